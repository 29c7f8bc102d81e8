"""The ONNX export (embed_core.evaluate.onnx_export): a saved model's transformer, pooling and
normalisation as one graph that onnxruntime runs on the saved tokenizer's tensors, encoding like the
saved model under every prompt; without the onnx extra, or for modules it cannot export, a one-line
error."""

import importlib.util

import numpy as np
import pytest

from embed_core.errors import EmbedpipeError, ReleaseError
from embed_core.evaluate.onnx_export import ONNX_DIR, ONNX_FILE, OnnxEncoder, export_onnx, require_onnx
from embed_core.evaluate.release import deviation
from tests.helpers.tiny_model import build_tiny_decoder

LONG = " ".join(f"word{i}" for i in range(60))  # beyond the saved max length (24): truncated
BATCHES = [["a cat"], [LONG], ["a cat sleeps on the mat", LONG, "the dog runs", "x"] * 5]
INSTRUCTIONS = {"query": "find the passage that answers the question"}

# (architecture, Embedder settings): the poolings embedpipe saves, the prompt kept in or left out of them
CASES = {
    "bert-mean": ("bert", {"pooling": "mean"}),
    "bert-cls-prompt-left-out": ("bert", {"pooling": "cls", "exclude_instruction_from_pooling": True}),
    "qwen3-last-token": ("qwen3", {"pooling": "last_token"}),
    "qwen3-bidirectional-mean-prompt-left-out": ("qwen3", {"pooling": "mean", "bidirectional": True,
                                                            "exclude_instruction_from_pooling": True}),
}


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory, tiny_model):
    return build_tiny_decoder(tmp_path_factory.mktemp("qwen") / "qwen3", "qwen3", tiny_model)


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory, tiny_model, tiny_qwen):
    """(case, saved model folder, release folder with onnx/, the export's encoder) for each case."""
    from embed_core.model.embedder import Embedder

    arch, settings = CASES[request.param]
    tmp = tmp_path_factory.mktemp("onnx")
    saved = Embedder(str(tiny_model if arch == "bert" else tiny_qwen), max_length=24, **settings).save(
        tmp / "model", instructions=INSTRUCTIONS, use_instructions=True)
    return request.param, saved, tmp / "release", export_onnx(saved, tmp / "release")


@pytest.mark.slow
def test_an_export_encodes_like_the_saved_model_under_every_prompt_one_text_or_many_truncated_or_not(exported):
    from sentence_transformers import SentenceTransformer

    _, saved, _, encoder = exported
    model = SentenceTransformer(str(saved), device="cpu")
    assert model.prompts["query"].startswith("Instruct: ")
    for texts in BATCHES:
        for prompt in (None, *model.prompts):
            ours = encoder.encode(texts, prompt_name=prompt, batch_size=8)
            theirs = model.encode(texts, prompt_name=prompt, batch_size=8, convert_to_numpy=True)
            assert ours.shape == theirs.shape == (len(texts), 32) and ours.dtype == np.float32
            assert deviation(ours, theirs) <= 1e-6, (texts[0], prompt)
            np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


@pytest.mark.slow
def test_the_graph_takes_what_the_tokenizer_gives_with_dynamic_batch_and_sequence_axes(exported):
    import onnx

    case, _, release, _ = exported
    graph = onnx.load(str(release / ONNX_DIR / ONNX_FILE)).graph
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    expected = ["input_ids", "attention_mask"] + (["token_type_ids"] if case.startswith("bert") else [])
    assert list(inputs) == expected + (["prompt_length"] if case.endswith("prompt-left-out") else [])
    for name in expected:
        batch, sequence = inputs[name]
        assert isinstance(batch, str) and isinstance(sequence, str) and batch != sequence  # both symbolic
    (output,) = graph.output
    assert output.name == "sentence_embedding" and output.type.tensor_type.shape.dim[1].dim_value == 32


@pytest.mark.slow
@pytest.mark.parametrize("exported", [c for c in CASES if c.endswith("prompt-left-out")], indirect=True)
def test_leaving_the_prompt_out_of_the_pooling_is_done_in_the_graph(exported):
    encoder = exported[-1]
    prompt = encoder.prompts["query"]
    batch = encoder.tokenizer([prompt + "a cat sleeps on the mat"], return_tensors="np")
    feed = {name: batch[name].astype(np.int64) for name in encoder.input_names if name != "prompt_length"}
    length = encoder.prompt_length(prompt)
    assert 5 < length < feed["input_ids"].shape[1] - 3
    pooled = {n: encoder.session.run(None, {**feed, "prompt_length": np.array([n], dtype=np.int64)})[0]
              for n in (0, length)}
    assert deviation(pooled[0], pooled[length]) > 1e-4  # the prompt's tokens are left out of the pooling
    np.testing.assert_allclose(pooled[length], encoder.encode(["a cat sleeps on the mat"], prompt_name="query"),
                               atol=1e-6)


def test_an_export_without_the_onnx_extra_is_a_one_line_error_naming_what_to_install(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    with pytest.raises(ReleaseError) as exc:
        export_onnx(tmp_path / "model", tmp_path / "release")
    message = str(exc.value)
    assert "\n" not in message and isinstance(exc.value, EmbedpipeError)
    assert message.startswith("evaluate.release.export: the onnx export needs onnxruntime (not installed")
    assert "pip install -e '.[onnx]'" in message and not (tmp_path / "release").exists()
    monkeypatch.undo()
    require_onnx()  # installed here (the dev extra has the onnx extra's packages)


def test_a_model_with_a_dense_layer_after_its_pooling_is_refused_with_one_line(tmp_path, tiny_model):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Dense, Pooling, Transformer

    model = SentenceTransformer(modules=[Transformer(str(tiny_model)), Pooling(32), Dense(32, 8)], device="cpu")
    model.save(str(tmp_path / "model"))
    with pytest.raises(ReleaseError) as exc:
        export_onnx(tmp_path / "model", tmp_path / "release")
    assert "\n" not in str(exc.value) and "not this model's modules (Transformer, Pooling, Dense)" in str(exc.value)
    assert not (tmp_path / "release" / ONNX_DIR).exists()


@pytest.mark.slow
def test_an_encoder_refuses_a_prompt_the_model_does_not_have(exported):
    encoder = exported[-1]
    assert isinstance(encoder, OnnxEncoder) and encoder.encode([], prompt_name="query").shape == (0, 32)
    with pytest.raises(ValueError, match="'passage' is not one of the model's prompts"):
        encoder.encode(["a cat"], prompt_name="passage")


EXPORT_IN_A_FRESH_HOME = """
import sys
from pathlib import Path
from embed_core.evaluate.onnx_export import export_onnx
from embed_core.model.embedder import Embedder
saved = Embedder(sys.argv[1], max_length=24).save(Path(sys.argv[2]) / "model")
encoder = export_onnx(saved, Path(sys.argv[2]) / "release")
print(encoder.encode(["a cat"], batch_size=1).shape)
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("onnxruntime") is None, reason="needs the onnx extra")
def test_an_onnx_export_and_its_encoding_write_nothing_into_an_empty_home(tiny_model, tmp_path):
    """onnxruntime writes a device id and a telemetry database under ~/.cache/Microsoft when loaded
    (DO_NOT_TRACK or not): the export and the encoder keep it off, so HOME stays empty."""
    import os
    import subprocess
    import sys

    from tests.helpers.repo import REPO

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "ORT_"))}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", EXPORT_IN_A_FRESH_HOME, str(tiny_model), str(work)], cwd=work,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "(1, 32)"
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []
