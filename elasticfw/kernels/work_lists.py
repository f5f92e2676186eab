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

The compact form (:func:`compact_lists`, the definition; :func:`work_lists_triton_compact`, two
launches: the counts, then the entries from their prefix sum) keeps only the listed chunks, one flat
list with a start offset per tile, for sequences whose dense lists would not fit
(:data:`~elasticfw.kernels.block_sparse_attention.COMPACT_LISTS_ABOVE`).

:func:`~elasticfw.kernels.block_sparse_attention.plan_work` uses the builders while
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

__all__ = ["compact_lists", "work_lists_triton", "work_lists_triton_compact"]

#: key chunks a program decides per step
CHUNKS = 256


@triton.jit
def _work_lists_kernel(
    sel_ptr, q_start_ptr, kv_len_ptr, clean_ptr, nclean_ptr, masked_ptr, nmasked_ptr, start_ptr,
    stride_sb, stride_sh, stride_sr, stride_sg,
    stride_lb, stride_lh, stride_lt, stride_lc,
    stride_cb, stride_ch, stride_ct,
    q_len, num_rows, num_groups, num_chunks, row_block, per, window, block_m, block_n,
    CHUNKS: tl.constexpr, WRITE: tl.constexpr, COUNT: tl.constexpr, COMPACT: tl.constexpr,
):
    # dense lists: WRITE and COUNT; the compact form: a COUNT pass, then a WRITE pass (COMPACT) from the
    # start offsets the counts give, a tile's masked chunks after its clean ones
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    c_off = b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch + tile * stride_ct
    q_start = tl.load(q_start_ptr + b).to(tl.int64)
    kv_len = tl.load(kv_len_ptr + b).to(tl.int64)
    pos0 = q_start + tile * block_m  # the tile's first and last positions
    pos1 = q_start + tl.minimum(tile * block_m + block_m, q_len) - 1
    base = q_start // row_block
    r_lo = tl.minimum(pos0 // row_block - base, num_rows - 1)
    r_hi = tl.minimum(pos1 // row_block - base, num_rows - 1)
    s_base = sel_ptr + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
    if COMPACT:
        clean_base = tl.load(start_ptr + c_off)
        masked_base = clean_base + tl.load(nclean_ptr + c_off)
    else:
        clean_base = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + tile.to(tl.int64) * stride_lt
        masked_base = clean_base
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
        if WRITE:
            slot_c = n_clean + tl.cumsum(clean_i, axis=0) - 1
            slot_m = n_masked + tl.cumsum(masked_i, axis=0) - 1
            tl.store(clean_ptr + clean_base + slot_c.to(tl.int64) * stride_lc, c, mask=clean)
            tl.store(masked_ptr + masked_base + slot_m.to(tl.int64) * stride_lc, c, mask=masked)
        n_clean += tl.sum(clean_i, axis=0)
        n_masked += tl.sum(masked_i, axis=0)
    if COUNT:
        tl.store(nclean_ptr + c_off, n_clean)
        tl.store(nmasked_ptr + c_off, n_masked)


def _launch(selection: RowSelection, seq: SeqInfo, block_m: int, block_n: int, clean: torch.Tensor,
            n_clean: torch.Tensor, masked: torch.Tensor, n_masked: torch.Tensor, start: torch.Tensor,
            list_strides: list[int], *, write: bool, count: bool, compact: bool) -> None:
    sel = selection.selected
    tiles, heads, batch = n_clean.shape[2], sel.shape[1], seq.batch
    flags = flag_table(sel, batch)
    _work_lists_kernel[(tiles, heads, batch)](
        flags, seq.q_start.contiguous(), seq.kv_len.contiguous(), clean, n_clean, masked, n_masked, start,
        *flags.stride(), *list_strides, *n_clean.stride(),
        seq.q_len, sel.shape[2], sel.shape[3], math.ceil(seq.kv_capacity / block_n), selection.row_block,
        selection.group_size // block_n, selection.window, block_m, block_n,
        CHUNKS=CHUNKS, WRITE=write, COUNT=count, COMPACT=compact,
    )


def _counts(selection: RowSelection, seq: SeqInfo, block_m: int, block_n: int, caller: str) -> tuple[torch.Tensor, torch.Tensor]:
    if selection.group_size % block_n:
        raise ValueError(f"{caller}: block_n {block_n} must divide the group size {selection.group_size}")
    shape = (seq.batch, selection.selected.shape[1], math.ceil(seq.q_len / block_m))
    n_clean = torch.zeros(shape, dtype=torch.int32, device=selection.selected.device)
    return n_clean, torch.zeros_like(n_clean)


def work_lists_triton(
    selection: RowSelection, seq: SeqInfo, block_m: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(clean, clean_count, masked, masked_count)``: what
    :func:`~elasticfw.kernels.block_sparse_attention.work_lists` returns, in one launch (``block_n``
    divides the group size)."""
    n_clean, n_masked = _counts(selection, seq, block_m, block_n, "work_lists_triton")
    chunks = math.ceil(seq.kv_capacity / block_n)
    clean = torch.zeros(*n_clean.shape, chunks, dtype=torch.int32, device=n_clean.device)
    masked = torch.zeros_like(clean)
    if n_clean.numel() and selection.selected.shape[2]:
        _launch(selection, seq, block_m, block_n, clean, n_clean, masked, n_masked, n_clean, list(clean.stride()),
                write=True, count=True, compact=False)
    return clean, n_clean, masked, n_masked


def compact_lists(
    clean: torch.Tensor, clean_count: torch.Tensor, masked: torch.Tensor, masked_count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compact form of dense work lists (the definition, torch): ``(flat, start)``, ``flat`` int32
    holding every (sample, head, tile)'s clean chunks then its masked ones, tile after tile in
    row-major order, ``start`` (B, H, NT) int64 where each tile's entries begin. Memory: 4 bytes per
    listed chunk instead of per (tile, chunk)."""
    chunks = clean.shape[-1]
    j = torch.arange(chunks, device=clean.device)
    keep = torch.cat([j < clean_count[..., None], j < masked_count[..., None]], -1)
    flat = torch.cat([clean, masked], -1)[keep]  # boolean indexing keeps row-major order
    per_tile = (clean_count.long() + masked_count.long()).flatten()
    start = (per_tile.cumsum(0) - per_tile).view(clean_count.shape)
    return flat.contiguous(), start


def work_lists_triton_compact(
    selection: RowSelection, seq: SeqInfo, block_m: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(flat, clean_count, masked_count, start)``: :func:`compact_lists` of
    :func:`work_lists_triton`'s lists without the dense ones, in two launches (the counts, then the
    entries from the offsets their prefix sum gives) and one host read of the total."""
    n_clean, n_masked = _counts(selection, seq, block_m, block_n, "work_lists_triton_compact")
    device = n_clean.device
    start = torch.zeros(n_clean.shape, dtype=torch.int64, device=device)
    if not n_clean.numel() or not selection.selected.shape[2]:
        return torch.zeros(1, dtype=torch.int32, device=device)[:0], n_clean, n_masked, start
    _launch(selection, seq, block_m, block_n, n_clean, n_clean, n_masked, n_masked, start, [0, 0, 0, 1],
            write=False, count=True, compact=False)
    per_tile = (n_clean.long() + n_masked.long()).flatten()
    ends = per_tile.cumsum(0)
    start = (ends - per_tile).view(n_clean.shape)
    total = int(ends[-1])
    flat = torch.empty(max(total, 1), dtype=torch.int32, device=device)[:total]  # never a null pointer
    if total:
        _launch(selection, seq, block_m, block_n, flat, n_clean, flat, n_masked, start, [0, 0, 0, 1],
                write=True, count=False, compact=True)
    return flat, n_clean, n_masked, start
