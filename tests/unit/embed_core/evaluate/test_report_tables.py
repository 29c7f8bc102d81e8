"""The evaluation report's score table fits the Prefect UI's artifact panel (a few columns per
table, every score × 100 with its change against the first model) and links the run's models."""

from embed_core.evaluate.report import MODELS_PER_TABLE, build_report, markdown_table


def _values(models, tasks):
    return {(m, t): 0.5 + 0.01 * i + 0.001 * j for i, m in enumerate(models) for j, t in enumerate(tasks)}


def test_more_models_than_fit_are_split_into_tables_that_each_begin_with_the_reference_model():
    models, tasks = ["base", "stage1", "stage2", "soup", "other"], ["STSB", "SciFact"]
    text = markdown_table(models, tasks, _values(models, tasks), {"STSB": "cosine_spearman", "SciFact": "ndcg_at_10"})
    heads = [line for line in text.splitlines() if line.startswith("| task |")]
    assert heads == ["| task | metric | base | stage1 | stage2 |", "| task | metric | base | soup | other |"]
    assert all(line.count("|") - 1 <= 2 + MODELS_PER_TABLE for line in text.splitlines())
    assert "| SciFact | ndcg_at_10 | 50.10 | 51.10 (+1.00) | 52.10 (+2.00) |" in text
    assert "| STSB | cosine_spearman | 50.00 | 53.00 (+3.00) | 54.00 (+4.00) |" in text


def test_a_model_missing_a_task_shows_a_dash_and_no_change():
    text = markdown_table(["base", "stage1"], ["T"], {("base", "T"): 0.5}, {"T": "m"})
    assert text.splitlines()[-1] == "| T | m | 50.00 | – |"


def test_the_report_links_a_model_in_the_run_directory_and_names_one_outside_it(tmp_path):
    import pyarrow as pa

    run_dir = tmp_path / "run"
    (run_dir / "train-stage 2/model").mkdir(parents=True)
    rows = [{"model": "base", "task": "T", "metric": "m", "value": 0.5, "main": True,
             "model_path": str(tmp_path / "base-model"), "fingerprint": "f0"},
            {"model": "stage2", "task": "T", "metric": "m", "value": 0.6, "main": True,
             "model_path": str(run_dir / "train-stage 2/model"), "fingerprint": "f2"}]
    md, _ = build_report(pa.Table.from_pylist(rows), run_dir=run_dir, title="t")
    assert f"- **base**: `{tmp_path / 'base-model'}` (fingerprint `f0`)" in md
    assert "- **stage2**: [train-stage 2/model](../train-stage%202/model) (fingerprint `f2`)" in md
