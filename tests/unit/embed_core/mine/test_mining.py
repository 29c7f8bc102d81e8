import json

import numpy as np
import pytest
from pydantic import ValidationError

from embed_core.stages import records_upstream
from embed_core.config import parse_config
from embed_core.mine.config import IndexConfig, MineConfig
from embed_core.mine.miner import mine_records
from embed_core.mine.run import run_mine
from embed_core.model.embedding_cache import EmbeddingCache
from embed_core.model.settings import ModelSettings
from embed_core.prepare.run import run_prepare
from embed_core.schema import Record


def unit(*xs):
    v = np.array(xs, dtype=np.float32)
    return v / np.linalg.norm(v)


def table_embed(vectors: dict[str, np.ndarray]):
    return lambda texts: np.stack([vectors[t] for t in texts])


def rec(i, q, pos, **kw):
    return Record(id=f"d:{i}", dataset="d", task=kw.pop("task", "retrieval"), query=q, positives=pos,
                  source_ref=f"f:{i}", **kw)


def test_window_excludes_query_positives_and_duplicates():
    # Query along x; candidates ranked by their x component.
    vecs = {"q": unit(1, 0, 0), "pos": unit(0.9, 0.1, 0), "Pos!": unit(0.95, 0.05, 0),  # normalised dup of pos
            "q ": unit(1, 0, 0),  # the query itself, as a document
            **{f"c{i}": unit(0.8 - 0.1 * i, 0.6, 0) for i in range(5)}}
    corpus = ["q ", "Pos!", *[f"c{i}" for i in range(5)]]
    s = MineConfig(range_min=1, range_max=3, num_negatives=4, relative_margin=None)
    out, stats = mine_records([rec(0, "q", ["pos"])], table_embed(vecs), s, corpus=corpus, seed=42)
    assert out[0].negatives == ["c1", "c2"]  # ranks 1 and 2 after removing q, pos and its duplicate
    assert out[0].negative_scores == pytest.approx([float(vecs["q"] @ vecs["c1"]), float(vecs["q"] @ vecs["c2"])], abs=1e-5)
    assert stats.too_few == 1 and "d:0 (2 of 4)" in stats.too_few_examples[0]


def test_the_negatives_are_counted_by_where_they_came_from_data_llm_or_this_mining():
    from embed_core.mine.miner import negative_sources

    vecs = {"q": unit(1, 0, 0), "pos": unit(0.9, 0.1, 0), "llm": unit(0.7, 0.7, 0), "own": unit(0.6, 0.8, 0),
            **{f"c{i}": unit(0.8 - 0.1 * i, 0.6, 0) for i in range(3)}}
    before = [rec(0, "q", ["pos"], negatives=["llm", "own"], origin="llm_negative"),
              rec(1, "q", ["pos"], negatives=["own"]), rec(2, "q", ["pos"])]
    s = MineConfig(range_min=0, range_max=10, num_negatives=2, relative_margin=None)
    after, _ = mine_records(before, table_embed(vecs), s, corpus=["c0", "c1", "c2"], seed=42)
    assert negative_sources(before, after) == {"original": 2, "llm": 1, "mined": sum(len(r.negatives) for r in after) - 3}
    assert negative_sources(before, after)["mined"] > 0
    assert negative_sources(before, before) == {"original": 2, "llm": 1, "mined": 0}


def test_relative_margin_removes_planted_near_duplicate_of_positive():
    q, pos = unit(1, 0.3, 0), unit(1, 0, 0)
    near_dup = unit(1, 0.01, 0.02)  # a paraphrase of the positive: scores ~ the positive
    vecs = {"q": q, "pos": pos, "near-dup": near_dup, **{f"n{i}": unit(0.5, 0.3, 0.5 + 0.2 * i) for i in range(4)}}
    corpus = ["pos", "near-dup", *[f"n{i}" for i in range(4)]]
    assert q @ near_dup >= 0.95 * (q @ pos)
    kept, _ = mine_records([rec(0, "q", ["pos"])], table_embed(vecs),
                           MineConfig(range_min=0, range_max=5, num_negatives=5, relative_margin=None), corpus, seed=42)
    assert "near-dup" in kept[0].negatives
    filtered, stats = mine_records([rec(0, "q", ["pos"])], table_embed(vecs),
                                   MineConfig(range_min=0, range_max=5, num_negatives=5, relative_margin=0.95), corpus,
                                   seed=42)
    assert "near-dup" not in filtered[0].negatives and filtered[0].negatives == [f"n{i}" for i in range(4)]
    assert len(stats.filtered_scores) == 1
    absolute, _ = mine_records([rec(0, "q", ["pos"])], table_embed(vecs),
                               MineConfig(range_min=0, range_max=5, num_negatives=5, relative_margin=None,
                                          absolute_margin=0.05), corpus, seed=42)
    assert "near-dup" not in absolute[0].negatives


def test_classification_negatives_come_from_other_labels_only():
    rng = np.random.default_rng(0)
    texts = [f"t{i}" for i in range(40)]
    labels = ["a" if i % 2 else "b" for i in range(40)]
    vecs = {t: unit(*rng.normal(size=8)) for t in texts}
    records = [rec(i, t, [texts[(i + 2) % 40]], task="classification", label=labels[i]) for i, t in enumerate(texts)]
    out, stats = mine_records(records, table_embed(vecs), MineConfig(range_min=0, range_max=10, relative_margin=None),
                              seed=42)
    assert stats.negatives_added == 4 * 40
    for r in out:
        assert r.negatives and all(labels[texts.index(n)] != r.label for n in r.negatives)
        assert r.negative_labels == [labels[texts.index(n)] for n in r.negatives]


def test_a_model_trained_with_instructions_mines_with_the_querys_instruction_and_plain_documents():
    # the plain query sits near c0, the instructed one near c1: only the instructed ranking is the trained model's
    vecs = {"q": unit(1, 0, 0), "Instruct: find\nQuery: q": unit(0, 1, 0), "pos": unit(0.7, 0.7, 0.1),
            "c0": unit(1, 0.05, 0.3), "c1": unit(0.05, 1, 0.3)}
    cfg = MineConfig(range_min=0, range_max=1, num_negatives=1, relative_margin=None)
    record = rec(0, "q", ["pos"], instruction="find")
    seen = []

    def embed(texts):
        seen.extend(texts)
        return table_embed(vecs)(texts)

    plain, _ = mine_records([record], embed, cfg, corpus=["c0", "c1"], seed=42)
    trained = ModelSettings(use_instructions=True)
    instructed, _ = mine_records([record], embed, cfg, corpus=["c0", "c1"], seed=42, settings=trained)
    assert plain[0].negatives == ["c0"] and instructed[0].negatives == ["c1"]
    assert "Instruct: find\nQuery: pos" not in seen  # documents of a retrieval record get no instruction
    without, _ = mine_records([record], embed, cfg, corpus=["c0", "c1"], seed=42, settings=ModelSettings())
    assert without[0].negatives == ["c0"]  # a model trained without instructions mines the plain texts


def test_classification_texts_get_the_instruction_on_both_sides_when_mined_with_instructions():
    records = [rec(i, f"t{i}", [f"t{(i + 2) % 6}"], task="classification", label="ab"[i % 2], instruction="intent")
               for i in range(6)]
    seen = []

    def embed(texts):
        seen.extend(texts)
        return np.stack([unit(1.0, len(t) % 3, 0.1) for t in texts])

    mine_records(records, embed, MineConfig(range_min=0, range_max=4, relative_margin=None), seed=42,
                 settings=ModelSettings(use_instructions=True))
    assert seen and all(t.startswith("Instruct: intent\nQuery: t") for t in seen)


def test_embedding_cache_persists_and_encodes_each_text_once(tmp_path):
    calls = []

    def encode(texts):
        calls.extend(texts)
        return np.stack([unit(len(t), 1.0, 2.0) for t in texts])

    cache = EmbeddingCache(tmp_path, "fp", 3)
    a = cache.get_or_encode(["x", "yy", "x"], encode)
    assert calls == ["x", "yy"] and np.allclose(a[0], a[2])
    again = EmbeddingCache(tmp_path, "fp", 3)  # a new process would see the same shards
    b = again.get_or_encode(["yy", "zzz"], encode)
    assert calls == ["x", "yy", "zzz"] and np.allclose(b[0], a[1], atol=1e-3)
    assert np.allclose(np.linalg.norm(b, axis=1), 1.0)


@pytest.mark.slow  # runs a whole stage on real models: make test, not make test-fast
@pytest.mark.shared_data
def test_scifact_mined_negatives_never_contain_a_qrel_positive(shared_data, tiny_model, tmp_path):
    cfg = parse_config({"data_root": str(shared_data), "prepare": {"sources": [
        {"name": "scifact", "kind": "beir", "path": "beir/scifact", "params": {"split": "train"}}]}})
    cfg = cfg.model_copy(update={"mine": MineConfig(model=str(tiny_model), max_length=64, relative_margin=None,
                                                    corpora={"scifact": "beir/scifact"}, batch_size=128)})
    run_prepare(cfg, tmp_path)
    manifest = run_mine(cfg, tmp_path, upstream=records_upstream(cfg, "mine"))
    import pyarrow.parquet as pq

    corpus = {}
    for line in open(shared_data / "beir/scifact/corpus.jsonl"):
        d = json.loads(line)
        corpus[d["_id"]] = f"{d['title'].strip()} {d['text'].strip()}".strip()
    queries = {json.loads(x)["_id"]: json.loads(x)["text"] for x in open(shared_data / "beir/scifact/queries.jsonl")}
    qrel_pos = {}
    for line in list(open(shared_data / "beir/scifact/qrels/train.tsv"))[1:]:
        qid, did, score = line.split()
        if float(score) > 0:
            qrel_pos.setdefault(queries[qid], set()).add(corpus[did])
    rows = pq.read_table(tmp_path / "mine/scifact.parquet").to_pylist()
    assert len(rows) == 808 and sum(len(r["negatives"]) for r in rows) >= 3 * 808  # 809 queries, 1 duplicate
    for r in rows:
        assert not set(r["negatives"]) & qrel_pos[r["query"]], r["id"]
        assert len(r["negative_scores"]) == len(r["negatives"])
    (ds,) = [d for d in manifest["counts"]["datasets"] if d["dataset"] == "scifact"]
    assert ds["index"]["factory"] == "Flat" and ds["index"]["size"] == len(set(corpus.values()))

    second = run_mine(cfg, tmp_path, upstream=records_upstream(cfg, "mine"))  # unchanged inputs: every embedding comes from the cache
    assert second["counts"]["texts_encoded"] == 0
    assert pq.read_table(tmp_path / "mine/scifact.parquet").to_pylist() == rows


def test_too_few_are_reported_and_padded_only_when_asked():
    vecs = {"q": unit(1, 0, 0), "pos": unit(0.9, 0.1, 0), **{f"c{i}": unit(0.5, 0.5, 0.1 * i) for i in range(3)},
            **{f"far{i}": unit(-1, 0.1 * i, 1) for i in range(6)}}
    corpus = ["pos", "c0", "c1", "c2", *[f"far{i}" for i in range(6)]]
    s = MineConfig(range_min=0, range_max=2, num_negatives=4, relative_margin=None)
    out, stats = mine_records([rec(0, "q", ["pos"])], table_embed(vecs), s, corpus, seed=42)
    assert len(out[0].negatives) == 2 and stats.too_few == 1 and stats.padded == 0
    s = s.model_copy(update={"pad_random": True})
    out, stats = mine_records([rec(0, "q", ["pos"])], table_embed(vecs), s, corpus, seed=42)
    assert len(out[0].negatives) == 4 and stats.padded == 2 and "pos" not in out[0].negatives
    assert len(out[0].negative_scores) == 4


def _pq_exact_corpus(n: int = 700, seed: int = 0):
    """Unit vectors whose coordinates are all ±1/4: every 2-d slice takes one of 4 values, so PQ8x4
    (16 centroids per 2-d slice) stores them exactly and every index type returns exact scores."""
    rng = np.random.default_rng(seed)
    signs = list(dict.fromkeys(tuple(int(v) for v in rng.integers(0, 2, size=16)) for _ in range(2 * n)))[:n]
    vecs = {f"c{i}": (np.array(s, dtype=np.float32) * 2 - 1) / 4 for i, s in enumerate(signs)}
    return vecs, rng


@pytest.mark.parametrize("factory, on_disk", [("HNSW32", False), ("IVF4,Flat", False), ("PQ8x4", False),
                                              ("IVF4,Flat", True)])
def test_every_index_factory_keeps_the_window_and_margin_rules_of_the_flat_index(factory, on_disk, tmp_path):
    vecs, rng = _pq_exact_corpus()
    corpus = list(vecs)
    records = []
    matrix = np.stack([vecs[t] for t in corpus])
    while len(records) < 30:
        q = unit(*rng.normal(size=16))
        scores = np.sort(matrix @ q)[::-1]
        # PQ's scores may differ from exact ones by up to ~2e-3 (how its k-means settles depends on the
        # CPU's float paths): keep queries whose decisions do not hinge on such a difference — no two
        # of the top 12 scores and no score and the margin (0.95 x the positive's) closer than 5e-3
        near_tie = np.diff(scores[:12]).max() > -5e-3 or np.abs(scores[:40] - 0.95 * scores[3]).min() < 5e-3
        if near_tie:
            continue
        i = len(records)
        vecs[f"q{i}"] = q
        ranked = sorted(corpus, key=lambda t: -float(q @ vecs[t]))
        records.append(rec(i, f"q{i}", [ranked[3]]))  # a positive ranked 4th: the margin has work to do
    rules = dict(range_min=2, range_max=8, num_negatives=4, relative_margin=0.95)
    index = dict(nprobe=4, train_size=700, add_chunk_size=100)
    flat, flat_stats = mine_records(records, table_embed(vecs), MineConfig(**rules, index=index), corpus, seed=42)
    other, stats = mine_records(records, table_embed(vecs),
                                MineConfig(**rules, index={**index, "factory": factory, "on_disk": on_disk}), corpus,
                                index_dir=tmp_path, seed=42)
    assert flat_stats.filtered_scores and stats.index["factory"] == factory and stats.index["size"] == len(corpus)
    if on_disk:  # the lists were merged from one shard per add chunk into a file the index maps
        assert stats.index["on_disk"]["shards"] == 7 and (tmp_path / "lists.ivfdata").stat().st_size > 0
    assert [r.negatives for r in other] == [r.negatives for r in flat]
    flat_scores = [x for r in flat for x in r.negative_scores]
    assert [x for r in other for x in r.negative_scores] == pytest.approx(flat_scores, abs=2e-3)
    assert len(flat_scores) >= 20  # the window kept negatives for many queries
    assert len(stats.filtered_scores) == len(flat_stats.filtered_scores)


def test_a_bad_index_factory_or_too_many_clusters_is_a_config_error_naming_the_setting():
    from embed_core.errors import ConfigError

    vecs, _ = _pq_exact_corpus(200)
    vecs["q"] = unit(*np.ones(16))
    with pytest.raises(ConfigError, match=r"mine.index.factory.*'IVF9,Nonsense'"):
        mine_records([rec(0, "q", ["c1"])], table_embed(vecs), MineConfig(index={"factory": "IVF9,Nonsense"}), list(vecs),
                     seed=42)
    with pytest.raises(ConfigError, match=r"64 clusters need at least 2496 training vectors.*201"):
        mine_records([rec(0, "q", ["c1"])], table_embed(vecs), MineConfig(index={"factory": "IVF64,Flat"}), list(vecs),
                     seed=42)
    with pytest.raises(ConfigError, match=r"mine.index.on_disk.*'HNSW32'"):
        # the config refuses this combination (below); the miner still names it if handed one unchecked
        unchecked = MineConfig.model_construct(index=IndexConfig.model_construct(factory="HNSW32", on_disk=True))
        mine_records([rec(0, "q", ["c1"])], table_embed(vecs), unchecked, list(vecs), seed=42)
    with pytest.raises(ValidationError, match=r"on_disk.*'PQ16' is no IVF index"):
        MineConfig.model_validate({"index": {"factory": "PQ16", "on_disk": True}})


def test_the_pool_is_encoded_in_chunks_never_all_at_once():
    vecs, rng = _pq_exact_corpus(500)
    vecs["q"] = unit(*rng.normal(size=16))
    calls = []

    def embed(texts):
        calls.append(len(texts))
        return np.stack([vecs[t] for t in texts])

    mine_records([rec(0, "q", ["c1"])], embed, MineConfig(index={"add_chunk_size": 128}, relative_margin=None),
                 [t for t in vecs if t != "q"], seed=42)
    assert max(calls) <= 128 and sum(calls) >= 500


@pytest.mark.slow  # runs a whole stage on real models: make test, not make test-fast
@pytest.mark.shared_data
def test_the_mine_stage_keeps_an_on_disk_index_in_its_scratch_directory_and_removes_it(shared_data, tiny_model,
                                                                                          tmp_path):
    cfg = parse_config({"data_root": str(shared_data), "prepare": {"sources": [
        {"name": "scifact", "kind": "beir", "path": "beir/scifact", "params": {"split": "train"}}]}})
    cfg = cfg.model_copy(update={"mine": MineConfig.model_validate({
        "model": str(tiny_model), "max_length": 32, "relative_margin": None, "corpora": {"scifact": "beir/scifact"}, "batch_size": 256,
        "index": {"factory": "IVF16,Flat", "on_disk": True, "add_chunk_size": 2000, "train_size": 1000}})})
    run_prepare(cfg, tmp_path)
    manifest = run_mine(cfg, tmp_path, upstream=records_upstream(cfg, "mine"))
    (ds,) = [d for d in manifest["counts"]["datasets"] if d["dataset"] == "scifact"]
    assert ds["index"]["on_disk"]["shards"] == 3 and ds["index"]["on_disk"]["bytes"] > 5183 * 32 * 4
    assert ds["index"]["size"] == 5183 and ds["negatives_added"] >= 3 * 808
    assert ds["negatives_by_source"] == {"original": 0, "llm": 0, "mined": ds["negatives_added"]}
    from embed_core.mine.stage import format_counts

    assert f"negatives by source: scifact original 0, llm 0, mined {ds['negatives_added']}" in format_counts(manifest)
    assert not list(tmp_path.rglob("*.ivfdata")) and not list(tmp_path.rglob("shard-*.index"))
