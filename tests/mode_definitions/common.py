"""Helpers shared by the token-level definitions (positions and causality only)."""

from __future__ import annotations

import torch

from elasticfw.attention.seq import SeqInfo

DEFINITION = None  # helpers, not a mode


def positions(seq: SeqInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 1, Sq, 1) query positions and (1, 1, 1, Sk) key indices."""
    q_pos = seq.query_positions()[:, None, :, None]
    kv = torch.arange(seq.kv_capacity)[None, None, None, :]
    return q_pos, kv


def causal(seq: SeqInfo, num_heads: int) -> torch.Tensor:
    q_pos, kv = positions(seq)
    return (kv <= q_pos).expand(seq.batch, num_heads, seq.q_len, seq.kv_capacity)
