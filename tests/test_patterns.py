"""elasticfw.attention.patterns: estimators and selectors against plain loops and hand-computed cases.

Every expected value here is computed without the module: Python loops over positions in float64
(estimators, pooling) or sorted lists (selectors), and a few cases worked out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from elasticfw.attention.patterns import (
    column_mass,
    diagonal_mass,
    gate_scores,
    last_query_attention,
    mean_pool_keys,
    pool_blocks,
    pool_tiles,
    query_grid,
    reduce_groups,
    threshold_select,
    topk_select,
)
from elasticfw.attention.seq import SeqInfo

# (name, SeqInfo, q_len, capacity): dense prefill, a right-padded batch, a chunked prefill whose
# first position is not block-aligned, a decode step
SEQS = {
    "dense": lambda: SeqInfo.dense(2, 37, 37),
    "padded": lambda: SeqInfo.from_lengths(torch.tensor([37, 22]), 37, 37),
    "chunked": lambda: SeqInfo(torch.tensor([13, 5]), torch.tensor([37, 25]), 20, 37),
    "decode": lambda: SeqInfo.dense(2, 1, 37),
    # queries known on the host to start on the 8-tile grid (query_grid's slice): whole tiles, and a
    # suffix of the keys with padding rows in its last tile
    "dense_whole_tiles": lambda: SeqInfo.dense(2, 40, 40),
    "dense_aligned_suffix": lambda: SeqInfo.dense(2, 21, 37),
}


def _inputs(seq: SeqInfo, hq: int = 6, hkv: int = 2, dim: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq.batch, hq, seq.q_len, dim, generator=g)
    k = torch.randn(seq.batch, hkv, seq.kv_capacity, dim, generator=g)
    return q, k


# -- last-query estimate --------------------------------------------------------------------------


def _last_query_loops(q, k, seq, last, scale, group):
    """(B, H, last, Sk) float64 probabilities, row by row, from the definition."""
    batch, hq, sq, dim = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    per_q = torch.zeros(batch, hq, last, sk, dtype=torch.float64)
    for b in range(batch):
        q_start, kv_len = int(seq.q_start[b]), int(seq.kv_len[b])
        real = [i for i in range(sq) if q_start + i < kv_len]
        chosen = real[-last:]
        for slot, i in zip(range(last - len(chosen), last), chosen):
            pos = q_start + i
            for h in range(hq):
                logits = [float(q[b, h, i].double() @ k[b, h // g, j].double()) * scale for j in range(pos + 1)]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                for j, w in enumerate(weights):
                    per_q[b, h, slot, j] = w / sum(weights)
    if group is None:
        return per_q
    grouped = per_q.view(batch, hkv, g, last, sk)
    return {"mean": grouped.mean(2), "max": grouped.amax(2), "sum": grouped.sum(2)}[group]


@pytest.mark.parametrize("name", list(SEQS))
@pytest.mark.parametrize("group", [None, "mean", "max"])
def test_last_query_attention_matches_loops(name, group):
    seq = SEQS[name]()
    q, k = _inputs(seq)
    k[1, :, int(seq.kv_len[1]) :] = 1e3  # garbage keys in the padding must not count
    last = 4
    est = last_query_attention(q, k, seq, last=last, scale=0.37, group=group)
    expected = _last_query_loops(q, k, seq, last, 0.37, group)
    assert est.probs.shape == expected.shape
    assert torch.allclose(est.probs.double(), expected, atol=1e-6)
    # the last estimating row is the sample's last real query
    last_real = torch.minimum(seq.q_start + seq.q_len, seq.kv_len) - 1
    assert torch.equal(est.positions[:, -1], last_real)
    n_real = (seq.kv_len - seq.q_start).clamp(0, seq.q_len)
    assert torch.equal(est.valid.sum(-1), n_real.clamp(max=last))


def test_last_query_attention_default_scale_is_inverse_sqrt_head_dim():
    seq = SEQS["dense"]()
    q, k = _inputs(seq, dim=9)
    est = last_query_attention(q, k, seq, last=3, group=None)
    assert torch.allclose(est.probs.double(), _last_query_loops(q, k, seq, 3, 1 / 3, None), atol=1e-6)


def test_column_and_diagonal_mass_hand_computed():
    """One head, keys 0..3; two estimating rows at positions 2 and 3 with known probabilities."""
    probs = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.1, 0.2, 0.3, 0.4]]).view(1, 1, 2, 4)
    from elasticfw.attention.patterns import LastQueries

    est = LastQueries(probs, torch.tensor([[2, 3]]), torch.tensor([[True, True]]))
    assert column_mass(est)[0, 0].tolist() == pytest.approx([0.6, 0.45, 0.55, 0.4])
    # offset d = position - key: row 2 puts 0.25 on d=0, 0.25 on d=1, 0.5 on d=2;
    # row 3 puts 0.4 on d=0, 0.3 on d=1, 0.2 on d=2, 0.1 on d=3
    assert diagonal_mass(est)[0, 0].tolist() == pytest.approx([0.65, 0.55, 0.7, 0.1])


@pytest.mark.parametrize("name", ["padded", "chunked"])
def test_diagonal_mass_matches_loops(name):
    seq = SEQS[name]()
    q, k = _inputs(seq, seed=4)
    est = last_query_attention(q, k, seq, last=5, group="mean")
    got = diagonal_mass(est)
    expected = torch.zeros(got.shape, dtype=torch.float64)
    for b in range(seq.batch):
        for h in range(got.shape[1]):
            for r in range(5):
                p = int(est.positions[b, r])
                for j in range(p + 1):
                    expected[b, h, p - j] += float(est.probs[b, h, r, j])
    assert torch.allclose(got.double(), expected, atol=1e-6)


def test_reduce_groups_uses_consecutive_query_heads():
    x = torch.arange(6.0).view(1, 6, 1)  # query heads 0..5, 2 KV heads: groups {0,1,2} and {3,4,5}
    assert reduce_groups(x, 2, "sum").flatten().tolist() == [3.0, 12.0]
    assert reduce_groups(x, 2, "max").flatten().tolist() == [2.0, 5.0]
    assert reduce_groups(x, 2, "mean").flatten().tolist() == [1.0, 4.0]
    with pytest.raises(ValueError, match="not a whole number of GQA groups"):
        reduce_groups(x, 4, "sum")


# -- pooling ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_pool_blocks_matches_loops(reduce):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 11, 14, generator=g)
    valid = torch.rand(2, 1, 11, 14, generator=g) > 0.3
    got = pool_blocks(x, (4, 5), reduce, valid)
    assert got.shape == (2, 3, 3, 3)
    for b in range(2):
        for h in range(3):
            for i in range(3):
                for j in range(3):
                    cell = [float(x[b, h, r, c]) for r in range(4 * i, min(11, 4 * i + 4))
                            for c in range(5 * j, min(14, 5 * j + 5)) if valid[b, 0, r, c]]
                    want = {"sum": sum(cell), "mean": sum(cell) / len(cell) if cell else 0.0,
                            "max": max(cell) if cell else -math.inf}[reduce]
                    assert float(got[b, h, i, j]) == pytest.approx(want, abs=1e-5)


def test_pool_blocks_on_two_and_three_dimensions_by_hand():
    """(..., R, C) with any leading shape: a 2 x 4 grid in 2 x 2 cells, then a batch of it."""
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    valid = torch.tensor([[True, False, True, True], [True, True, False, False]])
    # cell 0 keeps 1, 5, 6 (mean 4), cell 1 keeps 3, 4 (mean 3.5)
    assert pool_blocks(x, (2, 2), "mean", valid).tolist() == [[4.0, 3.5]]
    assert pool_blocks(x, (2, 2), "sum", valid).tolist() == [[12.0, 7.0]]
    assert pool_blocks(x, (2, 2), "max", valid).tolist() == [[6.0, 4.0]]
    # 3 rows in cells of 2: the second row of cells holds one real row (9, 10 | 11, 12)
    x3 = torch.stack([torch.cat([x, torch.tensor([[9.0, 10.0, 11.0, 12.0]])]), torch.zeros(3, 4)])
    assert pool_blocks(x3, (2, 2), "mean").tolist() == [[[3.5, 5.5], [9.5, 11.5]], [[0.0, 0.0], [0.0, 0.0]]]
    assert pool_blocks(x3, (2, 2), "mean", x3 > 4).tolist() == [[[5.5, 7.5], [9.5, 11.5]], [[0.0, 0.0], [0.0, 0.0]]]


def test_query_grid_rows_of_a_tile_not_a_power_of_two():
    """10 queries from position 0 in tiles of 3, layout rows 1..3: grid rows 0-6 are queries 3-9, rows
    7 and 8 (positions 10, 11 of the last tile) padding."""
    seq = SeqInfo.dense(1, 10, 10)
    q = torch.arange(1.0, 11.0).view(1, 1, 10, 1)
    grid, valid = query_grid(q, seq, 3, rows=(1, 4))
    assert grid.shape == (1, 1, 9, 1)
    assert grid.flatten().tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 0.0, 0.0]
    assert valid.tolist() == [[True] * 7 + [False] * 2]


@pytest.mark.parametrize("name", list(SEQS))
def test_query_grid_and_pool_tiles_match_positions(name):
    seq, bs = SEQS[name](), 8
    q, _ = _inputs(seq, hq=2, dim=3, seed=1)
    grid, valid = query_grid(q, seq, bs)
    nqb = seq.num_query_blocks(bs)
    assert grid.shape == (seq.batch, 2, nqb * bs, 3)
    means = pool_tiles(grid, valid, bs, "mean")
    maxes = pool_tiles(grid, valid, bs, "max")
    picked = pool_tiles(grid[..., 0] > 0, valid, bs, "any")
    every = pool_tiles(grid[..., 0] > 0, valid, bs, "all")
    for b in range(seq.batch):
        first_block = int(seq.q_start[b]) // bs
        for t in range(nqb):
            rows = [p - int(seq.q_start[b]) for p in range((first_block + t) * bs, (first_block + t + 1) * bs)
                    if 0 <= p - int(seq.q_start[b]) < seq.q_len and p < int(seq.kv_len[b])]
            for r in range((first_block + t) * bs, (first_block + t + 1) * bs):
                i = r - int(seq.q_start[b])
                is_real = i in rows
                assert bool(valid[b, r - first_block * bs]) == is_real
                if is_real:
                    assert torch.equal(grid[b, :, r - first_block * bs], q[b, :, i])
                else:
                    assert not grid[b, :, r - first_block * bs].any()
            if rows:
                assert torch.allclose(means[b, :, t], q[b, :, rows].mean(1), atol=1e-6)
                assert torch.equal(maxes[b, :, t], q[b, :, rows].amax(1))
                assert torch.equal(picked[b, :, t], (q[b, :, rows, 0] > 0).any(1))
                assert torch.equal(every[b, :, t], (q[b, :, rows, 0] > 0).all(1))
            else:
                assert not means[b, :, t].any() and not picked[b, :, t].any() and not every[b, :, t].any()


@pytest.mark.parametrize("name", ["chunked", "dense_whole_tiles", "dense_aligned_suffix"])
def test_query_grid_row_range_is_a_slice_of_the_whole_grid(name):
    seq = SEQS[name]()
    q, _ = _inputs(seq, hq=2, dim=3)
    whole, valid = query_grid(q, seq, 4)
    part, part_valid = query_grid(q, seq, 4, rows=(2, 4))
    assert torch.equal(part, whole[:, :, 8:16]) and torch.equal(part_valid, valid[:, 8:16])
    last = seq.num_query_blocks(4)
    tail, tail_valid = query_grid(q, seq, 4, rows=(last - 1, last))  # the last tile, padded or whole
    assert torch.equal(tail, whole[:, :, -4:]) and torch.equal(tail_valid, valid[:, -4:])


# -- MoBA's gate ------------------------------------------------------------------------------------


def test_mean_pool_keys_and_gate_scores_match_loops():
    seq = SEQS["padded"]()
    q, k = _inputs(seq, seed=3)
    means = mean_pool_keys(k, seq, 10)  # 37 keys: 4 blocks, the last of 7 keys (2 real in sample 1)
    gates = gate_scores(q, means)
    for b in range(2):
        n = int(seq.kv_len[b])
        for h in range(2):
            for blk in range(4):
                keys = k[b, h, blk * 10 : min(n, blk * 10 + 10)]
                want = keys.mean(0) if keys.shape[0] else torch.zeros(5)
                assert torch.allclose(means[b, h, blk], want, atol=1e-6)
        for h in range(6):
            assert torch.allclose(gates[b, h], q[b, h] @ means[b, h // 3].T, atol=1e-5)


# -- selectors --------------------------------------------------------------------------------------


def test_topk_select_hand_computed():
    scores = torch.tensor([[2.0, 5.0, 5.0, 2.0, 5.0, 9.0, 1.0]])
    idx = lambda m: m[0].nonzero().flatten().tolist()  # noqa: E731
    assert idx(topk_select(scores, 3)) == [1, 2, 5]  # ties: lower index first
    forced = torch.tensor([[False] * 6 + [True]])
    assert idx(topk_select(scores, 3, forced=forced)) == [1, 5, 6]  # the forced entry counts toward k
    many = torch.tensor([[True, True, True, False, False, False, True]])
    assert idx(topk_select(scores, 2, forced=many)) == [0, 1, 2, 6]  # forced kept beyond k
    candidates = torch.tensor([[True, False, False, True, False, False, False]])
    assert idx(topk_select(scores, 5, candidates=candidates)) == [0, 3]  # never a non-candidate
    # a candidate scored -inf is still taken before budget runs out; non-candidates never are
    low = torch.tensor([[-math.inf, 1.0, 3.0]])
    assert idx(topk_select(low, 2, candidates=torch.tensor([[True, False, True]]))) == [0, 2]


def test_topk_select_matches_sorted_lists():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (40, 9), generator=g).float()  # many ties
    candidates = torch.rand(40, 9, generator=g) > 0.3
    forced = torch.rand(40, 9, generator=g) > 0.8
    k = torch.randint(0, 6, (40, 1), generator=g)
    got = topk_select(scores, k, candidates=candidates, forced=forced)
    for r in range(40):
        keep = {j for j in range(9) if forced[r, j]}
        others = sorted((j for j in range(9) if candidates[r, j] and j not in keep), key=lambda j: (-scores[r, j], j))
        keep |= set(others[: max(int(k[r]) - len(keep), 0)])
        assert got[r].nonzero().flatten().tolist() == sorted(keep), r


def test_threshold_select_matches_loop():
    g = torch.Generator().manual_seed(1)
    mass = torch.randint(0, 5, (60, 8), generator=g).float()  # ties and zeros
    allowed = torch.rand(60, 8, generator=g) > 0.2
    forced = torch.rand(60, 8, generator=g) > 0.8
    for tau in (0.1, 0.5, 0.9):
        got = threshold_select(mass, tau, allowed=allowed, forced=forced)
        for r in range(60):
            ok = [j for j in range(8) if allowed[r, j]]
            total = sum(float(mass[r, j]) for j in ok)
            keep = {j for j in ok if forced[r, j]}
            kept = sum(float(mass[r, j]) for j in keep)
            for j in sorted((j for j in ok if j not in keep), key=lambda j: (-mass[r, j], j)):
                if kept < tau * total:
                    keep.add(j)
                    kept += float(mass[r, j])
            assert got[r].nonzero().flatten().tolist() == sorted(keep), (tau, r)
    assert torch.equal(threshold_select(mass, 1.0, allowed=allowed, forced=forced), allowed)


def test_threshold_select_hand_computed():
    mass = torch.tensor([[0.1, 0.4, 0.2, 0.2, 0.1]])  # total 1.0
    forced = torch.tensor([[True, False, False, False, False]])
    idx = lambda m: m[0].nonzero().flatten().tolist()  # noqa: E731
    assert idx(threshold_select(mass, 0.1, forced=forced)) == [0]  # forced 0.1 is not below 0.1
    assert idx(threshold_select(mass, 0.5, forced=forced)) == [0, 1]  # 0.1 < 0.5: add 0.4, now 0.5
    # 0.5 < 0.6: the tie 0.2/0.2 goes to index 2, which crosses the target and is kept
    assert idx(threshold_select(mass, 0.6, forced=forced)) == [0, 1, 2]
