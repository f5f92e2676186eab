"""Fuzzing the block-sparse kernel's work lists (plain torch, no kernel) against their definition.

For a random selection (flag rows of ``row_block`` positions over groups of ``group_size`` keys,
an optional sliding window), SeqInfo (prefill, chunked prefill with unaligned starts, decode,
key padding) and tile shape, per (sample, head, tile of ``block_m`` rows, chunk of ``block_n``
keys), computed here pair by pair from the RowSelection definition:

* the chunk is listed (clean or masked) if some real row of the tile sees some key of it, and
  only if some row selects its group (or some row's window reaches it) and it starts at or before
  the tile's last position and below ``kv_len`` (a listed chunk may still be wholly masked: one
  row selects it, another reaches it);
* it is *clean* only if every row of the tile sees every key of it (so the kernel may skip all
  masks), and every such chunk wholly before the tile's first position and below ``kv_len`` is
  clean (so the unmasked loop is not starved);
* each list is ascending without repeats, and nothing is listed twice.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticfw.attention.layout import RowSelection
from elasticfw.attention.seq import SeqInfo

pytest.importorskip("triton")


@st.composite
def cases(draw):
    block_n = draw(st.sampled_from([16, 32]))
    group_size = block_n * draw(st.sampled_from([1, 2]))
    block_m = draw(st.sampled_from([16, 32, 64]))
    row_block = draw(st.sampled_from([1, 16, 32]))
    window = draw(st.sampled_from([0, 0, 20, 50]))
    cap = draw(st.integers(20, 130))
    batch = draw(st.integers(1, 2))
    kv_len = [draw(st.integers(1, cap)) for _ in range(batch)]
    q_len = draw(st.integers(1, min(kv_len)))
    q_start = [n - q_len for n in kv_len]  # the queries are each sample's last q_len positions
    seq = SeqInfo(torch.tensor(q_start), torch.tensor(kv_len), q_len, cap)
    heads = draw(st.integers(1, 2))
    rows = seq.num_query_blocks(row_block)
    groups = math.ceil(cap / group_size)
    density = draw(st.sampled_from([0.2, 0.6, 1.0]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    table = torch.rand(draw(st.sampled_from([1, batch])), heads, rows, groups, generator=g) < density
    return RowSelection(table, group_size, row_block=row_block, window=window), seq, block_m, block_n


def _sees(selection, seq, b, h, i, j):
    pos = int(seq.q_start[b]) + i
    if j > pos or j >= int(seq.kv_len[b]):
        return False
    table = selection.selected[min(b, selection.selected.shape[0] - 1), h]
    row = pos // selection.row_block - int(seq.q_start[b]) // selection.row_block
    return bool(table[row, j // selection.group_size]) or (selection.window > 0 and j > pos - selection.window)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_work_lists_follow_the_definition(case):
    from elasticfw.kernels.work_lists import work_lists

    selection, seq, block_m, block_n = case
    clean, n_clean, masked, n_masked = work_lists(selection, seq, block_m, block_n)
    tiles = math.ceil(seq.q_len / block_m)
    chunks = math.ceil(seq.kv_capacity / block_n)
    for b in range(seq.batch):
        for h in range(selection.selected.shape[1]):
            for t in range(tiles):
                rows = range(t * block_m, min((t + 1) * block_m, seq.q_len))
                c_list = clean[b, h, t, : n_clean[b, h, t]].tolist()
                m_list = masked[b, h, t, : n_masked[b, h, t]].tolist()
                assert c_list == sorted(set(c_list)) and m_list == sorted(set(m_list))
                assert not set(c_list) & set(m_list)
                for c in range(chunks):
                    keys = range(c * block_n, min((c + 1) * block_n, seq.kv_capacity))
                    seen = [[_sees(selection, seq, b, h, i, j) for j in keys] for i in rows]
                    some, every = any(map(any, seen)), all(map(all, seen)) and len(keys) == block_n
                    listed = c in c_list or c in m_list
                    if some:
                        assert listed, (b, h, t, c)
                    if listed:
                        table = selection.selected[min(b, selection.selected.shape[0] - 1), h]
                        q0 = int(seq.q_start[b])
                        first, last = q0 + rows[0], q0 + rows[-1]
                        flag_rows = {p // selection.row_block - q0 // selection.row_block for p in range(first, last + 1)}
                        chosen = any(bool(table[r, (c * block_n) // selection.group_size]) for r in flag_rows)
                        windowed = selection.window > 0 and keys[-1] > first - selection.window
                        assert chosen or windowed, (b, h, t, c)
                        assert keys[0] <= last and keys[0] < int(seq.kv_len[b]), (b, h, t, c)
                    if c in c_list:
                        assert every, (b, h, t, c)
                    elif every and c in m_list:  # seen whole by every row yet masked: only a chunk the
                        # definition leaves clean by position (every row's keys below the first row's)
                        first = int(seq.q_start[b]) + rows[0]
                        assert not (keys[-1] <= first and keys[-1] < int(seq.kv_len[b])), (b, h, t, c)


def test_index_lists_by_hand_and_against_nonzero():
    """The compaction every block list uses (FlexAttention's BlockMask, the kernel's work lists)."""
    from elasticfw.attention.layout import BlockLayout, index_lists, kv_block_lists

    count, idx = index_lists(torch.tensor([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0]], dtype=torch.bool))
    assert count.tolist() == [3, 0] and idx.tolist() == [[1, 2, 4, 0, 0], [0, 0, 0, 0, 0]]
    assert count.dtype == idx.dtype == torch.int32
    mask = torch.rand(2, 3, 7, 40, generator=torch.Generator().manual_seed(0)) < 0.3
    count, idx = kv_block_lists(BlockLayout(mask, 16))
    for row, n, li in zip(mask.reshape(-1, 40), count.reshape(-1), idx.reshape(-1, 40)):
        assert li[:n].tolist() == row.nonzero().flatten().tolist()
