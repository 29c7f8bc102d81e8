"""The ONNX export of a released model (``evaluate.release.export: [onnx]``), without optimum.

The saved model is loaded as a user loads it (``SentenceTransformer(path)``); its modules are read —
a ``Transformer``, then a ``Pooling`` (any of its modes; mean, cls and last-token are the ones
embedpipe writes) and optionally a ``Normalize``; anything else is refused — and exported as one
float32 graph by torch's exporter (``torch.onnx.export``, opset ``OPSET``) to ``onnx/model.onnx``
beside the model (weights of 1 GiB or more in ``model.onnx.data``). The exporter is the
torch.export-based ("dynamo") one, torch's default since 2.9: it exports transformers 5's BERT and
Qwen3 as they run; the TorchScript one (deprecated) exports the BERT but fails on Qwen3 in torch 2.13.
sentence-transformers' own ONNX backend needs optimum-onnx, which requires transformers < 4.58.

* inputs, int64, (batch, sequence), both axes dynamic, as the saved tokenizer (in the model folder)
  pads them: ``input_ids``, ``attention_mask``, ``token_type_ids`` where the transformer takes them,
  and ``prompt_length`` (batch,) where the pooling leaves the prompt's tokens out
  (``include_prompt: false``);
* output ``sentence_embedding`` (batch, dimension): the pooled embedding, L2-normalised where the
  saved model normalises: what ``SentenceTransformer.encode`` returns.

``OnnxEncoder`` encodes with onnxruntime and that tokenizer, with the saved prompts and max length as
sentence-transformers applies them; the release check compares it with the saved model. Importing
this module imports torch: the release check imports it only when it exports.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from embed_core.errors import ReleaseError

ONNX_DIR = "onnx"
ONNX_FILE = "model.onnx"
OPSET = 18  # the exporter's own operator set (torchlib's): no conversion pass after the export
EXTRA_MODULES = ("onnx", "onnxruntime", "onnxscript")  # the `onnx` extra: the file, the runtime, the exporter's ops
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "sentence_embedding"
EXTERNAL_DATA_BYTES = 1 << 30  # float32 weights from 1 GiB on go to model.onnx.data (one file's limit: 2 GB)


def require_onnx() -> None:
    """A one-line error naming the `onnx` extra's missing packages, if any."""
    missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ReleaseError(f"evaluate.release.export: the onnx export needs {', '.join(missing)} (not installed; "
                           f"torch exports, onnxruntime encodes): pip install -e '.[onnx]' (or drop onnx from "
                           f"evaluate.release.export)")


def export_onnx(model_dir: Path, export_dir: Path) -> OnnxEncoder:
    """Export ``model_dir`` (a saved sentence-transformers model) to ``export_dir/onnx/model.onnx``
    and return the onnxruntime encoder of the export (tokenizer, prompts and max length from
    ``model_dir``)."""
    require_onnx()
    quiet_onnxruntime()  # the exporter's optimizer may load onnxruntime too
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_dir), device="cpu").float().eval()
    graph = SentenceGraph(st, where=str(model_dir)).eval()
    example = graph.example_inputs(st.tokenizer)
    out = export_dir / ONNX_DIR / ONNX_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    dynamic = {name: {axis: torch.export.Dim.DYNAMIC for axis in range(value.dim())} for name, value in example.items()}
    weights = sum(p.numel() for p in graph.parameters()) * 4
    with torch.no_grad():
        torch.onnx.export(graph, (), str(out), kwargs=example, input_names=list(example), output_names=[OUTPUT],
                          dynamic_shapes=dynamic, opset_version=OPSET, dynamo=True,
                          external_data=weights >= EXTERNAL_DATA_BYTES, verbose=False)
    return OnnxEncoder(model_dir, out)


class SentenceGraph(nn.Module):
    """The saved model's Transformer, Pooling and Normalize modules on the tokenizer's tensors."""

    def __init__(self, st, where: str):
        super().__init__()
        self.transformer, self.pooling, self.normalize = graph_modules(st, where)
        self.input_names = model_inputs(self.transformer.auto_model, st.tokenizer)
        self.model_kwargs = {"use_cache": False} if "use_cache" in _parameters(self.transformer.auto_model) else {}

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None,
                prompt_length: Tensor | None = None) -> Tensor:
        features = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            features["token_type_ids"] = token_type_ids
        hidden = self.transformer.auto_model(**features, **self.model_kwargs).last_hidden_state
        mask = attention_mask.to(torch.int32)  # onnxruntime's ArgMax/ReduceMax take no int64
        if prompt_length is not None:
            mask = without_prompt(mask, prompt_length)
        pooled = self.pooling({"token_embeddings": hidden, "attention_mask": mask})
        return (self.normalize(pooled) if self.normalize is not None else pooled)[OUTPUT]

    def example_inputs(self, tokenizer) -> dict[str, Tensor]:
        """Two texts of unequal lengths (no axis of size 1, which torch.export would fix)."""
        batch = tokenizer(["an example text", "a second, somewhat longer example text to be padded"],
                          padding=True, return_tensors="pt")
        example = {name: batch[name].to(torch.int64) for name in self.input_names}
        if not self.pooling.include_prompt:
            example["prompt_length"] = torch.tensor([2, 3], dtype=torch.int64)
        return example


def graph_modules(st, where: str) -> tuple[nn.Module, nn.Module, nn.Module | None]:
    """The saved model's (Transformer, Pooling, Normalize or None); a one-line error for any other
    layout (a Dense layer, a router, no pooling)."""
    from sentence_transformers.models import Normalize, Pooling, Transformer

    modules = list(st)
    kinds = [type(m).__name__ for m in modules]
    layout_ok = (len(modules) in (2, 3) and isinstance(modules[0], Transformer) and isinstance(modules[1], Pooling)
                 and (len(modules) == 2 or isinstance(modules[2], Normalize)))
    if not layout_ok:
        raise ReleaseError(f"{where}: evaluate.release.export: onnx exports a Transformer, Pooling and optional "
                           f"Normalize, not this model's modules ({', '.join(kinds)}); drop onnx from "
                           f"evaluate.release.export")
    return modules[0], modules[1], modules[2] if len(modules) == 3 else None


def model_inputs(model: nn.Module, tokenizer) -> list[str]:
    """The tokenizer's tensors the transformer's forward names (Qwen3 takes no token_type_ids)."""
    produced = tokenizer(["x"])
    params = _parameters(model)
    return [name for name in TEXT_INPUTS if name in produced and name in params]


def _parameters(model: nn.Module) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def without_prompt(mask: Tensor, prompt_length: Tensor) -> Tensor:
    """``mask`` with each row's first ``prompt_length`` attended tokens zeroed (after any left
    padding): sentence-transformers' ``Pooling(include_prompt=False)`` with a length per row."""
    first = mask.argmax(dim=1)
    positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
    return mask * (positions >= (first + prompt_length).unsqueeze(1)).to(mask.dtype)


def quiet_onnxruntime() -> None:
    """onnxruntime (1.32 on Linux) writes a device id and a telemetry database under
    ``~/.cache/Microsoft/DeveloperTools/`` when it is loaded, ``DO_NOT_TRACK`` or not; its own switch
    ``ORT_DISABLE_TELEMETRY`` keeps it from writing outside the run (a value the user set is kept)."""
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")


class OnnxEncoder:
    """Encodes texts with an exported ``onnx/model.onnx`` on onnxruntime (CPU), tokenized by the
    model folder's tokenizer, each under one of the saved prompts as sentence-transformers prefixes
    it, truncated to the saved max length."""

    def __init__(self, model_dir: str | Path, onnx_path: str | Path | None = None):
        quiet_onnxruntime()
        import onnxruntime
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        onnx_path = onnx_path or model_dir / ONNX_DIR / ONNX_FILE
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        settings = _read_json(model_dir / "config_sentence_transformers.json")
        # sentence-transformers' own defaults ("query", "document": none) under the saved prompts
        self.prompts: dict[str, str] = {"query": "", "document": "", **(settings.get("prompts") or {})}
        self.default_prompt_name: str | None = settings.get("default_prompt_name")
        self.max_length = int(_read_json(model_dir / "sentence_bert_config.json").get("max_seq_length")
                              or self.tokenizer.model_max_length)
        self.session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.dimension = int(self.session.get_outputs()[0].shape[1])

    def encode(self, texts: list[str], prompt_name: str | None = None, batch_size: int = 32,
               **_: Any) -> np.ndarray:
        """float32 embeddings (len(texts), dimension); ``prompt_name`` one of the saved prompts (none:
        the saved default prompt, if any)."""
        prompt_name = prompt_name or self.default_prompt_name
        if prompt_name and prompt_name not in self.prompts:
            raise ValueError(f"prompt {prompt_name!r} is not one of the model's prompts ({', '.join(self.prompts)})")
        prompt = self.prompts[prompt_name] if prompt_name else ""
        rows = [self._run([prompt + t for t in texts[i:i + batch_size]], prompt)
                for i in range(0, len(texts), batch_size)]
        return np.concatenate(rows) if rows else np.zeros((0, self.dimension), dtype=np.float32)

    def _run(self, texts: list[str], prompt: str) -> np.ndarray:
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="np")
        feed = {name: batch[name].astype(np.int64) for name in self.input_names if name != "prompt_length"}
        if "prompt_length" in self.input_names:
            feed["prompt_length"] = np.full(len(texts), self.prompt_length(prompt), dtype=np.int64)
        return self.session.run([OUTPUT], feed)[0]

    def prompt_length(self, prompt: str) -> int:
        """The prompt's tokens, its leading special tokens counted, a trailing one not
        (sentence-transformers' count)."""
        if not prompt:
            return 0
        ids = self.tokenizer(prompt)["input_ids"]
        return len(ids) - (1 if ids and ids[-1] in self.tokenizer.all_special_ids else 0)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
