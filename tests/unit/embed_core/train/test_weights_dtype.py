"""``train.weights_dtype``: a frozen LoRA base stored in bf16 (half its weight bytes) trains within a
stated tolerance of the all-fp32 run; trained weights are fp32 master weights whatever dtype the
checkpoint was saved in."""

import pytest
import torch
import yaml

from embed_core.config import parse_config
from embed_core.stages import records_upstream
from tests.helpers.repo import REPO
from tests.helpers.tiny_model import build_tiny_decoder

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from embed_core.prepare.run import run_prepare

    tmp = tmp_path_factory.mktemp("dtype")
    cfg = yaml.safe_load((REPO / "deployments/configs/demo.yaml").read_text())
    cfg.update(data_root=str(REPO / "data"), run_root=str(tmp / "runs"))
    for key in ("synthesize", "mine", "evaluate", "train"):
        cfg.pop(key, None)
    model = build_tiny_decoder(tmp / "qwen3", "qwen3")
    cfg["train"] = {"base_model": str(model), "max_length": 48, "bidirectional": True, "precision": "fp32",
                    "stages": [{"name": "s", "tasks": ["retrieval"], "steps": 1}]}
    config = parse_config(cfg)
    run_prepare(config, tmp / "runs/demo")
    return config, tmp / "runs/demo", model, tmp


def _trainer(prepared, **train_update):
    from embed_core.train.config import TrainStageConfig
    from embed_core.train.run import load_datasets
    from embed_core.train.engine.trainer import Trainer

    config, run_dir, model, tmp = prepared
    stage = TrainStageConfig(name="s", tasks=["retrieval"], steps=1, batch_size={"retrieval": 8},
                             num_hard_negatives=2, query_max_length=32, passage_max_length=48)
    datasets = load_datasets(run_dir, stage, records_upstream(config, "train"))
    from embed_core.train.config import LoraSettings

    if "lora" in train_update:
        train_update = {**train_update, "lora": LoraSettings(**train_update["lora"])}
    # model_copy, not a validated config: the last test reaches the trainer's own check
    train = config.train.model_copy(update=train_update)
    trainer = Trainer(train, stage, datasets, init_model=str(train_update.get("base_model", model)),
                      checkpoint_dir=tmp / "ck", seed=0)
    return trainer, datasets


def _step(trainer, datasets):
    from embed_core.train.engine.batches import build_batch

    torch.manual_seed(0)
    for p in trainer.model.parameters():  # peft starts LoRA's B at zero: give every adapter a gradient path
        if p.requires_grad and p.ndim == 2 and not p.any():
            torch.nn.init.normal_(p, std=0.02)
    trainer.model.eval()
    batch = build_batch(datasets["scifact"], list(range(8)), step=0, seed=0, num_negatives=2,
                        query_max_length=32, passage_max_length=48, use_instructions=False)
    loss = trainer._forward_backward(batch, 1.0)
    return loss, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def _bytes(model, trainable: bool) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad is trainable)


def test_a_bf16_stored_lora_base_halves_its_bytes_and_trains_within_tolerance_of_fp32(prepared):
    """Reference: weights and compute fp32. bf16 storage computes in bf16 (autocast), so the bound is
    bf16's: the loss within 2 % and every adapter gradient pointing the same way (cosine >= 0.98), as
    for bf16 autocast alone (test_training's bf16 test)."""
    fp32, datasets = _trainer(prepared, lora=LORA, weights_dtype="fp32", precision="fp32")
    bf16, _ = _trainer(prepared, lora=LORA, weights_dtype="bf16", precision="bf16")
    assert {p.dtype for p in bf16.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in bf16.model.parameters() if p.requires_grad} == {torch.float32}  # adapters: fp32 masters
    assert _bytes(bf16.model, trainable=False) * 2 == _bytes(fp32.model, trainable=False)
    assert _bytes(bf16.model, trainable=True) == _bytes(fp32.model, trainable=True)
    (loss32, grads32), (loss16, grads16) = _step(fp32, datasets), _step(bf16, datasets)
    assert abs(loss16 - loss32) <= 0.02 * abs(loss32), (loss16, loss32)
    assert grads32.keys() == grads16.keys() and grads32
    assert all("lora_" in name for name in grads32)
    for name in grads32:
        cosine = torch.nn.functional.cosine_similarity(grads32[name].flatten(), grads16[name].flatten(), dim=0)
        assert cosine >= 0.98, (name, float(cosine))


def test_a_full_fine_tune_of_a_bf16_checkpoint_keeps_fp32_master_weights(prepared, tmp_path):
    from transformers import AutoModel

    _, _, model, _ = prepared
    AutoModel.from_pretrained(model, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model / name).exists():
            (tmp_path / "bf16" / name).write_bytes((model / name).read_bytes())
    assert {p.dtype for p in AutoModel.from_pretrained(tmp_path / "bf16").parameters()} == {torch.bfloat16}
    trainer, datasets = _trainer(prepared, base_model=str(tmp_path / "bf16"), weights_dtype="bf16", precision="bf16")
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    _step(trainer, datasets)
    trainer._optimizer_step()
    assert trainer.optimizer.state and all(
        s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())


def test_bf16_storage_on_a_device_computing_in_fp32_is_refused_before_training(prepared):
    from embed_core.errors import ConfigError

    with pytest.raises(ConfigError, match="weights_dtype: bf16 needs bf16 compute"):
        _trainer(prepared, lora=LORA, weights_dtype="bf16", precision="fp32")
