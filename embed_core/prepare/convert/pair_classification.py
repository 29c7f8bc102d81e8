"""Pair classification (MRPC-style 0/1 labels), handled like STS (CoDiEmb A.1.1: "same processing
pipeline and objective functions as STS"): the label is the pair's score, both directions."""

from __future__ import annotations

from embed_core.prepare.convert._pairs import PairConverter, labelled_params


class PairClassification(PairConverter):
    kind = "pair_classification"
    task = "pair_classification"
    columns = {"text1": "sentence1", "text2": "sentence2", "label": "label"}
    Params = labelled_params({"1": 1.0, "0": 0.0, "yes": 1.0, "no": 0.0, "true": 1.0, "false": 0.0})
