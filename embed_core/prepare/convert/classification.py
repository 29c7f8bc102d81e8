"""Classification data, example-based (QZhou §3.2.3, after NV-Embed).

Each (text, label) row becomes a record with the text as query, another text of the same label
as positive, and ``num_negatives`` texts of other labels as negatives. The record keeps its
``label`` and the label of every negative (``negative_labels``), which the CLS loss mask (Eq. 3)
needs to drop same-class in-batch negatives. Sampling is deterministic under the run seed.
"""

from __future__ import annotations

import random
from collections import defaultdict

from embed_core.config import SourceSpec
from embed_core.errors import RowError
from embed_core.prepare.convert.base import Columns, ConvertStream, get_text, record_id
from embed_core.prepare.readers import RawRow
from embed_core.schema import Record

CLASSIFICATION_COLUMNS = ({"text": "text", "label": "label"}, {"text": 0, "label": 1})


def _other(rng: random.Random, pool: list[str], text: str) -> str:
    """A random member of ``pool`` (distinct texts, len >= 2) other than ``text``."""
    while True:
        pick = rng.choice(pool)
        if pick != text:
            return pick


def convert_classification(rows, spec: SourceSpec, cols: Columns, seed: int = 0) -> ConvertStream:
    examples: list[tuple[RawRow, str, str]] = []
    for raw in rows:
        if isinstance(raw, RowError):
            yield raw
            continue
        try:
            text = get_text(raw, cols["text"])
            label = get_text(raw, cols["label"])
        except RowError as err:
            yield err
            continue
        if spec.label_map:
            key = label.lower()
            lowered = {str(k).lower(): str(v) for k, v in spec.label_map.items()}
            if key not in lowered:
                yield RowError(raw.file, raw.row, str(cols["label"]), "unknown_label",
                               f"unknown label {label!r} (expected one of {', '.join(sorted(lowered))})")
                continue
            label = lowered[key]
        examples.append((raw, text, label))

    by_label: dict[str, list[str]] = defaultdict(list)
    seen: set[tuple[str, str]] = set()  # a list's `in` made this quadratic in the source size
    for _, text, label in examples:
        if (label, text) not in seen:
            seen.add((label, text))
            by_label[label].append(text)
    labels = sorted(by_label)
    rng = random.Random(f"{seed}:{spec.name}")
    for raw, text, label in examples:
        pool = by_label[label]
        if len(pool) < 2:
            yield RowError(raw.file, raw.row, str(cols["label"]), "singleton_label",
                           f"no other example with label {label!r} to use as positive")
            continue
        others = [lab for lab in labels if lab != label]
        if not others and spec.num_negatives:
            yield RowError(raw.file, raw.row, str(cols["label"]), "single_class",
                           "only one label in the source: no negatives possible")
            continue
        negatives: list[str] = []
        negative_labels: list[str] = []
        for _ in range(spec.num_negatives):
            neg_label = rng.choice(others)
            negatives.append(rng.choice(by_label[neg_label]))
            negative_labels.append(neg_label)
        yield Record(id=record_id(spec, raw), dataset=spec.name, task=spec.task or "classification",
                     instruction=spec.instruction, query=text, positives=[_other(rng, pool, text)],
                     negatives=negatives, negative_labels=negative_labels, label=label,
                     origin="original", source_ref=raw.ref)
