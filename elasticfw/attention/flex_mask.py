"""Block layout → FlexAttention :class:`~torch.nn.attention.flex_attention.BlockMask`, exactly and in O((S/bs)^2).

:func:`to_block_mask` puts a layout in canonical coordinates (:mod:`elasticfw.attention.seq`,
query rows at any ``q_start``) on FlexAttention's grid of ``KB x KB`` tiles (``KB``, the kernel
block size): each sample's queries are front-padded by ``q_start[b] % KB`` rows and the keys
padded to a multiple of ``KB`` (:meth:`FlexMask.pad_queries` / :meth:`FlexMask.unpad_rows`); a
layout of another block size is rescaled to ``KB`` or, when ``KB`` is a multiple of it, coarsened
with an exact sub-block lookup in ``mask_mod``. A tile is *full* (no ``mask_mod``) only where
every real pair in it is computed; in the others ``mask_mod`` applies causality, key validity,
the token mask and the sub-block lookup, so the pairs computed are exactly the layout's. Mask
heads are 1 or the query heads. Nothing is O(S^2) but the dense views (:func:`tile_masks`,
:func:`dense_kernel_mask`) kept for the emulated executor and tests. The conversion in detail:
``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from elasticfw.attention.layout import BlockLayout, expand_heads, index_lists, rescale
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import UnsupportedInputError

if TYPE_CHECKING:  # imported lazily: executors check FlexAttention's availability themselves
    from torch.nn.attention.flex_attention import BlockMask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class FlexMask:
    """A :class:`BlockMask` for padded q/k tensors, plus what it takes to pad and unpad them.

    ``q_offsets[b]`` is the padded row of real query row 0 of sample ``b`` (``q_start[b] % KB``);
    the padded query tensor has ``q_padded_len`` rows and the padded keys ``kv_padded_len``.
    ``mask_mod`` is the function stored in ``block_mask`` (also usable on broadcast index grids).
    """

    block_mask: BlockMask
    mask_mod: MaskMod
    kernel_block_size: int
    q_offsets: tuple[int, ...]
    q_len: int
    q_padded_len: int
    kv_capacity: int
    kv_padded_len: int
    block_lookup: bool

    @property
    def pads_queries(self) -> bool:
        return self.q_padded_len != self.q_len or any(self.q_offsets)

    def pad_queries(self, q: torch.Tensor) -> torch.Tensor:
        """(B, H, Sq, D) → (B, H, q_padded_len, D), each sample shifted by its offset (differentiable)."""
        if not self.pads_queries:
            return q
        tail = self.q_padded_len - self.q_len
        if len(set(self.q_offsets)) == 1:
            off = self.q_offsets[0]
            return F.pad(q, (0, 0, off, tail - off))
        return torch.cat(
            [F.pad(q[b : b + 1], (0, 0, off, tail - off)) for b, off in enumerate(self.q_offsets)], dim=0
        )

    def unpad_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of the real queries from a (B, H, q_padded_len, ...) tensor (output or lse)."""
        if not self.pads_queries:
            return x
        if len(set(self.q_offsets)) == 1:
            off = self.q_offsets[0]
            return x[:, :, off : off + self.q_len]
        return torch.cat([x[b : b + 1, :, off : off + self.q_len] for b, off in enumerate(self.q_offsets)])

    def pad_keys(self, k: torch.Tensor) -> torch.Tensor:
        """(B, H, Sk, D) → (B, H, kv_padded_len, D) with zero (masked) keys appended."""
        if self.kv_padded_len == self.kv_capacity:
            return k
        return F.pad(k, (0, 0, 0, self.kv_padded_len - self.kv_capacity))


def bucket_length(n: int, multiple: int, steps_per_octave: int) -> int:
    """Round ``n`` up to a multiple of ``multiple`` and, if ``steps_per_octave > 0``, to one of
    ``steps_per_octave`` geometric buckets per power of two (at most ``1/steps_per_octave``
    relative padding), so that compiled kernels see few distinct shapes."""
    n = max(int(n), 1)
    step = multiple
    if steps_per_octave > 0:
        octave = 1 << (n - 1).bit_length()  # smallest power of two >= n
        step = max(multiple, octave // (2 * steps_per_octave))
        step = -(-step // multiple) * multiple
    return -(-n // step) * step


def default_kernel_block_size(layout_block_size: int, preferred: int = 128) -> int:
    """``preferred`` when it divides or is divided by the layout's block size, else the layout's."""
    if layout_block_size % preferred == 0 or preferred % layout_block_size == 0:
        return preferred
    return layout_block_size


def to_block_mask(
    layout: BlockLayout,
    seq: SeqInfo,
    num_q_heads: int,
    *,
    kernel_block_size: int | None = None,
    q_padded_len: int | None = None,
    kv_padded_len: int | None = None,
    block_lookup: bool | None = None,
    compute_q_blocks: bool = True,
) -> FlexMask:
    """Convert ``layout`` over ``seq`` into a :class:`FlexMask` for ``num_q_heads`` query heads.

    ``kernel_block_size`` defaults to the layout's block size; it must divide it or be a multiple
    of it. ``q_padded_len`` / ``kv_padded_len`` are lower bounds for the padded lengths (buckets);
    they are raised to the smallest multiple of the kernel block size that fits. ``block_lookup``
    puts the layout's sub-block table into ``mask_mod``: required when the layout is coarsened
    (the default then) and for FlexAttention's eager path, which ignores the block lists and
    evaluates ``mask_mod`` on every pair. ``compute_q_blocks=False`` skips the transposed lists
    that only the backward pass needs.
    """
    bs = layout.block_size
    kb = bs if kernel_block_size is None else int(kernel_block_size)
    if kb <= 0:
        raise UnsupportedInputError(f"kernel block size must be positive, got {kb}")
    if kb < bs:
        if bs % kb:
            raise UnsupportedInputError(
                f"kernel block size {kb} must divide the layout's block size {bs} or be a multiple of it"
            )
        layout = rescale(layout, seq, kb)
        bs = kb
    elif kb % bs:
        raise UnsupportedInputError(
            f"kernel block size {kb} must divide the layout's block size {bs} or be a multiple of it"
        )
    f = kb // bs
    if block_lookup is None:
        block_lookup = f > 1
    if layout.dense_causal:
        block_lookup = False  # the causal pattern is already mask_mod's causality
    layout = expand_heads(layout, num_q_heads)
    heads = layout.num_heads
    if heads not in (1, num_q_heads):
        raise UnsupportedInputError(f"layout has {heads} heads; expected 1 or {num_q_heads} after expansion")

    batch, dev = seq.batch, seq.device
    q_start, kv_len = seq.q_start.to(dev), seq.kv_len.to(dev)
    nqb_k = seq.num_query_blocks(kb)
    qp = max(nqb_k * kb, -(-(q_padded_len or 0) // kb) * kb)
    kp = max(seq.num_key_blocks(kb) * kb, -(-(kv_padded_len or 0) // kb) * kb)
    nqb_k, nkb_k = qp // kb, kp // kb
    q_tile = torch.div(q_start, kb, rounding_mode="floor")  # (B,) position tile of padded tile 0
    q_tile_pos = q_tile * kb  # (B,) position of padded row 0

    # -- the layout at sub-block granularity, in the padded frame: (B, H, Qp/bs, Kp/bs) -------------
    nqb_l, nkb_l = layout.blocks.shape[2], layout.blocks.shape[3]
    sub_rows = q_tile[:, None] * f + torch.arange(nqb_k * f, device=dev)[None, :]  # position blocks
    lrow = sub_rows - torch.div(q_start, bs, rounding_mode="floor")[:, None]  # layout rows
    row_ok = (lrow >= 0) & (lrow < nqb_l)  # (B, R): rows outside hold only padding queries
    gather = lrow.clamp(0, nqb_l - 1)[:, None, :, None].expand(batch, heads, -1, nkb_l)

    def frame(t: torch.Tensor) -> torch.Tensor:
        t = t.expand(batch, heads, nqb_l, nkb_l).gather(2, gather)
        return F.pad(t, (0, nkb_k * f - nkb_l))  # key padding: never selected

    selected = frame(layout.blocks)
    kv_sub = torch.arange(nkb_k * f, device=dev)
    sub_live = (
        row_ok[:, None, :, None]
        & (kv_sub[None, None, None, :] <= sub_rows[:, None, :, None])
        & ((kv_sub * bs)[None, None, None, :] < kv_len[:, None, None, None])
    )
    table = selected & row_ok[:, None, :, None]  # the exact sub-block selection, padding rows off
    sub_sel = selected & sub_live
    sub_whole = selected if layout.token_mask is None else selected & ~frame(layout.partial_blocks())
    sub_whole = sub_whole | ~row_ok[:, None, :, None]  # rows of padding queries: don't care

    def tiles(t: torch.Tensor, reduce: str) -> torch.Tensor:
        t = t.reshape(batch, heads, nqb_k, f, nkb_k, f)
        return t.any(5).any(3) if reduce == "any" else t.all(5).all(3)

    computed = tiles(sub_sel, "any")
    pos_tile = (q_tile[:, None] + torch.arange(nqb_k, device=dev)[None, :])[:, None, :, None]  # (B,1,T,1)
    kv_tile = torch.arange(nkb_k, device=dev)[None, None, None, :]
    full = (
        computed
        & tiles(sub_whole, "all")
        & (kv_tile < pos_tile)
        & (((kv_tile + 1) * kb) <= kv_len[:, None, None, None])
    )
    partial_tiles = computed & ~full

    # -- mask_mod: everything the kernel applies inside a partial tile --------------------------------
    token_mask = layout.token_mask
    lookup_table = table if block_lookup else None
    table_heads = heads

    def mask_mod(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        pos = q_tile_pos[b] + q_idx
        keep = (kv_idx <= pos) & (kv_idx < kv_len[b])
        if lookup_table is not None:
            hh = h if table_heads > 1 else h * 0
            keep = keep & lookup_table[b, hh, q_idx // bs, kv_idx // bs]
        if token_mask is not None:
            keep = keep & token_mask(b, h, pos, kv_idx)
        return keep

    from torch.nn.attention.flex_attention import BlockMask

    num, idx = index_lists(partial_tiles)
    full_num, full_idx = index_lists(full)
    block_mask = BlockMask.from_kv_blocks(
        num,
        idx,
        full_num,
        full_idx,
        BLOCK_SIZE=kb,
        mask_mod=mask_mod,
        seq_lengths=(qp, kp),
        compute_q_blocks=compute_q_blocks,
    )
    offsets = tuple(int(x) for x in (q_start - q_tile_pos).tolist())
    return FlexMask(
        block_mask=block_mask,
        mask_mod=mask_mod,
        kernel_block_size=kb,
        q_offsets=offsets,
        q_len=seq.q_len,
        q_padded_len=qp,
        kv_capacity=seq.kv_capacity,
        kv_padded_len=kp,
        block_lookup=block_lookup,
    )


def restrict_heads(fm: FlexMask, keep: torch.Tensor, *, compute_q_blocks: bool = False) -> FlexMask:
    """``fm`` for ``keep.shape[1]`` query heads, computing nothing on the heads where ``keep`` is false.

    ``keep`` is (B or 1, Hq) bool. ``fm``'s block lists have 1 or Hq heads; they are broadcast to
    Hq and the counts of dropped heads set to 0 (their rows then come out as FlexAttention's empty
    rows: zeros). ``mask_mod`` is unchanged: it is only evaluated inside tiles the lists name. This
    is how the split executor runs a routed layer's sparse heads over one mask converted for one
    head, instead of converting a per-head layout (at 128K tokens, 32 heads: about 6 ms per call
    against 1.6 ms for one head).
    """
    from torch.nn.attention.flex_attention import BlockMask

    bm = fm.block_mask
    batch, heads = bm.kv_num_blocks.shape[:2]
    keep_batch, hq = keep.shape
    if heads not in (1, hq) or 1 not in (batch, keep_batch) and batch != keep_batch:
        raise UnsupportedInputError(
            f"restrict_heads: a mask of {batch} samples x {heads} heads cannot be restricted by keep {tuple(keep.shape)}"
        )
    out_b = max(batch, keep_batch)
    live = keep.to(device=bm.kv_num_blocks.device)[:, :, None].expand(out_b, hq, 1)

    def counts(num: torch.Tensor) -> torch.Tensor:
        return torch.where(live, num.expand(out_b, hq, num.shape[2]), torch.zeros_like(num[:1, :1])).contiguous()

    def lists(idx: torch.Tensor) -> torch.Tensor:
        return idx.expand(out_b, hq, *idx.shape[2:]).contiguous()

    full_num, full_idx = bm.full_kv_num_blocks, bm.full_kv_indices
    if full_num is not None and full_idx is not None:  # a BlockMask sets both or neither
        full_num, full_idx = counts(full_num), lists(full_idx)
    block_mask = BlockMask.from_kv_blocks(
        counts(bm.kv_num_blocks),
        lists(bm.kv_indices),
        full_num,
        full_idx,
        BLOCK_SIZE=bm.BLOCK_SIZE,
        mask_mod=bm.mask_mod,
        seq_lengths=bm.seq_lengths,
        compute_q_blocks=compute_q_blocks,
    )
    return replace(fm, block_mask=block_mask)


# ---------------------------------------------------------------------------------------
# Dense views: what the kernel computes, for the emulated path and tests (O(rows * Sk))
# ---------------------------------------------------------------------------------------


def _lists_to_dense(num: torch.Tensor, indices: torch.Tensor, nkb: int) -> torch.Tensor:
    entries = torch.arange(indices.shape[-1], device=indices.device)
    valid = entries < num[..., None]
    cols = torch.where(valid, indices.long(), torch.full_like(indices, nkb).long())
    dense = torch.zeros(*indices.shape[:-1], nkb + 1, dtype=torch.bool, device=indices.device)
    dense.scatter_(-1, cols, torch.ones_like(cols, dtype=torch.bool))
    return dense[..., :nkb]


def tile_masks(block_mask: BlockMask) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) bool tile masks (B, H, NQB, NKB) read back from a BlockMask's kv lists."""
    nkb = block_mask.kv_indices.shape[-1]
    partial = _lists_to_dense(block_mask.kv_num_blocks, block_mask.kv_indices, nkb)
    if block_mask.full_kv_num_blocks is None:
        return partial, torch.zeros_like(partial)
    assert block_mask.full_kv_indices is not None  # a BlockMask sets both full-block lists or neither
    full = _lists_to_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nkb)
    return partial, full


def dense_kernel_mask(
    fm: FlexMask,
    num_heads: int,
    rows: slice | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """(B, num_heads or 1, rows, Kp) bool over *padded* rows: exactly what a block-sparse
    FlexAttention kernel computes with ``fm`` — full tiles whole, ``mask_mod`` (called with query
    head indices ``0..num_heads-1``) inside partial tiles, nothing elsewhere. ``tiles`` is
    :func:`tile_masks`' result, to reuse across row chunks."""
    partial, full = tiles if tiles is not None else tile_masks(fm.block_mask)
    kb = fm.kernel_block_size
    dev = partial.device
    rows = rows if rows is not None else slice(0, fm.q_padded_len)
    r = torch.arange(fm.q_padded_len, device=dev)[rows]
    c = torch.arange(fm.kv_padded_len, device=dev)
    rt, ct = torch.div(r, kb, rounding_mode="floor"), torch.div(c, kb, rounding_mode="floor")
    p = partial[:, :, rt][..., ct]
    w = full[:, :, rt][..., ct]
    b = torch.arange(partial.shape[0], device=dev)[:, None, None, None]
    h = torch.arange(num_heads, device=dev)[None, :, None, None]
    inner = fm.mask_mod(b, h, r[None, None, :, None], c[None, None, None, :])
    return w | (p & inner)
