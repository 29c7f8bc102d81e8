"""Entailment pairs (QZhou §3.2.2): entailment / neutral / contradiction become the scores 2 / 1 /
0 of a (premise, hypothesis) pair, both directions; task ``nli``."""

from __future__ import annotations

from embed_core.prepare.convert._pairs import PairConverter, labelled_params


class Entailment(PairConverter):
    kind = "entailment"
    task = "nli"
    columns = {"text1": "premise", "text2": "hypothesis", "label": "label"}
    Params = labelled_params({"entailment": 2.0, "neutral": 1.0, "contradiction": 0.0})
