"""Releases in a real MLflow model registry (SQLite, artifacts on disk)."""

import hashlib
import json

import pytest

from embed_core.release.registry import CANDIDATE, CURRENT, RELEASE_MARKER, ReleaseRegistryError, Releases


def _model(folder, content: bytes):
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(content)
    (folder / "README.md").write_text(f"card of {content!r}\n")
    return folder


def _files(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()
            if p.is_file() and p.name != RELEASE_MARKER}


@pytest.fixture(scope="module")
def database(tmp_path_factory):
    return tmp_path_factory.mktemp("registry") / "mlflow.db"  # one database (its migrations take seconds)


@pytest.fixture
def releases(database, request):
    return Releases(f"sqlite:///{database}", f"embedpipe-{request.node.name[:40]}")


def test_a_model_is_registered_once_per_fingerprint_with_its_scores_and_lineage(tmp_path, releases, database):
    one = releases.register(_model(tmp_path / "a", b"weights-a"), "fp-a", scores={"sts": 0.8}, lineage={"run": "x"},
                            verdict="first")
    again = releases.register(_model(tmp_path / "a2", b"other bytes"), "fp-a", scores={}, lineage={}, verdict="x")
    two = releases.register(_model(tmp_path / "b", b"weights-b"), "fp-b", scores={"sts": 0.7}, lineage={},
                            verdict="failed")
    assert (one.version, again.version, two.version) == (1, 1, 2)
    assert releases.get(1).scores == {"sts": 0.8} and releases.get(1).lineage == {"run": "x"}
    assert releases.current() is None and releases.baseline("fp-a") is None
    assert list(releases.client.list_artifacts(releases.client.get_model_version(releases.name, "1").run_id, "model"))
    # the artifacts sit beside the database, not in the working directory
    location = releases.client.get_experiment_by_name("embedpipe-releases").artifact_location
    assert location == (database.parent / "mlartifacts").as_uri()


def test_promote_hold_reject_and_rollback_walk_the_history_of_current_releases(tmp_path, releases):
    for name in "abc":
        releases.register(_model(tmp_path / name, f"weights-{name}".encode()), f"fp-{name}", scores={}, lineage={},
                          verdict="")
    releases.promote(1, "gate first")
    releases.promote(2, "gate passed")
    assert releases.current().version == 2 and releases.history() == [1, 2]
    # the candidate's baseline: the last current release holding another model, before and after its promotion
    assert releases.baseline("fp-c").version == 2
    releases.hold(3)
    assert CANDIDATE in releases.get(3).aliases
    releases.promote(3, "approved")
    assert releases.baseline("fp-c").version == 2 and CANDIDATE not in releases.get(3).aliases
    assert CURRENT in releases.get(3).aliases and releases.get(3).decision == "approved"
    restored, gone = releases.rollback()
    assert (restored.version, gone.version, releases.get(3).decision) == (2, 3, "rolled back")
    assert releases.rollback()[0].version == 1 and releases.history() == [1]
    with pytest.raises(ReleaseRegistryError, match="no earlier release to roll back to"):
        releases.rollback()
    releases.reject(2)
    assert releases.get(2).decision == "rejected" and releases.current().version == 1


def test_a_copy_of_a_release_is_its_registered_bytes_swapped_in_whole(tmp_path, releases):
    a = _model(tmp_path / "a", b"weights-a")
    b = _model(tmp_path / "b", b"weights-b")
    releases.register(a, "fp-a", scores={}, lineage={}, verdict="")
    releases.register(b, "fp-b", scores={}, lineage={}, verdict="")
    (a / "model.safetensors").write_bytes(b"changed after release")  # the registry holds its own copy
    dest = tmp_path / "run/release"
    releases.materialize(2, dest)
    assert _files(dest) == _files(b)
    releases.materialize(1, dest)
    assert (dest / "model.safetensors").read_bytes() == b"weights-a" and set(_files(dest)) == set(_files(b))
    assert json.loads((dest / RELEASE_MARKER).read_text()) == {"name": releases.name, "version": 1}
    assert sorted(p.name for p in dest.parent.iterdir()) == ["release"]  # no staging folder left


def test_a_version_that_does_not_exist_is_named_in_one_line(releases, tmp_path):
    releases.register(_model(tmp_path / "a", b"w"), "fp-a", scores={}, lineage={}, verdict="")
    with pytest.raises(ReleaseRegistryError, match="has no version 7 \\(versions: 1\\)"):
        releases.promote(7, "by hand")


def test_with_push_to_hub_a_rollback_pushes_the_release_it_restores_as_a_promote_does(tmp_path, database,
                                                                                       monkeypatch):
    """The Hub repository holds the current release: a rollback uploads the one it makes current
    (offline here, so the upload fails, and says where the restored release is)."""
    from embed_core.config import parse_config
    from embed_core.errors import EmbedpipeError
    from embed_core.release.run import promote, releases_of, rollback

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task = {"name": "STS", "type": "sts", "path": "stsb/test.csv", "header": False,
            "columns": {"text1": 0, "text2": 1, "score": 2}}
    config = parse_config({"run_name": "hubbed", "run_root": str(tmp_path / "runs"),
                           "prepare": {"sources": [{"name": "sts", "kind": "sts", "path": "stsb/train.csv"}]},
                           "evaluate": {"tasks": [task], "push_to_hub": True, "hub_model_id": "someone/tiny"},
                           "release": {"registry_uri": f"sqlite:///{database}", "name": "embedpipe-hub-rollback"}})
    releases, run_dir = releases_of(config), tmp_path / "runs/hubbed"
    for name in ("a", "b"):
        version = releases.register(_model(tmp_path / name, f"weights-{name}".encode()), f"fp-{name}", scores={},
                                    lineage={}, verdict="passed").version
        with pytest.raises(EmbedpipeError, match=f"push_to_hub to someone/tiny failed .*{run_dir / 'release'}"):
            promote(config, run_dir, version, "passed")
    with pytest.raises(EmbedpipeError, match=f"push_to_hub to someone/tiny failed .*{run_dir / 'release'}"):
        rollback(config, run_dir)
    assert releases.current().version == 1 and _files(run_dir / "release") == _files(tmp_path / "a")
