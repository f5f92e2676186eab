"""Strided attention: a local window of blocks plus every ``stride``-th block before it.

An example third-party elasticfw plugin (docs/tutorials/write-a-mode-plugin.md). It is
block-granular: with block size ``bs``, query block ``t`` computes key block ``n`` iff
``n <= t`` and (``t - n < local_blocks`` or ``(t - n) % stride == 0``), so key ``j`` is visible
to the query at position ``p`` iff ``j <= p`` and the block distance ``d = p // bs - j // bs``
satisfies ``d < local_blocks`` or ``d % stride == 0``. The pattern does not look at the data,
so every head and every sample share it. ``stride: 1`` keeps every causal block.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from elasticfw import hookimpl
from elasticfw.attention.layout import BlockLayout, block_grid
from elasticfw.attention.mode import AttentionMode, ModeConfig
from elasticfw.attention.seq import SeqInfo


class StridedConfig(ModeConfig):
    name: Literal["strided"] = "strided"
    block_size: int = Field(64, ge=16, description="Block size of the layout, in tokens.")
    stride: int = Field(
        4, ge=1, description="Keep every stride-th key block before the local window; 1 keeps every causal block."
    )
    local_blocks: int = Field(
        2, ge=1, description="Most recent key blocks every query block keeps, the diagonal included."
    )


class StridedAttention(AttentionMode):
    """Local blocks plus every stride-th earlier block (a dilated block pattern)."""

    name = "strided"
    config_class = StridedConfig
    config: StridedConfig

    def build_layout(self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo) -> BlockLayout:
        cfg = self.config
        q_blocks, k_blocks = block_grid(seq, cfg.block_size)  # (B, NQB, 1) position blocks, (1, 1, NKB)
        distance = q_blocks - k_blocks
        keep = (distance >= 0) & ((distance < cfg.local_blocks) | (distance % cfg.stride == 0))
        return BlockLayout(keep[:, None], cfg.block_size)  # (B, 1, NQB, NKB): one head, shared by all


@hookimpl
def elasticfw_register_sparse_modes(register):
    register(StridedAttention)
