"""Fused NSA block importance (Triton): compressed-attention importance per layout tile, without
the score matrix.

Computes what ``NSAAttention.block_importance`` computes with ``query_granularity: block``: per
(sample, KV head, layout tile, key block), the sum over the tile's real query rows and the group's
query heads of ``sum_m softmax_m(scale * q . c_m) * overlap(m, n)`` over each row's valid
compressed keys ``c_m`` (window means, computed beforehand in torch). Two passes over the ``rows x
windows`` scores (softmax statistics per row, then probabilities summed per tile and mapped onto
key blocks), never storing them; ``q . c`` as ``SPLIT`` tensor-core products of 16-bit terms of
``c`` (float32 inputs: IEEE float32). Each program owns its output rows: no atomics, a
deterministic result, nothing quadratic in the sequence. :func:`unsupported` says when the kernels
cannot run. Precision, memory and the tile measurements: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elasticfw.attention.patterns import window_means
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import cdiv, interpreting, next_pow2, shared_memory_budget, unsupported_tensor

__all__ = ["nsa_block_importance_triton", "unsupported"]

#: score rows per program (a power of two, >= 16): query heads x whole tiles x padded positions
BLOCK_M = 256
#: windows per inner step (a power of two, >= 16; raised where a window's spill needs more blocks)
BLOCK_N = 64
NUM_WARPS = 8
#: 3 stages of 256 query rows and 2 x 64 windows of head dim 128 in 16 bits: 160 KB (module docstring)
NUM_STAGES = 3
#: terms of the 16-bit split of the float32 compressed keys (module docstring); 1 to 3
SPLIT = 2
#: shared memory the resident query tile and the pipelined key tiles may use per program at most
#: (lowered to the device's limit by :func:`~elasticfw.kernels.shared_memory_budget`)
SMEM_BUDGET = 160 * 1024
#: the largest ``next_pow2(block_size)`` (a program holds whole tiles)
MAX_BLOCK = 256
#: the largest ``BLOCK_N`` the spill of a window may require
MAX_BLOCK_N = 256
#: the largest head dim (padded to a power of two, kept whole in each tile)
MAX_HEAD_DIM = 256

_LOG2E = 1.4426950408889634


def _min_block_n(block_size: int, kernel: int, stride: int) -> int:
    """The fewest windows per step: whole key blocks, enough of them to hold a window's spill."""
    per_block = block_size // stride
    spill = (per_block - 1 + kernel // stride - 1) // per_block  # blocks past its first a window reaches
    return max(16, next_pow2(per_block) * next_pow2(spill + 1))


def unsupported(q: torch.Tensor, *, block_size: int, kernel: int, stride: int) -> str | None:
    """``None`` when the kernels can score ``q`` (B, Hq, Sq, D) at this block size, compression
    kernel and stride, else why not (the device, the dtype or the shape)."""
    reason = unsupported_tensor(q, "Triton NSA scorer")
    if reason is not None:
        return reason
    if stride < 1 or kernel < 1 or block_size < 1 or kernel % stride or block_size % stride:
        return (
            f"compress_kernel {kernel} and block_size {block_size} must be positive multiples of "
            f"compress_stride {stride}"
        )
    if next_pow2(block_size) > MAX_BLOCK:
        return f"block_size {block_size} is above the Triton NSA scorer's {MAX_BLOCK}"
    if _min_block_n(block_size, kernel, stride) > MAX_BLOCK_N:
        return (
            f"a compression window spans too many blocks for the Triton NSA scorer (block_size {block_size}, "
            f"compress_kernel {kernel}, compress_stride {stride})"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} is above the Triton NSA scorer's {MAX_HEAD_DIM}"
    return None


def _tiles(
    group: int, block_size: int, kernel: int, stride: int, d_pad: int, elsize: int, split: int,
    block_m: int | None, block_n: int | None, budget: int = SMEM_BUDGET,
) -> tuple[int, int, int, int, int]:
    """(heads per chunk HP, tiles per program RB, rows BLOCK_M, windows BLOCK_N, stages): the
    defaults shrunk to fit ``budget`` bytes of shared memory, never below one whole tile or the
    spill floor."""
    bs_pad = next_pow2(block_size)
    n_floor = _min_block_n(block_size, kernel, stride)
    rows = max(block_m or BLOCK_M, bs_pad, 16)
    bn = max(block_n or BLOCK_N, n_floor)
    stages = NUM_STAGES
    if block_m is None or block_n is None:
        while (rows + bn * split * stages) * d_pad * elsize > budget:
            if block_n is None and bn > n_floor and bn * split * stages >= rows:
                bn //= 2
            elif block_m is None and rows > max(bs_pad, 16):
                rows //= 2
            elif stages > 1:
                stages -= 1
            else:
                break
    for name, value in (("block_m", rows), ("block_n", bn)):
        if value & (value - 1):
            raise ValueError(f"Triton NSA importance: {name} must be a power of two, got {value}")
    hp = min(next_pow2(group), rows // bs_pad)
    rb = rows // (hp * bs_pad)
    return hp, rb, hp * rb * bs_pad, bn, stages


# ---------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _rows(
    t0, hc, q_start, kv_len, q_len, num_rows, group_size,
    BS: tl.constexpr, BS_PAD: tl.constexpr, RB: tl.constexpr, HP: tl.constexpr,
    KERNEL: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Per score row of a program (head, tile, position): its group head, position, query row,
    whether it is a real query (``real``) and whether it also has a valid window (``usable``)."""
    r = tl.arange(0, BLOCK_M)
    head = hc * HP + r // (RB * BS_PAD)
    t = t0 + (r // BS_PAD) % RB  # layout row
    i = r % BS_PAD
    pos = (q_start // BS + t) * BS + i
    ri = pos - q_start
    real = (i < BS) & (t < num_rows) & (ri >= 0) & (ri < q_len) & (pos < kv_len) & (head < group_size)
    usable = real & (pos + 1 >= KERNEL)
    return head, pos, ri, real, usable


@triton.jit
def _load_q(q_ptr, b, hq, ri, real, stride_qb, stride_qh, stride_qs, stride_qd,
            HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, UPCAST: tl.constexpr):
    d = tl.arange(0, D_PAD)
    offs = b.to(tl.int64) * stride_qb + hq.to(tl.int64) * stride_qh + ri.to(tl.int64) * stride_qs
    qv = tl.load(
        q_ptr + offs[:, None] + d[None, :] * stride_qd, mask=real[:, None] & (d < HEAD_DIM)[None, :], other=0.0
    )
    if UPCAST:  # the interpreter multiplies bfloat16 bit patterns as integers: upcast (exact)
        qv = qv.to(tl.float32)
    return qv


@triton.jit
def _chunk_rows(
    q_ptr, row_max_ptr, row_sum_ptr, b, hkv, t0, hc, q_start, kv_len, q_len, num_rows, group_size, stat_base,
    stride_qb, stride_qh, stride_qs, stride_qd,
    BS: tl.constexpr, BS_PAD: tl.constexpr, RB: tl.constexpr, HP: tl.constexpr,
    KERNEL: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, UPCAST: tl.constexpr,
):
    """Head chunk ``hc``'s rows for pass 2: positions, usable rows, queries, pass 1's max and 1/sum.
    Rows that are not usable get a zero query, a zero max and a zero 1/sum: probability 0 in every
    column, masked or not."""
    head, pos, ri, real, usable = _rows(
        t0, hc, q_start, kv_len, q_len, num_rows, group_size, BS, BS_PAD, RB, HP, KERNEL, BLOCK_M
    )
    qv = _load_q(
        q_ptr, b, hkv * group_size + head, ri, usable, stride_qb, stride_qh, stride_qs, stride_qd,
        HEAD_DIM, D_PAD, UPCAST,
    )
    stat = stat_base + head.to(tl.int64) * q_len + ri
    row_max = tl.load(row_max_ptr + stat, mask=usable, other=0.0)
    inv_sum = tl.where(usable, 1.0 / tl.load(row_sum_ptr + stat, mask=usable, other=1.0), 0.0)
    return pos, usable, qv, row_max, inv_sum


@triton.jit
def _overlap(first, gj, blocks, PER_BLOCK: tl.constexpr, GROUP_PAD: tl.constexpr, WINDOWS_PER_KERNEL: tl.constexpr):
    """(BLOCK_N, len(blocks)) float32: sub-chunks a column's window (its first sub-chunk ``first``,
    from the step's start) shares with each block of ``blocks`` (counted from the step's start)."""
    lo = first[:, None]
    shared = tl.minimum(lo + WINDOWS_PER_KERNEL, (blocks[None, :] + 1) * PER_BLOCK) - tl.maximum(
        lo, blocks[None, :] * PER_BLOCK
    )
    return tl.where(gj[:, None] < PER_BLOCK, tl.maximum(shared, 0), 0).to(tl.float32)


@triton.jit
def _windows(kt, num_windows, PER_BLOCK: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Window index of every column of step ``kt`` and whether it exists."""
    KEY_BLOCKS: tl.constexpr = BLOCK_N // GROUP_PAD
    c = tl.arange(0, BLOCK_N)
    gj = c % GROUP_PAD
    m = (kt * KEY_BLOCKS + c // GROUP_PAD) * PER_BLOCK + gj
    return m, (gj < PER_BLOCK) & (m < num_windows)


@triton.jit
def _scores(qv, c_base, m, m_ok, stride_ct, stride_cm, stride_cd,
            SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
            CHECK: tl.constexpr):
    """(BLOCK_M, BLOCK_N) float32 ``q . c_m``, ``c`` summed from its ``SPLIT`` terms. ``CHECK``:
    columns may be windows that do not exist (``m_ok``); else every column is read unmasked."""
    d = tl.arange(0, D_PAD)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ptrs = c_base + m.to(tl.int64)[:, None] * stride_cm + d[None, :] * stride_cd
    if CHECK:
        mask = m_ok[:, None] & (d < HEAD_DIM)[None, :]
    else:
        mask = (m >= 0)[:, None] & (d < HEAD_DIM)[None, :]  # all true: only the head dim's padding
    for term in tl.static_range(SPLIT):
        if CHECK or D_PAD != HEAD_DIM:
            cv = tl.load(ptrs + term * stride_ct, mask=mask, other=0.0)
        else:
            cv = tl.load(ptrs + term * stride_ct)
        if UPCAST:
            cv = cv.to(tl.float32)
        if IEEE:
            acc = tl.dot(qv, tl.trans(cv), acc, input_precision="ieee")
        else:
            acc = tl.dot(qv, tl.trans(cv), acc)
    return acc


@triton.jit
def _num_steps(pos, usable, KERNEL: tl.constexpr, STRIDE: tl.constexpr, PER_BLOCK: tl.constexpr,
               KEY_BLOCKS: tl.constexpr):
    """Window steps holding a window valid for some usable row (0 when none is)."""
    limit = tl.max(tl.where(usable, pos + 1, 0), axis=0)  # the latest row's position + 1
    last = tl.where(limit >= KERNEL, (limit - KERNEL) // STRIDE, 0)  # its last valid window
    return tl.where(limit >= KERNEL, last // PER_BLOCK // KEY_BLOCKS + 1, 0)


@triton.jit
def _num_full_steps(pos, usable, KERNEL: tl.constexpr, STRIDE: tl.constexpr, PER_BLOCK: tl.constexpr,
                    KEY_BLOCKS: tl.constexpr):
    """Leading window steps whose every window is valid for every usable row: the earliest usable
    row sees them all, so these steps need no causal mask (0 when no row is usable)."""
    none: tl.constexpr = 2147483647
    first = tl.min(tl.where(usable, pos + 1, none), axis=0)  # the earliest usable row's position + 1
    some = (first >= KERNEL) & (first < none)  # a usable row has position + 1 >= KERNEL
    seen = tl.where(some, (first - KERNEL) // STRIDE + 1, 0)  # windows it sees: 0 .. seen - 1
    return seen // (PER_BLOCK * KEY_BLOCKS)


@triton.jit
def _stats_kernel(
    q_ptr, c_ptr, q_start_ptr, kv_len_ptr, row_max_ptr, row_sum_ptr,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_ct, stride_cb, stride_ch, stride_cm, stride_cd,
    q_len, num_rows, num_windows, num_q_heads, group_size, qk_scale,
    BS: tl.constexpr, BS_PAD: tl.constexpr, RB: tl.constexpr, HP: tl.constexpr, HEAD_CHUNKS: tl.constexpr,
    KERNEL: tl.constexpr, STRIDE: tl.constexpr, PER_BLOCK: tl.constexpr, GROUP_PAD: tl.constexpr,
    SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Pass 1: per score row, the max and the sum of ``exp2`` of the base-2 logits over its valid
    windows (``-inf`` and 0 for a row without one)."""
    KEY_BLOCKS: tl.constexpr = BLOCK_N // GROUP_PAD
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows first
    hkv = tl.program_id(1) // HEAD_CHUNKS
    hc = tl.program_id(1) % HEAD_CHUNKS
    b = tl.program_id(2)
    q_start = tl.load(q_start_ptr + b).to(tl.int32)
    kv_len = tl.load(kv_len_ptr + b).to(tl.int32)
    head, pos, ri, real, usable = _rows(
        tile * RB, hc, q_start, kv_len, q_len, num_rows, group_size, BS, BS_PAD, RB, HP, KERNEL, BLOCK_M
    )
    hq = hkv * group_size + head
    # rows that are not usable read a zero query: finite scores in the unmasked steps, reset at the end
    qv = _load_q(q_ptr, b, hq, ri, usable, stride_qb, stride_qh, stride_qs, stride_qd, HEAD_DIM, D_PAD, UPCAST)
    c_base = c_ptr + b.to(tl.int64) * stride_cb + hkv.to(tl.int64) * stride_ch
    n_steps = _num_steps(pos, usable, KERNEL, STRIDE, PER_BLOCK, KEY_BLOCKS)
    n_full = _num_full_steps(pos, usable, KERNEL, STRIDE, PER_BLOCK, KEY_BLOCKS)
    row_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    for kt in range(0, n_full):  # every window valid for every row: no causal mask
        m, m_ok = _windows(kt, num_windows, PER_BLOCK, GROUP_PAD, BLOCK_N)
        s = _scores(
            qv, c_base, m, m_ok, stride_ct, stride_cm, stride_cd,
            SPLIT, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, IEEE, UPCAST, GROUP_PAD != PER_BLOCK,
        )
        s = s * qk_scale
        if GROUP_PAD != PER_BLOCK:  # the padding members of each block are no windows
            s = tl.where(m_ok[None, :], s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, axis=1))  # finite: every row has a real column
        row_sum = row_sum * tl.exp2(row_max - new_max) + tl.sum(tl.exp2(s - new_max[:, None]), axis=1)
        row_max = new_max
    for kt in range(n_full, n_steps):  # the causal edge
        m, m_ok = _windows(kt, num_windows, PER_BLOCK, GROUP_PAD, BLOCK_N)
        s = _scores(
            qv, c_base, m, m_ok, stride_ct, stride_cm, stride_cd,
            SPLIT, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, IEEE, UPCAST, True,
        )
        valid = usable[:, None] & m_ok[None, :] & (m[None, :] * STRIDE + KERNEL <= pos[:, None] + 1)
        s = tl.where(valid, s * qk_scale, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows with nothing valid yet
        row_sum = row_sum * tl.exp2(row_max - safe) + tl.sum(tl.exp2(s - safe[:, None]), axis=1)
        row_max = new_max
    out = (b * num_q_heads + hq).to(tl.int64) * q_len + ri
    tl.store(row_max_ptr + out, tl.where(usable, row_max, float("-inf")), mask=real)
    tl.store(row_sum_ptr + out, tl.where(usable, row_sum, 0.0), mask=real)


@triton.jit
def _importance_step(
    kt, carry, own, nxt, n, out_rows, row_mask, qv0, max0, inv0, usable, pos0,
    q_ptr, row_max_ptr, row_sum_ptr, c_base, b, hkv, t0, q_start, kv_len, q_len, num_rows, group_size,
    stat_base, num_windows, num_key_blocks, qk_scale, stride_qb, stride_qh, stride_qs, stride_qd,
    stride_ct, stride_cm, stride_cd, stride_on,
    BS: tl.constexpr, BS_PAD: tl.constexpr, RB: tl.constexpr, HP: tl.constexpr, HEAD_CHUNKS: tl.constexpr,
    KERNEL: tl.constexpr, STRIDE: tl.constexpr, PER_BLOCK: tl.constexpr, GROUP_PAD: tl.constexpr,
    SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, FULL: tl.constexpr,
):
    """One window step of pass 2: the step's probabilities summed per (tile, window) over rows and
    heads, its own blocks written (with the carry from the previous step), its spill returned.
    ``FULL``: every window of the step is valid for every usable row (no causal mask; rows that are
    not usable have probability 0 through their zero query and 1/sum)."""
    KEY_BLOCKS: tl.constexpr = BLOCK_N // GROUP_PAD
    PADDED: tl.constexpr = GROUP_PAD != PER_BLOCK
    m, m_ok = _windows(kt, num_windows, PER_BLOCK, GROUP_PAD, BLOCK_N)
    per_window = tl.zeros((RB, BLOCK_N), tl.float32)
    for hc in range(0, HEAD_CHUNKS):
        if HEAD_CHUNKS == 1:
            qv = qv0
            row_max = max0
            inv_sum = inv0
            ok = usable
            pos = pos0
        else:
            pos, ok, qv, row_max, inv_sum = _chunk_rows(
                q_ptr, row_max_ptr, row_sum_ptr, b, hkv, t0, hc, q_start, kv_len, q_len, num_rows, group_size,
                stat_base, stride_qb, stride_qh, stride_qs, stride_qd,
                BS, BS_PAD, RB, HP, KERNEL, BLOCK_M, HEAD_DIM, D_PAD, UPCAST,
            )
        s = _scores(
            qv, c_base, m, m_ok, stride_ct, stride_cm, stride_cd,
            SPLIT, HEAD_DIM, D_PAD, BLOCK_M, BLOCK_N, IEEE, UPCAST, PADDED or not FULL,
        )
        s = s * qk_scale - row_max[:, None]
        if FULL:
            if PADDED:  # the padding members of each block are no windows
                s = tl.where(m_ok[None, :], s, float("-inf"))
        else:
            valid = ok[:, None] & m_ok[None, :] & (m[None, :] * STRIDE + KERNEL <= pos[:, None] + 1)
            s = tl.where(valid, s, float("-inf"))
        p = tl.exp2(s) * inv_sum[:, None]
        if RB == 1:  # one tile: every row of the program is summed (no reshape of the scores)
            per_window += tl.sum(p, axis=0)[None, :]
        else:
            p = tl.sum(tl.reshape(p, (HP, RB, BS_PAD, BLOCK_N)), axis=2)
            per_window += tl.sum(p, axis=0)
    blocks = tl.sum(per_window[:, :, None] * own[None, :, :], axis=1) + carry
    kb = kt * KEY_BLOCKS + n
    tl.store(out_rows + kb[None, :] * stride_on, blocks, mask=row_mask & (kb < num_key_blocks)[None, :])
    return tl.sum(per_window[:, :, None] * nxt[None, :, :], axis=1)


@triton.jit
def _importance_kernel(
    q_ptr, c_ptr, q_start_ptr, kv_len_ptr, row_max_ptr, row_sum_ptr, out_ptr,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_ct, stride_cb, stride_ch, stride_cm, stride_cd,
    stride_ob, stride_oh, stride_ot, stride_on,
    q_len, num_rows, num_windows, num_key_blocks, num_q_heads, group_size, qk_scale,
    BS: tl.constexpr, BS_PAD: tl.constexpr, RB: tl.constexpr, HP: tl.constexpr, HEAD_CHUNKS: tl.constexpr,
    KERNEL: tl.constexpr, STRIDE: tl.constexpr, PER_BLOCK: tl.constexpr, GROUP_PAD: tl.constexpr,
    SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Pass 2: the probabilities of the program's rows summed per (tile, window) over rows and
    heads, mapped onto key blocks by overlap, written to ``out`` rows ``[tile*RB, tile*RB + RB)``."""
    KEY_BLOCKS: tl.constexpr = BLOCK_N // GROUP_PAD
    WINDOWS_PER_KERNEL: tl.constexpr = KERNEL // STRIDE
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    hkv = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(q_start_ptr + b).to(tl.int32)
    kv_len = tl.load(kv_len_ptr + b).to(tl.int32)
    t0 = tile * RB
    c_base = c_ptr + b.to(tl.int64) * stride_cb + hkv.to(tl.int64) * stride_ch
    stat_base = (b * num_q_heads + hkv * group_size).to(tl.int64) * q_len

    # rows of head chunk 0 (the same positions as every chunk's): the causal limit of the program
    head, pos, ri, real, usable = _rows(
        t0, 0, q_start, kv_len, q_len, num_rows, group_size, BS, BS_PAD, RB, HP, KERNEL, BLOCK_M
    )
    n_steps = _num_steps(pos, usable, KERNEL, STRIDE, PER_BLOCK, KEY_BLOCKS)
    # the whole group is resident when it fits one chunk: its rows and statistics are loaded once (with
    # several chunks, each step loads every chunk's; these are then chunk 0's, unused)
    _, _, qv0, max0, inv0 = _chunk_rows(
        q_ptr, row_max_ptr, row_sum_ptr, b, hkv, t0, 0, q_start, kv_len, q_len, num_rows, group_size, stat_base,
        stride_qb, stride_qh, stride_qs, stride_qd, BS, BS_PAD, RB, HP, KERNEL, BLOCK_M, HEAD_DIM, D_PAD, UPCAST,
    )

    # overlap (in sub-chunks) of each column's window with the step's own blocks and the next ones
    c = tl.arange(0, BLOCK_N)
    gj = c % GROUP_PAD
    first = (c // GROUP_PAD) * PER_BLOCK + gj  # the window's first sub-chunk, from the step's start
    n = tl.arange(0, KEY_BLOCKS)
    own = _overlap(first, gj, n, PER_BLOCK, GROUP_PAD, WINDOWS_PER_KERNEL)
    nxt = _overlap(first, gj, n + KEY_BLOCKS, PER_BLOCK, GROUP_PAD, WINDOWS_PER_KERNEL)

    rb = tl.arange(0, RB)
    out_rows = (
        out_ptr + b.to(tl.int64) * stride_ob + hkv.to(tl.int64) * stride_oh
        + (t0 + rb).to(tl.int64)[:, None] * stride_ot
    )
    row_mask = (t0 + rb < num_rows)[:, None]
    carry = tl.zeros((RB, KEY_BLOCKS), tl.float32)
    n_full = _num_full_steps(pos, usable, KERNEL, STRIDE, PER_BLOCK, KEY_BLOCKS)
    for kt in range(0, n_full):  # every window valid for every row: no causal mask
        carry = _importance_step(
            kt, carry, own, nxt, n, out_rows, row_mask, qv0, max0, inv0, usable, pos,
            q_ptr, row_max_ptr, row_sum_ptr, c_base, b, hkv, t0, q_start, kv_len, q_len, num_rows, group_size,
            stat_base, num_windows, num_key_blocks, qk_scale, stride_qb, stride_qh, stride_qs, stride_qd,
            stride_ct, stride_cm, stride_cd, stride_on,
            BS, BS_PAD, RB, HP, HEAD_CHUNKS, KERNEL, STRIDE, PER_BLOCK, GROUP_PAD, SPLIT, HEAD_DIM, D_PAD,
            BLOCK_M, BLOCK_N, IEEE, UPCAST, True,
        )
    for kt in range(n_full, n_steps):  # the causal edge
        carry = _importance_step(
            kt, carry, own, nxt, n, out_rows, row_mask, qv0, max0, inv0, usable, pos,
            q_ptr, row_max_ptr, row_sum_ptr, c_base, b, hkv, t0, q_start, kv_len, q_len, num_rows, group_size,
            stat_base, num_windows, num_key_blocks, qk_scale, stride_qb, stride_qh, stride_qs, stride_qd,
            stride_ct, stride_cm, stride_cd, stride_on,
            BS, BS_PAD, RB, HP, HEAD_CHUNKS, KERNEL, STRIDE, PER_BLOCK, GROUP_PAD, SPLIT, HEAD_DIM, D_PAD,
            BLOCK_M, BLOCK_N, IEEE, UPCAST, False,
        )
    kb = n_steps * KEY_BLOCKS + n  # the last step's spill (zeros where nothing spills)
    tl.store(out_rows + kb[None, :] * stride_on, carry, mask=row_mask & (kb < num_key_blocks)[None, :])


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------


def _split(c: torch.Tensor, dtype: torch.dtype, terms: int) -> torch.Tensor:
    """(terms, *c.shape) in ``dtype``: ``c`` rounded, then each remainder rounded."""
    if dtype == torch.float32:
        return c.unsqueeze(0).contiguous()
    parts = []
    rest = c
    for _ in range(terms):
        part = rest.to(dtype)
        parts.append(part)
        rest = rest - part.float()
    return torch.stack(parts).contiguous()


def nsa_block_importance_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    seq: SeqInfo,
    *,
    block_size: int,
    kernel: int,
    stride: int,
    scale: float | None = None,
    compressed: torch.Tensor | None = None,
    split: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """``NSAAttention.block_importance`` (``query_granularity: block``) on the Triton kernels.

    Returns (B, Hkv, NQB, NKB) float32, the same values up to float32 rounding (summation order;
    for 16-bit inputs also the ``split`` of the compressed keys, module docstring). ``q`` is read
    in place through its strides. ``compressed`` may pass ``window_means(k, kernel, stride)``
    when the caller has it (float32, (B, Hkv, M, D)); ``split`` (1 to 3, default :data:`SPLIT`)
    and ``block_m`` / ``block_n`` (powers of two) override the precision and the tile sizes.
    Raises :class:`~elasticfw.errors.BackendUnavailableError` where :func:`unsupported` gives a
    reason.
    """
    seq.check(q, k)
    if stride < 1 or kernel < 1 or block_size < 1 or kernel % stride or block_size % stride:
        raise ValueError(
            f"compress_kernel={kernel} and block_size={block_size} must be positive multiples of "
            f"compress_stride={stride}"
        )
    reason = unsupported(q, block_size=block_size, kernel=kernel, stride=stride)
    if reason is not None:
        raise BackendUnavailableError(f"Triton NSA importance: {reason}")
    terms = SPLIT if split is None else split
    if not 1 <= terms <= 3:
        raise ValueError(f"Triton NSA importance: split must be 1, 2 or 3, got {terms}")
    if q.dtype == torch.float32:
        terms = 1
    batch, hq, q_len, dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    bs = block_size
    nqb, nkb = seq.num_query_blocks(bs), seq.num_key_blocks(bs)
    out = torch.zeros(batch, hkv, nqb, nkb, dtype=torch.float32, device=q.device)
    c = window_means(k, kernel, stride) if compressed is None else compressed
    num_windows = c.shape[2]
    if c.shape != (batch, hkv, num_windows, dim):
        raise ValueError(f"compressed keys of shape {tuple(c.shape)} do not fit k {tuple(k.shape)}")
    if nqb == 0 or num_windows == 0 or batch == 0:
        return out
    c_terms = _split(c.float(), q.dtype, terms)  # (terms, B, Hkv, M, D)
    d_pad = max(16, next_pow2(dim))
    hp, rb, bm, bn, stages = _tiles(
        group, bs, kernel, stride, d_pad, q.element_size(), terms, block_m, block_n,
        shared_memory_budget(q.device, SMEM_BUDGET),
    )
    head_chunks = cdiv(group, hp)
    row_tiles = cdiv(nqb, rb)
    dev = q.device
    row_max = torch.empty(batch * hq, q_len, dtype=torch.float32, device=dev)
    row_sum = torch.empty(batch * hq, q_len, dtype=torch.float32, device=dev)
    q_start = seq.q_start.contiguous()
    kv_len = seq.kv_len.contiguous()
    qk_scale = (scale if scale is not None else dim**-0.5) * _LOG2E
    upcast = interpreting() and q.dtype == torch.bfloat16
    common = dict(
        BS=bs, BS_PAD=next_pow2(bs), RB=rb, HP=hp, HEAD_CHUNKS=head_chunks,
        KERNEL=kernel, STRIDE=stride, PER_BLOCK=bs // stride, GROUP_PAD=next_pow2(bs // stride),
        SPLIT=terms, HEAD_DIM=dim, D_PAD=d_pad, BLOCK_M=bm, BLOCK_N=bn,
        IEEE=q.dtype == torch.float32 or upcast, UPCAST=upcast,
        num_warps=NUM_WARPS, num_stages=stages,
    )
    _stats_kernel[(row_tiles, hkv * head_chunks, batch)](
        q, c_terms, q_start, kv_len, row_max, row_sum,
        *q.stride(), *c_terms.stride(),
        q_len, nqb, num_windows, hq, group, qk_scale,
        **common,
    )
    _importance_kernel[(row_tiles, hkv, batch)](
        q, c_terms, q_start, kv_len, row_max, row_sum, out,
        *q.stride(), *c_terms.stride(), *out.stride(),
        q_len, nqb, num_windows, nkb, hq, group, qk_scale,
        **common,
    )
    return out
