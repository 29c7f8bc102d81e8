"""MTEB task objects whose data comes from local files.

A task named like an MTEB task (``STSBenchmark``, ``SICK-R``, ``SciFact``,
``Banking77Classification``, …) is MTEB's own task class — same main score, splits, classifier
protocol (samples per label, number of experiments, seed) and prompt — with only ``load_data``
replaced, so scores are comparable with the MTEB leaderboard and, where the hub is reachable, the
same name resolves to MTEB's hosted data. Any other name builds a local task on the mteb
abstract type (``AbsTaskSTS``, ``AbsTaskRetrieval``, ``AbsTaskClassification``,
``AbsTaskPairClassification``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from embed_core.scoring.config import EvalTaskSpec
from embed_core.errors import ConfigError, EmbedpipeError
from embed_core.scoring import data as local_data

MTEB_TYPES = {"sts": "STS", "retrieval": "Retrieval", "classification": "Classification",
              "pair_classification": "PairClassification"}
DEFAULT_MAIN_SCORE = {"sts": "cosine_spearman", "retrieval": "ndcg_at_10", "classification": "accuracy",
                      "pair_classification": "max_ap"}
_LOADERS = {"sts": local_data.load_sts, "pair_classification": local_data.load_pair_classification,
            "classification": local_data.load_classification, "retrieval": local_data.load_retrieval}


def check_main_score(task: str, metric: str, value: float) -> float:
    """``value``, or an error naming the task when its main score is not a number: a NaN (a
    correlation over constant scores, an average over nothing) must never be reported as a result."""
    if math.isnan(value) or math.isinf(value):
        raise EmbedpipeError(f"evaluate: task {task}: main score {metric} is {value} (undefined: its data "
                             "is degenerate, e.g. constant gold scores or one class only); fix the task's files")
    return value


def _abstract_class(kind: str):
    from mteb.abstasks.classification import AbsTaskClassification
    from mteb.abstasks.pair_classification import AbsTaskPairClassification
    from mteb.abstasks.retrieval import AbsTaskRetrieval
    from mteb.abstasks.sts import AbsTaskSTS

    return {"sts": AbsTaskSTS, "retrieval": AbsTaskRetrieval, "classification": AbsTaskClassification,
            "pair_classification": AbsTaskPairClassification}[kind]


def mteb_task(name: str):
    """MTEB's registered task of this name, or None (registry lookup only; nothing is downloaded)."""
    import mteb

    try:
        return mteb.get_task(name)
    except (KeyError, ValueError):
        return None


def _local_metadata(spec: EvalTaskSpec):
    from mteb.abstasks.task_metadata import TaskMetadata

    return TaskMetadata(
        name=spec.name,
        description=f"Local {spec.type} task {spec.name} (embedpipe).",
        dataset={"path": f"local/{spec.name}", "revision": "local"},
        type=MTEB_TYPES[spec.type],
        category="t2t" if spec.type != "classification" else "t2c",
        modalities=["text"],
        eval_splits=[spec.split],
        eval_langs=["eng-Latn"],
        main_score=spec.main_metric or DEFAULT_MAIN_SCORE[spec.type],
        prompt=spec.instruction,
    )


def _labels_read_once(calculate_scores: Callable) -> Callable:
    """mteb's classification ``_calculate_scores`` with the gold labels read into one array first.
    mteb passes them as the test split's lazy ``datasets`` column, which each of sklearn's seven
    metrics reads again row by row (Banking77: 40 experiments × 7 metrics × 3,080 rows, 20 of the
    27 s a classification evaluation took on 2 cores); ``[:]`` reads a column, a list or an array
    whole."""
    import numpy as np

    def read_once(self, y_test, y_pred):
        return calculate_scores(self, np.asarray(y_test[:]), y_pred)

    return read_once


def build_task(spec: EvalTaskSpec, resolve: Callable[[str], Path], seed: int = 42) -> Any:
    """An mteb task object for ``spec`` that loads its data with ``resolve``d local paths."""
    registered = mteb_task(spec.name)
    if registered is not None:
        expected = MTEB_TYPES[spec.type]
        if registered.metadata.type != expected:
            raise ConfigError(f"evaluate.tasks[{spec.name}]: MTEB's {spec.name} is a {registered.metadata.type} "
                              f"task, not {expected}")
        base = type(registered)
        metadata = registered.metadata
        if spec.main_metric and spec.main_metric != metadata.main_score:
            metadata = metadata.model_copy(update={"main_score": spec.main_metric})
        if spec.instruction is not None:
            metadata = metadata.model_copy(update={"prompt": spec.instruction})
        if spec.split not in metadata.eval_splits:
            raise ConfigError(f"evaluate.tasks[{spec.name}]: split {spec.split!r} is not one of MTEB's "
                              f"eval splits {metadata.eval_splits}")
        metadata = metadata.model_copy(update={"eval_splits": [spec.split]})
    else:
        base = _abstract_class(spec.type)
        metadata = _local_metadata(spec)

    loader = _LOADERS[spec.type]

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        if self.data_loaded:
            return
        split_data = loader(spec, resolve)
        if spec.type == "retrieval":  # retrieval data is always keyed by subset, then split
            self.dataset = {spec.subset: {spec.split: split_data}}
        elif self.metadata.is_multilingual:
            self.dataset = {spec.subset: split_data}
        else:
            self.dataset = split_data
        self.data_loaded = True

    attrs: dict[str, Any] = {"metadata": metadata, "load_data": load_data, "__module__": __name__}
    if spec.type == "classification":
        attrs["train_split"] = "train"
        if hasattr(base, "_calculate_scores"):
            attrs["_calculate_scores"] = _labels_read_once(base._calculate_scores)
    task_cls = type(f"Local{base.__name__}", (base,), attrs)
    task = task_cls(seed=seed)
    if metadata.is_multilingual:
        if spec.subset not in metadata.hf_subsets:
            raise ConfigError(f"evaluate.tasks[{spec.name}]: subset {spec.subset!r} is not one of "
                              f"{', '.join(metadata.hf_subsets)}")
        task.hf_subsets = [spec.subset]
    if spec.type == "sts":
        # MTEB normalises gold scores with the class's min/max; local STS tasks take the configured range
        if registered is None:
            task.min_score, task.max_score = spec.score_range
    return task
