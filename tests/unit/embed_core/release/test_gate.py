import pytest

from embed_core.release import gate


def test_a_task_fails_only_when_the_candidate_drops_more_than_its_tolerance():
    rows = gate.compare({"sts": 0.8010, "scifact": 0.6400, "banking": 0.7700},
                        {"sts": 0.8050, "scifact": 0.6500, "banking": 0.7600},
                        {"sts": "guard", "scifact": "guard", "banking": "probe"}, tolerance=0.5,
                        tolerances={"scifact": 1.5})
    # sts: 80.10 − 80.50 = −0.40 points, within 0.5; scifact: −1.00, within its own 1.5; banking: +1.00
    assert [(r.task, round(100 * r.delta, 2), r.passed) for r in rows] == [
        ("sts", -0.4, True), ("scifact", -1.0, True), ("banking", 1.0, True)]
    worse = gate.compare({"sts": 0.7990}, {"sts": 0.8050}, {"sts": "guard"}, tolerance=0.5)
    assert [r.passed for r in worse] == [False] and gate.failed(worse) == worse  # −0.60 points


def test_a_drop_of_exactly_the_tolerance_passes():
    assert gate.compare({"t": 0.795}, {"t": 0.800}, {"t": "guard"}, tolerance=0.5)[0].passed


def test_the_verdict_line_and_table_name_each_worse_task_in_points():
    rows = gate.compare({"sts": 0.0893, "probe": 0.5}, {"sts": 0.6507, "probe": 0.5},
                        {"sts": "guard", "probe": "probe"}, tolerance=0.5)
    assert gate.verdict_line(rows, 3, 2) == ("release gate failed: v3 scores below current v2 on 1 of 2 tasks: "
                                             "sts -56.14 (tolerance 0.50)")
    assert "| sts | 65.07 | 8.93 | -56.14 | 0.50 | **worse** |" in gate.table(rows)
    assert "| probe (probe) | 50.00 | 50.00 | +0.00 | 0.50 | ok |" in gate.table(rows)
    assert gate.verdict_line(rows[1:], 3, 2) == "release gate passed: v3 against current v2: probe +0.00"


def test_a_task_without_a_score_is_refused_naming_the_side_that_lacks_it():
    with pytest.raises(ValueError, match="no score for 'sts' \\(current release\\)"):
        gate.compare({"sts": 0.5}, {}, {"sts": "guard"}, tolerance=0.5)
