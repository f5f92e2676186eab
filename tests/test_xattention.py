"""XAttention beyond the conformance suite: a hand-computed case, the antidiagonal estimate
against loops, threshold behaviour, head aggregation, chunking, dtypes and config errors."""

from __future__ import annotations

import math

import pytest
import torch
from mode_definitions.xattention import brute_mass, token_reference
from pydantic import ValidationError

from elasticfw.attention.layout import dense_mask
from elasticfw.attention.seq import SeqInfo
from elasticfw.testing.modes import SHAPES, make_inputs, make_mode, real_rows
from elasticfw_plugins.modes.xattention import (
    XAttention,
    XAttentionConfig,
    antidiagonal_scores,
    block_mass,
    select_blocks,
)


def _layout(q, k, seq, **config):
    """The layout of ``config`` with ``decode: sparse`` unless given: a one-row call is estimated
    (what these tests check) only then."""
    mode = make_mode("xattention", {"decode": "sparse", **config})
    with torch.no_grad():
        return mode.build_layout(q, k, seq)


# -- hand-computed case ------------------------------------------------------------------------


def _hand_case() -> tuple[torch.Tensor, torch.Tensor, SeqInfo]:
    """d = 1, stride 2, block 4, 12 tokens (3 blocks), one head.

    q = 1 at even positions, 0 at odd ones, so the antidiagonal of tile (m, n),
    q[2m] k[2n+1] + q[2m+1] k[2n], is k[2n+1]: only odd keys matter. They are 2 ln w_n with
    w = (1, 1, 2, 4, 1, 1), so after the 1/(sqrt(d) S) = 1/2 scale, exp(score) = w_n. Even keys
    are huge: the main diagonal (q[2m] k[2n] + ...) would be dominated by them.
    """
    q = torch.tensor([1.0 if p % 2 == 0 else 0.0 for p in range(12)]).view(1, 1, 12, 1)
    w = [1.0, 1.0, 2.0, 4.0, 1.0, 1.0]
    k = torch.zeros(12)
    k[1::2] = torch.tensor([2 * math.log(x) for x in w])
    k[0::2] = torch.tensor([50.0, -80.0, 90.0, 70.0, -60.0, 40.0])
    return q, k.view(1, 1, 12, 1), SeqInfo.dense(1, 12, 12)


def test_hand_computed_mass_and_selection():
    q, k, seq = _hand_case()
    mass = block_mass(q, k, seq, block_size=4, stride=2)[0, 0]
    # block 0: strided rows m=0 ([1]) and m=1 ([1, 1] / 2) put everything on key block 0.
    # block 1: m=2 -> [1, 1, 2] / 4, m=3 -> [1, 1, 2, 4] / 8.
    # block 2: m=4 -> [1, 1, 2, 4, 1] / 9, m=5 -> [1, 1, 2, 4, 1, 1] / 10.
    expected = torch.tensor(
        [
            [2.0, 0.0, 0.0],
            [0.25 + 0.25 + 1 / 8 + 1 / 8, 0.5 + 6 / 8, 0.0],
            [2 / 9 + 2 / 10, 6 / 9 + 6 / 10, 1 / 9 + 2 / 10],
        ]
    )
    assert torch.allclose(mass, expected, atol=1e-6)
    rows = torch.arange(3)[None]
    # block 2: forced blocks 0 and 2 hold 1/3 + 0.4 = 0.733 of a total of 2.
    low = select_blocks(mass[None, None], rows, 0.3)[0, 0]  # target 0.6: forced blocks suffice
    assert low.tolist() == [[True, False, False], [True, True, False], [True, False, True]]
    mid = select_blocks(mass[None, None], rows, 0.5)[0, 0]  # target 1.0: block 1 crosses it and is kept
    assert mid.tolist() == [[True, False, False], [True, True, False], [True, True, True]]


# -- antidiagonal estimate against loops -------------------------------------------------------


@pytest.mark.parametrize("q_len", [24, 8], ids=["keys_reversed", "queries_reversed"])
def test_antidiagonal_scores_match_brute_force(q_len):
    """Either side reversed (the smaller one: 6 x 24 query rows against 2 x 32 keys, then 6 x 8)."""
    g = torch.Generator().manual_seed(1)
    s = 4
    q = torch.randn(2, 6, q_len, 5, generator=g)
    k = torch.randn(2, 2, 32, 5, generator=g)
    got = antidiagonal_scores(q, k, s)
    rows = q_len // s
    assert got.shape == (2, 6, rows, 8)
    expected = torch.zeros(2, 6, rows, 8, dtype=torch.float64)
    for b in range(2):
        for h in range(6):
            for m in range(rows):
                for n in range(8):
                    total = 0.0
                    for i in range(s):
                        total += float(q[b, h, m * s + i].double() @ k[b, h // 3, n * s + s - 1 - i].double())
                    expected[b, h, m, n] = total
    assert torch.allclose(got.double(), expected, atol=1e-4)


def test_block_mass_rows_sum_to_real_strided_rows():
    """Each real strided row contributes one unit of probability; rows without real queries none."""
    q, k, _, seq = make_inputs((1, 8, 2, 97, 250, 16))  # q_start 153: first block has 7 real rows
    mass = block_mass(q, k, seq, block_size=16, stride=4)
    totals = mass.sum(-1)[0, 0]
    # block 9 = positions 144..159, real from 153: strided rows 152..155 and 156..159 -> 2
    assert totals[0].item() == pytest.approx(2.0, abs=1e-5)
    # blocks 10..14 are full; block 15 = positions 240..255, real up to 249: rows 240, 244, 248 -> 3
    assert torch.allclose(totals[1:-1], torch.full_like(totals[1:-1], 4.0), atol=1e-5)
    assert totals[-1].item() == pytest.approx(3.0, abs=1e-5)


# -- layout against the token definition, beyond the conformance config -----------------------


@pytest.mark.parametrize(
    "config",
    [
        {"block_size": 16, "stride": 4, "threshold": 0.3},
        {"block_size": 16, "stride": 8, "threshold": 0.6},
        {"block_size": 32, "stride": 4, "threshold": 0.8, "head_aggregation": "kv_group"},
        {"block_size": 16, "stride": 16, "threshold": 0.5, "head_aggregation": "kv_group"},
    ],
    ids=lambda c: "-".join(str(v) for v in c.values()),
)
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2], SHAPES[3]], ids=str)
def test_layout_matches_token_definition_other_configs(config, shape):
    kv_lens = [shape[4], shape[4] - 37] if shape[0] == 2 else None
    q, k, _, seq = make_inputs(shape, kv_lens=kv_lens, seed=5)
    mode = make_mode("xattention", {**config, "decode": "sparse"})  # the decode shape: estimated
    layout = mode.build_layout(q, k, seq)
    hq, hkv = q.shape[1], k.shape[1]
    assert layout.num_heads == (hkv if config.get("head_aggregation") == "kv_group" else hq)
    mask = dense_mask(layout, seq, num_heads=hq)
    expected = token_reference(q, k, seq, mode.config)
    rows = real_rows(seq).expand_as(mask)
    assert not ((mask != expected) & rows).any()


@pytest.mark.parametrize(
    "q_len, kv_len",
    [(72, 72), (70, 70), (44, 76), (64, 64), (1, 70)],
    ids=["tail_whole_strides", "tail_partial_stride", "aligned_suffix", "whole_blocks", "decode"],
)
def test_layout_on_host_dense_queries_matches_token_definition(q_len, kv_len, monkeypatch):
    """Host-dense queries (``SeqInfo.dense``) starting on the block grid are read in place, the
    last block's missing rows left out of the matmul when they are whole strides (72: 8 rows of
    block 4, 44: 12 of block 2), zero-filled otherwise (70): the layout meets the definition and
    the grid builder runs only when rows must be filled. The decode step too: one query, dotted with
    each strided key's antidiagonal partner, no grid (a capacity of 70 keys padded to 72 for the
    strides)."""
    import elasticfw.attention.patterns as patterns

    grids = []
    real_grid = patterns.query_grid
    monkeypatch.setattr(patterns, "query_grid", lambda *a, **kw: grids.append(1) or real_grid(*a, **kw))
    q, k, _, _ = make_inputs((2, 4, 2, q_len, kv_len, 16), seed=3)
    seq = SeqInfo.dense(2, q_len, kv_len)
    config = {"block_size": 16, "stride": 4, "threshold": 0.6, "decode": "sparse"}
    layout = _layout(q, k, seq, **config)
    expected = token_reference(q, k, seq, make_mode("xattention", config).config)
    assert torch.equal(dense_mask(layout, seq, num_heads=4), expected)
    assert bool(grids) == (q_len == 70)
    grids.clear()
    mass = block_mass(q, k, seq, block_size=16, stride=4)
    torch.testing.assert_close(mass.double(), brute_mass(q, k, seq, 16, 4), rtol=1e-5, atol=1e-6)


# -- threshold behaviour ---------------------------------------------------------------------


def test_threshold_monotone_and_forced_blocks():
    q, k, _, seq = make_inputs((2, 6, 2, 203, 203, 16), kv_lens=[203, 170], seed=3)
    previous = None
    for tau in (0.05, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.99, 1.0):
        blocks = _layout(q, k, seq, block_size=16, stride=4, threshold=tau).blocks
        blocks = blocks.expand(2, 6, *blocks.shape[2:])
        rows = seq.query_block_positions(16)[:, None, :]  # (B, 1, NQB)
        assert blocks[..., 0].all(), f"key block 0 dropped at threshold {tau}"
        diag = blocks.gather(-1, rows[..., None].expand(2, 6, -1, 1))[..., 0]
        assert diag.all(), f"diagonal block dropped at threshold {tau}"
        if previous is not None:
            assert not (previous & ~blocks).any(), f"threshold {tau} dropped a block a lower threshold kept"
        previous = blocks
    rows = seq.query_block_positions(16)[:, None, :, None]
    assert torch.equal(previous, (torch.arange(previous.shape[-1]) <= rows).expand_as(previous))


def test_threshold_one_is_dense_causal_even_with_extreme_scores():
    q, k, _, seq = make_inputs((1, 4, 2, 160, 160, 16))
    q = q * 1e3  # near-one-hot softmax rows: masses of other blocks underflow to 0
    layout = _layout(q, k, seq, block_size=16, stride=4, threshold=1.0)
    assert layout.dense_causal
    rows = seq.query_block_positions(16)[:, :, None]
    assert torch.equal(layout.blocks[:, 0], torch.arange(10)[None, None] <= rows)


def test_crossing_block_is_kept():
    """Rows whose forced mass is below target keep blocks until the target is reached, no further."""
    q, k, _, seq = make_inputs((1, 3, 3, 160, 160, 16), seed=11)
    tau = 0.7
    mass = block_mass(q, k, seq, block_size=16, stride=4)
    blocks = _layout(q, k, seq, block_size=16, stride=4, threshold=tau).blocks
    kept = torch.where(blocks, mass, torch.zeros(())).sum(-1)
    total = mass.sum(-1)
    assert (kept >= tau * total - 1e-5).all()  # the crossing block was included
    # dropping the smallest non-forced kept block would fall below the target
    nqb = blocks.shape[2]
    for h in range(3):
        for t in range(2, nqb):
            others = blocks[0, h, t].clone()
            others[0] = others[t] = False
            if others.any():
                smallest = mass[0, h, t][others].min()
                assert kept[0, h, t] - smallest < tau * total[0, h, t] + 1e-5


# -- chunking, padding, dtypes -----------------------------------------------------------------


def test_chunk_size_does_not_change_the_layout():
    q, k, _, seq = make_inputs((2, 6, 2, 203, 203, 16), kv_lens=[203, 120])
    big = _layout(q, k, seq, block_size=16, stride=4, threshold=0.8)
    small = _layout(q, k, seq, block_size=16, stride=4, threshold=0.8, chunk_size=16)
    mid = _layout(q, k, seq, block_size=16, stride=4, threshold=0.8, chunk_size=48)
    assert torch.equal(big.blocks, small.blocks) and torch.equal(big.blocks, mid.blocks)


@pytest.mark.parametrize("shape", [(2, 6, 2, 203, 203, 16), (2, 3, 1, 1, 181, 16)], ids=str)
def test_padding_never_influences_real_rows(shape):
    batch, hq, hkv, sq, sk, d = shape
    short = 150
    q, k, _, seq = make_inputs(shape, kv_lens=[sk, short], seed=2)
    q2, k2 = q.clone(), k.clone()
    k2[1, :, short:] = 1e4  # garbage keys
    if sq == sk:
        q2[1, :, short:] = -1e4  # garbage padding queries
    a = _layout(q, k, seq, block_size=16, stride=4, threshold=0.6)
    b = _layout(q2, k2, seq, block_size=16, stride=4, threshold=0.6)
    alone_seq = SeqInfo.from_lengths(torch.tensor([short]), min(sq, short), short)
    alone = _layout(
        q[1:, :, : min(sq, short)], k[1:, :, :short], alone_seq, block_size=16, stride=4, threshold=0.6
    )
    rows = real_rows(seq)[1:]
    ma = dense_mask(a, seq, num_heads=hq)[1:, :, :, :short]
    mb = dense_mask(b, seq, num_heads=hq)[1:, :, :, :short]
    m_alone = dense_mask(alone, alone_seq, num_heads=hq)
    rows_alone = rows[:, :, : m_alone.shape[2]]
    assert torch.equal(ma & rows, mb & rows)
    assert torch.equal(ma[:, :, : m_alone.shape[2]] & rows_alone, m_alone & rows_alone)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_inputs_are_estimated_in_float32(dtype):
    q, k, _, seq = make_inputs((2, 6, 2, 203, 203, 16), dtype=dtype)
    low = _layout(q, k, seq, block_size=16, stride=4, threshold=0.8)
    exact = _layout(q.float(), k.float(), seq, block_size=16, stride=4, threshold=0.8)
    assert torch.equal(low.blocks, exact.blocks)


# -- config ----------------------------------------------------------------------------------


def test_defaults_are_the_papers():
    cfg = XAttentionConfig()
    assert (cfg.block_size, cfg.stride, cfg.threshold, cfg.chunk_size) == (64, 16, 0.9, 16384)
    assert cfg.head_aggregation == "query"
    assert XAttention().block_size == 64


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"block_size": 64, "stride": 24}, "block_size=64 must be a multiple of stride=24"),
        ({"threshold": 0.0}, r"threshold must be in \(0, 1\]"),
        ({"threshold": 1.5}, r"threshold must be in \(0, 1\]"),
        ({"threshold": float("nan")}, r"threshold must be in \(0, 1\]"),
        ({"block_size": 64, "chunk_size": 100}, "chunk_size=100 must be a multiple of block_size=64"),
        ({"head_aggregation": "mean"}, "head_aggregation"),
        ({"stride": 0}, "stride"),
        ({"topk": 3}, "topk"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ValidationError, match=message):
        XAttentionConfig(**overrides)
