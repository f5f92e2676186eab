"""XAttention's threshold selection (Triton): ``select_blocks`` without a sort.

Computes ``plugins/modes/xattention.py``'s :func:`select_blocks` (a
:func:`~elasticfw.attention.selectors.threshold_select` over the causal blocks with key block 0 and
the diagonal forced): per row, a 31-step bisection over the masses' float32 bit patterns finds the
level at which the kept mass crosses ``threshold * total``, and the kept set is the sorted
selection's (ties to the lower index). Equal to the torch selector up to float32 rounding of the
row total and the running sums. ``threshold >= 1`` keeps every causal block (no kernel). Masses
must be non-negative and not NaN. Why the bisection is exact, and the sort it replaced:
``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import cdiv, next_pow2, triton_unavailable

__all__ = ["select_blocks_triton"]

#: about this many masses per program (rows x padded width); rows per program at most MAX_ROWS
ELEMENTS_PER_PROGRAM = 2048
MAX_ROWS = 32
NUM_WARPS = 4
#: bisection steps over the float32 bit patterns of non-negative masses (below 2**31)
BISECT_STEPS = 31


@triton.jit
def _select_bisect_kernel(
    mass_ptr, row_block_ptr, out_ptr,
    stride_mb, stride_mh, stride_mt, stride_mn,
    stride_rb, stride_rt,
    stride_ob, stride_oh, stride_ot, stride_on,
    num_rows, width, threshold,
    ROWS: tl.constexpr, N_PAD: tl.constexpr, STEPS: tl.constexpr,
):
    """The selection without a sort: a bisection over the candidates' float32 bit patterns
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
) -> torch.Tensor:
    """``select_blocks(mass, row_block, threshold)`` on a Triton kernel: bool (B, H, T, NKB).

    ``mass`` (B, H, T, NKB) float32 and ``row_block`` (B, T) int64 (absolute position block of
    each row) may have any strides. ``out`` (bool, the shape of ``mass``, e.g. a slice of a
    layout) receives the result and is returned. ``max_row_block``, when the caller knows it
    (``>= row_block.max()``), lets the kernel skip the key blocks no row reaches.
    """
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
    n_pad = max(16, next_pow2(width))
    rows_per_program = max(1, min(MAX_ROWS, ELEMENTS_PER_PROGRAM // n_pad))
    grid = (cdiv(rows, rows_per_program), heads, batch)
    _select_bisect_kernel[grid](
        mass, row_block, out, *mass.stride(), *row_block.stride(), *out.stride(), rows, width, float(threshold),
        ROWS=rows_per_program, N_PAD=n_pad, STEPS=BISECT_STEPS, num_warps=NUM_WARPS,
    )
    return out
