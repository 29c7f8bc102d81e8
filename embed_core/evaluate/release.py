"""The release check: before ``<run_dir>/evaluate/model`` is written, the trained model proves it is
what was trained, and that training moved it.

The train stage recorded the probe (``train-<stage>/probe.npz``, ``embed_core.model.probe``): a fixed
set of its texts as the in-training encoder embedded them under each of the model's prompts (and
without one). Here the same texts are encoded by
* the saved model, as a user loads it: ``SentenceTransformer(path).encode(texts, prompt_name=…)``;
  with LoRA the saved weights are the merged ones, so this is the merge's check too;
* the base model (the model the train stage started from), through the in-training encoder's code;
* each export (``evaluate.release.export``: onnx, torch's ONNX exporter encoded by onnxruntime,
  ``embed_core.evaluate.onnx_export``).

Figures are 1 − cosine, the largest over probe texts and prompts ("deviation"):
``saved_vs_training`` must be ≤ the tolerance (bf16_tolerance for an encoder that held bfloat16
weights) and smaller than ``saved_vs_base`` (a saved model closer to its base than to what was
trained is not the trained model, whatever the tolerance); ``export_vs_saved`` ≤ the tolerance;
``saved_vs_base`` > ``unchanged_tolerance`` and the weight files unlike the base's, unless
``allow_unchanged``. Any failure raises ``ReleaseError`` (one line, exit 2) and nothing is released.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from embed_core.errors import ReleaseError
from embed_core.evaluate.config import ReleaseConfig
from embed_core.manifests import MANIFEST, TrainManifest
from embed_core.model.probe import PROBE_FILE, encode_probe, normalized, read_probe
from embed_core.paths import resolve_within

log = logging.getLogger("embedpipe.evaluate")


def deviation(a: np.ndarray, b: np.ndarray) -> float:
    """The largest 1 − cosine between matching rows of ``a`` and ``b`` (any leading shape), computed
    in float64 as ‖a − b‖² / 2 of the unit vectors: exact down to ~1e-15, where a float32 cosine
    stops at ~1e-7 (a few steps at a small learning rate move embeddings by less)."""
    a64 = np.asarray(a, dtype=np.float64)
    b64 = np.asarray(b, dtype=np.float64)
    a64 /= np.maximum(np.linalg.norm(a64, axis=-1, keepdims=True), 1e-300)
    b64 /= np.maximum(np.linalg.norm(b64, axis=-1, keepdims=True), 1e-300)
    return float(np.max(np.sum((a64 - b64) ** 2, axis=-1)) / 2)


def encode_saved(model, probe: dict[str, Any]) -> np.ndarray:
    """The probe under each recorded prompt name ("" = none) by a loaded ``SentenceTransformer`` (or
    an ``onnx_export.OnnxEncoder``, which encodes alike)."""
    return np.stack([normalized(model.encode(probe["texts"], prompt_name=name or None, convert_to_numpy=True,
                                             batch_size=16, show_progress_bar=False))
                     for name in probe["names"]])


def encode_base(base_path: str, model_dir: Path, probe: dict[str, Any]) -> np.ndarray:
    """The probe as the base model embeds it with the trained model's settings (pooling, template,
    lengths): the in-training encoder's code on the base weights, in float32."""
    from embed_core.model.embedder import Embedder
    from embed_core.model.settings import read_model_settings

    s = read_model_settings(model_dir)
    raw = _settings_json(model_dir)
    embedder = Embedder(base_path, pooling=s.pooling, max_length=s.max_length, instruction_template=s.instruction_template,
                        exclude_instruction_from_pooling=bool(raw.get("exclude_instruction_from_pooling")),
                        bidirectional=bool(raw.get("bidirectional"))).to(_device())
    return np.stack([encode_probe(embedder, probe["texts"], instruction) for instruction in probe["instructions"]])


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _settings_json(model_dir: Path) -> dict[str, Any]:
    import json

    from embed_core.model.settings import SETTINGS_FILE

    path = model_dir / SETTINGS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def same_weights(model_dir: Path, base_path: str) -> bool:
    """The model's weight files (*.safetensors) equal the base's byte for byte (compared only where
    the names and sizes match, so a real model is never read twice)."""
    from embed_core.fingerprint import sha256_file

    mine = sorted(model_dir.glob("*.safetensors"))
    base = Path(base_path)
    theirs = sorted(base.glob("*.safetensors")) if base.is_dir() else []
    if not mine or [p.name for p in mine] != [p.name for p in theirs]:
        return False
    if any(a.stat().st_size != b.stat().st_size for a, b in zip(mine, theirs)):
        return False
    return all(sha256_file(a) == sha256_file(b) for a, b in zip(mine, theirs))


def check_release(model_dir: Path, train_manifest: TrainManifest | dict[str, Any], cfg: ReleaseConfig,
                  export_dir: Path | None = None) -> dict[str, Any]:
    """The figures of the release check of the trained model ``model_dir`` (its train stage's
    manifest given); raises ``ReleaseError`` when the release must be refused. ``export_dir``: where
    the exports are written (the staged release), when ``cfg.export`` names any."""
    from sentence_transformers import SentenceTransformer

    from embed_core.model.encoder import resolve_model_path

    where = f"{model_dir}"
    trained = TrainManifest.of(train_manifest, model_dir.parent / MANIFEST)
    base_path = resolve_model_path(trained.init_model)
    figures: dict[str, Any] = {"base": trained.init_model}
    entry = trained.probe or {}
    if not entry.get("file"):
        figures["checked"] = f"no probe recorded ({entry.get('reason', 'a train stage older than the check')})"
        log.warning("evaluate: release of %s not checked on a probe: %s", model_dir, figures["checked"])
        _refuse_same_weights(where, model_dir, base_path, figures, cfg)
        return figures
    probe = read_probe(resolve_within(model_dir.parent, PROBE_FILE))
    saved = encode_saved(SentenceTransformer(str(model_dir), device=_device()), probe)
    base = encode_base(base_path, model_dir, probe)
    tol = cfg.bf16_tolerance if entry.get("dtype") == "bfloat16" else cfg.tolerance
    figures.update({"probe_texts": len(probe["texts"]), "prompts": probe["names"], "tolerance": tol,
                    "saved_vs_base": deviation(saved, base),
                    "training_vs_base": deviation(probe["embeddings"], base)})
    if entry.get("averaged"):  # weights averaged with another stage's after training: nothing to match
        figures["saved_vs_training"] = None
    else:
        figures["saved_vs_training"] = _agreement(where, saved, probe, figures, tol, lora=bool(entry.get("lora")),
                                                  unchanged_tolerance=cfg.unchanged_tolerance)
    _refuse_same_weights(where, model_dir, base_path, figures, cfg)
    if figures["saved_vs_base"] <= cfg.unchanged_tolerance and not cfg.allow_unchanged:
        raise ReleaseError(f"{where}: release refused: it encodes the probe like its base model ({figures['base']}; "
                           f"largest 1 − cosine {figures['saved_vs_base']:.2e} ≤ unchanged_tolerance "
                           f"{cfg.unchanged_tolerance:g}); training changed nothing (evaluate.release.allow_unchanged: "
                           f"true releases it anyway)")
    for kind in cfg.export:
        figures[f"{kind}_vs_saved"] = check_export(kind, model_dir, export_dir, probe, saved, tol)
    log.info("evaluate: release check of %s passed:\n%s", model_dir, check_table(figures))
    return figures


def _refuse_same_weights(where: str, model_dir: Path, base_path: str, figures: dict[str, Any],
                         cfg: ReleaseConfig) -> None:
    figures["weights_equal_base"] = same_weights(model_dir, base_path)
    if figures["weights_equal_base"] and not cfg.allow_unchanged:
        raise ReleaseError(f"{where}: release refused: its weight files equal its base model's ({figures['base']}) "
                           f"byte for byte; training changed nothing (evaluate.release.allow_unchanged: true releases "
                           f"it anyway)")


def _agreement(where: str, saved: np.ndarray, probe: dict[str, Any], figures: dict[str, Any], tol: float, *,
               lora: bool, unchanged_tolerance: float) -> float:
    """``saved_vs_training``, refused when beyond ``tol`` or, when training moved the encoder, not
    closer to the trained encoder than to the base."""
    dev = deviation(saved, probe["embeddings"])
    worst = probe["names"][int(np.argmax([deviation(s, t) for s, t in zip(saved, probe["embeddings"])]))] or "no prompt"
    hint = "; the LoRA adapters were not merged into the saved weights?" if lora else \
        "; the saved weights are not the trained ones?"
    moved = figures["training_vs_base"] > unchanged_tolerance
    if dev > tol or (moved and dev >= figures["saved_vs_base"]):
        raise ReleaseError(f"{where}: release refused: the saved model encodes the probe unlike the in-training "
                           f"encoder (largest 1 − cosine {dev:.2e} under prompt {worst!r}, tolerance {tol:g}; "
                           f"1 − cosine to the base model {figures['saved_vs_base']:.2e}){hint}")
    return dev


def check_export(kind: str, model_dir: Path, export_dir: Path | None, probe: dict[str, Any], saved: np.ndarray,
                 tol: float) -> float:
    """Write the ``kind`` export of ``model_dir`` into ``export_dir`` and return its deviation from
    the saved model on the probe (the export encoding through onnxruntime and the model's own
    tokenizer and prompts); refused beyond ``tol``."""
    if kind != "onnx" or export_dir is None:
        raise ReleaseError(f"evaluate.release.export: unknown export {kind!r} (known: onnx)")
    from embed_core.evaluate.onnx_export import ONNX_DIR, export_onnx

    dev = deviation(encode_saved(export_onnx(model_dir, export_dir), probe), saved)
    if dev > tol:
        raise ReleaseError(f"{export_dir / ONNX_DIR}: release refused: the ONNX export encodes the probe unlike the "
                           f"saved model (largest 1 − cosine {dev:.2e}, tolerance {tol:g})")
    return dev


_FIGURES = ("saved_vs_training", "training_vs_base", "saved_vs_base", "onnx_vs_saved")


def check_table(check: dict[str, Any]) -> str:
    """The figures of ``check_release`` as a markdown table (largest 1 − cosine per comparison)."""
    lines = ["| comparison | largest 1 − cosine |", "|---|---:|"]
    for key in _FIGURES:
        if key in check:
            value = check[key]
            lines.append(f"| {key.replace('_vs_', ' vs ')} | {'—' if value is None else f'{value:.2e}'} |")
    return "\n".join(lines + ["", f"{check.get('probe_texts')} probe texts under {len(check.get('prompts', []))} "
                                   f"prompts; tolerance {check.get('tolerance')}."])


def release_section(release: dict[str, Any] | None) -> str:
    """The report's "Release check" section: the figures of ``check_release`` (none: no release)."""
    if release is None:
        return ""
    check = release.get("check") or {}
    lines = ["", "## Release check", "", f"Released `{release['model']}` (base: `{check.get('base')}`).", ""]
    if "checked" in check:
        return "\n".join(lines + [f"Not checked on a probe: {check['checked']}.", ""])
    return "\n".join(lines + [check_table(check), ""])
