"""Scoring functions (elasticfw.eval.metrics) against hand-computed cases and plain re-implementations
of the formulas they reproduce: InDel edit similarity (fuzzywuzzy / rapidfuzz ``ratio``), ROUGE-L F1
from the longest common subsequence of word lists, and label normalisation for exact match."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticfw.errors import UnsupportedInputError
from elasticfw.eval.metrics import (
    accuracy,
    code_edit_similarity,
    code_line,
    edit_similarity,
    exact_match,
    first_line,
    normalize_label,
    rouge_l,
)

# -- independent definitions ------------------------------------------------------------------------


def indel_distance(a: str, b: str) -> int:
    """Levenshtein distance with insertion/deletion cost 1 and substitution cost 2 (plain DP)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (0 if ca == cb else 2)))
        prev = cur
    return prev[-1]


def lcs(x: list[str], y: list[str]) -> int:
    table = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
    for i, a in enumerate(x, 1):
        for j, b in enumerate(y, 1):
            table[i][j] = table[i - 1][j - 1] + 1 if a == b else max(table[i - 1][j], table[i][j - 1])
    return table[-1][-1]


def words(text: str) -> list[str]:  # rouge-score's tokenisation, written out: lower case, [a-z0-9]+ runs
    return re.findall(r"[a-z0-9]+", text.lower())


# -- edit similarity ------------------------------------------------------------------------------


def test_edit_similarity_by_hand() -> None:
    # kitten -> sitting: delete k, insert s (2), e -> i as delete+insert (2), insert g (1): d = 5
    # ratio = 1 - d / (6 + 7) = 8 / 13
    assert edit_similarity("kitten", "sitting") == pytest.approx(8 / 13)
    # "abc" vs "abd": substitution c -> d costs 2; 1 - 2 / 6
    assert edit_similarity("abc", "abd") == pytest.approx(2 / 3)
    assert edit_similarity("x = 1", "x = 1") == 1.0
    assert edit_similarity("abc", "xyz") == 0.0
    assert edit_similarity("", "") == 1.0
    assert edit_similarity("", "abc") == 0.0


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab xy=()", max_size=12), st.text(alphabet="ab xy=()", max_size=12))
def test_edit_similarity_is_the_indel_ratio(a: str, b: str) -> None:
    expected = 1.0 if not a and not b else 1 - indel_distance(a, b) / (len(a) + len(b))
    assert edit_similarity(a, b) == pytest.approx(expected)


def test_code_line_skips_comments_and_fences_like_longbench() -> None:
    assert code_line("\n\n```python\n# a comment\n    return x + 1\nfoo()") == "return x + 1"
    assert code_line("a = b // 2\nc = 3") == "c = 3"  # LongBench skips lines with "//" (C comments)
    assert code_line("# only\n# comments") == ""
    assert code_line("") == ""


def test_code_edit_similarity_compares_stripped_first_code_line() -> None:
    assert code_edit_similarity("        return self._x\n        more()", "return self._x") == 1.0
    assert code_edit_similarity("# think first\nreturn self._y", "    return self._x") == pytest.approx(
        1 - 2 / 28  # one substitution (x -> y) in two strings of 14 characters
    )
    assert code_edit_similarity("```", "return 1") == 0.0  # nothing left to compare with


# -- ROUGE-L ---------------------------------------------------------------------------------------


def test_rouge_l_by_hand() -> None:
    # LCS("the cat sat on the mat", "the cat is on the mat") = the cat on the mat = 5 of 6 words each
    assert rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    # prediction of 3 words, all in order in the 6-word reference: P = 1, R = 1/2, F = 2PR/(P+R) = 2/3
    assert rouge_l("the cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)
    # order matters: LCS("mat the cat", "the cat mat") = "the cat" or "cat mat" = 2: P = R = 2/3
    assert rouge_l("mat the cat", "the cat mat") == pytest.approx(2 / 3)
    # case and punctuation are not tokens
    assert rouge_l("Return the VALUE, please!", "return the value please") == 1.0
    assert rouge_l("", "anything at all") == 0.0
    assert rouge_l("nothing shared", "anything at all") == 0.0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from(["a", "b", "c", "dog", "cat"]), max_size=10),
    st.lists(st.sampled_from(["a", "b", "c", "dog", "cat"]), max_size=10),
)
def test_rouge_l_is_lcs_f1(pred: list[str], ref: list[str]) -> None:
    common = lcs(words(" ".join(pred)), words(" ".join(ref)))
    if common == 0:
        expected = 0.0
    else:
        p, r = common / len(pred), common / len(ref)
        expected = 2 * p * r / (p + r)
    assert rouge_l(" ".join(pred), " ".join(ref)) == pytest.approx(expected)


# -- labels ------------------------------------------------------------------------------------------


def test_normalize_label() -> None:
    assert normalize_label(" `Asyncio`.\nmore text") == "asyncio"
    assert normalize_label('\n\n  "Email"  ') == "email"
    assert normalize_label("os.path") == "os.path"  # inner punctuation is part of the label
    assert normalize_label("Multi   Processing") == "multi processing"
    assert normalize_label("") == ""


def test_exact_match_and_accuracy() -> None:
    assert exact_match(" asyncio\n\nDefinition: x", "asyncio") == 1.0
    assert exact_match("asyncio module", "asyncio") == 0.0  # exact, not substring
    assert exact_match("xml", "xmlrpc") == 0.0
    assert accuracy(["Email.", "tkinter", "xml"], ["email", "asyncio", "xml"]) == pytest.approx(2 / 3)
    with pytest.raises(UnsupportedInputError, match="one reference per prediction"):
        accuracy(["a"], ["a", "b"])
    with pytest.raises(UnsupportedInputError, match="empty"):
        accuracy([], [])


def test_first_line() -> None:
    assert first_line("\n\n   Return the value.  \nSecond line") == "Return the value."
    assert first_line("   \n\t\n") == ""
