"""Evaluation on dev tasks while a stage trains, and the selection of the weights a stage keeps.

Every ``dev.eval_every`` steps (and at the last step) rank 0 scores the stage's dev tasks with
mteb — the same task definitions, metrics and instruction handling as the evaluate stage
(``embed_core.scoring``, which both use), on the model being trained (in eval mode, no gradients, no embedding
cache: the weights change). Dev tasks come from files (like evaluation tasks) or from the dev
records prepare set aside (``dataset: <name>``); evaluate's test sets are never read here.

The selection score is the weighted mean of the tasks' main scores; ``select: best`` keeps the
weights of the best one (saved under the stage's checkpoint directory, so a resumed run keeps its
best), ``select: last`` the final step's.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embed_core.artifacts import read_records
from embed_core.config import RunConfig
from embed_core.errors import ConfigError
from embed_core.scoring.config import EvalTaskSpec
from embed_core.scoring.model import EvalModel
from embed_core.model.settings import ModelSettings
from embed_core.schema import CLS_TASKS, PAIR_TASKS
from embed_core.stage_dirs import PREPARE
from embed_core.train.config import DevConfig, DevTaskSpec

log = logging.getLogger("embedpipe.train")


def materialize(spec: DevTaskSpec, run_dir: Path, work_dir: Path) -> EvalTaskSpec:
    """The dev task as an evaluation task spec; a ``dataset`` task's dev records are written to
    ``work_dir`` in the local task layout of its type (``_WRITERS``)."""
    fields = spec.model_dump(exclude={"dataset", "weight"})
    if not spec.dataset:
        return EvalTaskSpec(**fields)
    if spec.type not in _WRITERS:
        raise ConfigError(f"dev task {spec.name}: dev records make {', '.join(_WRITERS)} tasks, not {spec.type} "
                          "(give the task a path instead)")
    tables = read_records(run_dir, PREPARE, kind="dev_records")
    table = tables.get(f"dev/{spec.dataset}.parquet")
    if table is None or table.num_rows == 0:
        raise ConfigError(f"dev task {spec.name}: prepare set aside no dev records for dataset {spec.dataset!r} "
                          "(give the source dev_fraction or dev_path)")
    # absolute: a task path that is relative resolves against data_root, not the working directory
    out = work_dir.resolve() / f"dev-{spec.name}"
    out.mkdir(parents=True, exist_ok=True)
    return EvalTaskSpec(**{**fields, **_WRITERS[spec.type](spec, table.to_pylist(), out)})


def _sts(spec: DevTaskSpec, records: list[dict], out: Path) -> dict[str, Any]:
    """Scored pair records (sts, nli, pair_classification) as an sts CSV: both directions of a
    pair are one dev pair."""
    seen: set[tuple[str, str]] = set()
    with open(out / "pairs.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["sentence1", "sentence2", "score"])
        for r in records:
            if r["task"] not in PAIR_TASKS or not r["positive_scores"]:
                continue
            key = tuple(sorted((r["query"], r["positives"][0])))
            if key not in seen:
                seen.add(key)
                writer.writerow([r["query"], r["positives"][0], r["positive_scores"][0]])
    lo = min((r["positive_scores"][0] for r in records if r["positive_scores"]), default=0.0)
    hi = max((r["positive_scores"][0] for r in records if r["positive_scores"]), default=1.0)
    return {"path": str(out / "pairs.csv"), "format": "csv", "header": True, "columns": {},
            "score_range": (min(lo, 0.0), max(hi, lo + 1e-6))}


def _retrieval(spec: DevTaskSpec, records: list[dict], out: Path) -> dict[str, Any]:
    """Each record's query searching a BEIR corpus of every record's positives and negatives."""
    docs: dict[str, str] = {}
    (out / "qrels").mkdir(exist_ok=True)
    with open(out / "queries.jsonl", "w", encoding="utf-8") as q, open(out / "qrels/test.tsv", "w", encoding="utf-8") as j:
        j.write("query-id\tcorpus-id\tscore\n")
        for i, r in enumerate(records):
            q.write(json.dumps({"_id": f"q{i}", "text": r["query"]}) + "\n")
            for text in (*r["positives"], *r["negatives"]):
                docs.setdefault(text, f"d{len(docs)}")
            for text in r["positives"]:
                j.write(f"q{i}\t{docs[text]}\t1\n")
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as c:
        for text, did in docs.items():
            c.write(json.dumps({"_id": did, "title": "", "text": text}) + "\n")
    return {"path": str(out), "split": "test"}


def _classification(spec: DevTaskSpec, records: list[dict], out: Path) -> dict[str, Any]:
    """Classification records (example-based: a text, a text of its label, texts of other labels)
    as a linear-probe task: the records' texts are the evaluated split, and the classifier is fitted
    on the other texts they carry with their labels (positives and negatives), never on an
    evaluated text."""
    rows = [(r["query"], r["label"]) for r in records if r["task"] in CLS_TASKS and r["label"]]
    if len({label for _, label in rows}) < 2:
        raise ConfigError(f"dev task {spec.name}: dataset {spec.dataset!r} set aside classification dev records "
                          "of fewer than 2 labels")
    evaluated = {text for text, _ in rows}
    fitted: dict[str, str] = {}
    for r in records:
        if r["task"] in CLS_TASKS:
            labelled = [(t, r["label"]) for t in r["positives"]] + list(zip(r["negatives"], r["negative_labels"]))
            fitted.update((t, lab) for t, lab in labelled if t not in evaluated and lab)
    for name, pairs in (("test.csv", rows), ("train.csv", sorted(fitted.items()))):
        with open(out / name, "w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(["text", "label"])
            writer.writerows(pairs)
    return {"path": str(out / "test.csv"), "train_path": str(out / "train.csv"), "format": "csv", "header": True,
            "multiline": True, "columns": {"text": "text", "label": "label"}}


_WRITERS = {"sts": _sts, "retrieval": _retrieval, "classification": _classification}


class LiveModel(EvalModel):
    """The evaluator's encoder over the model being trained: the same instructions and prompts as
    ``EvalModel``, encoded by the trainer's ``Embedder`` without a cache."""

    def __init__(self, embedder, settings: ModelSettings, *, batch_size: int = 64, bf16: bool = False):
        from mteb.models.model_meta import ModelMeta, ScoringFunction

        self.embedder = embedder
        self.bf16 = bf16
        self.settings = settings
        self.batch_size = batch_size
        self.label = "training"
        self.model_prompts = None
        self.mteb_model_meta = ModelMeta.create_empty(overwrites=dict(
            name="embedpipe/training", revision="live", embed_dim=embedder.dim, max_tokens=settings.max_length,
            similarity_fn_name=ScoringFunction.COSINE, use_instructions=settings.use_instructions,
            framework=["PyTorch"], loader=None, modalities=["text"]))

    def _encode_texts(self, texts: list[str]) -> np.ndarray:
        device = next(self.embedder.parameters()).device
        out = []
        # the training precision: a bf16 run's dev encodes in bf16 autocast too (fp32 GEMMs would be
        # several times slower on a GPU, and score a model unlike the one trained)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16):
            for i in range(0, len(texts), self.batch_size):
                features = self.embedder.tokenize(texts[i:i + self.batch_size])  # pools over every token, as EvalModel
                out.append(self.embedder({k: v.to(device) for k, v in features.items()}).float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, self.embedder.dim), dtype=np.float32)

    def encode(self, inputs, *, task_metadata, hf_split: str, hf_subset: str, prompt_type=None, **kwargs: Any):
        return self._encode_texts(self.model_inputs(inputs, task_metadata, prompt_type))


class DevEvaluator:
    def __init__(self, dev: DevConfig, config: RunConfig, run_dir: Path, work_dir: Path, settings: ModelSettings,
                 batch_size: int = 64):
        from embed_core.scoring.tasks import build_task

        self.dev = dev
        self.settings = settings
        self.batch_size = batch_size
        self.weights = {t.name: t.weight for t in dev.tasks}
        self.tasks = []
        for spec in dev.tasks:
            task_spec = materialize(spec, Path(run_dir), Path(work_dir))
            if task_spec.max_rows is None and dev.max_rows is not None:
                task_spec = task_spec.model_copy(update={"max_rows": dev.max_rows})
            self.tasks.append((spec.name, build_task(task_spec, config.resolve, seed=config.seed)))

    def score(self, embedder, bf16: bool = False) -> dict[str, float]:
        """Main score of every dev task for the model as it is now (its training mode restored after),
        encoded under bf16 autocast when ``bf16`` (the training precision)."""
        import mteb

        was_training = embedder.training
        embedder.eval()
        try:
            model = LiveModel(embedder, self.settings, batch_size=self.batch_size, bf16=bf16)
            scores = {}
            for name, task in self.tasks:
                result = mteb.evaluate(model, task, cache=None, overwrite_strategy="always", show_progress_bar=False)
                scores[name] = float(result.task_results[0].get_score())
            return scores
        finally:
            embedder.train(was_training)

    def selection_score(self, scores: dict[str, float]) -> float:
        total = sum(self.weights[n] for n in scores)
        return sum(self.weights[n] * v for n, v in scores.items()) / total if total else float("nan")
