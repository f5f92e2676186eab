"""Confidence intervals of mean scores, and of averages of several task means.

Conventions (``confidence`` defaults to 0.95, ``z`` is the standard normal quantile
``Φ⁻¹((1 + confidence) / 2)`` ≈ 1.959964):

* **0/1 scores** (accuracies): the Wilson score interval of ``k`` successes in ``n`` trials,
  without continuity correction. It stays inside [0, 1] and is not symmetric about ``k/n``.
* **Continuous scores** (edit similarity, ROUGE-L, … in [0, 1]): the Student-t interval
  ``mean ± t_{(1+confidence)/2, n-1} · s / √n`` with ``s`` the sample standard deviation (ddof 1).
  It is not clipped to [0, 1].
* **A single continuous score** has no spread estimate; its interval is the whole score range
  [0, 1] (method ``"range"``): we know nothing beyond the score being a valid score.
* **Average of K task means** (the per-category and overall columns): normal approximation with the
  task means independent, ``half = z · √(Σ se_k²) / K`` where ``se_k = √(p(1-p)/n)`` for 0/1 scores
  and ``s/√n`` for continuous ones (``0.5`` for a single continuous score: the largest standard
  deviation a [0, 1] score can have). Note ``se_k = 0`` for an all-0 or all-1 task.

The method name returned with each interval is one of ``"wilson"``, ``"t"``, ``"range"``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from scipy import stats as _st

from elasticfw.report.errors import ReportError

WILSON, STUDENT_T, RANGE = "wilson", "t", "range"


class Interval(NamedTuple):
    """A mean score with its confidence interval and how it was computed."""

    mean: float
    lo: float
    hi: float
    method: str
    n: int

    @property
    def half_width(self) -> float:
        """Half the interval's width (the ``±`` of the tables; Wilson intervals are asymmetric)."""
        return (self.hi - self.lo) / 2


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ReportError(f"confidence must be strictly between 0 and 1, got {confidence!r}")


def z_value(confidence: float = 0.95) -> float:
    """The two-sided standard normal quantile, ``Φ⁻¹((1 + confidence) / 2)``."""
    _check_confidence(confidence)
    return float(_st.norm.ppf((1 + confidence) / 2))


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval (no continuity correction) of ``successes`` out of ``n``."""
    if n <= 0:
        raise ReportError(f"wilson_interval needs at least one trial, got n={n}")
    if not 0 <= successes <= n:
        raise ReportError(f"wilson_interval: successes={successes} is outside 0..n={n}")
    z = z_value(confidence)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def is_binary(values: Sequence[float]) -> bool:
    """Whether every value is exactly 0 or 1 (then the scores are treated as successes/failures)."""
    return all(v in (0, 1) for v in values)


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean of ``values`` with its confidence interval: Wilson when every value is 0 or 1, else
    Student-t; a single continuous value gets the whole range [0, 1] (see the module docstring)."""
    n = len(values)
    if n == 0:
        raise ReportError("mean_interval of no values")
    _check_confidence(confidence)
    mean = math.fsum(values) / n
    if is_binary(values):
        lo, hi = wilson_interval(round(math.fsum(values)), n, confidence)
        return Interval(mean, lo, hi, WILSON, n)
    if n == 1:
        return Interval(mean, 0.0, 1.0, RANGE, n)
    se = _sample_sd(values, mean) / math.sqrt(n)
    half = float(_st.t.ppf((1 + confidence) / 2, n - 1)) * se
    return Interval(mean, mean - half, mean + half, STUDENT_T, n)


def _sample_sd(values: Sequence[float], mean: float) -> float:
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def standard_error(values: Sequence[float], confidence: float = 0.95) -> float:
    """Standard error of the mean used for averages.

    0/1 values: the Wilson interval's half-width divided by z, ``√(p(1-p)/n + z²/4n²) / (1 + z²/n)``
    (unlike ``√(p(1-p)/n)`` it is not 0 when every sample scored the same, which a few samples
    often do); continuous values: ``s/√n``; a single continuous value: ``0.5``."""
    n = len(values)
    if n == 0:
        raise ReportError("standard_error of no values")
    mean = math.fsum(values) / n
    if is_binary(values):
        z = z_value(confidence)
        return math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    if n == 1:
        return 0.5
    return _sample_sd(values, mean) / math.sqrt(n)


def average_interval(
    means: Sequence[float], standard_errors: Sequence[float], confidence: float = 0.95
) -> tuple[float, float]:
    """``(average, half_width)`` of the plain average of K means: ``half = z·√(Σ se_k²)/K``."""
    if len(means) != len(standard_errors):
        raise ReportError(f"average_interval: {len(means)} means but {len(standard_errors)} standard errors")
    k = len(means)
    if k == 0:
        raise ReportError("average_interval of no means")
    half = z_value(confidence) * math.sqrt(math.fsum(se * se for se in standard_errors)) / k
    return math.fsum(means) / k, half
