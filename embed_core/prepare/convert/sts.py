"""STS pairs (QZhou §3.2.2): (text1, text2, score) → query, positive and its score, both
directions. A score is a number, or a binary yes/true → 1, no/false → 0; ``label_map`` maps
text labels to scores instead."""

from __future__ import annotations

from pydantic import Field

from embed_core.prepare.convert._pairs import PairConverter, PairParams
from embed_core.prepare.convert.base import ScoreRangeParams, get_score, map_label
from embed_core.prepare.readers import RawRow


class STS(PairConverter):
    kind = "sts"
    task = "sts"
    columns = {"text1": "sentence1", "text2": "sentence2", "score": "score"}

    class Params(PairParams, ScoreRangeParams):
        label_map: dict[str, float] | None = Field(
            None, description="Raw label -> score, for sources that label pairs with words; None = the score "
            "column holds numbers (or yes/true/no/false).")

    def score(self, raw: RawRow) -> float:
        if self.params.label_map:
            return map_label(raw, self.cols["score"], self.params.label_map)
        return get_score(raw, self.cols["score"], self.params.score_range)
