"""The model card's Matryoshka section (``embed_core.model.card``): the trained dims, how to cut
the embedding, and the scores per dimension once evaluated."""

from embed_core.model.card import card_facts, render_card
from embed_core.train.config import MatryoshkaConfig


def _facts(matryoshka=None):
    return card_facts(run_name="r", config_hash="0" * 64, base_model="b", init_model="b", stage={"name": "s"},
                      datasets={"d": {"task": "sts", "records": 3, "weight": 1.0}}, losses={"sts": "cosent"},
                      counts={}, matryoshka=matryoshka)


def test_a_card_without_matryoshka_has_no_dimension_section():
    assert "matryoshka" not in _facts()
    assert "## Matryoshka dimensions" not in render_card(_facts(), {})


def test_a_matryoshka_card_shows_truncate_dim_and_a_score_per_trained_dimension():
    facts = _facts(MatryoshkaConfig(dims=[64, 256, 128], weights=[1.0, 1.0, 0.5]))
    assert facts["matryoshka"] == {"dims": [256, 128, 64], "weights": [1.0, 0.5, 1.0]}
    before = render_card(facts, {})
    assert 'SentenceTransformer("path/to/this/model", truncate_dim=64)' in before
    assert "Scores per dimension: not evaluated yet" in before
    scores = [{"task": "STSB", "metric": "cosine_spearman", "dim": d, "value": v}
              for d, v in ((256, 0.8512), (128, 0.84), (64, 0.8))]
    after = render_card(facts, {}, dim_scores=scores)
    assert "| task | metric | 256 dims | 128 dims | 64 dims |" in after
    assert "| STSB | cosine_spearman | 85.12 | 84.00 | 80.00 |" in after
