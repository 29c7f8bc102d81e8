"""Failures of a training on a GPU cluster, each one line naming the rank, the stage and the
operation (issue 60, review F4 and F17, test T5). NCCL's watchdog aborts a rank whose collective
waited past ``train.dist_timeout_s`` (SIGABRT, exit code -6) before Python sees an exception, so its
one line must come from what the rank wrote to its log; under ``TORCH_NCCL_BLOCKING_WAIT`` the same
timeout is a Python exception. gloo's failure to connect the ranks (a host name that resolves to
127.0.1.1, several network interfaces) must name ``GLOO_SOCKET_IFNAME``.

The texts are as recorded in public issue threads (NVIDIA/Megatron-LM#1207, hiyouga/LlamaFactory#6269
and #7396, XPixelGroup/BasicSR#737, OFA-Sys/OFA#271, huggingface/open-r1#620,
mlfoundations/open_clip#1087, pytorch/pytorch#108732, pytorch/examples#812, sgl-project/sglang#3226)
and in torch's ProcessGroupNCCL.cpp (the blocking-wait text); a CPU has no NCCL to produce them."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from embed_core.errors import CollectiveError, LaunchError, user_error
from embed_core.dist import spawn
from embed_core.dist.distributed import collective_error, rank_environment, rank_log_failure, set_stage

# torch >= 2.4 (the "[PG ID 0 PG GUID 0(default_pg) Rank 3]" prefix), torch 2.2-2.3, and before 2.2 (no Numel*)
WATCHDOG = ("[rank3]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:616] [PG ID 0 PG GUID 0(default_pg) Rank 3] "
            "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1, "
            "NumelOut=1, Timeout(ms)=600000) ran for 600032 milliseconds before timing out.")
WATCHDOG_LOG = "\n".join([
    "step 12/500 loss 1.93",
    "[rank1]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank 1] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=7753, OpType=_REDUCE_SCATTER_BASE, NumelIn=544997376, NumelOut=68124672, "
    "Timeout(ms)=600000) ran for 600061 milliseconds before timing out.",
    "[rank1]:[E1206 18:44:12.715588844 ProcessGroupNCCL.cpp:1664] [PG 1 Rank 1] Exception (either an error or "
    "timeout) detected by watchdog at work: 7753, last enqueued NCCL work: 7755, last completed NCCL work: 7752.",
    "[rank1]:[E1206 18:44:16.994957078 ProcessGroupNCCL.cpp:621] [Rank 1] Some NCCL operations have failed or timed "
    "out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete "
    "data.",
    "[rank1]:[E1206 18:44:16.994964417 ProcessGroupNCCL.cpp:627] [Rank 1] To avoid data inconsistency, we are taking "
    "the entire process down.",
    "[rank1]:[E1206 18:44:17.031948957 ProcessGroupNCCL.cpp:1895] [PG ID 0 PG GUID 0(default_pg) Rank 1] Process "
    "group watchdog thread terminated with exception: [Rank 1] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=7753, OpType=_REDUCE_SCATTER_BASE, NumelIn=544997376, NumelOut=68124672, Timeout(ms)=600000) "
    "ran for 600061 milliseconds before timing out.",
    "Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:632 (most recent "
    "call first):",
    "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f0c4756c1b6 in libc10.so)",
    "terminate called after throwing an instance of 'c10::DistBackendError'",
])
OLD_WATCHDOG = ("[E ProcessGroupNCCL.cpp:737] [Rank 1] Watchdog caught collective operation timeout: "
                "WorkNCCL(SeqNum=469508, OpType=BROADCAST, Timeout(ms)=1800000) ran for 1802212 milliseconds before "
                "timing out.")
BLOCKING_WAIT = ("[PG ID 0 PG GUID 0(default_pg) Rank 1] Work WorkNCCL(SeqNum=5, OpType=_ALLGATHER_BASE, NumelIn=4096, "
                 "NumelOut=8192, Timeout(ms)=120000) timed out in blocking wait.")
ABORTED = ("NCCL communicator was aborted on rank 3.  Original reason for failure was: [Rank 3] Watchdog caught "
           "collective operation timeout: WorkNCCL(SeqNum=266392, OpType=ALLGATHER, Timeout(ms)=1800000) ran for "
           "1803169 milliseconds before timing out.")
HINT = "(raise train.dist_timeout_s if a rank legitimately works that long between collectives)"


@pytest.fixture
def stage():
    set_stage("ret")
    yield
    set_stage(None)


def test_a_recorded_watchdog_timeout_in_a_rank_log_is_the_one_line_naming_rank_stage_operation_and_timeout(stage):
    line = rank_log_failure(WATCHDOG, "training rank 3 of 8, stage ret")
    assert line == ("training rank 3 of 8, stage ret: a collective (all_reduce, NCCL sequence number 42) waited longer "
                    "than train.dist_timeout_s = 600 s: another rank stalled or died; NCCL's watchdog ended this rank; "
                    f"the rank that did not reach this collective is the one to look at {HINT}")


@pytest.mark.parametrize(("text", "operation", "seconds"), [
    (WATCHDOG_LOG, "reduce_scatter_tensor, NCCL sequence number 7753", 600),
    (OLD_WATCHDOG, "broadcast, NCCL sequence number 469508", 1800),
    (BLOCKING_WAIT, "all_gather_into_tensor, NCCL sequence number 5", 120),
])
def test_every_recorded_form_of_the_nccl_timeout_names_its_operation_and_timeout(text, operation, seconds):
    line = rank_log_failure(text, "training rank 1 of 8")
    assert line.startswith(f"training rank 1 of 8: a collective ({operation}) waited longer than "
                           f"train.dist_timeout_s = {seconds} s: another rank stalled or died")


def test_a_log_without_nccl_text_is_not_taken_for_a_watchdog_failure():
    assert rank_log_failure("step 3/10 loss 2.1\nTraceback (most recent call last):\nValueError: x", "r") is None


@pytest.mark.parametrize("text", [BLOCKING_WAIT, ABORTED, WATCHDOG])
def test_the_nccl_timeout_raised_in_python_is_the_same_one_line(stage, text):
    """Under TORCH_NCCL_BLOCKING_WAIT=1, or at the next collective once the watchdog aborted the
    communicator (TORCH_NCCL_ASYNC_ERROR_HANDLING=2), torch raises the text as DistBackendError."""
    try:
        raise torch.distributed.DistBackendError(text)
    except RuntimeError as exc:
        error = collective_error(exc)
        assert user_error(exc) == str(error)
    assert isinstance(error, CollectiveError) and "\n" not in str(error)
    assert str(error).startswith("training rank 0 of 1, stage ret: a collective (")
    assert "waited longer than train.dist_timeout_s = " in str(error) and "WorkNCCL" not in str(error)


_ABORTING_RANK = """
    import os, sys
    print("step 1/10 loss 2.31", flush=True)
    # what NCCL does on a watchdog timeout: the flight recorder's dump (TORCH_FR_DUMP_TEMP_FILE + rank),
    # the watchdog's lines on stderr, then abort() from its thread: SIGABRT, no Python exception
    with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + os.environ["RANK"], "wb") as dump:
        dump.write(b"pickled trace")
    sys.stderr.write(sys.argv[1] + "\\n")
    sys.stderr.flush()
    os.abort()
"""


def test_a_real_rank_that_nccls_watchdog_aborts_is_one_line_through_the_spawn_path(stage, tmp_path, monkeypatch):
    """A child rank as ``local_ranks`` starts it (its log, the ranks' environment with the flight
    recorder's dump path), that writes the recorded watchdog lines and aborts (exit code -6):
    ``spawn``'s wait for it fails with the one line, naming the dump."""
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / spawn.FLIGHT_RECORDER).mkdir()
    env = {**os.environ, **rank_environment(2, str(tmp_path / spawn.FLIGHT_RECORDER / "rank-")), "RANK": "1"}
    log = open(tmp_path / "rank-1.log", "w")  # noqa: SIM115 (closed below)
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_ABORTING_RANK), WATCHDOG_LOG.split("\n", 1)[1]],
                             stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        with pytest.raises(CollectiveError) as caught:
            spawn._wait([(1, log, child)], tmp_path)
    finally:
        child.kill()
        child.wait()
        log.close()
    assert child.returncode == -signal.SIGABRT
    assert user_error(caught.value) == (
        "training rank 1 of 2, stage ret: a collective (reduce_scatter_tensor, NCCL sequence number 7753) waited "
        "longer than train.dist_timeout_s = 600 s: another rank stalled or died; NCCL's watchdog ended this rank; the "
        f"rank that did not reach this collective is the one to look at {HINT} (exit code -6; its log: "
        f"{tmp_path / 'rank-1.log'}; NCCL's flight recorder: {tmp_path / spawn.FLIGHT_RECORDER / 'rank-1'})")


def test_a_rank_whose_log_ends_in_a_python_traceback_is_one_line_with_the_exception(stage, tmp_path):
    (tmp_path / "rank-1.log").write_text("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                                         "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    line = str(spawn._child_failed(1, 4, 1, tmp_path))
    assert line == ("training rank 1 of 4, stage ret exited with code 1: torch.OutOfMemoryError: CUDA out of memory. "
                    f"Tried to allocate 2.00 GiB; its log: {tmp_path / 'rank-1.log'}")


def test_a_ranks_own_error_line_stays_what_it_said(stage, tmp_path):
    (tmp_path / "rank-1.log").write_text("embedpipe: error: training rank 1 of 2, stage ret: a collective (all_reduce) "
                                         "lost its connection to another rank\n")
    assert str(spawn._child_failed(1, 2, 2, tmp_path)) == (
        "training rank 1 of 2, stage ret: a collective (all_reduce) lost its connection to another rank (exit code 2; "
        f"its log: {tmp_path / 'rank-1.log'})")


# gloo connecting the ranks' full mesh (init_process_group, new_group) across nodes
GLOO_REFUSED = ("[/opt/conda/conda-bld/pytorch_1682343967769/work/third_party/gloo/gloo/transport/tcp/pair.cc:799] "
                "connect [172.31.71.170]:13195: Connection refused")
GLOO_LOOPBACK = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:769] connect [127.0.1.1]:25472: Connection refused"
GLOO_MESH = "Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error"


@pytest.mark.parametrize(("text", "detail"), [
    (GLOO_REFUSED, "connect [172.31.71.170]: Connection refused; the address gloo took for a rank is not one the other "
                   "nodes reach"),
    (GLOO_LOOPBACK, "connect [127.0.1.1]: Connection refused; 127.0.1.1 is a loopback address: this host's name "
                    "resolves to it"),
    (GLOO_MESH, "connectFullMesh failed; the address gloo took for a rank is not one the other nodes reach"),
])
def test_gloos_connect_failure_is_one_line_naming_gloo_socket_ifname(stage, monkeypatch, text, detail):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    error = collective_error(RuntimeError(text))
    assert isinstance(error, LaunchError)
    assert str(error) == (f"training rank 0 of 1, stage ret: gloo could not connect the ranks ({detail}); set "
                          "GLOO_SOCKET_IFNAME on every node to the network interface the nodes reach each other on "
                          "(one name, such as eth0 or ib0: `ip -br addr` lists them), and NCCL_SOCKET_IFNAME likewise")


def test_a_connect_failure_with_gloo_socket_ifname_set_says_to_check_it(stage, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    assert str(collective_error(RuntimeError(GLOO_REFUSED))).endswith(
        "GLOO_SOCKET_IFNAME=eth1 is set here: check that it names that interface on every node")


def test_a_gloo_socket_ifname_naming_no_interface_is_one_line_from_gloos_real_error(stage, monkeypatch):
    """Real: gloo refuses the interface when it makes its device, in one process."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(RuntimeError) as caught:
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    assert not torch.distributed.is_initialized()
    assert user_error(caught.value) == (
        "training rank 0 of 1, stage ret: GLOO_SOCKET_IFNAME=nosuch0 names no network interface of this host with an "
        "address: name the interface the nodes reach each other on (`ip -br addr` lists them), on every node")


def test_a_peer_that_closed_its_gloo_connection_is_still_a_lost_peer_not_a_connect_failure(stage):
    text = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4321"
    assert "lost its connection to another rank" in str(collective_error(RuntimeError(text)))
