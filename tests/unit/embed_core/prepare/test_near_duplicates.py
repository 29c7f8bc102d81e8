"""Near-duplicate contamination exclusion (prepare.near_duplicates): training records whose text is
nearly an evaluation or dev text leave training, with a report of each; off, nothing changes."""

import hashlib
import json

import pyarrow.parquet as pq
import pytest

from embed_core.artifacts import read_manifest, read_records
from embed_core.config import parse_config
from embed_core.errors import ConfigError
from embed_core.prepare.near_dup import NearDuplicateIndex, jaccard, shingles
from embed_core.prepare.run import input_fingerprint, run_prepare
from embed_core.prepare.stage import format_counts, near_duplicates_markdown
from embed_core.schema import Record

TEST_QUERY = "How can I reset the password of my online banking account from the mobile app"
PASSAGE = ("Contamination exclusion removes training samples that are highly similar to the test sets, "
           "so that scores measure generalisation rather than memorisation of evaluation texts.")


def _csv(path, rows):
    path.write_text("sentence1\tsentence2\tscore\n" + "".join(f"{a}\t{b}\t{s}\n" for a, b, s in rows))


def _config(tmp_path, near=None, **source):
    prepare = {"sources": [{"name": "sts", "kind": "sts", "path": "train.tsv", "delimiter": "\t", **source}],
               "contamination": [{"name": "sts-test", "kind": "sts", "path": "test.tsv", "delimiter": "\t"}]}
    if near is not None:
        prepare["near_duplicates"] = near
    return parse_config({"data_root": str(tmp_path), "prepare": prepare})


def _prepare(tmp_path, train_rows, test_rows, near=None, **source):
    _csv(tmp_path / "train.tsv", train_rows)
    _csv(tmp_path / "test.tsv", test_rows)
    cfg = _config(tmp_path, near, **source)
    manifest = run_prepare(cfg, tmp_path / "run")
    train = read_records(tmp_path / "run", "prepare").get("sts.parquet")
    return cfg, manifest, sorted({r["query"] for r in train.to_pylist()} if train is not None else set())


def _dropped(tmp_path):
    return pq.read_table(tmp_path / "run/prepare/_near_duplicates.parquet").to_pylist()


TRAIN = [(TEST_QUERY.replace("mobile", "banking"), "Resetting a forgotten login", 4),
         ("The cat sat on the warm windowsill all afternoon long", "A cat rests in the sun", 3)]
TEST = [(TEST_QUERY, "A sentence nobody trains on", 2)]


def test_a_test_query_with_one_word_changed_is_dropped_and_an_unrelated_text_is_kept(tmp_path):
    _, manifest, kept = _prepare(tmp_path, TRAIN, TEST, near={})
    # each sts row gives a record per direction: both records of the first row hold the near duplicate
    assert kept == ["A cat rests in the sun", "The cat sat on the warm windowsill all afternoon long"]
    counts = manifest["counts"]["datasets"][0]
    assert (counts["excluded_near_duplicate"], counts["excluded_contamination"]) == (2, 0)
    assert manifest["counts"]["totals"]["excluded_near_duplicate"] == 2
    assert "near duplicates 2" in format_counts(manifest)


def test_a_test_passage_rewrapped_with_a_hyphenated_line_break_is_dropped(tmp_path):
    rewrapped = PASSAGE.replace("highly ", "highly\n   ").replace("generalisation", "generali-\nsation")
    rows = [{"query": "What does contamination exclusion do", "pos": [rewrapped]},
            {"query": "Why hold out a test set", "pos": ["It keeps scores honest"]}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _csv(tmp_path / "test.tsv", [(PASSAGE, "Some query", 1)])
    cfg = parse_config({"data_root": str(tmp_path), "prepare": {
        "sources": [{"name": "fe", "kind": "flagembedding", "path": "train.jsonl"}],
        "contamination": [{"name": "sts-test", "kind": "sts", "path": "test.tsv", "delimiter": "\t"}],
        "near_duplicates": {}}})
    manifest = run_prepare(cfg, tmp_path / "run")
    kept = read_records(tmp_path / "run", "prepare")["fe.parquet"].to_pylist()
    assert [r["positives"] for r in kept] == [["It keeps scores honest"]]
    assert manifest["counts"]["totals"]["excluded_contamination"] == 0  # not equal after normalisation
    assert [(r["field"], r["text"], r["nearest_text"]) for r in _dropped(tmp_path)] == [
        ("positives[0]", rewrapped, PASSAGE)]


def test_a_hand_computed_jaccard_decides_exactly_at_the_threshold(tmp_path):
    # character bigrams of "abcde" {ab, bc, cd, de} and "abcdx" {ab, bc, cd, dx}: 3 shared of 5 → 0.6
    assert jaccard(shingles("abcde", 2), shingles("abcdx", 2)) == 3 / 5
    train, test = [("abcdx", "zzzzzzzz", 1)], [("abcde", "qqqqqqqq", 1)]
    _, manifest, kept = _prepare(tmp_path, train, test, near={"threshold": 0.6, "shingle": 2})
    assert kept == [] and _dropped(tmp_path)[0]["jaccard"] == pytest.approx(0.6)
    _, manifest, kept = _prepare(tmp_path, train, test, near={"threshold": 0.61, "shingle": 2})
    assert kept == ["abcdx", "zzzzzzzz"] and manifest["counts"]["totals"]["excluded_near_duplicate"] == 0


def test_the_dropped_records_file_names_the_nearest_evaluation_text_and_its_set(tmp_path):
    near_miss = TEST_QUERY.replace("mobile", "banking")
    farther = TEST_QUERY.replace("How can", "How could")  # also over a threshold of 0.6, but less similar
    assert jaccard(shingles(near_miss, 5), shingles(farther, 5)) >= 0.6
    _prepare(tmp_path, TRAIN, [(farther, "Another held-out sentence", 1), *TEST], near={"threshold": 0.6})
    rows = [r for r in _dropped(tmp_path) if r["field"] == "query"]
    assert len(rows) == 1
    row = rows[0]
    assert (row["text"], row["nearest_text"], row["contamination_set"]) == (near_miss, TEST_QUERY, "sts-test")
    assert row["source_ref"] == "train.tsv:2" and row["dataset"] == "sts"
    assert row["jaccard"] == pytest.approx(jaccard(shingles(near_miss, 5), shingles(TEST_QUERY, 5)))
    manifest = read_manifest(tmp_path / "run", "prepare")
    markdown = near_duplicates_markdown(tmp_path / "run/prepare", manifest)
    assert "Near duplicates dropped: 2" in markdown and TEST_QUERY in markdown


def test_a_training_pair_that_nearly_repeats_a_dev_pair_is_dropped(tmp_path):
    dev_pair = ("A man is playing a large wooden guitar on the stage of the old concert hall",
                "A man plays a big wooden guitar on a stage in the old concert hall")
    (tmp_path / "dev.tsv").write_text(f"sentence1\tsentence2\tscore\n{dev_pair[0]}\t{dev_pair[1]}\t4\n")
    train = [(dev_pair[1].replace("a stage", "the stage"), dev_pair[0], 4),  # the dev pair, reversed, a word changed
             (dev_pair[0], "A woman is slicing an onion", 0)]                 # one dev sentence alone is no dev pair
    _, manifest, kept = _prepare(tmp_path, train, [("unrelated", "texts", 1)], near={}, dev_path="dev.tsv")
    assert kept == [dev_pair[0], "A woman is slicing an onion"]
    assert {r["contamination_set"] for r in _dropped(tmp_path)} == {"dev:sts"}
    assert manifest["counts"]["datasets"][0]["excluded_near_duplicate"] == 2


def test_a_dev_record_nearly_repeating_a_test_text_is_not_a_dev_record(tmp_path):
    (tmp_path / "dev.tsv").write_text("sentence1\tsentence2\tscore\n"
                                      f"{TEST_QUERY.replace('mobile', 'banking')}\tA dev answer\t3\n"
                                      "A dev sentence of its own\tAnother dev sentence\t2\n")
    _prepare(tmp_path, TRAIN[1:], TEST, near={}, dev_path="dev.tsv")
    dev = read_records(tmp_path / "run", "prepare", kind="dev_records")["dev/sts.parquet"].to_pylist()
    assert {r["source_ref"] for r in dev} == {"dev.tsv:3"}


def test_a_threshold_outside_zero_to_one_is_a_config_error_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"prepare\.near_duplicates\.threshold"):
        _config(tmp_path, near={"threshold": 1.5})
    with pytest.raises(ConfigError, match=r"prepare\.near_duplicates\.shingles"):
        _config(tmp_path, near={"shingles": 3})  # a misspelt key is refused, not ignored


def test_with_near_duplicates_off_nothing_changes(tmp_path):
    cfg, manifest, kept = _prepare(tmp_path, TRAIN, TEST)
    assert len(kept) == 4  # the one-word change stays in training: only exact (normalised) matches leave
    assert "excluded_near_duplicate" not in manifest["counts"]["datasets"][0]
    assert not (tmp_path / "run/prepare/_near_duplicates.parquet").exists()
    assert "near" not in format_counts(manifest)
    # the config part of the cache key is what it was before the option existed
    before = hashlib.sha256(json.dumps({k: v for k, v in cfg.prepare.model_dump(mode="json").items()
                                        if k != "near_duplicates"}, sort_keys=True, separators=(",", ":"))
                            .encode()).hexdigest()
    off = input_fingerprint(cfg).inputs["config"]
    assert off == before and input_fingerprint(_config(tmp_path, near={})).inputs["config"] != off


def test_an_index_proposes_nothing_for_an_empty_text_or_an_empty_index():
    index = NearDuplicateIndex(0.8, 5, 64)
    rec = Record(id="r", dataset="d", task="sts", query="anything", positives=["else"], positive_scores=[1.0],
                 source_ref="f.csv:2")
    assert index.match(rec) is None
    index.add_text("   ", "set")  # normalises to nothing: not indexed
    assert len(index) == 0
