"""Synthetic long users: up to 4,096 events under the spec's click rule, their event log and their wire."""

import numpy as np

from recserve.backends.store.user_state.tokens import dedup
from recserve.build.synthetic_users import long_users
from recserve.core.names import USER_ID, USER_SEQ
from recserve.core.spec.parse import parse_spec
from tests.unit.helpers import ctr_spec_document


def _spec():
    doc = ctr_spec_document()
    doc["user_state"] = {"enabled": True}
    return parse_spec(doc)


def test_long_users_have_up_to_4096_events_and_the_click_rule_follows_the_whole_history():
    spec = _spec()
    made = long_users(spec, 800, seed=1)  # the rule shows by 0.2 at this size (5 sigma); 0.03 is asked
    lengths = made.rows.lengths
    assert lengths.max() <= 4096 and lengths.max() > 2048 and made.rows.history.shape[1] == 4096
    clusters = made.rows.history % 20
    target = made.rows.target % 20
    valid = np.arange(4096)[None, :] < lengths[:, None]
    share = ((clusters == target[:, None]) & valid).sum(1) / np.maximum(lengths, 1)
    keep = (lengths > 0) & (made.rows.target >= 0)
    high = share[keep] > np.median(share[keep])
    labels = made.rows.labels[keep]
    assert labels[high].mean() > labels[~high].mean() + 0.03  # the planted rule: cluster share raises clicks


def test_the_event_log_and_the_wire_tail_describe_the_same_users():
    spec = _spec()
    made = long_users(spec, 4, seed=2, max_events=300, mean_events=200)
    log = made.event_log(start_ts=100.0)
    for index, user in enumerate(made.users.tolist()):
        mine = log.users == user
        assert np.array_equal(log.items[mine], made.events(index))
        assert np.array_equal(log.seqs[mine], np.arange(1, mine.sum() + 1))
    wire = made.wire(spec)
    tail = spec.user_state.tail
    assert wire[USER_ID][:, 0].tolist() == made.users.tolist()
    assert wire[USER_SEQ][:, 0].tolist() == made.rows.lengths.tolist()
    length = wire[spec.attention_groups[0].length_input][:, 0]
    assert (length == np.minimum(made.rows.lengths, tail)).all()
    first = made.events(0)
    assert np.array_equal(wire[spec.sequences[0].name][0, : length[0]], first[-tail:])
    assert dedup(first).events == made.rows.lengths[0]
