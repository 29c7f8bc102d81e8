"""The release check (embed_core.evaluate.release): a released model encodes the train stage's probe
like the in-training encoder, moved from its base, and any export encodes like it; otherwise the
release is refused with one line."""

import shutil

import numpy as np
import pytest

from embed_core.config import parse_config
from embed_core.errors import EmbedpipeError, ReleaseError
from embed_core.evaluate.config import ReleaseConfig
from embed_core.stages import records_upstream
from tests.unit.embed_core.train.test_training import _config_dict

pytestmark = pytest.mark.slow  # trains a tiny model: make test, not make test-fast

STS = [{"name": "LocalSTS", "type": "sts", "path": "stsb/test.csv", "header": False,
        "columns": {"text1": 0, "text2": 1, "score": 2}, "max_rows": 20}]


def _train(tmp, tiny_model, name: str, train: dict | None = None, **stage):
    from embed_core.prepare.run import run_prepare
    from embed_core.train.run import run_train_stage

    raw = _config_dict(tmp / name, tiny_model)
    raw["train"].update(train or {})
    raw["train"]["stages"] = raw["train"]["stages"][:1]
    raw["train"]["stages"][0].update(tasks=["retrieval", "sts"], **stage)
    raw["train"]["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
    raw["evaluate"] = {"base_model": str(tiny_model), "models": ["trained"], "tasks": STS}
    config = parse_config(raw)
    run_dir = tmp / name / "runs/demo"
    run_prepare(config, run_dir)
    run_train_stage(config, run_dir, "stage1", upstream=records_upstream(config, "train"))
    return config, run_dir


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model):
    return _train(tmp_path_factory.mktemp("release"), tiny_model, "lora", steps=4, lr=1e-2)


@pytest.fixture(scope="module")
def qwen3_run(tmp_path_factory, tiny_model):
    """A tiny Qwen3 decoder trained with LoRA into a last-token embedder: the decoder recipes' shape."""
    from tests.helpers.tiny_model import build_tiny_decoder

    tmp = tmp_path_factory.mktemp("release")
    qwen3 = build_tiny_decoder(tmp / "qwen3", "qwen3", tiny_model)
    return _train(tmp, qwen3, "qwen3", train={"pooling": "last_token"}, steps=4, lr=1e-2)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and isinstance(exc.value, EmbedpipeError)
    return message


def test_a_trained_lora_model_is_released_with_the_check_figures_in_the_manifest(lora_run, caplog):
    import logging

    from embed_core.evaluate.run import run_evaluate

    caplog.set_level(logging.INFO, logger="embedpipe.evaluate")
    config, run_dir = lora_run
    train_manifest = (run_dir / "train-stage1/manifest.json").read_text()
    assert '"probe.npz"' in train_manifest and '"lora": true' in train_manifest
    check = run_evaluate(config, run_dir)["release"]["check"]
    assert check["probe_texts"] == 32 and "" in check["prompts"] and len(check["prompts"]) > 1
    assert check["saved_vs_training"] <= 1e-8  # the merged LoRA encodes like the in-training peft model
    assert check["saved_vs_base"] > 1e-4 and check["training_vs_base"] > 1e-4
    assert check["weights_equal_base"] is False and check["tolerance"] == 1e-3
    assert (run_dir / "evaluate/model/model.safetensors").is_file()
    report = (run_dir / "evaluate/report.md").read_text()
    assert "## Release check" in report and f"| saved vs training | {check['saved_vs_training']:.2e} |" in report
    logged = next(r.getMessage() for r in caplog.records if "release check of" in r.getMessage())
    assert f"| saved vs base | {check['saved_vs_base']:.2e} |" in logged and "{" not in logged  # a table, no dict


def test_deviation_is_one_minus_the_cosine_resolved_below_float32s_step():
    from embed_core.evaluate.release import deviation

    a = np.array([[1.0, 0.0], [0.0, 2.0]], dtype=np.float32)
    b = np.array([[np.cos(1e-5), np.sin(1e-5)], [0.0, 1.0]], dtype=np.float32)
    assert deviation(a, b) == pytest.approx(1 - np.cos(1e-5), rel=1e-2)  # 5e-11: float32's cosine would say 0
    assert deviation(a, a) == 0.0


def test_a_release_whose_lora_was_not_merged_is_refused_with_one_line(lora_run, tiny_model, tmp_path):
    from embed_core.artifacts import read_manifest
    from embed_core.evaluate.release import check_release

    _, run_dir = lora_run
    stage = tmp_path / "train-stage1"
    shutil.copytree(run_dir / "train-stage1", stage)
    # the saved weights are the base's: what saving the peft model's base model without merging gives
    (stage / "model/model.safetensors").unlink()
    shutil.copy(tiny_model / "model.safetensors", stage / "model/model.safetensors")
    with pytest.raises(ReleaseError) as exc:
        check_release(stage / "model", read_manifest(run_dir, "train-stage1"), ReleaseConfig())
    assert "the saved model encodes the probe unlike the in-training encoder" in _one_line(exc)
    assert "LoRA adapters were not merged" in str(exc.value) and "1 − cosine to the base model" in str(exc.value)


def test_a_model_equal_to_its_base_is_refused_with_one_line_unless_allowed(tmp_path_factory, tiny_model):
    from embed_core.evaluate.run import run_evaluate

    # a learning rate far below float32's resolution of the weights: training changes nothing
    config, run_dir = _train(tmp_path_factory.mktemp("release"), tiny_model, "still", steps=2, lr=1e-20)
    with pytest.raises(ReleaseError) as exc:
        run_evaluate(config, run_dir)
    assert "release refused" in _one_line(exc) and "training changed nothing" in str(exc.value)
    assert not (run_dir / "evaluate").exists()  # nothing committed
    raw = config.model_dump(mode="json")
    raw["evaluate"]["release"] = {"allow_unchanged": True}
    check = run_evaluate(parse_config(raw), run_dir)["release"]["check"]
    assert check["saved_vs_base"] <= 1e-8


def test_evaluating_only_the_base_model_releases_nothing_and_checks_nothing(lora_run, tmp_path):
    from embed_core.evaluate.run import run_evaluate

    config, run_dir = lora_run
    fresh = tmp_path / "demo"  # the run without an evaluation yet (scores accumulate across evaluations)
    shutil.copytree(run_dir, fresh, ignore=shutil.ignore_patterns("evaluate"))
    manifest = run_evaluate(config, fresh, ["base"])  # `embedpipe evaluate --model base`: the base model alone
    assert manifest["release"] is None and {m["label"] for m in manifest["models"]} == {"base"}


@pytest.mark.parametrize("run", ["lora_run", "qwen3_run"])
def test_an_onnx_export_encodes_the_probe_within_tolerance_of_the_saved_model(run, request, tmp_path):
    from embed_core.artifacts import read_manifest
    from embed_core.evaluate.release import check_release

    _, run_dir = request.getfixturevalue(run)
    check = check_release(run_dir / "train-stage1/model", read_manifest(run_dir, "train-stage1"),
                          ReleaseConfig(export=["onnx"]), tmp_path)
    assert check["saved_vs_training"] <= 1e-3 and check["saved_vs_base"] > 1e-4  # the model moved in training
    assert check["onnx_vs_saved"] <= 1e-6 and (tmp_path / "onnx/model.onnx").is_file()
    assert len(check["prompts"]) > 1  # every prompt of the probe, through the export's tokenizer and prompts


def test_a_release_with_the_onnx_export_carries_it_and_reports_its_figure(lora_run, tmp_path):
    from embed_core.evaluate.run import run_evaluate

    config, run_dir = lora_run
    fresh = tmp_path / "demo"
    shutil.copytree(run_dir, fresh, ignore=shutil.ignore_patterns("evaluate"))
    raw = config.model_dump(mode="json")
    raw["evaluate"]["release"] = {"export": ["onnx"]}
    check = run_evaluate(parse_config(raw), fresh)["release"]["check"]
    assert check["onnx_vs_saved"] <= 1e-6 and (fresh / "evaluate/model/onnx/model.onnx").is_file()
    assert (fresh / "evaluate/model/tokenizer.json").is_file()  # what the export is encoded with
    assert f"| onnx vs saved | {check['onnx_vs_saved']:.2e} |" in (fresh / "evaluate/report.md").read_text()
