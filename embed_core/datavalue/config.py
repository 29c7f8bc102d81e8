"""A training stage's ``data_value`` section: the budget and the units of its data-value gate.
A leaf (pydantic and ``embed_core.config_base`` only), so the train config can import it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from embed_core.config_base import StrictModel

# Unit kinds: a data source (one dataset, by its prepare.sources name) and a synthetic strategy
# (the records of one origin: paraphrase, augmentation, llm_negative, synthetic = corpus queries).
SOURCE, SYNTHETIC = "dataset", "origin"
SYNTHETIC_ORIGINS = ("paraphrase", "augmentation", "llm_negative", "synthetic")
Mode = Literal["leave_one_out", "add_one_in"]


class DataValueConfig(StrictModel):
    """The data-value gate of one training stage (opt-in): before the stage, a reference proxy
    (every unit) and one proxy per unit, each with every seed, are short trainings of the stage's
    own recipe at ``steps`` steps, scored on the stage's dev tasks; each unit is then kept,
    down-weighted or dropped (``embed_core.datavalue.rule``), and the stage trains on the result."""

    steps: int = Field(200, ge=1, description="Optimizer steps of each proxy training (the stage's recipe at this "
                       "budget; its warm-up scaled by steps / the stage's steps).")
    seeds: int = Field(3, ge=2, le=20, description="Seeds each proxy runs with (1..seeds); the spread over them is "
                       "the noise a unit's delta must exceed to drop it.")
    max_proxy_runs: int = Field(40, ge=1, description="The gate refuses, with one line, to start more proxy "
                                "trainings than this (cached ones count: they are what it would cost afresh).")
    down_weight: float = Field(0.5, gt=0, lt=1, description="Weight multiplier of a unit that measured harmful "
                               "within the noise (its dataset_weight or origin_weight times this).")
    z: float = Field(1.0, gt=0, description="A unit is dropped when its mean delta is below -z standard errors.")
    units: list[str] | None = Field(None, description="Units to measure, each 'dataset:NAME' (a data source) or "
                                    "'origin:ORIGIN' (a synthetic strategy: origin:paraphrase, origin:augmentation, "
                                    "origin:llm_negative, origin:synthetic = corpus queries); None = every dataset "
                                    "the stage trains on and every synthetic origin its records have.")
    source_mode: Mode = Field("leave_one_out", description="How a data source is measured: leave_one_out = the "
                              "reference's score minus the score without it; add_one_in = the score of the base "
                              "(every unit measured add_one_in left out) with it, minus the base's.")
    synthetic_mode: Mode = Field("add_one_in", description="How a synthetic strategy is measured (as source_mode).")

    @field_validator("units")
    @classmethod
    def _unit_names(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        for unit in v:
            kind, _, name = unit.partition(":")
            if kind not in (SOURCE, SYNTHETIC) or not name:
                raise ValueError(f"data_value.units: {unit!r} is not 'dataset:NAME' or 'origin:ORIGIN'")
            if kind == SYNTHETIC and name not in SYNTHETIC_ORIGINS:
                raise ValueError(f"data_value.units: {unit!r}: a synthetic origin is one of "
                                 f"{', '.join(SYNTHETIC_ORIGINS)}")
        if len(set(v)) != len(v):
            raise ValueError("data_value.units: a unit is listed twice")
        return v

    def mode_of(self, unit: str) -> Mode:
        return self.source_mode if unit.startswith(SOURCE + ":") else self.synthetic_mode
