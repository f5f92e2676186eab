"""A 1-head layout means one pattern for every head: its token mask must never be called with a
query-head index (the trap behind an IndexError on decode shapes)."""

from __future__ import annotations

import torch

from elasticfw.attention.layout import BlockLayout, block_grid, broadcast_heads, dense_mask, expand_heads
from elasticfw.attention.seq import SeqInfo


def _one_head_layout(seq: SeqInfo, bs: int, keep: torch.Tensor) -> BlockLayout:
    """All causal blocks, refined by a token mask read from ``keep`` (B, 1, Sk, Sk): indexed by head,
    so a head index >= 1 would be out of range."""
    q_blocks, k_blocks = block_grid(seq, bs)
    blocks = (k_blocks <= q_blocks)[:, None]
    partial = blocks.clone()

    def token_mask(b, h, q, k):  # type: ignore[no-untyped-def]
        return keep[b, h, q, k]

    return BlockLayout(blocks, bs, token_mask=token_mask, partial=partial)


def test_a_one_head_layout_applies_its_token_mask_to_every_head():
    g = torch.Generator().manual_seed(0)
    seq = SeqInfo.from_lengths(torch.tensor([37, 29]), 1, 40)  # decode shapes: one query row
    keep = torch.rand(2, 1, 40, 40, generator=g) > 0.5
    layout = _one_head_layout(seq, 8, keep)
    heads = 6
    mask = dense_mask(layout, seq, num_heads=heads)  # an IndexError before: heads 1..5 read keep[:, h]
    # the expected mask, built directly: causal, and keep[b, 0, position, key], for every head
    pos = seq.q_start[:, None] + torch.arange(seq.q_len)[None, :]  # (B, R)
    kv = torch.arange(40)
    want = (kv[None, None, :] <= pos[:, :, None]) & keep[torch.arange(2)[:, None, None], 0, pos[:, :, None], kv]
    assert mask.shape == (2, heads, 1, 40)
    assert torch.equal(mask, want[:, None].expand(2, heads, 1, 40))
    for expanded in (expand_heads(layout, heads), broadcast_heads(layout, heads)):
        h = torch.arange(heads)[None, :, None, None]
        b = torch.arange(2)[:, None, None, None]
        got = expanded.token_mask(b, h, pos[:, None, :, None], kv[None, None, None, :])
        assert torch.equal(got, keep[b, 0, pos[:, None, :, None], kv[None, None, None, :]].expand(2, heads, 1, 40))
