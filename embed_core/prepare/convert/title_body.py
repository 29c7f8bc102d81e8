"""Title–body (or title–abstract) pairs (QZhou §3.2.1): title → query, body → positive. Over-long
bodies are truncated by the cleaning step to ``cleaning.max_chars``."""

from __future__ import annotations

from embed_core.prepare.convert._two_texts import QueryPositiveConverter


class TitleBody(QueryPositiveConverter):
    kind = "title_body"
    columns = {"title": "title", "body": "text"}
    text_fields = ("title",)
