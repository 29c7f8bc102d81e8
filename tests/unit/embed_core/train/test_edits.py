"""HMCL's sample supplier: deterministic under a seed, and every op changes the text."""

import numpy as np

from embed_core.train.engine.edits import generate_positive, generate_weak_positive

TEXTS = ["A man is playing a guitar on the stage tonight with 3 friends.", "Two dogs run.", "Hello",
         "The 2019 report lists 45 cases and 12 deaths in 3 regions of the country."]


def test_deterministic_under_a_seed_and_different_from_the_source():
    for seed in range(20):
        for text in TEXTS:
            a = generate_positive(text, np.random.default_rng(seed))
            b = generate_positive(text, np.random.default_rng(seed))
            assert a == b and a[0] != text
            wa = generate_weak_positive(text, "An unrelated sentence about weather.", np.random.default_rng(seed))
            wb = generate_weak_positive(text, "An unrelated sentence about weather.", np.random.default_rng(seed))
            assert wa == wb and wa[0] != text


def test_every_weak_positive_op_is_reached_and_keeps_its_meaning_of_degradation():
    seen = {}
    text = TEXTS[3]
    for seed in range(200):
        out, op = generate_weak_positive(text, "Unrelated text.", np.random.default_rng(seed))
        seen.setdefault(op, out)
    assert set(seen) == {"delete", "insert", "number", "mix", "shuffle"}
    assert len(seen["delete"].split()) < len(text.split())
    assert "[MASK]" in seen["insert"] or "[UNK]" in seen["insert"]
    assert seen["mix"] == f"{text} Unrelated text."
    assert sorted(seen["shuffle"].split()) == sorted(text.split())
    assert seen["number"] != text and seen["number"].split()[0] == "The"


def test_positive_ops_keep_every_word():
    for seed in range(50):
        out, op = generate_positive(TEXTS[0], np.random.default_rng(seed))
        assert set(TEXTS[0].split()) <= set(out.split()) and op in ("rep", "ins")
