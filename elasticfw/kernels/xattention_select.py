"""XAttention's threshold selection (Triton): ``select_blocks`` without the sorts in PyTorch.

Computes ``plugins/modes/xattention.py``'s :func:`select_blocks` (itself
:func:`~elasticfw.attention.patterns.threshold_select` over the causal blocks with key block 0
and the diagonal forced). One program takes ``ROWS`` rows of one (sample, head):

* the row's causal masses (``n <= row_block``), their total and the forced blocks' mass;
* every other causal block becomes an int64 sort key ``(float32 bits of its mass) << 32 |
  (N_PAD - 1 - n)``: masses are non-negative, and non-negative float32 bit patterns order like
  the floats, so one descending sort of the keys visits candidates by descending mass with ties
  to the lower index (a stable descending sort); non-candidates get key -1 and sort last. The
  sort is a bitonic network over the row (:func:`_sort_descending`, Triton 3.0's ``tl.sort``
  written with sums instead of xor-reductions, which Triton's interpreter runs one element at
  a time);
* ``before_j`` (the forced mass plus the candidates before ``j``) is non-decreasing, so the kept
  candidates are the first ``L`` of that order, ``L = #{j : before_j < threshold * total}``,
  counted from one ``tl.cumsum``; the flags are stored back at the candidates' own indices
  (non-candidates store their forced flag).

The default kernel (:func:`_select_bisect_kernel`) needs no sort. With ``above(u)`` = the
forced mass plus the candidates whose float32 bit pattern exceeds ``u`` (non-increasing in ``u``,
the row total at ``u = -1``), a bisection over ``u`` (31 steps, one masked row sum each) finds
the least ``u*`` with ``above(u*) < threshold * total``. ``u*`` is the bit pattern of some
candidate (``above`` only changes there), and in descending order:

* every candidate above level ``u*`` is kept (the running sum after it is at most ``above(u*)``);
* every candidate below it is not (its running sum is at least ``above(u* - 1)``);
* the ``r``-th candidate of level ``u*`` by index is kept iff ``above(u*) + r * mass < threshold
  * total``, the running sum the sort would give it.

So the kept set is the sort's. The sort kernel stays for comparison (``method="sort"``).

Equal to the torch selector up to float32 rounding of the row total and the running sums
(summation order): only a block whose running sum lies within rounding of ``threshold * total``
can be decided differently, as between the torch selector on a CPU and on a GPU. ``threshold >= 1``
keeps every causal block (no kernel). Masses must be non-negative and not NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import triton_unavailable

__all__ = ["select_blocks_triton"]

#: about this many masses per program (rows x padded width); rows per program at most MAX_ROWS
ELEMENTS_PER_PROGRAM = 2048
MAX_ROWS = 32
NUM_WARPS = 4
#: bisection steps over the float32 bit patterns of non-negative masses (below 2**31)
BISECT_STEPS = 31


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@triton.jit
def _compare_and_swap(x, flip, i: tl.constexpr, n_dims: tl.constexpr):
    """One bitonic compare-and-swap round on the last dim of int64 ``x`` (Triton 3.0's stdlib
    ``tl.sort`` step: the partners are extracted with sums, which Triton's interpreter runs
    vectorised, where the newer stdlib's xor-reductions run one element at a time)."""
    n_outer: tl.constexpr = x.numel >> n_dims
    shape: tl.constexpr = [n_outer * 2**i, 2, 2 ** (n_dims - i - 1)]
    y = tl.reshape(x, shape)
    mask = tl.arange(0, 2)[None, :, None]
    left = tl.broadcast_to(tl.sum(y * (1 - mask), 1)[:, None, :], shape).to(y.dtype)
    right = tl.broadcast_to(tl.sum(y * mask, 1)[:, None, :], shape).to(y.dtype)
    left = tl.reshape(left, x.shape)
    right = tl.reshape(right, x.shape)
    swap = (left > right) ^ (flip != 0)
    return x ^ tl.where(swap, left ^ right, tl.zeros_like(x))


@triton.jit
def _bitonic_merge(x, stage: tl.constexpr, order: tl.constexpr, n_dims: tl.constexpr):
    n_outer: tl.constexpr = x.numel >> n_dims
    if order == 2:  # alternating: sub-sequences of 2**stage sorted up, down, up, ...
        shape: tl.constexpr = [n_outer * 2 ** (n_dims - 1 - stage), 2, 2**stage]
        flip = tl.reshape(tl.broadcast_to(tl.arange(0, 2)[None, :, None], shape), x.shape)
    else:
        flip = order
    for i in tl.static_range(stage):
        x = _compare_and_swap(x, flip, i + (n_dims - stage), n_dims)
    return x


@triton.jit
def _sort_descending(x, N_DIMS: tl.constexpr):
    """Bitonic sort of int64 ``x`` (ROWS, 2**N_DIMS) along its last dim, descending."""
    for i in tl.static_range(1, N_DIMS + 1):
        x = _bitonic_merge(x, i, 2 if i < N_DIMS else 1, N_DIMS)
    return x


@triton.jit
def _select_kernel(
    mass_ptr, row_block_ptr, out_ptr,
    stride_mb, stride_mh, stride_mt, stride_mn,
    stride_rb, stride_rt,
    stride_ob, stride_oh, stride_ot, stride_on,
    num_rows, width, threshold,
    ROWS: tl.constexpr, N_PAD: tl.constexpr, LOG_N: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    t = tile * ROWS + tl.arange(0, ROWS)
    t_ok = t < num_rows
    diag = tl.load(row_block_ptr + b.to(tl.int64) * stride_rb + t * stride_rt, mask=t_ok, other=0)
    n = tl.arange(0, N_PAD)
    inside = t_ok[:, None] & (n[None, :] < width)
    rows = b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh + t[:, None].to(tl.int64) * stride_mt
    x = tl.load(mass_ptr + rows + n[None, :] * stride_mn, mask=inside, other=0.0)
    allowed = inside & (n[None, :] <= diag[:, None])
    forced = allowed & ((n[None, :] == 0) | (n[None, :] == diag[:, None]))
    x = tl.where(allowed, x, 0.0)
    total = tl.sum(x, axis=1)
    forced_mass = tl.sum(tl.where(forced, x, 0.0), axis=1)
    candidate = allowed & ~forced
    bits = tl.where(x > 0, x.to(tl.int32, bitcast=True), 0).to(tl.int64)  # -0.0 sorts as 0.0
    low = (N_PAD - 1 - n).to(tl.int64)
    key = tl.where(candidate, (bits << 32) | low[None, :], -1)
    key = _sort_descending(key, LOG_N)
    is_candidate = key >= 0
    index = (N_PAD - 1) - (key & 0xFFFFFFFF).to(tl.int32)
    value = tl.where(is_candidate, (key >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    rank = tl.arange(0, N_PAD)[None, :]
    # running[j] = forced + value[0] + ... + value[j] = before_{j+1}
    running = tl.cumsum(tl.where(rank == 0, value + forced_mass[:, None], value), axis=1)
    target = threshold * total
    kept = tl.sum((running < target[:, None]).to(tl.int32), axis=1) + (forced_mass < target).to(tl.int32)
    take = is_candidate & (rank < kept[:, None])
    out_rows = b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + t[:, None].to(tl.int64) * stride_ot
    # disjoint stores: non-candidates in place, candidates through their sorted indices
    tl.store(out_ptr + out_rows + n[None, :] * stride_on, forced, mask=inside & ~candidate)
    tl.store(out_ptr + out_rows + index * stride_on, take, mask=t_ok[:, None] & is_candidate)


@triton.jit
def _select_bisect_kernel(
    mass_ptr, row_block_ptr, out_ptr,
    stride_mb, stride_mh, stride_mt, stride_mn,
    stride_rb, stride_rt,
    stride_ob, stride_oh, stride_ot, stride_on,
    num_rows, width, threshold,
    ROWS: tl.constexpr, N_PAD: tl.constexpr, STEPS: tl.constexpr,
):
    """The same selection without a sort: a bisection over the candidates' float32 bit patterns
    finds the lowest mass level whose first candidate is kept (see the module docstring)."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    t = tile * ROWS + tl.arange(0, ROWS)
    t_ok = t < num_rows
    diag = tl.load(row_block_ptr + b.to(tl.int64) * stride_rb + t * stride_rt, mask=t_ok, other=0)
    n = tl.arange(0, N_PAD)
    inside = t_ok[:, None] & (n[None, :] < width)
    rows = b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh + t[:, None].to(tl.int64) * stride_mt
    x = tl.load(mass_ptr + rows + n[None, :] * stride_mn, mask=inside, other=0.0)
    allowed = inside & (n[None, :] <= diag[:, None])
    forced = allowed & ((n[None, :] == 0) | (n[None, :] == diag[:, None]))
    x = tl.where(allowed, x, 0.0)
    total = tl.sum(x, axis=1)
    forced_mass = tl.sum(tl.where(forced, x, 0.0), axis=1)
    candidate = allowed & ~forced
    xc = tl.where(candidate, x, 0.0)
    bits = tl.where(candidate & (x > 0), x.to(tl.int32, bitcast=True), 0)  # -0.0 counts as 0.0
    target = threshold * total
    # above(u) = forced + the candidates with bits > u: non-increasing in u, >= target at u = -1
    # (it is the row total). Find the least u with above(u) < target, bisecting (lo, hi].
    lo = tl.full((ROWS,), -1, tl.int32)
    hi = tl.max(bits, axis=1)
    for _ in range(STEPS):
        mid = lo + (hi - lo) // 2
        above = forced_mass + tl.sum(tl.where(bits > mid[:, None], xc, 0.0), axis=1)
        go_low = above < target
        hi = tl.where(go_low, mid, hi)
        lo = tl.where(go_low, lo, mid)
    level = hi
    above_level = forced_mass + tl.sum(tl.where(bits > level[:, None], xc, 0.0), axis=1)
    on_level = candidate & (bits == level[:, None])
    rank = tl.cumsum(on_level.to(tl.int32), axis=1) - 1  # among the level's candidates, by index
    level_take = on_level & (above_level[:, None] + rank.to(tl.float32) * xc < target[:, None])
    take = (candidate & (bits > level[:, None]) | level_take) & (forced_mass < target)[:, None]
    out_rows = b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + t[:, None].to(tl.int64) * stride_ot
    tl.store(out_ptr + out_rows + n[None, :] * stride_on, forced | take, mask=inside)


def select_blocks_triton(
    mass: torch.Tensor,
    row_block: torch.Tensor,
    threshold: float,
    *,
    out: torch.Tensor | None = None,
    max_row_block: int | None = None,
    method: str = "bisect",
) -> torch.Tensor:
    """``select_blocks(mass, row_block, threshold)`` on a Triton kernel: bool (B, H, T, NKB).

    ``mass`` (B, H, T, NKB) float32 and ``row_block`` (B, T) int64 (absolute position block of
    each row) may have any strides. ``out`` (bool, the shape of ``mass``, e.g. a slice of a
    layout) receives the result and is returned. ``max_row_block``, when the caller knows it
    (``>= row_block.max()``), lets the kernel skip the key blocks no row reaches. ``method``:
    ``bisect`` (default) or ``sort`` (the bitonic kernel), the same selection.
    """
    if method not in ("bisect", "sort"):
        raise ValueError(f"select_blocks_triton: method must be 'bisect' or 'sort', got {method!r}")
    if mass.dim() != 4 or row_block.shape != (mass.shape[0], mass.shape[2]):
        raise ValueError(
            f"select_blocks_triton: mass must be (B, H, T, NKB) and row_block (B, T), got "
            f"{tuple(mass.shape)} and {tuple(row_block.shape)}"
        )
    if mass.dtype != torch.float32 or row_block.dtype != torch.long:
        raise ValueError(
            f"select_blocks_triton: mass must be float32 and row_block int64, got {mass.dtype} and {row_block.dtype}"
        )
    if out is None:
        out = torch.empty(mass.shape, dtype=torch.bool, device=mass.device)
    elif out.shape != mass.shape or out.dtype != torch.bool or out.device != mass.device:
        raise ValueError(
            f"select_blocks_triton: out must be a bool tensor of shape {tuple(mass.shape)} on {mass.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    batch, heads, rows, nkb = mass.shape
    kb = torch.arange(nkb, device=mass.device)
    if threshold >= 1.0:
        out.copy_((kb <= row_block[:, None, :, None]).expand(mass.shape))
        return out
    reason = triton_unavailable(mass.device)
    if reason is not None:
        raise BackendUnavailableError(f"Triton block selection: {reason}")
    width = nkb if max_row_block is None else max(1, min(nkb, max_row_block + 1))
    if width < nkb:
        out[..., width:] = False
    if batch * heads * rows == 0:
        return out
    n_pad = max(16, _next_pow2(width))
    rows_per_program = max(1, min(MAX_ROWS, ELEMENTS_PER_PROGRAM // n_pad))
    grid = (triton.cdiv(rows, rows_per_program), heads, batch)
    args = (mass, row_block, out, *mass.stride(), *row_block.stride(), *out.stride(), rows, width, float(threshold))
    if method == "sort":
        _select_kernel[grid](*args, ROWS=rows_per_program, N_PAD=n_pad, LOG_N=n_pad.bit_length() - 1,
                             num_warps=NUM_WARPS)
    else:
        _select_bisect_kernel[grid](*args, ROWS=rows_per_program, N_PAD=n_pad, STEPS=BISECT_STEPS,
                                    num_warps=NUM_WARPS)
    return out
