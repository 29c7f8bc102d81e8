"""A stage whose training diverged is not committed: NaN or infinite weights end the stage with one
line naming the stage, the first broken tensor and the step its loss stopped being finite, and the
stage directory keeps what it held."""

import math

import pytest
import torch

from embed_core.config import parse_config
from embed_core.train.engine.finite import NonFiniteError, check_finite_weights
from tests.unit.embed_core.train.test_training import _config_dict


def test_finite_weights_pass_and_one_nan_tensor_is_one_line_naming_it_and_the_first_bad_step():
    good = [("a.weight", torch.ones(3)), ("a.ids", torch.arange(3))]
    check_finite_weights("s", good, [{"step": 1, "loss": 0.5}], 1)
    bad = [*good, ("b.weight", torch.tensor([1.0, math.nan])), ("c.weight", torch.tensor([math.inf]))]
    rows = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": math.nan}]
    with pytest.raises(NonFiniteError) as info:
        check_finite_weights("s", bad, rows, 2)
    message = str(info.value)
    assert "\n" not in message and "2 weight tensors" in message and "first: b.weight" in message
    assert "not finite from step 2" in message and "nothing was committed" in message


@pytest.mark.slow
def test_a_stage_that_diverges_commits_nothing(tmp_path, tiny_model):
    from embed_core.prepare.run import run_prepare
    from embed_core.stages import records_upstream
    from embed_core.train.run import run_train_stage

    raw = _config_dict(tmp_path, tiny_model)
    raw["train"]["stages"] = [dict(raw["train"]["stages"][0], steps=3, lr=1e30, warmup_steps=0)]
    config = parse_config(raw)
    run_dir = tmp_path / "runs/demo"
    run_prepare(config, run_dir)
    with pytest.raises(NonFiniteError, match="train stage stage1: .* hold NaN or infinite values after step 3"):
        run_train_stage(config, run_dir, "stage1", upstream=records_upstream(config, "train"))
    assert not (run_dir / "train-stage1").exists()
