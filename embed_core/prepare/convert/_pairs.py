"""What the pair kinds (sts, entailment, pair_classification) share: a row is (text1, text2, score
or label), emitted as one record and, as both kinds are symmetric, once more with the roles
swapped (QZhou §3.2.2; CoDiEmb A.1.1 treats pair classification like STS)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, create_model

from embed_core.prepare.convert.base import Converter, ConverterParams, Item, map_label
from embed_core.prepare.readers import RawRow

class PairParams(ConverterParams):
    both_directions: bool = Field(True, description="Also emit every pair with its texts swapped (text2, text1).")


def labelled_params(labels: dict[str, float]) -> type[PairParams]:
    """The parameters of a kind whose pairs are scored by their label: ``label_map`` defaults to ``labels``."""
    label_map = Field(default_factory=lambda: dict(labels), min_length=1,
                      description="Raw label (case-insensitive) -> score; replaces the default mapping.")
    return create_model("Params", __base__=PairParams, __module__=__name__, label_map=(dict[str, float], label_map))


class PairConverter(Converter):
    """A (text1, text2, label) row whose score is its label looked up in ``params.label_map``
    (a kind that reads scores otherwise overrides ``score``)."""

    text_fields: ClassVar[tuple[str, ...]] = ("text1", "text2")
    pair: ClassVar[bool] = True
    Params: ClassVar[type[ConverterParams]] = PairParams

    def score(self, raw: RawRow) -> float:
        return map_label(raw, self.cols["label"], self.params.label_map)

    def convert_row(self, raw: RawRow) -> list[Item]:
        text1 = self.text(raw, "text1")
        text2 = self.text(raw, "text2")
        score = float(self.score(raw))
        out: list[Item] = [self.row_record(raw, query=text1, positives=[text2], positive_scores=[score])]
        if self.params.both_directions:
            out.append(self.row_record(raw, "~rev", query=text2, positives=[text1], positive_scores=[score]))
        return out
