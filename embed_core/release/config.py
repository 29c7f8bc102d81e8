"""The ``release`` config section: where a run's releases are registered, the gate a trained model
passes against the current release, and who approves one that fails it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from embed_core.config_base import StrictModel
from embed_core.scoring.config import EvalTaskSpec


class GateConfig(StrictModel):
    """Releases (``embed_core.release``): each model the evaluate stage checked is registered as a
    version of a registered model in MLflow's model registry; the alias ``current`` names the one in
    use. A new version becomes current only when it scores no worse than the current release on the
    guard tasks and probes (within a tolerance each); otherwise it is held for a person's approval.
    Needs MLflow (the ``tracking`` extra, part of ``dev``)."""

    registry_uri: str | None = Field(None, description="MLflow registry URI (sqlite:///path.db, http://host:5000); "
                                     "None = the tracking URI (tracking.uri, else sqlite:///{run_root}/mlflow.db, "
                                     "with artifacts in {run_root}/mlartifacts).")
    name: str | None = Field(None, description="Registered model name; None = embedpipe-{run_name}.")
    guard_tasks: list[str] | None = Field(None, description="evaluate.tasks the gate compares on; None = every one.")
    tolerance: float = Field(0.5, ge=0, description="Largest drop allowed on a guard task or probe, in score points "
                             "(main score × 100): 0.5 lets a candidate 0.5 below the current release pass.")
    tolerances: dict[str, float] = Field(default_factory=dict, description="Per task or probe name: its own "
                                         "tolerance in points, over `tolerance`.")
    probes: list[EvalTaskSpec] = Field(default_factory=list, description="General-skill tasks that stay fixed "
                                       "across data changes (same schema as evaluate.tasks), scored for the candidate "
                                       "and the current release by the gate only.")
    approval: Literal["deployments", "always", "never"] = Field(
        "deployments", description="A candidate that fails the gate: deployments = the flow run pauses for approval "
        "in the Prefect UI when it runs as a deployment (a schedule, the UI), and is held otherwise; always = every "
        "flow run pauses; never = held (promote it with `embedpipe release promote`).")
    approval_timeout_s: int = Field(86400, ge=1, description="Seconds a paused run waits for a decision; then the "
                                    "candidate is rejected and the run goes on.")
