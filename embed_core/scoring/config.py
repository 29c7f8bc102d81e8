"""What an MTEB task on local files is (``EvalTaskSpec``: the evaluate stage's tasks and, through
``DevTaskSpec``, a train stage's dev tasks) and the libraries whose versions shape its score."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from embed_core.config_base import FileFormat, check_path_name

EvalTaskType = Literal["sts", "retrieval", "classification", "pair_classification"]
# Libraries whose versions shape an MTEB score (part of the code identity of evaluate, and of a train
# stage with dev tasks: embed_core.fingerprint).
SCORING_LIBRARIES = ("torch", "transformers", "mteb", "numpy", "scikit-learn")


class EvalTaskSpec(FileFormat):
    """One evaluation task on local files. When ``name`` is an MTEB task name (STSBenchmark, SICK-R,
    SciFact, Banking77Classification, EmotionClassification, AmazonCounterfactualClassification, …)
    MTEB's own task definition is used (metric, splits, classifier protocol, prompt) and only the
    data comes from here; any other name defines a local task of ``type``."""

    name: str = Field(description="Task name; an MTEB name reuses MTEB's task definition.")
    type: EvalTaskType = Field(description="Task type (decides the file layout and the MTEB evaluator).")
    path: str | list[str] = Field(description="sts / pair_classification / classification: the evaluated file "
                                  "(a list is read in order as one split, e.g. SICK-R's three files); "
                                  "retrieval: a BEIR directory (corpus.jsonl[.gz], queries.jsonl, qrels/{split}.tsv).")
    train_path: str | None = Field(None, description="classification: file the classifier is fitted on (read "
                                   "with the same format settings).")
    label_map: dict[str, int] | None = Field(None, description="pair_classification: raw label -> 0/1.")
    split: str = Field("test", description="Split name reported (and the BEIR qrels split).")
    subset: str = Field("default", description="MTEB subset (e.g. 'en' for AmazonCounterfactualClassification).")
    main_metric: str | None = Field(None, description="Default: MTEB's main score for the task or type.")
    score_range: tuple[float, float] = Field((0.0, 5.0), description="sts: gold score range.")
    instruction: str | None = Field(None, description="Instruction for instruction-following models "
                                                      "(default: MTEB's task prompt, else none).")
    max_rows: int | None = Field(None, ge=1, description="Evaluate only the first N rows/queries (smoke runs).")
    max_corpus: int | None = Field(None, ge=1, description="retrieval: search a corpus of N documents: every "
                                   "document judged for the evaluated queries plus a seeded sample of the others "
                                   "(quick runs; scores are not comparable with the full corpus's, so give the task "
                                   "its own name).")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return check_path_name(v, "task name")
