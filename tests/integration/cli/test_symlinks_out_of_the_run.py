"""A run directory handed to you whose files link out of it, through the real CLI (``embedpipe
evaluate``): nothing outside the run directory is read into the evaluate artifact or the release.
A link out of a trained model is refused with one line (as a package manager refuses a link out of
its tree); a link planted among the previous results is not carried over (only what the
manifest lists is); the release copies only the files the train stage's manifest lists."""

import os

import pytest

from tests.helpers.cli_run import in_process, write_config

pytestmark = pytest.mark.prefect

SECRET = "aws_secret_access_key = DO-NOT-LEAK-1234"
HEADER = "sentence1,sentence2,score\n"
ROWS = "".join(f"Sentence number {i} is here.,Another sentence {i} here.,{i % 5}\n" for i in range(40))


def _regular_files_text(directory):
    """The bytes of every regular file under ``directory`` (links not followed), as one string."""
    out = []
    for dirpath, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                out.append(open(path, "rb").read().decode("utf-8", "replace"))
    return "\n".join(out)


def test_links_out_of_a_run_directory_are_never_read_into_evaluate_or_the_release(tmp_path, capfd, tiny_model,
                                                                                   prefect_harness):
    credentials = tmp_path / "home/.aws/credentials"
    credentials.parent.mkdir(parents=True)
    credentials.write_text(SECRET + "\n")
    (tmp_path / "s.csv").write_text(HEADER + ROWS)
    stage = {"name": "s1", "steps": 2, "batch_size": {"sts": 4}, "warmup_steps": 0, "query_max_length": 16,
             "passage_max_length": 16, "log_every": 1}
    config = write_config(tmp_path, [{"name": "sts", "kind": "sts", "path": "s.csv"}],
                          train={"base_model": str(tiny_model), "max_length": 16, "stages": [stage]},
                          evaluate={"base_model": str(tiny_model), "models": ["base", "trained"],
                                    "tasks": [{"name": "LocalSTS", "type": "sts", "path": "s.csv"}]})
    assert in_process(capfd, "run", "--config", config).rc == 0
    run_dir = tmp_path / "runs/r"
    model = run_dir / "train-s1/model"
    assert (run_dir / "evaluate/model/config.json").exists()

    # a link planted among the previous results: the rerun carries over only what the manifest lists
    results = next((run_dir / "evaluate/results").rglob("*.json")).parent
    (results / "leak.json").symlink_to(credentials)
    assert in_process(capfd, "evaluate", "--config", config, "--force").rc == 0
    assert SECRET not in _regular_files_text(run_dir / "evaluate")

    # a file put into the trained model after training is not the trained model: not released
    (model / "notes.txt").write_text(SECRET + "\n")
    assert in_process(capfd, "evaluate", "--config", config, "--force").rc == 0
    assert not (run_dir / "evaluate/model/notes.txt").exists()
    assert SECRET not in _regular_files_text(run_dir / "evaluate")
    (model / "notes.txt").unlink()

    # a link out of the trained model: refused, one line naming it; the previous artifact stays
    before = _regular_files_text(run_dir / "evaluate")
    (model / "leak.txt").symlink_to(credentials)
    in_process(capfd, "evaluate", "--config", config, "--force").assert_one_line_error(
        f"{model / 'leak.txt'}: a symbolic link to {credentials}, outside {model}")
    assert _regular_files_text(run_dir / "evaluate") == before
