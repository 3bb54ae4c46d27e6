"""What a restarted ``recserve learn`` keeps of the one before it: accumulators and rollback watches.

The rows themselves are the served ones (the update log has every publish), and what was trained
is ``learner.json``'s segment. Kept besides, each to an ``.npz`` of plain arrays (no pickle),
replaced atomically:

* each published row's Adagrad accumulator (:func:`save`): without them a restarted learner would
  take a new row's large first steps again on rows it had already slowed down. Written with each
  publish, as they stood for the rows published (not what was trained after);
* the dense optimizer's state as its last dense version was published (:func:`save_dense`),
  named with that version: taken back only when the newest served version is still that one;
* the publishes still watched (:func:`save_watches`): their versions, the rows they published and
  those they replaced (with their accumulators), so a version published just before a restart is
  still judged, and rolled back, after it; and the dense versions still watched
  (:func:`save_dense_watches`): their weights, those they replaced and the optimizer's state then.
  Not the examples they had scored: a restarted learner trains again on the examples after its
  last publish, and scores them again then.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recserve.core.files import write_atomically
from recserve.loop.dense import DenseTrainer, DenseWatch
from recserve.loop.learner import Learner
from recserve.loop.watch import Key, Watch


def save(learner: Learner, path: Path) -> None:
    """The accumulators of the rows as last published, to ``path`` (replaced whole)."""
    published = {**learner.restored, **learner.published_accumulators}
    keys = list(published)
    _write(
        path,
        {
            "tables": np.array([t for t, _ in keys], np.int16),
            "keys": np.array([k for _, k in keys], np.int64),
            "sums": np.array([published[k] for k in keys], np.float64),
        },
    )


def restore(learner: Learner, path: Path) -> int:
    """Give ``learner`` the accumulators saved at ``path`` (none there: nothing). Returns how many."""
    if not path.exists():
        return 0
    with np.load(path, allow_pickle=False) as saved:
        tables, keys, sums = saved["tables"], saved["keys"], saved["sums"]
        if not tables.shape == keys.shape == sums.shape:
            raise ValueError(f"{path}: the saved accumulators do not line up")
        restored = dict(zip(zip(tables.tolist(), keys.tolist(), strict=True), sums.tolist(), strict=True))
    learner.accumulators.update(restored)
    learner.restored.update(restored)
    return len(restored)


def _write(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``arrays`` as an ``.npz`` at ``path``, replaced whole (a reader never sees half of it)."""
    write_atomically(path, lambda handle: np.savez(handle, **arrays))


def _rows(prefix: str, rows: dict[Key, np.ndarray | None], width: int) -> dict[str, np.ndarray]:
    keys = list(rows)
    return {
        f"{prefix}tables": np.array([t for t, _ in keys], np.int16),
        f"{prefix}keys": np.array([k for _, k in keys], np.int64),
        f"{prefix}known": np.array([rows[k] is not None for k in keys], bool),  # False: the store's row
        f"{prefix}vectors": np.array(
            [np.zeros(width, np.float32) if rows[k] is None else rows[k] for k in keys], np.float32
        ).reshape(len(keys), width),
    }


def save_watches(learner: Learner, path: Path) -> None:
    """The publishes ``learner`` still watches, to ``path`` (replaced whole; none: an empty file)."""
    width = learner.store.dim
    arrays: dict[str, np.ndarray] = {"count": np.array(len(learner.watching), np.int64)}
    for i, watch in enumerate(learner.watching):
        arrays[f"w{i}_tables"] = np.array(list(watch.versions), np.str_)
        arrays[f"w{i}_versions"] = np.array(list(watch.versions.values()), np.int64)
        arrays[f"w{i}_share"] = np.array(watch.positive_share, np.float64)
        arrays.update(_rows(f"w{i}_rows_", dict(watch.rows), width))
        arrays.update(_rows(f"w{i}_replaced_", watch.previous, width))
        arrays[f"w{i}_replaced_sums"] = np.array(
            [0.0 if v is None else v[1] for v in watch.replaced.values()], np.float64
        )
    _write(path, arrays)


def _read_rows(saved: np.lib.npyio.NpzFile, prefix: str) -> list[tuple[Key, np.ndarray | None]]:
    tables, keys = saved[f"{prefix}tables"].tolist(), saved[f"{prefix}keys"].tolist()
    known, vectors = saved[f"{prefix}known"], saved[f"{prefix}vectors"]
    if not len(tables) == len(keys) == len(known) == len(vectors):
        raise ValueError(f"the saved {prefix} rows do not line up")
    return [
        ((t, k), vectors[i] if known[i] else None) for i, (t, k) in enumerate(zip(tables, keys, strict=True))
    ]


def restore_watches(learner: Learner, path: Path) -> int:
    """Give ``learner`` the watches saved at ``path`` (none there: nothing). Returns how many."""
    if not path.exists():
        return 0
    with np.load(path, allow_pickle=False) as saved:
        for i in range(int(saved["count"])):
            versions = dict(
                zip(saved[f"w{i}_tables"].tolist(), saved[f"w{i}_versions"].tolist(), strict=True)
            )
            rows = {key: row for key, row in _read_rows(saved, f"w{i}_rows_") if row is not None}
            sums = saved[f"w{i}_replaced_sums"].tolist()
            replaced = {
                key: None if row is None else (row, sum_)
                for (key, row), sum_ in zip(_read_rows(saved, f"w{i}_replaced_"), sums, strict=True)
            }
            learner.watching.append(Watch(versions, rows, replaced, float(saved[f"w{i}_share"])))
    return len(learner.watching)


def save_dense(dense: DenseTrainer, path: Path) -> None:
    """The dense optimizer's state as its served version was published, to ``path`` (safetensors)."""
    _save_tensors(path, _optimizer_tensors(dense.published[1], ""), {"version": str(dense.version)})


def _optimizer_tensors(optimizer_state: dict, prefix: str) -> dict[str, torch.Tensor]:
    """An Adagrad ``state_dict()``'s per-parameter tensors by ``<prefix><index>.<field>``."""
    return {f"{prefix}{i}.{name}": (value.reshape(-1) if name == "step" else value).contiguous()
            for i, entry in optimizer_state["state"].items() for name, value in entry.items()}  # fmt: skip


def _optimizer_state(saved: Any, prefix: str) -> dict[int, dict[str, torch.Tensor]]:
    """The per-parameter state :func:`_optimizer_tensors` wrote under ``prefix``."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name in saved.keys():  # noqa: SIM118 - a safetensors file, not a dict
        if name.startswith(prefix):
            index, field = name[len(prefix) :].split(".")
            value = saved.get_tensor(name)
            state.setdefault(int(index), {})[field] = value.reshape(()) if field == "step" else value
    return state


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda handle: handle.write(save(tensors, metadata)))


def save_dense_watches(dense: DenseTrainer, path: Path) -> None:
    """The dense versions still watched, to ``path`` (safetensors), for a restarted learner to judge.

    Each one's weights, those it replaced and the optimizer's state then.
    """
    tensors: dict[str, torch.Tensor] = {}
    heads = []
    for k, watch in enumerate(dense.watching):
        # copies: a watch's weights are the next watch's replaced ones, the same tensors, which
        # safetensors refuses to write twice
        tensors |= {f"{k}/weights/{name}": value.clone() for name, value in watch.weights.items()}
        tensors |= {f"{k}/replaced/{name}": value.clone() for name, value in watch.replaced[0].items()}
        tensors |= _optimizer_tensors(watch.replaced[1], f"{k}/optimizer/")
        heads.append({"version": watch.version, "positive_share": watch.positive_share})
    _save_tensors(path, tensors, {"watches": json.dumps(heads)})


def restore_dense_watches(dense: DenseTrainer, path: Path) -> int:
    """Give ``dense`` back the watches saved at ``path`` of the versions up to the one it serves; how many."""
    from safetensors import safe_open

    if not path.exists():
        return 0
    with safe_open(str(path), "pt") as saved:
        heads = json.loads((saved.metadata() or {}).get("watches", "[]"))
        names = list(saved.keys())  # noqa: SIM118 - a safetensors file, not a dict

        def weights(prefix: str) -> dict[str, torch.Tensor]:
            return {n[len(prefix) :]: saved.get_tensor(n) for n in names if n.startswith(prefix)}

        groups = dense.optimizer.state_dict()["param_groups"]
        for k, head in enumerate(heads):
            if head["version"] > dense.version:
                continue  # a version this restart does not serve
            replaced = (weights(f"{k}/replaced/"), {"state": _optimizer_state(saved, f"{k}/optimizer/"),
                                                    "param_groups": groups})  # fmt: skip
            watch = DenseWatch(head["version"], weights(f"{k}/weights/"), replaced, head["positive_share"])
            dense.watching.append(watch)
    return len(dense.watching)


def restore_dense(dense: DenseTrainer, path: Path) -> bool:
    """Give ``dense`` the optimizer's state saved at ``path`` if it was saved for its served version."""
    from safetensors import safe_open

    if not path.exists():
        return False
    with safe_open(str(path), "pt") as saved:
        if (saved.metadata() or {}).get("version") != str(dense.version):
            return False  # saved for another version (a publish after it never got its state written)
        state = _optimizer_state(saved, "")
    current = dense.optimizer.state_dict()
    if set(state) != set(current["state"]):
        raise ValueError(f"{path}: the saved optimizer state is not this network's")
    dense.optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
    dense.published = (dense.published[0], dense.optimizer_state())
    return True
