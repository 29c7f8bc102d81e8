"""``embedpipe compare`` on bad inputs, through the real CLI: a corrupt or foreign results file and
an ``--out`` that is a file or holds files compare did not write are one line each; nothing the
user made is overwritten."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers.cli_run import in_process

ROWS = [{"model": "base", "model_path": "m", "fingerprint": "f", "task": "T", "task_type": "STS", "split": "test",
         "subset": "default", "metric": "cosine_spearman", "value": 0.5, "main": True}]


@pytest.fixture
def results(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


def test_a_corrupt_results_file_is_one_line_naming_it(tmp_path, capfd):
    bad = tmp_path / "results.parquet"
    bad.write_bytes(b"PAR1 not really parquet")
    in_process(capfd, "compare", bad, "--out", tmp_path / "out").assert_one_line_error(
        f"{bad}: not a readable results file")
    assert not (tmp_path / "out").exists()


def test_a_parquet_file_that_is_not_evaluate_results_is_one_line(tmp_path, capfd):
    other = tmp_path / "records.parquet"
    pq.write_table(pa.table({"text": ["a"]}), other)
    in_process(capfd, "compare", other, "--out", tmp_path / "out").assert_one_line_error(
        f"{other}: not an evaluate results file (no column 'model')")


def test_an_out_that_is_a_file_is_refused_and_left_alone(tmp_path, capfd, results):
    out = tmp_path / "notes.txt"
    out.write_text("mine\n")
    in_process(capfd, "compare", results, "--out", out).assert_one_line_error(f"{out}: --out is a file")
    assert out.read_text() == "mine\n"


def test_a_compare_md_compare_did_not_write_is_never_overwritten_but_its_own_is(tmp_path, capfd, results):
    out = tmp_path / "out"
    out.mkdir()
    (out / "compare.md").write_text("my own notes\n")
    in_process(capfd, "compare", results, "--out", out).assert_one_line_error(
        f"{out / 'compare.md'}: exists and was not written by embedpipe compare")
    assert (out / "compare.md").read_text() == "my own notes\n"

    fresh = tmp_path / "fresh"
    assert in_process(capfd, "compare", results, "--out", fresh).rc == 0
    assert in_process(capfd, "compare", results, "--out", fresh).rc == 0  # its own files: rewritten
    assert "a/base" in (fresh / "compare.md").read_text()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_nan_score_in_a_results_file_is_one_line_naming_model_and_task_not_a_number_in_the_table(tmp_path, capfd,
                                                                                                   value):
    path = tmp_path / "nan.parquet"  # a NaN beside it that is not a main score (mteb's nauc_* can be) is no error
    pq.write_table(pa.Table.from_pylist([{**ROWS[0], "value": value},
                                         {**ROWS[0], "metric": "nauc_ndcg_at_1_max", "value": value, "main": False}]), path)
    in_process(capfd, "compare", path, "--out", tmp_path / "out").assert_one_line_error(
        f"{path}: model base, task T: cosine_spearman is {value!r}, not a finite score")
    assert not (tmp_path / "out").exists()


def test_a_nan_beside_the_main_score_is_not_shown_and_not_an_error(tmp_path, capfd):
    path = tmp_path / "results.parquet"  # mteb's nauc_* metrics can be NaN; the table shows main scores only
    pq.write_table(pa.Table.from_pylist([ROWS[0], {**ROWS[0], "metric": "nauc_ndcg_at_1_max", "value": float("nan"),
                                                   "main": False}]), path)
    result = in_process(capfd, "compare", path, "--out", tmp_path / "out")
    assert result.rc == 0, result.err
    assert "50.00" in (tmp_path / "out/compare.md").read_text()
