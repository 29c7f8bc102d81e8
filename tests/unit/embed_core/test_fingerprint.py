"""A cache hit means the same result: stage keys include the code each stage runs, file hashes are
remembered by file identity, and computing a key never loads a model."""

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from embed_core import fingerprint
from embed_core.fingerprint import code_identity, forget_file_hashes, module_closure, sha256_file
from tests.helpers.repo import REPO, add_tiny_stages


def test_each_stage_depends_only_on_the_code_it_imports():
    prepare = module_closure("embed_core.prepare.run")
    mine = module_closure("embed_core.mine.run")
    train = module_closure("embed_core.train.run")
    assert "embed_core.prepare.convert.sts" in prepare and "embed_core.prepare.cleaning" in prepare
    assert not any(m.startswith(("embed_core.losses", "embed_core.train")) for m in (*prepare, *mine))
    assert "embed_core.losses.cosent" in train and "embed_core.train.engine.trainer" in train
    assert "embed_core.mine.miner" in mine and "embed_core.mine.miner" not in prepare


def test_the_import_scan_reads_every_kind_of_import_statement(tmp_path):
    pkg = tmp_path / "embed_core" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text(
        "import json, embed_core.a.b as ab\n"
        "from . import sibling\n"
        "from .. import top\n"
        "from ..other import thing, other_thing\n"
        "class K:\n"
        "    def f(self):\n"
        "        from embed_core.lazy import heavy\n")
    (pkg / "__init__.py").write_text("from embed_core.registry import discover\ndiscover(__path__)\n")
    (pkg / "one.py").write_text("")
    assert fingerprint._imported_names(pkg / "mod.py", "embed_core.pkg.mod") == {
        "json", "embed_core.a.b", "embed_core.pkg", "embed_core.pkg.sibling", "embed_core", "embed_core.top",
        "embed_core.other", "embed_core.other.thing", "embed_core.other.other_thing",
        "embed_core.lazy", "embed_core.lazy.heavy"}
    # a package that hands its __path__ to a discovery call depends on every module in it
    assert fingerprint._imported_names(pkg / "__init__.py", "embed_core.pkg") == {
        "embed_core.registry", "embed_core.registry.discover", "embed_core.pkg.mod", "embed_core.pkg.one"}


def _race(scan, seconds: float) -> list[SystemError]:
    """``scan`` in one thread while another parses a builtin's text signature through ``ast.parse``
    (what pydantic's ``inspect.signature`` does in Prefect's event-loop thread during a flow run),
    with a thread switch possible at every garbage collection."""
    import gc
    import inspect
    import threading

    errors: list[SystemError] = []
    stop = time.monotonic() + seconds

    def loop(fn):
        while time.monotonic() < stop and not errors:
            try:
                fn()
            except SystemError as exc:
                errors.append(exc)

    def callback(*_):
        return None

    interval, threshold = sys.getswitchinterval(), gc.get_threshold()
    gc.callbacks.append(callback)
    gc.set_threshold(50)
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=loop, args=(fn,)) for fn in (scan, lambda: inspect.signature(len))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*threshold)
        sys.setswitchinterval(interval)
    return errors


def test_the_import_scan_survives_another_thread_parsing_python_at_the_same_time():
    path = REPO / "embed_core" / "fingerprint.py"
    assert _race(lambda: fingerprint._imported_names(path, "embed_core.fingerprint"), seconds=1.5) == []
    if sys.version_info[:3] < (3, 11, 8):
        # the control: the same race with ast.parse in place of the scan fails on this interpreter
        # (python/cpython#106905), which is why the scan reads bytecode
        import ast

        source = path.read_text(encoding="utf-8")
        errors = _race(lambda: ast.parse(source), seconds=10)
        assert errors and "AST constructor recursion depth mismatch" in str(errors[0])


def test_code_identity_changes_with_a_module_in_the_closure_and_a_library_version(tmp_path, monkeypatch):
    pkg = tmp_path / "embed_core"
    shutil.copytree(REPO / "embed_core", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(fingerprint, "PACKAGE_ROOT", pkg)
    code_identity.cache_clear()
    before = {m: code_identity(m, ("torch",)) for m in ("embed_core.prepare.run", "embed_core.mine.run", "embed_core.train.run")}
    with open(pkg / "losses" / "cosent.py", "a") as fh:
        fh.write("\n# a change\n")
    code_identity.cache_clear()
    after = {m: code_identity(m, ("torch",)) for m in before}
    assert after["embed_core.train.run"] != before["embed_core.train.run"]
    assert after["embed_core.prepare.run"] == before["embed_core.prepare.run"]
    assert after["embed_core.mine.run"] == before["embed_core.mine.run"]
    assert code_identity("embed_core.prepare.run", ("torch", "pyarrow")) != after["embed_core.prepare.run"]
    code_identity.cache_clear()


def test_a_scoring_edit_retrains_only_a_stage_whose_dev_scores_choose_its_weights(tmp_path, monkeypatch):
    from embed_core.config import parse_config
    from embed_core.scoring.config import SCORING_LIBRARIES
    from embed_core.train import key as train_key

    pkg = tmp_path / "embed_core"
    shutil.copytree(REPO / "embed_core", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(fingerprint, "PACKAGE_ROOT", pkg)
    roots = ("embed_core.train.run", "embed_core.train.dev", "embed_core.evaluate.run")
    code_identity.cache_clear()
    before = {m: code_identity(m, SCORING_LIBRARIES) for m in roots}
    with open(pkg / "scoring" / "tasks.py", "a") as fh:
        fh.write("\n# a change\n")
    code_identity.cache_clear()
    after = {m: code_identity(m, SCORING_LIBRARIES) for m in roots}
    assert after["embed_core.train.run"] == before["embed_core.train.run"]  # training without dev tasks
    assert after["embed_core.train.dev"] != before["embed_core.train.dev"]
    assert after["embed_core.evaluate.run"] != before["embed_core.evaluate.run"]

    (tmp_path / "dev.csv").write_text("a,b,1.0\n")
    config = parse_config({"data_root": str(tmp_path), "prepare": {"sources": [
        {"name": "s", "kind": "sts", "path": "dev.csv", "header": False, "columns": {"text1": 0, "text2": 1, "score": 2}}]},
        "train": {"stages": [
        {"name": "plain"},
        {"name": "chosen", "dev": {"tasks": [{"name": "D", "type": "sts", "path": "dev.csv", "header": False,
                                              "columns": {"text1": 0, "text2": 1, "score": 2}}]}}]}})
    plain, chosen = config.train.stages
    assert train_key._dev_inputs(config, tmp_path, plain) == {}
    dev = train_key._dev_inputs(config, tmp_path, chosen)
    # the dev evaluation's code and mteb's version are in the key of the stage they select weights for
    assert dev["code"] == after["embed_core.train.dev"] and dev["D:dev.csv"] == fingerprint.sha256_file(tmp_path / "dev.csv")
    code_identity.cache_clear()


def test_file_hashes_are_remembered_across_processes_and_forgotten_on_change(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"a" * 1000)
    first = sha256_file(f)
    forget_file_hashes()
    assert sha256_file(f) == first  # from the SQLite table
    f.write_bytes(b"b" * 1000)  # same size; mtime/ctime move
    assert sha256_file(f) != first
    st = f.stat()
    f.write_bytes(b"c" * 1000)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # a rewrite that restores mtime still changes ctime
    forget_file_hashes()
    assert sha256_file(f) == hashlib.sha256(b"c" * 1000).hexdigest()


def test_status_on_a_one_gigabyte_model_answers_in_under_a_second_the_second_time(tmp_path, monkeypatch):
    from embed_core.config import parse_config
    from embed_core.runs.status import run_status

    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "big-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    size = (1 << 30) - 128  # one 1 GiB tensor, a whole safetensors file (models are checked before use)
    header = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode().ljust(120)
    with open(model / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(1 << 30)  # 1 GiB (sparse: the test's disk stays free; every byte is still read and hashed)
    (tmp_path / "sts.csv").write_text("a cat,a kitten,4.0\na dog,a car,0.5\n")
    config = parse_config({
        "data_root": str(tmp_path), "prepare": {"sources": [{"name": "s", "kind": "sts", "path": "sts.csv",
                                                             "header": False, "columns": {"text1": 0, "text2": 1, "score": 2}}]},
        "evaluate": {"base_model": str(model), "tasks": [{"name": "S", "type": "sts", "path": "sts.csv", "header": False,
                                                          "columns": {"text1": 0, "text2": 1, "score": 2}}]}})
    forget_file_hashes()
    t0 = time.perf_counter()
    first = run_status(config, tmp_path / "run")
    cold = time.perf_counter() - t0
    forget_file_hashes()  # only the on-disk table remains, as for a new `embedpipe status` process
    t0 = time.perf_counter()
    second = run_status(config, tmp_path / "run")
    warm = time.perf_counter() - t0
    assert [r.current_input for r in first] == [r.current_input for r in second]
    assert second[-1].stage == "evaluate" and second[-1].current_input
    assert warm < 1.0, f"second status took {warm:.2f} s (first {cold:.2f} s)"


def _first_rows(path: Path, rows: int, *, header: bool) -> None:
    """Keep the header (if any) and the first ``rows`` rows of a CSV/TSV file (quoted
    multi-line fields stay whole: the csv module reads and writes them)."""
    import csv

    dialect = "excel-tab" if path.suffix == ".tsv" else "excel"
    with open(path, newline="", encoding="utf-8") as fh:
        kept = [row for _, row in zip(range(rows + header), csv.reader(fh, dialect))]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh, dialect, lineterminator="\n").writerows(kept)


def _shrink_demo_data(data: Path, rows: int = 120) -> None:
    """The demo's sources at ``rows`` rows each (SciFact: its first ``rows`` training qrels): which
    stages recompute does not depend on how many records they hold, and the STS evaluation and the
    mining pool shrink with them."""
    for name, header in (("stsb/train.csv", False), ("stsb/test.csv", False), ("sick/train.tsv", True),
                         ("banking77/train.csv", True), ("banking77/test.csv", True),
                         ("scifact/qrels/train.tsv", True)):
        _first_rows(data / name, rows, header=header)


def _run_cli(src: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=src, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _last_results(run_dir: Path, n: int) -> dict[str, bool]:
    """stage -> computed? for the last pipeline run (its n history entries)."""
    entries = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines() if line.strip()]
    return {e["stage"]: not e["cached"] for e in entries[-n:]}


@pytest.mark.prefect  # (so slow) the session's Prefect server: each command skips starting its own
def test_source_edits_recompute_exactly_the_stages_whose_code_changed(demo_copy, tmp_path, prefect_harness):
    """On a copy of the project: a README edit recomputes nothing; a converter edit recomputes
    prepare and everything after it; a loss edit recomputes training, evaluation and the release
    gate (its candidate changed) only."""
    src = tmp_path / "src"
    for part in ("embed_core", "flows", "tasks"):
        shutil.copytree(REPO / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "README.md", src / "README.md")
    add_tiny_stages(demo_copy, tmp_path, evaluate=True)
    _shrink_demo_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ, PYTHONPATH=str(src), EMBEDPIPE_CACHE_DIR=str(tmp_path / "hash-cache"),
               PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_API_URL=PREFECT_API_URL.value())
    probe = subprocess.run([sys.executable, "-c", "import embed_core; print(embed_core.__file__)"], cwd=src, env=env,
                           capture_output=True, text=True)
    assert probe.stdout.strip() == str(src / "embed_core" / "__init__.py")  # the copy, not the installed tree
    run = ("run", "--config", str(demo_copy), "--run-dir", str(run_dir))
    stages = ["prepare", "mine", "train-stage1", "train-stage2", "evaluate", "gate"]

    _run_cli(src, *run, env=env)
    assert _last_results(run_dir, 6) == dict.fromkeys(stages, True)

    (src / "README.md").write_text((src / "README.md").read_text() + "\nAn edit.\n")
    status = json.loads(_run_cli(src, "status", "--run-dir", str(run_dir), "--json", env=env).stdout)
    assert [r["state"] for r in status] == ["fresh"] * 6  # the next run would recompute nothing

    base = src / "embed_core" / "prepare" / "convert" / "base.py"
    base.write_text(base.read_text().replace("    value = value.strip()\n", "    value = value.strip().lower()\n", 1))
    _run_cli(src, *run, env=env)
    assert _last_results(run_dir, 6) == dict.fromkeys(stages, True)

    infonce = src / "embed_core" / "losses" / "infonce.py"  # the retrieval loss both stages train with
    edited = infonce.read_text().replace("logits = (scores / tau)", "logits = (1.5 * scores / tau)")
    assert edited != infonce.read_text()
    infonce.write_text(edited)
    _run_cli(src, *run, env=env)
    assert _last_results(run_dir, 6) == {"prepare": False, "mine": False, "train-stage1": True, "train-stage2": True,
                                         "evaluate": True, "gate": True}  # the gate: another candidate
