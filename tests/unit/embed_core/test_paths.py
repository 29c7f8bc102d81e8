"""Containment helpers: a walk or a lookup under a root never follows a link out of it."""

import pytest

from embed_core.paths import NotAFileError, OutsideRootError, file_problem, files_within, regular_file, resolve_within


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("a")
    (root / "sub/b.txt").write_text("b")
    (tmp_path / "outside.txt").write_text("secret")
    (tmp_path / "outside-dir").mkdir()
    (tmp_path / "outside-dir/c.txt").write_text("secret")
    return root


def test_files_within_lists_regular_files_and_links_that_stay_inside(tree):
    (tree / "link-to-a").symlink_to("a.txt")
    (tree / "sub-again").symlink_to("sub")  # a link to a directory inside: skipped, its files are listed once
    (tree / "dangling").symlink_to("nowhere")
    assert [p.relative_to(tree).as_posix() for p in files_within(tree)] == ["a.txt", "link-to-a", "sub/b.txt"]


@pytest.mark.parametrize("target", ["outside.txt", "outside-dir"])
def test_a_link_out_of_the_root_is_an_error_naming_link_and_target(tree, target):
    (tree / "sub/leak").symlink_to(tree.parent / target)
    with pytest.raises(OutsideRootError, match=f"{tree / 'sub/leak'}: a symbolic link to {tree.parent / target}, "
                                               f"outside {tree}"):
        files_within(tree)


def test_a_relative_link_climbing_out_is_caught_too(tree):
    (tree / "sub/up").symlink_to("../../outside.txt")
    with pytest.raises(OutsideRootError):
        resolve_within(tree, "sub/up")
    assert resolve_within(tree, "sub/b.txt") == (tree / "sub/b.txt").resolve()


def test_a_root_that_is_itself_a_link_is_fine(tree, tmp_path):
    alias = tmp_path / "alias"
    alias.symlink_to(tree)
    assert [p.name for p in files_within(alias)] == ["a.txt", "b.txt"]
    assert resolve_within(alias, "a.txt") == (tree / "a.txt").resolve()


def test_a_missing_root_has_no_files(tmp_path):
    assert files_within(tmp_path / "nope") == []


def test_only_a_regular_file_passes_the_file_rule_anything_else_is_one_line_naming_it(tmp_path):
    import os

    (tmp_path / "f.txt").write_text("x")
    (tmp_path / "d.json").mkdir()
    os.mkfifo(tmp_path / "pipe.csv")
    (tmp_path / "link.txt").symlink_to(tmp_path / "f.txt")
    assert regular_file(tmp_path / "f.txt") == tmp_path / "f.txt" and file_problem(tmp_path / "link.txt") is None
    assert file_problem(tmp_path / "d.json") == "is a directory, expected a file"
    assert file_problem(tmp_path / "pipe.csv").startswith("is not a regular file (a FIFO")
    assert file_problem(tmp_path / "gone.txt") == "not found"
    with pytest.raises(NotAFileError, match=f"^{tmp_path / 'd.json'}: is a directory, expected a file; copy it$"):
        regular_file(tmp_path / "d.json", "copy it")
