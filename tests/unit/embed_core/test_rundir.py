"""Run directory ownership: which folders become run directories, and what cleanup may touch."""

import os

import pytest

from embed_core.artifacts import StageWriter, clean_leftovers
from embed_core.errors import EmbedpipeError
from embed_core.rundir import MARKER, RunDirError, claim_run_dir, is_marked, is_own_snapshot, run_dir_lock


def test_a_folder_with_a_file_of_someone_else_is_not_claimed(tmp_path):
    (tmp_path / "report.docx").write_text("x")
    with pytest.raises(RunDirError, match="not an embedpipe run directory and not empty .it holds report.docx"):
        claim_run_dir(tmp_path)
    assert not (tmp_path / MARKER).exists()


def test_a_folder_holding_only_a_lock_file_counts_as_empty(tmp_path):
    (tmp_path / ".lock").write_text("")
    claim_run_dir(tmp_path)
    assert (tmp_path / MARKER).is_file()


def test_a_stage_directory_with_a_valid_manifest_makes_a_folder_a_run_directory(tmp_path):
    with StageWriter(tmp_path, "prepare") as writer:
        writer.commit({"input_fingerprint": "abc"})
    claim_run_dir(tmp_path)
    assert (tmp_path / MARKER).is_file()


def test_a_config_snapshot_of_an_earlier_version_makes_a_folder_a_run_directory(tmp_path):
    (tmp_path / "config.yaml").write_text("# Written by embedpipe: the config of this run directory's latest "
                                          "run.\nrun_name: r\n")
    claim_run_dir(tmp_path)
    assert is_marked(tmp_path)


@pytest.mark.parametrize("marker", [None, "", "{}\n", "not json", '{"embedpipe": 1, "since": 2}'])
def test_a_history_file_or_a_marker_without_embedpipes_content_does_not_make_a_folder_a_run_directory(tmp_path,
                                                                                                       marker):
    (tmp_path / "history.jsonl").write_text('{"stage": "prepare"}\n')
    (tmp_path / ".notes.abcd1234.tmp").write_text("unsaved work")
    if marker is not None:
        (tmp_path / MARKER).write_text(marker)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(RunDirError, match="not an embedpipe run directory"):
        claim_run_dir(tmp_path)
    with pytest.raises(RunDirError, match="not an embedpipe run directory"):
        with run_dir_lock(tmp_path):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / MARKER).read_text() == marker if marker is not None else not (tmp_path / MARKER).exists()


def test_a_folder_of_an_earlier_version_holding_a_users_config_yaml_is_refused_without_a_marker(tmp_path):
    with StageWriter(tmp_path, "prepare") as writer:
        writer.commit({"input_fingerprint": "abc"})
    (tmp_path / "config.yaml").write_text("mine: true\n")
    with pytest.raises(RunDirError, match="not a config snapshot embedpipe wrote"):
        claim_run_dir(tmp_path)
    assert not (tmp_path / MARKER).exists()


def test_an_empty_or_marked_folder_is_claimed_and_stays_claimed(tmp_path):
    claim_run_dir(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    claim_run_dir(tmp_path / "empty")
    (tmp_path / "empty" / "prepare").mkdir()  # what a run writes next: a marked directory stays one
    claim_run_dir(tmp_path / "empty")
    assert (tmp_path / "new" / MARKER).is_file() and (tmp_path / "empty" / MARKER).is_file()


def test_a_manifest_that_is_not_one_does_not(tmp_path):
    (tmp_path / "prepare").mkdir()
    (tmp_path / "prepare" / "manifest.json").write_text("{}")
    with pytest.raises(RunDirError):
        claim_run_dir(tmp_path)


def test_only_a_snapshot_with_embedpipes_first_line_is_its_own(tmp_path):
    (tmp_path / "a.yaml").write_text("# Written by embedpipe: the config of this run directory's latest run.\nx: 1\n")
    (tmp_path / "b.yaml").write_text("x: 1\n")
    assert is_own_snapshot(tmp_path / "a.yaml") and not is_own_snapshot(tmp_path / "b.yaml")
    assert not is_own_snapshot(tmp_path / "missing.yaml")


def test_cleanup_under_the_lock_touches_only_entries_named_as_embedpipe_names_them(tmp_path):
    claim_run_dir(tmp_path)
    ours = [".config.yaml.ab_cd123.tmp", ".prepare.staging-0123abcd"]
    theirs = [".draft.tmp", ".config.yaml.short.tmp", ".prepare.staging-old", ".mine.old-9999zzzz"]
    (tmp_path / ours[0]).write_text("half")
    (tmp_path / ours[1]).mkdir()
    for name in theirs:
        (tmp_path / name).write_text("keep")
    (tmp_path / ".train-a.old-00000000").mkdir()  # superseded but holds no manifest: not provably ours
    with run_dir_lock(tmp_path, "test"):
        pass
    left = set(os.listdir(tmp_path))
    assert not left & set(ours)
    assert set(theirs) | {".train-a.old-00000000"} <= left


def test_an_interrupted_commit_is_still_restored(tmp_path):
    with StageWriter(tmp_path, "prepare") as writer:
        writer.commit({"input_fingerprint": "abc"})
    os.replace(tmp_path / "prepare", tmp_path / ".prepare.old-0a1b2c3d")  # killed between the renames
    assert clean_leftovers(tmp_path) == ["restored prepare from an interrupted commit"]
    assert (tmp_path / "prepare" / "manifest.json").is_file()


def test_a_stage_writer_never_replaces_a_stage_directory_it_did_not_write(tmp_path):
    (tmp_path / "prepare").mkdir()
    (tmp_path / "prepare" / "mine.txt").write_text("mine")
    with pytest.raises(EmbedpipeError, match="is not a stage artifact embedpipe wrote"):
        with StageWriter(tmp_path, "prepare") as writer:
            writer.commit({"input_fingerprint": "abc"})
    assert (tmp_path / "prepare" / "mine.txt").read_text() == "mine"


def test_a_stage_directory_that_is_a_symlink_is_not_replaced(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    with StageWriter(elsewhere, "prepare") as writer:
        writer.commit({"input_fingerprint": "abc"})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "prepare").symlink_to(elsewhere / "prepare")
    with pytest.raises(EmbedpipeError, match="is not a stage artifact embedpipe wrote"):
        StageWriter(run_dir, "prepare").__enter__()
    assert (elsewhere / "prepare" / "manifest.json").is_file()
