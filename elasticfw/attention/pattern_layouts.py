"""Selections → :class:`~elasticfw.attention.layout.BlockLayout`, exactly.

The third step of a data-dependent mode (:mod:`elasticfw.attention.patterns` estimates,
:mod:`elasticfw.attention.selectors` selects): :func:`key_blocks_to_layout` (one selection per
tile over key groups), :func:`row_selection_layout` and :func:`row_selection_layout_from_tiles`
(one selection per query row: the tile's union, partial where its rows disagree, a token mask
per row), :func:`lines_to_layout` (vertical and slash lines) and :func:`tile_union`. Results are
causal block patterns in canonical coordinates (:mod:`elasticfw.attention.seq`) with the
selection's number of heads (1, ``Hkv`` or ``Hq``); causality inside the diagonal block is the
executor's. Every tensor is O((S/bs)^2) per head besides the selections passed in. Each converter
in detail: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import torch

from elasticfw.attention.layout import BlockLayout, RowSelection, block_grid
from elasticfw.attention.patterns import pool_tiles, query_grid
from elasticfw.attention.seq import SeqInfo


def _key_groups(seq: SeqInfo, block_size: int, key_block_size: int | None, num_groups: int) -> torch.Tensor:
    """(NKB,) the key group (of ``key_block_size`` keys) each layout key block belongs to."""
    kbs = block_size if key_block_size is None else key_block_size
    if kbs <= 0 or kbs % block_size:
        raise ValueError(
            f"key_block_size={kbs} must be a positive multiple of block_size={block_size} (a key group must "
            "be a whole number of layout blocks)"
        )
    nkb = seq.num_key_blocks(block_size)
    needed = ((nkb - 1) * block_size) // kbs + 1 if nkb else 0
    if num_groups < needed:
        raise ValueError(
            f"the selection has {num_groups} key groups of {kbs} keys; kv_capacity {seq.kv_capacity} needs {needed}"
        )
    k_blocks = torch.arange(nkb, device=seq.device)
    return torch.div(k_blocks * block_size, kbs, rounding_mode="floor")


def key_blocks_to_layout(
    selected: torch.Tensor, seq: SeqInfo, block_size: int, *, key_block_size: int | None = None
) -> BlockLayout:
    """Per-tile selections (B or 1, H, NQB, G) bool over key groups → a block layout.

    ``selected[b, h, t, n]``: layout row ``t`` (position block ``seq.q_block_start(bs)[b] + t``)
    computes key group ``n``, the keys ``[n * key_block_size, (n + 1) * key_block_size)``
    (``key_block_size`` defaults to ``block_size`` and must be a multiple of it). The layout keeps
    the selected groups' blocks that are causal (key block ``<=`` the row's position block)."""
    owner = _key_groups(seq, block_size, key_block_size, selected.shape[-1])
    q_blocks, k_blocks = block_grid(seq, block_size)
    return BlockLayout(selected[..., owner] & (k_blocks <= q_blocks)[:, None], block_size)


def tile_union(
    selected: torch.Tensor, seq: SeqInfo, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row selections (B, H, Sq, N) → per layout tile (B, H, NQB, N): the entries any real row
    of the tile selects, the entries every real row selects (``False`` for a tile without a real
    row), and (B, NQB) whether the tile has a real row."""
    grid, valid = query_grid(selected, seq, block_size)
    union = pool_tiles(grid, valid, block_size, "any")
    common = pool_tiles(grid, valid, block_size, "all")
    occupied = valid.view(valid.shape[0], -1, block_size).any(-1)
    return union, common, occupied


def row_selection_layout(
    selected: torch.Tensor, seq: SeqInfo, block_size: int, *, key_block_size: int | None = None
) -> BlockLayout:
    """Per-query-row selections (B, H, Sq, G) bool over key groups → a block layout with a token mask.

    ``selected[b, h, i, n]``: query row ``i`` (position ``seq.q_start[b] + i``) sees the keys of
    key group ``n`` (``key_block_size`` keys, default ``block_size``, a multiple of it), causally. A
    tile computes the union of its real rows' selections; a block is partial where they disagree,
    and the token mask returns row ``i``'s own selection. Padding rows select nothing."""
    union, common, _ = tile_union(selected, seq, block_size)
    return row_selection_layout_from_tiles(selected, union, common, seq, block_size, key_block_size=key_block_size)


def row_selection_layout_from_tiles(
    selected: torch.Tensor,
    union: torch.Tensor,
    common: torch.Tensor,
    seq: SeqInfo,
    block_size: int,
    *,
    key_block_size: int | None = None,
) -> BlockLayout:
    """:func:`row_selection_layout` with the tiles' ``union`` and ``common`` (B, H, NQB, G) bool
    already computed (as :func:`tile_union` returns them, e.g. by a fused kernel that selects and
    pools in one pass); ``selected`` (B, H, Sq, G) is what the token mask looks up."""
    owner = _key_groups(seq, block_size, key_block_size, selected.shape[-1])
    q_blocks, k_blocks = block_grid(seq, block_size)
    blocks = union[..., owner] & (k_blocks <= q_blocks)[:, None]
    partial = blocks & ~common[..., owner]
    sq, groups = selected.shape[2], selected.shape[3]
    if sq == 0:
        return BlockLayout(blocks, block_size)
    q_start, kbs = seq.q_start, block_size if key_block_size is None else key_block_size

    def token_mask(b, h, q_pos, kv_pos):  # type: ignore[no-untyped-def]
        row = (q_pos - q_start[b]).clamp(0, sq - 1)
        group = torch.div(kv_pos, kbs, rounding_mode="floor").clamp(0, groups - 1)
        return selected[b, h, row, group]

    return BlockLayout(blocks, block_size, token_mask, partial, row_selection=RowSelection(selected, kbs))


def _range_counts(prefix: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Selected entries in ``[lo, hi]`` per (b, h, t, n): ``prefix`` (B, H, N+1) running counts,
    ``lo``/``hi`` (B, NQB, NKB) inclusive bounds, clamped to the table (empty when lo > hi)."""
    n = prefix.shape[-1] - 1
    lo_c, hi_c = lo.clamp(0, n), (hi + 1).clamp(0, n)
    batch, heads = prefix.shape[:2]
    shape = (max(batch, lo.shape[0]), heads, lo.shape[1] * lo.shape[2])
    table = prefix.expand(shape[0], heads, n + 1)

    def at(i: torch.Tensor) -> torch.Tensor:
        return table.gather(-1, i.reshape(i.shape[0], 1, -1).expand(shape))

    return (at(hi_c) - at(lo_c)).clamp_min(0).view(shape[0], heads, lo.shape[1], lo.shape[2])


def lines_to_layout(
    seq: SeqInfo,
    block_size: int,
    *,
    columns: torch.Tensor | None = None,
    diagonals: torch.Tensor | None = None,
) -> BlockLayout:
    """Vertical and slash lines → the exact block layout and token mask.

    ``columns`` (B or 1, H, Sk) bool: key ``j`` is visible to every query at or after it.
    ``diagonals`` (B or 1, H, Sk) bool, indexed by offset ``d``: the query at position ``p`` sees
    key ``p - d``. Key ``j`` is visible to position ``p`` iff ``j <= p`` and (``columns[j]`` or
    ``diagonals[p - j]``). At least one of the two must be given; both need the same heads.

    ``blocks`` lists exactly the causal (tile, key block) pairs where a line crosses a key below
    ``seq.kv_capacity`` at some position of the tile; a block is whole (not ``partial``) when all
    its keys are selected columns, or all the offsets its causal pairs can have are selected
    diagonals; every other listed block is partial and evaluated with the token mask."""
    if columns is None and diagonals is None:
        raise ValueError("lines_to_layout needs columns, diagonals or both")
    lines = columns if columns is not None else diagonals
    assert lines is not None
    for name, t in (("columns", columns), ("diagonals", diagonals)):
        if t is not None and (t.dtype != torch.bool or t.dim() != 3 or t.shape[-1] != seq.kv_capacity):
            raise ValueError(
                f"lines_to_layout: {name} must be (batch or 1, heads, kv_capacity={seq.kv_capacity}) bool, "
                f"got {t.dtype} of shape {tuple(t.shape)}"
            )
    if columns is not None and diagonals is not None and columns.shape[1] != diagonals.shape[1]:
        raise ValueError(
            f"lines_to_layout: columns have {columns.shape[1]} heads and diagonals {diagonals.shape[1]}; "
            "give both the same heads"
        )
    bs, cap = block_size, seq.kv_capacity
    heads, dev = lines.shape[1], lines.device
    q_blocks, k_blocks = block_grid(seq, bs)  # (B, NQB, 1), (1, 1, NKB)
    nkb = k_blocks.shape[-1]
    causal = (k_blocks <= q_blocks)[:, None]  # (B, 1, NQB, NKB)
    k_first = k_blocks * bs
    k_last = torch.clamp(k_first + bs, max=cap) - 1  # last existing key of each block
    crossed = torch.zeros(1, heads, 1, nkb, dtype=torch.bool, device=dev)
    whole = torch.zeros_like(crossed)
    if columns is not None:
        padded = torch.nn.functional.pad(columns, (0, nkb * bs - cap), value=True)  # no key there
        per_block = padded.view(columns.shape[0], heads, nkb, bs)
        exists = torch.arange(nkb * bs, device=dev).view(nkb, bs) < cap
        crossed = (per_block & exists).any(-1)[:, :, None]  # (B|1, H, 1, NKB)
        whole = per_block.all(-1)[:, :, None]
    if diagonals is not None:
        prefix = torch.nn.functional.pad(diagonals.long().cumsum(-1), (1, 0))  # (B|1, H, Sk+1)
        # the causal pairs (p, j) of tile t x key block n (positions p < kv_capacity) have exactly
        # the offsets d = p - j in [lo, hi]
        p_last = torch.clamp(q_blocks * bs + bs, max=cap) - 1
        lo = (q_blocks * bs - k_last).clamp_min(0).expand(-1, -1, nkb)
        hi = (p_last - k_first).expand(-1, -1, nkb)
        count = _range_counts(prefix, lo, hi)
        width = (hi - lo + 1).clamp_min(0)[:, None]
        crossed = crossed | (count > 0)
        whole = whole | ((count == width) & (width > 0))
    blocks = crossed & causal
    partial = blocks & ~whole
    last = cap - 1

    def on_columns(b, h, kv_pos):  # type: ignore[no-untyped-def]
        assert columns is not None
        return columns[b if columns.shape[0] > 1 else torch.zeros_like(b), h, kv_pos.clamp(0, last)]

    def on_diagonals(b, h, q_pos, kv_pos):  # type: ignore[no-untyped-def]
        assert diagonals is not None
        offset = q_pos - kv_pos
        picked = diagonals[b if diagonals.shape[0] > 1 else torch.zeros_like(b), h, offset.clamp(0, last)]
        return (offset >= 0) & picked

    def token_mask(b, h, q_pos, kv_pos):  # type: ignore[no-untyped-def]
        if diagonals is None:
            return on_columns(b, h, kv_pos)
        if columns is None:
            return on_diagonals(b, h, q_pos, kv_pos)
        return on_columns(b, h, kv_pos) | on_diagonals(b, h, q_pos, kv_pos)

    return BlockLayout(blocks, bs, token_mask, partial)
