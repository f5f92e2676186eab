"""Scoring functions shared by tasks: edit similarity, ROUGE-L, exact match and accuracy.

Each function states the reference it reproduces and where it departs from it. They take plain
strings (a model's decoded completion and a reference) and return a float in [0, 1].

* :func:`edit_similarity` and :func:`code_line` reproduce LongBench's ``code_sim_score``
  (Bai et al., 2024, arXiv 2308.14508; ``metrics.py`` of THUDM/LongBench), the metric of its
  code-completion tasks ``lcc`` and ``repobench-p``: ``fuzz.ratio(prediction, reference) / 100``
  from ``fuzzywuzzy`` on the first line of the completion that is not a comment or a Markdown
  fence. ``rapidfuzz.fuzz.ratio`` is the maintained implementation of the same ratio.
* :func:`rouge_l` is ROUGE-L F1 (Lin, 2004) as computed by Google's ``rouge-score`` package,
  the metric of LongBench's summarisation tasks (``gov_report``, ``qmsum``, ``multi_news``,
  ``samsum``).
* :func:`normalize_label`, :func:`exact_match` and :func:`accuracy` score closed-set answers
  (LongBench ``trec``-style classification) by exact match after normalisation.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from rapidfuzz import fuzz

from elasticfw.errors import UnsupportedInputError

#: LongBench's ``code_sim_score`` skips completion lines containing any of these (comments in
#: Python / C-like languages and Markdown code fences) and scores the first remaining line
CODE_LINE_SKIP: tuple[str, ...] = ("`", "#", "//")


def edit_similarity(prediction: str, reference: str) -> float:
    """Normalised InDel similarity of two strings, in [0, 1]: ``rapidfuzz.fuzz.ratio / 100``.

    This is ``1 - d / (len(prediction) + len(reference))`` where ``d`` is the Levenshtein
    distance with insertions and deletions of cost 1 and substitutions of cost 2 (the ratio of
    python-Levenshtein, which ``fuzzywuzzy.fuzz.ratio`` calls); two empty strings score 1.
    LongBench divides ``fuzz.ratio`` (an integer percentage, rounded) by 100; rapidfuzz returns
    the unrounded percentage, so scores here differ from LongBench's by less than 0.005.
    """
    return float(fuzz.ratio(prediction, reference)) / 100.0


def first_line(text: str) -> str:
    """The first non-empty line of ``text``, stripped (LongBench keeps a generation's first line
    for single-line answers: ``pred.lstrip('\\n').split('\\n')[0]``; blank lines are skipped here
    too, and surrounding spaces removed)."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def code_line(completion: str, skip: Sequence[str] = CODE_LINE_SKIP) -> str:
    """The line of a code completion that LongBench's ``code_sim_score`` compares: the first line
    (after leading newlines) containing none of ``skip``; ``""`` when every line contains one.

    Unlike LongBench the line is returned stripped of surrounding whitespace: indentation is
    layout, and the reference line is compared stripped as well (see the ``code_completion`` task).
    """
    for line in completion.lstrip("\n").split("\n"):
        if not any(marker in line for marker in skip):
            return line.strip()
    return ""


def code_edit_similarity(completion: str, reference: str) -> float:
    """LongBench ``code_sim_score``: :func:`edit_similarity` of :func:`code_line` of the completion
    and the (stripped) reference line."""
    return edit_similarity(code_line(completion), reference.strip())


@lru_cache(maxsize=4)
def _rouge_scorer(use_stemmer: bool) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=use_stemmer)


def rouge_l(prediction: str, reference: str, *, use_stemmer: bool = False) -> float:
    """ROUGE-L F1 of ``prediction`` against ``reference`` with ``rouge-score``.

    ``rouge-score`` lower-cases, replaces every non-alphanumeric character by a space and splits
    on whitespace; with ``L`` the length of the longest common subsequence of the two token lists,
    precision ``P = L / len(prediction)``, recall ``R = L / len(reference)`` and
    ``F1 = 2PR / (P + R)`` (0 when either side has no token). No stemming by default, as the
    ``rouge`` package LongBench uses does not stem either.
    """
    score = _rouge_scorer(use_stemmer).score(reference, prediction)  # rouge-score: (target, prediction)
    return float(score["rougeL"].fmeasure)


_PUNCT = string.punctuation + "\u2018\u2019\u201c\u201d"


def normalize_label(text: str) -> str:
    """Normalise a closed-set answer: its first non-empty line, lower-cased, runs of whitespace
    collapsed, and punctuation / quotes / backticks stripped from both ends (so ``" `Asyncio`."``
    becomes ``"asyncio"``; inner punctuation such as the dot of ``"os.path"`` is kept)."""
    line = re.sub(r"\s+", " ", first_line(text).lower())
    return line.strip(_PUNCT + " ")


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the normalised prediction equals the normalised reference, else 0.0."""
    return float(normalize_label(prediction) == normalize_label(reference))


def accuracy(predictions: Iterable[str], references: Iterable[str]) -> float:
    """Mean :func:`exact_match` over paired predictions and references (they must pair up)."""
    preds, refs = list(predictions), list(references)
    if len(preds) != len(refs):
        raise UnsupportedInputError(
            f"accuracy needs one reference per prediction, got {len(preds)} predictions and {len(refs)} references"
        )
    if not preds:
        raise UnsupportedInputError("accuracy of an empty list of predictions is undefined")
    return sum(exact_match(p, r) for p, r in zip(preds, refs)) / len(preds)
