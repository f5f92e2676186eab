"""The Triton work-list builder (elasticfw.kernels.work_lists) against the definition
(elasticfw.kernels.work_lists.work_lists, torch) and a hand-checked case, under Triton's
interpreter (on CUDA where there is one, and at 32K with the ``gpu`` mark): the four lists
equal, entry for entry, over tiles that cover one or several layout
rows or part of one, query starts off the tile grid, padded keys, decode rows, windows, tables
shared by the batch, narrower or wider than the keys, and groups read in several chunks; the same
for the compact form (one flat list and a start offset per tile)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from elasticfw.attention.layout import RowSelection
from elasticfw.attention.seq import SeqInfo
from elasticfw.kernels import triton_unavailable

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(triton_unavailable(DEV) is not None, reason=f"Triton cannot run here: {triton_unavailable(DEV)}")


def _seq(q_start, kv_len, q_len, cap):
    return SeqInfo(torch.tensor(q_start), torch.tensor(kv_len), q_len, cap)


CASES = {
    # name: (seq, table batch, heads, row_block, group, window, extra groups, block_m, block_n, density)
    "one_row_per_tile": (lambda: SeqInfo.dense(1, 256, 256), 1, 3, 64, 64, 0, 0, 64, 64, 0.4),
    "two_rows_per_tile": (lambda: SeqInfo.dense(2, 256, 256), 2, 2, 32, 32, 0, 0, 64, 32, 0.5),
    "tile_inside_a_row": (lambda: _seq([5], [140], 135, 140), 1, 2, 64, 64, 0, 0, 32, 32, 0.7),
    "chunked_unaligned": (lambda: _seq([37, 50], [170, 118], 70, 170), 1, 2, 16, 16, 0, 0, 32, 16, 0.6),
    "padded_keys": (lambda: _seq([0, 0], [150, 83], 150, 150), 2, 2, 16, 16, 0, 0, 32, 16, 0.7),
    "decode": (lambda: _seq([149, 96], [150, 97], 1, 150), 2, 4, 16, 16, 0, 0, 16, 16, 0.5),
    "per_token_rows_window": (lambda: _seq([0, 30], [150, 140], 110, 150), 2, 2, 1, 32, 24, 0, 32, 16, 0.3),
    "window_wider_than_tile": (lambda: _seq([20], [200], 180, 200), 1, 1, 32, 32, 100, 0, 32, 16, 0.1),
    "group_in_four_chunks": (lambda: SeqInfo.dense(1, 300, 300), 1, 2, 64, 64, 0, 0, 64, 16, 0.5),
    "narrow_table": (lambda: SeqInfo.dense(1, 200, 200), 1, 2, 32, 32, 0, -2, 32, 32, 0.8),
    "wide_table": (lambda: SeqInfo.dense(1, 200, 200), 1, 2, 32, 32, 0, 3, 32, 32, 0.8),
    "many_chunks": (lambda: SeqInfo.dense(1, 1100, 1100), 1, 1, 16, 16, 40, 0, 64, 16, 0.3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_work_lists_equal_the_definition(name):
    from elasticfw.kernels.work_lists import work_lists, work_lists_triton

    make, table_batch, heads, row_block, group, window, extra, block_m, block_n, density = CASES[name]
    seq = make()
    rows = seq.num_query_blocks(row_block)
    groups = math.ceil(seq.kv_capacity / group) + extra
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    selected = (torch.rand(table_batch, heads, rows, groups, generator=g) < density).to(DEV)
    seq = SeqInfo(seq.q_start.to(DEV), seq.kv_len.to(DEV), seq.q_len, seq.kv_capacity)
    selection = RowSelection(selected, group, row_block=row_block, window=window)
    want = work_lists(selection, seq, block_m, block_n)
    got = work_lists_triton(selection, seq, block_m, block_n)
    for label, a, b in zip(("clean", "clean_count", "masked", "masked_count"), got, want):
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), label
    assert int(want[1].sum()) + int(want[3].sum()) > 0


@pytest.mark.parametrize("name", list(CASES))
def test_compact_lists_hold_each_tiles_lists(name):
    """The compact form (one flat list, tile after tile, clean then masked, from a start offset) built
    by the two-launch Triton builder equals :func:`compact_lists` of the definition's dense lists,
    and both hold each tile's lists, read here tile by tile from the dense ones."""
    from elasticfw.kernels.work_lists import compact_lists, work_lists, work_lists_triton_compact

    make, table_batch, heads, row_block, group, window, extra, block_m, block_n, density = CASES[name]
    seq = make()
    groups = math.ceil(seq.kv_capacity / group) + extra
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    selected = (torch.rand(table_batch, heads, seq.num_query_blocks(row_block), groups, generator=g) < density).to(DEV)
    seq = SeqInfo(seq.q_start.to(DEV), seq.kv_len.to(DEV), seq.q_len, seq.kv_capacity)
    selection = RowSelection(selected, group, row_block=row_block, window=window)
    clean, n_clean, masked, n_masked = work_lists(selection, seq, block_m, block_n)
    flat, start = compact_lists(clean, n_clean, masked, n_masked)
    got = work_lists_triton_compact(selection, seq, block_m, block_n)
    for label, a, b in zip(("flat", "clean_count", "masked_count", "start"), got, (flat, n_clean, n_masked, start)):
        assert a.dtype == b.dtype and torch.equal(a, b), label
    offset = 0
    for b, h, t in itertools.product(*map(range, n_clean.shape)):
        nc, nm = int(n_clean[b, h, t]), int(n_masked[b, h, t])
        assert int(start[b, h, t]) == offset
        assert flat[offset:offset + nc].tolist() == clean[b, h, t, :nc].tolist()
        assert flat[offset + nc:offset + nc + nm].tolist() == masked[b, h, t, :nm].tolist()
        offset += nc + nm
    assert flat.numel() == offset > 0


def test_triton_work_lists_by_hand():
    """The definition's hand-checked case: 4-row tiles, 2-key chunks, one 4-key block per row; and its
    compact form."""
    from elasticfw.kernels.work_lists import work_lists_triton, work_lists_triton_compact

    seq = SeqInfo.dense(1, 12, 12, device=DEV)
    blocks = torch.tensor([[[[1, 0, 0], [1, 1, 0], [0, 1, 1]]]], dtype=torch.bool, device=DEV)
    clean, n_clean, masked, n_masked = work_lists_triton(RowSelection(blocks, 4, row_block=4), seq, 4, 2)
    lists = lambda li, n, t: li[0, 0, t, : n[0, 0, t]].tolist()  # noqa: E731
    assert [lists(clean, n_clean, t) for t in range(3)] == [[], [0, 1], [2, 3]]
    assert [lists(masked, n_masked, t) for t in range(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="divide the group size"):
        work_lists_triton(RowSelection(blocks, 4, row_block=4), seq, 4, 8)
    flat, n_clean2, n_masked2, start = work_lists_triton_compact(RowSelection(blocks, 4, row_block=4), seq, 4, 2)
    assert flat.tolist() == [0, 1, 0, 1, 2, 3, 2, 3, 4, 5] and start.tolist() == [[[0, 2, 6]]]
    assert torch.equal(n_clean2, n_clean) and torch.equal(n_masked2, n_masked)
    with pytest.raises(ValueError, match="work_lists_triton_compact: block_n 8 must divide"):
        work_lists_triton_compact(RowSelection(blocks, 4, row_block=4), seq, 4, 8)


def test_plan_work_takes_the_triton_builder_by_default(monkeypatch):
    """``TRITON_WORK_LISTS`` (on by default) routes plan_work through the Triton builder, off through
    torch's definition; the attention over either's lists equals a float64 masked-softmax reference
    built from the selection's flags."""
    import elasticfw.kernels.block_sparse_attention as bsa
    import elasticfw.kernels.work_lists as wl

    assert wl.TRITON_WORK_LISTS is True
    n = 192
    seq = SeqInfo.dense(1, n, n, device=DEV)
    g = torch.Generator().manual_seed(2)
    flags = torch.rand(1, 2, 3, 3, generator=g) < 0.6
    flags |= torch.eye(3, dtype=torch.bool)  # every row sees its own block: no empty row
    selection = RowSelection(flags.to(DEV), 64, row_block=64)
    q, k, v = (torch.randn(1, h, n, 16, generator=g).to(DEV) for h in (4, 2, 2))
    # the definition: query head h (table head h // 2, KV head h // 2) sees key j iff j <= i and
    # j's block is selected by i's block
    blocks = torch.arange(n) // 64
    seen = flags[0][:, blocks][:, :, blocks] & torch.ones(n, n, dtype=torch.bool).tril()  # (2, n, n)
    qd, kd, vd = (t.cpu().double() for t in (q, k, v))
    kd, vd = kd.repeat_interleave(2, 1), vd.repeat_interleave(2, 1)
    scores = (qd @ kd.transpose(-1, -2) * 0.25).masked_fill(~seen.repeat_interleave(2, 0), float("-inf"))
    want = torch.softmax(scores, -1) @ vd
    triton_calls, torch_calls = [], []
    real_triton, real_torch = wl.work_lists_triton, wl.work_lists
    monkeypatch.setattr(wl, "work_lists_triton", lambda *a: triton_calls.append(a) or real_triton(*a))
    monkeypatch.setattr(wl, "work_lists", lambda *a: torch_calls.append(a) or real_torch(*a))
    on = bsa.row_selection_attention(q, k, v, selection, seq, scale=0.25)
    assert (len(triton_calls), len(torch_calls)) == (1, 0)
    monkeypatch.setattr(wl, "TRITON_WORK_LISTS", False)
    off = bsa.row_selection_attention(q, k, v, selection, seq, scale=0.25)
    assert (len(triton_calls), len(torch_calls)) == (1, 1)
    for out in (on, off):
        torch.testing.assert_close(out[0].cpu().double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(on[0], off[0], rtol=0, atol=0)
    torch.testing.assert_close(on[1], off[1], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_m, window", [(64, 0), (128, 0), (64, 512)])
def test_gpu_32k_xattention_like_lists(block_m, window):
    """At 32K tokens, 32 table heads of 64-token blocks at about 20% density (an XAttention-like
    layout: every row keeps its diagonal), with and without NSA's 512-token window: the compiled
    kernel's lists equal torch's, and so does its compact form."""
    from elasticfw.kernels.work_lists import (
        compact_lists,
        work_lists,
        work_lists_triton,
        work_lists_triton_compact,
    )

    n, bs = 32768, 64
    seq = SeqInfo.dense(1, n, n, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = n // bs
    selected = torch.rand(1, 32, rows, rows, generator=g, device="cuda") < 0.2
    selected |= torch.eye(rows, dtype=torch.bool, device="cuda")
    selection = RowSelection(selected, bs, row_block=bs, window=window)
    want = work_lists(selection, seq, block_m, bs)
    got = work_lists_triton(selection, seq, block_m, bs)
    for label, a, b in zip(("clean", "clean_count", "masked", "masked_count"), got, want):
        assert torch.equal(a, b), label
    flat, start = compact_lists(*want)
    got = work_lists_triton_compact(selection, seq, block_m, bs)
    for label, a, b in zip(("flat", "clean_count", "masked_count", "start"), got, (flat, want[1], want[3], start)):
        assert torch.equal(a, b), label
