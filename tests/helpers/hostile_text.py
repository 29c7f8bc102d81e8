"""Hostile texts for property-based tests of the readers (hypothesis strategies), and an oracle
independent of ``clean_text``: which characters a reader must keep, and which it must never hand on."""

from __future__ import annotations

import unicodedata

from hypothesis import strategies as st

from embed_core.prepare.cleaning import ALLOWED_CONTROLS

HOSTILE = ("\x00", "\x01", "\x08", "\x0b", "\x0c", "\r", "\r\n", "\n", "\t", "\x1b[31m", "\x1a", "\x7f", "\x85", "\x92",
           "\u200b", "\u200c", "\u200d", "\u200e", "\u202a", "\u202e", "\u2066", "\u2069", "\u2028", "\u2029",
           "\u2060", "\ufeff", "\u00ad", "\ud800x", "\udc80", "\ufffe", "\uffff")  # "x": no surrogate pair forms
# What only a binary or damaged file holds, never a good text: a row holding one is quarantined.
UNUSABLE = ("\x00", "\ud800", "\udc80", "\ufffe", "\uffff")
WORDS = st.sampled_from(["alpha", "Beta", "über", "日本語", "مرحبا", "emoji 🙂", "x=1,y", '"quoted"', " ", "-"])
TEXTS = st.lists(st.one_of(WORDS, st.sampled_from(HOSTILE)), min_size=1, max_size=8).map("".join)


def visible(text: str) -> str:
    """The characters a reader must keep, in order: everything but controls, format characters,
    line/paragraph separators, surrogates and what stands in for a lost character."""
    return "".join(ch for ch in text if unicodedata.category(ch) not in ("Cc", "Cf", "Zl", "Zp", "Cs")
                   and ch not in "\ufffd\ufffe\uffff")


def assert_hygienic(text: str) -> None:
    """No control character but tab and newline, no format character but ZWJ/ZWNJ, no other line end."""
    for ch in text:
        assert ch in ALLOWED_CONTROLS or unicodedata.category(ch) not in ("Cc", "Cs"), (ch, text)
        assert ch in "\u200c\u200d" or unicodedata.category(ch) != "Cf", (ch, text)
        assert ch not in "\u2028\u2029\r", (ch, text)


def usable(text: str) -> bool:
    """Whether a row holding ``text`` must come through (else it is quarantined)."""
    return not any(ch in text for ch in UNUSABLE)
