"""``scripts/cost_compare.py``: routers of different mode sets at their expected cost, paired.

Hand-computed: mode costs set in the recipe (full 1, XAttention 0.5, streaming 0.4), shares and
scores written out, so each cost, density and paired difference is arithmetic on the page.
"""

from __future__ import annotations

import pytest

from elasticfw.attention.mode import ModeCosts
from elasticfw.recipe import validate_recipe_data
from elasticfw.registry import get_registry
from tests.file_modules import load_script

cc = load_script("cost_compare")


def costs() -> ModeCosts:
    section = validate_recipe_data({"elastic": {"modes": [
        {"name": "full", "block_size": 16},
        {"name": "xattention", "block_size": 16, "stride": 8, "cost": 0.5},
        {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16, "cost": 0.4},
    ]}})
    return ModeCosts([get_registry().make("sparse_mode", c) for c in section.elastic.mode_configs()])


def sample(score, msr, esr, tokens, shares=None):
    s = {"score": score, "msr": msr, "esr": esr, "tokens": tokens}
    if shares is not None:
        s["shares"] = shares
    return s


def run(modes, samples):
    return {"modes": modes, "details": {"mlp": {"passkey": {"per_sample": samples}}}}


THREE = run("full-xattention-streaming", [
    sample(1.0, 0.5, 0.3, 100, [0.5, 0.25, 0.25]),  # 0.5 + 0.125 + 0.1 = 0.725
    sample(0.0, 1.0, 0.6, 120, [0.0, 0.0, 1.0]),    # 0.4
    sample(1.0, 0.5, 0.4, 90, [0.5, 0.5, 0.0]),     # 0.75
])
PAIR = run("full-streaming", [
    sample(0.0, 0.6, 0.2, 100),  # 0.4 + 0.6 * 0.4 = 0.64
    sample(0.0, 0.0, 0.0, 120),  # 1.0
    sample(1.0, 1.0, 0.5, 90),   # 0.4
])


def test_costs_densities_and_paired_differences_by_hand():
    table = cc.compare({"three": THREE, "pair": PAIR}, costs(), "three")["passkey"]
    three, pair = table["three"], table["pair"]
    assert three["cost"] == pytest.approx((0.725 + 0.4 + 0.75) / 3)
    assert pair["cost"] == pytest.approx((0.64 + 1.0 + 0.4) / 3)
    assert three["density"] == pytest.approx(1 - (0.3 + 0.6 + 0.4) / 3)
    assert pair["density"] == pytest.approx(1 - (0.2 + 0.0 + 0.5) / 3)
    assert three["score"] == pytest.approx(2 / 3) and pair["score"] == pytest.approx(1 / 3)
    # three - pair per sample: +1, 0, 0
    assert pair["reference_minus_this"]["diff"] == pytest.approx(1 / 3)
    lo, hi = pair["reference_minus_this"]["diff_ci"]
    assert lo < 1 / 3 < hi
    assert "reference_minus_this" not in three


def test_runs_on_other_samples_are_not_paired():
    other = run("full-streaming", [sample(1.0, 0.5, 0.2, n) for n in (100, 121, 90)])
    row = cc.compare({"three": THREE, "other": other}, costs(), "three")["passkey"]["other"]
    assert "reference_minus_this" not in row and row["score"] == 1.0


def test_a_mode_without_a_cost_and_an_unknown_reference_are_refused():
    nsa = run("full-nsa", [sample(1.0, 0.5, 0.2, 100)])
    with pytest.raises(ValueError, match="not among the cost recipe"):
        cc.compare({"three": THREE, "nsa": nsa}, costs(), "three")
    twice = run("streaming-streaming", [sample(1.0, 0.5, 0.2, 100, [0.5, 0.5])])
    with pytest.raises(ValueError, match="a mode named twice"):
        cc.compare({"three": THREE, "twice": twice}, costs(), "three")
    with pytest.raises(ValueError, match="--reference 'four'"):
        cc.compare({"three": THREE}, costs(), "four")
