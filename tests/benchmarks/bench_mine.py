"""Mining benchmark: embedpipe's miner vs sentence-transformers' ``util.mine_hard_negatives(use_faiss=True)``.

Same model (packaged all-MiniLM-L6-v2), same corpus, same queries, same window (ranks 10–30), same
positive-aware margin (ours: score < 0.95 × positive; theirs: relative_margin=0.05, the same rule),
4 negatives per query, batch size 64. Each miner runs in a fresh subprocess (cold: empty
embedding cache), so wall time and peak RSS are its own. Cases:

* ``scifact``: SciFact corpus (5,183 docs) with the SciFact train (query, positive) pairs;
* ``large``: >= 50k distinct real texts from every dataset in ../shared/data, queries = SciFact
  train pairs + STS-B train pairs with score >= 4.

Prints wall time, peak RSS, the overlap of the selected negatives, and last
``RATIO mine_vs_sentence_transformers=<peer time / our time>`` for the large pool.
Run: ``make bench`` (or ``python tests/benchmarks/bench_mine.py [--case scifact|large]``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("EMBEDPIPE_SHARED_DATA", REPO.parent / "shared" / "data"))
WINDOW = dict(range_min=10, range_max=30, num_negatives=4)
BATCH = 64


def _jsonl(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def scifact_pairs() -> tuple[list[tuple[str, str]], list[str]]:
    d = SHARED / "beir/scifact"
    corpus = {x["_id"]: f"{x['title'].strip()} {x['text'].strip()}".strip() for x in _jsonl(d / "corpus.jsonl")}
    queries = {x["_id"]: x["text"] for x in _jsonl(d / "queries.jsonl")}
    pairs = []
    with open(d / "qrels/train.tsv") as fh:
        for row in list(csv.reader(fh, delimiter="\t"))[1:]:
            pairs.append((queries[row[0]], corpus[row[1]]))
    return pairs, list(dict.fromkeys(corpus.values()))


def large_pool() -> tuple[list[tuple[str, str]], list[str]]:
    pairs, texts = scifact_pairs()
    texts = list(texts)
    with open(SHARED / "stsb_en/stsb-en-train.csv", newline="") as fh:
        for a, b, score in csv.reader(fh):
            texts += [a, b]
            if float(score) >= 4:
                pairs.append((a, b))
    for name in ("stsb-en-dev.csv",):
        with open(SHARED / "stsb_en" / name, newline="") as fh:
            for a, b, _ in csv.reader(fh):
                texts += [a, b]
    for f in ("SICK_train.txt", "SICK_trial.txt"):
        with open(SHARED / "sick" / f) as fh:
            for row in list(csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]:
                texts += [row[1], row[2]]
    for f in ("train.csv",):
        with open(SHARED / "banking77" / f, newline="") as fh:
            texts += [r["text"] for r in csv.DictReader(fh)]
    with open(SHARED / "emotion/train.txt") as fh:
        texts += [line.rsplit(";", 1)[0] for line in list(fh)[1:]]
    for f in ("EN-ext_train.tsv", "DE_train.tsv"):
        with open(SHARED / "amazon_counterfactual" / f) as fh:
            texts += [line.split("\t")[0] for line in list(fh)[1:]]
    with open(SHARED / "mrpc/msr-para-train.tsv", encoding="utf-8-sig") as fh:
        for row in list(csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]:
            texts += [row[3], row[4]]
    for sub in ("msmarco", "dbpedia"):
        texts += [f"{x.get('title', '')} {x['text']}".strip() for x in _jsonl(SHARED / "beir_mini_agentset" / sub / "corpus.jsonl")]
    pool = list(dict.fromkeys(t.strip() for t in texts if t.strip()))
    return pairs, pool


def run_ours(pairs, pool) -> dict:
    from embed_core.mine.config import MineConfig
    from embed_core.mine.miner import mine_records
    from embed_core.model.embedding_cache import EmbeddingCache
    from embed_core.model.encoder import Encoder
    from embed_core.schema import Record

    t0 = time.perf_counter()
    enc = Encoder("default", max_length=256)
    grouped: dict[str, list[str]] = {}
    for q, p in pairs:
        grouped.setdefault(q, []).append(p)
    records = [Record(id=f"b:{i}", dataset="b", task="retrieval", query=q, positives=ps, source_ref=f"b:{i}")
               for i, (q, ps) in enumerate(grouped.items())]
    with tempfile.TemporaryDirectory() as tmp:
        cache = EmbeddingCache(tmp, enc.fingerprint, enc.dim, "float32")
        embed = lambda texts: cache.get_or_encode(texts, lambda t: enc.encode(t, batch_size=BATCH))  # noqa: E731
        out, stats = mine_records(records, embed, MineConfig(relative_margin=0.95, **WINDOW), corpus=pool, seed=42)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "negatives": {r.query: r.negatives for r in out}, "added": stats.negatives_added}


def run_peer(pairs, pool) -> dict:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    from embed_core.model.encoder import default_model_path

    t0 = time.perf_counter()
    model = SentenceTransformer(default_model_path(), device="cpu")
    ds = Dataset.from_dict({"anchor": [q for q, _ in pairs], "positive": [p for _, p in pairs]})
    res = mine_hard_negatives(ds, model, corpus=pool, relative_margin=0.05, sampling_strategy="top",
                              output_format="n-tuple", batch_size=BATCH, use_faiss=True, verbose=False, **WINDOW)
    wall = time.perf_counter() - t0
    negs: dict[str, list[str]] = {}
    for row in res:
        negs.setdefault(row["anchor"], [])
        negs[row["anchor"]] += [row[k] for k in row if k.startswith("negative")]
    negs = {q: list(dict.fromkeys(v)) for q, v in negs.items()}  # one output row per (anchor, positive)
    return {"wall_s": wall, "negatives": negs, "added": sum(len(v) for v in negs.values())}


def child(which: str, case: str) -> None:
    pairs, pool = scifact_pairs() if case == "scifact" else large_pool()
    res = (run_ours if which == "ours" else run_peer)(pairs, pool)
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    res["pool"], res["pairs"] = len(pool), len(pairs)
    print("RESULT " + json.dumps(res))


def measure(which: str, case: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", which, "--case", case], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{which}/{case} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[7:])


def overlap(ours: dict, peer: dict) -> float:
    shared = [q for q in peer["negatives"] if q in ours["negatives"] and peer["negatives"][q]]
    if not shared:
        return float("nan")
    return sum(len(set(ours["negatives"][q]) & set(peer["negatives"][q])) / len(set(peer["negatives"][q]))
               for q in shared) / len(shared)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=["scifact", "large", "all"], default="all")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.case)
        return
    if not (SHARED / "MANIFEST.md").exists():
        raise SystemExit(f"bench_mine needs {SHARED}")
    ratio = None
    for case in (["scifact", "large"] if args.case == "all" else [args.case]):
        ours, peer = measure("ours", case), measure("st", case)
        ratio = peer["wall_s"] / ours["wall_s"]
        print(f"[{case}] pool={ours['pool']} texts, {ours['pairs']} query-positive pairs")
        print(f"  embedpipe             wall {ours['wall_s']:7.1f} s  peak RSS {ours['peak_rss_mb']:7.0f} MB  negatives {ours['added']}")
        print(f"  sentence-transformers wall {peer['wall_s']:7.1f} s  peak RSS {peer['peak_rss_mb']:7.0f} MB  negatives {peer['added']}")
        print(f"  overlap of selected negatives (share of the peer's found by us): {overlap(ours, peer):.3f}")
        print(f"  speed ratio (peer / ours): {ratio:.2f}")
    print(f"RATIO mine_vs_sentence_transformers={ratio:.3f}")


if __name__ == "__main__":
    main()
