import gzip
import io
import re

import numpy as np
import pytest

from recserve.build.synthetic import generate
from recserve.clients.rows import RowFormatError, Rows, read_rows
from recserve.clients.writers import write_csv, write_tsv
from recserve.core.spec.parse import load_spec
from recserve.core.spec.types import NUMPY_DTYPES
from recserve.core.values import parse_hex


def _tsv_line(label=None, dense=None, cats=None, extras=None) -> str:
    dense = dense if dense is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{i:08x}" for i in range(26)]
    head = [label] if label is not None else []
    fields = head + dense + cats + (list(extras) if extras is not None else [])
    return "\t".join(fields) + "\n"


def _csv_text(spec, rows: list[dict[str, str]], columns: list[str]) -> str:
    lines = [",".join(columns)]
    for row in rows:
        lines.append(",".join(row.get(c, "") for c in columns))
    return "\n".join(lines) + "\n"


def _full_row(**overrides: str) -> dict[str, str]:
    row = {f"I{i}": str(i) for i in range(1, 14)}
    row.update({f"C{i}": f"{i:08x}" for i in range(1, 27)})
    row.update(overrides)
    return row


def _assert_matches_wire(rows: Rows, raw, spec) -> None:
    got, expected = rows.to_inputs(spec), raw.to_wire(spec)
    # The server ignores dense values flagged missing; files carry them as empty fields (read as 0).
    expected[spec.dense.name] = np.where(raw.dense_missing, 0.0, raw.dense).astype(np.float32)
    assert list(got) == [w.name for w in spec.wire_inputs()]
    for name, array in expected.items():
        assert got[name].dtype == array.dtype, name
        assert got[name].shape == array.shape, name
        np.testing.assert_array_equal(got[name], array, err_msg=name)


# ---- TSV ---------------------------------------------------------------------------------------


def test_tsv_with_label_without_extras(spec):
    text = _tsv_line("1") + _tsv_line("0", dense=["", "-2"] + ["7"] * 11, cats=[""] + ["abc"] * 25)
    rows = read_rows(io.StringIO(text), spec)
    assert len(rows) == 2
    np.testing.assert_array_equal(rows.labels, np.array([1, 0], dtype=np.float32))
    assert rows.dense.dtype == np.float32 and rows.dense.shape == (2, 13)
    np.testing.assert_array_equal(rows.dense[0], np.arange(13, dtype=np.float32))
    assert rows.dense_missing[1, 0] and not rows.dense_missing[1, 1:].any()
    assert rows.dense[1, 0] == 0.0 and rows.dense[1, 1] == -2.0
    assert rows.categorical[1, 0] == b"" and rows.categorical[1, 1] == b"abc"
    assert rows.categorical[0, 5] == b"00000005"
    np.testing.assert_array_equal(rows.target, [-1, -1])
    np.testing.assert_array_equal(rows.lengths, [0, 0])


def test_tsv_without_label_without_extras(spec):
    rows = read_rows(io.StringIO(_tsv_line() * 3), spec)
    assert len(rows) == 3 and rows.labels is None
    inputs = rows.to_inputs(spec)
    assert inputs[spec.sequence.name].shape == (3, 1)
    np.testing.assert_array_equal(inputs[spec.sequence_length_input], np.zeros((3, 1), dtype=np.int32))
    np.testing.assert_array_equal(inputs[spec.target.name], np.full((3, 1), -1, dtype=np.int64))


def test_tsv_with_label_and_extras(spec):
    text = (
        _tsv_line("1", extras=["5 6 7", "42"])
        + _tsv_line("0", extras=["", ""])
        + _tsv_line("1", extras=["9,10", "0"])
    )
    rows = read_rows(io.StringIO(text), spec)
    np.testing.assert_array_equal(rows.labels, [1, 0, 1])
    np.testing.assert_array_equal(rows.target, [42, -1, 0])
    np.testing.assert_array_equal(rows.lengths, [3, 0, 2])
    inputs = rows.to_inputs(spec)
    np.testing.assert_array_equal(inputs[spec.sequence.name], [[5, 6, 7], [0, 0, 0], [9, 10, 0]])
    np.testing.assert_array_equal(inputs[spec.sequence_length_input], [[3], [0], [2]])


def test_tsv_without_label_with_extras(spec):
    rows = read_rows(io.StringIO(_tsv_line(extras=["3", "4"]) + _tsv_line(extras=["", "-1"])), spec)
    assert rows.labels is None
    np.testing.assert_array_equal(rows.target, [4, -1])
    np.testing.assert_array_equal(rows.lengths, [1, 0])


def test_to_inputs_dtypes_follow_the_spec(spec):
    rows = read_rows(io.StringIO(_tsv_line("1", extras=["1 2", "3"])), spec)
    inputs = rows.to_inputs(spec)
    for wire in spec.wire_inputs():
        assert inputs[wire.name].dtype == np.dtype(NUMPY_DTYPES[wire.dtype]), wire.name
        assert inputs[wire.name].ndim == 2
    assert all(isinstance(v, bytes) for v in inputs[spec.categorical.name].ravel())


def test_tsv_windows_line_endings_and_blank_lines(spec):
    text = _tsv_line("1").replace("\n", "\r\n") + "\n" + _tsv_line("0")
    rows = read_rows(io.StringIO(text), spec)
    assert len(rows) == 2 and rows.categorical[0, 25] == b"00000019"


def test_column_count_is_checked(spec):
    with pytest.raises(RowFormatError, match="line 1"):
        read_rows(io.StringIO("1\t2\t3\n"), spec)
    text = _tsv_line("1") + _tsv_line("1", extras=["1", "2"])
    with pytest.raises(RowFormatError, match="line 2"):
        read_rows(io.StringIO(text), spec)


def test_bad_number_names_line_and_column(spec):
    text = _tsv_line("1") + _tsv_line("0", dense=["1", "2", "x3"] + ["0"] * 10)
    with pytest.raises(RowFormatError, match=r"line 2, column I3") as info:
        read_rows(io.StringIO(text), spec)
    assert info.value.line == 2 and info.value.column == "I3"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("extras", "column"),
    [
        (["1 z", "3"], "history_items"),
        (["1", "q"], "target_item"),
        (["-4", "1"], "history_items"),
        (["", "-5"], "target_item"),
    ],
)
def test_bad_extras_name_the_column(spec, extras, column):
    text = _tsv_line("1", extras=["", ""]) + _tsv_line("1", extras=extras)
    with pytest.raises(RowFormatError, match=f"line 2, column {column}"):
        read_rows(io.StringIO(text), spec)


def test_a_bad_label_is_rejected(spec):
    with pytest.raises(RowFormatError, match="line 1, column label"):
        read_rows(io.StringIO(_tsv_line("yes")), spec)


def test_bad_hex_is_rejected(spec):
    cats = ["zz"] + ["0"] * 25
    with pytest.raises(RowFormatError, match="line 1, column C1"):
        read_rows(io.StringIO(_tsv_line("1", cats=cats)), spec)
    cats = ["0"] * 25 + ["1" * (spec.categorical.raw_columns[-1].max_hex_digits + 1)]
    with pytest.raises(RowFormatError, match="column C26"):
        read_rows(io.StringIO(_tsv_line("1", cats=cats)), spec)


def test_a_history_longer_than_max_length_keeps_its_newest_ids(spec):
    limit = spec.sequence.max_length
    ok = " ".join(["1"] * limit)
    rows = read_rows(io.StringIO(_tsv_line("1", extras=[ok, "2"])), spec)
    assert rows.lengths[0] == limit and rows.to_inputs(spec)[spec.sequence.name].shape == (1, limit)
    too_long = " ".join(str(i) for i in range(1, limit + 6))  # newest last
    rows = read_rows(
        io.StringIO(_tsv_line("1", extras=[ok, "2"]) + _tsv_line("1", extras=[too_long, "2"])), spec
    )
    assert rows.lengths[1] == limit
    np.testing.assert_array_equal(rows.history[1], np.arange(6, limit + 6))


def test_empty_input_gives_no_rows(spec):
    rows = read_rows(io.StringIO(""), spec)
    assert len(rows) == 0 and list(rows.batches(8)) == []


# ---- CSV ---------------------------------------------------------------------------------------


def test_csv_with_header_and_label(spec):
    columns = ["label", *spec.dense.columns, *spec.categorical.columns, "history_items", "target_item"]
    text = _csv_text(
        spec,
        [
            _full_row(label="1", I2="", I3="-7", C4="", history_items="11 12", target_item="13"),
            _full_row(label="0"),
        ],
        columns,
    )
    rows = read_rows(io.StringIO(text), spec)
    np.testing.assert_array_equal(rows.labels, [1, 0])
    assert rows.dense_missing[0, 1] and rows.dense[0, 2] == -7.0
    assert rows.categorical[0, 3] == b"" and rows.categorical[0, 4] == b"00000005"
    np.testing.assert_array_equal(rows.target, [13, -1])
    np.testing.assert_array_equal(rows.to_inputs(spec)[spec.sequence.name], [[11, 12], [0, 0]])


def test_csv_without_label_in_any_column_order(spec):
    columns = [*reversed(spec.categorical.columns), *spec.dense.columns]
    rows = read_rows(io.StringIO(_csv_text(spec, [_full_row(C1="ff", I13="")], columns)), spec)
    assert rows.labels is None
    assert rows.categorical[0, 0] == b"ff" and rows.dense_missing[0, 12]
    np.testing.assert_array_equal(rows.lengths, [0])
    np.testing.assert_array_equal(rows.target, [-1])


def test_csv_missing_required_column(spec):
    columns = [*spec.dense.columns, *spec.categorical.columns[:-1]]
    with pytest.raises(RowFormatError, match="C26"):
        read_rows(io.StringIO(_csv_text(spec, [_full_row()], columns)), spec)


def test_csv_bad_number_names_line(spec):
    columns = ["label", *spec.dense.columns, *spec.categorical.columns]
    rows = [_full_row(label="1"), _full_row(label="0"), _full_row(label="1", I5="five")]
    text = _csv_text(spec, rows, columns)
    with pytest.raises(RowFormatError, match="line 4, column I5"):
        read_rows(io.StringIO(text), spec)


# ---- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("writer", [write_tsv, write_csv])
@pytest.mark.parametrize("with_label", [True, False])
def test_round_trip_matches_synthetic_wire(spec, tmp_path, writer, with_label):
    raw = generate(spec, 50, seed=3)
    path = writer(tmp_path / "rows.txt", raw, spec, with_label=with_label)
    rows = read_rows(path, spec)
    assert len(rows) == 50
    if with_label:
        np.testing.assert_array_equal(rows.labels, raw.labels)
    else:
        assert rows.labels is None
    _assert_matches_wire(rows, raw, spec)


def test_round_trip_without_sequence_columns(spec, tmp_path):
    raw = generate(spec, 20, seed=5)
    rows = read_rows(write_tsv(tmp_path / "plain.tsv", raw, spec, with_sequence=False), spec)
    assert rows.labels is not None
    np.testing.assert_array_equal(rows.categorical, raw.to_wire(spec)[spec.categorical.name])
    np.testing.assert_array_equal(rows.lengths, np.zeros(20))
    np.testing.assert_array_equal(rows.target, np.full(20, -1))


def test_gzip_and_binary_streams(spec, tmp_path):
    raw = generate(spec, 10, seed=1)
    path = write_tsv(tmp_path / "rows.tsv.gz", raw, spec)
    with gzip.open(path, "rb") as fh:
        data = fh.read()
    _assert_matches_wire(read_rows(path, spec), raw, spec)
    _assert_matches_wire(read_rows(io.BytesIO(data), spec), raw, spec)


def test_batches_keep_order_and_trim_history(spec, tmp_path):
    raw = generate(spec, 50, seed=3)
    rows = read_rows(write_csv(tmp_path / "rows.csv", raw, spec), spec)
    batches = list(rows.batches(16))
    assert [len(b) for b in batches] == [16, 16, 16, 2]
    for i, batch in enumerate(batches):
        part = raw.take(slice(16 * i, 16 * (i + 1)))
        _assert_matches_wire(batch, part, spec)
    with pytest.raises(ValueError):
        next(rows.batches(0))


def test_max_rows(spec, tmp_path):
    raw = generate(spec, 30, seed=2)
    assert len(read_rows(write_tsv(tmp_path / "a.tsv", raw, spec), spec, max_rows=7)) == 7
    assert len(read_rows(write_csv(tmp_path / "a.csv", raw, spec), spec, max_rows=7)) == 7


# ---- real exports --------------------------------------------------------------------------------


def test_integers_written_as_floats_are_read_as_integers(spec):
    """pandas writes an integer column holding NaN as floats: ``260.0``; ids keep every digit."""
    dense = ["260.0", "-3.00", "", "7."] + ["0"] * 9
    big = str(2**62 + 1)
    text = _tsv_line("1", dense=dense, extras=[f"{big}.0 5.0", "12.0"])
    rows = read_rows(io.StringIO(text), spec)
    np.testing.assert_array_equal(rows.dense[0, :4], [260.0, -3.0, 0.0, 7.0])
    assert rows.dense_missing[0, 2] and not rows.dense_missing[0, 0]
    assert rows.history[0, :2].tolist() == [2**62 + 1, 5] and rows.target[0] == 12


def test_numeric_columns_take_real_values_and_integers_stay_exact(spec):
    """Prices, bids and ratios are real numbers: read as float32, integers as the nearest float32."""
    dense = ["8.3", "1e3", ".5", "-0.25", "16777217", "260.0"] + ["0"] * 7
    rows = read_rows(io.StringIO(_tsv_line("1", dense=dense)), spec)
    np.testing.assert_array_equal(
        rows.dense[0, :6], np.array([8.3, 1000.0, 0.5, -0.25, 16777217, 260.0], dtype=np.float32)
    )
    assert rows.dense[0, 4] == np.float32(np.int64(16777217))  # read as an integer, not through float64


def test_sample_rows_of_a_real_valued_feature_round_trip_exactly(tmp_path):
    """The taobao spec's price is real (``value_type = "real"``): written short, read back the same."""
    taobao = load_spec("taobao")
    raw = generate(taobao, 200, seed=4)
    price = taobao.numeric_columns.index("price")
    assert (raw.dense[:, price] != np.trunc(raw.dense[:, price])).any()  # real values, not counts
    for path in (write_tsv(tmp_path / "a.tsv.gz", raw, taobao), write_csv(tmp_path / "a.csv", raw, taobao)):
        rows = read_rows(path, taobao)
        np.testing.assert_array_equal(rows.dense[~rows.dense_missing], raw.dense[~raw.dense_missing])
        np.testing.assert_array_equal(rows.dense_missing, raw.dense_missing)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("1.0.0", "is not a number"),
        ("abc", "is not a number"),
        ("1_000", "is not a number"),
        ("nan", "is not a finite number"),
        ("-inf", "is not a finite number"),
        ("1e39", "is not a finite number"),
    ],
)
def test_a_field_that_is_no_finite_number_names_line_and_column(spec, value, why):
    text = _tsv_line("1") + _tsv_line("1", dense=["0", "0", value] + ["0"] * 10)
    with pytest.raises(RowFormatError, match=rf"line 2, column I3: '{value}' {why}"):
        read_rows(io.StringIO(text), spec)


def test_csv_export_with_quotes_crlf_bom_and_an_ignored_id_column(spec, tmp_path):
    """A CSV as spreadsheet tools and pandas write it: quoted fields, CRLF, a BOM, an ``id`` column."""
    raw = generate(spec, 5, seed=3)
    plain = tmp_path / "plain.csv"
    write_csv(plain, raw, spec, with_label=True)
    header, *lines = plain.read_text().splitlines()
    quoted = ['"' + '","'.join(line.split(",")) + '"' for line in lines]
    ids = [str(2**64 - 1 - i) for i in range(len(lines))]  # above 2^63: fits no int64, never parsed
    text = "\ufeffid," + header + "\r\n" + "".join(f"{i},{q}\r\n" for i, q in zip(ids, quoted, strict=True))
    export = tmp_path / "export.csv.gz"
    with gzip.open(export, "wt", newline="") as fh:
        fh.write(text)
    _assert_matches_wire(read_rows(export, spec), raw, spec)


def test_csv_as_pandas_exports_it(spec, tmp_path):
    """pandas reads all-digit hex columns and integer columns with gaps as floats and writes ``12.0``."""
    raw = generate(spec, 40, seed=12)
    raw.categorical[:, :3] = np.array([b"30883035", b"00123456", b"99999999"], dtype=object)  # all digits
    plain = tmp_path / "plain.csv"
    write_csv(plain, raw, spec, with_label=True)
    header, *lines = plain.read_text().splitlines()
    names = header.split(",")
    floated = {*spec.dense.columns, *spec.categorical.columns, spec.target.name, "label"}

    def pandas_field(name, value):
        numeric = value.lstrip("-").isdigit()
        return f"{int(value)}.0" if name in floated and numeric else value

    rows = [
        ",".join(pandas_field(n, v) for n, v in zip(names, line.split(","), strict=True)) for line in lines
    ]
    text = "\r\n".join([header, *rows]) + "\r\n"
    assert "30883035.0" in text and ",123456.0," in text  # the hex strings as pandas writes them
    export = tmp_path / "export.csv"
    export.write_bytes(text.encode())
    got, expected = read_rows(export, spec).to_inputs(spec), raw.to_wire(spec)
    name = spec.categorical.name
    assert got[name][0, 1] == b"123456"  # the leading zeros pandas dropped do not change the value:
    np.testing.assert_array_equal(parse_hex(got[name], 16, name)[0], parse_hex(expected[name], 16, name)[0])
    for tensor in (
        spec.dense_missing_input,
        spec.target.name,
        spec.sequence.name,
        spec.sequence_length_input,
    ):
        np.testing.assert_array_equal(got[tensor], expected[tensor], err_msg=tensor)
    np.testing.assert_array_equal(got[spec.dense.name], np.where(raw.dense_missing, 0.0, raw.dense))


@pytest.mark.parametrize("value", ["ab.0", "12.5", "+12.0"])
def test_a_float_in_a_hex_column_that_is_not_an_integer_is_refused_as_written(spec, value):
    cats = [value] + ["0"] * 25
    with pytest.raises(RowFormatError, match=rf"line 1, column C1: '{re.escape(value)}' is not a hex string"):
        read_rows(io.StringIO(_tsv_line("1", cats=cats)), spec)
