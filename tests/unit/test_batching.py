import numpy as np

from recserve.backends.base.batching import groups_within, merge, split


def test_merge_pads_ragged_tensors_and_split_restores_each_request():
    a = {"keys": np.ones((2, 3), np.int64), "dense": np.zeros((2, 4), np.float32)}
    b = {"keys": np.full((1, 8), 2, np.int64), "dense": np.ones((1, 4), np.float32)}
    merged, sizes = merge([a, b])
    assert sizes == [2, 1]
    assert merged["keys"].shape == (3, 8)
    assert merged["keys"][:2, 3:].sum() == 0
    parts = split({"out": merged["keys"] * 10, "dense": merged["dense"]}, sizes, {"out": [3, 8]})
    assert parts[0]["out"].shape == (2, 3) and parts[1]["out"].shape == (1, 8)
    assert (parts[1]["out"] == 20).all() and (parts[0]["dense"] == 0).all()


def test_single_request_passes_through_unchanged():
    a = {"x": np.arange(6).reshape(3, 2)}
    merged, sizes = merge([a])
    assert merged["x"] is a["x"] and sizes == [3]


def test_bytes_tensors_are_padded_with_empty_elements_the_padding_of_a_multi_hot_list():
    a = {"tags": np.array([[b"x", b"y"]], dtype=object)}
    b = {"tags": np.array([[b"z"]], dtype=object)}
    merged, _ = merge([a, b])
    assert merged["tags"].tolist() == [[b"x", b"y"], [b"z", b""]]


def test_requests_join_while_their_rows_stay_within_the_batch_limit():
    assert groups_within([3, 4, 2, 9, 1], 9) == [[0, 1, 2], [3], [4]]
    assert groups_within([12, 1], 9) == [[0], [1]]  # one over the limit is a group of its own
    assert groups_within([], 9) == []


def test_tensors_on_the_host_and_on_a_device_join_on_the_device():
    import torch

    # Triton places a GPU step's input in host memory when its CUDA pool is full: such a request
    # joins the others on their device ("meta" stands in for the GPU on a machine without one)
    on_device = {"x": torch.ones((2, 3), device="meta")}
    on_host = {"x": torch.ones((1, 5))}
    for batch in ([on_host, on_device], [on_device, on_host]):
        merged, sizes = merge(batch)
        assert sizes == [len(b["x"]) for b in batch]
        assert merged["x"].device.type == "meta" and tuple(merged["x"].shape) == (3, 5)
    merged, _ = merge([on_host, {"x": torch.zeros((1, 5))}])
    assert merged["x"].device.type == "cpu" and merged["x"].sum() == 5


def test_the_versions_made_once_for_a_merged_batch_go_whole_to_every_request():
    merged, sizes = merge([{"x": np.zeros((3, 2))}, {"x": np.ones((5, 2))}])
    versions = np.array([[4, 7]], np.int64)  # one row for the batch, not one per row
    parts = split({"probability": np.arange(8.0)[:, None], "embedding_version": versions}, sizes)
    assert [p["probability"].shape for p in parts] == [(3, 1), (5, 1)]
    assert all(p["embedding_version"] is versions for p in parts)


def test_ragged_parts_are_padded_on_their_side_in_one_array():
    a = {"h": np.ones((2, 2, 3), np.float32)}
    b = {"h": np.full((1, 4, 3), 2, np.float32)}
    right, _ = merge([a, b])
    left, _ = merge([a, b], left={"h"})
    assert right["h"].shape == left["h"].shape == (3, 4, 3)
    assert (right["h"][:2, :2] == 1).all() and (right["h"][:2, 2:] == 0).all() and (right["h"][2] == 2).all()
    assert (left["h"][:2, 2:] == 1).all() and (left["h"][:2, :2] == 0).all() and (left["h"][2] == 2).all()
