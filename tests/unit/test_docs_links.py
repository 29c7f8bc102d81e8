"""Every relative link in README.md and docs/*.md leads somewhere: the file (or folder) exists and,
for a ``#anchor``, the markdown file has that heading (GitHub's slugs)."""

import re
from pathlib import Path

import pytest

from tests.helpers.repo import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"`|\*\*|__", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated heading's get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(text):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(text: str, here: Path) -> list[str]:
    """The relative links of the markdown ``text`` (a file in the folder ``here``) that lead nowhere."""
    broken = []
    for line in prose(text):
        for target in LINK.findall(re.sub(r"`[^`]*`", "``", line)):  # not in inline code
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (here / path).resolve() if path else None
            if file is not None and not file.exists():
                broken.append(f"{target}: no such file")
            elif anchor and (file is None or file.suffix == ".md"):
                headings = anchors(text if file is None else file.read_text(encoding="utf-8"))
                if anchor not in headings:
                    broken.append(f"{target}: no heading with that anchor")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_of_the_docs_leads_to_a_file_and_heading_that_exist(doc):
    assert broken_links(doc.read_text(encoding="utf-8"), doc.parent) == []


def test_a_link_to_a_missing_file_or_heading_is_reported_and_a_good_one_is_not(tmp_path):
    (tmp_path / "other.md").write_text("# The `train` stage: what it does\n\n## Sizes (issue 46)\n\n## Sizes (issue 46)\n")
    text = ("# Here\n[ok](other.md#the-train-stage-what-it-does) [ok](other.md#sizes-issue-46-1) [ok](#here)\n"
            "[web](https://example.com/x.md) `[code](gone.md)`\n"
            "```\n[fenced](gone.md)\n```\n"
            "[gone](gone.md) [bad anchor](other.md#no-such-heading) [bad local](#nowhere)\n")
    assert broken_links(text, tmp_path) == ["gone.md: no such file", "other.md#no-such-heading: no heading with that anchor",
                                           "#nowhere: no heading with that anchor"]
