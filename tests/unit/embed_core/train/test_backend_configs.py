"""What the training back ends are given: DeepSpeed's engine config gets a bf16 section when the
trainer computes in bf16 (review F23: without it ZeRO partitions and communicates in fp32 while the
forward autocasts), and the user's ``train.deepspeed`` still wins."""

from embed_core.train.engine.backends.deepspeed import engine_config
from embed_core.train.config import TrainStageConfig


def test_deepspeed_gets_bf16_enabled_when_the_trainer_trains_in_bf16_and_not_otherwise():
    stage = TrainStageConfig(name="s", grad_accum=4, max_grad_norm=1.0)
    zero2 = {"zero_optimization": {"stage": 2}}
    on = engine_config(stage, zero2, bf16=True)
    assert on == {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
                  "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    assert "bf16" not in engine_config(stage, zero2, bf16=False)


def test_the_users_deepspeed_bf16_section_wins_over_the_trainers():
    stage = TrainStageConfig(name="s")
    assert engine_config(stage, {"bf16": {"enabled": False}}, bf16=True)["bf16"] == {"enabled": False}
