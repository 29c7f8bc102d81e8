"""``Embedder.save`` with LoRA: the adapters are merged into the saved weights from a state dict,
layer by layer, never by copying the model — the same weights as peft's own ``merge_and_unload``,
the same embeddings as the in-memory LoRA model, and the model keeps training with its adapters."""

import copy

import pytest
import torch

from embed_core.errors import ConfigError
from embed_core.model.embedder import Embedder, merged_lora_state_dict
from tests.helpers.tiny_model import build_tiny_decoder

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}
TEXTS = ["a cat sleeps on the mat", "the dog runs"]


def _lora_embedder(path, **kw) -> Embedder:
    pytest.importorskip("peft")
    m = Embedder(str(path), pooling="mean", lora=LORA, **kw).eval()
    torch.manual_seed(1)
    with torch.no_grad():  # peft starts B at zero, which would make the merge a no-op
        for name, p in m.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    return m


def _saved_weights(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory, tiny_model):
    return build_tiny_decoder(tmp_path_factory.mktemp("qwen") / "qwen3", "qwen3", tiny_model)


@pytest.mark.parametrize("arch", ["bert", "qwen3"])
def test_the_saved_lora_model_has_peft_merged_weights_and_embeds_like_the_lora_model(tmp_path, tiny_model,
                                                                                      tiny_qwen, arch):
    from transformers import AutoModel

    m = _lora_embedder(tiny_model if arch == "bert" else tiny_qwen)
    out = m.save(tmp_path / "saved")
    theirs = copy.deepcopy(m.model).merge_and_unload().state_dict()  # peft's merge, for the check only
    ours = _saved_weights(out)
    assert set(ours) == set(theirs)
    for key, value in ours.items():
        torch.testing.assert_close(value, theirs[key], atol=1e-6, rtol=0, msg=key)
    base = {k.replace(".base_layer.", "."): v for k, v in m.model.get_base_model().state_dict().items()}
    changed = [k for k in ours if not torch.equal(ours[k], base[k])]
    adapted = [k for k in m.model.state_dict() if k.endswith("lora_A.default.weight")]
    assert len(changed) == len(adapted) > 0  # every adapted linear layer's weight, merged
    plain = Embedder(str(out), pooling="mean").eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(plain.tokenize(TEXTS)), m(m.tokenize(TEXTS)), atol=1e-5, rtol=1e-5)
    assert AutoModel.from_pretrained(out) is not None


def test_the_model_keeps_its_adapters_after_save_and_trains_on(tmp_path, tiny_qwen):
    m = _lora_embedder(tiny_qwen)
    before = {n: p.detach().clone() for n, p in m.model.named_parameters()}
    m.save(tmp_path / "saved")
    after = dict(m.model.named_parameters())
    assert set(after) == set(before) and any("lora_A" in n for n in after)
    assert all(torch.equal(after[n], before[n]) for n in before)  # the merge left the live weights alone
    m.train()
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
    emb = m(m.tokenize(TEXTS))
    (1 - emb[0] @ emb[1]).backward()
    opt.step()
    assert any(not torch.equal(after[n], before[n]) for n in before if "lora_" in n)


def test_save_takes_the_weights_from_a_given_state_dict(tmp_path, tiny_qwen):
    m = _lora_embedder(tiny_qwen)
    state = {k: v.detach().clone() for k, v in m.model.state_dict().items()}  # e.g. gathered from FSDP shards
    key = next(k for k in state if k.endswith("q_proj.lora_B.default.weight"))
    state[key] = state[key] * 2
    saved = _saved_weights(m.save(tmp_path / "given", state_dict=state))
    default = _saved_weights(m.save(tmp_path / "own"))
    merged_key = key.removeprefix("base_model.model.").replace(".lora_B.default.weight", ".weight")
    assert not torch.equal(saved[merged_key], default[merged_key])
    assert all(torch.equal(saved[k], default[k]) for k in saved if k != merged_key)


def test_the_merge_is_w_plus_b_times_a_times_the_scaling_on_tensors_alone():
    w, a, b, bias = torch.randn(3, 5), torch.randn(2, 5), torch.randn(3, 2), torch.randn(3)
    state = {"base_model.model.proj.base_layer.weight": w, "base_model.model.proj.base_layer.bias": bias,
             "base_model.model.proj.lora_A.default.weight": a, "base_model.model.proj.lora_B.default.weight": b,
             "base_model.model.norm.weight": torch.ones(3)}
    merged = merged_lora_state_dict(state, {"base_model.model.proj": (0.5, False)})
    assert set(merged) == {"proj.weight", "proj.bias", "norm.weight"}
    torch.testing.assert_close(merged["proj.weight"], w + 0.5 * b @ a)
    assert merged["proj.bias"] is bias and torch.equal(state["base_model.model.proj.base_layer.weight"], w)
    bf16 = merged_lora_state_dict({**state, "base_model.model.proj.base_layer.weight": w.bfloat16()},
                                  {"base_model.model.proj": (0.5, False)})
    # a bf16 base: the merged weights stay fp32 (a small update is not rounded away), as does the rest
    assert {t.dtype for t in bf16.values()} == {torch.float32}
    torch.testing.assert_close(bf16["proj.weight"], w.bfloat16().float() + 0.5 * b @ a)


def test_lora_on_a_layer_that_is_not_linear_is_a_config_error(tiny_qwen):
    pytest.importorskip("peft")
    with pytest.raises(ConfigError, match="other than linear"):
        Embedder(str(tiny_qwen), lora={**LORA, "target_modules": ["embed_tokens", "q_proj"]})
