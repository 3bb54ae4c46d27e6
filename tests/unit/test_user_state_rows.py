"""Rows that are users' real-time tails: their user and user_seq columns, read, written and sent."""

import io

import numpy as np
import pytest

from recserve.build.synthetic_users import long_users
from recserve.clients.base import ClientBase
from recserve.clients.errors import InvalidRequestError
from recserve.clients.rows import RowFormatError, read_rows
from recserve.clients.writers import write_csv, write_tsv
from recserve.core.names import BYTES_WIRE, IDS_WIRE, USER_ID, USER_SEQ
from recserve.core.spec.parse import parse_spec
from recserve.core.user_state_wire import user_key
from tests.unit.helpers import ctr_spec_document


def _spec(user_state=True, **inputs):
    doc = ctr_spec_document()
    doc["user_state"] = {"enabled": user_state}
    doc["inputs"] = {**doc.get("inputs", {}), **inputs}
    return parse_spec(doc)


def _tails(spec, users=5):
    made = long_users(spec, users, seed=3, max_events=300, mean_events=150)
    rows = made.tail_rows(spec.user_state.tail).with_user_state(spec, made.users + 40, made.rows.lengths)
    return made, rows


@pytest.mark.parametrize("writer", [write_csv, write_tsv])
def test_written_tails_read_back_with_their_users_and_sequence_numbers(tmp_path, writer):
    spec = _spec()
    made, rows = _tails(spec)
    path = writer(tmp_path / "rows.txt", rows, spec)
    header = path.read_text().splitlines()[0].split("," if writer is write_csv else "\t")
    assert header[-2:] == [USER_ID, USER_SEQ]  # a TSV of tails gets a header naming them
    read = read_rows(path, spec)
    assert read.users.tolist() == (made.users + 40).tolist()
    assert read.user_seqs.tolist() == made.rows.lengths.tolist()
    for form in (IDS_WIRE, BYTES_WIRE):
        inputs = read.to_inputs(spec, form)
        assert inputs[USER_ID].shape == (5, 1) and inputs[USER_ID].dtype == np.int64
        assert inputs[USER_SEQ][:, 0].tolist() == made.rows.lengths.tolist()
    assert read.take(np.array([3, 1])).users.tolist() == [made.users[3] + 40, made.users[1] + 40]


def test_without_user_state_the_columns_are_neither_written_nor_sent(tmp_path):
    spec = _spec(user_state=False)
    _, rows = _tails(_spec())
    assert USER_ID not in rows.to_inputs(spec) and not rows.user_state_wire(spec)
    text = write_csv(tmp_path / "rows.csv", rows, spec).read_text()
    assert USER_SEQ not in text.splitlines()[0]


def test_the_user_column_of_inputs_user_is_the_state_key(tmp_path):
    spec = _spec(user="C3")
    _, rows = _tails(spec)
    column = spec.categorical.columns.index("C3")
    assert [int(v) for v in rows.categorical[:, column]] == rows.users.tolist()
    path = write_csv(tmp_path / "rows.csv", rows, spec)
    assert USER_ID not in path.read_text().splitlines()[0]  # C3 is the user column
    assert read_rows(path, spec).users.tolist() == rows.users.tolist()


def test_bad_user_state_fields_name_their_line_and_column():
    spec = _spec()
    _, rows = _tails(spec, users=3)
    text = _csv_text(rows, spec)
    lines = text.splitlines()
    lines[2] = lines[2].rsplit(",", 1)[0] + ",1"  # row 2's user_seq below its history's length
    with pytest.raises(RowFormatError, match=r"line 3.*user_seq|user_seq.*line 3"):
        read_rows(io.StringIO("\n".join(lines) + "\n"), spec)
    lines = text.splitlines()
    lines[1] = lines[1].rsplit(",", 2)[0] + ",99999999999999999999," + lines[1].rsplit(",", 1)[1]
    with pytest.raises(RowFormatError, match=r"line 2.*user_id.*beyond int64|beyond int64.*line 2"):
        read_rows(io.StringIO("\n".join(lines) + "\n"), spec)
    lines[1] = lines[1].rsplit(",", 2)[0] + ", u-17 ," + lines[1].rsplit(",", 1)[1]
    assert read_rows(io.StringIO("\n".join(lines) + "\n"), spec).users[0] == user_key("u-17")  # a string id
    header = text.splitlines()[0].split(",")
    without_user = [",".join(f for f, h in zip(line.split(","), header, strict=True) if h != USER_ID)
                    for line in text.splitlines()]  # fmt: skip
    with pytest.raises(RowFormatError, match="needs the user's column"):
        read_rows(io.StringIO("\n".join(without_user) + "\n"), spec)


def _csv_text(rows, spec):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        return write_csv(Path(folder) / "rows.csv", rows, spec).read_text()


def test_the_client_sends_user_id_and_user_seq_together_or_not_at_all():
    spec = _spec()
    _, rows = _tails(spec, users=4)
    client = ClientBase(None, "grpc", 1.0, spec, None)
    for form in (IDS_WIRE, BYTES_WIRE):
        prepared = client._prepare(rows.to_inputs(spec, form))
        assert prepared[USER_ID][:, 0].tolist() == rows.users.tolist()
        assert prepared[USER_SEQ].shape == (4, 1)
    inputs = rows.to_inputs(spec)
    with pytest.raises(InvalidRequestError, match="go together"):
        client._prepare({k: v for k, v in inputs.items() if k != USER_SEQ})
    with pytest.raises(InvalidRequestError, match="batch size"):
        client._prepare({**inputs, USER_ID: inputs[USER_ID][:2]})
    plain = ClientBase(None, "grpc", 1.0, _spec(user_state=False), None)
    with pytest.raises(InvalidRequestError, match="unknown inputs"):
        plain._prepare(inputs)
