"""Full (dense causal) attention: every causal (query, key) pair."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from elasticfw.attention.layout import BlockLayout, causal_layout
from elasticfw.attention.mode import AttentionMode, ModeConfig
from elasticfw.attention.seq import SeqInfo


class FullConfig(ModeConfig):
    name: Literal["full"] = "full"
    block_size: int = Field(64, ge=16, description="Block size of the (dense causal) layout; paper: 64.")


class FullAttention(AttentionMode):
    """Dense causal attention (the paper's FA / retrieval mode)."""

    name = "full"
    config_class = FullConfig
    layout_depends_on_inputs = False  # the layout is a function of seq and the config alone

    def dense_at(self, seq: SeqInfo) -> bool:
        return True

    def build_layout(self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo) -> BlockLayout:
        return causal_layout(seq, self.block_size)

    def expected_density(self, length: int) -> float:
        """Every causal pair: 1.0."""
        return 1.0
