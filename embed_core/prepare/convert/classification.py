"""Classification data, example-based (QZhou §3.2.3, after NV-Embed).

Each (text, label) row becomes a record with the text as query, another text of the same label
as positive, and ``num_negatives`` texts of other labels as negatives. The record keeps its
``label`` and the label of every negative (``negative_labels``), which the CLS loss mask (Eq. 3)
needs to drop same-class in-batch negatives. Sampling is deterministic under the run seed.
"""

from __future__ import annotations

import random
from collections import defaultdict

from pydantic import Field

from embed_core.errors import RowError
from embed_core.prepare.convert.base import Converter, ConverterParams, ConvertStream, Rows
from embed_core.prepare.readers import RawRow


def _other(rng: random.Random, pool: list[str], text: str) -> str:
    """A random member of ``pool`` (distinct texts, len >= 2) other than ``text``."""
    while True:
        pick = rng.choice(pool)
        if pick != text:
            return pick


class Classification(Converter):
    kind = "classification"
    task = "classification"
    columns = {"text": "text", "label": "label"}
    text_fields = ("text",)

    class Params(ConverterParams):
        label_map: dict[str, str | int | float] | None = Field(
            None, description="Raw label (case-insensitive) -> the label to keep; a label not listed is "
            "quarantined (reason unknown_label). None = keep the raw labels.")
        num_negatives: int = Field(4, ge=0, description="Negatives of other labels per record.")

    def _examples(self, rows: Rows) -> tuple[list[tuple[RawRow, str, str]], list[RowError]]:
        """(row, text, label) of every good row (labels mapped), and the bad rows' errors."""
        label_map = self.params.label_map
        lowered = {str(k).lower(): str(v) for k, v in label_map.items()} if label_map else None
        examples: list[tuple[RawRow, str, str]] = []
        errors: list[RowError] = []
        for raw in rows:
            if isinstance(raw, RowError):
                errors.append(raw)
                continue
            try:
                text = self.text(raw, "text")
                label = self.text(raw, "label")
            except RowError as err:
                errors.append(err)
                continue
            if lowered is not None:
                if label.lower() not in lowered:
                    errors.append(RowError(raw.file, raw.row, str(self.cols["label"]), "unknown_label",
                                           f"unknown label {label!r} (expected one of {', '.join(sorted(lowered))})"))
                    continue
                label = lowered[label.lower()]
            examples.append((raw, text, label))
        return examples, errors

    def convert(self, rows: Rows) -> ConvertStream:
        examples, errors = self._examples(rows)
        yield from errors
        by_label: dict[str, list[str]] = defaultdict(list)
        seen: set[tuple[str, str]] = set()  # a list's `in` made this quadratic in the source size
        for _, text, label in examples:
            if (label, text) not in seen:
                seen.add((label, text))
                by_label[label].append(text)
        labels = sorted(by_label)
        rng = random.Random(f"{self.run.seed}:{self.spec.name}")
        for raw, text, label in examples:
            yield from self._example_record(rng, raw, text, label, by_label, labels)

    def _example_record(self, rng: random.Random, raw: RawRow, text: str, label: str,
                        by_label: dict[str, list[str]], labels: list[str]) -> ConvertStream:
        pool = by_label[label]
        label_col = str(self.cols["label"])
        if len(pool) < 2:
            yield RowError(raw.file, raw.row, label_col, "singleton_label",
                           f"no other example with label {label!r} to use as positive")
            return
        others = [lab for lab in labels if lab != label]
        if not others and self.params.num_negatives:
            yield RowError(raw.file, raw.row, label_col, "single_class",
                           "only one label in the source: no negatives possible")
            return
        negatives: list[str] = []
        negative_labels: list[str] = []
        for _ in range(self.params.num_negatives):
            neg_label = rng.choice(others)
            negatives.append(rng.choice(by_label[neg_label]))
            negative_labels.append(neg_label)
        yield self.row_record(raw, query=text, positives=[_other(rng, pool, text)], negatives=negatives,
                              negative_labels=negative_labels, label=label)
