"""Screenshots of the Prefect UI for the README, with headless Chromium against a running local
server (``make serve``, then run the pipeline deployment once):

    python deployments/screenshots.py [--ui http://127.0.0.1:4200] [--out docs] [--flow-run ID]

Writes ``deployment-form.png`` (the pipeline deployment's run form), ``run-page.png`` (the newest
completed pipeline run: task graph with the train child run, logs), that run's stage table and
evaluation report artifacts (``run-artifact-stages.png``, ``run-artifact-report.png``) and, when
there is one, the newest failed run (``run-failed.png``). Needs Debian's ``chromium`` package.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The flags keep Chromium off the network (this machine has none) and out of the user's profile.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


def shoot(url: str, out: Path, size: str = "1440,1100", wait_ms: int = 20000) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium not found (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
                        f"--virtual-time-budget={wait_ms}", f"--screenshot={out}", url],
                       check=True, capture_output=True, timeout=180)
    print(f"{out}  <- {url}")


async def _ids(api: str, run_id: str | None) -> tuple[str, str, dict[str, str], str | None]:
    """The pipeline deployment, its newest completed run (or ``run_id``) with that run's keyed
    artifacts, and its newest failed run (None if it has none)."""
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterDeploymentId, FlowRunFilterId,
                                                FlowRunFilterState, FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    async with PrefectClient(api) as client:
        dep = await client.read_deployment_by_name("pipeline/embedpipe-pipeline")

        async def newest(state: StateType) -> list:
            return await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[dep.id]),
                                              state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[state]))),
                sort=FlowRunSort.END_TIME_DESC, limit=1)

        runs, failed = await newest(StateType.COMPLETED), await newest(StateType.FAILED)
        if run_id is not None:
            runs = [await client.read_flow_run(run_id)]
        if not runs:
            raise SystemExit("no completed run of pipeline/embedpipe-pipeline yet: run it once first")
        arts = await client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[runs[0].id])))
        return (str(dep.id), str(runs[0].id), {a.key: str(a.id) for a in arts if a.key},
                str(failed[0].id) if failed else None)


def keyed(artifacts: dict[str, str], prefix: str) -> str | None:
    """The id of the run's artifact whose key is ``prefix-<run name>`` (a run name may hold dashes)."""
    return next((art_id for key, art_id in sorted(artifacts.items()) if key.startswith(prefix + "-")), None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ui", default="http://127.0.0.1:4200")
    p.add_argument("--out", type=Path, default=Path("docs"))
    p.add_argument("--flow-run", help="id of the pipeline run to show (default: the newest completed one)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    deployment_id, run_id, artifacts, failed_id = asyncio.run(_ids(f"{args.ui}/api", args.flow_run))
    shoot(f"{args.ui}/deployments/deployment/{deployment_id}/run", args.out / "deployment-form.png", size="1440,1300")
    # tall: the logs down to the hand-off to the gpu pool and the training progress it follows
    shoot(f"{args.ui}/runs/flow-run/{run_id}", args.out / "run-page.png", size="1440,2500")
    if failed_id is not None:
        shoot(f"{args.ui}/runs/flow-run/{failed_id}", args.out / "run-failed.png", size="1440,1100")
    # the UI's tabs are not addressable by URL: the run's key artifacts have pages of their own
    for prefix, name in (("pipeline-stages", "run-artifact-stages.png"), ("evaluate-report", "run-artifact-report.png")):
        art_id = keyed(artifacts, prefix)
        if art_id is None:
            raise SystemExit(f"the run has no {prefix}-<run name> artifact (artifacts: {', '.join(sorted(artifacts))})")
        shoot(f"{args.ui}/artifacts/artifact/{art_id}", args.out / name, size="1440,1300")
    return 0


if __name__ == "__main__":
    sys.exit(main())
