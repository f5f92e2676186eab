"""Query-gather attention (Triton) for per-row key-group selections: upstream MoBA's varlen scheme.

Computes what :mod:`elasticfw.kernels.block_sparse_attention` computes for a
:class:`~elasticfw.attention.layout.RowSelection` with ``row_block = 1`` and no window, the other way
round: per key group, the query rows that chose it (``moba_attn_varlen``), so the work is the
selected pairs, not a tile's union. :func:`gather_plan` sorts the selected (row, group) entries
into tiles (torch); ``merge="passes"`` (the default) runs one launch per rank and merges into
float32 accumulators by log-sum-exp, ``merge="entries"`` (:func:`gather_entry_plan`) one launch of
per-entry partials and a second that merges them. Forward only. Memory, measurements and the
choice of the default: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

from elasticfw.attention.layout import RowSelection
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import interpreting, next_pow2
from elasticfw.kernels.block_sparse_attention import (
    Tiles,
    attend_chunk,
    check_inputs,
    fit_tiles,
    kv_descriptors,
    load_rows,
)

__all__ = ["EntryPlan", "GatherPlan", "gather_entry_plan", "gather_plan", "gathered_selection_attention",
           "unsupported_selection"]

#: tiles of the gathered rows: 128 rows, 128-key chunks, as the block-sparse kernel's defaults
DEFAULT_TILES = Tiles(block_m=128, block_n=128, num_warps=8, num_stages=3)
_LOG2E = 1.4426950408889634


def unsupported_selection(selection: RowSelection) -> str | None:
    """``None`` when :func:`gathered_selection_attention` computes ``selection``, else why not."""
    if selection.row_block != 1:
        return f"it gathers per-row selections (row_block 1), not rows of {selection.row_block} positions"
    if selection.window > 0:
        return "it does not run a sliding window"
    return None


@dataclass(frozen=True)
class GatherPlan:
    """Sorted entries and their tiles (module docstring)."""

    rows: torch.Tensor  # (E,) int32 query row of each entry, in tile order
    tile_start: torch.Tensor  # (T,) int32 first entry of each tile
    tile_count: torch.Tensor  # (T,) int32 rows in each tile
    tile_b: torch.Tensor  # (T,) int32
    tile_h: torch.Tensor  # (T,) int32 table head
    tile_g: torch.Tensor  # (T,) int32 key group
    pass_bounds: list[int]  # tiles [pass_bounds[r], pass_bounds[r + 1]) belong to rank r


def gather_plan(selection: RowSelection, batch: int, block_m: int) -> GatherPlan:
    """The entries of ``selection`` (its table expanded to ``batch`` samples) in tiles of up to
    ``block_m`` rows (module docstring). Reads the number of entries and of ranks from the device.

    Every entry is encoded as one int64 sort key ``(((rank * B + b) * H + h) * G + g) * Sq + row``,
    so that one sort of the keys orders the entries and the sorted keys themselves give each
    entry's row and segment (no gather of per-entry columns by the sort's permutation)."""
    sel = selection.selected
    if sel.shape[0] != batch:
        sel = sel.expand(batch, *sel.shape[1:])
    _, heads, q_len, groups = sel.shape
    device = sel.device
    flat = sel.reshape(-1).nonzero().squeeze(1)  # ascending: sorted by (b, h, row, g)
    n = flat.numel()
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        return GatherPlan(empty, empty, empty, empty, empty, empty, [0])
    index = torch.arange(n, device=device)
    row_id = flat // groups  # (b * H + h) * Sq + row
    g = flat - row_id * groups
    # a row's entries are consecutive: the rank is the entry's place after the row's first entry
    # (1-D scans only: torch's scans along a short last dimension, and its cummax, are slow on CUDA)
    rank = index - _first_of_runs(row_id, index)
    bh = row_id // q_len
    key = ((rank * (batch * heads) + bh) * groups + g) * q_len + (row_id - bh * q_len)
    key = key.sort().values
    segment = key // q_len  # (rank, b, h, g)
    starts, counts = _segment_tiles(segment, index, block_m)
    tile_segment = segment[starts]
    tile_rank, tile_bh = tile_segment // (batch * heads * groups), tile_segment // groups % (batch * heads)
    ranks = int(tile_rank[-1].item()) + 1
    bounds = torch.searchsorted(tile_rank, torch.arange(ranks + 1, device=device)).tolist()
    return GatherPlan(_int32(key - segment * q_len), _int32(starts), _int32(counts), _int32(tile_bh // heads),
                      _int32(tile_bh % heads), _int32(tile_segment % groups), [int(x) for x in bounds])


@dataclass(frozen=True)
class EntryPlan:
    """The entries of one launch over every rank: tiles of one (sample, table head, group) and up
    to ``block_m`` rows, each entry's slot (its place in row-major order, where a row's entries are
    consecutive) and each table row's first slot (``row_ptr``, one more than the rows)."""

    rows: torch.Tensor  # (E,) int32 query row of each entry, in tile order
    slots: torch.Tensor  # (E,) int32 the entry's place in row-major order
    tile_start: torch.Tensor  # (T,) int32
    tile_count: torch.Tensor  # (T,) int32
    tile_b: torch.Tensor  # (T,) int32
    tile_h: torch.Tensor  # (T,) int32 table head
    tile_g: torch.Tensor  # (T,) int32 key group
    row_ptr: torch.Tensor  # (B * H * Sq + 1,) int32
    max_entries: int  # the most entries of one row


def gather_entry_plan(selection: RowSelection, batch: int, block_m: int) -> EntryPlan:
    """:func:`gather_plan` without the ranks, for ``merge="entries"``: the entries sorted by (sample,
    table head, group, row) through one sort of int64 keys, whose permutation is each entry's slot."""
    sel = selection.selected
    if sel.shape[0] != batch:
        sel = sel.expand(batch, *sel.shape[1:])
    _, heads, q_len, groups = sel.shape
    device = sel.device
    per_row = (sel != 0).sum(-1, dtype=torch.int32).reshape(-1)  # flags may be uint8 of any nonzero value
    row_ptr = torch.zeros(per_row.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(per_row, 0, out=row_ptr[1:])
    flat = sel.reshape(-1).nonzero().squeeze(1)  # ascending: row-major, a row's entries consecutive
    n = flat.numel()
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        return EntryPlan(empty, empty, empty, empty, empty, empty, empty, _int32(row_ptr), 0)
    row_id = flat // groups  # (b * H + h) * Sq + row
    bh = row_id // q_len
    key = (bh * groups + (flat - row_id * groups)) * q_len + (row_id - bh * q_len)
    key, order = key.sort()
    segment = key // q_len  # (b, h, g)
    starts, counts = _segment_tiles(segment, torch.arange(n, device=device), block_m)
    tile_segment = segment[starts]
    tile_bh = tile_segment // groups
    return EntryPlan(_int32(key - segment * q_len), _int32(order), _int32(starts), _int32(counts),
                     _int32(tile_bh // heads), _int32(tile_bh % heads), _int32(tile_segment % groups),
                     _int32(row_ptr), int(per_row.max().item()))


def _segment_tiles(segment: torch.Tensor, index: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first entry, entries) of each tile: runs of equal ``segment`` (sorted) cut every ``block_m``."""
    new_segment = torch.ones(segment.numel(), dtype=torch.bool, device=segment.device)
    new_segment[1:] = segment[1:] != segment[:-1]
    new_tile = new_segment | ((index - _first_of_runs(segment, index, new_segment)) % block_m == 0)
    starts = new_tile.nonzero().squeeze(1)
    return starts, torch.diff(starts, append=torch.tensor([segment.numel()], device=segment.device))


def _first_of_runs(values: torch.Tensor, index: torch.Tensor, new_run: torch.Tensor | None = None) -> torch.Tensor:
    """For each position of ``values`` (runs of equal values), the index of its run's first position
    (``new_run``: where a run starts, when the caller has it)."""
    if new_run is None:
        new_run = torch.ones(values.numel(), dtype=torch.bool, device=values.device)
        new_run[1:] = values[1:] != values[:-1]
    return index[new_run][new_run.cumsum(0) - 1]


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


@triton.jit
def _tile_partial(
    t, head_in_table, q_ptr, k_ptr, v_ptr, rows_ptr, start_ptr, count_ptr, tb_ptr, th_ptr, tg_ptr, keep_ptr,
    q_start_ptr, kv_len_ptr, k_desc, v_desc,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    k_rows_b, k_rows_h, k_cols_h, v_rows_b, v_rows_h, v_cols_h,
    stride_eb, stride_eh, group_size, kv_group, sel_group, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
):
    """Tile ``t``'s rows (for query head ``head_in_table`` of its table head) attended over its key
    group: ``(b, h, first, i, row_ok, part, part_lse, seen)``, ``part`` the normalised partial
    output (float32) and ``part_lse`` its natural-log log-sum-exp (``-inf`` where a row saw no key)."""
    h = tl.load(th_ptr + t) * sel_group + head_in_table  # the query head
    b = tl.load(tb_ptr + t)
    grp = tl.load(tg_ptr + t)
    first = tl.load(start_ptr + t)
    kept = tl.load(keep_ptr + b.to(tl.int64) * stride_eb + h.to(tl.int64) * stride_eh) != 0
    count = tl.where(kept, tl.load(count_ptr + t), 0)
    m = tl.arange(0, BLOCK_M)
    row_ok = m < count
    i = tl.load(rows_ptr + first + m, mask=row_ok, other=0)
    q_start = tl.load(q_start_ptr + b).to(tl.int32)
    kv_len = tl.load(kv_len_ptr + b).to(tl.int32)
    pos = q_start + i
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    EVEN_D: tl.constexpr = HEAD_DIM == D_PAD
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    qv = tl.load(q_base + i[:, None].to(tl.int64) * stride_qs + d[None, :] * stride_qd,
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter multiplies 16-bit bit patterns as integers: upcast (exact)
        qv = qv.to(tl.float32)
    kh = h // kv_group
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kh.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kh.to(tl.int64) * stride_vh
    start = grp * group_size
    stop = tl.minimum(start + group_size, kv_len)
    pos_min = tl.min(tl.where(row_ok, pos, 2147483647), axis=0)
    pos_max = tl.max(tl.where(row_ok, pos, -1), axis=0)
    # chunks every row sees whole (rows ascend: the first row's position bounds them), then the rest
    full_stop = start + tl.maximum(tl.minimum(stop, pos_min + 1) - start, 0) // BLOCK_N * BLOCK_N
    full_stop = tl.where(count > 0, full_stop, start)
    last = tl.where(count > 0, tl.minimum(stop, pos_max + 1), start)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    n = tl.arange(0, BLOCK_N)
    none = tl.zeros((BLOCK_M, BLOCK_N), tl.int1)
    for c0 in range(start, full_stop, BLOCK_N):
        if TMA:  # as the block-sparse kernel's clean chunks (block_sparse_attention.kv_descriptor)
            kt = k_desc.load([b * k_rows_b + kh * k_rows_h + c0, kh * k_cols_h])
            vt = v_desc.load([b * v_rows_b + kh * v_rows_h + c0, kh * v_cols_h])
        else:
            kt = load_rows(k_base, c0 + n, stride_ks, stride_kd, d, d_ok, EVEN_D)
            vt = load_rows(v_base, c0 + n, stride_vs, stride_vd, d, d_ok, EVEN_D)
        acc, m_i, l_i = attend_chunk(acc, m_i, l_i, qv, kt, vt, none, qk_scale, MASKED=False, IEEE=IEEE, UPCAST=UPCAST)
    for c0 in range(full_stop, last, BLOCK_N):
        kpos = c0 + n
        ok = (kpos[None, :] < stop) & (kpos[None, :] <= pos[:, None])
        kt = load_rows(k_base, tl.minimum(kpos, stop - 1), stride_ks, stride_kd, d, d_ok, EVEN_D)
        vt = load_rows(v_base, tl.minimum(kpos, stop - 1), stride_vs, stride_vd, d, d_ok, EVEN_D)
        acc, m_i, l_i = attend_chunk(acc, m_i, l_i, qv, kt, vt, ok, qk_scale, MASKED=True, IEEE=IEEE, UPCAST=UPCAST)
    seen = l_i > 0
    part_lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    part = acc / tl.where(seen, l_i, 1.0)[:, None]
    return b, h, first, i, row_ok, part, part_lse, seen


@triton.jit
def _lse_merge(acc, lse, part, part_lse):
    """Two normalised partial results and their natural-log lse merged by log-sum-exp: (merged, lse);
    a side at ``-inf`` adds nothing, both at ``-inf`` give 0 and ``-inf``."""
    top = tl.maximum(lse, part_lse)
    base = tl.where(top == float("-inf"), 0.0, top)
    w_old = tl.exp(lse - base)
    w_new = tl.exp(part_lse - base)
    total = w_old + w_new
    safe = tl.where(total > 0, total, 1.0)
    merged = (acc * w_old[:, None] + part * w_new[:, None]) / safe[:, None]
    return merged, tl.where(total > 0, base + tl.log(safe), float("-inf"))


@triton.jit
def _gather_kernel(
    q_ptr, k_ptr, v_ptr, rows_ptr, start_ptr, count_ptr, tb_ptr, th_ptr, tg_ptr, keep_ptr,
    q_start_ptr, kv_len_ptr, slot_ptr, acc_ptr, lse_ptr, k_desc, v_desc,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    k_rows_b, k_rows_h, k_cols_h, v_rows_b, v_rows_h, v_cols_h,
    stride_eb, stride_eh,
    tile0, q_len, num_q_heads, group_size, kv_group, sel_group, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr, FIRST: tl.constexpr, ENTRIES: tl.constexpr,
):
    """Tiles ``tile0 + pid(0)`` for query head ``pid(1)`` of their table head: ``ENTRIES``, each row's
    partial and lse into its entry's slot (``acc_ptr``, ``lse_ptr`` the entry buffers); else merged
    into the rows' float32 accumulators by log-sum-exp (a rank's pass; ``FIRST``: rank 0, no read)."""
    b, h, first, i, row_ok, part, part_lse, seen = _tile_partial(
        tile0 + tl.program_id(0), tl.program_id(1), q_ptr, k_ptr, v_ptr, rows_ptr, start_ptr, count_ptr, tb_ptr,
        th_ptr, tg_ptr, keep_ptr, q_start_ptr, kv_len_ptr, k_desc, v_desc,
        stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd, k_rows_b, k_rows_h, k_cols_h, v_rows_b, v_rows_h, v_cols_h,
        stride_eb, stride_eh, group_size, kv_group, sel_group, qk_scale,
        HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, IEEE, UPCAST, TMA,
    )
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    if ENTRIES:  # the entry's place in row-major order, per query head of the table head
        m = tl.arange(0, BLOCK_M)
        slot = tl.load(slot_ptr + first + m, mask=row_ok, other=0).to(tl.int64) * sel_group + tl.program_id(1)
        tl.store(acc_ptr + slot[:, None] * HEAD_DIM + d[None, :], part.to(acc_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + slot, part_lse, mask=row_ok)
    else:
        row_off = (b * num_q_heads + h).to(tl.int64) * q_len + i.to(tl.int64)
        upd = row_ok & seen
        acc_rows = acc_ptr + row_off[:, None] * HEAD_DIM + d[None, :]
        if FIRST:  # rank 0: no earlier partial (the accumulators hold 0 and -inf), the merge is the partial
            tl.store(acc_rows, part, mask=upd[:, None] & d_ok[None, :])
            tl.store(lse_ptr + row_off, part_lse, mask=upd)
        else:
            old_lse = tl.load(lse_ptr + row_off, mask=upd, other=float("-inf"))
            old = tl.load(acc_rows, mask=upd[:, None] & d_ok[None, :], other=0.0)
            merged, new_lse = _lse_merge(old, old_lse, part, part_lse)
            tl.store(acc_rows, merged, mask=upd[:, None] & d_ok[None, :])
            tl.store(lse_ptr + row_off, new_lse, mask=upd)


@triton.jit
def _merge_entries_kernel(
    part_ptr, part_lse_ptr, row_ptr, keep_ptr, out_ptr, lse_ptr,
    stride_eb, stride_eh, q_len, num_q_heads, table_heads, sel_group,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr, MAX_ENTRIES: tl.constexpr,
):
    """Rows [pid(0) * BLOCK_R, ...) of query head pid(1) of sample pid(2): their entries' partials
    (at most MAX_ENTRIES each, consecutive slots) merged by log-sum-exp in float32."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1)
    b = tl.program_id(2)
    r_ok = r < q_len
    kept = tl.load(keep_ptr + b.to(tl.int64) * stride_eb + h.to(tl.int64) * stride_eh) != 0
    table_row = ((b * table_heads + h // sel_group).to(tl.int64)) * q_len + r
    lo = tl.load(row_ptr + table_row, mask=r_ok, other=0)
    hi = tl.load(row_ptr + table_row + 1, mask=r_ok, other=0)
    hi = tl.where(kept, hi, lo)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    run_lse = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    acc = tl.zeros((BLOCK_R, D_PAD), tl.float32)
    for e in range(MAX_ENTRIES):
        has = r_ok & (lo + e < hi)
        slot = (lo + e).to(tl.int64) * sel_group + h % sel_group
        p_lse = tl.load(part_lse_ptr + slot, mask=has, other=float("-inf"))
        p = tl.load(part_ptr + slot[:, None] * HEAD_DIM + d[None, :], mask=has[:, None] & d_ok[None, :], other=0.0)
        acc, run_lse = _lse_merge(acc, run_lse, p.to(tl.float32), p_lse)
    row_off = (b * num_q_heads + h).to(tl.int64) * q_len + r
    tl.store(out_ptr + row_off[:, None] * HEAD_DIM + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + row_off, run_lse, mask=r_ok)


def gathered_selection_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: RowSelection,
    seq: SeqInfo,
    *,
    scale: float,
    keep_heads: torch.Tensor | None = None,
    tiles: Tiles = DEFAULT_TILES,
    merge: Literal["passes", "entries"] = "passes",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32) of attention under ``selection``,
    what :func:`~elasticfw.kernels.block_sparse_attention.row_selection_attention` computes, by query
    gathering (module docstring; ``merge`` chooses between one launch per rank merging into float32
    accumulators and one launch over every entry followed by a merge). Raises
    :class:`~elasticfw.errors.BackendUnavailableError` where the kernel cannot run or
    :func:`unsupported_selection` gives a reason."""
    reason = unsupported_selection(selection)
    if reason is not None:
        raise BackendUnavailableError(f"Triton gathered_selection_attention: {reason}")
    if merge not in ("passes", "entries"):
        raise ValueError(f"gathered_selection_attention: merge must be 'passes' or 'entries', got {merge!r}")
    keep = check_inputs(q, k, v, selection, seq, keep_heads, "gathered_selection_attention")
    if merge == "entries":
        return _entries_attention(q, k, v, selection, seq, keep, scale=scale, tiles=tiles)
    batch, hq, q_len, dim = q.shape
    sel = selection.selected
    acc = torch.zeros(batch, hq, q_len, dim, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, hq, q_len), float("-inf"), dtype=torch.float32, device=q.device)
    if batch * hq * q_len == 0:
        return acc.to(q.dtype), lse
    heads_per_table = hq // sel.shape[1]
    tiles, block_n = fit_tiles(tiles, min(tiles.block_n, max(16, next_pow2(selection.group_size))),
                               max(16, next_pow2(dim)), q.element_size(), q.device, shrink=True)
    plan = gather_plan(selection, batch, tiles.block_m)
    tma, k_desc, v_desc, k_rows, v_rows = kv_descriptors(k, v, block_n)
    for r in range(len(plan.pass_bounds) - 1):
        lo, hi = plan.pass_bounds[r], plan.pass_bounds[r + 1]
        if hi == lo:
            continue
        _gather_kernel[(hi - lo, heads_per_table)](
            q, k, v, plan.rows, plan.tile_start, plan.tile_count, plan.tile_b, plan.tile_h, plan.tile_g, keep,
            seq.q_start.contiguous(), seq.kv_len.contiguous(), plan.rows, acc, lse, k_desc, v_desc,
            *q.stride(), *k.stride(), *v.stride(), *k_rows, *v_rows, *keep.stride(),
            lo, q_len, hq, selection.group_size, hq // k.shape[1], heads_per_table, scale * _LOG2E,
            HEAD_DIM=dim, D_PAD=max(16, next_pow2(dim)), BLOCK_M=tiles.block_m, BLOCK_N=block_n,
            IEEE=q.dtype == torch.float32, UPCAST=interpreting() and q.dtype != torch.float32, TMA=tma,
            FIRST=r == 0, ENTRIES=False, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    return acc.to(q.dtype), lse


#: query rows per program of the entries' merge
MERGE_ROWS = 32


def _entries_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: RowSelection, seq: SeqInfo, keep: torch.Tensor,
    *, scale: float, tiles: Tiles,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge="entries"``: one launch attends every entry's tile and stores each row's partial
    (normalised, in q's dtype, as upstream MoBA's per-block outputs) and its lse in the entry's
    slot; a second launch merges each row's consecutive slots by log-sum-exp in float32."""
    batch, hq, q_len, dim = q.shape
    out = torch.empty(batch, hq, q_len, dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, hq, q_len, dtype=torch.float32, device=q.device)
    if batch * hq * q_len == 0:
        return out, lse
    d_pad = max(16, next_pow2(dim))
    tiles, block_n = fit_tiles(tiles, min(tiles.block_n, max(16, next_pow2(selection.group_size))), d_pad,
                               q.element_size(), q.device, shrink=True)
    plan = gather_entry_plan(selection, batch, tiles.block_m)
    heads_per_table = hq // selection.selected.shape[1]
    entries = plan.slots.numel()
    part = torch.empty(entries * heads_per_table, dim, dtype=q.dtype, device=q.device)
    part_lse = torch.empty(entries * heads_per_table, dtype=torch.float32, device=q.device)
    if plan.tile_start.numel():
        tma, k_desc, v_desc, k_rows, v_rows = kv_descriptors(k, v, block_n)
        _gather_kernel[(plan.tile_start.numel(), heads_per_table)](
            q, k, v, plan.rows, plan.tile_start, plan.tile_count, plan.tile_b, plan.tile_h, plan.tile_g, keep,
            seq.q_start.contiguous(), seq.kv_len.contiguous(), plan.slots, part, part_lse, k_desc, v_desc,
            *q.stride(), *k.stride(), *v.stride(), *k_rows, *v_rows, *keep.stride(),
            0, q_len, hq, selection.group_size, hq // k.shape[1], heads_per_table, scale * _LOG2E,
            HEAD_DIM=dim, D_PAD=d_pad, BLOCK_M=tiles.block_m, BLOCK_N=block_n,
            IEEE=q.dtype == torch.float32, UPCAST=interpreting() and q.dtype != torch.float32, TMA=tma,
            FIRST=False, ENTRIES=True, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    _merge_entries_kernel[(triton.cdiv(q_len, MERGE_ROWS), hq, batch)](
        part, part_lse, plan.row_ptr, keep, out, lse, *keep.stride(), q_len, hq, selection.selected.shape[1],
        heads_per_table, HEAD_DIM=dim, D_PAD=d_pad, BLOCK_R=MERGE_ROWS, MAX_ENTRIES=max(1, plan.max_entries),
        num_warps=4,
    )
    return out, lse
