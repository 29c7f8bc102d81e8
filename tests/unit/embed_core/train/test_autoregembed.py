"""AutoRegEmbed (autoregembed.txt): the CDA loss against hand computation, the compression encoder's
layout and inference embedding, the frozen decoder's log-probabilities, and both stages through the
train stage on a tiny Gemma-3 built in code; plus LoRA on the decoder embedder."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from embed_core.stages import records_upstream
from embed_core.config import parse_config
from embed_core.train.config import AutoRegEmbedConfig, TrainConfig, TrainStageConfig
from embed_core.losses.autoregembed import CDALoss, cda_loss, ic_loss

from tests.helpers.repo import REPO  # noqa: E402

pytestmark = pytest.mark.slow  # trains or reads real data: make test, not make test-fast


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory) -> Path:
    from tests.helpers.tiny_model import build_tiny_gemma

    return build_tiny_gemma(tmp_path_factory.mktemp("gemma") / "model")


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# -- the CDA loss (Eq. 2) -------------------------------------------------------------------------
def test_cda_loss_matches_hand_computation_on_two_examples():
    lp_q_pos = torch.tensor([-10.0, -20.0])
    lp_self = torch.tensor([-8.0, -25.0])
    lp_q_neg = torch.tensor([[-12.0], [-18.0]])
    ref_pos = torch.tensor([-11.0, -21.0])
    ref_neg = torch.tensor([[-11.0], [-19.0]])
    beta, tau = 0.1, 0.05

    def row(gap_self: float, margin: float) -> float:
        a = -_sig(beta * abs(gap_self)) / tau  # S1 / tau
        b = -_sig(beta * margin) / tau  # S2 / tau
        return -a + math.log(math.exp(a) + math.exp(b))

    # paper: margin = (lp+ - lp-) - (ref+ - ref-): row 0: 2 - 0 = 2; row 1: -2 - (-2) = 0
    paper = (row(-10 + 8, 2.0) + row(-20 + 25, 0.0)) / 2
    assert row(-2, 2.0) == pytest.approx(math.log(2))  # S1 = S2 in row 0
    got = cda_loss(lp_q_pos, lp_self, lp_q_neg, ref_pos, ref_neg, beta=beta, tau=tau)
    assert float(got) == pytest.approx(paper, rel=1e-6)
    # the authors' code adds the reference gap: row 0: 2 + 0; row 1: -2 + (-2) = -4
    repo = (row(-2, 2.0) + row(5, -4.0)) / 2
    got_repo = cda_loss(lp_q_pos, lp_self, lp_q_neg, ref_pos, ref_neg, beta=beta, tau=tau, reference_sign="repo")
    assert float(got_repo) == pytest.approx(repo, rel=1e-6)
    assert float(got_repo) != pytest.approx(float(got))


def test_cda_loss_sums_over_an_examples_negatives_and_offers_the_appendix_squashes():
    lp_q_pos, lp_self = torch.tensor([-5.0]), torch.tensor([-6.0])
    lp_q_neg, ref_pos, ref_neg = torch.tensor([[-9.0, -4.0]]), torch.tensor([-5.0]), torch.tensor([[-7.0, -7.0]])
    a = -math.tanh(0.1 * 1.0) / 0.05
    b1 = -math.tanh(0.1 * ((-5 + 9) - (-5 + 7))) / 0.05
    b2 = -math.tanh(0.1 * ((-5 + 4) - (-5 + 7))) / 0.05
    expected = -a + math.log(math.exp(a) + math.exp(b1) + math.exp(b2))
    got = CDALoss(squash="tanh")(lp_q_pos, lp_self, lp_q_neg, ref_pos, ref_neg)
    assert float(got) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="squash"):
        CDALoss(squash="relu")
    with pytest.raises(ValueError, match="beta"):
        CDALoss(beta=0)


def test_ic_loss_is_mean_token_nll():
    token_lp = torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]])  # zeros at padding
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert float(ic_loss(token_lp, mask)) == pytest.approx(2.0)


# -- the two networks -----------------------------------------------------------------------------
def test_compression_encoder_layout_and_inference_embedding(tiny_gemma, tmp_path):
    from embed_core.model.encoder import Encoder
    from embed_core.train.engine.autoregembed.model import CompressionEncoder

    enc = CompressionEncoder(str(tiny_gemma), compress_tokens=3, max_length=16).eval()
    texts = ["a short one", "a much longer sentence with many more words than the first"]
    features = enc.tokenize(texts, ["say it", "say it"])
    lengths = features["attention_mask"].sum(1).tolist()
    assert max(lengths) == 16  # the long text was cut so the three tokens still fit
    for row, n in enumerate(lengths):  # the k tokens sit right after each sequence's true length
        assert features["input_ids"][row, n - 3:n].tolist() == enc.compress_ids
    with torch.no_grad():
        states = enc.compress(features)
        emb = enc(features)
    assert states.shape == (2, 3, enc.dim)
    manual = torch.nn.functional.normalize(states.mean(dim=1), dim=-1)
    assert torch.allclose(emb, manual, atol=1e-6)
    assert torch.allclose(emb.norm(dim=-1), torch.ones(2), atol=1e-5)

    # the saved model, encoded by the evaluator's Encoder, gives the same vectors
    out = enc.save(tmp_path / "saved", task_instructions={"sts": "say it"})
    ev = Encoder(str(out), pooling="compress", compress_tokens=3, max_length=16, precision="fp32")
    vec = ev.encode([enc.format(t, "say it") for t in texts])
    assert torch.allclose(torch.from_numpy(vec), emb, atol=1e-5)


def test_frozen_decoder_scores_targets_from_the_prefix_only(tiny_gemma):
    from embed_core.train.engine.autoregembed.model import FrozenDecoder

    dec = FrozenDecoder(str(tiny_gemma), target_max_length=8)
    assert not any(p.requires_grad for p in dec.parameters())
    dec.train()
    assert not dec.lm.training  # no dropout whatever the trainer does
    torch.manual_seed(1)
    prefix = torch.randn(2, 3, 32, requires_grad=True)
    ids, mask = dec.targets(["one two three four", "five"])
    assert ids[1, int(mask[1].sum()) - 1] == dec.eos_id  # target + EOS
    lp = dec.sequence_logprob(prefix, ids, mask)
    # by hand for row 1 alone (no padding): position k-1+t predicts target token t
    n = int(mask[1].sum())
    inputs = torch.cat([prefix[1:2], dec.lm.get_input_embeddings()(ids[1:2, :n])], dim=1)
    logp = torch.log_softmax(dec.lm(inputs_embeds=inputs).logits[0].float(), dim=-1)
    manual = sum(float(logp[3 - 1 + t, ids[1, t]]) for t in range(n))
    assert float(lp[1]) == pytest.approx(manual, abs=1e-4)
    lp.sum().backward()
    assert prefix.grad is not None and prefix.grad.abs().sum() > 0  # gradients reach the prefix


def _stage(**kw) -> TrainStageConfig:
    return TrainStageConfig(**{"name": "s", "steps": 2, "lr": 5e-3, "warmup_steps": 0, "checkpoint_every": 100,
                               "batch_size": {"autoregembed": 2}, **kw})


def test_information_compression_trains_the_encoder_and_leaves_the_decoder_frozen(tiny_gemma, tmp_path):
    from embed_core.train.engine.autoregembed.data import ICExample
    from embed_core.train.engine.autoregembed.trainer import AutoRegEmbedTrainer

    stage = _stage(mode="autoregembed_ic")
    train = TrainConfig(base_model=str(tiny_gemma), stages=[stage],
                        autoregembed=AutoRegEmbedConfig(compress_tokens=3, context_max_length=24, target_max_length=12))
    examples = [ICExample(t, "say it", t) for t in ("the cat sat", "a dog ran far", "birds sing", "rain falls")]
    trainer = AutoRegEmbedTrainer(train, stage, examples, init_model=str(tiny_gemma), decoder_model=str(tiny_gemma),
                                  checkpoint_dir=tmp_path / "ckpt", log=lambda m: None)
    decoder_before = {k: v.clone() for k, v in trainer.decoder.state_dict().items()}
    encoder_before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    rows = trainer.fit().metrics
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    assert all(torch.equal(v, trainer.decoder.state_dict()[k]) for k, v in decoder_before.items())
    changed = [k for k, v in trainer.model.state_dict().items() if not torch.equal(v, encoder_before[k])]
    assert changed  # the encoder learned
    assert not any(name.startswith("decoder") for name, _ in trainer.model.named_parameters())


@pytest.mark.slow
# -- both stages through the train stage ----------------------------------------------------------
def test_autoregembed_stages_run_through_the_pipeline_and_reuse_reference_scores(tiny_gemma, tmp_path):
    from embed_core.artifacts import read_manifest
    from embed_core.model.encoder import Encoder
    from embed_core.model.settings import read_model_settings
    from embed_core.prepare.run import run_prepare
    from embed_core.train.run import run_train_stage

    cfg = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    for key in ("synthesize", "mine", "evaluate"):
        cfg.pop(key, None)
    cfg["data_root"], cfg["run_root"] = str(REPO / "data"), str(tmp_path / "runs")
    cfg["prepare"]["sources"] = [s for s in cfg["prepare"]["sources"] if s["name"] in ("stsb", "scifact")]
    common = {"steps": 2, "lr": 1e-3, "warmup_steps": 0, "batch_size": {"autoregembed": 4}, "checkpoint_every": 100}
    cfg["train"] = {"base_model": str(tiny_gemma), "use_instructions": False,
                    "autoregembed": {"compress_tokens": 3, "context_max_length": 32, "target_max_length": 16},
                    "stages": [{"name": "ic", "mode": "autoregembed_ic", "datasets": ["stsb"], **common},
                               {"name": "cda", "mode": "autoregembed_cda", **common}]}
    config = parse_config(cfg)
    run_dir = tmp_path / "runs/demo"
    run_prepare(config, run_dir)
    run_train_stage(config, run_dir, "ic", upstream=records_upstream(config, "train"))
    manifest = run_train_stage(config, run_dir, "cda", upstream=records_upstream(config, "train"))
    assert manifest["init_model"].endswith("train-ic/model")
    ref = read_manifest(run_dir, "reference-cda")
    assert ref["counts"]["examples"] > 0 and ref["counts"]["negatives"] == 1
    first_created = ref["created_at"], (run_dir / "reference-cda/scores.parquet").stat().st_mtime_ns
    run_train_stage(config, run_dir, "cda", upstream=records_upstream(config, "train"))  # same inputs: the reference scores are read, not recomputed
    assert (run_dir / "reference-cda/scores.parquet").stat().st_mtime_ns == first_created[1]

    model = run_dir / "train-cda/model"
    settings = read_model_settings(model)
    assert (settings.pooling, settings.compress_tokens, settings.instructions_fixed) == ("compress", 3, True)
    assert settings.task_instructions["sts"] == config.train.autoregembed.sts_instruction
    assert settings.task_instructions["retrieval_passage"] == config.train.autoregembed.passage_instruction
    vec = Encoder(str(model), pooling="compress", compress_tokens=3, max_length=32, precision="fp32").encode(
        [settings.format(settings.task_instructions["sts"], "A man plays a guitar.")])
    assert abs(float((vec ** 2).sum()) - 1.0) < 1e-5


# -- LoRA on the decoder embedder (QZhou §3.1 track) ---------------------------------------------
def test_lora_trains_adapters_only_and_saves_a_plain_merged_model(tiny_gemma, tmp_path):
    pytest.importorskip("peft")
    from transformers import AutoModel

    from embed_core.model.embedder import Embedder

    m = Embedder(str(tiny_gemma), pooling="mean", bidirectional=True,
                 lora={"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"})
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    frozen_before = {n: p.clone() for n, p in m.named_parameters() if not p.requires_grad}
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        emb = m(m.tokenize(["a cat", "a dog sleeps"]))
        (1 - emb[0] @ emb[1]).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(p, frozen_before[n]) for n, p in m.named_parameters() if not p.requires_grad)
    out = m.save(tmp_path / "saved")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "lora" in k]
    plain = AutoModel.from_pretrained(out).eval()
    assert plain.config.use_bidirectional_attention
    m.eval()
    features = m.tokenize(["a bird flies"])
    with torch.no_grad():
        ours = m(features)
        hidden = plain(input_ids=features["input_ids"], attention_mask=features["attention_mask"]).last_hidden_state
    mask = features["attention_mask"].unsqueeze(-1).float()
    theirs = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    assert torch.allclose(ours, theirs, atol=1e-4)  # adapters merged, not dropped
