"""The block-sparse kernel's work lists: which key chunks each query tile visits, planned before
:mod:`elasticfw.kernels.block_sparse_attention` runs its kernel over them.

Per (sample, table head, tile of ``BLOCK_M`` query rows): *clean* chunks of ``BLOCK_N`` keys, which
every row of the tile sees whole (no mask at all), and *masked* chunks, the rest of what its rows
see. :func:`work_lists` is the definition (torch); :func:`work_lists_triton` builds the same lists
in one launch. Dense lists grow with the square of the sequence, so above
:data:`COMPACT_LISTS_ABOVE` bytes :func:`plan_work` builds the compact form (:class:`WorkPlan`: one
flat list with a start offset per tile; :func:`compact_lists`, :func:`work_lists_triton_compact`).
:func:`plan_work` uses the Triton builders while :data:`TRITON_WORK_LISTS` is on. Memory and
measurements: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from elasticfw.attention.layout import RowSelection, index_lists
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import cdiv
from elasticfw.kernels.block_sparse_tiles import Tiles, _chunk_size, default_tiles, flag_table

__all__ = [
    "WorkPlan",
    "compact_lists",
    "dense_list_bytes",
    "plan_work",
    "work_lists",
    "work_lists_triton",
    "work_lists_triton_compact",
]

#: key chunks a program decides per step
CHUNKS = 256

#: the work lists built by one Triton kernel (:func:`work_lists_triton`) instead of in torch
#: (:func:`work_lists`, the definition it is tested against). On one H200 at 128K with 64-row tiles:
#: XAttention's lists 0.99 ms against 10.0, NSA's 0.31 against 3.0 (``results/bench/work-lists-triton/``)
TRITON_WORK_LISTS = True
#: :func:`plan_work` builds the compact form of the lists (:class:`WorkPlan`) when the dense form would
#: take more bytes than this: 2 GiB. On an H200 at 128K (Hq 32 / Hkv 8, d 128, structured q/k) the
#: compact form's kernel took what the dense one's did (XAttention 59.5 against 59.3 ms, NSA 38.9 /
#: 38.9, MoBA 183.0 / 183.6, streaming 11.3 / 11.2) for 4-5% of the memory (XAttention 50 MB
#: against 1,074), but its two-launch plan 0.3-2.5 ms more (XAttention 1.36 against 1.04, MoBA 5.37
#: against 2.85; ``results/bench/compact-work-lists/kernel_timing.json``), so the dense form
#: stays wherever its memory is affordable
COMPACT_LISTS_ABOVE = 2 * 2**30


def work_lists(
    selection: RowSelection, seq: SeqInfo, block_m: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's work lists (module docstring) for ``selection``: ``(clean, clean_count,
    masked, masked_count)``, lists (B, H, NT, NC) int32 of key-chunk indices (chunks of ``block_n``
    keys; ``block_n`` divides the group size), counts (B, H, NT) int32."""
    sel, row_block, group_size = selection.selected, selection.row_block, selection.group_size
    batch, q_len = seq.batch, seq.q_len
    heads, groups = sel.shape[1], sel.shape[3]
    device = sel.device
    tiles = math.ceil(q_len / block_m)
    chunks = math.ceil(seq.kv_capacity / block_n)
    first_row = torch.arange(tiles, device=device) * block_m
    last_row = torch.clamp(first_row + block_m, max=q_len) - 1
    pos0 = seq.q_start[:, None] + first_row[None, :]  # (B, NT) the tiles' first and last positions
    pos1 = seq.q_start[:, None] + last_row[None, :]
    base = torch.div(seq.q_start, row_block, rounding_mode="floor")[:, None]
    r_lo = torch.div(pos0, row_block, rounding_mode="floor") - base
    r_hi = torch.div(pos1, row_block, rounding_mode="floor") - base
    span = min(sel.shape[2], (block_m + row_block - 1) // row_block + 1)
    rows = torch.minimum(r_lo[..., None] + torch.arange(span, device=device), r_hi[..., None])  # (B, NT, span)
    table = sel.expand(batch, *sel.shape[1:]) if sel.shape[0] != batch else sel
    index = rows.reshape(batch, 1, tiles * span, 1).expand(batch, heads, tiles * span, groups)
    picked = table.gather(2, index).view(batch, heads, tiles, span, groups)
    union, common = picked.any(3), picked.all(3)  # (B, H, NT, G)
    per = group_size // block_n
    if per > 1:
        union = union.repeat_interleave(per, -1)
        common = common.repeat_interleave(per, -1)
    union, common = union[..., :chunks], common[..., :chunks]
    if union.shape[-1] < chunks:  # a table narrower than the keys: the rest is not selected
        pad = chunks - union.shape[-1]
        union = torch.nn.functional.pad(union, (0, pad))
        common = torch.nn.functional.pad(common, (0, pad))
    start = torch.arange(chunks, device=device) * block_n  # (NC,)
    kv_len = seq.kv_len[:, None, None]
    reach = (start <= pos1[..., None]) & (start < kv_len)  # (B, NT, NC)
    whole = (start + block_n - 1 <= pos0[..., None]) & (start + block_n <= kv_len)
    if selection.window > 0:  # the window reaches the chunk's last key from the first position
        union = union | (start + block_n - 1 > pos0[..., None] - selection.window)[:, None]
        common = common | (start > pos1[..., None] - selection.window)[:, None]  # whole, from every row
    visit = union & reach[:, None]
    clean = common & whole[:, None] & visit
    clean_count, clean_list = index_lists(clean)
    masked_count, masked_list = index_lists(visit & ~clean)
    return clean_list, clean_count, masked_list, masked_count


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
    :func:`work_lists` returns, in one launch (``block_n``
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


@dataclass(frozen=True)
class WorkPlan:
    """The work lists of one selection over one :class:`SeqInfo` for one tile shape (:func:`plan_work`),
    kept by a caller that runs the same layout many times (the flex executor, for reusable layouts).

    Dense form (``start is None``): :func:`work_lists`' four tensors. Compact form: ``clean`` and
    ``masked`` are one flat int32 tensor holding, for each (sample, table head, tile) in order, its
    clean chunks then its masked ones, from ``start`` (B, H, NT) int64
    (:func:`compact_lists`); the counts as in the dense form."""

    clean: torch.Tensor
    clean_count: torch.Tensor
    masked: torch.Tensor
    masked_count: torch.Tensor
    block_m: int
    block_n: int
    start: torch.Tensor | None = None


def dense_list_bytes(selection: RowSelection, seq: SeqInfo, block_m: int, block_n: int) -> int:
    """The bytes of :func:`work_lists`' two dense lists: ``2 * 4 * B * H * tiles * chunks``."""
    heads = selection.selected.shape[1]
    return 8 * seq.batch * heads * cdiv(seq.q_len, block_m) * cdiv(seq.kv_capacity, block_n)


def plan_work(
    selection: RowSelection, seq: SeqInfo, tiles: Tiles | None = None, *, compact: bool | None = None
) -> WorkPlan:
    """:func:`work_lists` for ``tiles`` (``None``:
    :func:`~elasticfw.kernels.block_sparse_attention.default_tiles`; raises
    :class:`~elasticfw.errors.BackendUnavailableError` for a group size the kernel cannot chunk), in
    the compact form when ``compact`` (``None``: when the dense lists would take more than
    :data:`COMPACT_LISTS_ABOVE` bytes)."""
    if tiles is None:
        tiles = default_tiles(selection)
    block_n = _chunk_size(selection.group_size, tiles.block_n)
    if block_n is None:
        raise BackendUnavailableError(
            f"Triton block-sparse kernel: key group size {selection.group_size} is not a multiple of 16"
        )
    if compact is None:
        compact = dense_list_bytes(selection, seq, tiles.block_m, block_n) > COMPACT_LISTS_ABOVE
    if TRITON_WORK_LISTS:
        if compact:
            flat, n_clean, n_masked, start = work_lists_triton_compact(selection, seq, tiles.block_m, block_n)
            return WorkPlan(flat, n_clean, flat, n_masked, tiles.block_m, block_n, start)
        lists = work_lists_triton(selection, seq, tiles.block_m, block_n)
    else:
        lists = work_lists(selection, seq, tiles.block_m, block_n)
        if compact:
            flat, start = compact_lists(*lists)
            return WorkPlan(flat, lists[1], flat, lists[3], tiles.block_m, block_n, start)
    return WorkPlan(*lists, tiles.block_m, block_n)
