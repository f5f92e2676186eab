"""Decode attention (Triton): one query row per sample over a selection, split over the keys,
without work lists and without padding the row to a query tile.

Computes :mod:`~elasticfw.kernels.block_sparse_attention`'s definition at ``q_len = 1``. A *routed*
call takes two selections and ``second_heads`` ((B or 1, Hq) bool: the heads that read the second),
so a routed layer's decode step is one launch whatever its routing, with no device read on the
host. One program per (key split, KV head, sample) over the GQA group's query heads visits only
the chunks some row sees; a second launch merges the splits by log-sum-exp (flash-decoding's
split-KV). Float32 accumulation, the output in the input dtype, natural-log ``lse``. Memory beyond
inputs and outputs: ``4 * B * Hq * splits * (D + 2)`` bytes. Forward only; :func:`unsupported` says
when it cannot run. Programs and chunks in detail: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from elasticfw.attention.layout import RowSelection
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import cdiv, interpreting, next_pow2, shared_memory_limit, unsupported_tensor
from elasticfw.kernels.block_sparse_attention import MAX_HEAD_DIM, attend_chunk, load_rows

__all__ = ["decode_attention", "num_splits", "unsupported"]

_LOG2E = 1.4426950408889634
#: the widest key chunk (decode reads K/V once: narrow chunks keep a split's registers small)
MAX_BLOCK_N = 64
#: the most chunks one program's range holds (its flags and their compaction live in registers)
MAX_CHUNKS_PER_SPLIT = 256
#: the chunks a range holds at most by default (2,048 keys at 64-key chunks). Where few heads read
#: every key (MSR 0.875: one KV head in eight), filling the GPU with programs of *all* heads leaves
#: the reading heads' programs long and serial: on an H100 at 128K keys (results/bench/decode-kernel-splits/, scripts/
#: decode_host_timing.py --splits) 33 ranges of 63 chunks took 138 us of GPU time a call, 66 ranges of
#: 32 chunks 91 us (host-bound: the GPU time is below it), 132 and 264 ranges the same
SPLIT_CHUNKS = 32
#: the most ranges :data:`SPLIT_CHUNKS` asks for (the merge kernel holds a (ranges, head dim) float32
#: tile per row: 128 x 128 at 256K keys and beyond, where 32-chunk ranges would ask 512 at 1M)
SPLIT_CHUNKS_MAX_SPLITS = 128
#: shared memory the split kernel holds beyond one K chunk, one V chunk and the query tile (the
#: kernels compiled for sm_80 / sm_89 / sm_90 asked at most 4,160 bytes more; twice that as margin)
SMEM_MARGIN = 8192


def split_kernel_bytes(block_n: int, block_h: int, d_pad: int, itemsize: int) -> int:
    """Shared memory of the split kernel: a K and a V chunk of ``block_n`` keys and the query tile of
    ``block_h`` rows, ``d_pad`` columns each, and :data:`SMEM_MARGIN`."""
    return (2 * block_n + block_h) * d_pad * itemsize + SMEM_MARGIN


def unsupported(q: torch.Tensor, *selections: RowSelection) -> str | None:
    """``None`` when :func:`decode_attention` can run ``q`` (B, Hq, 1, D) over ``selections``."""
    reason = unsupported_tensor(q, "Triton decode kernel")
    if reason is not None:
        return reason
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} is above the Triton decode kernel's {MAX_HEAD_DIM}"
    for selection in selections:
        if selection.group_size % 16:
            return f"key group size {selection.group_size} is not a multiple of 16"
    return None


def _chunk(selections: tuple[RowSelection, ...]) -> int:
    n = MAX_BLOCK_N
    while any(s.group_size % n for s in selections):
        n //= 2
    return n


@functools.cache
def _multiprocessors(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (asked once: the query costs about 50 us of
    host time, a decode step's budget for a whole layer)."""
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def num_splits(device: torch.device, programs_per_split: int, chunks: int) -> int:
    """Key ranges per (sample, KV head): about two programs per streaming multiprocessor on a GPU
    (four ranges under the interpreter), at least enough that no range exceeds
    :data:`SPLIT_CHUNKS` chunks, both up to :data:`SPLIT_CHUNKS_MAX_SPLITS` ranges (one sample of
    one KV head would otherwise ask 264 ranges of an H100, and the merge a 512-row tile per head);
    always enough that no range exceeds :data:`MAX_CHUNKS_PER_SPLIT`, and never more ranges than
    chunks."""
    if device.type == "cuda":
        target = 2 * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    else:
        target = 4 * programs_per_split
    wanted = max(cdiv(target, max(programs_per_split, 1)), cdiv(chunks, SPLIT_CHUNKS))
    splits = max(min(wanted, SPLIT_CHUNKS_MAX_SPLITS), cdiv(chunks, MAX_CHUNKS_PER_SPLIT))
    return max(1, min(splits, chunks))


@triton.jit
def _row_flags(sel_ptr, b, h, stride_b, stride_h, stride_g, sel_group, group_size, groups, cpos, row_ok):
    """(rows, chunks) flags of flag row 0 for the chunks starting at key positions ``cpos`` (groups
    past the table's ``groups``: not selected)."""
    base = sel_ptr + b.to(tl.int64) * stride_b + (h // sel_group).to(tl.int64) * stride_h
    g = cpos // group_size
    return tl.load(base[:, None] + g[None, :].to(tl.int64) * stride_g,
                   mask=row_ok[:, None] & (g < groups)[None, :], other=0) != 0


#: the split kernel's integers that change as a cache grows (the selection tables' group counts and
#: strides, the key ranges, the partials' offsets): Triton specialises an integer on being 1 or a multiple of 16, so each
#: would compile another variant every few decode steps (7 of the split kernel between 2,048 and
#: 40,000 keys at the Llama-3.1-8B shape before these were excluded, 2 after: Triton's keys computed
#: on the CPU)
_GROWING = ("stride_ab", "stride_ah", "stride_bb", "stride_bh", "groups_a", "groups_b", "chunks_per_split", "splits",
            "m_off", "l_off")


@triton.jit(do_not_specialize=_GROWING)
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, sel_a, sel_b, second_ptr, keep_ptr, q_start_ptr, kv_len_ptr, work_ptr, m_off, l_off,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ab, stride_ah, stride_ag, stride_bb, stride_bh, stride_bg,
    stride_2b, stride_2h, stride_eb, stride_eh,
    group_a, window_a, selgrp_a, groups_a, group_b, window_b, selgrp_b, groups_b,
    hq, kv_group, chunks_per_split, splits, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr, TWO: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    split = tl.program_id(0)
    kh = tl.program_id(1)
    b = tl.program_id(2)
    r = tl.arange(0, BLOCK_H)
    row_ok = r < kv_group
    h = kh * kv_group + tl.where(row_ok, r, 0)
    pos = tl.load(q_start_ptr + b).to(tl.int32)
    kv_len = tl.load(kv_len_ptr + b).to(tl.int32)
    kept = row_ok & (tl.load(keep_ptr + b.to(tl.int64) * stride_eb + h.to(tl.int64) * stride_eh) != 0)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    EVEN_D: tl.constexpr = HEAD_DIM == D_PAD
    qv = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h[:, None].to(tl.int64) * stride_qh + d[None, :] * stride_qd,
                 mask=kept[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter multiplies 16-bit bit patterns as integers: upcast (exact)
        qv = qv.to(tl.float32)
    # the chunks of this range some row sees: flags (or window), causality and kv_len
    ci = split * chunks_per_split + tl.arange(0, CHUNKS)
    cpos = ci * BLOCK_N
    in_range = (tl.arange(0, CHUNKS) < chunks_per_split) & (cpos <= pos) & (cpos < kv_len)
    seen = _row_flags(sel_a, b, h, stride_ab, stride_ah, stride_ag, selgrp_a, group_a, groups_a, cpos, kept)
    seen = seen | ((cpos + BLOCK_N - 1 > pos - window_a) & (window_a > 0))[None, :]
    if TWO:
        use_b = kept & (tl.load(second_ptr + b.to(tl.int64) * stride_2b + h.to(tl.int64) * stride_2h) != 0)
        seen_b = _row_flags(sel_b, b, h, stride_bb, stride_bh, stride_bg, selgrp_b, group_b, groups_b, cpos, kept)
        seen_b = seen_b | ((cpos + BLOCK_N - 1 > pos - window_b) & (window_b > 0))[None, :]
        seen = tl.where(use_b[:, None], seen_b, seen)
    need = (tl.max((seen & kept[:, None]).to(tl.int32), axis=0) > 0) & in_range  # (CHUNKS,)
    rank = tl.cumsum(need.to(tl.int32), axis=0)  # the e-th needed chunk has rank e + 1
    count = tl.sum(need.to(tl.int32), axis=0)

    kb = k_ptr + b.to(tl.int64) * stride_kb + kh.to(tl.int64) * stride_kh
    vb = v_ptr + b.to(tl.int64) * stride_vb + kh.to(tl.int64) * stride_vh
    n = tl.arange(0, BLOCK_N)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D_PAD), tl.float32)
    for e in range(0, count):
        c = tl.sum(tl.where(need & (rank == e + 1), ci, 0), axis=0)
        kpos = c * BLOCK_N + n
        fa = _row_flags(sel_a, b, h, stride_ab, stride_ah, stride_ag, selgrp_a, group_a, groups_a,
                        c * BLOCK_N + tl.zeros((1,), tl.int32), kept)
        row_seen = fa | ((kpos > pos - window_a) & (window_a > 0))[None, :]
        if TWO:
            fb = _row_flags(sel_b, b, h, stride_bb, stride_bh, stride_bg, selgrp_b, group_b, groups_b,
                            c * BLOCK_N + tl.zeros((1,), tl.int32), kept)
            row_seen = tl.where(use_b[:, None], fb | ((kpos > pos - window_b) & (window_b > 0))[None, :], row_seen)
        ok = row_seen & kept[:, None] & (kpos <= pos)[None, :] & (kpos < kv_len)[None, :]
        kt = load_rows(kb, tl.minimum(kpos, kv_len - 1), stride_ks, stride_kd, d, d_ok, EVEN_D)
        vt = load_rows(vb, tl.minimum(kpos, kv_len - 1), stride_vs, stride_vd, d, d_ok, EVEN_D)
        acc, m_i, l_i = attend_chunk(acc, m_i, l_i, qv, kt, vt, ok, qk_scale, MASKED=True, IEEE=IEEE, UPCAST=UPCAST)
    part = (b * hq + h).to(tl.int64) * splits + split  # (rows,) partial slots
    # work: the accumulators (partials x HEAD_DIM), the running maxima from m_off, the sums from l_off
    tl.store(work_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(work_ptr + m_off + part, m_i, mask=row_ok)
    tl.store(work_ptr + l_off + part, l_i, mask=row_ok)


@triton.jit(do_not_specialize=("splits", "m_off", "l_off"))
def _merge_kernel(work_ptr, m_off, l_off, out_ptr, lse_ptr, stride_ob, stride_oh, stride_od, hq, splits,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)  # b * hq + h
    acc_ptr = work_ptr  # the split kernel's layout of the partials
    m_ptr = work_ptr + m_off
    l_ptr = work_ptr + l_off
    s = tl.arange(0, SPLITS)
    s_ok = s < splits
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    base = row.to(tl.int64) * splits
    m = tl.load(m_ptr + base + s, mask=s_ok, other=float("-inf"))
    lsum = tl.load(l_ptr + base + s, mask=s_ok, other=0.0)
    mx = tl.max(m, axis=0)
    shift = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.where(lsum > 0, tl.exp2(m - shift), 0.0)
    total = tl.sum(lsum * w, axis=0)
    acc = tl.load(acc_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    seen = total > 0
    out = tl.where(seen, tl.sum(acc * w[:, None], axis=0) / tl.where(seen, total, 1.0), 0.0)
    b = row // hq
    h = row % hq
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)
    lse = tl.where(seen, (shift + tl.log2(tl.where(seen, total, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + row, lse)


def _table(selection: RowSelection, batch: int, hq: int, caller: str) -> tuple[torch.Tensor, int, int, int, int]:
    """``(flags, stride over samples, over heads, over groups, groups)`` of the selection's flag row 0
    (the row of each sample's one query) as the kernel reads it: the table itself (a bool table
    viewed as bytes in place; row 0 starts where the table does) and a sample stride of 0 for a
    table shared by every sample: no slice, no expand (each costs host time)."""
    sel = selection.selected
    if sel.shape[0] not in (1, batch) or hq % sel.shape[1] or sel.shape[2] < 1:
        raise ValueError(
            f"{caller}: a selection table must be (1 or B={batch}, H dividing {hq}, rows >= 1, G), got {tuple(sel.shape)}"
        )
    flags = sel.view(torch.uint8) if sel.dtype == torch.bool else sel
    stride = flags.stride()
    return flags, (stride[0] if flags.shape[0] == batch else 0), stride[1], stride[3], flags.shape[3]


@functools.lru_cache(maxsize=64)
def _constant_heads(value: int, hq: int, device: torch.device) -> torch.Tensor:
    """A (1, hq) uint8 row of ``value``, made once per device (never written: kernels only read it)."""
    return torch.full((1, hq), value, dtype=torch.uint8, device=device)


def _heads(
    mask: torch.Tensor | None, batch: int, hq: int, name: str, device: torch.device, default: bool
) -> tuple[torch.Tensor, int, int]:
    """``(flags, stride over samples, stride over heads)`` of a (B or 1, Hq) head mask as bytes (a bool
    mask viewed in place; a sample stride of 0 for one row shared by every sample)."""
    if mask is None:
        return _constant_heads(int(default), hq, device), 0, 1
    if mask.dim() != 2 or mask.shape[0] not in (1, batch) or mask.shape[1] != hq:
        raise ValueError(f"decode_attention: {name} must be (1 or {batch}, {hq}), got {tuple(mask.shape)}")
    # a bool mask is read as bytes in place (no conversion kernel per call)
    flags = mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8)
    return flags, (flags.stride(0) if mask.shape[0] == batch else 0), flags.stride(1)


class _Plan(NamedTuple):
    """What a decode call's launches take beyond q, k, v and the head masks: the selection tables as
    :func:`_table` gives them, the tile sizes and the key splits."""

    table_a: tuple[torch.Tensor, int, int, int, int]
    table_b: tuple[torch.Tensor, int, int, int, int]
    block_n: int
    d_pad: int
    block_h: int
    splits: int
    per_split: int


#: plans by (selections' ids, call geometry), with the selections they were made for (identity
#: checked: a cached plan holds them, so their ids cannot be reused while it is kept)
_PLANS: OrderedDict[tuple[object, ...], tuple[tuple[RowSelection, ...], _Plan]] = OrderedDict()
#: plans kept: a decode step's layers share one or two selections, so a few steps' worth
PLAN_CACHE_SIZE = 16


def _plan(
    selections: tuple[RowSelection, ...], q: torch.Tensor, hkv: int, kv_capacity: int, splits: int | None
) -> _Plan:
    """:class:`_Plan` of a call, made once per tuple of selection objects and call geometry (batch,
    query and KV heads, head dim, dtype, device, its shared memory, ``kv_capacity`` and the
    ``splits`` asked). A decode step's layers share their selections, and the plan reads only the
    tables' shapes, strides and dtype, which a selection (frozen) never changes: making it at every
    layer cost about 7 us of host time of a call's 29 (scripts/decode_host_timing.py --no-launch on
    the CPU)."""
    batch, hq, _, dim = q.shape
    limit = shared_memory_limit(q.device)
    key = (*map(id, selections), batch, hq, hkv, dim, q.dtype, q.device, kv_capacity, splits, limit)
    hit = _PLANS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], selections, strict=True)):
        return hit[1]
    table_a = _table(selections[0], batch, hq, "decode_attention")
    table_b = _table(selections[1], batch, hq, "decode_attention") if len(selections) > 1 else table_a
    block_n = _chunk(selections)
    d_pad, block_h = max(16, next_pow2(dim)), max(16, next_pow2(hq // hkv))
    # narrower chunks where the GPU's shared memory is short (float32 at head dim 256: 64-key chunks
    # ask 151,616 bytes, above an RTX 4090's 101,376); half a power of two dividing the groups divides them
    while limit is not None and block_n > 16 and split_kernel_bytes(block_n, block_h, d_pad, q.element_size()) > limit:
        block_n //= 2
    chunks = cdiv(kv_capacity, block_n)
    if splits is None:
        splits = num_splits(q.device, batch * hkv, chunks)
    elif not 1 <= splits <= chunks:
        raise ValueError(f"decode_attention: splits must be in [1, {chunks}] (the key chunks), got {splits}")
    per_split = cdiv(chunks, splits)
    if per_split > MAX_CHUNKS_PER_SPLIT:
        raise ValueError(f"decode_attention: {splits} splits leave {per_split} chunks per split, above "
                         f"{MAX_CHUNKS_PER_SPLIT}")
    plan = _Plan(table_a, table_b, block_n, d_pad, block_h, cdiv(chunks, per_split), per_split)
    _PLANS[key] = (selections, plan)
    while len(_PLANS) > PLAN_CACHE_SIZE:
        _PLANS.popitem(last=False)
    return plan


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: RowSelection,
    seq: SeqInfo,
    *,
    scale: float,
    second: RowSelection | None = None,
    second_heads: torch.Tensor | None = None,
    keep_heads: torch.Tensor | None = None,
    splits: int | None = None,
    checked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Hq, 1, D) in q's dtype, lse (B, Hq, 1) float32) of a decode step (module
    docstring): ``q`` (B, Hq, 1, D), ``k`` / ``v`` (B, Hkv, S, D), any strides. Query head ``h`` of
    sample ``b`` reads ``second`` where ``second_heads[b, h]`` (both given, or neither), else
    ``selection``; ``keep_heads`` (B or 1, Hq) bool: heads outside it compute nothing (zero
    output, ``-inf`` lse). ``splits``: key ranges per (sample, KV head) (default
    :func:`num_splits`). Raises :class:`~elasticfw.errors.BackendUnavailableError` where
    :func:`unsupported` gives a reason, ``ValueError`` for shapes that do not fit. ``checked``: the
    caller has run :func:`unsupported` on these selections and checked q, k, v against ``seq``
    (an executor's input checks), so neither runs again (a decode step's host time is its cost)."""
    selections = (selection,) if second is None else (selection, second)
    if (second is None) != (second_heads is None):
        raise ValueError("decode_attention: give second and second_heads together")
    batch, hq, q_len, dim = q.shape
    hkv = k.shape[1]
    if q_len != 1 or seq.q_len != 1:
        raise ValueError(f"decode_attention: one query row per sample, got q of {q_len} rows (seq.q_len {seq.q_len})")
    if not checked:
        reason = unsupported(q, *selections)
        if reason is not None:
            raise BackendUnavailableError(f"Triton decode_attention: {reason}")
        seq.check(q, k)
    if k.dtype != q.dtype or v.dtype != q.dtype or v.shape[-1] != dim or hq % hkv:
        raise ValueError(
            f"decode_attention: q, k, v must share dtype and head dim, and KV heads divide {hq}; got "
            f"{q.dtype}/{k.dtype}/{v.dtype}, head dims {dim}/{k.shape[-1]}/{v.shape[-1]}, {hkv} KV heads"
        )
    if v.shape != k.shape:
        raise ValueError(f"decode_attention: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    out = torch.empty(batch, hq, 1, dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, hq, 1, dtype=torch.float32, device=q.device)
    if batch * hq == 0:
        return out, lse
    plan = _plan(selections, q, hkv, seq.kv_capacity, splits)
    sel_a, sa_b, sa_h, sa_g, groups_a = plan.table_a
    sel_b, sb_b, sb_h, sb_g, groups_b = plan.table_b
    b_sel = second if second is not None else selection
    use_b, u_b, u_h = _heads(second_heads, batch, hq, "second_heads", q.device, False)
    keep, e_b, e_h = _heads(keep_heads, batch, hq, "keep_heads", q.device, True)
    block_n, d_pad, block_h, splits, per_split = plan.block_n, plan.d_pad, plan.block_h, plan.splits, plan.per_split
    group = hq // hkv
    partials = batch * hq * splits  # the partial results, in one allocation (each costs host time)
    work = torch.empty(partials * (dim + 2), dtype=torch.float32, device=q.device)
    q_start, kv_len = seq.q_start, seq.kv_len
    if not (q_start.is_contiguous() and kv_len.is_contiguous()):
        q_start, kv_len = q_start.contiguous(), kv_len.contiguous()
    _decode_split_kernel[(splits, hkv, batch)](
        q, k, v, sel_a, sel_b, use_b, keep, q_start, kv_len, work, partials * dim, partials * (dim + 1),
        q.stride(0), q.stride(1), q.stride(3), *k.stride(), *v.stride(),
        sa_b, sa_h, sa_g, sb_b, sb_h, sb_g, u_b, u_h, e_b, e_h,
        selection.group_size, selection.window, hq // selection.selected.shape[1], groups_a,
        b_sel.group_size, b_sel.window, hq // b_sel.selected.shape[1], groups_b,
        hq, group, per_split, splits, scale * _LOG2E,
        HEAD_DIM=dim, D_PAD=d_pad, BLOCK_H=block_h, BLOCK_N=block_n,
        CHUNKS=max(16, next_pow2(per_split)), TWO=second is not None, IEEE=q.dtype == torch.float32,
        UPCAST=interpreting() and q.dtype != torch.float32, num_warps=4, num_stages=2,
    )
    _merge_kernel[(batch * hq,)](
        work, partials * dim, partials * (dim + 1), out, lse, out.stride(0), out.stride(1), out.stride(3), hq, splits,
        HEAD_DIM=dim, D_PAD=d_pad, SPLITS=max(2, next_pow2(splits)), num_warps=4,
    )
    return out, lse
