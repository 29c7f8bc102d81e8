"""``append_eos``: last-token pooling ends every text with the tokenizer's EOS (Qwen3-Embedding,
Tevatron), also a truncated one, never twice, and the saved model's tokenizer carries it, so the
evaluate encoder and sentence-transformers encode as the trained model does. A tiny random-init
Qwen3 built in code with a decoder-style tokenizer (the tiny BERT vocabulary, no [SEP] at the end)."""

import json

import pytest
import torch

from embed_core.errors import ConfigError
from embed_core.model.embedder import Embedder
from tests.helpers.tiny_model import build_tiny_decoder

EOS = "[unused0]"
TEXTS = ["a cat sleeps", "the dog runs in the park " * 30]  # the second is longer than max_length


def _decoder_tokenizer(dest, ending: str):
    """The tiny BERT tokenizer as a decoder's: no post-processing (``none``), a BOS only (``bos``),
    ByteLevel offsets only (``bytelevel``) or the EOS already appended (``eos``)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from embed_core.model.encoder import default_model_path

    backend = Tokenizer.from_file(f"{default_model_path()}/tokenizer.json")
    backend.post_processor = {
        "none": None, "bytelevel": processors.ByteLevel(trim_offsets=False),
        "bos": processors.TemplateProcessing(single="[CLS] $A", pair="[CLS] $A $B:1", special_tokens=[("[CLS]", 101)]),
        "eos": processors.TemplateProcessing(single=f"$A {EOS}", pair=f"$A $B:1 {EOS}:1", special_tokens=[(EOS, 1)]),
    }[ending]
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token="[PAD]", unk_token="[UNK]",
                            bos_token="[CLS]").save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def decoders(tmp_path_factory, tiny_model):
    """ending -> a tiny Qwen3 directory whose tokenizer ends texts that way."""
    root = tmp_path_factory.mktemp("eos")
    return {ending: build_tiny_decoder(root / ending, "qwen3", _decoder_tokenizer(root / f"{ending}-tok", ending))
            for ending in ("none", "bos", "bytelevel", "eos")}


def _last_ids(batch) -> list[int]:
    last = batch["attention_mask"].sum(dim=1) - 1
    return batch["input_ids"][torch.arange(len(last)), last].tolist()


@pytest.mark.parametrize("ending", ["none", "bos", "bytelevel"])
def test_last_token_pooling_ends_every_text_with_the_eos_even_a_truncated_one(decoders, ending):
    m = Embedder(str(decoders[ending]), pooling="last_token", max_length=16)
    batch = m.tokenize(TEXTS)
    eos = m.tokenizer.eos_token_id
    assert _last_ids(batch) == [eos, eos]
    assert int(batch["attention_mask"][1].sum()) == 16  # truncated, with room kept for the EOS
    assert bool((batch["input_ids"][:, 0] == 101).all()) is (ending == "bos")  # the BOS stays first
    assert int((batch["input_ids"][0] == eos).sum()) == 1


def test_a_tokenizer_that_already_ends_with_the_eos_gets_no_second_one(decoders):
    m = Embedder(str(decoders["eos"]), pooling="last_token", max_length=16, append_eos="always")
    ids = m.tokenize(TEXTS)["input_ids"]
    assert _last_ids(m.tokenize(TEXTS)) == [1, 1]
    assert [int((row == 1).sum()) for row in ids] == [1, 1]


def test_never_and_auto_with_mean_pooling_leave_the_tokenizer_as_it_is_and_always_appends(decoders):
    texts = TEXTS[:1]
    assert _last_ids(Embedder(str(decoders["none"]), pooling="last_token", append_eos="never").tokenize(texts)) != [1]
    assert _last_ids(Embedder(str(decoders["none"]), pooling="mean").tokenize(texts)) != [1]
    assert _last_ids(Embedder(str(decoders["none"]), pooling="mean", append_eos="always").tokenize(texts)) == [1]


def test_the_instruction_left_out_of_mean_pooling_is_counted_without_the_appended_eos(decoders):
    m = Embedder(str(decoders["bos"]), pooling="mean", append_eos="always", exclude_instruction_from_pooling=True)
    batch = m.tokenize(["a cat"], ["find it"])
    head = m.tokenizer(m.format("find it", "a cat").split("a cat")[0], add_special_tokens=False)["input_ids"]
    assert batch["pool_mask"][0].tolist() == [0] * (1 + len(head)) + [1] * (len(batch["input_ids"][0]) - 1 - len(head))


def test_the_saved_model_appends_the_eos_in_the_evaluate_encoder_and_sentence_transformers(decoders, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    from embed_core.scoring.model import EvalModel

    m = Embedder(str(decoders["bos"]), pooling="last_token", max_length=16).eval()
    saved = m.save(tmp_path / "saved")
    assert json.loads((saved / "embedpipe.json").read_text())["appends_eos"] is True
    assert AutoTokenizer.from_pretrained(saved)(TEXTS[0])["input_ids"][-1] == 1
    with torch.no_grad():
        ours = m(m.tokenize(TEXTS))
    evaluated = EvalModel(str(saved), label="eos", cache_root=tmp_path / "cache", device="cpu")._encode_texts(TEXTS)
    torch.testing.assert_close(torch.as_tensor(evaluated), ours, atol=1e-5, rtol=1e-5)
    st = SentenceTransformer(str(saved), device="cpu")
    torch.testing.assert_close(torch.as_tensor(st.encode(TEXTS)), ours, atol=1e-5, rtol=1e-5)
    again = Embedder(str(saved), pooling="last_token", max_length=16)  # a next stage: no second EOS
    assert [int((row == 1).sum()) for row in again.tokenize(TEXTS[:1])["input_ids"]] == [1]


def test_a_tokenizer_class_that_would_drop_the_eos_when_saved_is_a_config_error(tmp_path, tiny_model):
    path = build_tiny_decoder(tmp_path / "bert-tok", "qwen3", tiny_model)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": EOS}))
    with pytest.raises(ConfigError, match="rebuilds its post-processor"):  # BertTokenizer: always [CLS] $A [SEP]
        Embedder(str(path), pooling="last_token")


def test_always_without_an_eos_token_is_a_config_error_and_auto_leaves_it(tiny_model):
    assert Embedder(str(tiny_model), pooling="last_token").tokenizer.eos_token is None
    with pytest.raises(ConfigError, match="no eos_token"):
        Embedder(str(tiny_model), pooling="last_token", append_eos="always")
