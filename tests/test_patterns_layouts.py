"""elasticfw.attention.pattern_layouts: selections -> block layouts, against token-level definitions.

For each converter the expected (query row, key) mask is written directly from the selection
(loops or broadcasting over positions, never the module's block arithmetic); the layout must
reproduce it through ``dense_mask``, list no block without a visible pair (lines) or exactly the
selected groups (blocks), mark as whole only blocks whose every causal pair is visible, and report
pair counts (``computed_pairs``) equal to a direct count.
"""

from __future__ import annotations

import pytest
import torch

from elasticfw.attention.layout import computed_pairs, dense_mask
from elasticfw.attention.pattern_layouts import (
    key_blocks_to_layout,
    lines_to_layout,
    row_selection_layout,
    tile_union,
)
from elasticfw.attention.seq import SeqInfo

SEQS = {
    "dense": lambda: SeqInfo.dense(2, 45, 45),
    "padded": lambda: SeqInfo.from_lengths(torch.tensor([45, 29]), 45, 45),
    "chunked": lambda: SeqInfo(torch.tensor([13, 5]), torch.tensor([45, 30]), 22, 45),
    "decode": lambda: SeqInfo.dense(2, 1, 45),
}


def _positions(seq: SeqInfo) -> tuple[torch.Tensor, torch.Tensor]:
    return seq.query_positions()[:, None, :, None], torch.arange(seq.kv_capacity)[None, None, None, :]


def _real(seq: SeqInfo) -> torch.Tensor:
    return seq.query_valid()[:, None, :, None]


def _check_exact(layout, seq, expected, heads):
    """dense_mask equals ``expected`` on real rows; whole blocks are fully visible; counts agree."""
    real = _real(seq)
    mask = dense_mask(layout, seq, num_heads=heads)
    assert not ((mask != expected) & real).any(), f"{int(((mask != expected) & real).sum())} pairs differ"
    assert torch.equal(computed_pairs(layout, seq, heads), (expected & real).sum((-1, -2)))


# -- lines ------------------------------------------------------------------------------------------


def _lines_definition(seq, columns, diagonals):
    """(B, H, Sq, Sk): key j visible to position p iff j <= p and (columns[j] or diagonals[p - j])."""
    q_pos, kv = _positions(seq)
    offset = q_pos - kv
    seen = torch.zeros(1, dtype=torch.bool)
    if columns is not None:
        seen = seen | columns[:, :, None, :]
    if diagonals is not None:
        picked = torch.gather(
            diagonals[:, :, None, :].expand(-1, -1, seq.q_len, -1),
            -1,
            offset.clamp(0, seq.kv_capacity - 1).expand(diagonals.shape[0], diagonals.shape[1], -1, -1),
        )
        seen = seen | (picked & (offset >= 0))
    return seen & (kv <= q_pos)


def _blocks_crossed(seq, columns, diagonals, bs):
    """(B, H, NQB, NKB) from loops: some position p of the tile (p < kv_capacity) sees some key."""
    nqb, nkb, cap = seq.num_query_blocks(bs), seq.num_key_blocks(bs), seq.kv_capacity
    heads = (columns if columns is not None else diagonals).shape[1]
    out = torch.zeros(seq.batch, heads, nqb, nkb, dtype=torch.bool)
    for b in range(seq.batch):
        first = int(seq.q_start[b]) // bs
        for h in range(heads):
            for t in range(nqb):
                for p in range((first + t) * bs, min((first + t + 1) * bs, cap)):
                    for j in range(p + 1):
                        col = columns is not None and bool(columns[min(b, columns.shape[0] - 1), h, j])
                        dia = diagonals is not None and bool(diagonals[min(b, diagonals.shape[0] - 1), h, p - j])
                        if col or dia:
                            out[b, h, t, j // bs] = True
    return out


@pytest.mark.parametrize("name", list(SEQS))
@pytest.mark.parametrize("which", ["both", "columns", "diagonals"])
def test_lines_to_layout_is_exact(name, which):
    seq, bs = SEQS[name](), 8
    g = torch.Generator().manual_seed(3)
    cap = seq.kv_capacity
    columns = torch.rand(seq.batch, 2, cap, generator=g) > 0.85 if which != "diagonals" else None
    diagonals = torch.rand(seq.batch, 2, cap, generator=g) > 0.8 if which != "columns" else None
    if diagonals is not None:
        diagonals[:, :, :3] = True  # a local band: some blocks wholly covered by diagonals
        diagonals[0, 1, 8:24] = True  # and every offset of a whole off-diagonal block
    if columns is not None:
        columns[0, 0, 16:24] = True  # one key block wholly covered by columns
    layout = lines_to_layout(seq, bs, columns=columns, diagonals=diagonals)
    assert layout.num_heads == 2
    expected = _lines_definition(seq, columns, diagonals)
    _check_exact(layout, seq, expected.expand(seq.batch, 2, -1, -1), 2)
    assert torch.equal(layout.blocks, _blocks_crossed(seq, columns, diagonals, bs))
    # a whole (not partial) block has every causal pair of every position of its tile visible
    whole = layout.blocks & ~layout.partial_blocks()
    assert whole.any(), "the planted full columns / diagonals should give whole blocks"
    if name == "dense":
        q_pos, kv = _positions(seq)
        visible = expected | (kv > q_pos)
        for b, h, t, n in whole.nonzero().tolist():
            assert visible[b, h, t * bs : (t + 1) * bs, n * bs : (n + 1) * bs].all(), (b, h, t, n)


def test_lines_to_layout_hand_computed():
    """16 tokens, blocks of 4, one head: column 1 and the main diagonal only."""
    seq = SeqInfo.dense(1, 16, 16)
    columns = torch.zeros(1, 1, 16, dtype=torch.bool)
    columns[0, 0, 1] = True
    diagonals = torch.zeros(1, 1, 16, dtype=torch.bool)
    diagonals[0, 0, 0] = True
    layout = lines_to_layout(seq, 4, columns=columns, diagonals=diagonals)
    # every tile: key block 0 (column 1) and its own diagonal block; all of them partial
    assert layout.blocks[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    assert torch.equal(layout.partial_blocks(), layout.blocks)
    assert computed_pairs(layout, seq).item() == 15 + 16 - 1  # key 1 for positions 1..15, each p -> p, (1, 1) once
    # offsets 0..3 all selected: the diagonal blocks become whole
    diagonals[0, 0, :4] = True
    layout = lines_to_layout(seq, 4, diagonals=diagonals)
    diag = torch.eye(4, dtype=torch.bool)
    assert torch.equal(layout.blocks[0, 0], diag | torch.eye(4, dtype=torch.bool).roll(-1, 1).tril())
    assert torch.equal(layout.partial_blocks()[0, 0], layout.blocks[0, 0] & ~diag)


def test_lines_to_layout_shared_heads_and_errors():
    seq = SEQS["padded"]()
    columns = torch.zeros(1, 1, 45, dtype=torch.bool)
    columns[0, 0, [0, 7, 30]] = True
    layout = lines_to_layout(seq, 8, columns=columns)  # one selection for every sample and head
    expected = _lines_definition(seq, columns, None).expand(2, 3, -1, -1)
    _check_exact(layout, seq, expected, 3)
    with pytest.raises(ValueError, match="columns, diagonals or both"):
        lines_to_layout(seq, 8)
    with pytest.raises(ValueError, match=r"diagonals must be \(batch or 1, heads, kv_capacity=45\) bool"):
        lines_to_layout(seq, 8, diagonals=torch.zeros(1, 1, 44, dtype=torch.bool))
    with pytest.raises(ValueError, match="same heads"):
        lines_to_layout(seq, 8, columns=columns, diagonals=torch.zeros(1, 2, 45, dtype=torch.bool))


def test_lines_to_layout_columns_shared_by_the_batch_with_their_own_heads():
    """Columns of shape (1, H, Sk) with H != batch: one selection per head, shared by both samples."""
    seq = SEQS["padded"]()
    columns = torch.zeros(1, 3, 45, dtype=torch.bool)
    columns[0, 0, [0, 7]] = True
    columns[0, 1, 30] = True
    columns[0, 2, 16:24] = True  # head 2: key block 2 whole
    layout = lines_to_layout(seq, 8, columns=columns)
    assert layout.num_heads == 3
    _check_exact(layout, seq, _lines_definition(seq, columns, None).expand(2, 3, -1, -1), 3)
    assert torch.equal(layout.blocks, _blocks_crossed(seq, columns, None, 8))


# -- key blocks and per-row selections --------------------------------------------------------------


@pytest.mark.parametrize("name", list(SEQS))
@pytest.mark.parametrize("key_block_size", [8, 16])
def test_key_blocks_to_layout_is_exact(name, key_block_size):
    seq, bs = SEQS[name](), 8
    g = torch.Generator().manual_seed(1)
    groups = -(-seq.kv_capacity // key_block_size)
    selected = torch.rand(seq.batch, 3, seq.num_query_blocks(bs), groups, generator=g) > 0.5
    layout = key_blocks_to_layout(selected, seq, bs, key_block_size=key_block_size)
    q_pos, kv = _positions(seq)
    tile = (q_pos // bs - seq.q_block_start(bs)[:, None, None, None]).clamp(0, selected.shape[2] - 1)
    picked = torch.gather(selected, 2, tile.expand(-1, 3, -1, groups))  # (B, H, Sq, G): the row's tile's row
    expected = torch.gather(picked, 3, (kv // key_block_size).expand(seq.batch, 3, seq.q_len, -1)) & (kv <= q_pos)
    _check_exact(layout, seq, expected, 3)
    assert layout.token_mask is None


def test_key_blocks_to_layout_errors():
    seq = SEQS["dense"]()
    with pytest.raises(ValueError, match="key_block_size=12 must be a positive multiple of block_size=8"):
        key_blocks_to_layout(torch.zeros(2, 1, 6, 4, dtype=torch.bool), seq, 8, key_block_size=12)
    with pytest.raises(ValueError, match="has 2 key groups of 16 keys; kv_capacity 45 needs 3"):
        key_blocks_to_layout(torch.zeros(2, 1, 6, 2, dtype=torch.bool), seq, 8, key_block_size=16)


@pytest.mark.parametrize("name", list(SEQS))
@pytest.mark.parametrize("key_block_size", [8, 16])
def test_row_selection_layout_is_exact(name, key_block_size):
    seq, bs = SEQS[name](), 8
    g = torch.Generator().manual_seed(2)
    groups = -(-seq.kv_capacity // key_block_size)
    selected = torch.rand(seq.batch, 2, seq.q_len, groups, generator=g) > 0.6
    selected[:, 0, :, 0] = True  # a key group every row selects: whole blocks below the diagonal
    layout = row_selection_layout(selected, seq, bs, key_block_size=key_block_size)
    q_pos, kv = _positions(seq)
    expected = torch.gather(selected, 3, (kv // key_block_size).expand(seq.batch, 2, seq.q_len, -1)) & (kv <= q_pos)
    _check_exact(layout, seq, expected, 2)
    # a whole block: every real row of the tile selects its key group
    union, common, occupied = tile_union(selected, seq, bs)
    for b, h, t, n in (layout.blocks & ~layout.partial_blocks()).nonzero().tolist():
        assert bool(common[b, h, t, n * bs // key_block_size]) and bool(occupied[b, t])
    assert not (layout.blocks & ~union[..., torch.arange(layout.blocks.shape[-1]) * bs // key_block_size]).any()


def test_tile_union_hand_computed():
    """Tiles of 4; chunked prefill from position 2 (tile 0 holds rows 0-1), 7 rows, 3 key groups."""
    seq = SeqInfo(torch.tensor([2]), torch.tensor([9]), 7, 9)
    rows = [[1, 0, 0], [1, 1, 0], [1, 0, 0], [0, 0, 1], [1, 0, 1], [1, 0, 1], [0, 1, 0]]
    selected = torch.tensor(rows, dtype=torch.bool).view(1, 1, 7, 3)
    union, common, occupied = tile_union(selected, seq, 4)
    # tile 0 = positions 0-3: rows 0, 1 (positions 2, 3); tile 1 = rows 2-5; tile 2 = row 6 (position 8)
    assert union[0, 0].int().tolist() == [[1, 1, 0], [1, 0, 1], [0, 1, 0]]
    assert common[0, 0].int().tolist() == [[1, 0, 0], [0, 0, 0], [0, 1, 0]]
    assert occupied[0].tolist() == [True, True, True]
