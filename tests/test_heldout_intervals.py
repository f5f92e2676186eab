"""The held-back summary's intervals, by hand: Wilson for 0/1 scores, Student-t for the rest, and
the difference to full attention paired sample by sample."""

from __future__ import annotations

import math

import pytest

from elasticfw.training.evaluate import score_intervals

Z = 1.959963984540054  # the standard normal's 97.5 % point
T2 = 4.302652729911275  # Student's t, 2 degrees of freedom, 97.5 %


def wilson(k: int, n: int) -> tuple[float, float]:
    p = k / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / (1 + Z * Z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def test_binary_scores_and_their_paired_difference():
    scores, full = [1.0] * 40, [1.0] * 29 + [0.0] * 11
    out = score_intervals(scores, full)
    assert out["ci"] == pytest.approx(wilson(40, 40))
    assert out["ci"][0] == pytest.approx(40 / (40 + Z * Z))  # all 40 right: the lower bound n / (n + z^2)
    # differences 0 or 1: 11 of 40 ones, a Wilson interval around 0.275
    assert out["diff_to_full"] == pytest.approx(0.275)
    assert out["diff_ci"] == pytest.approx(wilson(11, 40))


def test_continuous_scores_pair_sample_by_sample():
    out = score_intervals([0.5, 0.7, 0.9], [0.6, 0.6, 0.6])
    # differences -0.1, 0.1, 0.3: mean 0.1, sample sd 0.2
    half = T2 * 0.2 / math.sqrt(3)
    assert out["diff_to_full"] == pytest.approx(0.1)
    assert out["diff_ci"] == pytest.approx([0.1 - half, 0.1 + half])
    # paired, not two independent means: the same scores against full attention in another order differ
    assert score_intervals([0.5, 0.7, 0.9], [0.6, 0.6, 0.6])["diff_ci"] != pytest.approx(
        score_intervals([0.5, 0.7, 0.9], [0.4, 0.6, 0.8])["diff_ci"])
    assert score_intervals([0.5, 0.7, 0.9], [0.4, 0.6, 0.8])["diff_ci"] == pytest.approx([0.1, 0.1])


def test_no_full_attention_scores_no_difference():
    assert set(score_intervals([1.0, 0.0], [])) == {"ci"}
    assert score_intervals([], []) == {}
