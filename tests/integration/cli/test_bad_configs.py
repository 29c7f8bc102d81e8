"""Bad configs through the real CLI: exit 2, one stderr line naming the file (and line or key);
nothing runs and nothing is written."""

import pytest

from tests.helpers.cli_run import STS_SOURCE, in_process, write_config, write_sts_data

STS = STS_SOURCE


@pytest.fixture
def data(tmp_path):
    return write_sts_data(tmp_path)


def test_a_config_that_is_not_utf8_names_the_file_and_line(data, capfd):
    path = data / "latin1.yaml"
    path.write_bytes(b"run_name: r\n# caf\xe9\nprepare: {sources: []}\n")
    in_process(capfd, "prepare", "--config", path).assert_one_line_error(f"{path}:2: not UTF-8 (byte 0xe9)")


def test_config_pointing_at_a_directory_is_refused(data, capfd):
    in_process(capfd, "prepare", "--config", data).assert_one_line_error(f"{data}: is a directory")


def test_a_duplicated_yaml_key_is_an_error_not_a_silently_dropped_list(data, capfd):
    path = data / "dup.yaml"
    path.write_text("prepare:\n  sources:\n    - {name: a, kind: sts, path: sts.csv}\n"
                    "  sources:\n    - {name: b, kind: sts, path: sts.csv}\n")
    in_process(capfd, "prepare", "--config", path).assert_one_line_error(
        f"{path}:4: invalid YAML: duplicate key 'sources' (first at line 2)")


def test_yaml_merge_keys_may_override_what_they_merge(data):
    from embed_core.safe_yaml import read_yaml

    path = data / "merge.yaml"
    path.write_text("base: &b {lr: 1, steps: 2}\nstage: {<<: *b, lr: 3}\n")
    assert read_yaml(path)["stage"] == {"lr": 3, "steps": 2}


def test_a_two_character_delimiter_is_a_config_error(data, capfd):
    path = write_config(data, [dict(STS, format="delimited", delimiter=";;")])
    in_process(capfd, "prepare", "--config", path).assert_one_line_error(
        str(path), "prepare.sources[sts].delimiter", "one character")


@pytest.mark.parametrize("name", ["x" * 300, "bad\0name", "a/b", "..", ".hidden", "sp ace"])
def test_source_names_that_cannot_be_a_file_name_are_refused(data, capfd, name):
    path = write_config(data, [dict(STS, name=name)])
    line = in_process(capfd, "prepare", "--config", path).assert_one_line_error(
        "prepare.sources.0.name", "becomes a path")
    assert len(line) < 400 and "\0" not in line


def test_two_sources_with_one_name_are_an_error_not_a_silent_merge(data, capfd):
    path = write_config(data, [STS, dict(STS)])
    in_process(capfd, "prepare", "--config", path).assert_one_line_error(
        "prepare.sources", "two sources are named 'sts'")


def test_a_reversed_score_range_is_a_config_error(data, capfd):
    path = write_config(data, [dict(STS, params={"score_range": [5, 0]})])
    in_process(capfd, "prepare", "--config", path).assert_one_line_error("score_range", "min < max")


def test_an_alias_bomb_inside_a_free_form_mapping_is_refused_before_anything_runs(data, capfd):
    from tests.unit.embed_core.test_safe_yaml import BOMB

    path = data / "bomb.yaml"
    path.write_text(f"run_name: r\ndata_root: {data}\nprepare:\n  sources:\n"
                    "    - {name: s, kind: sts, path: sts.csv}\n"
                    "  label_map:\n    l0: &l0 [lol]\n" + "".join("    " + line + "\n" for line in BOMB.splitlines()))
    in_process(capfd, "prepare", "--config", path).assert_one_line_error(f"{path}:", "expands to more than")
    assert not (data / "runs").exists()


@pytest.mark.parametrize("kind", ["device", "fifo", "symlink loop"])
def test_a_config_that_is_no_regular_file_is_one_line(data, capfd, kind):
    import os

    path = data / "odd.yaml"
    if kind == "device":
        path = "/dev/zero"
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(path)
    expected = "Too many levels of symbolic links" if kind == "symlink loop" else "not a regular file"
    in_process(capfd, "prepare", "--config", path).assert_one_line_error(str(path), expected)
