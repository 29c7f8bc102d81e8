"""A checkpoint that cannot be written (a full disk: torch reports it as a RuntimeError with no
errno) is one line naming it, and the last complete checkpoint is kept."""

import subprocess
import sys
import textwrap

from tests.helpers.repo import REPO


def test_a_checkpoint_write_cut_by_a_file_size_limit_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    # the kernel refuses torch's own writes past 64 KiB (EFBIG), as a full disk refuses them (ENOSPC)
    program = textwrap.dedent(f"""
        import resource, signal, torch
        from pathlib import Path
        from embed_core.errors import CheckpointError
        from embed_core.train.engine.checkpoint import checkpoint_write as _checkpoint_write

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        root = Path({str(tmp_path)!r})
        last = root / "step-0000002"
        last.mkdir()
        tmp = root / ".tmp-step-0000004"
        tmp.mkdir()
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            with _checkpoint_write(tmp, [last]):
                torch.save({{"w": torch.zeros(100_000)}}, tmp / "state.pt")
        except CheckpointError as exc:
            print(exc)
        print("tmp left:", tmp.exists(), "last kept:", last.exists())
    """)
    proc = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line, state = proc.stdout.splitlines()
    assert line.startswith(f"{tmp_path}/.tmp-step-0000004: writing the checkpoint failed (")
    assert "MiB free there: a full disk?); the last complete checkpoint (step-0000002) is kept" in line
    assert state == "tmp left: False last kept: True"
