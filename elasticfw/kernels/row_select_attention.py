"""Attention over per-row key-group selections (Triton): per-token MoBA without token masks.

Computes, for a :class:`~elasticfw.attention.layout.RowSelection` (row ``i`` of head ``h`` sees
the keys of the key groups it selected, ``group_size`` keys each), what an executor computes from
the layout's blocks and token mask: for the query at position ``p = q_start + i``, softmax
attention over the keys ``j`` with ``selected[b, h', i, j // group_size]``, ``j <= p`` and
``j < kv_len`` (``h' = h // (Hq / H)``), in float32 with the output in the input dtype and the
natural-log ``lse``; a row that sees no key gets a zero output and ``lse = -inf``.

* **Work lists.** Per (sample, selection head, tile of ``BLOCK_M`` rows), the groups any real row
  of the tile selects, ascending, and their count (``tile_groups``: a reshape, an ``any`` and
  one sort in torch). A tile computes only its union, not every block a FlexAttention tile of
  the layout would visit, and evaluates no per-pair mask function.
* **Kernel.** One program per (tile, query head, sample), FlashAttention-style: for each group of
  its list, the rows' selection flags for that group (one ``BLOCK_M`` load), then the group's
  keys in chunks of ``BLOCK_N`` up to the tile's causal limit, scores ``q . k`` (16-bit inputs on
  tensor cores; float32 in IEEE float32), masked by the flags, causality and ``kv_len``, an
  online softmax in base 2, and ``p . v`` accumulated in float32.

Forward only (no autograd): the flex executor uses it for inference calls with
``row_selection_kernel`` ``triton`` (or ``auto`` on CUDA), FlexAttention otherwise. Memory beyond
the inputs and outputs: the work lists, ``4 * B * H * (Sq / BLOCK_M) * G`` bytes. Tile sizes
are module constants, not tuned on a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from elasticfw.attention.layout import RowSelection
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import interpreting, next_pow2, unsupported_tensor

__all__ = ["row_selection_attention", "tile_groups", "unsupported"]

BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
MAX_HEAD_DIM = 256

_LOG2E = 1.4426950408889634


def unsupported(q: torch.Tensor) -> str | None:
    """``None`` when the kernel can attend for ``q`` (B, Hq, Sq, D), else why not."""
    reason = unsupported_tensor(q, "Triton row-selection kernel")
    if reason is not None:
        return reason
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} is above the Triton row-selection kernel's {MAX_HEAD_DIM}"
    return None


def tile_groups(selected: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile of ``block_m`` rows: (B, H, NT, G) int32 the selected groups, ascending (any row
    of the tile), then padding; (B, H, NT) int32 how many."""
    batch, heads, rows, groups = selected.shape
    tiles = math.ceil(rows / block_m)
    pad = tiles * block_m - rows
    grid = torch.nn.functional.pad(selected, (0, 0, 0, pad)) if pad else selected
    union = grid.view(batch, heads, tiles, block_m, groups).any(3)
    counts = union.sum(-1, dtype=torch.int32)
    ids = torch.arange(groups, device=selected.device, dtype=torch.int32)
    # selected groups first, ascending: sort the keys (not selected, index)
    keys = torch.where(union, ids, ids + groups)
    lists = keys.sort(-1).values
    return torch.where(lists < groups, lists, 0).to(torch.int32), counts


@triton.jit
def _row_select_kernel(
    q_ptr, k_ptr, v_ptr, sel_ptr, list_ptr, count_ptr, keep_ptr, q_start_ptr, kv_len_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_sb, stride_sh, stride_ss, stride_sg,
    stride_lb, stride_lh, stride_lt, stride_lg,
    stride_cb, stride_ch, stride_ct,
    stride_eb, stride_eh,
    stride_ob, stride_oh, stride_os, stride_od,
    q_len, group_size, kv_group, sel_group, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    hs = h // sel_group  # the selection's head
    q_start = tl.load(q_start_ptr + b).to(tl.int32)
    kv_len = tl.load(kv_len_ptr + b).to(tl.int32)
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = i < q_len
    pos = q_start + i
    last = tl.max(tl.where(row_ok, pos, -1), axis=0)  # the tile's causal limit
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    qv = tl.load(q_base + i[:, None].to(tl.int64) * stride_qs + d[None, :] * stride_qd,
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter multiplies 16-bit bit patterns as integers: upcast (exact)
        qv = qv.to(tl.float32)
    kh = h // kv_group
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kh.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kh.to(tl.int64) * stride_vh
    s_base = sel_ptr + b.to(tl.int64) * stride_sb + hs.to(tl.int64) * stride_sh + i.to(tl.int64) * stride_ss
    l_base = list_ptr + b.to(tl.int64) * stride_lb + hs.to(tl.int64) * stride_lh + tile.to(tl.int64) * stride_lt
    count = tl.load(count_ptr + b.to(tl.int64) * stride_cb + hs.to(tl.int64) * stride_ch + tile * stride_ct)
    keep = tl.load(keep_ptr + b.to(tl.int64) * stride_eb + h.to(tl.int64) * stride_eh)
    count = tl.where(keep != 0, count, 0)  # a head left out computes nothing

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    n = tl.arange(0, BLOCK_N)
    for e in range(0, count):
        g = tl.load(l_base + e * stride_lg)
        flags = tl.load(s_base + g * stride_sg, mask=row_ok, other=0) != 0
        start = g * group_size
        stop = tl.minimum(tl.minimum(start + group_size, kv_len), last + 1)
        for c0 in range(start, stop, BLOCK_N):
            kpos = c0 + n
            k_ok = kpos < stop
            kv_rows = kpos.to(tl.int64)
            kt = tl.load(k_base + kv_rows[:, None] * stride_ks + d[None, :] * stride_kd,
                         mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            vt = tl.load(v_base + kv_rows[:, None] * stride_vs + d[None, :] * stride_vd,
                         mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                kt = kt.to(tl.float32)
                vt = vt.to(tl.float32)
            if IEEE:
                s = tl.dot(qv, tl.trans(kt), input_precision="ieee")
            else:
                s = tl.dot(qv, tl.trans(kt))
            keep = flags[:, None] & k_ok[None, :] & (kpos[None, :] <= pos[:, None])
            s = tl.where(keep, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
            p = tl.exp2(s - safe[:, None])
            alpha = tl.exp2(m_i - safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE or UPCAST:
                acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
    seen = l_i > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_base = out_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_base + i[:, None].to(tl.int64) * stride_os + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + (b * tl.num_programs(1) + h).to(tl.int64) * q_len + i, lse, mask=row_ok)


def row_selection_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: RowSelection,
    seq: SeqInfo,
    *,
    scale: float,
    keep_heads: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32) of attention under ``selection``
    (module docstring); ``q`` (B, Hq, Sq, D), ``k`` / ``v`` (B, Hkv, Sk, D), any strides.
    ``keep_heads`` (B or 1, Hq) bool: heads outside it compute nothing (zero output, ``-inf``
    lse), as the flex executor's ``keep_heads``. Raises
    :class:`~elasticfw.errors.BackendUnavailableError` where :func:`unsupported` gives a reason."""
    reason = unsupported(q)
    if reason is not None:
        raise BackendUnavailableError(f"Triton row-selection attention: {reason}")
    seq.check(q, k)
    batch, hq, q_len, dim = q.shape
    hkv = k.shape[1]
    sel = selection.selected
    if sel.dim() != 4 or sel.shape[0] not in (1, batch) or sel.shape[2] != q_len or hq % sel.shape[1]:
        raise ValueError(
            f"row_selection_attention: selected must be (1 or B={batch}, H dividing {hq}, Sq={q_len}, G), got "
            f"{tuple(sel.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype or v.shape[-1] != dim:
        raise ValueError(
            f"row_selection_attention: q, k, v must share dtype and head dim; got {q.dtype}/{k.dtype}/{v.dtype}, "
            f"head dims {dim}/{k.shape[-1]}/{v.shape[-1]}"
        )
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, hq, q_len, dtype=torch.float32, device=q.device)
    if batch * hq * q_len == 0:
        return out, lse
    sel_u8 = sel.view(torch.uint8) if sel.dtype == torch.bool else sel
    lists, counts = tile_groups(sel, BLOCK_M)
    if sel.shape[0] == 1 and batch > 1:  # one table for every sample: stride 0 over the batch
        sel_u8 = sel_u8.expand(batch, *sel_u8.shape[1:])
        lists = lists.expand(batch, *lists.shape[1:])
        counts = counts.expand(batch, *counts.shape[1:])
    if keep_heads is None:
        keep = torch.ones(1, hq, dtype=torch.uint8, device=q.device).expand(batch, hq)
    else:
        if keep_heads.dim() != 2 or keep_heads.shape[0] not in (1, batch) or keep_heads.shape[1] != hq:
            raise ValueError(f"row_selection_attention: keep_heads must be (1 or {batch}, {hq}), got "
                             f"{tuple(keep_heads.shape)}")
        keep = keep_heads.to(torch.uint8).expand(batch, hq)
    d_pad = max(16, next_pow2(dim))
    grid = (triton.cdiv(q_len, BLOCK_M), hq, batch)
    _row_select_kernel[grid](
        q, k, v, sel_u8, lists, counts, keep, seq.q_start.contiguous(), seq.kv_len.contiguous(), out, lse,
        *q.stride(), *k.stride(), *v.stride(), *sel_u8.stride(), *lists.stride(), *counts.stride(), *keep.stride(),
        *out.stride(),
        q_len, selection.group_size, hq // hkv, hq // sel.shape[1], scale * _LOG2E,
        HEAD_DIM=dim, D_PAD=d_pad, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32, UPCAST=interpreting() and q.dtype != torch.float32,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out, lse
