"""Vertical-slash attention: key columns and diagonals chosen from the last queries' attention.

An example third-party elasticfw plugin (docs/tutorials/write-a-data-dependent-mode.md), written
with elasticfw's public building blocks. Source: MInference (Jiang et al., 2024, arXiv
2407.02490), ``vertical_slash_sparse_attention``: the attention of the last 64 queries of the
prompt is summed per key column (*vertical lines*) and per diagonal (*slash lines*, offset
``d = position - key``); the first 30 columns and the last 100 diagonals are always kept; the
top ``vertical_size`` columns and ``slash_size`` diagonals are kept, those forced ones included.

Precisely, per sample and KV head (the query heads of a GQA group share one pattern, their
probabilities averaged, or maxed with ``head_reduce: max``):

* the estimating rows are the sample's last ``last_queries`` real query rows (all of them if the
  call has fewer: a decode step estimates from its single row); each puts
  ``softmax(scale * q . k_j)`` on its causal real keys ``j``, in float32;
* ``vertical[j]`` is the probability summed over those rows, ``slash[d]`` the probability on the
  pairs (position ``p``, key ``p - d``);
* columns: the first ``sink_columns`` real keys, plus the best other real keys by ``vertical``
  up to ``vertical_size`` in all; diagonals: offsets ``0 .. local_diagonals - 1``, plus the best
  other offsets ``d < kv_len`` by ``slash`` up to ``slash_size`` in all; ties go to the lower
  index;
* key ``j`` is visible to position ``p`` iff ``j <= p`` and (``j`` is a kept column or ``p - j``
  a kept diagonal).

The selection reads the whole prompt (its last queries), so a row's output may change when later
tokens change: the mode is causal in its mask, not in its selection (the conformance suite's
``causality = "prompt"``).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from elasticfw import hookimpl
from elasticfw.attention.layout import BlockLayout
from elasticfw.attention.mode import AttentionMode, ModeConfig
from elasticfw.attention.pattern_layouts import lines_to_layout
from elasticfw.attention.patterns import column_mass, diagonal_mass, last_query_attention, topk_select
from elasticfw.attention.seq import SeqInfo


class VerticalSlashConfig(ModeConfig):
    name: Literal["vertical_slash"] = "vertical_slash"
    block_size: int = Field(64, ge=16, description="Block size of the layout, in tokens.")
    last_queries: int = Field(
        64, ge=1, description="Last query rows of the prompt whose attention estimates the lines; MInference: 64."
    )
    vertical_size: int = Field(1000, ge=1, description="Key columns kept, the sink columns included.")
    slash_size: int = Field(6096, ge=1, description="Diagonals kept, the local diagonals included.")
    sink_columns: int = Field(30, ge=0, description="First keys every query keeps (MInference: 30).")
    local_diagonals: int = Field(
        100, ge=0, description="Diagonals 0 .. local_diagonals-1 every query keeps, its own key included (MInference: 100)."
    )
    head_reduce: Literal["mean", "max"] = Field(
        "mean", description="How the query heads of a GQA group combine their estimates into one pattern per KV head."
    )


class VerticalSlashAttention(AttentionMode):
    """MInference's vertical-slash pattern: key columns and diagonals picked by the last queries."""

    name = "vertical_slash"
    config_class = VerticalSlashConfig
    config: VerticalSlashConfig

    def select_lines(
        self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, *, scale: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Hkv, Sk) bool each: the kept key columns and the kept diagonals (by offset)."""
        cfg = self.config
        est = last_query_attention(q, k, seq, last=cfg.last_queries, scale=scale, group=cfg.head_reduce)
        index = torch.arange(seq.kv_capacity, device=q.device)
        real = seq.key_valid()[:, None]  # (B, 1, Sk): real keys, and the offsets a sample can have
        columns = topk_select(
            column_mass(est), cfg.vertical_size, candidates=real, forced=real & (index < cfg.sink_columns)
        )
        diagonals = topk_select(
            diagonal_mass(est), cfg.slash_size, candidates=real, forced=real & (index < cfg.local_diagonals)
        )
        return columns, diagonals

    def build_layout(
        self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, *, scale: float | None = None
    ) -> BlockLayout:
        seq.check(q, k)
        columns, diagonals = self.select_lines(q, k, seq, scale=scale)
        return lines_to_layout(seq, self.config.block_size, columns=columns, diagonals=diagonals)


@hookimpl
def elasticfw_register_sparse_modes(register):
    register(VerticalSlashAttention)
