"""A training stage with ``merge`` (issue 36, item 5) saves the average of its trained weights and
an earlier stage's: exactly (1 − w)·θ_stage + w·θ_other, recorded in its manifest; the merge is
part of the stage's cache key; naming a stage that is not earlier is refused at load."""

import pytest
import torch
from safetensors.torch import load_file

from embed_core.artifacts import read_manifest
from embed_core.config import parse_config
from embed_core.errors import ConfigError
from tests.helpers.repo import tiny_demo_config



def _config(tmp, tiny_model, merge=None):
    return parse_config(tiny_demo_config(tmp, tiny_model, "merge", [
        {"name": "stage1", "tasks": ["retrieval"], "steps": 3},
        {"name": "stage2", "tasks": ["sts"], "steps": 3, **({"merge": merge} if merge else {})}]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model):
    from embed_core.prepare.run import run_prepare
    from embed_core.train.run import run_train_stage

    tmp = tmp_path_factory.mktemp("merge")
    plain = _config(tmp, tiny_model)
    run_dir = tmp / "runs/merge"
    run_prepare(plain, run_dir)
    for stage in ("stage1", "stage2"):
        run_train_stage(plain, run_dir, stage, upstream="prepare")
    weights = {name: load_file(str(run_dir / f"train-{name}/model/model.safetensors")) for name in ("stage1", "stage2")}
    merged = _config(tmp, tiny_model, merge={"stage": "stage1", "weight": 0.25})
    run_train_stage(merged, run_dir, "stage2", upstream="prepare")  # the same training, then the average
    return run_dir, weights, plain, merged


def test_the_saved_weights_are_the_weighted_average_of_the_stage_and_the_earlier_stage(trained):
    run_dir, weights, _, _ = trained
    saved = load_file(str(run_dir / "train-stage2/model/model.safetensors"))
    assert set(saved) == set(weights["stage2"])
    for name, tensor in saved.items():
        expected = 0.75 * weights["stage2"][name].float() + 0.25 * weights["stage1"][name].float()
        torch.testing.assert_close(tensor.float(), expected, rtol=0, atol=1e-6)
    assert any(not torch.equal(saved[n], weights["stage2"][n]) for n in saved)
    assert read_manifest(run_dir, "train-stage2")["merged_with"] == {"stage": "stage1", "weight": 0.25}


def test_the_merge_is_part_of_the_stages_cache_key(trained):
    from embed_core.train.key import input_fingerprint

    run_dir, _, plain, merged = trained
    keys = {input_fingerprint(c, run_dir, "stage2", upstream="prepare").key for c in (plain, merged)}
    assert len(keys) == 2
    assert read_manifest(run_dir, "train-stage2")["input_fingerprint"] == \
        input_fingerprint(merged, run_dir, "stage2", upstream="prepare").key


def test_merging_with_a_stage_that_is_not_earlier_is_refused_at_load(tmp_path, tiny_model):
    with pytest.raises(ConfigError, match=r"stages\[stage2\]\.merge\.stage: 'stage3' is no earlier stage "
                                          r"\(earlier: stage1\)"):
        _config(tmp_path, tiny_model, merge={"stage": "stage3"})
