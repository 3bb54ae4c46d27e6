"""``[loop] train_tables``: the tables whose rows the learner trains, checked against the spec's tables."""

import dataclasses
from pathlib import Path

import pytest
import torch

from recserve.backends.dense.network import CTRNet
from recserve.commands.loop import table_names
from recserve.core.sections.base import SpecError
from recserve.core.spec.parse import parse_spec
from recserve.loop.learner import Learner
from recserve.perf.bench.loop.bench import LoopGrid, bench_specs
from tests.loop_examples import examples
from tests.store_tables import spec_store


def with_loop(spec, **loop):
    return parse_spec({**spec.source, "loop": {**spec.source.get("loop", {}), **loop}})


def test_every_table_is_trained_unless_the_spec_names_some(spec):
    assert spec.loop.train_tables == ()
    assert with_loop(spec, train_tables=["item", "C3"]).loop.train_tables == ("item", "C3")


def test_a_table_the_spec_does_not_have_is_refused_by_name(spec):
    named = r"\[loop\] train_tables names 'itme', not a table of the spec \(its tables: item, C1"
    with pytest.raises(SpecError, match=named):
        with_loop(spec, train_tables=["item", "itme"])
    with pytest.raises(SpecError, match="twice"):
        with_loop(spec, train_tables=["item", "item"])
    with pytest.raises(SpecError, match="train_tables"):
        dataclasses.replace(spec.loop, train_tables=("C99",)).check(spec.table_names)


def test_only_the_named_tables_rows_are_trained_and_published(spec):
    torch.manual_seed(0)
    tables, store = spec_store(spec)
    learn = Learner(with_loop(spec, train_tables=["item"]), store, CTRNet(spec), learning_rate=0.5)
    item = store.table_id("item")
    batch = examples(spec, tables, [1, 0, 1, 0])
    learn.train(batch)
    assert learn.touched and {table for table, _ in learn.touched} == {item}
    assert set(learn.rows) == learn.touched and set(learn.accumulators) == learn.touched
    published = []
    learn.publish(lambda table, keys, vectors: published.append(table) or 2)
    assert published == ["item"]
    everything = Learner(spec, store, CTRNet(spec), learning_rate=0.5)  # the spec's: all tables
    everything.train(batch)
    assert {table for table, _ in everything.touched} > {item}


def test_the_learners_tables_are_the_specs_unless_given(spec):
    _, store = spec_store(spec)
    named = with_loop(spec, train_tables=["C1", "item"])
    ids = sorted([store.table_id("C1"), store.table_id("item")])
    assert Learner(named, store, CTRNet(spec)).trained_tables.tolist() == ids
    assert Learner(named, store, CTRNet(spec), train_tables=()).trained_tables.tolist() == sorted(
        store.table_id(name) for name in spec.table_names
    )
    given = Learner(spec, store, CTRNet(spec), train_tables=("item",)).trained_tables
    assert given.tolist() == [store.table_id("item")]


def test_the_flag_reads_names_by_commas_and_an_empty_one_as_all():
    assert table_names("item, C3") == ("item", "C3")
    assert table_names("") == ()


def test_the_bench_trains_the_items_its_stream_drifts_unless_told_otherwise(spec):
    loop, frozen = bench_specs(spec, Path("bench"), LoopGrid(train_tables=("C3",)))
    assert loop.loop.train_tables == ("C3",) and frozen.loop.train_tables == ("C3",)
    assert bench_specs(spec, Path("bench"), LoopGrid())[0].loop.train_tables == (spec.targets[0].table,)
    assert bench_specs(spec, Path("bench"), LoopGrid(train_tables=()))[0].loop.train_tables == ()
