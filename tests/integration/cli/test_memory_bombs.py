"""Memory bombs through the real CLI (issue 44): each input past a bound of a source's ``limits``
(or of the YAML reader) is one quarantined row or one stderr line with exit 2, within 30 s, in an
``embedpipe`` process whose address space is limited to 6 GiB — never a MemoryError traceback.

"Within 30 s" is the command's own time, user + system CPU from the kernel's accounting of the
child (``RUSAGE_CHILDREN``): on a shared 2-core machine the wall clock measures the neighbours too
(at a load average of 12 the 2 GB CSV's run took 44 s of wall time and about 11 s of CPU). The
wall clock is held to 120 s, so a hang still fails.

The files are generated at full size (a 2 GB single-line CSV as a sparse file: instant to write,
read at disk-cache speed). Each command runs as its own process (``resource.RLIMIT_AS`` applies to
a whole process) against the session's Prefect test server."""

from __future__ import annotations

import gzip
import os
import resource
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers.cli_run import CliResult, write_config
from tests.helpers.repo import REPO

pytestmark = pytest.mark.prefect

ADDRESS_SPACE = 6 << 30
SECONDS = 30  # CPU seconds of the command
HANG = 120  # wall-clock seconds
HEADER = b"sentence1,sentence2,score\n"
GOOD = b"A man plays a guitar.,A man is playing guitar.,4.6\n"


@pytest.fixture(autouse=True)
def _prefect(prefect_harness):
    yield


def limited(*argv: object, address_space: int = ADDRESS_SPACE, timeout: int = HANG) -> tuple[CliResult, float]:
    """``embedpipe *argv`` in a process limited to ``address_space`` bytes and ``timeout`` seconds of
    wall time; returns its result and the CPU seconds it (and any process it waited for) used."""
    from prefect.settings import PREFECT_API_URL

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": PREFECT_API_URL.value()}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *map(str, argv)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=limit)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return CliResult(proc.returncode, proc.stdout, proc.stderr), cpu


def prepare(tmp_path, source: dict, timeout: int = HANG, **limits) -> tuple[CliResult, float]:
    spec = {"name": "sts", "kind": "sts", **source, **({"limits": limits} if limits else {})}
    return limited("prepare", "--config", write_config(tmp_path, [spec]), timeout=timeout)


def quarantine(tmp_path) -> list[dict]:
    return pq.read_table(tmp_path / "runs/r/prepare/_quarantine.parquet").to_pylist()


def test_a_2_gb_single_line_csv_is_one_quarantined_row_and_the_rows_after_it_are_read(tmp_path):
    path = tmp_path / "s.csv"
    with open(path, "wb") as fh:  # a sparse file: the 2 GB line is a hole of NUL bytes
        fh.write(HEADER + GOOD)
        fh.seek(2 << 30, os.SEEK_CUR)
        fh.write(b",x,1\n" + GOOD)
    result, seconds = prepare(tmp_path, {"path": "s.csv"})
    path.unlink()
    assert result.rc == 0, result.err[-3000:]
    assert seconds < SECONDS
    (row,) = quarantine(tmp_path)
    assert (row["row"], row["reason"]) == (3, "line_too_long") and "limits.max_line_bytes (64 MiB)" in row["message"]


def test_a_500_mb_string_in_a_small_parquet_file_is_one_quarantined_row(tmp_path):
    path = tmp_path / "s.parquet"
    big = "x" * (500 << 20)
    pq.write_table(pa.table({"sentence1": [big], "sentence2": ["b"], "score": ["1.0"]}), path, compression="zstd")
    del big
    good = tmp_path / "t.parquet"
    pq.write_table(pa.table({"sentence1": ["a"], "sentence2": ["b"], "score": ["1.0"]}), good)
    assert path.stat().st_size < 100_000
    result, seconds = limited("prepare", "--config", write_config(tmp_path, [
        {"name": "sts", "kind": "sts", "path": "s.parquet", "allow_empty": True},
        {"name": "t", "kind": "sts", "path": "t.parquet"}]))
    assert result.rc == 0, result.err[-3000:]
    assert seconds < SECONDS
    (row,) = quarantine(tmp_path)
    assert (row["row"], row["field"], row["reason"]) == (1, "sentence1", "field_too_long")


def test_a_gzip_bomb_past_the_decompressed_bound_is_one_line(tmp_path):
    # 512 MiB of zeros in about 500 KB; the bound is lowered so the test stays fast (32 GiB by default).
    zeros = bytes(64 << 20)
    with gzip.open(tmp_path / "s.csv.gz", "wb", compresslevel=1) as fh:
        fh.write(HEADER)
        for _ in range(8):
            fh.write(zeros)
    result, seconds = prepare(tmp_path, {"path": "s.csv.gz"}, max_decompressed_bytes=256 << 20)
    result.assert_one_line_error("s.csv.gz: expands when decompressed to more than limits.max_decompressed_bytes "
                                 "(256 MiB); raise limits.max_decompressed_bytes")
    assert seconds < SECONDS


def test_a_yaml_alias_bomb_of_one_large_string_is_one_line(tmp_path):
    # 9,000 sources whose instruction is an alias of one 3 MiB string: 90,000 values (under the
    # 100,000 cap), 28 GB once expanded (before: pydantic aborted the process allocating 6 GB).
    instruction = '&big "' + "x" * (3 << 20) + '"'
    sources = [f"    - {{name: s{i}, kind: sts, path: s.csv, instruction: {instruction if i == 0 else '*big'}}}"
               for i in range(9000)]
    config = tmp_path / "config.yaml"
    config.write_text(f"data_root: {tmp_path}\nrun_root: {tmp_path / 'runs'}\nrun_name: r\nprepare:\n  sources:\n"
                      + "\n".join(sources) + "\n")
    result, seconds = limited("prepare", "--config", config)
    result.assert_one_line_error("config.yaml:1: invalid YAML: expands to more than 16 MiB of text once its aliases")
    assert seconds < SECONDS


def test_a_memory_error_is_one_line_with_exit_2(tmp_path):
    # A bound raised past what the process may hold: reading the 2 GB line runs out of address space.
    # Not a bound's case, so not held to 30 s: it fills memory first.
    path = tmp_path / "s.csv"
    with open(path, "wb") as fh:
        fh.write(HEADER + GOOD)
        fh.seek(2 << 30, os.SEEK_CUR)
        fh.write(b",x,1\n")
    result, _ = prepare(tmp_path, {"path": "s.csv"}, max_line_bytes=8 << 30, max_record_bytes=8 << 30,
                        max_field_bytes=8 << 30)
    path.unlink()
    result.assert_one_line_error("out of memory (MemoryError)", "ulimit -v")
