"""Question–answer pairs (QZhou §3.2.1): question → query, answer → positive."""

from __future__ import annotations

from embed_core.prepare.convert._two_texts import QueryPositiveConverter


class QA(QueryPositiveConverter):
    kind = "qa"
    columns = {"question": "question", "answer": "answer"}
    text_fields = ("question",)
