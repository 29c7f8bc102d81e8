"""Passages from documents: a document's text split into chunks of at most ``max_tokens`` tokens
of a tokenizer, each a character span of the text (``text[start:end]`` is the passage, exactly).

The splitting is semchunk's (https://github.com/isaacus-dev/semchunk): it splits at the largest
boundary that fits — blank lines, then line breaks, tabs, sentence ends, clause punctuation, words
— and merges the pieces back up to the size, so passages end where the text pauses. It was chosen
by measurement against semantic-text-splitter on the SciFact corpus and the repository's markdown
(docs/experiments.md, "Chunking"): both never exceed the size and both give exact spans; semchunk
was faster with the same share of chunks ending at a sentence, and is pure Python.

Tokens are counted by the given tokenizer (``tokenizer.json`` of a model directory, ``default``:
the packaged all-MiniLM-L6-v2) without special tokens, so a passage of ``max_tokens`` fits an
encoder with ``passage_max_length`` = ``max_tokens`` + 2.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import semchunk

from embed_core.errors import ConfigError


@lru_cache(maxsize=4)
def token_counter(tokenizer: str) -> Callable[[str], int]:
    """Tokens of a text (no special tokens) under ``tokenizer``: a model directory (or ``default``)."""
    from tokenizers import Tokenizer

    from embed_core.model.encoder import model_source

    source = model_source(tokenizer)
    path = Path(source) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"chunking tokenizer {tokenizer!r}: no tokenizer.json in {source}")
    tok = Tokenizer.from_file(str(path))
    tok.no_truncation()
    tok.no_padding()

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    return count


class Chunker:
    """``spans(text)``: the (start, end) character spans of ``text``'s passages, in order; the
    whitespace between passages belongs to none."""

    def __init__(self, count: Callable[[str], int], max_tokens: int, overlap: int = 0):
        if overlap >= max_tokens:
            raise ConfigError(f"chunk overlap {overlap} must be below the chunk size {max_tokens}")
        self.max_tokens = max_tokens
        self.overlap = overlap
        # token counts of pieces are memoised; bounded, so a large corpus does not grow memory
        self._chunk = semchunk.chunkerify(count, max_tokens, cache_maxsize=1 << 16)

    @classmethod
    def for_tokenizer(cls, tokenizer: str, max_tokens: int, overlap: int = 0) -> Chunker:
        return cls(token_counter(tokenizer), max_tokens, overlap)

    def spans(self, text: str) -> list[tuple[int, int]]:
        if not text.strip():
            return []
        _, offsets = self._chunk(text, offsets=True, overlap=self.overlap or None)
        out = []
        for a, b in offsets:  # no passage starts or ends with whitespace (a last line's break)
            piece = text[a:b]
            if piece.strip():
                a += len(piece) - len(piece.lstrip())
                out.append((int(a), int(a + len(piece.strip()))))
        return out
