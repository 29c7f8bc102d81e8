"""The prepare stage's config section: the raw sources, their cleaning and the contamination sets.

A source's common keys are here (``SourceSpec``); what only one kind has (a label mapping, a
BEIR split, a claim corpus ...) goes under ``params:`` and is validated against that kind's
converter (``embed_core.prepare.convert``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from embed_core.config_base import FileFormat, StrictModel, check_path_name
from embed_core.prepare.convert import CONVERTERS, ConverterParams
from embed_core.schema import TASKS


def _kind_parameter_error(kind: Any, key: str, value: Any) -> str | None:
    """What to write instead of a kind's parameter given at the top level of a source (None: no
    converter has a parameter ``key``)."""
    owners = [k for k, cls in CONVERTERS.items() if key in cls.Params.model_fields]
    if not owners or kind not in CONVERTERS:
        return None
    if kind in owners:
        return (f"'{key}' is a parameter of the {kind} converter: write params: "
                f"{{{key}: {json.dumps(value, default=str)}}}")
    theirs = ", ".join(CONVERTERS[kind].Params.model_fields)
    return (f"'{key}' is a parameter of the {', '.join(owners)} converter{'s' if len(owners) > 1 else ''}, "
            f"not of {kind} ({kind} parameters: {theirs or 'none'})")


class SourceSpec(FileFormat):
    """One raw source and how to turn it into records."""

    name: str = Field(description="Dataset name: the grouping key for batching and the output file name.")
    kind: str = Field(description="Converter to use: one of the source kinds listed below.",
                      json_schema_extra=lambda schema: schema.update(enum=list(CONVERTERS)))
    path: str = Field(description="File (or BEIR directory), relative to data_root. '.gz' is read transparently.")
    allow_empty: bool = Field(False, description="Accept a source with no data rows (otherwise an error).")
    dev_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="Set aside this fraction of the source's rows "
                                "(seeded, by source row, so both directions of a pair stay together) as dev records: "
                                "written to prepare/dev/{name}.parquet, never to training or mining.")
    dev_path: str | None = Field(None, description="A dev file of the same format and columns (e.g. STS-B's "
                                 "sts-dev.csv): all its rows are dev records. Not for beir (use dev_fraction).")
    task: str | None = Field(None, description="Override the task the kind implies.")
    instruction: str = Field("", description="Task instruction stored with every record.")
    max_rows: int | None = Field(None, ge=1, description="Read at most this many data rows (for samples).")
    match: Literal["text", "pair"] = Field(
        "text", description="Contamination sources only: 'text' excludes training records containing any "
        "test text; 'pair' (kinds of pairs: sts, entailment, pair_classification) only those containing a "
        "test pair.")
    # In the JSON schema (Prefect's parameter form) a mapping: its keys depend on the kind.
    params: Annotated[SerializeAsAny[ConverterParams], WithJsonSchema({"type": "object"})] = Field(
        default_factory=dict, validate_default=True,  # type: ignore[arg-type]
        description="Settings only this kind has (its parameters are listed below), e.g. "
        "{label_map: {...}} or {split: test}.")

    @model_validator(mode="before")
    @classmethod
    def _moved_kind_parameters(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                if key not in cls.model_fields:
                    moved = _kind_parameter_error(data.get("kind"), key, value)
                    if moved:
                        raise ValueError(moved)
        return data

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        if v not in CONVERTERS:
            raise ValueError(f"unknown source kind {v!r}; expected one of {', '.join(CONVERTERS)}")
        return v

    @field_validator("params", mode="before")
    @classmethod
    def _kind_params(cls, v: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("kind")
        if kind not in CONVERTERS:
            return {}  # the kind's own error is reported
        params_model = CONVERTERS[kind].Params
        try:
            return params_model.model_validate(v)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(map(str, first["loc"]))
            raise ValueError(f"{where + ': ' if where else ''}{first['msg'].removeprefix('Value error, ')} "
                             f"({kind} parameters: {', '.join(params_model.model_fields) or 'none'})") from None

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str | None) -> str | None:
        if v is not None and v not in TASKS:
            raise ValueError(f"unknown task {v!r}; expected one of {', '.join(TASKS)}")
        return v

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return check_path_name(v, "dataset name")

    @model_validator(mode="after")
    def _fits_the_kind(self) -> SourceSpec:
        converter = CONVERTERS[self.kind]
        converter.check_columns(self.columns)
        if self.dev_path and self.dev_fraction:
            raise ValueError("give dev_path or dev_fraction, not both")
        if self.dev_path and not converter.one_file:
            raise ValueError(f"{self.kind} sources set aside dev records with dev_fraction (dev_path is for files)")
        if self.match == "pair" and not converter.pair:
            pairs = ", ".join(k for k, c in CONVERTERS.items() if c.pair)
            raise ValueError(f"match 'pair' needs a kind of pairs ({pairs}), not '{self.kind}'")
        return self


class CleaningConfig(StrictModel):
    max_chars: int = Field(8000, ge=1, description="Texts longer than this are truncated or quarantined.")
    over_long: Literal["truncate", "quarantine"] = Field("truncate", description="Texts over max_chars: truncate them, or quarantine the row.")
    dedupe: Literal["none", "exact", "normalized"] = Field(
        "normalized", description="'normalized' removes exact duplicates, then duplicates after text normalisation.")


class NearDuplicateConfig(StrictModel):
    """Near-duplicate contamination exclusion: MinHash LSH proposes candidates, the exact Jaccard
    similarity of character-n-gram shingle sets decides (embed_core/prepare/near_dup.py)."""

    threshold: float = Field(0.8, gt=0.0, le=1.0, description="Jaccard similarity of the shingle sets at or "
                             "above which a training text is a near duplicate of an evaluation or dev text.")
    shingle: int = Field(5, ge=1, le=32, description="Shingle size: character n-grams of the normalised text "
                         "(case-folded, punctuation and whitespace collapsed). Characters, not words: a short "
                         "query with one word changed keeps most of its character n-grams.")
    num_perm: int = Field(128, ge=16, le=1024, description="MinHash permutations: more find candidates near "
                          "the threshold more reliably and cost proportionally more time per text.")


class PrepareConfig(StrictModel):
    sources: list[SourceSpec] = Field(min_length=1, description="Raw sources to convert, each into one dataset.")
    cleaning: CleaningConfig = Field(default_factory=CleaningConfig, description="Length limits and deduplication.")
    contamination: list[SourceSpec] = Field(
        default_factory=list,
        description="Evaluation sets whose texts must not appear in training records (QZhou §6.1).")
    near_duplicates: NearDuplicateConfig | None = Field(
        None, description="Also drop training records with a text that is a near duplicate (shingle Jaccard "
        "similarity) of a contamination or dev text, and list them in _near_duplicates.parquet; unset: off, "
        "only texts equal after normalisation are excluded.")

    @field_validator("sources", "contamination")
    @classmethod
    def _unique_names(cls, specs: list[SourceSpec]) -> list[SourceSpec]:
        seen: dict[str, int] = {}
        for i, spec in enumerate(specs):
            if spec.name in seen:
                raise ValueError(f"items {seen[spec.name]} and {i}: two sources are named {spec.name!r} (each source "
                                 "writes its own dataset: give them distinct names)")
            seen[spec.name] = i
        return specs
