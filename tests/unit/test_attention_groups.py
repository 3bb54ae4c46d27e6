"""Several behaviour sequences, each with positions of its own: one attention group each."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import tomllib
import torch

from recserve.backends.dense.network import CTRNet
from recserve.backends.features.transform import FeatureTransform
from recserve.build.export import example_inputs
from recserve.build.synthetic import generate
from recserve.clients.rows import read_rows
from recserve.clients.writers import write_csv
from recserve.core.contract import dense_contract, dense_net_inputs
from recserve.core.names import HISTORY_KEYS, HISTORY_MASK
from recserve.core.sections.base import SpecError
from recserve.core.spec.parse import load_spec, parse_spec, spec_path

CART = ("target_embedding__cart_item_ids", "history_embeddings__cart_item_ids", "history_mask__cart_item_ids")


def test_each_group_has_its_length_its_contract_tensors_and_a_target_may_attend_several():
    taobao = load_spec("taobao")
    groups = taobao.attention_groups
    assert [[s.name for s in g.sequences] for g in groups] == [
        ["hist_item_ids", "hist_cate_ids"],
        ["cart_item_ids", "cart_cate_ids"],
    ]
    assert [g.length_input for g in groups] == ["hist_item_ids__length", "cart_item_ids__length"]
    names = [t.name for t in taobao.wire_inputs()]
    assert names.count("item_id") == 1 and {"hist_item_ids__length", "cart_item_ids__length"} <= set(names)
    contract = {t.name: t for t in dense_contract(taobao)[0]}
    assert dense_net_inputs(taobao)[-3:] == CART
    assert contract[CART[1]].shape == (-1, -1, 16) and "on the left" in contract[CART[1]].holds
    assert "cart_item_ids + cart_cate_ids" in contract[CART[1]].holds
    assert set(taobao.user_inputs()) >= {t for t in taobao.wire_inputs() if t.name.startswith("cart_")}


def _doc() -> dict:
    return tomllib.loads(spec_path("taobao").read_text())


def _feature(doc: dict, name: str) -> dict:
    return next(f for f in doc["features"] if f["name"] == name)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: _feature(d, "item_id").__setitem__("attends", "hist_item_ids"), "'cart_item_ids' needs"),
        (lambda d: _feature(d, "cart_item_ids").pop("max_length"), "'cart_item_ids' needs max_length >= 1"),
        (lambda d: _feature(d, "cart_item_ids").__setitem__("max_length", 65), "longest max_length 65"),
        (lambda d: _feature(d, "cart_cate_ids").__setitem__("padding", "right"), "its padding is 'left'"),
    ],
)
def test_a_group_without_its_target_or_its_length_is_refused(edit, message):
    doc = _doc()
    edit(doc)
    with pytest.raises(SpecError, match=message):
        parse_spec(doc)


def test_every_group_is_padded_to_the_bucket_of_the_longest_history_of_any_group():
    taobao = load_spec("taobao")
    raw = generate(taobao, 6, seed=4)
    raw.lengths[:] = [0, 1, 2, 40, 3, 0]  # the clicks reach the 64 bucket, the cart stays short
    raw.side["cart_item_ids__length"][:] = [0, 1, 16, 2, 0, 0]
    out = FeatureTransform(taobao).transform(raw.to_wire(taobao))
    assert out[HISTORY_KEYS].shape == (6, 4 * 64)
    np.testing.assert_array_equal(out[HISTORY_MASK].sum(1), [0, 1, 2, 40, 3, 0])
    cart = out[CART[2]]
    np.testing.assert_array_equal(cart.sum(1), [0, 1, 16, 2, 0, 0])
    assert cart[2, -16:].all() and not cart[2, :-16].any()  # the cart on the left


def test_the_built_in_network_attends_over_each_group_and_ignores_its_padding():
    taobao = load_spec("taobao")
    torch.manual_seed(0)
    net = CTRNet(taobao).eval()
    assert len(net.further) == 1
    inputs = example_inputs(taobao, 5, 8, seed=2)
    inputs[CART[2]][:] = 0.0
    inputs[CART[2]][:, :3] = 1.0

    def score(named):
        with torch.no_grad():
            return net(*(torch.from_numpy(named[n]) for n in net.input_names)).numpy()

    base = score(inputs)
    padded = {**inputs, CART[1]: inputs[CART[1]].copy()}
    padded[CART[1]][:, 3:] += 5.0  # the cart's padding positions
    np.testing.assert_allclose(score(padded), base, atol=1e-6)
    moved = {**inputs, CART[1]: inputs[CART[1]].copy()}
    moved[CART[1]][:, :3] += 0.5  # the cart's real positions
    assert np.abs(score(moved) - base).max() > 1e-4


def test_a_sequences_separator_is_how_files_write_and_read_its_ids(tmp_path):
    doc = _doc()
    _feature(doc, "hist_item_ids")["separator"] = "^"
    _feature(doc, "cart_item_ids")["separator"] = "|"
    spec = parse_spec(doc)
    raw = generate(spec, 40, seed=6)
    path = write_csv(tmp_path / "rows.csv", raw, spec)
    with open(path, newline="") as fh:
        table = list(csv.DictReader(fh))
    many = next(r for r in table if len(r["hist_item_ids"].split("^")) > 2)
    assert " " not in many["hist_item_ids"] and "^" not in many["hist_cate_ids"]
    assert any("|" in r["cart_item_ids"] for r in table)
    back = read_rows(path, spec).to_inputs(spec)
    sent = raw.to_wire(spec)
    for name in ("hist_item_ids", "hist_cate_ids", "cart_item_ids", "hist_item_ids__length"):
        np.testing.assert_array_equal(back[name], sent[name], err_msg=name)
    _feature(doc, "hist_item_ids")["separator"] = "-"
    with pytest.raises(SpecError, match="separator '-' may not hold digits"):
        parse_spec(doc)
