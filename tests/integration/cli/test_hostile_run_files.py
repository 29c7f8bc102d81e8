"""Hostile files in a run directory through the real CLI: ``history.jsonl`` is a log anybody (a
crash, a disk error, another tool) may have damaged; ``embedpipe status`` reads what entries it
can and shows the rest of the run, never a traceback."""

import os

import pytest

from tests.helpers.cli_run import STS_SOURCE, in_process, write_config, write_sts_data

pytestmark = pytest.mark.prefect


@pytest.fixture(autouse=True)
def _prefect(prefect_harness):
    yield


def test_status_reads_a_history_of_random_bytes_and_wrong_shapes_as_the_entries_it_can(tmp_path, capfd):
    write_sts_data(tmp_path)
    config = write_config(tmp_path, [STS_SOURCE])
    assert in_process(capfd, "prepare", "--config", config).rc == 0
    history = tmp_path / "runs/r/history.jsonl"
    good = history.read_bytes()
    garbage = [os.urandom(300), b"[1, 2]", b'{"stage": 5}', b'"just a string"', b"{" * 100_000,
               b'{"stage": "prepare", "seconds": "long", "cached": "yes", "at": 7}', b"x" * 200_000]
    history.write_bytes(b"\n".join(garbage) + b"\n" + good + os.urandom(50))
    result = in_process(capfd, "status", "--run-dir", tmp_path / "runs/r", "--config", config)
    assert result.rc == 0, result.err[-3000:]
    assert "Traceback" not in result.out + result.err
    (row,) = [line for line in result.out.splitlines() if line.startswith("prepare ")]
    assert "fresh" in row and "computed at" in row
