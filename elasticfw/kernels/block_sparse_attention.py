"""Block-sparse attention (Triton) over block layouts and per-row key-group selections.

Exact attention of a :class:`~elasticfw.attention.layout.RowSelection`: a flag table ``selected``
(B or 1, H, R, G) where the query at position ``p`` reads flag row ``p // row_block - q_start //
row_block`` and sees key ``j`` iff ``j <= p``, ``j < kv_len`` and (its row selects ``j``'s group of
``group_size`` keys, or ``p - window < j``); query head ``h`` reads table head ``h // (Hq / H)``
and K/V head ``h // (Hq / Hkv)``. Float32 accumulation, the output in the input dtype and the
natural-log ``lse`` (a row that sees no key: zero output, ``lse = -inf``).
:func:`block_layout_attention` runs any layout without a token mask as such a selection. Each
tile visits only the key chunks its work lists name (:mod:`elasticfw.kernels.work_lists`): clean
chunks unmasked, the others masked. Forward only: the flex executor's kernel at inference. Launch
configuration: :mod:`elasticfw.kernels.block_sparse_tiles`. The kernel's choices and their
measurements: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from elasticfw.attention.layout import BlockLayout, RowSelection
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import (
    cdiv,
    hopper_or_newer,
    interpreting,
    next_pow2,
    shared_memory_limit,
    unsupported_tensor,
)
from elasticfw.kernels import work_lists as planning  # planning.plan_work: looked up at each call
from elasticfw.kernels.block_sparse_tiles import (  # the tiles: also importable from here
    DEFAULT_TILES,
    SMALL_TILES,
    Tiles,
    _chunk_size,
    default_tiles,
    flag_table,
)
from elasticfw.kernels.work_lists import WorkPlan

__all__ = [
    "DEFAULT_TILES",
    "SMALL_TILES",
    "Tiles",
    "block_layout_attention",
    "check_inputs",
    "default_tiles",
    "flag_table",
    "kv_descriptor",
    "kv_descriptors",
    "load_rows",
    "layout_selection",
    "planned_tiles",
    "row_selection_attention",
    "unsupported",
    "unsupported_layout",
]

MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634


#: shared memory Triton holds beyond :func:`pipeline_bytes` (measured on an H100: 459,776 bytes asked
#: for 128 x 128 tiles, 3 stages, head dim 256 in bf16, where the estimate is 458,752)
SMEM_SLACK = 1024
#: the smallest rows and key chunk :func:`fit_tiles` shrinks to
MIN_FIT_BLOCK = 32


def pipeline_bytes(block_m: int, block_n: int, num_stages: int, d_pad: int, itemsize: int, *,
                   hopper: bool = True) -> int:
    """Shared memory of a kernel's operands: one tile of ``block_m`` query rows and the K and V
    chunks of ``block_n`` keys its pipeline keeps, ``d_pad`` columns each: ``num_stages`` of them on
    Hopper, ``num_stages - 1`` (at least one) on earlier GPUs (what Triton 3.9 compiles to: 163,840
    bytes for 128 x 128 tiles, 3 stages, head dim 128 in bf16 for sm_80 and sm_89, 229,376 for sm_90;
    ``metadata.shared`` of the kernels compiled for each target)."""
    buffers = num_stages if hopper else max(num_stages - 1, 1)
    return (buffers * 2 * block_n + block_m) * d_pad * itemsize


def fit_tiles(tiles: Tiles, block_n: int, d_pad: int, itemsize: int, device: torch.device, *,
              shrink: bool) -> tuple[Tiles, int]:
    """``(tiles, block_n)`` within the GPU's shared memory (:func:`~elasticfw.kernels.shared_memory_limit`,
    with :data:`SMEM_SLACK`): fewer stages down to 2, then (``shrink``: a kernel whose work is not yet
    planned for these tiles) half the key chunk and then half the rows down to
    :data:`MIN_FIT_BLOCK` each, then one stage. Unchanged where they fit, as the 128-dim defaults do
    on Hopper, and off a GPU. Head dim 256 (Gemma's) in 16-bit asks 459,776 bytes at the defaults,
    beyond an H100's 232,448. Raises :class:`~elasticfw.errors.BackendUnavailableError` where even
    the smallest of these does not fit (:func:`unsupported` says so beforehand)."""
    limit = shared_memory_limit(device)
    if limit is None:
        return tiles, block_n
    hopper = hopper_or_newer(device)
    block_m, stages = tiles.block_m, tiles.num_stages
    while pipeline_bytes(block_m, block_n, stages, d_pad, itemsize, hopper=hopper) + SMEM_SLACK > limit:
        if stages > 2:
            stages -= 1
        elif shrink and block_n > MIN_FIT_BLOCK:
            block_n //= 2
        elif shrink and block_m > MIN_FIT_BLOCK:
            block_m //= 2
        elif stages > 1:
            stages -= 1
        else:
            need = pipeline_bytes(block_m, block_n, stages, d_pad, itemsize, hopper=hopper) + SMEM_SLACK
            raise BackendUnavailableError(
                f"Triton kernels: tiles of {block_m} rows x {block_n} keys at head dim {d_pad} (padded) in "
                f"{itemsize}-byte elements need {need} bytes of shared memory, above this GPU's {limit} per block"
                + ("" if shrink else " (the work was planned for these tiles: plan with smaller ones)")
            )
    if (block_m, stages) == (tiles.block_m, tiles.num_stages):
        return tiles, block_n
    return replace(tiles, block_m=block_m, num_stages=stages), block_n


def planned_tiles(tiles: Tiles, q: torch.Tensor) -> Tiles:
    """``tiles`` to plan a block-sparse call's work for (:func:`fit_tiles` with ``shrink``, the key
    chunk included): unchanged where they fit q's GPU at q's head dim and dtype."""
    fitted, block_n = fit_tiles(tiles, tiles.block_n, max(16, next_pow2(q.shape[-1])), q.element_size(), q.device,
                                shrink=True)
    return fitted if block_n == fitted.block_n else replace(fitted, block_n=block_n)


def unsupported(q: torch.Tensor) -> str | None:
    """``None`` when the kernel can attend for ``q`` (B, Hq, Sq, D), else why not."""
    reason = unsupported_tensor(q, "Triton block-sparse kernel")
    if reason is not None:
        return reason
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} is above the Triton block-sparse kernel's {MAX_HEAD_DIM}"
    limit = shared_memory_limit(q.device)
    if limit is not None:
        d_pad, size = max(16, next_pow2(q.shape[-1])), q.element_size()
        need = pipeline_bytes(MIN_FIT_BLOCK, MIN_FIT_BLOCK, 1, d_pad, size, hopper=hopper_or_newer(q.device))
        if need + SMEM_SLACK > limit:
            return (f"head_dim {q.shape[-1]} in {q.dtype} needs {need + SMEM_SLACK} bytes of shared memory at the "
                    f"smallest tiles, above this GPU's {limit} per block")
    return None


def layout_selection(layout: BlockLayout) -> RowSelection | None:
    """The selection the kernel computes ``layout`` as: its row selection, or its blocks when it has
    no token mask; ``None`` for another token mask."""
    if layout.row_selection is not None:
        return layout.row_selection
    if layout.token_mask is not None:
        return None
    return RowSelection(layout.blocks, layout.block_size, row_block=layout.block_size)


def unsupported_layout(layout: BlockLayout, tiles: Tiles = DEFAULT_TILES) -> str | None:
    """``None`` when :func:`block_layout_attention` computes ``layout`` exactly, else why not."""
    selection = layout_selection(layout)
    if selection is None:
        return "the layout has a token mask (pairs inside blocks) that is not a row selection"
    if _chunk_size(selection.group_size, tiles.block_n) is None:
        return f"key group size {selection.group_size} is not a multiple of 16"
    return None


# ---------------------------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def load_rows(base, rows, stride_s, stride_d, d, d_ok, EVEN_D: tl.constexpr):
    """The (len(rows), D_PAD) tile of rows ``rows`` of a (S, D) matrix at ``base`` (columns past D: 0)."""
    offs = rows.to(tl.int64)[:, None] * stride_s + d[None, :] * stride_d
    if EVEN_D:
        return tl.load(base + offs)
    return tl.load(base + offs, mask=d_ok[None, :], other=0.0)


@triton.jit
def attend_chunk(acc, m_i, l_i, qv, kt, vt, ok, qk_scale,
                 MASKED: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One key chunk of the online softmax in base 2 (``qk_scale`` includes ``log2(e)``): ``kt`` and
    ``vt`` (BLOCK_N, D_PAD) its keys and values, ``ok`` (BLOCK_M, BLOCK_N) the pairs kept (MASKED only)."""
    if UPCAST:  # the interpreter multiplies 16-bit bit patterns as integers: upcast (exact)
        kt = kt.to(tl.float32)
        vt = vt.to(tl.float32)
    if IEEE:
        s = tl.dot(qv, tl.trans(kt), input_precision="ieee")
    else:
        s = tl.dot(qv, tl.trans(kt))
    if MASKED:
        s = tl.where(ok, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        p = tl.exp2(s - shift[:, None])
    else:  # every pair kept: the scale folds into one multiply-add per score
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        shift = m_new
        p = tl.exp2(s * qk_scale - shift[:, None])
    alpha = tl.exp2(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE or UPCAST:
        acc = tl.dot(p, vt.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _block_sparse_kernel(
    q_ptr, k_ptr, v_ptr, sel_ptr, clean_ptr, nclean_ptr, masked_ptr, nmasked_ptr, start_ptr, keep_ptr,
    q_start_ptr, kv_len_ptr, out_ptr, lse_ptr, k_desc, v_desc,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    k_rows_b, k_rows_h, k_cols_h, v_rows_b, v_rows_h, v_cols_h,
    stride_sb, stride_sh, stride_sr, stride_sg,
    stride_lb, stride_lh, stride_lt, stride_lc,
    stride_cb, stride_ch, stride_ct,
    stride_eb, stride_eh,
    stride_ob, stride_oh, stride_os, stride_od,
    q_len, row_block, group_size, n_groups, window, kv_group, sel_group, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr, REVERSE: tl.constexpr,
    GROUPED: tl.constexpr, COMPACT: tl.constexpr,
):
    n_tiles = tl.num_programs(0)
    if GROUPED:  # KV head by KV head, a tile's query heads of one GQA group side by side (shared K/V in L2)
        lin = tl.program_id(1) * n_tiles + tl.program_id(0)
        rest = lin // kv_group
        tile = rest % n_tiles
        h = (rest // n_tiles) * kv_group + lin % kv_group
    else:
        tile = tl.program_id(0)
        h = tl.program_id(1)
    if REVERSE:  # the causally longest tiles first: less idle time at the end of the grid
        tile = n_tiles - 1 - tile
    b = tl.program_id(2)
    hs = h // sel_group  # the table's head
    q_start = tl.load(q_start_ptr + b).to(tl.int32)
    kv_len = tl.load(kv_len_ptr + b).to(tl.int32)
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = i < q_len
    pos = q_start + i
    flag_row = pos // row_block - q_start // row_block
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    EVEN_D: tl.constexpr = HEAD_DIM == D_PAD
    q_base = q_ptr + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    qv = tl.load(q_base + i[:, None].to(tl.int64) * stride_qs + d[None, :] * stride_qd,
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        qv = qv.to(tl.float32)
    kh = h // kv_group
    k_base = k_ptr + b.to(tl.int64) * stride_kb + kh.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + kh.to(tl.int64) * stride_vh
    # TMA: K and V as 2-D (rows, columns) tensor descriptors; this head's key j is row k_row0 + j
    k_row0 = b * k_rows_b + kh * k_rows_h
    v_row0 = b * v_rows_b + kh * v_rows_h
    s_base = sel_ptr + b.to(tl.int64) * stride_sb + hs.to(tl.int64) * stride_sh + flag_row.to(tl.int64) * stride_sr
    count_off = b.to(tl.int64) * stride_cb + hs.to(tl.int64) * stride_ch + tile * stride_ct
    head_kept = tl.load(keep_ptr + b.to(tl.int64) * stride_eb + h.to(tl.int64) * stride_eh) != 0
    listed_clean = tl.load(nclean_ptr + count_off)
    n_clean = tl.where(head_kept, listed_clean, 0)  # a head left out computes nothing
    n_masked = tl.where(head_kept, tl.load(nmasked_ptr + count_off), 0)
    if COMPACT:  # one flat list: the tile's clean chunks from its start, its masked ones right after
        clean_off = tl.load(start_ptr + count_off)
        masked_off = clean_off + listed_clean
    else:
        clean_off = b.to(tl.int64) * stride_lb + hs.to(tl.int64) * stride_lh + tile.to(tl.int64) * stride_lt
        masked_off = clean_off

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    n = tl.arange(0, BLOCK_N)
    none = tl.zeros((BLOCK_M, BLOCK_N), tl.int1)
    for e in range(0, n_clean):  # chunks every row selects, wholly before the tile: no mask
        c = tl.load(clean_ptr + clean_off + e * stride_lc)
        if TMA:
            kt = k_desc.load([k_row0 + c * BLOCK_N, kh * k_cols_h])
            vt = v_desc.load([v_row0 + c * BLOCK_N, kh * v_cols_h])
        else:
            kt = load_rows(k_base, c * BLOCK_N + n, stride_ks, stride_kd, d, d_ok, EVEN_D)
            vt = load_rows(v_base, c * BLOCK_N + n, stride_vs, stride_vd, d, d_ok, EVEN_D)
        acc, m_i, l_i = attend_chunk(acc, m_i, l_i, qv, kt, vt, none, qk_scale,
                                     MASKED=False, IEEE=IEEE, UPCAST=UPCAST)
    for e in range(0, n_masked):
        c = tl.load(masked_ptr + masked_off + e * stride_lc)
        kpos = c * BLOCK_N + n
        grp = (c * BLOCK_N) // group_size  # a group past a narrow table is not selected (a window may reach it)
        # (never read past the table: of a table of no groups, no flag at all)
        in_table = (tl.zeros_like(row_ok.to(tl.int32)) + grp) < n_groups  # (rows,): a scalar mask fails to load
        flags = tl.load(s_base + tl.minimum(grp, n_groups - 1) * stride_sg, mask=row_ok & in_table, other=0) != 0
        seen_pair = flags[:, None]
        if WINDOW:
            seen_pair = seen_pair | (kpos[None, :] > pos[:, None] - window)
        ok = seen_pair & (kpos[None, :] <= pos[:, None]) & (kpos[None, :] < kv_len)
        # pointers, rows clamped below kv_len: never a key of unwritten cache memory (p = 0 times a
        # NaN there would still be NaN); zeroing such values after a TMA load cost more (per-token MoBA
        # 224.7 ms against 185.4, results/bench/block-sparse-kernel-options/kernel_options.json)
        kt = load_rows(k_base, tl.minimum(kpos, kv_len - 1), stride_ks, stride_kd, d, d_ok, EVEN_D)
        vt = load_rows(v_base, tl.minimum(kpos, kv_len - 1), stride_vs, stride_vd, d, d_ok, EVEN_D)
        acc, m_i, l_i = attend_chunk(acc, m_i, l_i, qv, kt, vt, ok, qk_scale,
                                     MASKED=True, IEEE=IEEE, UPCAST=UPCAST)
    seen = l_i > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_base = out_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(o_base + i[:, None].to(tl.int64) * stride_os + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + (b * tl.num_programs(1) + h).to(tl.int64) * q_len + i, lse, mask=row_ok)


#: K and V through TMA tensor descriptors where their strides allow (:func:`kv_descriptor`), on
#: GPUs of compute capability 9 or more and under the interpreter
USE_TMA = True
#: the programs of a head visit its query tiles last first (the causally longest first)
REVERSE_TILES = True
#: the programs run KV head by KV head, the query heads of a GQA group for one tile consecutive (they
#: read the same K/V chunks while these are in L2); else query head by query head
GROUP_HEADS = True


def kv_descriptor(x: torch.Tensor, block_n: int) -> tuple[object, int, int, int] | None:
    """A 2-D TMA descriptor of ``x`` (B, H, S, D) and where head ``h`` of sample ``b`` starts in it
    (``(desc, rows_b, rows_h, cols_h)``: its key ``j`` is row ``b * rows_b + h * rows_h + j``, from
    column ``h * cols_h``), or ``None`` where TMA cannot read ``x``: not 16-bit, D not a power of
    two of at least 16 (the kernels pad the head dim to 16), strided last dimension, rows or base not 16-byte aligned, or (B, H, S) neither
    head-major (rows of every head consecutive) nor token-major (the heads of a token side by side,
    the layout of a (B, S, H, D) projection viewed as (B, H, S, D))."""
    if not USE_TMA or x.dtype not in (torch.float16, torch.bfloat16):
        return None
    if x.device.type == "cuda":
        if torch.cuda.get_device_capability(x.device)[0] < 9:
            return None
    elif not interpreting():
        return None
    batch, heads, seq_len, dim = x.shape
    sb, sh, ss, sd = x.stride()
    if dim < 16 or dim & (dim - 1) or sd != 1 or (ss * 2) % 16 or x.data_ptr() % 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    if (heads == 1 or sh == seq_len * ss) and (batch == 1 or sb == heads * seq_len * ss):
        shape, rows_b, rows_h, cols_h = [batch * heads * seq_len, dim], heads * seq_len, seq_len, 0
    elif sh >= dim and (sh * 2) % 16 == 0 and ss >= heads * sh and (batch == 1 or sb == seq_len * ss):
        shape, rows_b, rows_h, cols_h = [batch * seq_len, (heads - 1) * sh + dim], seq_len, 0, sh
    else:
        return None
    return TensorDescriptor(x, shape, [ss, 1], [block_n, dim]), rows_b, rows_h, cols_h


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int) -> tuple[bool, object, object, list[int], list[int]]:
    r"""``(tma, k_desc, v_desc, k_rows, v_rows)`` for a kernel launch: both :func:`kv_descriptor`\ s and
    their ``[rows_b, rows_h, cols_h]`` when TMA can read K *and* V, else ``(False, None, None, [0, 0, 0],
    [0, 0, 0])`` (the pointer path)."""
    k_tma, v_tma = kv_descriptor(k, block_n), kv_descriptor(v, block_n)
    if k_tma is None or v_tma is None:
        return False, None, None, [0, 0, 0], [0, 0, 0]
    return True, k_tma[0], v_tma[0], list(k_tma[1:]), list(v_tma[1:])


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: RowSelection,
    seq: SeqInfo,
    keep_heads: torch.Tensor | None,
    caller: str,
) -> torch.Tensor:
    """Check a kernel call of this package's selection kernels (``caller`` names it); returns the
    (B, Hq) uint8 heads to compute. Raises :class:`~elasticfw.errors.BackendUnavailableError`
    where :func:`unsupported` gives a reason, ``ValueError`` for shapes that do not fit."""
    reason = unsupported(q)
    if reason is not None:
        raise BackendUnavailableError(f"Triton {caller}: {reason}")
    seq.check(q, k)
    batch, hq, _, dim = q.shape
    sel = selection.selected
    rows = seq.num_query_blocks(selection.row_block)
    if sel.shape[0] not in (1, batch) or sel.shape[2] != rows or sel.shape[1] == 0 or hq % sel.shape[1]:
        raise ValueError(
            f"{caller}: the selection table must be (1 or B={batch}, H dividing {hq}, {rows} rows of "
            f"{selection.row_block} positions, G), got {tuple(sel.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype or v.shape[-1] != dim:
        raise ValueError(
            f"{caller}: q, k, v must share dtype and head dim; got {q.dtype}/{k.dtype}/{v.dtype}, "
            f"head dims {dim}/{k.shape[-1]}/{v.shape[-1]}"
        )
    if v.shape != k.shape:
        raise ValueError(f"{caller}: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if keep_heads is None:
        return torch.ones(1, hq, dtype=torch.uint8, device=q.device).expand(batch, hq)
    if keep_heads.dim() != 2 or keep_heads.shape[0] not in (1, batch) or keep_heads.shape[1] != hq:
        raise ValueError(f"{caller}: keep_heads must be (1 or {batch}, {hq}), got {tuple(keep_heads.shape)}")
    return keep_heads.to(torch.uint8).expand(batch, hq)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: RowSelection,
    seq: SeqInfo,
    scale: float,
    keep_heads: torch.Tensor | None,
    tiles: Tiles | None,
    plan: WorkPlan | None,
    caller: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    keep = check_inputs(q, k, v, selection, seq, keep_heads, caller)
    if tiles is None:
        tiles = default_tiles(selection)
    batch, hq, q_len, dim = q.shape
    hkv = k.shape[1]
    sel = selection.selected
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, hq, q_len, dtype=torch.float32, device=q.device)
    if batch * hq * q_len == 0:
        return out, lse
    if plan is None:
        tiles = planned_tiles(tiles, q)
        plan = planning.plan_work(selection, seq, tiles)
    elif plan.block_m != tiles.block_m or plan.clean_count.shape != (batch, sel.shape[1], cdiv(q_len, plan.block_m)):
        raise ValueError(
            f"{caller}: the work plan is for {plan.block_m}-row tiles and counts of shape "
            f"{tuple(plan.clean_count.shape)}, not {tiles.block_m}-row tiles of this call"
        )
    clean, n_clean, masked, n_masked, block_n = (plan.clean, plan.clean_count, plan.masked, plan.masked_count,
                                                 plan.block_n)
    if plan.start is None:
        start, list_strides = n_clean, list(clean.stride())  # start: unused
    elif plan.start.stride() == n_clean.stride() == n_masked.stride() and clean.dim() == 1 and masked is clean:
        start, list_strides = plan.start, [0, 0, 0, 1]
    else:
        raise ValueError(f"{caller}: a compact work plan needs one flat list and start offsets laid out as its counts")
    sel_u8 = flag_table(sel, batch)
    grid = (cdiv(q_len, tiles.block_m), hq, batch)
    tiles, _ = fit_tiles(tiles, block_n, max(16, next_pow2(dim)), q.element_size(), q.device, shrink=False)
    tma, k_desc, v_desc, k_rows, v_rows = kv_descriptors(k, v, block_n)
    _block_sparse_kernel[grid](
        q, k, v, sel_u8, clean, n_clean, masked, n_masked, start, keep, seq.q_start.contiguous(),
        seq.kv_len.contiguous(), out, lse, k_desc, v_desc,
        *q.stride(), *k.stride(), *v.stride(), *k_rows, *v_rows,
        *sel_u8.stride(), *list_strides, *n_clean.stride(), *keep.stride(),
        *out.stride(),
        q_len, selection.row_block, selection.group_size, sel.shape[3], selection.window, hq // hkv,
        hq // sel.shape[1], scale * _LOG2E,
        HEAD_DIM=dim, D_PAD=max(16, next_pow2(dim)), BLOCK_M=tiles.block_m, BLOCK_N=block_n,
        WINDOW=selection.window > 0, IEEE=q.dtype == torch.float32, UPCAST=interpreting() and q.dtype != torch.float32,
        TMA=tma, REVERSE=REVERSE_TILES, GROUPED=GROUP_HEADS and hq > hkv, COMPACT=plan.start is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out, lse


def row_selection_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    selection: RowSelection,
    seq: SeqInfo,
    *,
    scale: float,
    keep_heads: torch.Tensor | None = None,
    tiles: Tiles | None = None,
    plan: WorkPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32) of attention under ``selection``
    (module docstring); ``q`` (B, Hq, Sq, D), ``k`` / ``v`` (B, Hkv, Sk, D), any strides.
    ``keep_heads`` (B or 1, Hq) bool: heads outside it compute nothing (zero output, ``-inf``
    lse), as the flex executor's ``keep_heads``. ``tiles``: the launch configuration (``None``:
    :func:`default_tiles`). ``plan``: the work lists from
    :func:`~elasticfw.kernels.work_lists.plan_work` for this selection,
    ``seq`` and ``tiles`` (built here when ``None``). Raises
    :class:`~elasticfw.errors.BackendUnavailableError` where :func:`unsupported` gives a reason."""
    return _attend(q, k, v, selection, seq, scale, keep_heads, tiles, plan, "row_selection_attention")


def block_layout_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    seq: SeqInfo,
    *,
    scale: float,
    keep_heads: torch.Tensor | None = None,
    tiles: Tiles | None = None,
    plan: WorkPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_selection_attention` of ``layout``'s selection (:func:`layout_selection`: its row
    selection, or its blocks when it has no token mask). Raises
    :class:`~elasticfw.errors.BackendUnavailableError` where :func:`unsupported_layout` gives a reason."""
    reason = unsupported_layout(layout, DEFAULT_TILES if tiles is None else tiles)
    if reason is not None:
        raise BackendUnavailableError(f"Triton block_layout_attention: {reason}")
    selection = layout_selection(layout)
    assert selection is not None  # unsupported_layout said so
    return row_selection_attention(q, k, v, selection, seq, scale=scale, keep_heads=keep_heads, tiles=tiles,
                                   plan=plan)
