"""The access layer's value door: the Lua Envoy runs, in LuaJIT in process, against the first step's rule.

The door sets lambda from the arrivals it sees as the first step's controller does from its own
(``DegradeController.arrived``), and refuses what the controller would refuse at that lambda; a
request it lets through carries the lambda, which the step serves it at, at least.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from recserve.access import value_door
from recserve.access.front_door import FrontDoor
from recserve.access.value_door import ValueDoor
from recserve.backends.steps.degrade_control import DegradeController
from recserve.core.degrade_capacity import FILE_NAME
from recserve.core.names import EMBEDDING_LOOKUP
from recserve.core.sections.degrade import LAMBDA_HEADER, REFUSED_HEADER, VALUE_HEADER
from recserve.core.spec.parse import parse_spec
from recserve.errors import InvalidParameter
from tests.unit.helpers import ctr_spec_document
from tests.unit.lua_door import door_script

luajit = pytest.importorskip("lupa.luajit21")

#: costs that add up exactly, so that the door's sums and numpy's agree to the last bit
DEGRADE = {
    "enabled": True,
    "tiers": {"low": 0.25, "standard": 1.0},
    "default": "standard",
    "levels": [
        {"name": "trimmed", "cost": 0.75, "quality": 0.97, "max_candidates": 32, "history_length": 32},
        {"name": "minimal", "cost": 0.5, "quality": 0.9, "max_candidates": 8, "history_length": 8},
    ],
    "full_value": 3.5,
    "max_lambda": 4.0,
    "capacity": 400.0,
}


def spec(**changes):
    return parse_spec({**ctr_spec_document(), "degrade": {**DEGRADE, **changes}})


def door_runner(value_door: ValueDoor | None):
    run = door_script(luajit, FrontDoor(value_door=value_door))

    def send(value: str | None, now_ms: float, extra: dict[str, str] | None = None):
        """(refusal message, lambda header) of one inference call at ``now_ms``; ``send.reported``: the
        refusals it reports."""
        headers = {**({VALUE_HEADER: value} if value is not None else {}), **(extra or {})}
        status, body, logged, after = run(b'{"inputs": []}', "/v2/models/m/infer", headers, now_ms)
        assert logged is None, logged
        lam = after.get(LAMBDA_HEADER)
        send.reported = after.get(REFUSED_HEADER)
        if status is not None:
            assert int(status) == 503, body
            return json.loads(body)["error"], lam
        return None, lam

    return send


def test_the_door_sets_lambda_and_refuses_as_the_first_step_would():
    served = spec()
    section = served.degrade
    send = door_runner(ValueDoor(section, section.capacity))
    controller = DegradeController(section)
    rng = np.random.default_rng(3)
    now, refused, raised = 1000.0, 0, 0
    for rate in (200, 1600, 200, 3200, 200):  # arrivals per second: normal, 2x and 4x the budget's
        for _ in range(rate // 5):  # 0.2 s
            now += rng.exponential(1000.0 / rate)
            value = float(rng.lognormal(0.0, 1.0))
            message, lam = send(repr(value), now)
            floor = controller.arrived(now / 1000.0, [value])
            level = controller.levels([value], [floor])[0]
            assert (message is not None) == (level == controller.refused_level), (value, floor, message)
            if message is None:
                assert lam is None if floor == 0 else float(lam) == floor
            refused += message is not None
            raised += floor > 0
    assert refused > 100 and raised > 300  # the spikes were held, the normal phases were not


def test_a_callers_lambda_never_passes_and_a_value_the_door_cannot_read_is_left_to_the_step():
    send = door_runner(None)
    forged = {LAMBDA_HEADER: "1e9", REFUSED_HEADER: "low:1000"}
    assert send("1.0", 0.0, forged) == (None, None) and send.reported is None  # no door: removed all the same
    section = spec().degrade
    send = door_runner(ValueDoor(section, 1.0))  # a budget of a twentieth of a request per window
    assert send("premium?", 0.0) == (None, None)  # neither a tier nor a number: the step names it
    message, _ = send("low", 1.0, {LAMBDA_HEADER: "0"})
    assert message is not None and "refused under load at the access layer" in message
    assert send("100", 2.0) == (None, "4")  # over full_value: in full, whatever the lambda
    assert send.reported == "low:1"  # the refusal since the last request let through, reported with it
    message, lam = send("3", 3.0)  # worth more than minimal costs at the ceiling: degraded, not refused
    assert message is None and float(lam) == section.max_lambda and send.reported is None
    assert send(None, 4.0)[0] is not None and send("0.1", 5.0)[0] is not None  # refused: 1.0, 0.1
    assert send("3", 6.0, forged)[0] is None and sorted(send.reported.split(",")) == ["default:1", "number:1"]
    assert send("3", 7.0)[0] is None and send.reported is None


def test_refusals_past_what_one_report_may_carry_go_with_the_next_requests(monkeypatch):
    monkeypatch.setattr(value_door, "MAX_REPORTED", 2)  # the step reads at most 1e6 a tier
    section = spec().degrade
    send = door_runner(ValueDoor(section, 1.0))
    assert all(send("low", float(t))[0] is not None for t in range(5))
    reports = []
    for t in range(5, 9):
        assert send("100", float(t))[0] is None  # over full_value: let through, with what is left
        reports.append(send.reported)
    assert reports == ["low:2", "low:2", "low:1", None]
    assert [section.door_counts(r) for r in reports[:3]] == [{"low": 2}, {"low": 2}, {"low": 1}]


def test_the_first_step_serves_at_the_doors_lambda_at_least():
    section = spec().degrade
    controller = DegradeController(section)
    values = [0.5, 0.5, 0.5]
    assert controller.levels(values) == [0, 0, 0]
    assert controller.levels(values, [0.0, 0.6, 4.0]) == [0, 2, 3]  # full, minimal, refused
    assert section.lambda_of(None) == 0.0 and section.lambda_of("1e9") == section.max_lambda
    for bad in ("nan", "-1", "inf", "x" * 300):
        with pytest.raises(InvalidParameter, match=LAMBDA_HEADER):
            section.lambda_of(bad)
    assert section.door_counts("low:2,number:1") == {"low": 2, "number": 1}
    assert section.door_counts(None) == {}
    malformed = ("premium:1", "low:0", "low:-1", "low:x", "low", "low:" + "9" * 40, "low:1," * 5, "low:1,")
    # counts past the bound behind leading zeros, and digits that are not ASCII's
    past = ("low:0000000100000000", "low:1" + "0" * 60, "low:1000001", "low:²", "low:١", "low: 1")
    for bad in (*malformed, *past):
        with pytest.raises(InvalidParameter, match=REFUSED_HEADER):
            section.door_counts(bad)


def kept(repository, capacity) -> None:
    """The capacity ``repository``'s first step keeps (a number, or any text as it is)."""
    (repository / EMBEDDING_LOOKUP).mkdir(parents=True, exist_ok=True)
    text = json.dumps({"capacity_per_s": capacity}) if not isinstance(capacity, str) else capacity
    (repository / EMBEDDING_LOOKUP / FILE_NAME).write_text(text)


def test_the_door_stands_where_degrade_chooses_and_reads_the_kept_capacities(tmp_path):
    off = parse_spec({**spec().source, "degrade": {**DEGRADE, "enabled": False}})
    assert ValueDoor.in_front_of(off, [tmp_path], 1) is None
    assert ValueDoor.in_front_of(spec(fixed_lambda=0.1), [tmp_path], 1) is None  # a drill: the step holds it
    door = ValueDoor.in_front_of(spec(), [tmp_path, tmp_path], 2)
    assert door is not None and door.capacity_per_s == 800.0
    table = luajit.LuaRuntime().eval(door.lua_table())  # what one worker's window may cost: its share
    assert table.headroom * table.capacity / table.workers * table.window_s == 0.9 * 400.0 * 0.05
    assert door.kept == ()  # set in the spec: nothing to read
    learned = spec(capacity=0.0)
    door = ValueDoor.in_front_of(learned, [tmp_path], 1)
    assert door is not None and door.capacity_per_s == 0.0  # nothing kept yet: the door waits for it
    assert door.kept == (str((tmp_path / EMBEDDING_LOOKUP / FILE_NAME).resolve()),)
    kept(tmp_path, 250.0)
    assert ValueDoor.in_front_of(learned, [tmp_path], 1).capacity_per_s == 250.0


def test_the_door_follows_the_capacities_the_servers_keep_while_the_proxy_runs(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    send = door_runner(ValueDoor.in_front_of(spec(capacity=0.0), [first, second], 1))
    now = [0.0]

    def spike() -> int:
        """Refusals among 100 low-value arrivals 0.5 ms apart, a second after the last spike."""
        now[0] += 1000.0
        refused = 0
        for _ in range(100):
            now[0] += 0.5
            refused += send("low", now[0])[0] is not None
        return refused

    assert spike() == 0  # no capacity kept: everything goes on, the first step decides
    kept(first, 1.0)
    assert spike() == 0  # one server of two: still not known
    kept(second, 1.0)
    assert spike() > 90  # 2 requests/s of capacity: the spike is refused
    kept(first, "not json")
    assert spike() > 90  # a damaged file: the last capacity stands
    kept(first, 1e9)  # out of range: as damaged
    assert spike() > 90
    kept(first, 5e6)
    kept(second, 5e6)
    assert spike() == 0  # the capacity grew: the spike fits
