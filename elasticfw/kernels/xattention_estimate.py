"""Fused XAttention antidiagonal estimate (Triton): the block mass without the score matrix.

Computes what :func:`elasticfw.attention.patterns.iter_antidiagonal_mass` computes (the definition:
``plugins/modes/xattention.py``) without storing the strided scores ``A[m, n] = sum_{i<S} q[m*S +
i] . k[n*S + S-1-i]``: in one pass by default (:data:`PASSES` = 1: each row's block sums kept
relative to its running maximum in a float32 scratch, rescaled once the row is done) or in two
(softmax statistics, then the mass). Inputs stay in their dtype (16-bit products are exact in
float32; float32 inputs multiply in IEEE float32); rows without a real query and keys past
``kv_len`` are zero vectors, as in the reference. Each program owns whole blocks (no atomics);
per chunk of positions nothing is quadratic in the sequence. :func:`unsupported` says when the
kernels cannot run. Passes, memory and tiles: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import cdiv, interpreting, next_pow2, shared_memory_budget, unsupported_tensor

__all__ = [
    "antidiagonal_mass_triton",
    "iter_antidiagonal_mass_triton",
    "unsupported",
]

#: strided query rows per program (a power of two, >= 16); each program holds BLOCK_M x BLOCK_N scores
BLOCK_M = 128
#: strided keys per inner step (a power of two, >= 16)
BLOCK_N = 128
NUM_WARPS = 8
#: 128 x 128 tiles, 8 warps, 3 stages: the fastest of nine configurations of the single pass timed on
#: one H200 at 128K (bf16, d 128, stride 16: 14.1 ms against 20.5 with 2 stages, 15.8 for 128 x 256 /
#: 2 stages, 17.7 for 256 x 128 / 2 stages and 21-26 for the others;
#: results/bench/planner-tiles/xattention_tiles.txt). 3 stages of 128 x 128 tiles need 192 KB of
#: shared memory: on a GPU with less (:func:`~elasticfw.kernels.shared_memory_budget`) the tiles shrink.
NUM_STAGES = 3
#: 1: :func:`_single_pass_kernel` (scores computed once, per-row block sums kept in a scratch of
#: ``4 * B * Hq * (C/S) * NKB`` bytes per chunk of ``C`` positions); 2: the two-pass kernels
PASSES = 1
#: shared memory the operand pipeline may use per program at most (lowered to the device's limit by
#: :func:`~elasticfw.kernels.shared_memory_budget`): tiles shrink (and then stages) to fit
SMEM_BUDGET = 200 * 1024
#: the largest ``next_pow2(block_size / stride)`` (a tile holds at least one whole block)
MAX_GROUP = 128
#: the largest head dim (padded to a power of two, kept whole in each tile)
MAX_HEAD_DIM = 256

_LOG2E = 1.4426950408889634


def unsupported(q: torch.Tensor, *, block_size: int, stride: int) -> str | None:
    """``None`` when the kernels can estimate ``q`` (B, Hq, Sq, D) at this block size and stride,
    else why not (the device, the dtype or the shape)."""
    reason = unsupported_tensor(q, "Triton estimator")
    if reason is not None:
        return reason
    if stride < 1 or block_size < 1 or block_size % stride:
        return f"block_size {block_size} is not a positive multiple of stride {stride}"
    group = next_pow2(block_size // stride)
    if group > MAX_GROUP:
        return (
            f"block_size / stride = {block_size // stride} strided rows per block is above the Triton "
            f"estimator's {MAX_GROUP}"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} is above the Triton estimator's {MAX_HEAD_DIM}"
    return None


def _tiles(
    elsize: int, d_pad: int, group_pad: int, block_m: int | None, block_n: int | None, budget: int = SMEM_BUDGET
) -> tuple[int, int, int]:
    """(block_m, block_n, stages): the defaults shrunk to fit ``budget`` bytes of shared memory,
    never below a whole block (``group_pad``) or the 16 rows ``tl.dot`` needs."""
    floor = max(16, group_pad)
    bm = max(block_m or BLOCK_M, floor)
    bn = max(block_n or BLOCK_N, floor)
    stages = NUM_STAGES
    if block_m is None or block_n is None:
        while (bm + bn) * d_pad * elsize * stages > budget:
            if block_n is None and bn > floor and bn >= bm:
                bn //= 2
            elif block_m is None and bm > floor:
                bm //= 2
            elif stages > 1:
                stages -= 1
            else:
                break
    for name, value in (("block_m", bm), ("block_n", bn)):
        if value & (value - 1):
            raise ValueError(f"Triton antidiagonal estimate: {name} must be a power of two, got {value}")
    return bm, bn, stages


# ---------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _antidiagonal_tile(
    q_base, k_base, m_abs, row_ok, lo, hi, n_idx, col_ok, kv_len,
    stride_qs, stride_qd, stride_ks, stride_kd, n_steps,
    STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) float32 ``A[m, n] = sum_i q[m*S + i] . k[n*S + S-1-i]`` (``n_steps``
    is ``STRIDE``, or 0 for a tile known to be all masked); absent rows and keys read as zeros."""
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, n_steps):
        qpos = m_abs * STRIDE + i
        q_ok = row_ok & (qpos >= lo) & (qpos < hi)
        q_rows = (qpos - lo).to(tl.int64) * stride_qs
        qv = tl.load(
            q_base + q_rows[:, None] + d[None, :] * stride_qd, mask=q_ok[:, None] & d_ok[None, :], other=0.0
        )
        kpos = n_idx * STRIDE + (STRIDE - 1 - i)
        k_ok = col_ok & (kpos < kv_len)
        k_rows = kpos.to(tl.int64) * stride_ks
        kv = tl.load(
            k_base + k_rows[:, None] + d[None, :] * stride_kd, mask=k_ok[:, None] & d_ok[None, :], other=0.0
        )
        if UPCAST:  # the interpreter multiplies bfloat16 bit patterns as integers: upcast (exact)
            qv = qv.to(tl.float32)
            kv = kv.to(tl.float32)
        if IEEE:
            acc = tl.dot(qv, tl.trans(kv), acc, input_precision="ieee")
        else:
            acc = tl.dot(qv, tl.trans(kv), acc)
    return acc


@triton.jit
def _strided_rows(
    tile, row0, row1, first_block, lo, hi,
    STRIDE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """A program's row slots, layout rows from ``row0 + tile * BLOCK_M / GROUP_PAD`` (below
    ``row1``) as (block, member) pairs: the slot index, layout row, member, absolute strided row,
    whether it is a row of the range, whether it holds a real query, and the last real row (-1)."""
    ROW_BLOCKS: tl.constexpr = BLOCK_M // GROUP_PAD
    r = tl.arange(0, BLOCK_M)
    t = row0 + tile * ROW_BLOCKS + r // GROUP_PAD
    gi = r % GROUP_PAD
    m_abs = (first_block + t) * GROUP + gi
    row_ok = (gi < GROUP) & (t < row1)
    # the row's positions [m_abs * STRIDE, + STRIDE) meet the real ones [lo, hi) (none where hi <= lo)
    real = row_ok & (tl.maximum(m_abs * STRIDE, lo) < tl.minimum(m_abs * STRIDE + STRIDE, hi))
    last = tl.max(tl.where(real, m_abs, -1), axis=0)
    return r, t, gi, m_abs, row_ok, real, last


@triton.jit
def _strided_keys(kt, num_key_blocks, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tile ``kt``'s columns as (block, member) pairs: strided key index and whether it exists."""
    KEY_BLOCKS: tl.constexpr = BLOCK_N // GROUP_PAD
    c = tl.arange(0, BLOCK_N)
    kb = kt * KEY_BLOCKS + c // GROUP_PAD
    gj = c % GROUP_PAD
    return kb * GROUP + gj, (gj < GROUP) & (kb < num_key_blocks)


@triton.jit
def _causal_scores(
    q_base, k_base, m_abs, row_ok, lo, hi, kv_len, kt, num_key_blocks, qk_scale,
    stride_qs, stride_qd, stride_ks, stride_kd,
    STRIDE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Key tile ``kt``'s scaled base-2 logits, ``-inf`` past each row's strided diagonal."""
    n_idx, col_ok = _strided_keys(kt, num_key_blocks, GROUP, GROUP_PAD, BLOCK_N)
    s = _antidiagonal_tile(
        q_base, k_base, m_abs, row_ok, lo, hi, n_idx, col_ok, kv_len,
        stride_qs, stride_qd, stride_ks, stride_kd, STRIDE,
        STRIDE, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, IEEE, UPCAST,
    )
    return tl.where(col_ok[None, :] & (n_idx[None, :] <= m_abs[:, None]), s * qk_scale, float("-inf"))


@triton.jit
def _stats_kernel(
    q_ptr, k_ptr, q_start_ptr, kv_len_ptr, row_max_ptr, row_sum_ptr,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    q_len, num_rows, num_key_blocks, num_q_heads, group_size, stat_stride, qk_scale,
    STRIDE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Pass 1: per strided row, the max and the sum of ``exp2`` of the scaled scores over the
    strided-causal keys (base-2 logits: ``qk_scale`` includes log2(e))."""
    KEY_BLOCKS: tl.constexpr = BLOCK_N // GROUP_PAD
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows first
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(q_start_ptr + b).to(tl.int32)
    kv_len = tl.load(kv_len_ptr + b).to(tl.int32)
    lo = q_start
    hi = tl.minimum(q_start + q_len, kv_len)  # real query positions: [lo, hi)
    first_block = q_start // (GROUP * STRIDE)

    r, t, gi, m_abs, row_ok, real, last = _strided_rows(
        tile, 0, num_rows, first_block, lo, hi, STRIDE, GROUP, GROUP_PAD, BLOCK_M
    )
    key_tiles = tl.cdiv(num_key_blocks, KEY_BLOCKS)
    n_tiles = tl.where(last >= 0, tl.minimum(key_tiles, (last // GROUP) // KEY_BLOCKS + 1), 0)

    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = k_ptr + b.to(tl.int64) * stride_kb + (h // group_size).to(tl.int64) * stride_kh
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    for kt in range(0, n_tiles):
        s = _causal_scores(
            q_base, k_base, m_abs, row_ok, lo, hi, kv_len, kt, num_key_blocks, qk_scale,
            stride_qs, stride_qd, stride_ks, stride_kd,
            STRIDE, GROUP, GROUP_PAD, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, IEEE, UPCAST,
        )
        # key n = 0 is in the first tile and causal for every row, so new_max is finite
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        row_sum = row_sum * tl.exp2(row_max - new_max) + tl.sum(tl.exp2(s - new_max[:, None]), axis=1)
        row_max = new_max
    out = (b * num_q_heads + h).to(tl.int64) * stat_stride + tile * BLOCK_M + r  # = row t*GROUP_PAD + gi
    tl.store(row_max_ptr + out, row_max)
    tl.store(row_sum_ptr + out, row_sum)


@triton.jit
def _mass_kernel(
    q_ptr, k_ptr, q_start_ptr, kv_len_ptr, row_max_ptr, row_sum_ptr, out_ptr,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_ob, stride_oh, stride_ot, stride_on,
    q_len, row0, row1, num_key_blocks, num_key_tiles, num_q_heads, group_size, stat_stride, qk_scale,
    STRIDE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Pass 2: the probabilities of one tile summed into its (query block, key block) cells, for
    layout rows ``[row0, row1)`` (``out`` row 0 is layout row ``row0``)."""
    ROW_BLOCKS: tl.constexpr = BLOCK_M // GROUP_PAD
    KEY_BLOCKS: tl.constexpr = BLOCK_N // GROUP_PAD
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    tile = pid // num_key_tiles
    kt = pid % num_key_tiles
    q_start = tl.load(q_start_ptr + b).to(tl.int32)
    kv_len = tl.load(kv_len_ptr + b).to(tl.int32)
    lo = q_start
    hi = tl.minimum(q_start + q_len, kv_len)
    first_block = q_start // (GROUP * STRIDE)

    r, t, gi, m_abs, row_ok, real, last = _strided_rows(
        tile, row0, row1, first_block, lo, hi, STRIDE, GROUP, GROUP_PAD, BLOCK_M
    )
    n_idx, col_ok = _strided_keys(kt, num_key_blocks, GROUP, GROUP_PAD, BLOCK_N)
    # a tile wholly after every real row's diagonal (or without real rows) is all zero
    n_steps = tl.where(last >= kt * KEY_BLOCKS * GROUP, STRIDE, 0)

    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = k_ptr + b.to(tl.int64) * stride_kb + (h // group_size).to(tl.int64) * stride_kh
    s = _antidiagonal_tile(
        q_base, k_base, m_abs, row_ok, lo, hi, n_idx, col_ok, kv_len,
        stride_qs, stride_qd, stride_ks, stride_kd, n_steps,
        STRIDE, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, IEEE, UPCAST,
    )
    stat = (b * num_q_heads + h).to(tl.int64) * stat_stride + t * GROUP_PAD + gi
    row_max = tl.load(row_max_ptr + stat, mask=real, other=0.0)
    row_sum = tl.load(row_sum_ptr + stat, mask=real, other=1.0)
    keep = real[:, None] & col_ok[None, :] & (n_idx[None, :] <= m_abs[:, None])
    s = tl.where(keep, s * qk_scale, float("-inf"))
    p = tl.exp2(s - row_max[:, None]) / row_sum[:, None]
    cells = tl.sum(tl.sum(tl.reshape(p, (ROW_BLOCKS, GROUP_PAD, KEY_BLOCKS, GROUP_PAD)), axis=3), axis=1)

    ot = tile * ROW_BLOCKS + tl.arange(0, ROW_BLOCKS)
    on = kt * KEY_BLOCKS + tl.arange(0, KEY_BLOCKS)
    ptrs = (
        out_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        + ot[:, None].to(tl.int64) * stride_ot + on[None, :] * stride_on
    )
    tl.store(ptrs, cells, mask=(ot < row1 - row0)[:, None] & (on < num_key_blocks)[None, :])


@triton.jit
def _single_pass_kernel(
    q_ptr, k_ptr, q_start_ptr, kv_len_ptr, part_ptr, tmax_ptr, out_ptr,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_ob, stride_oh, stride_ot, stride_on,
    q_len, row0, row1, num_key_blocks, num_key_tiles, num_q_heads, group_size, part_rows, qk_scale,
    STRIDE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """One pass over the scores of ``BLOCK_M`` strided rows (layout rows ``[row0, row1)``): the
    online max and sum as in pass 1, and per key tile each row's ``exp`` sums per key block
    relative to the running max then, kept in ``part`` with that max in ``tmax``; then, once the
    row's final max and sum are known, the kept sums rescaled, summed over each query block's
    rows and written to ``out``."""
    ROW_BLOCKS: tl.constexpr = BLOCK_M // GROUP_PAD
    KEY_BLOCKS: tl.constexpr = BLOCK_N // GROUP_PAD
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows first
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(q_start_ptr + b).to(tl.int32)
    kv_len = tl.load(kv_len_ptr + b).to(tl.int32)
    lo = q_start
    hi = tl.minimum(q_start + q_len, kv_len)
    first_block = q_start // (GROUP * STRIDE)

    r, t, gi, m_abs, row_ok, real, last = _strided_rows(
        tile, row0, row1, first_block, lo, hi, STRIDE, GROUP, GROUP_PAD, BLOCK_M
    )
    n_tiles = tl.where(last >= 0, tl.minimum(num_key_tiles, (last // GROUP) // KEY_BLOCKS + 1), 0)

    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = k_ptr + b.to(tl.int64) * stride_kb + (h // group_size).to(tl.int64) * stride_kh
    bh = (b * num_q_heads + h).to(tl.int64)
    prow = bh * part_rows + tile * BLOCK_M + r  # this program's rows of the scratch
    cols = tl.arange(0, KEY_BLOCKS)
    part_stride = num_key_tiles * KEY_BLOCKS
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    for kt in range(0, n_tiles):
        s = _causal_scores(
            q_base, k_base, m_abs, row_ok, lo, hi, kv_len, kt, num_key_blocks, qk_scale,
            stride_qs, stride_qd, stride_ks, stride_kd,
            STRIDE, GROUP, GROUP_PAD, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, IEEE, UPCAST,
        )
        new_max = tl.maximum(row_max, tl.max(s, axis=1))  # finite: key 0 is causal for every row
        e = tl.exp2(s - new_max[:, None])
        row_sum = row_sum * tl.exp2(row_max - new_max) + tl.sum(e, axis=1)
        row_max = new_max
        sums = tl.sum(tl.reshape(e, (BLOCK_M, KEY_BLOCKS, GROUP_PAD)), axis=2)
        tl.store(part_ptr + prow[:, None] * part_stride + kt * KEY_BLOCKS + cols[None, :], sums)
        tl.store(tmax_ptr + prow * num_key_tiles + kt, new_max)
    tl.debug_barrier()  # the second loop reads what other threads of this program stored
    inv = tl.where(real, 1.0 / tl.where(real, row_sum, 1.0), 0.0)
    ot = tile * ROW_BLOCKS + tl.arange(0, ROW_BLOCKS)
    o_base = out_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + ot[:, None].to(tl.int64) * stride_ot
    for kt in range(0, n_tiles):
        sums = tl.load(part_ptr + prow[:, None] * part_stride + kt * KEY_BLOCKS + cols[None, :])
        at = tl.load(tmax_ptr + prow * num_key_tiles + kt)
        scaled = sums * (tl.exp2(at - row_max) * inv)[:, None]
        cells = tl.sum(tl.reshape(scaled, (ROW_BLOCKS, GROUP_PAD, KEY_BLOCKS)), axis=1)
        on = kt * KEY_BLOCKS + cols
        tl.store(o_base + on[None, :] * stride_on, cells,
                 mask=(ot < row1 - row0)[:, None] & (on < num_key_blocks)[None, :])


# ---------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------


def iter_antidiagonal_mass_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    seq: SeqInfo,
    *,
    block_size: int,
    stride: int,
    chunk_size: int,
    scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    passes: int | None = None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """:func:`elasticfw.attention.patterns.iter_antidiagonal_mass` on the Triton kernels.

    Yields ``(t0, t1, mass)`` for layout rows ``[t0, t1)``, mass (B, Hq, t1-t0, NKB) float32, the
    same values up to float32 rounding (summation order). ``q`` and ``k`` are read in place
    through their strides (no copy). ``block_m`` / ``block_n`` override the tile sizes (powers of
    two); ``passes`` (1 or 2, default :data:`PASSES`) picks the kernels. Raises
    :class:`~elasticfw.errors.BackendUnavailableError` where :func:`unsupported` gives a reason.
    """
    passes = PASSES if passes is None else passes
    if passes not in (1, 2):
        raise ValueError(f"Triton antidiagonal estimate: passes must be 1 or 2, got {passes}")
    seq.check(q, k)
    bs, s = block_size, stride
    if s < 1 or bs < 1 or bs % s:
        raise ValueError(f"block_size={bs} must be a positive multiple of stride={s}")
    reason = unsupported(q, block_size=bs, stride=s)
    if reason is not None:
        raise BackendUnavailableError(f"Triton antidiagonal estimate: {reason}")
    batch, hq, q_len, dim = q.shape
    hkv = k.shape[1]
    group = bs // s
    group_pad = next_pow2(group)
    d_pad = max(16, next_pow2(dim))
    nqb, nkb = seq.num_query_blocks(bs), seq.num_key_blocks(bs)
    if nqb == 0:
        return
    budget = shared_memory_budget(q.device, SMEM_BUDGET)
    bm, bn, stages = _tiles(q.element_size(), d_pad, group_pad, block_m, block_n, budget)
    rows_per_tile = bm // group_pad
    keys_per_tile = bn // group_pad
    row_tiles = cdiv(nqb, rows_per_tile)
    stat_stride = row_tiles * bm
    dev = q.device
    row_max = torch.empty(batch * hq, stat_stride if passes == 2 else 0, dtype=torch.float32, device=dev)
    row_sum = torch.empty_like(row_max)
    q_start = seq.q_start.contiguous()
    kv_len = seq.kv_len.contiguous()
    base = scale if scale is not None else 1.0 / math.sqrt(dim)
    qk_scale = base / s * _LOG2E
    common = dict(
        STRIDE=s, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=dim, D_PAD=d_pad, BLOCK_M=bm, BLOCK_N=bn,
        IEEE=q.dtype == torch.float32, UPCAST=interpreting() and q.dtype == torch.bfloat16,
        num_warps=NUM_WARPS, num_stages=stages,
    )
    if passes == 2:
        _stats_kernel[(row_tiles, hq, batch)](
            q, k, q_start, kv_len, row_max, row_sum,
            *q.stride(), *k.stride(),
            q_len, nqb, nkb, hq, hq // hkv, stat_stride, qk_scale,
            **common,
        )
    first_max = int(seq.q_block_start(bs).max().item())  # one host read: the last causal key block
    rows_per_chunk = max(1, chunk_size // bs)
    for t0 in range(0, nqb, rows_per_chunk):
        t1 = min(nqb, t0 + rows_per_chunk)
        mass = torch.zeros(batch, hq, t1 - t0, nkb, dtype=torch.float32, device=dev)
        kb_end = max(1, min(nkb, first_max + t1))  # key blocks past it are never causal here
        key_tiles = cdiv(kb_end, keys_per_tile)
        if passes == 1:
            chunk_tiles = cdiv(t1 - t0, rows_per_tile)
            part_rows = chunk_tiles * bm
            part = torch.empty(batch * hq, part_rows, key_tiles * keys_per_tile, dtype=torch.float32, device=dev)
            tmax = torch.empty(batch * hq, part_rows, key_tiles, dtype=torch.float32, device=dev)
            _single_pass_kernel[(chunk_tiles, hq, batch)](
                q, k, q_start, kv_len, part, tmax, mass,
                *q.stride(), *k.stride(), *mass.stride(),
                q_len, t0, t1, nkb, key_tiles, hq, hq // hkv, part_rows, qk_scale,
                **common,
            )
            yield t0, t1, mass
            continue
        grid = (cdiv(t1 - t0, rows_per_tile) * key_tiles, hq, batch)
        _mass_kernel[grid](
            q, k, q_start, kv_len, row_max, row_sum, mass,
            *q.stride(), *k.stride(), *mass.stride(),
            q_len, t0, t1, nkb, key_tiles, hq, hq // hkv, stat_stride, qk_scale,
            **common,
        )
        yield t0, t1, mass


def antidiagonal_mass_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    seq: SeqInfo,
    *,
    block_size: int,
    stride: int,
    chunk_size: int = 16384,
    scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    passes: int | None = None,
) -> torch.Tensor:
    """(B, Hq, NQB, NKB) float32: :func:`iter_antidiagonal_mass_triton` for every layout row."""
    parts = [
        m
        for _, _, m in iter_antidiagonal_mass_triton(
            q, k, seq, block_size=block_size, stride=stride, chunk_size=chunk_size, scale=scale,
            block_m=block_m, block_n=block_n, passes=passes,
        )
    ]
    if not parts:
        return q.new_zeros(q.shape[0], q.shape[1], 0, seq.num_key_blocks(block_size), dtype=torch.float32)
    return torch.cat(parts, dim=2)
