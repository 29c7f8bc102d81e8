"""The stage registry is the one place the pipeline's shape is written: a stage package that
declares its ``STAGE``, plus one line in ``stages.ORDER``, shows up in status, the pipeline flow and
the CLI without touching any of them."""

import logging
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from embed_core import stages
from embed_core.artifacts import read_manifest
from embed_core.config import load_config
from embed_core.errors import EmbedpipeError
from embed_core.synthesize.config import SynthesizeConfig

# A stage that counts the rows of its upstream's records (reads ctx.upstream, writes through StageWriter),
# declared the way every built-in stage is: a module with a STAGE.
COUNT_ROWS_STAGE = textwrap.dedent('''
    import logging

    from embed_core.artifacts import StageWriter, read_manifest
    from embed_core.fingerprint import Fingerprint
    from embed_core.stage_api import Stage


    def fingerprint(ctx):
        up = read_manifest(ctx.run_dir, ctx.upstream)
        return Fingerprint.of(ctx.instance, __name__, (), {"upstream": {n: i["sha256"] for n, i in up["outputs"].items()}
                                                          if up else "missing"})


    def run(ctx, fp):
        rows = sum(i.get("rows") or 0 for i in read_manifest(ctx.run_dir, ctx.upstream)["outputs"].values())
        logging.getLogger("embedpipe.count-rows").info("counted %d rows", rows)  # the library's own logger
        with StageWriter(ctx.run_dir, ctx.instance) as writer:
            writer.write_file("rows.txt", str(rows).encode(), kind="count")
            return writer.commit({"input_fingerprint": fp.key, "run_name": ctx.config.run_name,
                                  "counts": {"rows": rows}})


    STAGE = Stage(name="count-rows", help="count the upstream's rows", fingerprint=fingerprint, run=run,
                  summarize=lambda m: f"{m['counts']['rows']} rows")
''')


@pytest.fixture
def count_stage(tmp_path, monkeypatch):
    """The count-rows stage as a package of its own, one line added to the order after prepare."""
    package = tmp_path / "plugin_stages"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "count_rows.py").write_text(COUNT_ROWS_STAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    order = list(stages.ORDER)
    order.insert(order.index("embed_core.prepare.stage") + 1, "plugin_stages.count_rows")
    monkeypatch.setattr(stages, "ORDER", order)
    yield stages.get("count-rows")
    for name in ("plugin_stages.count_rows", "plugin_stages"):
        sys.modules.pop(name, None)


def test_the_registry_lists_the_built_in_stages_in_pipeline_order():
    assert [s.name for s in stages.all_stages()] == ["prepare", "synthesize", "mine", "train", "evaluate", "gate"]


def test_a_registered_stage_appears_in_pipeline_order_status_and_the_cli(count_stage, demo_copy, tmp_path):
    from embed_core.runs.status import run_status
    from flows.cli import _parser

    config = load_config(demo_copy)
    assert [inst for _, inst in stages.pipeline_instances(config)] == ["prepare", "count-rows"]
    assert [r.stage for r in run_status(config, tmp_path / "run")] == ["prepare", "count-rows"]
    assert "count-rows" in _parser()._subparsers._group_actions[0].choices
    assert stages.downstream_of(config, "prepare") == ["count-rows"]


@pytest.mark.prefect
def test_a_registered_stage_runs_in_the_pipeline_and_from_the_cli(count_stage, prefect_harness, demo_copy, tmp_path,
                                                                   capsys):
    from flows.cli import main
    from flows.pipeline import pipeline_flow

    run_dir = tmp_path / "run"
    state = pipeline_flow(config_path=str(demo_copy), run_dir=str(run_dir), return_state=True)
    results = state.result()
    assert list(results) == ["prepare", "count-rows"]
    # the library's INFO log line reached the Prefect run logs
    import asyncio

    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()

    async def logs():
        async with get_client() as client:
            return await client.read_logs(log_filter=LogFilter(
                flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))

    messages = [entry.message for entry in asyncio.run(logs())]
    assert any(m.startswith("counted ") and m.endswith(" rows") for m in messages), messages[-10:]
    rows = int((run_dir / "count-rows" / "rows.txt").read_text())
    assert rows == sum(i["rows"] for i in read_manifest(run_dir, "prepare")["outputs"].values() if i.get("rows"))
    assert main(["count-rows", "--config", str(demo_copy), "--run-dir", str(run_dir)]) == 0
    assert "count-rows (cache hit)" in capsys.readouterr().out
    assert main(["count-rows", "--config", str(demo_copy), "--run-dir", str(run_dir), "--force"]) == 0
    assert "count-rows (computed)" in capsys.readouterr().out


def test_records_flow_from_the_nearest_enabled_stage_that_produces_them(demo_copy):
    config = load_config(demo_copy)
    assert stages.records_upstream(config, "mine") == "prepare"
    with_synth = config.model_copy(update={"synthesize": SynthesizeConfig()})
    assert stages.records_upstream(with_synth, "mine") == "synthesize"
    assert stages.records_upstream(with_synth, "train") == "synthesize"


def test_progress_logs_count_rate_and_eta_at_its_interval(caplog):
    from embed_core.progress import Progress

    logger = logging.getLogger("embedpipe.test-progress")
    with caplog.at_level(logging.INFO, logger="embedpipe.test-progress"):
        with Progress("encode", total=10, unit="texts", logger=logger, every_s=0.0) as progress:
            progress.update(4)
            progress.update(1, loss="0.4312", failed=0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("encode: 4/10 texts (") and "ETA" in lines[0]
    assert lines[-1].startswith("encode: 5/10 texts, loss 0.4312, failed 0 (")
    assert len(lines) == 2  # closing after a logged count repeats nothing
    with caplog.at_level(logging.INFO, logger="embedpipe.test-progress"):
        caplog.clear()
        with Progress("quiet", total=3, logger=logger, every_s=3600) as progress:
            progress.update(3)
    assert not caplog.records  # a short loop stays quiet


def test_a_step_slower_than_a_second_shows_seconds_per_step():
    import time

    from embed_core.progress import Progress

    progress = Progress("train s1", total=10, unit="steps", logger=logging.getLogger("embedpipe.test-progress"))
    progress.start -= 80.0  # as if two steps had taken 80 s
    progress.update(2)
    assert "(40.0 s/step, 1m20s elapsed, ETA 5m20s)" in progress.line()
    progress.start = time.monotonic() - 1.0
    progress.update(8)
    assert "(10.0/s," in progress.line()


# ---------------------------------------------------------------- inputs are checked before use

def _prepared_run(config_path, tmp_path):
    from embed_core.prepare.run import run_prepare

    config = load_config(config_path)
    run_dir = tmp_path / "run"
    run_prepare(config, run_dir)
    return config, run_dir


def _with(config_path, tmp_path, name: str, **sections):
    raw = yaml.safe_load(config_path.read_text())
    raw.update(sections)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)


def test_a_stage_refuses_an_upstream_output_that_differs_from_its_manifest(count_stage, demo_copy, tmp_path):
    from embed_core.runs.status import run_status

    config, run_dir = _prepared_run(demo_copy, tmp_path)
    ctx = stages.context(config, run_dir, count_stage)
    stages.check_inputs(count_stage, ctx)  # intact and fresh: nothing to say
    table = run_dir / "prepare" / "stsb.parquet"
    table.write_bytes(table.read_bytes() + b"\0")
    with pytest.raises(EmbedpipeError) as refused:
        stages.cache_decision(count_stage, ctx)
    assert str(refused.value) == (f"count-rows: {table} is missing or changed since {run_dir}/prepare/manifest.json was "
                                  f"written; rerun that stage: `embedpipe prepare --force --run-dir {run_dir}` (with "
                                  "the same --config)")
    prepare_row = run_status(config, run_dir)[0]
    assert (prepare_row.state, prepare_row.detail) == (
        "damaged", "prepare/stsb.parquet is missing or changed since its manifest was written")
    # the original bytes back, but through a link to a file elsewhere: still not what the stage wrote
    elsewhere = tmp_path / "elsewhere.parquet"
    elsewhere.write_bytes(table.read_bytes()[:-1])
    table.unlink()
    table.symlink_to(elsewhere)
    with pytest.raises(EmbedpipeError, match="stsb.parquet is missing or changed"):
        stages.check_inputs(count_stage, ctx)
    table.unlink()
    table.write_bytes(elsewhere.read_bytes())
    stages.check_inputs(count_stage, ctx)


def test_a_stage_refuses_an_upstream_that_is_stale_for_its_config(count_stage, demo_copy, tmp_path):
    _, run_dir = _prepared_run(demo_copy, tmp_path)
    changed = _with(demo_copy, tmp_path, "changed.yaml",
                    prepare={**yaml.safe_load(demo_copy.read_text())["prepare"], "cleaning": {"max_chars": 300}})
    with pytest.raises(EmbedpipeError) as refused:
        stages.cache_decision(count_stage, stages.context(changed, run_dir, count_stage))
    line = str(refused.value)
    assert line.startswith(f"count-rows: upstream stage prepare in {run_dir} is stale for this config: ")
    assert f"run `embedpipe prepare --run-dir {run_dir}` (with the same --config) first" in line
    assert not (run_dir / "count-rows").exists()


def test_a_missing_upstream_names_the_command_that_makes_it(count_stage, demo_copy, tmp_path):
    config = load_config(demo_copy)
    run_dir = tmp_path / "empty-run"
    with pytest.raises(EmbedpipeError, match=r"^count-rows reads .*/prepare, which has no manifest.json .* run "
                                             r"`embedpipe prepare --run-dir "):
        stages.check_inputs(count_stage, stages.context(config, run_dir, count_stage))


def test_a_disabled_stage_left_in_the_run_dir_blocks_nothing(demo_copy, tmp_path):
    """synthesize ran once, is now off: training reads prepare, and synthesize's leftovers (damaged
    here) are not its inputs."""
    config, run_dir = _prepared_run(demo_copy, tmp_path)
    (run_dir / "synthesize").mkdir()
    (run_dir / "synthesize" / "manifest.json").write_text('{"stage": "synthesize"}')
    trained = _with(demo_copy, tmp_path, "train.yaml", train={"base_model": "unused", "stages": [{"name": "s1"}]})
    train = stages.get("train")
    ctx = stages.context(trained, run_dir, train, "train-s1")
    assert train.input_dirs(ctx) == [run_dir / "prepare"]
    stages.check_inputs(train, ctx)


def test_a_later_training_stage_reads_the_model_of_the_one_it_starts_from(demo_copy, tmp_path):
    config = _with(demo_copy, tmp_path, "train.yaml", train={"base_model": "unused", "stages": [
        {"name": "s1"}, {"name": "s2"}, {"name": "s3", "init_from": "base"}]})
    train = stages.get("train")
    run_dir = tmp_path / "run"
    dirs = {inst: train.input_dirs(stages.context(config, run_dir, train, inst)) for inst in ("train-s2", "train-s3")}
    assert dirs == {"train-s2": [run_dir / "prepare", run_dir / "train-s1"], "train-s3": [run_dir / "prepare"]}
    assert train.command("train-s2") == "embedpipe train --stage s2"


def test_a_trained_model_named_as_base_or_mining_model_is_checked_against_its_manifest(demo_copy, tmp_path):
    """A model another run trained (``<run>/train-x/model`` with its manifest) read as the base of a
    training stage or as the mining model: its stage directory is an input, and a changed weight
    file there is refused before anything is read."""
    from embed_core.artifacts import StageWriter

    other = tmp_path / "other-run"
    with StageWriter(other, "train-x") as writer:
        writer.write_file("model/config.json", b"{}", "model")
        writer.write_file("model/model.safetensors", b"weights", "model")
        writer.commit({"input_fingerprint": "f"})
    model = other / "train-x" / "model"
    _, run_dir = _prepared_run(demo_copy, tmp_path)
    raw = yaml.safe_load(demo_copy.read_text())
    train_only = {k: v for k, v in raw.items() if k not in ("mine", "synthesize")}
    demo_copy.write_text(yaml.safe_dump(train_only))
    checks = [(_with(demo_copy, tmp_path, "base.yaml", train={"base_model": str(model), "stages": [{"name": "s1"}]}),
               stages.get("train"), "train-s1"),
              (_with(demo_copy, tmp_path, "mining.yaml", mine={"model": str(model)}), stages.get("mine"), "mine")]
    for config, stage, instance in checks:
        ctx = stages.context(config, run_dir, stage, instance)
        assert other / "train-x" in stage.input_dirs(ctx)
        stages.check_inputs(stage, ctx)  # intact: nothing to say
    (model / "model.safetensors").write_bytes(b"base weights swapped in")
    for config, stage, instance in checks:
        with pytest.raises(EmbedpipeError, match=f"{instance}: {model}/model.safetensors is missing or changed"):
            stages.check_inputs(stage, stages.context(config, run_dir, stage, instance))
