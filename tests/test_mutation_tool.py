"""scripts/mutation.py's test selection: a mutant is tested by exactly the tests that executed its lines."""

from __future__ import annotations

from pathlib import Path

from file_modules import load_script

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    return load_script("mutation", "mutation_tool")


LINES = {
    "elasticfw/a.py": {"3": ["t::x"], "4": ["t::y", "t::x"], "9": ["t::z"]},
    "elasticfw/imported_only.py": {},
}


def test_tests_of_the_mutated_lines_only():
    tool = _tool()
    assert tool._covering_tests(LINES, "elasticfw/a.py", 4, 4) == (["t::x", "t::y"], "line")
    assert tool._covering_tests(LINES, "elasticfw/a.py", 3, 5) == (["t::x", "t::y"], "line")  # a multi-line mutant


def test_a_line_run_only_at_import_gets_every_test_of_its_file():
    tool = _tool()
    assert tool._covering_tests(LINES, "elasticfw/a.py", 6, 7) == (["t::x", "t::y", "t::z"], "file")


def test_a_file_no_test_reaches_has_no_tests():
    tool = _tool()
    assert tool._covering_tests(LINES, "elasticfw/imported_only.py", 1, 1) == ([], "none")
    assert tool._covering_tests(LINES, "plugins/unknown.py", 1, 1) == ([], "none")


def test_shards_use_their_own_worktree(tmp_path: Path):
    tool = _tool()
    assert tool._trees(tmp_path, 0) == (tmp_path / "tree", tmp_path / "links")
    assert tool._trees(tmp_path, 2) == (tmp_path / "tree2", tmp_path / "links2")
    env = tool._env(tmp_path, 1)
    assert env["PYTHONPATH"].split(":")[:2] == [str(tmp_path / "tree1"), str(tmp_path / "links1")]
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
