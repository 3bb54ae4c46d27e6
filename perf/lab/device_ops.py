"""How many torch operators, and how many host synchronisations, one batch costs on the device path.

A GPU step pays per launch and per synchronisation, not per row (docs/gpu-check.md). This counts
both without a GPU: the served steps' own objects run their device code under torch on the CPU
(``device="cpu"``, as CI runs it) inside two modes,

- a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that sees every ATen operator: each
  one that is not a view is an operator of the batch (a view launches nothing); ``nonzero``,
  ``masked_select``, ``item`` and ``_local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``),
  an index by a boolean mask, ``unique`` and a copy from a device to the host are host synchronisations;
- a :class:`~torch.overrides.TorchFunctionMode` that sees tensor methods which never reach the
  dispatcher on the CPU: ``.cpu()``, and ``.numpy()``, ``.tolist()`` and ``__array__`` of a tensor
  an operator made (a device tensor read into numpy) are host synchronisations too
  (``.cpu().numpy()`` counts once; the numpy view of a host staging buffer is none).

Measured on one user's candidate list in the id form (history 256) of 256 and of 4,096
candidates, as the ``candidates`` ensemble hands them to the steps: the lookup step's
:meth:`~recserve.backends.steps.lookup.FeaturesToEmbeddings.candidate_lists` (keys made on the
device, the tables resident there), then the dense step's
:meth:`~recserve.backends.dense.runner.DenseStep.score_lists` on the lookup's tensors. Each is
called once to warm up, then counted. ``recserve lab device-ops --json FILE`` prints and writes the
counts; ``tests/unit/test_device_ops.py`` holds the targets.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from recserve.core.candidate_lists import candidate_step_inputs
from recserve.core.gpu_batches import gpu_spec
from recserve.core.names import CANDIDATE_PREFIX
from recserve.core.spec.model import ModelSpec
from recserve.core.spec.parse import load_spec, parse_spec

#: the list sizes measured (candidates of one user) and the history length
SIZES = (256, 4096)
HISTORY = 256
#: ATen operators that wait for the device (their result's size or value is read on the host)
SYNC_OPERATORS = frozenset(
    {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim"}
)
#: tensor methods that read a tensor into host memory (on the CPU they never reach the dispatcher)
HOST_READS = frozenset({"cpu", "numpy", "tolist", "__array__"})
#: calls that place host data on a device when given one
PLACING = frozenset({"to", "cuda", "tensor", "as_tensor"})
#: operators whose result holds nothing computed (host data lifted, a fresh allocation)
FRESH = frozenset({"lift_fresh", "empty", "empty_strided"})
#: operators that change only a tensor's metadata (no kernel)
METADATA = frozenset({"detach", "detach_", "alias", "lift_fresh"})


@dataclass
class OperatorCount:
    """The operators (not views) and host synchronisations seen, by name."""

    operators: Counter[str] = field(default_factory=Counter)
    syncs: Counter[str] = field(default_factory=Counter)
    #: host arrays placed on the device (``.to(device)`` of a tensor no operator made,
    #: ``tensor(..., device=)``)
    uploads: Counter[str] = field(default_factory=Counter)
    #: the tensors operators made in this window (a ``.to(device)`` of one is no upload)
    made: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)

    @property
    def ops(self) -> int:
        """Operators that are not views."""
        return sum(self.operators.values())

    @property
    def sync_count(self) -> int:
        """Host synchronisations."""
        return sum(self.syncs.values())


def _boolean_index(args: tuple[Any, ...]) -> bool:
    """Whether an ``index``/``index_put`` call indexes by a boolean mask (a data-dependent shape)."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _moves_to_host(args: tuple[Any, ...], result: Any) -> bool:
    """Whether an operator's result lands in host memory from a tensor on a device."""
    on_device = any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)
    return on_device and isinstance(result, torch.Tensor) and result.device.type == "cpu"


def _copies(args: tuple[Any, ...], result: Any) -> bool:
    """Whether a view operator (``to``, ``reshape``, ``contiguous``: views when they can) made a copy."""
    source = args[0] if args else None
    if not (isinstance(source, torch.Tensor) and isinstance(result, torch.Tensor)):
        return False
    return result.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()


class _Dispatched(TorchDispatchMode):
    """Counts ATen operators and the synchronising ones."""

    def __init__(self, count: OperatorCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor) and name not in FRESH:
            self.count.made[result] = True
        if name not in METADATA and (not func.is_view or _copies(args, result)):
            self.count.operators[name] += 1
        if name in SYNC_OPERATORS:
            self.count.syncs[name] += 1
        elif name in {"index", "index_put", "index_put_"} and _boolean_index(args):
            self.count.syncs["boolean index"] += 1
        elif _moves_to_host(args, result):
            self.count.syncs["device to host"] += 1
        return result


def _places(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether a ``to``/``tensor``/``as_tensor`` call names a device."""
    named = kwargs.get("device") is not None
    return named or any(isinstance(a, (str, torch.device)) for a in args[1:])


class _Methods(TorchFunctionMode):
    """Counts tensor methods that read a tensor into host memory (``.cpu().numpy()`` once)."""

    def __init__(self, count: OperatorCount) -> None:
        super().__init__()
        self.count = count
        self.read: set[int] = set()  # ids of the tensors ``.cpu()`` made in this window

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in PLACING and _places(args, kwargs) and not (args and args[0] in self.count.made):
            self.count.uploads[name] += 1
        host_buffer = name != "cpu" and bool(args) and args[0] not in self.count.made
        if name in HOST_READS and not host_buffer:  # a host buffer's numpy view reads no device
            if args and id(args[0]) in self.read:  # ``.cpu().numpy()``: one read
                self.read.discard(id(args[0]))
            else:
                self.count.syncs[f".{name}()"] += 1
                if name == "cpu":
                    self.read.add(id(result))
        return result


def count_operators(call: Callable[[], Any]) -> tuple[OperatorCount, Any]:
    """The operators and host synchronisations of one ``call()``, and its result."""
    count = OperatorCount()
    with _Methods(count), _Dispatched(count):
        result = call()
    return count, result


def served_spec(spec: ModelSpec, rows: int) -> ModelSpec:
    """``spec`` as the GPU profiles serve it, taking one list of at least ``rows`` candidates."""
    if spec.serving.gpu_max_batch_size < rows:
        doc = json.loads(json.dumps(spec.source))
        doc.setdefault("serving", {})["gpu_max_batch_size"] = max(rows, spec.model.max_batch_size)
        spec = parse_spec(doc)
    return gpu_spec(spec)


def one_list(spec: ModelSpec, candidates: int, history: int) -> dict[str, np.ndarray]:
    """One user's list of ``candidates`` in the id form, named as the candidates ensemble names them."""
    from recserve.perf.bench.candidates import LIST, requests_of

    made = requests_of(spec, candidates, history, seed=11)[LIST]
    step_names = {t.name for t in candidate_step_inputs(spec)}
    return {
        CANDIDATE_PREFIX + name if CANDIDATE_PREFIX + name in step_names else name: array
        for name, array in made.items()
    }


class DeviceSteps:
    """The lookup and dense steps as a ``cuda`` instance holds them, on ``device``, with synthetic tables.

    Every table resident on the device (a few rows each, keys of ids 0..63), no L3; the dense
    network with seeded random weights, its candidate lists scored on the device at a bucket's
    static shape (a CUDA graph per bucket on CUDA, the same forward eagerly on the CPU).
    """

    def __init__(self, spec: ModelSpec, device: str = "cpu") -> None:
        from recserve.backends.dense.buckets import spec_buckets
        from recserve.backends.dense.list_graphs import list_scorer
        from recserve.backends.dense.network import CTRNet
        from recserve.backends.dense.runner import DenseStep
        from recserve.backends.dense.torch_runners import TorchEager, bucketed_torch_runner
        from recserve.backends.steps.lookup import EmbeddingLookup, FeaturesToEmbeddings
        from recserve.backends.store.device.tier import device_lookup

        self.spec = spec
        store = synthetic_store(spec)
        on_device = device_lookup(store, device, 1 << 30)
        lookup = EmbeddingLookup(spec, store, on_device)
        lookup.takes_device_keys = True
        self.lookup = FeaturesToEmbeddings(spec, lookup)
        torch.manual_seed(0)
        net = CTRNet(spec).eval()
        copies = self.lookup.copies
        runner = bucketed_torch_runner(spec, net, device, prepare=spec_buckets(spec)[:1], background=False)
        scorer = list_scorer(spec, TorchEager(net, device, copies=copies))  # the served step's
        self.dense = DenseStep(spec, runner, copies=copies, scorer=scorer)

    def looked_up(self, request: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
        """The lookup step's outputs of one candidate list."""
        return self.lookup.candidate_lists([request])

    def scored(self, looked_up: list[dict[str, Any]]) -> list[np.ndarray]:
        """The dense step's probabilities of the lookup's lists (its inputs, as the ensemble maps them)."""
        names = set(self.dense.lists.input_names)
        return self.dense.score_lists([{n: v for n, v in out.items() if n in names} for out in looked_up])

    def close(self) -> None:
        """Stop the dense runner's compiles."""
        self.dense.close()


def synthetic_store(spec: ModelSpec, rows: int = 64) -> Any:
    """A store of ``rows`` rows per table of ``spec``: the keys of ids 0..rows-1 of the table's features."""
    from recserve.backends.features.hashing import keys_for, table_salt
    from recserve.backends.store.table_data import TableArrays
    from recserve.backends.store.tiered import TieredStore

    rng = np.random.default_rng(7)
    tables = {}
    for name in spec.table_names:
        dim = spec.tables[name].dim
        keys = keys_for(np.arange(rows, dtype=np.uint64), table_salt(spec.hashing.namespace, name))
        vectors = rng.normal(size=(rows, dim)).astype(np.float32)
        tables[name] = TableArrays(name, keys.view(np.int64), vectors, np.zeros(dim, np.float32))
    return TieredStore.from_tables(tables)


def measure(spec: ModelSpec, device: str = "cpu", sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """Operators and host synchronisations per batch of the lookup and dense steps' device paths.

    Keys ``lookup_ops_<n>``, ``dense_ops_<n>`` per list size ``n``, ``*_uploads_<n>`` (host arrays
    placed on the device); ``lookup_syncs`` and
    ``dense_syncs`` (the most over the sizes); ``*_sync_kinds`` and ``*_operators`` (by name, the
    largest size) say which.
    """
    served = served_spec(spec, max(sizes))
    steps = DeviceSteps(served, device)
    report: dict[str, Any] = {"spec": spec.name, "device": device, "history": HISTORY}
    try:
        for size in sizes:
            request = one_list(served, size, HISTORY)
            steps.scored(steps.looked_up(request))  # warm-up: lazy device copies, version caches
            lookup, outputs = count_operators(functools.partial(steps.looked_up, request))
            dense, _ = count_operators(functools.partial(steps.scored, outputs))
            for step, count in (("lookup", lookup), ("dense", dense)):
                report[f"{step}_ops_{size}"] = count.ops
                report[f"{step}_syncs"] = max(report.get(f"{step}_syncs", 0), count.sync_count)
                report[f"{step}_uploads_{size}"] = sum(count.uploads.values())
                report[f"{step}_sync_kinds"] = dict(count.syncs)
                report[f"{step}_operators"] = dict(count.operators.most_common())
    finally:
        steps.close()
    return report


def run_from_args(args: argparse.Namespace) -> int:
    """Measure, print the counts, write ``--json``."""
    report = measure(load_spec(args.spec), args.device)
    keys = [k for k in report if k.endswith(("_256", "_4096", "_syncs"))]
    for key in keys:
        print(f"{key:>16} {report[key]}")
    for step in ("lookup", "dense"):
        print(f"{step} syncs by kind: {report[f'{step}_sync_kinds'] or 'none'}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
