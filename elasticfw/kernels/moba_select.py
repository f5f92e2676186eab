"""Fused MoBA token selection (Triton): gates, top-k and tile pooling without the sorts.

Computes what ``plugins/modes/moba.py``'s token-granular planner computes with
:func:`~elasticfw.attention.patterns.gate_scores`, :func:`~elasticfw.attention.selectors.topk_select`
and :func:`~elasticfw.attention.pattern_layouts.tile_union`, in one pass over the queries: per real
query row, float32 gates against the KV head's block means (computed by the caller), the current
block forced and the ``top_k - 1`` best earlier blocks added (ties to the lower block), and each
tile's union and common part written as (B, Hq, NQB, NMB) bool. Equal to the torch path up to the
float32 summation order of the gates; padding rows select nothing; nothing holds the (B, Hq, Sq,
NMB) gates. :func:`unsupported` says when the kernel cannot run (callers then use torch). Grid,
precision and measurements: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import cdiv, interpreting, next_pow2, unsupported_tensor

__all__ = ["moba_token_selection_triton", "unsupported"]

#: the most MoBA blocks (key blocks of ``moba_block_size``) a row can choose among (padded to a
#: power of two); 1024 blocks of 1024 tokens is 1M keys
MAX_BLOCKS = 1024
#: about this many gates per step (row slots x N_PAD float32 in registers; at least 16 slots)
ROWS_X_BLOCKS = 8192
#: about this many means per head-dim chunk (N_PAD x BLOCK_D float32, the dot's second operand)
MEANS_PER_CHUNK = 8192
NUM_WARPS = 8



def unsupported(q: torch.Tensor, *, num_blocks: int) -> str | None:
    """``None`` when the kernel can select for ``q`` (B, Hq, Sq, D) among ``num_blocks`` MoBA
    blocks, else why not (the device, the dtype or the number of blocks)."""
    reason = unsupported_tensor(q, "Triton MoBA planner")
    if reason is not None:
        return reason
    if num_blocks > MAX_BLOCKS:
        return f"{num_blocks} MoBA blocks are more than the Triton MoBA planner's {MAX_BLOCKS}"
    return None


@triton.jit
def _moba_select_kernel(
    q_ptr, means_ptr, q_start_ptr, kv_len_ptr, sel_ptr, union_ptr, common_ptr,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_mb, stride_mh, stride_mn, stride_md,
    stride_sb, stride_sh, stride_ss, stride_sn,
    stride_ub, stride_uh, stride_ut, stride_un,
    q_len, tile0, tile1, num_blocks, group_size, top_k, block_size, moba_block_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, TILES: tl.constexpr, SUB: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr,
):
    """Layout tiles ``[tile0 + p*TILES, ...)`` (``p`` the program), below ``tile1``, of one
    (sample, query head): ``SUB`` rows of each of the ``TILES`` tiles at a time."""
    ROWS: tl.constexpr = TILES * SUB
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(q_start_ptr + b).to(tl.int32)
    kv_len = tl.load(kv_len_ptr + b).to(tl.int32)
    j = tl.arange(0, ROWS)
    tile = tile0 + tl.program_id(0) * TILES + j // SUB  # layout row of each row slot
    member = j % SUB
    first = (q_start // block_size + tile) * block_size  # position of each slot's tile row 0
    tiles = tile0 + tl.program_id(0) * TILES + tl.arange(0, TILES)

    n = tl.arange(0, N_PAD)
    n_ok = n < num_blocks
    d = tl.arange(0, BLOCK_D)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    m_base = means_ptr + b.to(tl.int64) * stride_mb + (h // group_size).to(tl.int64) * stride_mh
    s_base = sel_ptr + b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
    any_sel = tl.zeros((TILES, N_PAD), tl.int32)
    all_sel = tl.full((TILES, N_PAD), 1, tl.int32)
    occupied = tl.zeros((TILES,), tl.int32)
    for r0 in range(0, block_size, SUB):
        r = r0 + member
        pos = first + r
        i = pos - q_start
        in_call = (r < block_size) & (tile < tile1) & (i >= 0) & (i < q_len)
        real = in_call & (pos < kv_len)
        current = tl.minimum(pos // moba_block_size, num_blocks - 1)
        top_cur = tl.max(tl.where(real, current, 0), axis=0)
        sel = real[:, None] & (n[None, :] == current[:, None])
        rounds = tl.minimum(top_k - 1, top_cur)
        if rounds > 0:
            gates = tl.zeros((ROWS, N_PAD), tl.float32)
            q_rows = i.to(tl.int64) * stride_qs
            for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
                dd = d0 + d
                d_ok = dd < HEAD_DIM
                qv = tl.load(
                    q_base + q_rows[:, None] + dd[None, :] * stride_qd, mask=real[:, None] & d_ok[None, :], other=0.0
                )
                mv = tl.load(
                    m_base + n[:, None].to(tl.int64) * stride_mn + dd[None, :] * stride_md,
                    mask=(n < top_cur)[:, None] & d_ok[None, :],
                    other=0.0,
                )
                if SPLIT:  # 16-bit q: the float32 means as three 16-bit terms, each product exact in float32
                    hi = mv.to(qv.dtype)
                    rest = mv - hi.to(tl.float32)
                    mid = rest.to(qv.dtype)
                    lo = (rest - mid.to(tl.float32)).to(qv.dtype)
                    if UPCAST:  # the interpreter multiplies 16-bit bit patterns as integers: upcast (exact)
                        qf = qv.to(tl.float32)
                        gates = tl.dot(qf, tl.trans(hi.to(tl.float32)), gates, input_precision="ieee")
                        gates = tl.dot(qf, tl.trans(mid.to(tl.float32)), gates, input_precision="ieee")
                        gates = tl.dot(qf, tl.trans(lo.to(tl.float32)), gates, input_precision="ieee")
                    else:
                        gates = tl.dot(qv, tl.trans(hi), gates)
                        gates = tl.dot(qv, tl.trans(mid), gates)
                        gates = tl.dot(qv, tl.trans(lo), gates)
                else:
                    gates = tl.dot(qv.to(tl.float32), tl.trans(mv), gates, input_precision="ieee")
            candidate = real[:, None] & (n[None, :] < current[:, None])
            for _ in range(0, rounds):
                value = tl.where(candidate, gates, float("-inf"))
                best = tl.max(value, axis=1)
                index = tl.min(tl.where(candidate & (value == best[:, None]), n[None, :], N_PAD), axis=1)
                take = n[None, :] == index[:, None]  # no column when the row has no candidate left
                sel = sel | take
                candidate = candidate & ~take
        row_ptrs = s_base + i[:, None].to(tl.int64) * stride_ss
        tl.store(row_ptrs + n[None, :] * stride_sn, sel, mask=in_call[:, None] & n_ok[None, :])
        for c0 in range(N_PAD, num_blocks, N_PAD):  # columns no row of this launch can select
            cols = c0 + n
            tl.store(
                row_ptrs + cols[None, :] * stride_sn,
                tl.zeros((ROWS, N_PAD), tl.int1),
                mask=in_call[:, None] & (cols < num_blocks)[None, :],
            )
        sel_i = sel.to(tl.int32)
        any_sel = tl.maximum(any_sel, tl.max(tl.reshape(tl.where(real[:, None], sel_i, 0), (TILES, SUB, N_PAD)), 1))
        all_sel = tl.minimum(all_sel, tl.min(tl.reshape(tl.where(real[:, None], sel_i, 1), (TILES, SUB, N_PAD)), 1))
        occupied = tl.maximum(occupied, tl.max(tl.reshape(real.to(tl.int32), (TILES, SUB)), 1))

    out = b.to(tl.int64) * stride_ub + h.to(tl.int64) * stride_uh + tiles[:, None].to(tl.int64) * stride_ut
    union = (any_sel > 0)
    common = (all_sel > 0) & (occupied > 0)[:, None]
    for c0 in range(0, num_blocks, N_PAD):  # columns past N_PAD: False
        cols = c0 + n
        keep = (tiles < tile1)[:, None] & (cols < num_blocks)[None, :]
        tl.store(union_ptr + out + cols[None, :] * stride_un, union & (c0 == 0), mask=keep)
        tl.store(common_ptr + out + cols[None, :] * stride_un, common & (c0 == 0), mask=keep)


def moba_token_selection_triton(
    q: torch.Tensor,
    means: torch.Tensor,
    seq: SeqInfo,
    *,
    moba_block_size: int,
    top_k: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoBA's per-token selection and its tile pooling on one Triton kernel.

    ``q`` (B, Hq, Sq, D) in float16 / bfloat16 / float32 (any strides), ``means`` (B, Hkv, NMB, D)
    float32, the mean of each MoBA block's real keys. Returns ``(selected, union, common)``:
    ``selected`` (B, Hq, Sq, NMB) bool, each real row's current block plus its ``top_k - 1`` best
    earlier blocks (``False`` for padding rows), and the (B, Hq, NQB, NMB) bool union and common
    part of each layout tile's real rows (:func:`~elasticfw.attention.pattern_layouts.tile_union`).
    Raises :class:`~elasticfw.errors.BackendUnavailableError` where :func:`unsupported` gives a
    reason.
    """
    batch, hq, q_len, dim = q.shape
    if means.dim() != 4 or means.shape[0] != batch or means.shape[3] != dim or means.dtype != torch.float32:
        raise ValueError(
            f"moba_token_selection_triton: means must be (B={batch}, Hkv, NMB, D={dim}) float32, got "
            f"{means.dtype} of shape {tuple(means.shape)}"
        )
    hkv, nmb = means.shape[1], means.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"moba_token_selection_triton: {hq} query heads are not a multiple of {hkv} KV heads")
    if moba_block_size < 1 or block_size < 1 or top_k < 1:
        raise ValueError(
            f"moba_token_selection_triton: moba_block_size ({moba_block_size}), top_k ({top_k}) and block_size "
            f"({block_size}) must be positive"
        )
    reason = unsupported(q, num_blocks=nmb)
    if reason is not None:
        raise BackendUnavailableError(f"Triton MoBA planner: {reason}")
    dev = q.device
    nqb = seq.num_query_blocks(block_size)
    selected = torch.empty(batch, hq, q_len, nmb, dtype=torch.bool, device=dev)
    union = torch.empty(batch, hq, nqb, nmb, dtype=torch.bool, device=dev)
    common = torch.empty_like(union)
    if batch * hq * q_len * nmb == 0 or nqb == 0:
        union.zero_()
        common.zero_()
        return selected.zero_(), union, common
    q_start = seq.q_start.contiguous()
    kv_len = seq.kv_len.contiguous()
    # layout rows [t0, t1) whose rows' current blocks are all below n_pad share one launch
    top_qbs = int(seq.q_block_start(block_size).max().item()) if nqb > 1 else None
    d_pad = max(16, next_pow2(dim))
    t0 = 0
    while t0 < nqb:
        if top_qbs is None:
            n_pad, t1 = max(16, next_pow2(nmb)), nqb
        else:
            last_pos = (top_qbs + t0 + 1) * block_size - 1  # the tile's last position, over the batch
            n_pad = max(16, next_pow2(min(nmb, last_pos // moba_block_size + 1)))
            # tile t fits while its last position (top_qbs + t + 1) * bs - 1 is below n_pad blocks
            t1 = nqb if n_pad >= nmb else min(nqb, n_pad * moba_block_size // block_size - top_qbs)
        rows = max(16, ROWS_X_BLOCKS // n_pad)  # row slots per step
        sub = min(next_pow2(block_size), rows)  # rows of each tile per step
        tiles = max(16 // sub, 1, min(rows // sub, next_pow2(t1 - t0)))  # tiles per program
        block_d = min(d_pad, max(16, MEANS_PER_CHUNK // n_pad), 64)
        _moba_select_kernel[(cdiv(t1 - t0, tiles), hq, batch)](
            q, means, q_start, kv_len, selected, union, common,
            *q.stride(), *means.stride(), *selected.stride(), *union.stride(),
            q_len, t0, t1, nmb, hq // hkv, top_k, block_size, moba_block_size,
            HEAD_DIM=dim, BLOCK_D=block_d, N_PAD=n_pad, TILES=tiles, SUB=sub,
            SPLIT=q.dtype != torch.float32, UPCAST=interpreting() and q.dtype != torch.float32, num_warps=NUM_WARPS,
        )
        t0 = t1
    return selected, union, common
