"""The block-sparse kernel's work lists built by one Triton kernel (no (B, H, tiles, chunks) temporaries).

:func:`elasticfw.kernels.block_sparse_attention.work_lists` is the definition (torch): per
(sample, table head, tile of ``block_m`` query rows), the key chunks of ``block_n`` keys the tile
visits, split into *clean* chunks (selected by every row of the tile or inside every row's window,
wholly at or before the tile's first position and below ``kv_len``) and *masked* ones (the rest of
what its rows see, up to its causal limit and ``kv_len``). The torch version gathers the tile's
flag rows into a (B, H, tiles, span, groups) tensor, reduces it, and compacts two (B, H, tiles,
chunks) masks with a cumulative sum and a scatter: at 128K tokens, 32 table heads and 64-row tiles
that is several passes over 134M-entry tensors.

:func:`work_lists_triton` computes the same lists with one program per (tile, table head, sample):
it reads the tile's flag rows once, ``CHUNKS`` chunks at a time, and writes each list compacted
(a prefix sum within the step and a running offset). Output: the same four tensors, equal to the
definition's (entries past a list's count are 0, as there).

:func:`~elasticfw.kernels.block_sparse_attention.plan_work` uses it while
:data:`elasticfw.kernels.block_sparse_attention.TRITON_WORK_LISTS` is on (the default). On one H200
at 128K (Llama-3.1-8B shape, structured inputs, 64-row tiles) it built XAttention's lists in 0.99 ms
against torch's 10.0, NSA's in 0.31 against 3.0, MoBA's in 2.9 against 4.8 and streaming's in 0.15
against 1.9, entry for entry the same (``results/bench/issue10-s10/variants/kernel_timing.json``).
It is tested against the definition under Triton's interpreter and at 32K on a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from elasticfw.attention.layout import RowSelection
from elasticfw.attention.seq import SeqInfo
from elasticfw.kernels.block_sparse_attention import flag_table

__all__ = ["work_lists_triton"]

#: key chunks a program decides per step
CHUNKS = 256


@triton.jit
def _work_lists_kernel(
    sel_ptr, q_start_ptr, kv_len_ptr, clean_ptr, nclean_ptr, masked_ptr, nmasked_ptr,
    stride_sb, stride_sh, stride_sr, stride_sg,
    stride_lb, stride_lh, stride_lt, stride_lc,
    stride_cb, stride_ch, stride_ct,
    q_len, num_rows, num_groups, num_chunks, row_block, per, window, block_m, block_n,
    CHUNKS: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(q_start_ptr + b).to(tl.int64)
    kv_len = tl.load(kv_len_ptr + b).to(tl.int64)
    pos0 = q_start + tile * block_m  # the tile's first and last positions
    pos1 = q_start + tl.minimum(tile * block_m + block_m, q_len) - 1
    base = q_start // row_block
    r_lo = tl.minimum(pos0 // row_block - base, num_rows - 1)
    r_hi = tl.minimum(pos1 // row_block - base, num_rows - 1)
    s_base = sel_ptr + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
    l_base = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + tile.to(tl.int64) * stride_lt
    n_clean = 0
    n_masked = 0
    for c0 in range(0, num_chunks, CHUNKS):
        c = c0 + tl.arange(0, CHUNKS)
        exists = c < num_chunks
        g = c // per
        has_group = exists & (g < num_groups)  # a table narrower than the keys: not selected
        union = tl.zeros((CHUNKS,), tl.int1)
        common = has_group
        for r in range(r_lo, r_hi + 1):
            # r is int64 (it counts from q_start, loaded as int64)
            f = tl.load(s_base + r * stride_sr + g.to(tl.int64) * stride_sg, mask=has_group, other=0) != 0
            union = union | f
            common = common & f
        start = c.to(tl.int64) * block_n
        if window > 0:  # the window reaches the chunk's last key from the first position; whole from every row
            union = union | (start + block_n - 1 > pos0 - window)
            common = common | (start > pos1 - window)
        reach = (start <= pos1) & (start < kv_len)
        whole = (start + block_n - 1 <= pos0) & (start + block_n <= kv_len)
        visit = union & reach & exists
        clean = common & whole & visit
        masked = visit & ~clean
        clean_i = clean.to(tl.int32)
        masked_i = masked.to(tl.int32)
        slot_c = n_clean + tl.cumsum(clean_i, axis=0) - 1
        slot_m = n_masked + tl.cumsum(masked_i, axis=0) - 1
        tl.store(clean_ptr + l_base + slot_c.to(tl.int64) * stride_lc, c, mask=clean)
        tl.store(masked_ptr + l_base + slot_m.to(tl.int64) * stride_lc, c, mask=masked)
        n_clean += tl.sum(clean_i, axis=0)
        n_masked += tl.sum(masked_i, axis=0)
    c_off = b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch + tile * stride_ct
    tl.store(nclean_ptr + c_off, n_clean)
    tl.store(nmasked_ptr + c_off, n_masked)


def work_lists_triton(
    selection: RowSelection, seq: SeqInfo, block_m: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(clean, clean_count, masked, masked_count)``: what
    :func:`~elasticfw.kernels.block_sparse_attention.work_lists` returns, in one launch (``block_n``
    divides the group size)."""
    sel, row_block, group_size = selection.selected, selection.row_block, selection.group_size
    if group_size % block_n:
        raise ValueError(f"work_lists_triton: block_n {block_n} must divide the group size {group_size}")
    batch, q_len = seq.batch, seq.q_len
    heads, rows, groups = sel.shape[1], sel.shape[2], sel.shape[3]
    tiles = math.ceil(q_len / block_m)
    chunks = math.ceil(seq.kv_capacity / block_n)
    device = sel.device
    clean = torch.zeros(batch, heads, tiles, chunks, dtype=torch.int32, device=device)
    masked = torch.zeros_like(clean)
    n_clean = torch.zeros(batch, heads, tiles, dtype=torch.int32, device=device)
    n_masked = torch.zeros_like(n_clean)
    if batch * heads * tiles == 0 or rows == 0:
        return clean, n_clean, masked, n_masked
    flags = flag_table(sel, batch)
    _work_lists_kernel[(tiles, heads, batch)](
        flags, seq.q_start.contiguous(), seq.kv_len.contiguous(), clean, n_clean, masked, n_masked,
        *flags.stride(), *clean.stride(), *n_clean.stride(),
        q_len, rows, groups, chunks, row_block, group_size // block_n, selection.window, block_m, block_n,
        CHUNKS=CHUNKS,
    )
    return clean, n_clean, masked, n_masked
