"""Packed passes (``embed_core.model.packing``, ``train.packing``): a group's texts laid back to
back, attention and pooling per text, give the padded ``Embedder.forward(Embedder.tokenize(...))``
embeddings within 1e-5 in fp32 — for every pooling (mean, cls, last_token, mean without the
instruction) on a tiny BERT, a tiny bidirectional Qwen3 and a tiny causal Qwen3 (random init, built
in code), with a one-token text, a text left empty by its instruction and a text cut at exactly
max_length; in both layouts (masked rows under SDPA / eager, one variable-length row under
FlashAttention, emulated here by an attention function registered with transformers); and through
the trainer (loss and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embed_core.config import parse_config
from embed_core.errors import ConfigError
from embed_core.model.embedder import Embedder
from embed_core.model.packing import best_fit_rows
from tests.helpers.tiny_model import build_tiny_bert, build_tiny_decoder

MAX_LENGTH = 24
INSTRUCTION = "Find the passage"
# a one-word text; a text with nothing after its instruction; one far past MAX_LENGTH (cut to it exactly)
TEXTS = ["x", "", "a much longer text that goes on and on " * 8, "some words here and there", "short one"]
INSTRUCTIONS = [None, INSTRUCTION, INSTRUCTION, None, INSTRUCTION]
POOLINGS = {"mean": ("mean", False), "cls": ("cls", False), "last_token": ("last_token", False),
            "instruction_excluded_mean": ("mean", True)}
MODELS = ("bert", "bidirectional_qwen3", "causal_qwen3")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    bert = build_tiny_bert(root / "bert", dropout=0.0)
    qwen3 = build_tiny_decoder(root / "qwen3", "qwen3", bert)
    return {"bert": bert, "qwen3": qwen3, "mistral": build_tiny_decoder(root / "mistral", "mistral", bert,
                                                                        sliding_window=8)}


def _embedder(model_dirs, model: str, pooling: str = "mean", exclude: bool = False, **kw) -> Embedder:
    path = model_dirs["bert" if model == "bert" else "qwen3"]
    return Embedder(str(path), pooling=pooling, max_length=MAX_LENGTH, exclude_instruction_from_pooling=exclude,
                    bidirectional=model.startswith("bidirectional"), **kw).eval()


def _padded_and_packed(m: Embedder, features: dict) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return m(features), m(m.pack(features))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("pooling", POOLINGS)
def test_packed_pooling_equals_padded_pooling_on_an_encoder_and_decoders(model_dirs, model, pooling):
    m = _embedder(model_dirs, model, *POOLINGS[pooling])
    features = m.tokenize(TEXTS, INSTRUCTIONS)
    lengths = features["attention_mask"].sum(dim=1)
    assert int(lengths.max()) == MAX_LENGTH and int(lengths[0]) == 3  # cut at max_length; [CLS] x [SEP]
    if POOLINGS[pooling][1]:
        assert int(features["pool_mask"][1].sum()) == 1  # empty after the instruction: its last token alone
    padded, packed = _padded_and_packed(m, features)
    assert m.pack(features)["input_ids"].numel() < features["input_ids"].numel()
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("pooling", ["mean", "cls", "last_token"])
def test_one_token_sequences_pack_to_the_padded_embeddings(model_dirs, model, pooling):
    m = _embedder(model_dirs, model, pooling)
    lengths = torch.tensor([1, 5, 1, 9, 2])
    mask = (torch.arange(9)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1000, 2000, mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    features = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
                "pool_mask": mask.clone()}
    padded, packed = _padded_and_packed(m, features)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model", ["bert", "bidirectional_qwen3"])
def test_eager_attention_gets_the_additive_form_of_the_packed_mask_and_the_same_embeddings(model_dirs, model):
    m = _embedder(model_dirs, model)
    m.model.set_attn_implementation("eager")
    padded, packed = _padded_and_packed(m, m.tokenize(TEXTS, INSTRUCTIONS))
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)


def _emulated_flash_varlen(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, is_causal=None, **_):
    """FlashAttention's variable-length semantics on CPU: attention within each [start, end) of
    ``cu_seq_lens``, causal as transformers' flash path decides (the kwarg, else the module's)."""
    assert attention_mask is None and query.size(0) == 1 and torch.equal(cu_seq_lens_q, cu_seq_lens_k)
    causal = is_causal if is_causal is not None else module.is_causal
    groups = query.size(1) // key.size(1)
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    bounds = cu_seq_lens_q.tolist()
    assert max_length_q == max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    out = torch.cat([F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
                                                    is_causal=causal, scale=scaling)
                     for s, e in zip(bounds[:-1], bounds[1:])], dim=2)
    return out.transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("model", MODELS)
def test_under_flash_attention_the_texts_go_in_one_row_with_the_kernels_boundaries_and_no_mask(model_dirs, model):
    from transformers import AttentionInterface

    AttentionInterface.register("emulated_flash_varlen", _emulated_flash_varlen)
    m = _embedder(model_dirs, model, "mean", True)
    features = m.tokenize(TEXTS, INSTRUCTIONS)
    with torch.no_grad():
        padded = m(features)
        # set on the config: set_attn_implementation would look for a real flash kernel for the name
        m.model.config._attn_implementation = "emulated_flash_varlen"
        assert m.varlen_attention
        packed_features = m.pack(features)
        packed = m(packed_features)
    lengths = features["attention_mask"].sum(dim=1)
    assert packed_features["input_ids"].shape == (1, int(lengths.sum()))  # not one padding position
    assert packed_features["cu_seqlens"].tolist() == [0, *torch.cumsum(lengths, 0).tolist()]
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)


def test_a_sliding_window_model_keeps_padded_passes_for_a_text_longer_than_its_window(model_dirs):
    m = Embedder(str(model_dirs["mistral"]), pooling="mean", max_length=MAX_LENGTH).eval()  # window 8
    assert m.pack(m.tokenize(["a b", "c d e"])) is not None
    assert m.pack(m.tokenize(["a b", "one two three four five six seven eight"])) is None


def test_best_fit_rows_place_every_text_within_its_row_without_overlap():
    lengths = [7, 1, 3, 7, 2, 5, 4, 1, 6, 2]
    place = best_fit_rows(lengths, 7)
    taken: dict[int, set[int]] = {}
    for (row, offset), n in zip(place, lengths):
        cells = set(range(offset, offset + n))
        assert offset + n <= 7 and not cells & taken.get(row, set())
        taken.setdefault(row, set()).update(cells)
    assert len(taken) == -(-sum(lengths) // 7)  # as few rows as the tokens need here


def _trainer(model_dirs, tmp_path, packing: str):
    from embed_core.schema import Record, records_to_table
    from embed_core.train.engine.batches import DatasetRecords
    from embed_core.train.config import TrainConfig, TrainStageConfig
    from embed_core.train.engine.trainer import Trainer

    pairs = [("what is x", "x is a letter " * (i + 1)) for i in range(6)]
    recs = [Record(id=f"d:{i}", dataset="d", task="retrieval", instruction=INSTRUCTION, query=q, positives=[p],
                   positive_scores=[], negatives=[], negative_scores=[], negative_labels=[], weak_positives=[],
                   label=None, origin="original", source_ref=f"d:{i}") for i, (q, p) in enumerate(pairs)]
    stage = TrainStageConfig(name="p", steps=1, batch_size={"retrieval": 6}, num_hard_negatives=0,
                             query_max_length=MAX_LENGTH, passage_max_length=MAX_LENGTH)
    cfg = TrainConfig(base_model=str(model_dirs["bert"]), max_length=MAX_LENGTH, precision="fp32", packing=packing,
                      exclude_instruction_from_pooling=True, stages=[stage])
    return Trainer(cfg, stage, {"d": DatasetRecords("d", records_to_table(recs))}, init_model=str(model_dirs["bert"]),
                   checkpoint_dir=tmp_path / packing, seed=0, log=lambda _: None)


def test_a_packed_training_step_gives_the_padded_loss_gradients_and_token_counts(model_dirs, tmp_path):
    from embed_core.train.engine.batches import build_batch

    results = {}
    for packing in ("off", "on"):
        trainer = _trainer(model_dirs, tmp_path, packing)
        passes = []
        trainer.model.register_forward_hook(lambda _m, args, _out: passes.append(args[0]["input_ids"].shape))
        batch = build_batch(trainer.datasets["d"], list(range(6)), step=0, seed=0, num_negatives=0,
                            query_max_length=MAX_LENGTH, passage_max_length=MAX_LENGTH, use_instructions=True)
        loss = trainer._forward_backward(batch, 1.0)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results[packing] = (loss, grads, passes, trainer.passes.tokens, trainer.passes.texts)
    (loss_off, grads_off, passes_off, *counts_off), (loss_on, grads_on, passes_on, *counts_on) = results.values()
    assert len(passes_on) == len(batch.groups) < len(passes_off)  # one packed pass per group
    assert counts_on == counts_off
    assert abs(loss_on - loss_off) < 1e-5
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_auto_packs_every_group_under_flash_attention_and_under_sdpa_the_groups_whose_rows_it_cuts_by_a_quarter(
        model_dirs, tmp_path):
    auto, off = _trainer(model_dirs, tmp_path, "auto"), _trainer(model_dirs, tmp_path, "off")
    short_and_skewed, one_per_row = torch.tensor([8, 2, 2, 2, 2, 2, 2, 2]), torch.tensor([8, 8, 8, 7])
    assert not auto.passes.packs  # SDPA on CPU: group by group
    assert auto.passes._packs(short_and_skewed) and not auto.passes._packs(one_per_row)
    assert not off.passes._packs(short_and_skewed)
    for trainer in (auto, off):
        trainer.model.model.config._attn_implementation = "flash_attention_2"  # read, never run, here
    assert auto.passes.packs and auto.passes._packs(one_per_row) and not off.passes.packs


def test_packing_pays_where_best_fit_rows_as_wide_as_the_longest_text_number_at_most_three_quarters_of_the_texts():
    from embed_core.model.packing import packing_pays

    assert packing_pays([8, 2, 2, 2, 2, 2, 2, 2])  # rows of 8: [8] [2 2 2 2] [2 2 2] = 3 rows for 8 texts
    assert packing_pays([4, 4, 2, 2])              # [4] [4] [2 2] = 3 rows for 4 texts: exactly 3/4
    assert not packing_pays([4, 4, 3, 2])          # [4] [4] [3] [2]... best fit: [4] [4] [3] [2] = 4 rows
    assert not packing_pays([8, 8, 8, 7])          # one text a row (SciFact's 256-token passages)
    assert not packing_pays([5])


def test_packing_rejects_a_value_other_than_auto_on_or_off():
    sources = [{"name": "stsb", "kind": "sts", "path": "stsb/train.csv"}]
    with pytest.raises(ConfigError, match=r"^c.yaml: train.packing: Input should be 'auto', 'on' or 'off'"):
        parse_config({"prepare": {"sources": sources}, "train": {"packing": "yes", "stages": [{"name": "s"}]}},
                     origin="c.yaml")
    assert parse_config({"prepare": {"sources": sources}, "train": {"stages": [{"name": "s"}]}}).train.packing == "auto"


def test_attention_auto_keeps_transformers_default_off_cuda_and_flash_attention_is_refused_there():
    from embed_core.errors import ConfigError
    from embed_core.model.packing import resolve_attention

    assert resolve_attention("auto", "cpu") is None
    assert resolve_attention("eager", "cpu") == "eager"
    with pytest.raises(ConfigError, match="flash_attention_2 needs CUDA and a flash-attn package that imports"):
        resolve_attention("flash_attention_2", "cpu")
