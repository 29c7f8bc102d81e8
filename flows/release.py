"""The release decision in a flow run: a candidate the gate held pauses the run for a person's
approval in the Prefect UI (a typed form: approve, note), with a timeout that rejects it."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.logging import get_run_logger
from pydantic import Field

from embed_core.config import RunConfig
from embed_core.stage_dirs import GATE


class ReleaseApproval(RunInput):
    """The form the Prefect UI shows on a paused run whose candidate failed the release gate."""

    approve: bool = Field(False, description="Make the candidate the current release despite the gate.")
    note: str = Field("", description="Why (kept on the release version in the registry).")


@task(name="settle-release", cache_policy=NO_CACHE, persist_result=False)
def settle_task(config: RunConfig, run_dir: Path):
    from embed_core.release.run import settle

    return settle(config, run_dir)


@task(name="decide-release", cache_policy=NO_CACHE, persist_result=False)
def decide_task(config: RunConfig, run_dir: Path, version: int, approve: bool, decision: str):
    from embed_core.release.run import promote, reject

    return promote(config, run_dir, version, decision) if approve else reject(config, version, decision)


def pauses_here(config: RunConfig) -> bool:
    """Whether a held candidate pauses this flow run (``release.approval``)."""
    from prefect.runtime import deployment, flow_run

    policy = config.release.approval
    return policy == "always" or (policy == "deployments" and bool(deployment.id or flow_run.parent_deployment_id))


def _duration(seconds: int) -> str:
    return f"{seconds} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:g} h"


def settle_release(config: RunConfig, run_dir: Path) -> str:
    """Settle the run's candidate; a held one waits for a decision here when ``pauses_here``.
    Returns what happened (promoted, current, held, kept out, none)."""
    logger = get_run_logger()
    outcome = settle_task(config, run_dir)
    logger.info("release: %s", outcome.line)
    if outcome.action != "held" or not pauses_here(config):
        return outcome.action
    report = (Path(run_dir) / GATE / "report.md").read_text(encoding="utf-8")
    form = ReleaseApproval.with_initial_data(
        description=f"{report}\n\nApprove to make v{outcome.version} the current release; reject (leave approve off) "
                    f"to keep the current one. Without an answer within {_duration(config.release.approval_timeout_s)} "
                    "the candidate is rejected.", approve=False)
    timeout = config.release.approval_timeout_s
    try:
        answer = pause_flow_run(wait_for_input=form, timeout=timeout, poll_interval=min(5, max(1, timeout // 2)),
                                key=f"release-v{outcome.version}")
    except FlowPauseTimeout:
        decided = decide_task(config, run_dir, outcome.version, False,
                              f"rejected: no decision within {timeout} s")
        logger.warning("release: %s", decided.line)
        return decided.action
    verb = "approved" if answer.approve else "rejected"
    decided = decide_task(config, run_dir, outcome.version, answer.approve,
                          f"{verb} in the Prefect UI" + (f": {answer.note}" if answer.note else ""))
    logger.info("release: %s", decided.line)
    return decided.action
