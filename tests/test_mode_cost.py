"""Relative cost of a mode (the fraction of dense causal attention work it does).

Independent definitions: costs counted by hand for small configurations, and, for every mode
whose count the config fixes, the pairs of its own layout counted on a prefill (token-exact
reference masks of tests/mode_definitions for the per-token modes).
"""

from __future__ import annotations

import pytest
import torch

from elasticfw.attention.layout import computed_pairs
from elasticfw.attention.mode import causal_density
from elasticfw.attention.seq import SeqInfo
from elasticfw.recipe import validate_recipe_data
from elasticfw.registry import get_registry


def mode(section: dict):
    elastic = {"retrieval_mode": {"name": "full", "block_size": 16}, "sparse_mode": section}
    config = validate_recipe_data({"elastic": elastic}).elastic.sparse_mode
    return get_registry().make("sparse_mode", config)


def test_full_attention_costs_one():
    assert mode({"name": "full", "block_size": 32}).cost(1) == 1.0
    assert mode({"name": "full", "block_size": 32}).cost(100_000) == 1.0


def test_streaming_token_window_by_hand():
    # sink 2, local 3, 8 tokens: query i reads min(i + 1, 5) keys -> 1+2+3+4+5+5+5+5 = 30 of 36 causal pairs
    m = mode({"name": "streaming", "sink_tokens": 2, "local_tokens": 3, "block_size": 16, "granularity": "token"})
    assert m.cost(8) == pytest.approx(30 / 36, abs=1e-12)
    assert m.cost(5) == 1.0  # sink + window cover every key
    # long sequences: every query past sink + local reads exactly 5 keys
    assert m.cost(1000) == pytest.approx((15 + 5 * 995) / (1000 * 1001 / 2), abs=1e-12)


def test_streaming_block_window_by_hand():
    # sink 1 block, local 2 blocks of 16, 64 tokens. Query blocks 0-2 read every causal key
    # (136 + 392 + 648 pairs); block 3 (p = 48..63) drops key block 1: p + 1 - 16 keys -> 33..48, 648.
    m = mode({"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16})
    assert m.cost(64) == pytest.approx((136 + 392 + 648 + 648) / (64 * 65 / 2), abs=1e-12)


def test_moba_by_hand():
    # MoBA blocks of 4, top_k 2, 12 tokens: block 0 (p 0..3) reads p + 1 keys (10); blocks 1 and 2 read
    # their own block up to p plus one whole earlier block: (1..4) + 4 each -> 26 + 26. Of 78 pairs.
    m = mode({"name": "moba", "moba_block_size": 4, "top_k": 2, "block_size": 4})
    assert m.cost(12) == pytest.approx((10 + 26 + 26) / 78, abs=1e-12)


def test_nsa_estimate_by_hand():
    # top_n 3 blocks of 16 (48 keys) + the 16 window keys beyond the 2 local blocks: at most 64 keys a query
    m = mode({"name": "nsa", "block_size": 16, "top_n": 3, "window": 48, "local_blocks": 2, "init_blocks": 1})
    assert m.cost(100) == pytest.approx((sum(range(1, 65)) + 64 * 36) / (100 * 101 / 2), abs=1e-12)


def test_xattention_has_no_config_estimate_and_counts_as_dense():
    assert mode({"name": "xattention", "block_size": 16, "stride": 4}).cost(4096) == 1.0


@pytest.mark.parametrize("section", [
    {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16, "cost": 0.25},
    {"name": "xattention", "block_size": 16, "stride": 4, "cost": 0.4},
    {"name": "full", "block_size": 32, "cost": 1.5},
])
def test_the_recipe_cost_overrides_the_estimate(section):
    assert mode(section).cost(64) == section["cost"]
    assert mode(section).cost(100_000) == section["cost"]


def test_a_negative_cost_or_length_is_an_error():
    with pytest.raises(Exception, match="cost"):
        mode({"name": "full", "block_size": 32, "cost": -0.1})
    with pytest.raises(ValueError, match="sequence length >= 1"):
        mode({"name": "full", "block_size": 32}).cost(0)


@pytest.mark.parametrize("section", [
    {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16},
    {"name": "streaming", "sink_tokens": 5, "local_tokens": 21, "block_size": 16, "granularity": "token"},
    {"name": "moba", "moba_block_size": 32, "top_k": 2, "block_size": 16},
    {"name": "full", "block_size": 16},
])
@pytest.mark.parametrize("length", [37, 160])
def test_exact_costs_equal_the_pairs_of_the_modes_own_layout(section, length):
    """The modes whose count the config fixes: their cost is the pairs their layout computes."""
    m = mode(section)
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, length, 8), torch.randn(1, 2, length, 8)
    seq = SeqInfo.dense(1, length, length)
    pairs = computed_pairs(m.build_layout(q, k, seq), seq, 2)  # (1, 2)
    assert float(pairs[0, 0]) / (length * (length + 1) / 2) == pytest.approx(m.cost(length), abs=1e-12)


def test_causal_density_needs_a_query():
    assert causal_density(torch.tensor([1.0, 2.0])) == 1.0
    assert causal_density(torch.tensor([1.0])) == 1.0  # one query, its one key: 1 of 1 causal pair
    assert causal_density(torch.tensor([1.0, 1.0])) == 2 / 3  # the second query skips key 0
    with pytest.raises(ValueError, match="at least one"):
        causal_density(torch.zeros(0))
