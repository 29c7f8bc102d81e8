"""A disk that fills up while a stage writes, through the real CLI: one line naming the stage's
directory and saying the disk is full (pyarrow's own error names no file), exit 2, and the
previous artifact is left as it was.

The full disk is real: a 512 KiB tmpfs mounted for the test (needs root with CAP_SYS_ADMIN;
skipped elsewhere), so the failing writes are the stage's own, through pyarrow and Python."""

import os
import subprocess

import pytest

from tests.helpers.cli_run import in_process, write_config

pytestmark = pytest.mark.prefect

HEADER = "sentence1,sentence2,score\n"


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _rows(n: int) -> str:
    return "".join(f"{os.urandom(24).hex()},{os.urandom(24).hex()},{i % 5}\n" for i in range(n))


def test_a_full_disk_during_a_stage_is_one_line_and_keeps_the_previous_artifact(tmp_path, capfd, small_disk,
                                                                                 prefect_harness):
    (tmp_path / "s.csv").write_text(HEADER + _rows(20))
    config = write_config(tmp_path, [{"name": "sts", "kind": "sts", "path": "s.csv"}])
    run_dir = small_disk / "run"
    assert in_process(capfd, "prepare", "--config", config, "--run-dir", run_dir).rc == 0
    before = {p.name: p.read_bytes() for p in (run_dir / "prepare").iterdir()}

    (tmp_path / "s.csv").write_text(HEADER + _rows(20000))  # ~2 MB of records: more than the disk holds
    result = in_process(capfd, "prepare", "--config", config, "--run-dir", run_dir)
    line = result.assert_one_line_error("no space left to write the prepare stage (ENOSPC", "nothing was committed",
                                        f"{run_dir / 'prepare'} is as it was")
    assert str(run_dir) in line.split(":")[2]  # the path it names is in the run directory (its staging dir)
    assert {p.name: p.read_bytes() for p in (run_dir / "prepare").iterdir()} == before
    assert not [p for p in run_dir.iterdir() if ".staging-" in p.name]  # the space it took is given back
