"""A damaged training checkpoint through the real CLI (``embedpipe train``): one line naming the
checkpoint and ``--no-resume``; the checkpoint is left as it was, and ``--no-resume`` trains."""

import pytest
import yaml

from embed_core.config import load_config
from embed_core.train.key import input_fingerprint
from embed_core.train.run import load_datasets
from embed_core.train.engine.trainer import Trainer
from tests.helpers.cli_run import in_process
from tests.unit.embed_core.train.test_training import _config_dict

pytestmark = pytest.mark.prefect


def _write_config(tmp_path, tiny_model):
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(_config_dict(tmp_path, tiny_model)))
    return config_path


def test_a_cut_off_checkpoint_is_one_line_that_names_it_and_no_resume(tmp_path, capfd, tiny_model, prefect_harness):
    config_path = _write_config(tmp_path, tiny_model)
    assert in_process(capfd, "prepare", "--config", config_path).rc == 0
    config = load_config(config_path)  # stage1 interrupted after its first checkpoint, as a kill leaves it
    run_dir = tmp_path / "runs" / config.run_name
    stage = config.train.stages[0]
    fingerprint = input_fingerprint(config, run_dir, stage.name, upstream="prepare")
    ckpt_dir = run_dir / "checkpoints" / stage.name
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / "input_fingerprint").write_text(fingerprint.key)
    trainer = Trainer(config.train, stage, load_datasets(run_dir, stage, "prepare"), init_model=str(tiny_model),
                      checkpoint_dir=ckpt_dir, seed=config.seed)
    checkpoint = trainer.save_checkpoint()
    state = checkpoint / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])  # a copy cut off, a disk that filled up
    damaged = state.read_bytes()

    result = in_process(capfd, "train", "--config", config_path, "--stage", stage.name)
    result.assert_one_line_error(f"{checkpoint}: damaged checkpoint, cannot resume from it", "--no-resume")
    assert state.read_bytes() == damaged  # nothing deleted behind the user's back

    assert in_process(capfd, "train", "--config", config_path, "--stage", stage.name, "--no-resume").rc == 0
    assert (run_dir / f"train-{stage.name}/model/model.safetensors").exists()
