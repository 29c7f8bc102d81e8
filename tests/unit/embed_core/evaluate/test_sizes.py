"""Scores by embedding size and precision (``embed_core.evaluate.sizes``): the quantized search
against hand-worked rankings, the bytes per vector, and the sizes table of a real evaluation."""

import numpy as np
import pyarrow.parquet as pq
import pytest

from embed_core.errors import ConfigError
from embed_core.evaluate.sizes import QuantizedIndex, bytes_per_vector, cut, int8_ranges, quantized, sizes_of, variants
from tests.unit.embed_core.evaluate.test_evaluation import LOCAL_TASKS, _config, local_data  # noqa: F401


def test_bytes_per_vector_are_four_per_float_one_per_int8_and_one_bit_per_binary_dimension():
    assert [bytes_per_vector(64, p) for p in ("float32", "int8", "ubinary")] == [256, 64, 8]
    assert bytes_per_vector(12, "ubinary") == 2  # bits packed into whole bytes


def test_a_cut_keeps_the_first_coordinates_normalised_again():
    emb = np.array([[0.6, 0.0, 0.8], [0.0, 0.6, 0.8]], dtype=np.float32)
    assert np.allclose(cut(emb, 2), [[1.0, 0.0], [0.0, 1.0]])
    assert cut(emb, 3) is not None and np.allclose(cut(emb, 3), emb)


def test_binary_search_ranks_by_hamming_distance_and_rescoring_restores_the_float_order():
    docs = np.array([[0.1, 0.1, 0.1, 0.1], [0.9, 0.9, -0.1, -0.1], [-0.5, -0.5, -0.5, -0.5]], dtype=np.float32)
    query = np.array([[0.9, 0.9, 0.05, -0.1]], dtype=np.float32)
    index = QuantizedIndex("ubinary")
    index.add_documents(docs, ["d0", "d1", "d2"])
    scores, order = index.search(query, top_k=3)
    # query bits 1110: Hamming 1 to d0 (1111) and d1 (1100), 3 to d2: ±1 dot = 4 − 2·hamming = 2, 2, −2
    assert order == [[0, 1, 2]] and scores == [[2.0, 2.0, -2.0]]
    rescored = QuantizedIndex("ubinary", rescore_multiplier=3)
    rescored.add_documents(docs, ["d0", "d1", "d2"])
    scores, order = rescored.search(query, top_k=2)
    # float query · 0/1 bits: d0 0.9+0.9+0.05−0.1 = 1.75, d1 0.9+0.9 = 1.8: d1 first
    assert order == [[1, 0]] and scores[0] == pytest.approx([1.8, 1.75])


def test_binary_candidates_rescored_with_int8_or_float32_vectors_rank_by_those_vectors_not_the_bits():
    # per-dimension range [-128, 127]: int8 codes equal the values, so int8 rescoring equals float32 here
    docs = np.array([[127.0, -128.0], [1.0, 1.0], [-128.0, 127.0]], dtype=np.float32)
    query = np.array([[1.0, 0.1]], dtype=np.float32)
    found = {}
    for source in ("quantized", "int8", "float32"):
        index = QuantizedIndex("ubinary", rescore_multiplier=3, rescore_with=source)
        index.add_documents(docs, ["a", "b", "c"])
        found[source] = index.search(query, top_k=2)
    # bits a 10, b 11, c 01: the query against the bits gives a 1.0, b 1.1, c 0.1
    assert found["quantized"][1] == [[1, 0]] and found["quantized"][0][0] == pytest.approx([1.1, 1.0])
    # against the vectors: a 127 − 12.8 = 114.2, b 1.1, c −128 + 12.7 = −115.3
    for source in ("int8", "float32"):
        assert found[source][1] == [[0, 1]] and found[source][0][0] == pytest.approx([114.2, 1.1], abs=1e-4)


def test_only_rescore_top_k_times_the_multiplier_candidates_are_rescored_and_the_rest_follow_in_hamming_order():
    # query bits 1110; Hamming distances d1 0, d0 1, d2 2, d3 3; by the float vectors d2 is far the best
    docs = np.array([[0.1, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, -0.2], [3.0, 3.0, -0.1, 0.1], [-1.0, -1.0, -1.0, -1.0]],
                    dtype=np.float32)
    query = np.array([[1.0, 1.0, 1.0, -0.1]], dtype=np.float32)
    found = {}
    for multiplier in (1, 3):
        index = QuantizedIndex("ubinary", rescore_multiplier=multiplier, rescore_with="float32", rescore_top_k=1)
        index.add_documents(docs, ["d0", "d1", "d2", "d3"])
        found[multiplier] = index.search(query, top_k=4)
    # ×1: only d1 is rescored (0.2·3 + 0.02 = 0.62); d0, d2, d3 follow in Hamming order, scored below it
    assert found[1][1] == [[1, 0, 2, 3]] and found[1][0][0] == pytest.approx([0.62, -0.38, -1.38, -2.38])
    # ×3: d1, d0, d2 are rescored (0.62, 0.3 − 0.01 = 0.29, 6 − 0.1 − 0.01 = 5.89): d2 first; d3 below
    assert found[3][1] == [[2, 1, 0, 3]] and found[3][0][0] == pytest.approx([5.89, 0.62, 0.29, -0.71])


def test_rescoring_with_other_vectors_without_a_multiplier_is_refused_at_load():
    from embed_core.evaluate.config import EvaluateConfig

    with pytest.raises(ValueError, match="rescore_with 'int8' needs rescore_multiplier"):
        EvaluateConfig(tasks=LOCAL_TASKS[:1], precisions=["float32", "ubinary"], rescore_with="int8")
    assert EvaluateConfig(tasks=LOCAL_TASKS[:1], precisions=["ubinary"], rescore_multiplier=4,
                          rescore_with="int8").rescore_with == "int8"


def test_the_sizes_table_names_the_vectors_a_rescored_column_rescored_with():
    from embed_core.evaluate.report import sizes_tables

    row = {"model": "m", "task": "T", "metric": "ndcg_at_10", "dim": 8, "precision": "ubinary", "rescore": 4,
           "bytes_per_vector": 1, "value": 0.5}
    table = sizes_tables([{**row, "rescore_with": "int8"}, {**row, "rescore_with": "quantized", "value": 0.25},
                          {**row, "rescore": 0, "rescore_with": None, "value": 0.125}])
    assert "| model | dims | ubinary rescored ×4 with int8 | ubinary rescored ×4 | ubinary |" in table
    assert "| m | 8 | 50.00 (1 B) | 25.00 (1 B) | 12.50 (1 B) |" in table


def test_int8_codes_come_from_the_corpus_ranges_and_rank_by_their_inner_product():
    # a corpus whose per-dimension range is [-128, 127]: buckets of width 1, so a code is the value itself
    docs = np.array([[-128.0, 0.0], [127.0, 127.0], [0.0, -128.0]], dtype=np.float32)
    ranges = int8_ranges(docs)
    assert ranges.tolist() == [[-128.0, -128.0], [127.0, 127.0]]
    assert quantized(docs, "int8", ranges).tolist() == docs.tolist()
    assert quantized(np.array([[300.0, -300.0]], dtype=np.float32), "int8", ranges).tolist() == [[127.0, -128.0]]
    index = QuantizedIndex("int8")
    index.add_documents(docs, ["a", "b", "c"])
    scores, order = index.search(np.array([[127.0, 127.0]], dtype=np.float32), top_k=3)
    # inner products of the codes: a −128·127, b 2·127², c −128·127 (ties keep the corpus order)
    assert order == [[1, 0, 2]] and scores == [[2 * 127 * 127, -128 * 127, -128 * 127]]


def test_sizes_default_to_the_trained_dims_and_a_size_above_the_model_is_refused():
    assert sizes_of(None, [32, 16, 8], 32, "m") == [32, 16, 8]
    assert sizes_of([], [32, 16, 8], 32, "m") == [32]
    assert sizes_of([8], [], 32, "m") == [32, 8]
    with pytest.raises(ConfigError, match=r"evaluate.dims: \[64\] above model m's embedding size 32"):
        sizes_of([64], [], 32, "m")
    assert variants([32, 8], ["float32", "ubinary"], 4, retrieval=True) == [
        (32, "float32", 0), (32, "ubinary", 0), (32, "ubinary", 4), (8, "float32", 0), (8, "ubinary", 0), (8, "ubinary", 4)]
    assert (8, "ubinary", 4) not in variants([32, 8], ["float32", "ubinary"], 4, retrieval=False)


@pytest.mark.slow
def test_evaluation_at_sizes_and_precisions_gives_a_table_per_task_with_bytes_per_vector(local_data, tmp_path,
                                                                                        tiny_model):
    from embed_core.evaluate.report import compare_runs
    from embed_core.evaluate.run import run_evaluate

    config = _config(local_data, tmp_path / "runs", LOCAL_TASKS[:2], base_model=str(tiny_model), dims=[16, 8],
                     precisions=["float32", "int8", "ubinary"], rescore_multiplier=2)
    run_dir = tmp_path / "runs/ev"
    run_evaluate(config, run_dir)
    rows = pq.read_table(run_dir / "evaluate/sizes.parquet").to_pylist()
    main = {r["task"]: r["value"] for r in pq.read_table(run_dir / "evaluate/results.parquet").to_pylist() if r["main"]}
    for task, rescored in (("LocalSTS", False), ("LocalRetrieval", True)):
        mine = {(r["dim"], r["precision"], r["rescore"]): r for r in rows if r["task"] == task}
        assert set(mine) == set(variants([32, 16, 8], ["float32", "int8", "ubinary"], 2 if rescored else None,
                                         retrieval=rescored))
        assert {k: r["bytes_per_vector"] for k, r in mine.items() if k[0] == 16} == {
            k: b for k, b in {(16, "float32", 0): 64, (16, "int8", 0): 16, (16, "ubinary", 0): 2,
                              (16, "int8", 2): 16, (16, "ubinary", 2): 2}.items() if k in mine}
        assert mine[(32, "float32", 0)]["value"] == main[task]  # the full float32 row is the task's main score
        assert {r["rescore_with"] for r in mine.values()} == ({None, "quantized"} if rescored else {None})
        assert all(-1 <= r["value"] <= 1 for r in mine.values())
    report = (run_dir / "evaluate/report.md").read_text()
    assert "### LocalSTS (cosine_spearman)" in report
    assert "| model | dims | float32 | int8 | int8 rescored ×2 | ubinary | ubinary rescored ×2 |" in report
    ubinary = next(r for r in rows if (r["task"], r["dim"], r["precision"], r["rescore"]) == ("LocalRetrieval", 8, "ubinary", 2))
    assert f"{100 * ubinary['value']:.2f} (1 B) |" in report.split("| base | 8 |")[-1].splitlines()[0]
    assert (run_dir / "evaluate/plots/sizes.png").exists()
    md = compare_runs([run_dir], tmp_path / "cmp").read_text()
    assert "### LocalRetrieval (ndcg_at_10)" in md and "| ev/base | 16 | " in md and "(16 B)" in md


def test_binary_search_with_rescoring_returns_what_sentence_transformers_semantic_search_faiss_returns():
    pytest.importorskip("faiss")
    from sentence_transformers.util.quantization import quantize_embeddings, semantic_search_faiss

    rng = np.random.default_rng(0)
    corpus = rng.normal(size=(200, 64)).astype(np.float32)
    corpus /= np.linalg.norm(corpus, axis=1, keepdims=True)
    queries = rng.normal(size=(5, 64)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    theirs, _ = semantic_search_faiss(queries, corpus_embeddings=quantize_embeddings(corpus, "ubinary"),
                                      corpus_precision="ubinary", top_k=5, rescore=True, rescore_multiplier=4)
    index = QuantizedIndex("ubinary", rescore_multiplier=4)
    index.add_documents(corpus, [str(i) for i in range(200)])
    scores, order = index.search(queries, top_k=5)
    assert order == [[hit["corpus_id"] for hit in hits] for hits in theirs]
    assert np.allclose(scores, [[hit["score"] for hit in hits] for hits in theirs], atol=1e-5)


def test_reranking_a_candidate_list_returns_positions_in_that_list():
    index = QuantizedIndex("ubinary", rescore_multiplier=2)
    index.add_documents(np.array([[1.0, 1.0], [-1.0, -1.0], [1.0, -1.0]], dtype=np.float32), ["a", "b", "c"])
    scores, order = index.search(np.array([[0.9, 0.1]], dtype=np.float32), top_k=2, top_ranked={"q": ["b", "a"]},
                                 query_idx_to_id={0: "q"})
    # only b and a compete: a (bits 11) scores 0.9 + 0.1 against the float query, b (00) 0
    assert order == [[1, 0]] and scores[0] == pytest.approx([1.0, 0.0])
