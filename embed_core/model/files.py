"""The one check a model directory passes before anything loads it (base model, evaluated model,
mined-with model): a directory, with ``config.json``, and safetensors weights that are whole.

A bad directory is refused with one line naming it and saying what to do, instead of a traceback
from deep inside transformers. Pickle-only weights (``pytorch_model.bin``) are refused too: model
directories may come from others and unpickling is code execution (torch's ``weights_only``
loader narrows that, and has had bypasses); converting them once to safetensors is one line.
A directory with a GGUF file is left to transformers' GGUF loader (config and weights in the file).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from embed_core.errors import EmbedpipeError
from embed_core.paths import file_problem

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
MAX_CONFIG_BYTES = 16 * 1024 * 1024  # a model's config.json (real ones: a few KB)
# Sizes a model's config.json states, by the names architectures give them: a value that is not a
# whole number in range would fail deep inside transformers, or build a model that never finishes
# (10**15 layers), before any weight is read.
MAX_LAYERS = 10_000
MAX_WIDTH = 1 << 20  # hidden, intermediate and head sizes, and head counts
MAX_PARAMETERS = 10 ** 13  # 12·layers·hidden², the parameters of the transformer blocks
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads", "num_key_value_heads")
WIDTH_FIELDS = ("hidden_size", "n_embd", "d_model", "intermediate_size", "d_ff")
DERIVED_FIELDS = ("head_dim", "d_kv", "n_inner")  # 0 (or null): derived from the others by some architectures
# The files a loader of a model directory reads (transformers, sentence-transformers, tokenizers,
# embedpipe's own settings), by how their names end: each must be a regular file where it is.
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".json", ".txt", ".model", ".gguf")
CONVERT_HINT = ("convert it once to safetensors (load it with transformers' from_pretrained, trusting its source, "
                "and save_pretrained it: that writes model.safetensors)")


class ModelFilesError(EmbedpipeError):
    """A model directory cannot be loaded: not a model, a file, damaged or unsafe weights."""


def check_model_dir(path: str | Path) -> None:
    """Raise ``ModelFilesError`` unless ``path`` is a loadable model directory (see the module doc)."""
    root = Path(path)
    if root.is_file():
        if root.suffix == ".gguf":
            return
        raise ModelFilesError(f"{root}: is a file, not a model directory; give the directory that holds "
                              "config.json and the weights (or a .gguf file)")
    if not root.is_dir():
        raise ModelFilesError(f"{root}: not a model directory")
    _check_model_files(root)
    if any(root.glob("*.gguf")):
        return
    if not (root / "config.json").exists():
        raise ModelFilesError(f"{root}: not a model directory (no config.json); give a Hugging Face or "
                              "sentence-transformers model directory, or 'default' for the packaged model")
    check_model_config(root / "config.json")
    shards = safetensors_files(root)
    if not shards:
        if any(root.glob("pytorch_model*.bin")):
            raise ModelFilesError(f"{root}: has only pickle weights (pytorch_model.bin), which embedpipe does not "
                                  f"load (unpickling can run code); {CONVERT_HINT}")
        raise ModelFilesError(f"{root}: no model weights (model.safetensors) in the directory")
    for shard in shards:
        check_safetensors(shard)


def _check_model_files(root: Path) -> None:
    """Every file a loader reads (``MODEL_FILE_SUFFIXES``), in the directory and its module
    directories (``1_Pooling/config.json``), is a regular file (``paths.file_problem``): a directory
    or a FIFO of that name is one line naming it, not a loader's traceback, a hang, or a file
    silently skipped (a tokenizer.json that is a directory would leave the tokenizer to a fallback)."""
    for path in sorted([*root.iterdir(), *(p for d in root.iterdir() if d.is_dir() for p in d.iterdir())]):
        if path.name.endswith(MODEL_FILE_SUFFIXES):
            problem = file_problem(path)
            if problem is not None:
                raise ModelFilesError(f"{path}: {problem}; copy or download the model again")


def safetensors_files(root: Path) -> list[Path]:
    """The weight files a directory's model loads: the shards its index names, else ``*.safetensors``."""
    index = root / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(root.glob("*.safetensors"))
    try:
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ModelFilesError(f"{index}: not a safetensors index (weight_map missing or not JSON); "
                              "copy the model again") from None
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise ModelFilesError(f"{root / missing[0]}: weight shard named by {index.name} is missing; copy the model again")
    return [root / n for n in names]


def check_safetensors(path: Path) -> None:
    """A safetensors file whose header parses and whose tensors end exactly at the end of the file
    (a cut-off copy or download fails here, without reading the weights)."""
    size = path.stat().st_size
    damaged = f"{path}: truncated or damaged safetensors file ({size} bytes); copy or download the model again"
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelFilesError(damaged)
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ModelFilesError(damaged)
        try:
            header = json.loads(fh.read(length))
            tensors = {k: t for k, t in header.items() if k != "__metadata__"}
            end = max((int(t["data_offsets"][1]) for t in tensors.values()), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise ModelFilesError(damaged) from None
    for name, tensor in tensors.items():  # every loader reads a tensor's shape from here (plan: its memory)
        shape = tensor.get("shape")
        if not isinstance(shape, list) or not all(_whole(n, 0, 1 << 62) for n in shape):
            raise ModelFilesError(f"{path}: tensor {name!r}: shape {shape!r} is not a list of sizes in the "
                                  "safetensors header; copy or download the model again")
    if 8 + length + end != size:
        raise ModelFilesError(damaged)


def check_model_config(path: Path) -> None:
    """A ``config.json`` that is a JSON object whose layer count, head counts and widths (here and in
    its sub-configs, e.g. a multimodal model's ``text_config``) are whole numbers in range and agree."""
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ModelFilesError(f"{path}: {path.stat().st_size} bytes, more than a model's config.json can be "
                              f"({MAX_CONFIG_BYTES}); copy or download the model again")
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelFilesError(f"{path}: not JSON ({exc}); copy or download the model again") from None
    if not isinstance(config, dict):
        raise ModelFilesError(f"{path}: not a model's config (a JSON {type(config).__name__}, not an object)")
    _check_sizes(path, "", config)
    for key, sub in config.items():
        if key.endswith("_config") and isinstance(sub, dict):
            _check_sizes(path, f"{key}.", sub)


# Keys transformers writes into a saved tokenizer_config.json from how the saving process loaded it
# (HF_HUB_OFFLINE, a cache directory), not from the tokenizer: a model saved from the UI's worker and
# from a plain shell must be the same files and the same fingerprint.
LOADER_ONLY_KEYS = frozenset({"local_files_only", "cache_dir", "force_download", "proxies", "token",
                              "use_auth_token", "revision", "_commit_hash", "trust_remote_code"})
TOKENIZER_CONFIG = "tokenizer_config.json"


def save_tokenizer(tokenizer: object, directory: str | Path) -> None:
    """``tokenizer.save_pretrained(directory)`` without the loader-only keys (``LOADER_ONLY_KEYS``)."""
    tokenizer.save_pretrained(str(directory))  # type: ignore[attr-defined]
    path = Path(directory) / TOKENIZER_CONFIG
    kept = _without_loader_keys(path) if path.is_file() else None
    if kept is not None:
        path.write_text(json.dumps(kept, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def tokenizer_config_identity(path: Path) -> bytes | None:
    """What identifies a tokenizer_config.json that holds loader-only keys: its JSON without them
    (canonical); None for one without them, identified by its bytes as any file is."""
    kept = _without_loader_keys(path)
    return None if kept is None else json.dumps(kept, sort_keys=True, ensure_ascii=False).encode()


def _without_loader_keys(path: Path) -> dict | None:
    """The JSON object in ``path`` without ``LOADER_ONLY_KEYS``; None when it holds none of them (or
    is not a JSON object)."""
    try:
        config = json.loads(path.read_bytes())
    except (ValueError, OSError):
        return None
    if not isinstance(config, dict) or not LOADER_ONLY_KEYS & set(config):
        return None
    return {k: v for k, v in config.items() if k not in LOADER_ONLY_KEYS}


# Heads of task models: a checkpoint of one is a classifier (a cross-encoder when it scores pairs),
# whose encoder without its head is not a trained embedding model.
TASK_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMultipleChoice")
ROLES = ("cross_encoder", "embedder")


def check_model_role(root: Path, role: str) -> None:
    """A model directory is what its role needs, else one line (``ModelFilesError``): a
    ``cross_encoder`` (the mine stage's teacher) is a ``*ForSequenceClassification`` checkpoint with one
    label, so its head is loaded, not newly initialised (sentence-transformers' CrossEncoder would
    otherwise score with a random head, a warning on stdout); an ``embedder`` (base, mining or
    evaluated model, an embedder teacher) is not a task model whose head would be dropped. A GGUF
    model (its config is in the file) is not judged here."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}: one of {ROLES}")
    if root.is_file() or not (root / "config.json").is_file():
        return
    config = json.loads((root / "config.json").read_bytes())  # check_model_config read it whole already
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    heads = [a for a in archs if a.endswith(TASK_HEADS)]
    if role == "cross_encoder":
        scorers = [a for a in heads if a.endswith("ForSequenceClassification")]
        if not scorers:
            raise ModelFilesError(
                f"{root}: mine.teacher kind cross_encoder needs a cross-encoder (a *ForSequenceClassification "
                f"checkpoint with one label: a sentence-transformers CrossEncoder, a reranker), but config.json names "
                f"{', '.join(archs) or 'no architecture'}: its scoring head would be newly initialised at random; "
                "for an embedding model use kind: embedder")
        labels = _labels(config)
        if labels != 1:
            raise ModelFilesError(f"{root}: mine.teacher kind cross_encoder needs one score per pair, but this "
                                  f"{scorers[0]} has {labels} labels (config.json num_labels / id2label); give a "
                                  "reranker trained with one label")
    elif heads and len(heads) == len(archs):
        raise ModelFilesError(f"{root}: a {heads[0]} checkpoint (a classifier or cross-encoder), not an embedding "
                              "model: its encoder would be used without the head it was trained with; give an "
                              "embedding model, or use it as mine.teacher with kind: cross_encoder")


def _labels(config: dict) -> int:
    """A config's label count as transformers reads it: ``id2label``'s size, else ``num_labels``, else 2."""
    if isinstance(config.get("id2label"), dict) and config["id2label"]:
        return len(config["id2label"])
    value = config.get("num_labels")
    return value if isinstance(value, int) and not isinstance(value, bool) else 2


def _check_sizes(path: Path, prefix: str, config: dict) -> None:
    """The checks of ``check_model_config`` on one (sub-)config; ``prefix`` names it in the error."""
    def bad(field: str, reason: str) -> ModelFilesError:
        return ModelFilesError(f"{path}: {prefix}{field}: {config[field]!r} {reason}; the file is damaged or not "
                               "a model's config")

    for fields, low, high in ((LAYER_FIELDS, 0, MAX_LAYERS), (HEAD_FIELDS + WIDTH_FIELDS, 1, MAX_WIDTH),
                              (DERIVED_FIELDS, 0, MAX_WIDTH)):
        for field in fields:
            value = config.get(field)
            # a list or mapping: one per layer or per part (Gemma-3n's widths, LXMERT's layers)
            values = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else [value]
            if value is not None and not all(_whole(x, low, high) for x in values):
                raise bad(field, f"is not a whole number from {low} to {high}")

    def number(*fields: str) -> str | None:  # the first of fields that holds one number
        return next((f for f in fields if _whole(config.get(f), 1, MAX_WIDTH)), None)

    hidden, heads = number("hidden_size", "n_embd"), number("num_attention_heads", "n_head")
    kv = number("num_key_value_heads")
    if hidden and heads and not config.get("head_dim") and config[heads] > config[hidden]:
        raise bad(heads, f"attention heads share {hidden} {config[hidden]}: less than one dimension a head "
                  "(no head_dim given)")
    head_dim = number("head_dim")
    if heads and head_dim and config[heads] * config[head_dim] > MAX_WIDTH:
        raise bad(heads, f"attention heads of head_dim {config[head_dim]} are {config[heads] * config[head_dim]} "
                  f"dimensions a token, more than {MAX_WIDTH}")
    if heads and kv and config[heads] % config[kv]:
        raise bad(kv, f"key-value heads do not divide {heads} {config[heads]}")
    layers, width = number(*LAYER_FIELDS), number("hidden_size", "n_embd", "d_model")
    parameters = 12 * config[layers] * config[width] ** 2 if layers and width else 0
    if parameters > MAX_PARAMETERS:
        raise bad(layers, f"layers of {width} {config[width]} make about {parameters:.1e} parameters, more than "
                  f"{MAX_PARAMETERS:.0e}")


def _whole(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_decoder_type(model_type: str) -> bool:
    """A decoder LM's model type (Qwen, Llama, Mistral, Gemma...): transformers has a causal-LM
    class for it and no masked-LM one (BERT-likes have both)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def set_config_dtype(directory: Path, dtype_name: str) -> None:
    """Record ``dtype_name`` (``bfloat16``...) as the saved weights' dtype in ``config.json``
    (``save_pretrained`` writes the in-memory parameters' dtype, fp32 master weights, even when it
    was given a state dict in another dtype); loaders with ``dtype="auto"`` read it."""
    config = Path(directory) / "config.json"
    fields = json.loads(config.read_text(encoding="utf-8"))
    fields["dtype"] = dtype_name
    fields.pop("torch_dtype", None)
    config.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def tensor_names(root: Path) -> dict[str, Path]:
    """Every weight of a model directory and the file that holds it (one ``model.safetensors`` or
    the shards its index names, ``model-00001-of-0000N.safetensors``), from the headers alone."""
    names: dict[str, Path] = {}
    for path in safetensors_files(Path(root)):
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        names.update({name: path for name in header if name != "__metadata__"})
    return names
