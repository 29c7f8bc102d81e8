"""Hostile files in a run directory through the real CLI: ``history.jsonl`` is a log anybody (a
crash, a disk error, another tool) may have damaged; ``embedpipe status`` reads what entries it
can and shows the rest of the run, never a traceback."""

import os

import pytest

from tests.helpers.cli_run import STS_SOURCE, in_process, write_config, write_sts_data

pytestmark = pytest.mark.prefect


@pytest.fixture(autouse=True)
def _prefect(prefect_harness):
    yield


def test_status_reads_a_history_of_random_bytes_and_wrong_shapes_as_the_entries_it_can(tmp_path, capfd):
    write_sts_data(tmp_path)
    config = write_config(tmp_path, [STS_SOURCE])
    assert in_process(capfd, "prepare", "--config", config).rc == 0
    history = tmp_path / "runs/r/history.jsonl"
    good = history.read_bytes()
    garbage = [os.urandom(300), b"[1, 2]", b'{"stage": 5}', b'"just a string"', b"{" * 100_000,
               b'{"stage": "prepare", "seconds": "long", "cached": "yes", "at": 7}', b"x" * 200_000]
    history.write_bytes(b"\n".join(garbage) + b"\n" + good + os.urandom(50))
    result = in_process(capfd, "status", "--run-dir", tmp_path / "runs/r", "--config", config)
    assert result.rc == 0, result.err[-3000:]
    assert "Traceback" not in result.out + result.err
    (row,) = [line for line in result.out.splitlines() if line.startswith("prepare ")]
    assert "fresh" in row and "computed at" in row


@pytest.mark.parametrize("command", ["mine", "train"])
def test_a_truncated_record_file_whose_manifest_hash_was_made_to_match_is_one_line_naming_it(tmp_path, capfd,
                                                                                          tiny_model, command):
    """The file's hash checks out (the manifest was edited to match, or the file was damaged before
    the manifest was written), but it is not Parquet: mine reads it whole, train converts it to the
    memory-mapped copy; both end with one line naming the file and what to rerun."""
    import hashlib
    import json

    write_sts_data(tmp_path)
    (tmp_path / "sts.csv").write_text("sentence1,sentence2,score\n" + "".join(
        f"A man plays song {i}.,A man is playing song {i}.,{i % 5}.0\n" for i in range(40)))
    config = write_config(tmp_path, [STS_SOURCE], mine={"model": str(tiny_model), "tasks": ["sts"]},
                          train={"base_model": str(tiny_model), "max_length": 16,
                                 "stages": [{"name": "s1", "steps": 1, "batch_size": {"sts": 4}}]})
    assert in_process(capfd, "prepare", "--config", config).rc == 0
    prepared = tmp_path / "runs/r/prepare"
    data = prepared / "sts.parquet"
    data.write_bytes(data.read_bytes()[:200])  # cut: no footer
    manifest = json.loads((prepared / "manifest.json").read_text())
    manifest["outputs"]["sts.parquet"]["sha256"] = hashlib.sha256(data.read_bytes()).hexdigest()
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    stage = "mine" if command == "mine" else "train-s1"
    extra = () if command == "mine" else ("--stage", "s1")
    raw = json.loads(json.dumps(__import__("yaml").safe_load(config.read_text())))
    if command == "train":
        raw.pop("mine")  # train reads prepare's records
        config.write_text(__import__("yaml").safe_dump(raw))
    in_process(capfd, command, "--config", config, *extra).assert_one_line_error(
        f"{data}: not a readable Parquet file although its manifest's hash matches it",
        "rerun the stage that wrote prepare/ with --force")
    assert not (tmp_path / "runs/r" / stage / "manifest.json").exists()
