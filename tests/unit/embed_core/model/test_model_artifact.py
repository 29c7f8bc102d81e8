"""The trained model as a released artifact: a complete sentence-transformers model (its prompts
reproduce the evaluator's embeddings), a model card, and results in mteb's result-cache layout."""

import json

import numpy as np
import pytest
from mteb.types import PromptType

from embed_core.stages import records_upstream
from embed_core.config import parse_config
from embed_core.scoring.config import EvalTaskSpec
from tests.unit.embed_core.train.test_training import _config_dict

pytestmark = pytest.mark.slow  # trains or reads real data: make test, not make test-fast


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model):
    from embed_core.prepare.run import run_prepare
    from embed_core.train.run import run_train_stage

    tmp = tmp_path_factory.mktemp("artifact")
    raw = _config_dict(tmp, tiny_model)
    raw["train"]["stages"] = raw["train"]["stages"][:1]
    raw["train"]["stages"][0].update(steps=2, tasks=["retrieval", "sts"])
    config = parse_config(raw)
    run_dir = tmp / "runs/demo"
    run_prepare(config, run_dir)
    run_train_stage(config, run_dir, "stage1", upstream=records_upstream(config, "train"))
    return config, run_dir, run_dir / "train-stage1/model"


def test_the_saved_model_loads_in_sentence_transformers_with_its_prompts_and_reproduces_the_evaluator(trained, tmp_path):
    from sentence_transformers import SentenceTransformer

    from embed_core.scoring.model import EvalModel
    from embed_core.scoring.tasks import build_task

    config, _, model_dir = trained
    evaluator = EvalModel(str(model_dir), label="stage1", cache_root=tmp_path / "cache", precision="fp32")
    assert evaluator.settings.use_instructions and evaluator.settings.instructions["scifact"]
    task = build_task(EvalTaskSpec(name="scifact", type="retrieval", path="scifact"), config.resolve)
    st = SentenceTransformer(str(model_dir), device="cpu")
    assert st.prompts["scifact"].startswith("Instruct: ") and st.prompts["document"] == ""

    query = "Vitamin D deficiency is linked to multiple sclerosis."
    document = "We studied serum vitamin D levels in 200 patients with relapsing MS."
    for text, prompt_type, prompt_name in ((query, PromptType.query, "scifact"), (document, PromptType.document, "document")):
        expected = evaluator.encode([{"text": [text]}], task_metadata=task.metadata, hf_split="test",
                                    hf_subset="default", prompt_type=prompt_type)
        got = st.encode([text], prompt_name=prompt_name, convert_to_numpy=True)
        np.testing.assert_allclose(got, expected, atol=1e-5)
    # the query prompt matters: without it the embedding differs
    plain = st.encode([query], convert_to_numpy=True)
    assert not np.allclose(plain, st.encode([query], prompt_name="scifact", convert_to_numpy=True), atol=1e-3)


def test_the_saved_model_has_a_card_with_its_data_losses_and_settings(trained):
    import yaml

    config, run_dir, model_dir = trained
    card = (model_dir / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "sentence-transformers" and meta["base_model"] == config.train.base_model
    manifest_datasets = json.loads((run_dir / "train-stage1/manifest.json").read_text())["datasets"]
    assert meta["datasets"] == sorted(manifest_datasets) and {"scifact", "stsb"} <= set(manifest_datasets)
    for name, info in manifest_datasets.items():
        assert f"| {name} | {info['task']} | {info['records']} |" in card
    assert "| retrieval | `infonce(" in card and "| sts | `cosent(" in card
    assert "| steps | `2` |" in card and "Not evaluated yet" in card
    assert 'prompt_name="query"' in card


def test_evaluate_releases_the_final_model_with_the_evaluation_table_in_its_card(trained, tmp_path):
    import mteb
    import yaml
    from sentence_transformers import SentenceTransformer

    from embed_core.evaluate.run import run_evaluate

    config, run_dir, model_dir = trained
    raw = config.model_dump(mode="json")
    raw["evaluate"] = {"base_model": config.train.base_model, "models": ["base", "trained"], "tasks": [
        {"name": "LocalSTS", "type": "sts", "path": "stsb/test.csv", "header": False,
         "columns": {"text1": 0, "text2": 1, "score": 2}, "max_rows": 40}]}
    config = parse_config(raw)
    manifest = run_evaluate(config, run_dir)
    assert manifest["release"]["model"] == "stage1"
    release = run_dir / "evaluate/model"
    card = (release / "README.md").read_text()
    assert yaml.safe_load(card.split("---")[1])["datasets"] == sorted(json.loads(
        (run_dir / "train-stage1/manifest.json").read_text())["datasets"])
    assert "| task | metric | base | stage1 |" in card
    assert "| LocalSTS | cosine_spearman |" in card and "| retrieval | `infonce(" in card
    # the weights are the trained stage's own files (linked, not rewritten)
    assert (release / "model.safetensors").stat().st_ino == (model_dir / "model.safetensors").stat().st_ino
    text = "A man is playing a guitar."
    np.testing.assert_allclose(SentenceTransformer(str(release), device="cpu").encode([text], prompt_name="STS"),
                               SentenceTransformer(str(model_dir), device="cpu").encode([text], prompt_name="STS"))
    loaded = mteb.ResultCache(run_dir / "evaluate").load_results(require_model_meta=True, include_remote=False)
    assert {m.model_name for m in loaded.model_results} == {"embedpipe/base", "embedpipe/stage1"}


def test_push_to_hub_without_network_is_a_clear_error_after_the_release_is_committed(trained, monkeypatch):
    """The offline case (this machine has no Hub); the upload itself needs a network and a token."""
    from embed_core.errors import EmbedpipeError
    from embed_core.evaluate.run import run_evaluate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config, run_dir, _ = trained
    raw = config.model_dump(mode="json")
    raw["release"] = None  # no gate: evaluate's model/ is the release, pushed by evaluate
    raw["evaluate"] = {"base_model": config.train.base_model, "models": ["trained"], "push_to_hub": True,
                       "hub_model_id": "someone/tiny-embedder", "tasks": [
                           {"name": "LocalSTS", "type": "sts", "path": "stsb/test.csv", "header": False,
                            "columns": {"text1": 0, "text2": 1, "score": 2}, "max_rows": 20}]}
    with pytest.raises(EmbedpipeError, match=r"push_to_hub to someone/tiny-embedder failed \(.*\); the release is "
                                             r"committed in .*evaluate/model: upload it with `huggingface-cli upload"):
        run_evaluate(parse_config(raw), run_dir)
    assert (run_dir / "evaluate/model/README.md").exists()
    with pytest.raises(Exception, match="push_to_hub needs hub_model_id"):
        parse_config({**raw, "evaluate": {**raw["evaluate"], "hub_model_id": None}})


def test_with_a_release_gate_the_model_is_pushed_when_it_becomes_current_not_by_evaluate(trained, monkeypatch):
    from embed_core.errors import EmbedpipeError
    from embed_core.evaluate.run import run_evaluate
    from embed_core.release.run import releases_of, run_gate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # any upload attempt fails, and says so
    config, run_dir, _ = trained
    raw = config.model_dump(mode="json")
    raw["release"] = {}
    raw["evaluate"] = {"base_model": config.train.base_model, "models": ["trained"], "push_to_hub": True,
                       "hub_model_id": "someone/tiny-embedder", "tasks": [
                           {"name": "LocalSTS", "type": "sts", "path": "stsb/test.csv", "header": False,
                            "columns": {"text1": 0, "text2": 1, "score": 2}, "max_rows": 20}]}
    gated = parse_config(raw)
    run_evaluate(gated, run_dir)  # no upload here: the model is only a candidate
    with pytest.raises(EmbedpipeError, match=r"push_to_hub to someone/tiny-embedder failed"):
        run_gate(gated, run_dir)  # the first release becomes current, then is pushed
    assert releases_of(gated).current().version == 1 and (run_dir / "release/model.safetensors").is_file()
