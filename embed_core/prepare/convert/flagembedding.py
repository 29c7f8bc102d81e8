"""FlagEmbedding fine-tuning JSONL: ``query``, ``pos``, ``neg``, ``pos_scores``, ``neg_scores``,
``prompt`` (the instruction, unless the source sets one) and ``category`` (the record's label)."""

from __future__ import annotations

from embed_core.prepare.convert.base import (
    Converter,
    Item,
    ScoreRangeParams,
    get_score_list,
    get_text_list,
)
from embed_core.prepare.readers import RawRow


class FlagEmbedding(Converter):
    kind = "flagembedding"
    columns = {"query": "query", "pos": "pos", "neg": "neg", "pos_scores": "pos_scores",
               "neg_scores": "neg_scores", "prompt": "prompt", "label": "category"}
    optional = ("neg", "pos_scores", "neg_scores", "prompt", "label")
    text_fields = ("query",)
    Params = ScoreRangeParams

    def convert_row(self, raw: RawRow) -> list[Item]:
        cols, score_range = self.cols, self.params.score_range
        query = self.text(raw, "query")
        pos = get_text_list(raw, cols["pos"])
        neg = get_text_list(raw, cols["neg"], allow_missing=True)
        pos_scores = get_score_list(raw, cols["pos_scores"], len(pos), score_range)
        neg_scores = get_score_list(raw, cols["neg_scores"], len(neg), score_range)
        prompt = raw.values.get(cols["prompt"])
        label = raw.values.get(cols["label"])
        record = self.row_record(raw, query=query, positives=pos, positive_scores=pos_scores, negatives=neg,
                                 negative_scores=neg_scores, label=str(label) if label is not None else None)
        if isinstance(prompt, str) and prompt.strip() and not self.spec.instruction:
            record.instruction = prompt.strip()
        return [record]
