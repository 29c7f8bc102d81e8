"""Work one rank does for all (``embed_core.dist.ranks``), in two real gloo processes whose
collectives time out after 2 seconds: rank 0's step may take longer than that (the other rank waits
for it and reads its result), a step that fails on rank 0 ends the other rank with one line instead
of a wait, every rank takes rank 0's cache decision, and a rank other than 0 cannot open a stage
writer (which would delete rank 0's staging directory of the same stage)."""

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow

TIMEOUT_S, BUSY_S = 2, 4


def _meet(out: Path, rank: int) -> None:
    """Both processes ready before the rendezvous, so that its short timeout is about the
    collectives, not about one process starting seconds after the other on a loaded machine."""
    (out / f"ready{rank}").touch()
    deadline = time.time() + 120
    while not all((out / f"ready{r}").exists() for r in (0, 1)) and time.time() < deadline:
        time.sleep(0.05)


def _outcome(call) -> str:
    try:
        return f"returned {call()}"
    except Exception as exc:  # noqa: BLE001 (the outcome is what the test reads)
        return f"{type(exc).__name__}: {exc}"


def _steps(rank: int, out: Path) -> dict[str, str]:
    from embed_core.artifacts import StageWriter
    from embed_core.dist.ranks import main_decides, on_main_rank

    def slow() -> str:  # a re-mining that outlasts the collective timeout
        time.sleep(BUSY_S)
        (out / "committed").write_text("rank 0's result")
        return "computed"

    def failing() -> str:
        raise ValueError("the corpus is unreadable")

    def open_writer() -> str:
        with StageWriter(out / "run", "mine-stage2"):
            return "opened"

    return {"slow": _outcome(lambda: on_main_rank("mine-stage2", slow, (out / "committed").read_text)),
            "failing": _outcome(lambda: on_main_rank("synth-stage2", failing, lambda: "read")),
            "decision": _outcome(lambda: main_decides(rank == 0)),
            "writer": _outcome(open_writer)}


def _rank(rank: int, out: str) -> None:
    import embed_core.artifacts  # noqa: F401 (imported before the rendezvous: both ranks start warm)
    import embed_core.dist.ranks  # noqa: F401

    out = Path(out)
    os.environ.update(WORLD_SIZE="2", RANK=str(rank))
    _meet(out, rank)
    torch.distributed.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=2,
                                         timeout=timedelta(seconds=TIMEOUT_S))
    (out / f"rank{rank}.json").write_text(json.dumps(_steps(rank, out)))
    os._exit(0)  # a gloo group can abort in its destructor at interpreter exit; the outcome is written


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[dict[int, dict[str, str]], Path]:
    """What each rank's calls returned or raised, and the directory they worked in."""
    out = tmp_path_factory.mktemp("ranks")
    mp.start_processes(_rank, args=(str(out),), nprocs=2, start_method="spawn")
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}, out


def test_a_step_longer_than_the_collective_timeout_runs_on_rank_0_and_the_other_rank_reads_its_result(ranks):
    outcomes, out = ranks
    assert outcomes[0]["slow"] == "returned computed"
    assert outcomes[1]["slow"] == "returned rank 0's result"


def test_a_step_that_fails_on_rank_0_ends_the_other_rank_with_one_line_naming_the_step(ranks):
    outcomes, out = ranks
    assert outcomes[0]["failing"] == "ValueError: the corpus is unreadable"
    assert outcomes[1]["failing"] == ("EmbedpipeError: synth-stage2: rank 0 failed (ValueError: the corpus is "
                                      "unreadable); rank 1 has nothing to read")


def test_every_rank_takes_rank_0s_decision(ranks):
    outcomes, out = ranks
    assert outcomes[0]["decision"] == outcomes[1]["decision"] == "returned True"


def test_only_rank_0_opens_a_stage_writer_and_no_staging_directory_is_left(ranks):
    outcomes, out = ranks
    assert outcomes[0]["writer"] == "returned opened"
    assert outcomes[1]["writer"].startswith("EmbedpipeError: ")
    assert "mine-stage2: rank 1 of a multi-process job opened a stage writer; only rank 0 writes a stage" in \
        outcomes[1]["writer"]
    assert sorted(p.name for p in (out / "run").iterdir()) == []
