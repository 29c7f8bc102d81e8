"""Local Prefect stack for embedpipe: a server (SQLite) on loopback, a process worker per work
pool, and the deployments of ``deployments/prefect.yaml``.

    python deployments/local.py serve [--port 4200] [--home .prefect-local]   # make serve
    python deployments/local.py stop  [--home .prefect-local]                 # make stop

``serve`` returns once everything is up and prints the UI URL and the state of each deployment's
schedule (the nightly data watch is active); the server and workers keep running in the background
(their PIDs are recorded in ``<home>/pids.json``, logs in ``<home>/logs/``) until ``stop``.
Prefect's state (database, cached results) lives in ``<home>``, not in ``~/.prefect``.
``<home>/stack.json`` names the running stack's UI, API and file server: the ``embedpipe``
command reads it to run on this server (``flows.local_server``); ``stop`` removes it with
``pids.json``. ``EMBEDPIPE_STACK_HOME`` is the default ``--home`` (both sides read it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POOLS = ("cpu", "gpu")  # names used in prefect.yaml; locally both are process pools
STATE_FILES = ("stack.json", "pids.json")  # what `stop` removes: no state names a stack that is gone


def stack_env(home: Path, port: int, poll_seconds: float) -> dict[str, str]:
    """The environment of the server and the workers (and so of every flow run): embedpipe's
    defaults (``flows.env``; a value the user set wins) and this stack's own settings."""
    from flows.env import apply_defaults

    env = apply_defaults(dict(os.environ))
    env.update({
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_WORKER_QUERY_SECONDS": str(poll_seconds),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    })
    return env


def _prefect() -> list[str]:
    return [sys.executable, "-m", "prefect"]


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        # own session: survives this script, and `stop` can end the whole process group
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return proc.pid


def _wait_healthy(url: str, timeout: float, pid: int, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if not _alive(pid):
            raise SystemExit(f"prefect server exited during start-up; see {log}")
        time.sleep(1)
    raise SystemExit(f"prefect server not healthy after {timeout:.0f} s; see {log}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run(cmd: list[str], env: dict[str, str]) -> None:
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd[2:])}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def serve(home: Path, port: int, poll_seconds: float, startup_timeout: float, files_root: Path,
          files_port: int) -> dict:
    home = home.resolve()
    pids_file = home / "pids.json"
    if pids_file.exists() and any(_alive(p) for p in json.loads(pids_file.read_text()).values()):
        raise SystemExit(f"a local stack is already running (see {pids_file}); `make stop` first")
    (home / "stack.json").unlink(missing_ok=True)  # a stack that died without `stop`: its state names no server
    env = stack_env(home, port, poll_seconds)
    logs = home / "logs"
    pids: dict[str, int] = {}
    # The run directories over http on loopback, so the file links of the UI's artifacts open
    # (a browser does not follow file:// links from a web page).
    files_root = files_root.resolve()
    files_root.mkdir(parents=True, exist_ok=True)
    pids["files"] = _spawn([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(files_root),
                            str(files_port)], env, logs / "files.log")
    env.update({"EMBEDPIPE_FILES_URL": f"http://127.0.0.1:{files_port}/", "EMBEDPIPE_FILES_ROOT": str(files_root)})
    pids["server"] = _spawn([*_prefect(), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env, logs / "server.log")
    pids_file.parent.mkdir(parents=True, exist_ok=True)
    pids_file.write_text(json.dumps(pids))
    _wait_healthy(env["PREFECT_API_URL"], startup_timeout, pids["server"], logs / "server.log")
    for pool in POOLS:
        _run([*_prefect(), "work-pool", "create", pool, "--type", "process", "--overwrite"], env)
        pids[f"worker-{pool}"] = _spawn([*_prefect(), "worker", "start", "--pool", pool, "--name", f"embedpipe-{pool}"],
                                        env, logs / f"worker-{pool}.log")
        pids_file.write_text(json.dumps(pids))
    _run([*_prefect(), "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"], env)
    info = {"ui": f"http://127.0.0.1:{port}", "api": env["PREFECT_API_URL"], "home": str(home), "pids": pids,
            "files": env["EMBEDPIPE_FILES_URL"], "files_root": str(files_root)}
    (home / "stack.json").write_text(json.dumps(info, indent=2))
    return info


def schedules(api: str) -> list[str]:
    """One line per deployment that has schedules: each schedule's cron, timezone and whether it is
    active (as the server has them, after the deploy), and how to pause it."""
    deployments = _post(f"{api}/deployments/filter", {})
    flows = {f["id"]: f["name"] for f in _post(f"{api}/flows/filter", {})}
    lines = []
    for dep in sorted(deployments, key=lambda d: d["name"]):
        if not dep.get("schedules"):
            continue
        name = f"{flows.get(dep['flow_id'], '?')}/{dep['name']}"
        states = [f"cron {s['schedule'].get('cron') or s['schedule']} ({s['schedule'].get('timezone') or 'UTC'}) "
                  f"{'ACTIVE' if s.get('active') and not dep.get('paused') else 'paused'}" for s in dep["schedules"]]
        lines.append(f"schedule of {name}: {', '.join(states)}; pause it with the toggle on its deployment page, or "
                     f"PREFECT_API_URL={api} prefect deployment schedule pause {name} --all")
    return lines


def _post(url: str, body: dict) -> list[dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())


def stop(home: Path, grace: float = 15.0) -> list[str]:
    home = home.resolve()
    pids_file = home / "pids.json"
    if not pids_file.exists():
        (home / "stack.json").unlink(missing_ok=True)
        return []
    pids: dict[str, int] = json.loads(pids_file.read_text())
    stopped = []
    # workers first, so no new flow run starts while the server goes away
    for name, pid in sorted(pids.items(), key=lambda kv: kv[0] == "server"):
        if not _alive(pid):
            continue
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + grace
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                os.waitpid(pid, os.WNOHANG)  # reap if it is our child (tests)
            except ChildProcessError:
                pass
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
        stopped.append(name)
    for name in STATE_FILES:
        (home / name).unlink(missing_ok=True)
    return stopped


def _default_home() -> Path:
    home = os.environ.get("EMBEDPIPE_STACK_HOME")  # flows.local_server.STACK_HOME_ENV
    return Path(home) if home else REPO / ".prefect-local"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, default=int(os.environ.get("EMBEDPIPE_PREFECT_PORT", 4200)))
    s.add_argument("--home", type=Path, default=_default_home())
    s.add_argument("--poll-seconds", type=float, default=5.0, help="how often workers look for runs")
    s.add_argument("--startup-timeout", type=float, default=300.0)
    s.add_argument("--files-root", type=Path, default=REPO / "runs", help="run directories served for the UI's links")
    s.add_argument("--files-port", type=int, default=int(os.environ.get("EMBEDPIPE_FILES_PORT", 4280)))
    t = sub.add_parser("stop")
    t.add_argument("--home", type=Path, default=_default_home())
    args = p.parse_args(argv)
    if args.command == "serve":
        info = serve(args.home, args.port, args.poll_seconds, args.startup_timeout, args.files_root, args.files_port)
        print(f"Prefect UI: {info['ui']}\nAPI: {info['api']}   state: {info['home']}   run files: {info['files']}\n"
              f"work pools: {', '.join(POOLS)} (one process worker each)   deployments: deployments/prefect.yaml")
        print("\n".join(schedules(info["api"])))
        print("`embedpipe` commands run on this server while it is up (their runs show in the UI)\n"
              "stop with: make stop")
    else:
        stopped = stop(args.home)
        print(f"stopped: {', '.join(stopped)}" if stopped else "nothing running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
