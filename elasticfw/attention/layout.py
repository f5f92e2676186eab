"""Block layouts: which key blocks each (batch, head, query block) computes.

A :class:`BlockLayout` is the one representation every mode produces and every executor
consumes. ``blocks[b, h, t, j]`` says whether query-block row ``t`` of sample ``b`` and head
``h`` computes key block ``j`` (row ``t`` is position block ``seq.q_block_start(bs)[b] + t``,
see :mod:`elasticfw.attention.seq`). Causality inside the diagonal block is always applied by
the executor; a layout never needs to encode it. Modes whose pattern is finer than a block
(token-exact streaming, per-token MoBA) add a *token mask* — a function
``(b, h, q_pos, kv_pos) -> bool`` written with elementwise tensor ops, so that it can be
evaluated on broadcast index grids (reference executor, statistics) and inside FlexAttention's
``mask_mod`` alike — plus ``partial``, the blocks where that mask may be ``False``.

Token masks must accept any integer position (executors evaluate them on padding rows and
columns too), so clamp before indexing a tensor with a position.

Sizes are O((S/bs)^2) per head, never O(S^2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import UnsupportedInputError

TokenMask = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RowSelection:
    """A token mask of the form "query row ``i`` sees the key groups it selected (and a sliding
    window)", kept as data so that a kernel can run it without evaluating the mask per pair
    (per-token MoBA, NSA per token or per query block).

    ``selected`` is (B or 1, H, R, G) bool over flag rows of ``row_block`` positions: the query at
    position ``p`` (row ``i = p - seq.q_start[b]``) reads flag row ``p // row_block - q_start //
    row_block`` (row ``i`` itself for ``row_block = 1``; the layout's query-block row for
    ``row_block = block_size``) and sees, causally, the keys ``[n * group_size, (n + 1) *
    group_size)`` of every group ``n`` it selects, and, when ``window > 0``, every key ``j`` with
    ``p - window < j``. ``H`` divides the layout's query heads (query head ``h`` reads table head
    ``h // (Hq / H)``, as :func:`expand_heads` maps a token mask). The layout's ``token_mask``
    computes the same pairs.
    """

    selected: torch.Tensor
    group_size: int
    row_block: int = 1
    window: int = 0

    def __post_init__(self) -> None:
        if self.selected.dim() != 4:
            raise UnsupportedInputError(
                f"RowSelection.selected must be 4-D (batch, heads, rows, groups), got {tuple(self.selected.shape)}"
            )
        if self.group_size <= 0 or self.row_block <= 0 or self.window < 0:
            raise UnsupportedInputError(
                f"RowSelection: group_size and row_block must be positive and window >= 0, got "
                f"{self.group_size}, {self.row_block}, {self.window}"
            )


@dataclass(frozen=True)
class BlockLayout:
    """Per-(batch, head, query block) key blocks, optionally refined by a token mask.

    ``blocks`` is bool of shape ``(B or 1, H, NQB, NKB)``; ``H`` is 1 (same for every head),
    the number of KV heads, or the number of query heads (see :func:`expand_heads`).
    ``dense_causal`` declares that ``blocks`` is exactly the causal block pattern and there is
    no token mask, so an executor may hand those heads to a dense causal kernel.
    ``reusable`` is set by whoever hands the *same object* to many executor calls (the runtime
    does, for modes whose layout depends only on ``seq``: one layout for every layer of a
    forward): an executor may then keep what it derives from the layout (a BlockMask), keyed on
    the object's identity. A layout's tensors are never changed in place. ``row_selection``, when
    set, is the token mask as data (:class:`RowSelection`); transformations that change which
    pairs a layout computes build a new layout without it, so an executor may use it instead of
    ``blocks`` and ``token_mask`` whenever it is present.
    """

    blocks: torch.Tensor
    block_size: int
    token_mask: TokenMask | None = None
    partial: torch.Tensor | None = None
    dense_causal: bool = False
    reusable: bool = False
    row_selection: RowSelection | None = None

    def __post_init__(self) -> None:
        if self.blocks.dtype != torch.bool or self.blocks.dim() != 4:
            raise UnsupportedInputError(
                f"BlockLayout.blocks must be a 4-D bool tensor (batch, heads, q_blocks, kv_blocks); got "
                f"{self.blocks.dtype} of shape {tuple(self.blocks.shape)}"
            )
        if self.block_size <= 0:
            raise UnsupportedInputError(f"block_size must be positive, got {self.block_size}")
        if self.partial is not None and self.partial.shape != self.blocks.shape:
            raise UnsupportedInputError(
                f"BlockLayout.partial shape {tuple(self.partial.shape)} != blocks shape {tuple(self.blocks.shape)}"
            )

    @property
    def num_heads(self) -> int:
        return int(self.blocks.shape[1])

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.blocks.shape)  # type: ignore[return-value]

    def partial_blocks(self) -> torch.Tensor:
        """Blocks where the token mask may drop pairs (all False without a token mask)."""
        if self.token_mask is None:
            return torch.zeros_like(self.blocks)
        return self.blocks if self.partial is None else self.partial & self.blocks


# ---------------------------------------------------------------------------------------
# Construction
# ---------------------------------------------------------------------------------------


def block_grid(seq: SeqInfo, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, NQB, 1) position block of every layout row and (1, 1, NKB) key-block index."""
    q_blocks = seq.query_block_positions(block_size)[:, :, None]
    k_blocks = torch.arange(seq.num_key_blocks(block_size), device=seq.device)[None, None, :]
    return q_blocks, k_blocks


def causal_layout(seq: SeqInfo, block_size: int) -> BlockLayout:
    """Every causal block, one head broadcast to all (``dense_causal=True``)."""
    q_blocks, k_blocks = block_grid(seq, block_size)
    return BlockLayout((k_blocks <= q_blocks)[:, None], block_size, dense_causal=True)


def expand_heads(layout: BlockLayout, num_heads: int) -> BlockLayout:
    """Expand a layout of 1 or ``G``-grouped heads to ``num_heads`` (query heads under GQA).

    A layout made per KV head is repeated for the query heads of its group (query head ``h``
    belongs to KV head ``h // (num_heads // H)``), as transformers' ``repeat_kv`` does. Returns
    the layout unchanged when it already has ``num_heads`` heads, and a 1-head layout still
    broadcasting, its token mask (if any) called with head 0 for every head: a 1-head layout means
    one pattern for all heads, whether it was built shared or per KV head with a single KV head,
    so its token mask never sees a query-head index it was not built for.
    """
    heads = layout.num_heads
    if heads == num_heads:
        return layout
    if heads == 1:
        if layout.token_mask is None:
            return layout
        inner_one = layout.token_mask

        def shared_mask(b, h, q, k, _inner=inner_one):  # type: ignore[no-untyped-def]
            return _inner(b, torch.zeros_like(h), q, k)

        return replace(layout, token_mask=shared_mask)
    if num_heads % heads != 0:
        raise UnsupportedInputError(
            f"cannot expand a layout of {heads} heads to {num_heads} query heads: not a multiple"
        )
    group = num_heads // heads
    blocks = layout.blocks.repeat_interleave(group, dim=1)
    partial = layout.partial.repeat_interleave(group, dim=1) if layout.partial is not None else None
    token_mask = None
    if layout.token_mask is not None:
        inner = layout.token_mask

        def token_mask(b, h, q, k, _inner=inner, _g=group):  # type: ignore[no-untyped-def]
            return _inner(b, torch.div(h, _g, rounding_mode="floor"), q, k)

    return replace(layout, blocks=blocks, partial=partial, token_mask=token_mask)


def broadcast_heads(layout: BlockLayout, num_heads: int) -> BlockLayout:
    """Materialise a 1-head layout as ``num_heads`` identical heads (after :func:`expand_heads`)."""
    layout = expand_heads(layout, num_heads)
    if layout.num_heads == num_heads:
        return layout
    shape = (layout.blocks.shape[0], num_heads, *layout.blocks.shape[2:])
    partial = layout.partial.expand(shape) if layout.partial is not None else None
    return replace(layout, blocks=layout.blocks.expand(shape), partial=partial)


def rescale(layout: BlockLayout, seq: SeqInfo, block_size: int) -> BlockLayout:
    """Re-express a layout at a smaller block size that divides its own (exactly the same pairs)."""
    old = layout.block_size
    if block_size == old:
        return layout
    if old % block_size != 0:
        raise UnsupportedInputError(
            f"cannot rescale a layout of block size {old} to {block_size}: the new block size must divide the old"
        )
    f = old // block_size
    new_rows = seq.query_block_positions(block_size)  # (B, NQB')
    old_rows = torch.div(new_rows, f, rounding_mode="floor") - seq.q_block_start(old)[:, None]
    old_rows = old_rows.clamp(0, layout.blocks.shape[2] - 1)
    nkb = seq.num_key_blocks(block_size)

    def remap(t: torch.Tensor) -> torch.Tensor:
        batch = t.shape[0]
        rows = old_rows if batch == seq.batch else old_rows[:1]
        idx = rows[:, None, :, None].expand(batch, t.shape[1], rows.shape[1], t.shape[3])
        t = t.gather(2, idx)
        return t.repeat_interleave(f, dim=3)[..., :nkb]

    partial = remap(layout.partial) if layout.partial is not None else None
    return replace(layout, blocks=remap(layout.blocks), partial=partial, block_size=block_size)


def select_heads(use_first: torch.Tensor, first: BlockLayout, second: BlockLayout) -> BlockLayout:
    """Per (batch, head): ``first`` where ``use_first[b, h]`` else ``second``.

    ``use_first`` is (B, H) bool at the query-head granularity of the result; both layouts must
    have the same block size and 1 or H heads.
    """
    if first.block_size != second.block_size:
        raise UnsupportedInputError(
            f"select_heads needs one block size, got {first.block_size} and {second.block_size}; "
            "rescale the layouts first"
        )
    batch, heads = use_first.shape
    a, b = broadcast_heads(first, heads), broadcast_heads(second, heads)
    if a.blocks.shape[2:] != b.blocks.shape[2:]:
        raise UnsupportedInputError(
            f"layouts cover different block grids: {tuple(a.blocks.shape)} vs {tuple(b.blocks.shape)}"
        )
    sel = use_first[:, :, None, None]
    blocks = torch.where(sel, a.blocks, b.blocks)
    token_mask = None
    partial = None
    if a.token_mask is not None or b.token_mask is not None:
        partial = torch.where(sel, a.partial_blocks(), b.partial_blocks())
        ta, tb = a.token_mask, b.token_mask
        use = use_first

        def token_mask(bi, h, q, k, _ta=ta, _tb=tb, _use=use):  # type: ignore[no-untyped-def]
            pick = _use[bi, h]
            ma = _ta(bi, h, q, k) if _ta is not None else torch.ones_like(pick)
            mb = _tb(bi, h, q, k) if _tb is not None else torch.ones_like(pick)
            return torch.where(pick, ma, mb)

    dense = bool(a.dense_causal and b.dense_causal)
    return BlockLayout(blocks, first.block_size, token_mask, partial, dense)


def with_window(layout: BlockLayout, seq: SeqInfo, window: int) -> BlockLayout:
    """Intersect a layout with a sliding window: key ``j`` visible to position ``p`` iff ``p - j < window``.

    This is how a backbone's native sliding-window layers keep their semantics under any mode.
    """
    bs = layout.block_size
    q_blocks, k_blocks = block_grid(seq, bs)
    # A block is reachable if the tile's first position sees the block's last key.
    reach = (q_blocks * bs) - (k_blocks * bs + bs - 1) < window
    # It is fully inside the window if even the tile's last position sees its first key.
    inside = (q_blocks * bs + bs - 1) - (k_blocks * bs) < window
    blocks = layout.blocks & reach[:, None]
    partial = layout.partial_blocks() | ~inside[:, None]
    inner = layout.token_mask

    def token_mask(b, h, q, k, _inner=inner, _w=window):  # type: ignore[no-untyped-def]
        m = (q - k) < _w
        return m & _inner(b, h, q, k) if _inner is not None else m

    return BlockLayout(blocks, bs, token_mask, partial & blocks, False)


# ---------------------------------------------------------------------------------------
# Dense views (reference executor and tests) and statistics
# ---------------------------------------------------------------------------------------


def dense_mask(layout: BlockLayout, seq: SeqInfo, rows: slice | None = None, *, num_heads: int) -> torch.Tensor:
    """The token-level view of a layout: which (query, key) pairs of real tokens it computes.

    Returns a ``(B, num_heads, R, kv_capacity)`` bool tensor, ``R`` the query rows in ``rows``
    (default: all ``seq.q_len``). ``mask[b, h, i, j]`` is True exactly when query row ``i`` of
    sample ``b`` at query head ``h`` attends to key ``j``, that is when all of these hold:

    * the layout selects the pair: its block ``blocks[b, h, t, j // block_size]`` (``t`` the row's
      query block) is set, and its token mask, if any, is True for the pair;
    * causality: ``j <= p``, where ``p = seq.q_start[b] + i`` is the row's position;
    * both are real tokens of sample ``b`` (see :class:`~elasticfw.attention.seq.SeqInfo`): the
      row is not a padding row (``p < seq.kv_len[b]``) and the key is not a padding key
      (``j < seq.kv_len[b]``).

    So a padding row is all False (it attends to nothing; executors give it ``out == 0`` and
    ``lse == -inf``), and so is every padding column. Summed over rows and keys
    (``mask.sum((-1, -2))``), it counts the pairs :func:`computed_pairs` counts.

    :param layout: the block layout, of 1 head (one pattern for every head), ``Hkv`` heads (one
        per KV head, repeated for the query heads of its group) or ``num_heads`` heads; see
        :func:`expand_heads`.
    :param seq: where the real tokens are, in canonical coordinates.
    :param rows: the query rows to return (a slice of ``range(seq.q_len)``), so that an executor
        can build the mask chunk by chunk; default all rows.
    :param num_heads: the number of heads of the result: the query heads ``Hq`` of the attention.
        Required (keyword only), so that a layout of 1 or ``Hkv`` heads is never silently returned
        at its own head count.
    :raises UnsupportedInputError: ``num_heads`` is not a positive int, or not a multiple of the
        layout's heads (a 1-head layout fits any ``num_heads``).

    Memory and time are O(B * num_heads * R * kv_capacity): this is for the reference and dense
    executors (in row chunks) and for tests, not for long sequences.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise UnsupportedInputError(
            f"dense_mask: num_heads must be a positive int (the query heads Hq), got {num_heads!r}"
        )
    bs = layout.block_size
    lay = broadcast_heads(layout, num_heads)
    heads = num_heads
    rows = rows if rows is not None else slice(0, seq.q_len)
    row_idx = torch.arange(seq.q_len, device=seq.device)[rows]
    pos = seq.q_start[:, None] + row_idx[None, :]  # (B, R)
    t = torch.div(pos, bs, rounding_mode="floor") - seq.q_block_start(bs)[:, None]
    t = t.clamp(0, lay.blocks.shape[2] - 1)
    batch = seq.batch
    blocks = lay.blocks.expand(batch, heads, *lay.blocks.shape[2:])
    idx = t[:, None, :, None].expand(batch, heads, t.shape[1], blocks.shape[3])
    row_blocks = blocks.gather(2, idx)  # (B, H, R, NKB)
    kv = torch.arange(seq.kv_capacity, device=seq.device)
    mask = row_blocks[..., torch.div(kv, bs, rounding_mode="floor")]
    # causality, and real tokens only: a padding row (position >= kv_len) or key (index >= kv_len)
    # is all False; for a real row, j <= position < kv_len already keeps its keys real
    kv_len = seq.kv_len[:, None, None, None]
    real_row = pos[:, None, :, None] < kv_len
    mask = mask & (kv[None, None, None, :] <= pos[:, None, :, None]) & real_row & (kv[None, None, None, :] < kv_len)
    if lay.token_mask is not None:
        b_idx = torch.arange(batch, device=seq.device)[:, None, None, None]
        h_idx = torch.arange(heads, device=seq.device)[None, :, None, None]
        mask = mask & lay.token_mask(b_idx, h_idx, pos[:, None, :, None], kv[None, None, None, :])
    return mask


def _closed_form_pair_counts(seq: SeqInfo, bs: int) -> torch.Tensor:
    """(B, NQB, NKB) int64: causal pairs of real query rows inside each (row block, key block)."""
    q_blocks, k_blocks = block_grid(seq, bs)  # (B,NQB,1), (1,1,NKB)
    first_pos = seq.q_start[:, None, None]
    last_pos = torch.minimum(seq.q_start + seq.q_len, seq.kv_len)[:, None, None] - 1
    p0 = torch.maximum(q_blocks * bs, first_pos)
    p1 = torch.minimum(q_blocks * bs + bs - 1, last_pos)
    k_lo = k_blocks * bs
    k_hi = torch.minimum(k_blocks * bs + bs - 1, seq.kv_len[:, None, None] - 1)
    # rows in [max(p0, k_lo), min(p1, k_hi)] see (p - k_lo + 1) keys of the block
    a = torch.maximum(p0, k_lo)
    c = torch.minimum(p1, k_hi)
    n = (c - a + 1).clamp_min(0)
    tri = n * ((a - k_lo + 1) + (c - k_lo + 1)) // 2
    # rows past the block's last key see the whole block
    width = (k_hi - k_lo + 1).clamp_min(0)
    full_rows = (p1 - torch.maximum(p0, k_hi + 1) + 1).clamp_min(0)
    return torch.where(n > 0, tri, torch.zeros_like(tri)) + full_rows * width


def computed_pairs(layout: BlockLayout, seq: SeqInfo, num_heads: int | None = None) -> torch.Tensor:
    """(B, H) int64: (query, key) pairs the layout computes over real query rows, exactly.

    Blocks without a token mask are counted in closed form; partial blocks are evaluated token
    by token (only those blocks), so the cost stays O(#partial blocks * bs^2).
    """
    bs = layout.block_size
    heads = num_heads if num_heads is not None else layout.num_heads
    lay = broadcast_heads(layout, heads)
    counts = _closed_form_pair_counts(seq, bs)  # (B, NQB, NKB)
    batch = seq.batch
    blocks = lay.blocks.expand(batch, heads, *lay.blocks.shape[2:])
    partial = lay.partial_blocks().expand(batch, heads, *lay.blocks.shape[2:])
    whole = blocks & ~partial
    total = torch.zeros(batch, heads, dtype=torch.long, device=seq.device)
    for h in range(heads):
        total[:, h] = torch.where(whole[:, h], counts, torch.zeros_like(counts)).sum((-1, -2))
    if lay.token_mask is not None and bool(partial.any()):
        total += _partial_pair_counts(lay, seq, partial, heads)
    return total


def _partial_pair_counts(
    layout: BlockLayout, seq: SeqInfo, partial: torch.Tensor, heads: int, chunk: int = 4096
) -> torch.Tensor:
    bs = layout.block_size
    idx = partial.nonzero()  # (P, 4): b, h, t, j
    total = torch.zeros(seq.batch, heads, dtype=torch.long, device=seq.device)
    offs = torch.arange(bs, device=seq.device)
    qbs = seq.q_block_start(bs)
    last_pos = torch.minimum(seq.q_start + seq.q_len, seq.kv_len) - 1
    for start in range(0, idx.shape[0], chunk):
        part = idx[start : start + chunk]
        b, h, t, j = part.unbind(-1)
        qpos = ((qbs[b] + t) * bs)[:, None] + offs[None, :]  # (P, bs)
        kpos = (j * bs)[:, None] + offs[None, :]
        row_ok = (qpos >= seq.q_start[b][:, None]) & (qpos <= last_pos[b][:, None])
        m = layout.token_mask(b[:, None, None], h[:, None, None], qpos[:, :, None], kpos[:, None, :])  # type: ignore[misc]
        m = m & (kpos[:, None, :] <= qpos[:, :, None]) & row_ok[:, :, None]
        m = m & (kpos[:, None, :] < seq.kv_len[b][:, None, None])
        total.index_put_((b, h), m.sum((-1, -2)), accumulate=True)
    return total


def density(layout: BlockLayout, seq: SeqInfo, num_heads: int | None = None) -> torch.Tensor:
    """(B, H) float: computed pairs / causal pairs over real query rows."""
    causal = seq.causal_pairs().clamp_min(1).to(torch.float64)
    return (computed_pairs(layout, seq, num_heads).to(torch.float64) / causal[:, None]).float()


def esr(layout: BlockLayout, seq: SeqInfo, num_heads: int | None = None) -> torch.Tensor:
    """(B, H) effective sparsity ratio: the fraction of causal pairs *not* computed."""
    return 1.0 - density(layout, seq, num_heads)


def computes_every_causal_pair(layout: BlockLayout, seq: SeqInfo) -> bool:
    """Whether ``layout`` computes every causal pair of every real query row of ``seq`` (ESR 0), so
    that dense causal attention computes exactly its pairs: a ``dense_causal`` layout; a row
    selection whose every flag row selects every key group up to its rows' last real position (its
    sliding window not counted); or blocks, without a token mask, holding every causal block of
    every real row. Another token mask: ``False`` (not decided). A data-dependent mode at a short
    context (MoBA's top-k or NSA's top-n at least the blocks there are) gives such layouts.
    Reads the device once; O(B * H * rows * groups)."""
    if layout.dense_causal:
        return True
    selection = layout.row_selection
    if selection is not None:
        table, row_block, group = selection.selected, selection.row_block, selection.group_size
    elif layout.token_mask is None:
        table, row_block, group = layout.blocks, layout.block_size, layout.block_size
    else:
        return False
    if seq.q_len == 0 or seq.batch == 0:
        return True
    rows = table.shape[2]
    r = torch.arange(rows, device=seq.device)[None, :]
    first_row = torch.div(seq.q_start, row_block, rounding_mode="floor")[:, None]
    last_real = (torch.minimum(seq.q_start + seq.q_len, seq.kv_len) - 1)[:, None]  # (B, 1)
    lo = torch.maximum((first_row + r) * row_block, seq.q_start[:, None])  # each flag row's real positions
    hi = torch.minimum((first_row + r + 1) * row_block - 1, last_real)
    needed = torch.where(hi >= lo, torch.div(hi, group, rounding_mode="floor") + 1, 0)  # groups 0 .. needed-1
    if int(needed.max()) > table.shape[3]:
        return False  # a needed group past the table: never selected
    g = torch.arange(table.shape[3], device=seq.device)
    need = g[None, None, :] < needed[:, :, None]  # (B, R, G)
    return bool((table | ~need[:, None]).all())


def index_lists(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count (...) int32, indices (..., N) int32) of a (..., N) bool: the set entries' indices
    first, ascending; entries past ``count`` are 0. O(N) (a cumulative sum and a scatter, no sort):
    FlexAttention's ``kv_num_blocks`` / ``kv_indices`` format, and the block-sparse kernel's work
    lists."""
    n = mask.shape[-1]
    count = mask.sum(-1, dtype=torch.int32)
    slot = torch.where(mask, mask.cumsum(-1, dtype=torch.int32) - 1, n).long()  # unset entries to a spare slot
    cols = torch.arange(n, device=mask.device, dtype=torch.int32).expand(mask.shape)
    indices = torch.zeros(*mask.shape[:-1], n + 1, dtype=torch.int32, device=mask.device)
    indices.scatter_(-1, slot, cols)
    return count.contiguous(), indices[..., :n].contiguous()


def kv_block_lists(layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's format: ``kv_num_blocks`` (B,H,NQB) int32 and ``kv_indices`` (B,H,NQB,NKB) int32,
    the selected key blocks first, in ascending order (:func:`index_lists` of ``layout.blocks``)."""
    return index_lists(layout.blocks)


def routed_layout(hard: torch.Tensor, layouts: tuple[BlockLayout, BlockLayout], seq: SeqInfo) -> BlockLayout:
    """One per-head layout for routed heads: ``hard`` (B, Hq) True takes ``layouts[1]`` (sparse),
    False ``layouts[0]`` (retrieval), both re-expressed at the smaller block size."""
    lay_r, lay_s = layouts
    bs = min(lay_r.block_size, lay_s.block_size)
    return select_heads(hard, rescale(lay_s, seq, bs), rescale(lay_r, seq, bs))
