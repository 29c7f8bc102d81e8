"""Children that die with their parent (``embed_core.procs``): a command wrapped by
``dying_with_parent``, a process-pool worker armed by ``die_with_parent`` (a sweep's workers) and
one in a session of its own (a Ctrl-C to the parent's process group does not reach it), the
llama.cpp server's command line, and a commit refused in a process whose parent is gone."""

import os
import signal
import subprocess
import sys
import textwrap

from tests.helpers.procs import gone, kill_parent_and_check_children, python
from tests.helpers.repo import REPO


def test_a_command_started_through_the_helper_dies_with_its_sigkilled_parent():
    kill_parent_and_check_children("""
        import subprocess, sys, time
        from embed_core.procs import dying_with_parent
        child = subprocess.Popen(dying_with_parent([sys.executable, "-c", "import time; print('ready', flush=True); "
                                                    "time.sleep(600)"]))
        print(child.pid, flush=True)
        time.sleep(600)
    """)


def test_a_command_whose_parent_died_before_the_signal_was_armed_runs_nothing():
    # a parent other than the one named (no process has pid 0): it is gone already
    orphan = subprocess.run([sys.executable, "-m", "embed_core.procs", "0", str(int(signal.SIGTERM)), sys.executable,
                             "-c", "print('ran')"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=60)
    assert (orphan.returncode, orphan.stdout) == (1, "")


def test_a_process_pool_worker_armed_by_its_initializer_dies_with_its_sigkilled_parent():
    kill_parent_and_check_children("""
        import os, signal, time
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context
        from embed_core.procs import die_with_parent
        pool = ProcessPoolExecutor(2, mp_context=get_context("spawn"), initializer=die_with_parent,
                                   initargs=(signal.SIGKILL, os.getpid()))
        busy = [pool.submit(time.sleep, 600) for _ in range(2)]
        time.sleep(0.5)
        while len(pool._processes) < 2:
            time.sleep(0.1)
        print(*pool._processes, flush=True)
        print("ready", flush=True)
        time.sleep(600)
    """)


def test_a_pool_worker_in_its_own_session_is_not_reached_by_a_signal_to_its_parents_group_and_dies_with_the_parent():
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, signal, time
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context
        from embed_core.procs import own_session_dying_with_parent
        pool = ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=own_session_dying_with_parent,
                                   initargs=(signal.SIGKILL, os.getpid()))
        busy = pool.submit(time.sleep, 600)
        while not pool._processes:
            time.sleep(0.1)
        time.sleep(1)  # its initializer has run
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(*pool._processes, flush=True)
        time.sleep(600)
    """)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, text=True, stdout=subprocess.PIPE,
        start_new_session=True)
    try:
        (worker,) = [int(pid) for pid in parent.stdout.readline().split()]
        assert os.getsid(worker) == worker != os.getsid(parent.pid)
        os.killpg(parent.pid, signal.SIGINT)  # a Ctrl-C: the parent ignores it, the worker never hears of it
        assert not gone(worker, seconds=1), "the worker got the signal sent to its parent's process group"
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert gone(worker), "the worker outlived its SIGKILLed parent"


def test_the_llama_server_command_line_dies_with_its_sigkilled_parent():
    """The command ``LlamaCppServer`` starts, with a tiny Python program in place of the server."""
    kill_parent_and_check_children("""
        import subprocess, sys, time
        from embed_core.synthesize.server import LlamaCppServer
        command = LlamaCppServer("model.gguf", model_alias="m").command()
        server = command.index("llama_cpp.server") - 2  # [... wrapper ..., python, -m, llama_cpp.server, ...]
        assert command[server] == sys.executable and command[:server], command
        child = subprocess.Popen(command[:server] + [sys.executable, "-c", "import time; print('ready', flush=True); "
                                                     "time.sleep(600)"], start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(600)
    """)


def test_a_process_whose_parent_is_gone_commits_nothing(tmp_path):
    """The guard behind the death signal: armed with no signal (0), the orphan runs on and its
    commit is refused; the previous artifact stays as it was."""
    (tmp_path / "stage").mkdir()
    (tmp_path / "stage/manifest.json").write_text("{}")
    (tmp_path / "orphan.py").write_text(textwrap.dedent("""
        import os, sys, time
        from pathlib import Path
        from embed_core.artifacts import StageWriter
        from embed_core.procs import ParentGone, die_with_parent
        parent, run_dir = int(sys.argv[1]), Path(sys.argv[2])
        die_with_parent(0, parent)
        print("armed", flush=True)
        while os.getppid() == parent:
            time.sleep(0.05)
        try:
            with StageWriter(run_dir, "stage") as writer:
                writer.write_file("out.txt", b"orphan", kind="text")
                writer.commit({"input_fingerprint": "x"})
        except ParentGone as exc:
            (run_dir / "refused").write_text(str(exc))
    """))
    parent = python(f"""
        import os, subprocess, sys
        child = subprocess.Popen([sys.executable, {str(tmp_path / "orphan.py")!r}, str(os.getpid()), {str(tmp_path)!r}],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "armed"
        print(child.pid, flush=True)
    """)
    child = int(parent.stdout.readline())
    parent.wait()  # the parent exits; the child, armed with no signal, lives on and tries to commit
    assert gone(child)
    assert "not committing stage: the process that started this one" in (tmp_path / "refused").read_text()
    assert sorted(p.name for p in (tmp_path / "stage").iterdir()) == ["manifest.json"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".stage.")]


def test_a_guarded_process_is_killed_once_the_process_that_guards_it_is_sigkilled():
    """The sleeper knows nothing of its parent (no death signal, its own session), as the agents a
    raylet starts; the guard kills it when the parent dies."""
    kill_parent_and_check_children("""
        import subprocess, sys, time
        from embed_core import procs
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        guard = procs.guard(procs.descendants())
        print(sleeper.pid, guard.pid, flush=True)
        print("ready", flush=True)
        time.sleep(600)
    """)


def test_a_released_guard_kills_nothing():
    parent = python("""
        import subprocess, sys
        from embed_core import procs
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        procs.release(procs.guard([sleeper.pid]))
        print(sleeper.pid, flush=True)
    """)
    sleeper = int(parent.stdout.readline())
    parent.wait()
    try:
        assert not gone(sleeper, seconds=2)
    finally:
        os.kill(sleeper, signal.SIGKILL)
