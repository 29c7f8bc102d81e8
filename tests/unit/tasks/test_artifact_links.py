"""A report's links to the run's files become links the Prefect UI opens (tasks.common)."""

from tasks.common import linked_files


def test_a_relative_link_to_a_run_file_becomes_the_served_url_or_the_absolute_path(tmp_path, monkeypatch):
    run_dir = tmp_path / "runs" / "r"
    (run_dir / "train-stage 2/model").mkdir(parents=True)
    (run_dir / "evaluate").mkdir()
    md = ("- **stage2**: [train-stage 2/model](../train-stage%202/model)\n- gone: [x](../nothing)\n"
          "- web: [site](https://example.org/a) ![plot](plots/scores.png)")
    monkeypatch.delenv("EMBEDPIPE_FILES_URL", raising=False)
    monkeypatch.delenv("EMBEDPIPE_FILES_ROOT", raising=False)
    as_text = linked_files(md, run_dir / "evaluate")
    assert f"train-stage 2/model `{run_dir / 'train-stage 2/model'}`" in as_text
    monkeypatch.setenv("EMBEDPIPE_FILES_URL", "http://127.0.0.1:4280/")
    monkeypatch.setenv("EMBEDPIPE_FILES_ROOT", str(tmp_path / "runs"))
    served = linked_files(md, run_dir / "evaluate")
    assert "[train-stage 2/model](http://127.0.0.1:4280/r/train-stage%202/model)" in served
    assert "[x](../nothing)" in served and "[site](https://example.org/a)" in served
    assert "![plot](plots/scores.png)" in served
