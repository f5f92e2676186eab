"""Focused tests of the training-free NSA-like mode (the conformance suite runs the rest)."""

from __future__ import annotations

import math

import pytest
import torch
from mode_definitions.nsa import DEFINITION as NSA_DEFINITION
from mode_definitions.nsa import token_reference
from pydantic import ValidationError

from elasticfw.attention.layout import dense_mask
from elasticfw.attention.seq import SeqInfo
from elasticfw.testing.modes import SHAPES, make_inputs, make_mode, reference_executor, rel_rms
from elasticfw_plugins.modes.nsa import NSAConfig, compress_mean

SMALL = NSA_DEFINITION["small_config"]  # the conformance suite's small config: one definition


def nsa(**overrides):
    return make_mode("nsa", {**SMALL, **overrides})


def test_defaults_are_the_paper_table6():
    cfg = NSAConfig()
    assert (cfg.block_size, cfg.top_n, cfg.window) == (64, 128, 512)
    assert (cfg.compress_kernel, cfg.compress_stride) == (32, 16)
    assert (cfg.init_blocks, cfg.local_blocks, cfg.compression_branch) == (1, 2, False)


# -- compression ------------------------------------------------------------------------------
@pytest.mark.parametrize(("length", "kernel", "stride"), [(37, 8, 4), (64, 16, 16), (40, 32, 16), (5, 8, 4)])
def test_mean_pooling_matches_hand_loop(length, kernel, stride):
    x = torch.randn(2, 3, length, 5, generator=torch.Generator().manual_seed(1))
    got = compress_mean(x, kernel, stride)
    expected = []
    start = 0
    while start + kernel <= length:
        total = torch.zeros(2, 3, 5)
        for t in range(start, start + kernel):
            total += x[:, :, t]
        expected.append(total / kernel)
        start += stride
    assert got.shape == (2, 3, len(expected), 5)
    if expected:
        assert torch.allclose(got, torch.stack(expected, 2), atol=1e-6)


def test_importance_by_hand_uniform_scores():
    """q = 0: uniform softmax over the valid windows; window m credits block n with overlap / stride.

    Position 23, kernel 8, stride 4: windows 0..4 end at 8..24 <= 24 (window 5 would end at 28).
    Block 0 = [0, 16): windows 0, 1, 2 inside (2 strides each), window 3 = [12, 20) half (1): 7/5.
    Block 1 = [16, 32): window 3 half (1), window 4 = [16, 24) inside (2): 3/5. Per head; 3 heads.
    """
    mode = nsa()
    k = torch.randn(1, 1, 24, 8)
    q = torch.zeros(1, 3, 1, 8)
    seq = SeqInfo.dense(1, 1, 24)
    imp = mode.block_importance(q, k, seq)
    assert imp.shape == (1, 1, 1, 2)
    assert torch.allclose(imp[0, 0, 0], torch.tensor([7 / 5, 3 / 5]) * 3, atol=1e-6)
    # a window ending exactly at the query (end == position + 1) counts; one stride later does not
    seq22 = SeqInfo(torch.tensor([22]), torch.tensor([24]), 1, 24)
    imp22 = mode.block_importance(q, k, seq22)  # windows 0..3 valid: block 0 gets 7/4, block 1 1/4
    assert torch.allclose(imp22[0, 0, 0], torch.tensor([7 / 4, 1 / 4]) * 3, atol=1e-6)


def test_tile_importance_is_the_sum_of_its_rows():
    """Per-tile aggregation: a tile's importance = sum of its rows' own (single-row) importances."""
    mode = nsa()
    q, k, _, seq = make_inputs((1, 4, 2, 70, 70, 16), seed=3)
    tiles = mode.block_importance(q, k, seq)  # (1, 2, 5, 5)
    for tile in range(tiles.shape[2]):
        total = torch.zeros_like(tiles[:, :, 0])
        for row in range(tile * 16, min(70, tile * 16 + 16)):
            one = SeqInfo(torch.tensor([row]), torch.tensor([70]), 1, 70)
            total += mode.block_importance(q[:, :, row : row + 1], k, one)[:, :, 0]
        assert torch.allclose(tiles[:, :, tile], total, atol=1e-5)


# -- group-consistent selection ------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"group{s[1] // s[2]}_q{s[3]}_kv{s[4]}")
def test_selection_is_group_consistent(shape):
    mode = nsa()
    q, k, _, seq = make_inputs(shape, seed=5)
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    layout = mode.build_layout(q, k, seq)
    assert layout.num_heads == hkv
    mask = dense_mask(layout, seq, num_heads=hq)
    for g in range(hkv):
        for h in range(g * group + 1, (g + 1) * group):
            assert torch.equal(mask[:, h], mask[:, g * group])
    # the group's importance is the sum of its query heads' importances
    imp = mode.block_importance(q, k, seq)
    for g in range(hkv):
        parts = [
            mode.block_importance(q[:, h : h + 1], k[:, g : g + 1], seq)
            for h in range(g * group, (g + 1) * group)
        ]
        assert torch.allclose(imp[:, g : g + 1], sum(parts), atol=1e-5)


def test_group_sum_picks_the_block_the_group_prefers():
    """One head's strong preference decides for the whole group (no per-head selection)."""
    torch.manual_seed(0)
    dim, length = 16, 128
    k = torch.randn(1, 1, length, dim) * 0.1
    needle = torch.zeros(dim)
    needle[0] = 1.0
    k[0, 0, 40:48] += 6 * needle  # inside block 2
    q = torch.zeros(1, 3, length, dim)
    q[0, 0, :, :] = 4 * needle  # only head 0 looks for it; heads 1, 2 are indifferent
    mode = nsa(top_n=4, window=0)  # one free block per tile
    seq = SeqInfo.dense(1, length, length)
    mask = dense_mask(mode.build_layout(q, k, seq), seq, num_heads=3)
    last = length - 1  # tile 7: init block 0, local 6-7, and the needle's block 2
    for h in range(3):
        kept = sorted({j // 16 for j in range(length) if mask[0, h, last, j]})
        assert kept == [0, 2, 6, 7]


def test_ties_go_to_the_lower_block():
    """Zero keys: every compressed key is the same, so fully covered blocks tie; the earliest win."""
    q = torch.randn(1, 2, 128, 16)
    k = torch.zeros(1, 1, 128, 16)
    seq = SeqInfo.dense(1, 128, 128)
    mode = nsa(top_n=5, window=0)  # two free blocks per tile
    mask = dense_mask(mode.build_layout(q, k, seq), seq, num_heads=2)
    kept = sorted({j // 16 for j in range(128) if mask[0, 0, 127, j]})
    assert kept == [0, 1, 2, 6, 7]


# -- window semantics -------------------------------------------------------------------------------
def test_window_is_token_exact():
    """With no free block (top_n = local_blocks = 1, no init), a row sees its block and j > p - window."""
    mode = nsa(top_n=1, init_blocks=0, local_blocks=1, window=21)
    q, k, _, seq = make_inputs((2, 2, 1, 90, 90, 16), kv_lens=[90, 61])
    mask = dense_mask(mode.build_layout(q, k, seq), seq, num_heads=2)
    pos = torch.arange(90)[:, None]
    j = torch.arange(90)[None, :]
    expected = (j <= pos) & ((j // 16 == pos // 16) | (j > pos - 21))
    rows = seq.query_valid()
    for b in range(2):
        assert torch.equal(mask[b, :, rows[b]], expected[rows[b]].expand(2, -1, -1))


@pytest.mark.parametrize(
    "overrides",
    [
        {"window": 0},
        {"compress_kernel": 16, "compress_stride": 16, "init_blocks": 0, "local_blocks": 1, "top_n": 3},
        {"compress_kernel": 32, "compress_stride": 8, "window": 40, "top_n": 4},
    ],
)
def test_other_configs_match_token_definition(overrides):
    mode = nsa(**overrides)
    for shape in (SHAPES[1], SHAPES[2]):
        q, k, _, seq = make_inputs(shape, seed=11, kv_lens=[shape[4], shape[4] - 37][: shape[0]])
        mask = dense_mask(mode.build_layout(q, k, seq), seq, num_heads=q.shape[1])
        expected = token_reference(q, k, seq, mode.config)
        rows = seq.query_valid()[:, None, :, None].expand_as(mask)
        assert not ((mask != expected) & rows).any()


def test_score_chunk_does_not_change_results():
    q, k, v, seq = make_inputs(SHAPES[1], kv_lens=[203, 150])
    a, b = nsa(compression_branch=True), nsa(compression_branch=True, score_chunk=7)
    la, lb = a.build_layout(q, k, seq), b.build_layout(q, k, seq)
    assert torch.equal(la.blocks, lb.blocks)
    sa, sb = a.side_branch(q, k, v, seq, scale=0.25), b.side_branch(q, k, v, seq, scale=0.25)
    assert torch.allclose(sa.out, sb.out, atol=1e-6) and torch.equal(sa.lse.isinf(), sb.lse.isinf())


# -- compression branch ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"group{s[1] // s[2]}_q{s[3]}_kv{s[4]}")
def test_compression_branch_is_one_softmax_over_the_union(shape):
    """LSE merge of layout attention and compressed attention == one softmax over
    (selected/window tokens) ∪ (valid compressed keys), computed directly."""
    mode = nsa(compression_branch=True)
    batch, hq, hkv, sq, sk, dim = shape
    kv_lens = [sk, sk - 29][:batch]
    q, k, v, seq = make_inputs(shape, kv_lens=kv_lens, seed=2)
    scale = dim**-0.5
    got = mode.attend(q, k, v, seq, reference_executor(), scale=scale).out

    group = hq // hkv
    token_mask = token_reference(q, k, seq, mode.config)  # (B, Hq, Sq, Sk), layout branch only
    kernel, stride = 8, 4
    expected = torch.zeros(batch, hq, sq, dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(hq):
            g = h // group
            ck, cv, ends = [], [], []
            start = 0
            while start + kernel <= kv_lens[b]:
                ck.append(k[b, g, start : start + kernel].double().mean(0))
                cv.append(v[b, g, start : start + kernel].double().mean(0))
                ends.append(start + kernel)
                start += stride
            keys = torch.cat([k[b, g].double(), torch.stack(ck)])
            values = torch.cat([v[b, g].double(), torch.stack(cv)])
            for r in range(sq):
                pos = int(seq.q_start[b]) + r
                if pos >= kv_lens[b]:
                    continue
                allowed = torch.cat([token_mask[b, h, r], torch.tensor([e <= pos + 1 for e in ends])])
                scores = keys @ q[b, h, r].double() * scale
                probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), 0)
                expected[b, h, r] = probs @ values
    rows = seq.query_valid()[:, None, :, None].expand_as(got)
    assert torch.allclose(got[rows].double(), expected[rows], atol=1e-5)


def test_compression_branch_gradients_are_finite():
    """Rows with no valid compressed key (the first kernel - 1 positions) give lse -inf and no NaN."""
    mode = nsa(compression_branch=True)
    q, k, v, seq = make_inputs(SHAPES[1], kv_lens=[203, 150])
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    side = mode.side_branch(q, k, v, seq, scale=0.25)
    assert torch.isinf(side.lse[:, :, :7]).all() and torch.isfinite(side.lse[:, :, 7:150]).all()
    out = mode.attend(q, k, v, seq, reference_executor(), scale=0.25).out
    out[seq.query_valid()[:, None, :, None].expand_as(out)].sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_inputs(dtype):
    """Scoring is float32 whatever the input dtype: same layout as float32 inputs, close outputs."""
    mode = nsa(compression_branch=True)
    q, k, v, seq = make_inputs(SHAPES[2], dtype=dtype)
    q32, k32, v32 = q.float(), k.float(), v.float()
    assert torch.equal(mode.build_layout(q, k, seq).blocks, mode.build_layout(q32, k32, seq).blocks)
    out = mode.attend(q, k, v, seq, reference_executor(), scale=0.25).out
    ref = mode.attend(q32, k32, v32, seq, reference_executor(), scale=0.25).out
    assert out.dtype == dtype and rel_rms(out.float(), ref) < 2e-2


# -- config errors -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"compress_kernel": 10, "compress_stride": 4},
            "compress_kernel=10 must be a multiple of compress_stride=4",
        ),
        ({"block_size": 20, "compress_stride": 8, "compress_kernel": 16}, "block_size=20 must be a multiple"),
        ({"top_n": 2, "init_blocks": 1, "local_blocks": 2}, "top_n=2 must be at least"),
        ({"local_blocks": 0}, "local_blocks"),
        ({"top_k": 4}, "top_k"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ValidationError, match=message):
        NSAConfig.model_validate({**SMALL, **overrides})
