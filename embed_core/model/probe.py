"""The probe a release is checked on (``embed_core.evaluate.release``): a fixed small set of the
stage's training texts, encoded under each of the saved model's named prompts (and without one).

The train stage encodes it with the in-training encoder right before the model is saved and
writes ``train-<stage>/probe.npz``: ``texts`` (the probe), ``names`` (prompt names, "" = no prompt),
``instructions`` (the instruction each name stands for) and ``embeddings`` (names × texts × dim,
L2-normalised float32)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

PROBE_FILE = "probe.npz"
PROBE_TEXTS = 32  # texts in the probe: enough to see a change of any layer, cheap to encode 4 ways


def probe_texts(datasets: dict[str, Any], n: int = PROBE_TEXTS) -> list[str]:
    """The first ``n`` distinct texts of the datasets' queries and positives, the datasets taken in
    turn in name order (so every dataset is in the probe): fixed for a given stage's records."""
    def texts(records) -> list[Any]:
        rows = range(min(records.size, n))
        return [t for i in rows for t in (records.cols["query"][i], *(records.cols["positives"][i] or [])[:1])]

    columns = [texts(records) for _, records in sorted(datasets.items())]
    out: list[str] = []
    for row in range(max((len(c) for c in columns), default=0)):
        for column in columns:
            if row < len(column) and isinstance(column[row], str) and column[row] and column[row] not in out:
                out.append(column[row])
    return out[:n]


def probe_prompts(model_dir: Path) -> dict[str, str]:
    """Prompt name -> instruction to probe: "" (no prompt) and each distinct instruction of the
    saved model's prompts (one name per instruction)."""
    from embed_core.model.settings import prompt_instructions, read_model_settings

    out = {"": ""}
    for name, (_, instruction) in sorted(prompt_instructions(read_model_settings(model_dir)).items()):
        if instruction and instruction not in out.values():
            out[name] = instruction
    return out


def encode_probe(embedder, texts: list[str], instruction: str, batch_size: int = 16) -> np.ndarray:
    """``texts`` under ``instruction`` by an ``Embedder`` (eval mode, no gradients, its own weight
    dtype, no autocast), L2-normalised float32."""
    import torch

    device = next(embedder.parameters()).device
    was_training = embedder.training
    embedder.eval()
    out = []
    try:
        with torch.no_grad():
            for i in range(0, len(texts), batch_size):
                chunk = texts[i:i + batch_size]
                features = embedder.tokenize(chunk, [instruction or None] * len(chunk))
                out.append(embedder({k: v.to(device) for k, v in features.items()}).float().cpu().numpy())
    finally:
        embedder.train(was_training)
    return normalized(np.concatenate(out))


def normalized(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def probe_record(embedder, model_dir: Path, texts: list[str]) -> tuple[bytes, dict[str, Any]]:
    """``probe.npz``'s bytes and its manifest entry for the in-training ``embedder`` (whose weights
    ``model_dir`` holds)."""
    prompts = probe_prompts(model_dir)
    embeddings = np.stack([encode_probe(embedder, texts, instruction) for instruction in prompts.values()])
    dtype = str(next(embedder.parameters()).dtype).removeprefix("torch.")
    buf = io.BytesIO()
    np.savez(buf, texts=np.array(texts, dtype=object).astype(str), names=np.array(list(prompts), dtype=str),
             instructions=np.array(list(prompts.values()), dtype=str), embeddings=embeddings)
    return buf.getvalue(), {"file": PROBE_FILE, "texts": len(texts), "prompts": list(prompts), "dtype": dtype}


def read_probe(path: Path) -> dict[str, Any]:
    with np.load(path, allow_pickle=False) as z:
        return {"texts": [str(t) for t in z["texts"]], "names": [str(n) for n in z["names"]],
                "instructions": [str(i) for i in z["instructions"]], "embeddings": z["embeddings"]}
