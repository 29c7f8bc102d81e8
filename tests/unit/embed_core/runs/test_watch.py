"""The data-watch verdict and report, built by embed_core from the changes and the stage results
(no Prefect server)."""

from embed_core.runs.watch import watch_report

CHANGE = [{"source": "stsb", "change": "changed", "old": "a", "new": "b"}]


def test_a_run_where_every_stage_was_a_cache_hit_says_so_and_counts_them():
    report = watch_report("demo", [], {"prepare": True, "mine": True}, 1.5)
    assert report.verdict == "no stage recomputed: all 2 stages were cache hits"
    assert report.all_cached and report.stages == {"prepare": "cache hit", "mine": "cache hit"}
    assert "Changed sources: none" in report.markdown


def test_a_changed_source_names_the_recomputed_stages_and_the_cache_hits():
    report = watch_report("demo", CHANGE, {"prepare": False, "train-stage1": True, "train-stage2": False}, 12.0)
    assert report.verdict == "recomputed prepare, train-stage2; cache hits: train-stage1"
    assert not report.all_cached
    assert report.markdown.startswith(f"# data-watch: demo\n\n**{report.verdict}** (12.0 s)\n\n")
    assert "Changed sources: stsb (changed)" in report.markdown
    assert "| train-stage1 | cache hit |\n" in report.markdown and "| prepare | computed |\n" in report.markdown


def test_a_run_where_everything_was_recomputed_lists_no_cache_hits():
    assert watch_report("demo", CHANGE, {"prepare": False}, 1.0).verdict == "recomputed prepare; cache hits: none"


def test_without_the_pipeline_the_verdict_counts_the_emitted_events_and_nothing_is_all_cached():
    report = watch_report("demo", CHANGE, None, 0.3)
    assert report.verdict == "1 source change(s) emitted as events; pipeline not run here"
    assert report.stages == {} and not report.all_cached
    assert report.markdown.endswith("| stage | result |\n|---|---|\n\n")
