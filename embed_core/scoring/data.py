"""Read local evaluation files into the ``datasets.Dataset`` layouts MTEB's task types expect.

Evaluation data must be exact, so a bad row is an error (naming file, row and field) rather than
a quarantined row: silently dropping test pairs would change the score.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from embed_core.scoring.config import EvalTaskSpec
from embed_core.errors import RowError, SourceError
from embed_core.prepare.convert import CONVERTERS
from embed_core.prepare.convert.beir import beir_files, read_qrels, read_queries
from embed_core.prepare.readers import RawRow, excerpt, read_jsonl, read_rows, root_for

# The columns of a task file are those of the prepare source kind of the same name.
DEFAULT_COLUMNS: dict[str, dict[str, str | int]] = {
    kind: dict(CONVERTERS[kind].columns) for kind in ("sts", "pair_classification", "classification")}


def _paths(spec: EvalTaskSpec, resolve, attr: str = "path") -> list[tuple[Path, str, Path]]:
    """(path, display, root: the folder it may not leave) of each file of ``attr``."""
    raw = getattr(spec, attr)
    items = raw if isinstance(raw, list) else [raw]
    return [(resolve(p), p, root_for(resolve, p)) for p in items]


def _columns(spec: EvalTaskSpec) -> dict[str, str | int]:
    cols = dict(DEFAULT_COLUMNS[spec.type])
    cols.update(spec.columns)
    unknown = set(spec.columns) - set(DEFAULT_COLUMNS[spec.type])
    if unknown:
        raise SourceError(f"evaluate.tasks[{spec.name}]", None, sorted(unknown)[0], "config",
                          f"unknown column role for a {spec.type} task (expected: {', '.join(DEFAULT_COLUMNS[spec.type])})")
    return cols


def _rows(spec: EvalTaskSpec, path: Path, display: str, root: Path, cols: dict[str, str | int]):
    for raw in read_rows(path, display, fmt=spec.format, delimiter=spec.delimiter, header=spec.header,
                         quoting=spec.quoting, multiline=spec.multiline, required=list(cols.values()), root=root,
                         limits=spec.limits):
        if isinstance(raw, RowError):
            raise raw
        yield raw


def _text(raw: RawRow, cols: dict[str, str | int], role: str) -> str:
    value = raw.values.get(cols[role])
    if not isinstance(value, str) or not value.strip():
        raise RowError(raw.file, raw.row, str(cols[role]), "empty_text", f"empty or missing {role}")
    return value.strip()


def _number(raw: RawRow, cols: dict[str, str | int], role: str) -> float:
    value = raw.values.get(cols[role])
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RowError(raw.file, raw.row, str(cols[role]), "bad_score",
                       f"{role} {excerpt(repr(value))} is not a number") from None
    if not math.isfinite(number):
        raise RowError(raw.file, raw.row, str(cols[role]), "bad_score", f"{role} is {value!r}")
    return number


def _read_pairs(spec: EvalTaskSpec, resolve, attr: str = "path") -> list[dict[str, Any]]:
    cols = _columns(spec)
    out: list[dict[str, Any]] = []
    for path, display, root in _paths(spec, resolve, attr):
        for raw in _rows(spec, path, display, root, cols):
            row = {"sentence1": _text(raw, cols, "text1"), "sentence2": _text(raw, cols, "text2")}
            if spec.type == "sts":
                score = _number(raw, cols, "score")
                lo, hi = spec.score_range
                if not lo <= score <= hi:
                    raise RowError(raw.file, raw.row, str(cols["score"]), "bad_score",
                                   f"score {score} outside score_range {lo}..{hi}")
                row["score"] = score
            else:
                row["labels"] = _binary_label(spec, raw, cols)
            out.append(row)
            if spec.max_rows and len(out) >= spec.max_rows:
                return out
    return out


def _binary_label(spec: EvalTaskSpec, raw: RawRow, cols: dict[str, str | int]) -> int:
    value = str(raw.values.get(cols["label"], "")).strip()
    if spec.label_map is not None:
        if value not in spec.label_map:
            raise RowError(raw.file, raw.row, str(cols["label"]), "bad_label",
                           f"label {excerpt(repr(value))} not in label_map ({', '.join(spec.label_map)})")
        return int(spec.label_map[value])
    if value not in ("0", "1"):
        raise RowError(raw.file, raw.row, str(cols["label"]), "bad_label",
                       f"label {excerpt(repr(value))} is not 0/1 (set label_map)")
    return int(value)


def _read_labelled(spec: EvalTaskSpec, resolve, attr: str, limit: int | None) -> list[tuple[str, str]]:
    cols = _columns(spec)
    out: list[tuple[str, str]] = []
    for path, display, root in _paths(spec, resolve, attr):
        for raw in _rows(spec, path, display, root, cols):
            label = str(raw.values.get(cols["label"], "")).strip()
            if not label:
                raise RowError(raw.file, raw.row, str(cols["label"]), "bad_label", "empty label")
            out.append((_text(raw, cols, "text"), label))
            if limit and len(out) >= limit:
                return out
    return out


# Rows a task's metric needs: a correlation or an average precision over one pair is undefined.
MIN_ROWS = {"sts": 2, "pair_classification": 2, "classification": 2, "retrieval": 1}


def _enough(spec: EvalTaskSpec, rows: list, attr: str = "path", what: str = "rows") -> list:
    """``rows``, or a ``SourceError`` naming the file(s) when there are fewer than the task needs."""
    if len(rows) < MIN_ROWS[spec.type]:
        raw = getattr(spec, attr)
        files = " + ".join(raw) if isinstance(raw, list) else raw
        limit = " (or raise max_rows)" if spec.max_rows and attr == "path" else ""
        raise SourceError(files, None, None, "too_few_rows",
                          f"{len(rows)} {what.removesuffix('s') if len(rows) == 1 else what}; a {spec.type} task (evaluate.tasks {spec.name}) needs at least "
                          f"{MIN_ROWS[spec.type]}: add {what} to the file{limit}")
    return rows


def load_sts(spec: EvalTaskSpec, resolve):
    from datasets import Dataset

    return {spec.split: Dataset.from_list(_scores_vary(spec, _enough(spec, _read_pairs(spec, resolve))))}


def _scores_vary(spec: EvalTaskSpec, pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``pairs``, or a ``SourceError`` naming the file(s) when every gold score is the same: an STS
    task's main score is a correlation with them, undefined (NaN) for constant scores."""
    if len({p["score"] for p in pairs}) <= 1 and pairs:
        files = " + ".join(spec.path) if isinstance(spec.path, list) else spec.path
        raise SourceError(files, None, None, "constant_scores",
                          f"every gold score is {pairs[0]['score']:g}: the correlation an sts task (evaluate.tasks "
                          f"{spec.name}) scores by is undefined (NaN) for constant scores; use pairs with "
                          "different scores")
    return pairs


def load_pair_classification(spec: EvalTaskSpec, resolve):
    """MTEB's pair-classification layout: one row holding the lists of all pairs."""
    from datasets import Dataset

    pairs = _enough(spec, _read_pairs(spec, resolve))
    return {spec.split: Dataset.from_list([{
        "sentence1": [p["sentence1"] for p in pairs], "sentence2": [p["sentence2"] for p in pairs],
        "labels": [p["labels"] for p in pairs]}])}


def load_classification(spec: EvalTaskSpec, resolve, train_split: str = "train"):
    """Train rows keep their file order: MTEB's per-experiment undersampling shuffles indices with a
    fixed seed, so the order decides which examples the classifier is fitted on."""
    from datasets import Dataset

    if spec.train_path is None:
        raise SourceError(f"evaluate.tasks[{spec.name}]", None, "train_path", "config",
                          "a classification task needs train_path (the classifier is fitted on it)")
    train = _enough(spec, _read_labelled(spec, resolve, "train_path", None), "train_path")
    if len({label for _, label in train}) < 2:
        raise SourceError(spec.train_path, None, None, "too_few_labels", "one label only; the classifier of a "
                          f"classification task (evaluate.tasks {spec.name}) is fitted on at least 2 labels")
    test = _enough(spec, _read_labelled(spec, resolve, "path", spec.max_rows))
    names = sorted({label for _, label in train} | {label for _, label in test})
    ids = {name: i for i, name in enumerate(names)}
    return {train_split: Dataset.from_dict({"text": [t for t, _ in train], "label": [ids[lab] for _, lab in train]}),
            spec.split: Dataset.from_dict({"text": [t for t, _ in test], "label": [ids[lab] for _, lab in test]})}


def load_retrieval(spec: EvalTaskSpec, resolve):
    """A BEIR directory as MTEB's retrieval split data (corpus, queries with qrels, qrels)."""
    from datasets import Dataset

    directory = resolve(spec.path)
    files = beir_files(directory, spec.path.rstrip("/"), spec.split, root_for(resolve, spec.path))
    qrels: dict[str, dict[str, int]] = {}
    for item in read_qrels(*files["qrels"], limits=spec.limits):
        if isinstance(item, RowError):
            raise item
        _, qid, did, score = item
        qrels.setdefault(qid, {})[did] = int(score)
    queries, errors = read_queries(*files["queries"], limits=spec.limits)
    if errors:
        raise errors[0]
    missing = [q for q in qrels if q not in queries]
    if missing:
        raise SourceError(files["qrels"][1], None, "query-id", "missing_query",
                          f"{len(missing)} judged queries are not in queries.jsonl (e.g. {missing[0]!r})")
    qids = _enough(spec, [q for q in queries if q in qrels], what="judged queries")  # file order, as MTEB keeps them
    if spec.max_rows:
        qids = qids[: spec.max_rows]
        qrels = {q: qrels[q] for q in qids}
    ids, titles, texts = [], [], []
    for raw in read_jsonl(*files["corpus"], limits=spec.limits):
        if isinstance(raw, RowError):
            raise raw
        did = raw.values.get("_id")
        if did is None:
            raise RowError(raw.file, raw.row, "_id", "missing_field", "missing field")
        ids.append(str(did))
        titles.append(str(raw.values.get("title") or ""))
        texts.append(str(raw.values.get("text") or ""))
    _enough(spec, ids, what="corpus documents")
    known = set(ids)
    unknown = [(q, d) for q, docs in qrels.items() for d in docs if d not in known]
    if unknown:
        raise SourceError(files["qrels"][1], None, "corpus-id", "missing_document",
                          f"{len(unknown)} judged documents are not in the corpus (e.g. {unknown[0][1]!r})")
    if spec.max_corpus and len(ids) > spec.max_corpus:
        judged = {d for docs in qrels.values() for d in docs}
        others = [i for i, d in enumerate(ids) if d not in judged]
        room = max(0, spec.max_corpus - len(judged))
        keep = {i for i, d in enumerate(ids) if d in judged}
        keep.update(random.Random(f"{spec.name}:{spec.split}").sample(others, min(room, len(others))))
        ids, titles, texts = ([xs[i] for i in sorted(keep)] for xs in (ids, titles, texts))
    return {
        "corpus": Dataset.from_dict({"id": ids, "title": titles, "text": texts}),
        "queries": Dataset.from_dict({"id": qids, "text": [queries[q][0] for q in qids]}),
        "relevant_docs": qrels,
        "top_ranked": None,
    }
