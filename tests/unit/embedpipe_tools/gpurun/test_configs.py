"""The configs gpu-run drives the CLI with: quality.yaml at precision auto under the report
folder, the ablation's 6 rows x 3 seeds seed by seed, and the tiny versions, which keep every stage,
task list, loss, dev selection and variant and change only sizes, data and models."""

from __future__ import annotations

from pathlib import Path

from embed_core.config import load_config
from embedpipe_tools.gpurun.configs import ABLATION, QUALITY, TINY, ablation_rows, quality_config


def test_the_quality_run_is_quality_yaml_at_precision_auto_evaluating_its_own_last_stage(tmp_path):
    recipe = load_config(QUALITY)
    run = quality_config(tmp_path)
    assert recipe.train.precision == "fp32" and run.train.precision == "auto"
    assert run.run_root == str(tmp_path / "runs") and run.run_name == "gpu-run-quality"
    assert run.evaluate.models == ["base", str(tmp_path / "runs/gpu-run-quality/train-stage3/model")]
    assert run.train.stages == recipe.train.stages and run.prepare == recipe.prepare


def test_the_ablation_runs_every_row_at_one_seed_before_the_next_seed(tmp_path):
    cfg, runs = ablation_rows(tmp_path)
    rows = ["base", "merge", "remine", "negatives-0", "negatives-4", "one-stage"]
    assert cfg.ablation.seeds == [42, 43, 44] and list(cfg.ablation.variants) == rows[1:]
    assert [(r, s) for r, s, _ in runs] == [(r, s) for s in (42, 43, 44) for r in rows]
    by = {(r, s): c for r, s, c in runs}
    assert by[("negatives-0", 43)].train.stages[1].num_hard_negatives == 0
    assert by[("one-stage", 42)].train.stages[1].init_from == "base"
    assert by[("base", 44)].train.precision == "auto" and by[("base", 44)].seed == 44
    assert by[("merge", 42)].run_root == str(tmp_path / "runs")


def test_the_tiny_configs_change_sizes_data_and_models_only(tmp_path):
    tiny = tmp_path / "tiny-bert"
    full, small = quality_config(tmp_path), quality_config(tmp_path, tiny_model=tiny)
    assert small.train.base_model == str(tiny) and small.mine.model == str(tiny) and small.evaluate.base_model == str(tiny)
    assert Path(small.data_root) == Path(QUALITY).parents[2] / "data"
    assert small.train.precision == "auto"
    for a, b in zip(full.train.stages, small.train.stages, strict=True):
        assert (a.name, a.tasks, a.losses, a.eta, a.datasets, a.scheduler) == (b.name, b.tasks, b.losses, b.eta,
                                                                                b.datasets, b.scheduler)
        assert b.steps == TINY["stage"]["steps"] and set(b.batch_size.values()) == {TINY["batch"]}
    assert small.train.stages[-1].dev.select == "best" and small.train.stages[-1].dev.max_rows == TINY["dev"]["max_rows"]
    _, runs = ablation_rows(tmp_path, tiny_model=tiny, path=ABLATION)
    assert len(runs) == 18 and all(c.train.base_model == str(tiny) for _, _, c in runs)
    merge = next(c for r, _, c in runs if r == "merge")
    assert merge.train.stages[-1].merge.stage == "stage2"


def test_the_quality_run_shares_the_run_directory_of_the_ablations_base_row_only_when_their_settings_agree(tmp_path):
    from embedpipe_tools.gpurun.configs import shared_run_name

    quality = quality_config(tmp_path)
    _, runs = ablation_rows(tmp_path)
    assert shared_run_name(quality, runs) == "ablation-quality-gpu-base-s42"
    shared = quality_config(tmp_path, run_name="ablation-quality-gpu-base-s42")
    assert shared.default_run_dir() == runs[0][2].default_run_dir()
    assert shared_run_name(quality, runs[1:]) is None  # the first run is not the base row
    fp32 = quality.model_copy(update={"train": quality.train.model_copy(update={"precision": "fp32"})})
    assert shared_run_name(fp32, runs) is None  # other settings: its own directory
