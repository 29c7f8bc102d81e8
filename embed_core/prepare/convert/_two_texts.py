"""What title_body and qa share: a row is two texts, the first the query and the second its
positive (QZhou §3.2.1)."""

from __future__ import annotations

from embed_core.prepare.convert.base import Converter, Item
from embed_core.prepare.readers import RawRow


class QueryPositiveConverter(Converter):
    """The first of ``columns`` is the query, the second its positive."""

    def convert_row(self, raw: RawRow) -> list[Item]:
        first, second = list(self.columns)[:2]
        return [self.row_record(raw, query=self.text(raw, first), positives=[self.text(raw, second)])]
