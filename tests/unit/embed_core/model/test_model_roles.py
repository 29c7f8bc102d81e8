"""A model is what its role needs (``embed_core.model.files.check_model_role``, run by every
stage's cache key through ``model_fingerprint``): a cross-encoder teacher is a one-label
``*ForSequenceClassification`` checkpoint, not an embedding model whose scoring head would be
initialised at random; an embedding model is not a classifier whose head would be dropped."""

import pytest

from embed_core.errors import user_error
from embed_core.model.encoder import model_fingerprint
from embed_core.model.files import ModelFilesError, check_model_role
from tests.helpers.tiny_model import build_tiny_cross_encoder


def _classifier(dest, labels: int):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=labels)
    BertForSequenceClassification(config).save_pretrained(dest)
    return dest


def _refusal(path, role) -> str:
    with pytest.raises(ModelFilesError) as caught:
        check_model_role(path, role)
    line = user_error(caught.value)
    assert "\n" not in line
    return line


def test_a_cross_encoder_checkpoint_is_a_cross_encoder_and_an_embedding_model_is_an_embedder(tmp_path, tiny_model):
    check_model_role(build_tiny_cross_encoder(tmp_path / "ce"), "cross_encoder")
    check_model_role(tiny_model, "embedder")


def test_an_embedding_model_given_as_a_cross_encoder_teacher_is_one_line_naming_its_architecture(tiny_model):
    line = _refusal(tiny_model, "cross_encoder")
    assert line.startswith(f"{tiny_model}: mine.teacher kind cross_encoder needs a cross-encoder")
    assert "config.json names BertModel: its scoring head would be newly initialised at random" in line
    assert line.endswith("for an embedding model use kind: embedder")


def test_a_classifier_with_two_labels_is_not_a_teacher_of_one_score_per_pair(tmp_path):
    line = _refusal(_classifier(tmp_path / "nli", labels=2), "cross_encoder")
    assert "this BertForSequenceClassification has 2 labels" in line


def test_a_classifier_given_as_an_embedding_model_is_one_line(tmp_path):
    path = _classifier(tmp_path / "clf", labels=1)
    assert _refusal(path, "embedder").startswith(f"{path}: a BertForSequenceClassification checkpoint (a classifier "
                                                 "or cross-encoder), not an embedding model")


def test_the_cache_key_of_a_model_checks_its_role_before_any_work(tmp_path, tiny_model):
    ce = build_tiny_cross_encoder(tmp_path / "ce")
    assert model_fingerprint(str(ce), "cross_encoder", 64, False)
    assert model_fingerprint(str(tiny_model), "mean", 64, False)
    with pytest.raises(ModelFilesError, match="needs a cross-encoder"):
        model_fingerprint(str(tiny_model), "cross_encoder", 64, False)
    with pytest.raises(ModelFilesError, match="not an embedding model"):
        model_fingerprint(str(ce), "mean", 64, False)
