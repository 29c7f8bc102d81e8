"""HMCL's unsupervised sample supplier (HMCL Appendix A.2, Algorithm 2): text edits that make a
positive or a weak-positive when a record lacks one. Deterministic: every function takes a
``numpy.random.Generator`` (the trainer seeds it from (seed, step, record)).

Positive (meaning kept), one op uniformly: ``rep`` duplicates N ∈ [1, ⌊0.3·L⌋] words in place;
``ins`` inserts one neutral token (the, so, thus, too, there, a, an, '.', ',') at a random place.
The paper's third op, ``syn`` (syntax-aware paraphrase), needs a parser; without one the paper
itself falls back to ``rep``, which is what is done here.

Weak-positive (related but degraded), one op uniformly: ``delete`` N ∈ [1, 4] words (if L > 8,
else shuffle); ``insert`` N ∈ [2, 5] [MASK]/[UNK] tokens; ``number`` replaces every number by
another (else shuffle); ``mix`` joins the positive with another record's text (a hybrid of right
and wrong content); ``shuffle`` permutes all words (p = 0.5) or makes 7 random swaps. The
parser-based ``degrade`` op is left out (no parser dependency); ``shuffle`` covers word-order
damage, ``insert`` the masked-modifier case.
"""

from __future__ import annotations

import re

import numpy as np

NEUTRAL_TOKENS = ("the", "so", "thus", "too", "there", "a", "an", ".", ",")
MASK_TOKENS = ("[MASK]", "[UNK]")
POSITIVE_OPS = ("rep", "ins")
WEAK_POSITIVE_OPS = ("delete", "insert", "number", "mix", "shuffle")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)?")


def _rand_int(rng: np.random.Generator, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi] (inclusive, as the paper's rand_int)."""
    return int(rng.integers(lo, hi + 1))


def repeat_words(words: list[str], rng: np.random.Generator) -> list[str]:
    if len(words) < 2:
        return list(words)
    n = _rand_int(rng, 1, max(1, int(0.3 * len(words))))
    picked = set(rng.choice(len(words), size=n, replace=False).tolist())
    out: list[str] = []
    for i, word in enumerate(words):
        out += [word, word] if i in picked else [word]
    return out


def insert_neutral(words: list[str], rng: np.random.Generator) -> list[str]:
    out = list(words)
    out.insert(_rand_int(rng, 0, len(out)), NEUTRAL_TOKENS[int(rng.integers(len(NEUTRAL_TOKENS)))])
    return out


def shuffle_words(words: list[str], rng: np.random.Generator) -> list[str]:
    out = list(words)
    if len(out) < 2:
        return out
    if rng.random() < 0.5:
        original = list(out)
        for _ in range(5):  # a permutation can come back unchanged; retry a few times
            rng.shuffle(out)
            if out != original:
                break
    else:
        for _ in range(7):
            i, j = rng.integers(len(out), size=2)
            out[i], out[j] = out[j], out[i]
    return out


def generate_positive(text: str, rng: np.random.Generator) -> tuple[str, str]:
    """(edited text, op name): a close paraphrase by surface edits."""
    words = text.split()
    op = POSITIVE_OPS[int(rng.integers(len(POSITIVE_OPS)))]
    out = repeat_words(words, rng) if op == "rep" else insert_neutral(words, rng)
    if out == words:  # one-word text: rep is a no-op there
        out, op = insert_neutral(words, rng), "ins"
    return " ".join(out), op


def generate_weak_positive(text: str, other: str, rng: np.random.Generator) -> tuple[str, str]:
    """(edited text, op name): partly related to ``text``; ``other`` is an unrelated record's text (for mix)."""
    words = text.split()
    op = WEAK_POSITIVE_OPS[int(rng.integers(len(WEAK_POSITIVE_OPS)))]
    if op == "delete" and len(words) > 8:
        n = _rand_int(rng, 1, 4)
        drop = set(rng.choice(len(words), size=n, replace=False).tolist())
        out = " ".join(w for i, w in enumerate(words) if i not in drop)
    elif op == "insert":
        out_words = list(words)
        for _ in range(_rand_int(rng, 2, 5)):
            out_words.insert(_rand_int(rng, 0, len(out_words)), MASK_TOKENS[int(rng.integers(2))])
        out = " ".join(out_words)
    elif op == "number" and _NUMBER.search(text):
        out = _NUMBER.sub(lambda m: str(_rand_int(rng, 0, 999) if m.group() != "0" else _rand_int(rng, 1, 999)), text)
    elif op == "mix" and other.strip():
        out = f"{text} {other}"
    else:
        op = "shuffle"
        out = " ".join(shuffle_words(words, rng))
    if out == text:  # e.g. a one-word text that shuffles to itself
        out, op = " ".join([*words, MASK_TOKENS[0]]), "insert"
    return out, op
