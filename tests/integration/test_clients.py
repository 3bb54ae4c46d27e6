"""The SDK and the `recserve predict` / `recserve perf` commands against the live server."""

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from recserve.build.repository import reference_pipeline
from recserve.build.synthetic import generate
from recserve.clients import AsyncCTRClient, CTRClient, InvalidRequestError, read_rows
from recserve.clients.writers import write_csv, write_tsv
from tests.integration.helpers import run_perf


@pytest.fixture(scope="module")
def raw(spec):
    return generate(spec, 150, seed=2024)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sync_and_async_clients_agree_with_the_reference(server, spec, repository, raw, tmp_path, protocol):
    rows = read_rows(write_tsv(tmp_path / "rows.tsv", raw, spec), spec)
    expected = reference_pipeline(spec, repository, runtime="torch").predict(rows.to_inputs(spec))
    url = server.grpc_url if protocol == "grpc" else server.http_url
    with CTRClient(url, protocol=protocol, timeout_s=30, spec=spec) as client:
        assert client.is_ready()
        served = client.predict(rows, batch_size=64)

    async def run_async():
        async with AsyncCTRClient(url, protocol=protocol, timeout_s=30, spec=spec) as client:
            return await client.predict(rows, batch_size=32), await client.score_inputs(
                rows.take(slice(0, 5)).to_inputs(spec)
            )

    served_async, scored = asyncio.run(run_async())
    np.testing.assert_allclose(served, expected, atol=1e-5)
    np.testing.assert_array_equal(served_async, served)
    np.testing.assert_allclose(scored.probabilities, served[:5], atol=1e-5)
    # the versions leave once per request, not once per row
    assert scored.embedding_version.shape == (len(spec.table_names),)
    assert isinstance(scored.dense_version, int)


def test_sdk_raises_a_typed_error_naming_the_input(server, spec, raw):
    inputs = raw.take(slice(0, 2)).to_wire(spec)
    inputs[spec.dense.name][0, 0], inputs[spec.dense_missing_input][0, 0] = np.inf, False
    with CTRClient(server.grpc_url, spec=spec) as client:
        with pytest.raises(InvalidRequestError, match="input 'dense'"):
            client.predict_inputs(inputs)


@pytest.mark.parametrize(("fmt", "protocol"), [("tsv", "grpc"), ("csv", "http")])
def test_predict_command_prints_one_probability_per_row_in_order(server, spec, raw, tmp_path, fmt, protocol):
    writer = write_tsv if fmt == "tsv" else write_csv
    path = writer(tmp_path / f"rows.{fmt}", raw, spec, with_label=(fmt == "csv"))
    url = server.grpc_url if protocol == "grpc" else server.http_url
    done = subprocess.run(
        [sys.executable, "-m", "recserve.cli", "predict", "--input", str(path), "--url", url,
         "--protocol", protocol, "--batch-size", "64"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = np.array([np.float32(line) for line in done.stdout.splitlines()])
    assert len(printed) == len(raw)
    with CTRClient(server.grpc_url, spec=spec) as client:
        direct = client.predict(read_rows(path, spec))
    np.testing.assert_array_equal(printed, direct.astype(np.float32))  # every float32 digit printed
    shortened = subprocess.run(
        [sys.executable, "-m", "recserve.cli", "predict", "--input", str(path), "--url", url,
         "--protocol", protocol, "--digits", "3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shortened.stdout.splitlines() == [f"{p:.3f}" for p in direct]


def test_sample_then_predict_as_the_readme_says(server, tmp_path):
    rows = tmp_path / "rows.csv"
    cli = [sys.executable, "-m", "recserve.cli"]
    assert subprocess.run([*cli, "sample", "--rows", "20", "--output", str(rows)], timeout=60).returncode == 0
    done = subprocess.run(
        [*cli, "predict", "--input", str(rows), "--url", server.grpc_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    probabilities = [float(line) for line in done.stdout.split()]
    assert done.returncode == 0 and len(probabilities) == 20
    assert all(0 < p < 1 for p in probabilities) and len(set(probabilities)) > 10


def test_predict_command_reports_a_bad_file_without_a_traceback(server, tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\tx\n")
    done = subprocess.run(
        [sys.executable, "-m", "recserve.cli", "predict", "--input", str(bad), "--url", server.grpc_url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith("error: line 1:"), done.stderr  # after the spec source


def test_perf_command_runs_perf_analyzer_and_prints_its_table(server, tmp_path):
    out = tmp_path / "perf.csv"
    done = run_perf(server.grpc_url, out, "--batch-size", "8", "--concurrency", "1:2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Composing models" in done.stdout and "embedding_lookup" in done.stdout
    lines = out.read_text().splitlines()
    assert lines[0].startswith("batch_size,concurrency,rows_per_s") and len(lines) == 3
    assert all(float(line.split(",")[2]) > 0 for line in lines[1:])


def test_verify_compares_in_process_and_served_scores_with_the_users(server, spec, repository, raw, tmp_path):
    """``recserve verify --url``: the user's scores (here the PyTorch reference) against both paths."""
    rows_path = write_csv(tmp_path / "rows.csv", raw, spec, with_label=True)
    rows = read_rows(rows_path, spec)
    expected = reference_pipeline(spec, repository, runtime="torch").predict(rows.to_inputs(spec))
    (tmp_path / "ok.txt").write_text("".join(f"{p:.9f}\n" for p in expected))
    expected[42] += 0.02
    (tmp_path / "off.txt").write_text("".join(f"{p:.9f}\n" for p in expected))
    command = [
        sys.executable,
        "-m",
        "recserve.cli",
        "verify",
        "--rows",
        str(rows_path),
        "--url",
        server.grpc_url,
    ]
    command += ["--repository", str(repository)]
    done = subprocess.run([*command, "--expected", str(tmp_path / "ok.txt")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"| server {server.grpc_url} | 150 |" in done.stdout and "| 0 (> 1e-05) |" in done.stdout
    done = subprocess.run([*command, "--expected", str(tmp_path / "off.txt")], capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"server {server.grpc_url}: 1 rows differ" in done.stdout and "row 42: expected" in done.stdout
