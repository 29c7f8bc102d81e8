"""``bidirectional: true`` on the decoders of the QZhou recipe's family, on tiny random-init models
built in code (no downloads): Qwen2, Qwen3, Mistral, Llama and Gemma-3. Bidirectional, the first
token's state depends on the last token; causal, it does not; the SDPA and eager attention paths
give the same embeddings; a saved bidirectional model reloads bidirectional in embedpipe,
``transformers.AutoModel`` and sentence-transformers (the switch is in its ``config.json``)."""

import pytest
import torch

from embed_core.model.embedder import Embedder
from tests.helpers.tiny_model import build_tiny_decoder

ARCHS = ["qwen2", "qwen3", "mistral", "llama", "gemma3_text"]
TEXTS = ("one two three four", "one two three five")


def _tiny_decoder(dest, model_type: str, tokenizer_dir):
    return build_tiny_decoder(dest, model_type, tokenizer_dir)


def _first_states(model, embedder: Embedder) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(**{k: v for k, v in embedder.tokenize([t]).items() if k != "pool_mask"}
                                  ).last_hidden_state[0, 1] for t in TEXTS])


@pytest.mark.parametrize("arch", ARCHS)
def test_bidirectional_lets_the_first_token_see_the_last_and_causal_does_not(tmp_path, tiny_model, arch):
    path = _tiny_decoder(tmp_path / arch, arch, tiny_model)
    for bidirectional in (False, True):
        m = Embedder(str(path), pooling="mean", bidirectional=bidirectional).eval()
        first = _first_states(m.model, m)
        assert torch.allclose(first[0], first[1], atol=1e-6) is not bidirectional, (arch, bidirectional)


@pytest.mark.parametrize("arch", ARCHS)
def test_sdpa_and_eager_attention_give_the_same_bidirectional_embeddings(tmp_path, tiny_model, arch):
    path = _tiny_decoder(tmp_path / arch, arch, tiny_model)
    m = Embedder(str(path), pooling="mean", bidirectional=True).eval()
    batch = m.tokenize(["a short one", "a somewhat longer text with more words"])  # padding on the right
    out = {}
    for impl in ("sdpa", "eager"):
        m.model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = m(batch)
    torch.testing.assert_close(out["sdpa"], out["eager"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_saved_bidirectional_model_reloads_bidirectional_everywhere(tmp_path, tiny_model, arch):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    m = Embedder(str(_tiny_decoder(tmp_path / arch, arch, tiny_model)), pooling="mean", bidirectional=True).eval()
    saved = m.save(tmp_path / "saved")
    again = Embedder(str(saved), pooling="mean").eval()  # no flag: the saved config carries the switch
    first = _first_states(again.model, again)
    assert not torch.allclose(first[0], first[1], atol=1e-6)
    plain = AutoModel.from_pretrained(saved).eval()
    assert plain.config.is_causal is False
    first = _first_states(plain, again)
    assert not torch.allclose(first[0], first[1], atol=1e-6)
    st = SentenceTransformer(str(saved), device="cpu")
    with torch.no_grad():
        ours = m(m.tokenize(list(TEXTS)))
    torch.testing.assert_close(torch.as_tensor(st.encode(list(TEXTS))), ours, atol=1e-5, rtol=1e-5)


def test_an_encoder_asked_to_be_bidirectional_is_checked_and_stays_as_it_is(tiny_model):
    m = Embedder(str(tiny_model), bidirectional=True).eval()  # BERT: not in the tested set, so probed once at load
    first = _first_states(m.model, m)
    assert not torch.allclose(first[0], first[1], atol=1e-6)
