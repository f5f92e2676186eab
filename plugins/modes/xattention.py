"""XAttention: block-sparse attention with antidiagonal scoring (XA).

Sources: XAttention (Xu et al., 2025, arXiv 2503.16428; mit-han-lab/x-attention, ``xattn_estimate``
and ``find_blocks_chunked``, select mode "inverse"); defaults from Elastic Attention (arXiv
2601.17367) Table 6: stride 16, threshold 0.9, block 64, chunk 16384. The method below is the
reference; upstream's chunking quirks are not copied. **Estimate** (float32): the antidiagonal
score ``A[m, n] = sum_{i<S} q[m*S + i] . k[n*S + S-1-i]`` of each strided tile, scaled by
``scale / S``, causal at strided granularity, soft-maxed over ``n`` and summed per (query block,
key block) into ``mass``; absent queries and padding keys are zero vectors, so only real rows
count. **Selection** per query block among the causal key blocks: block 0 and the diagonal
forced, the others by descending mass (ties: the lower index) while the kept mass is below
``threshold`` times the row's total, the crossing block included; ``threshold >= 1`` keeps every
causal block. ``decode: full`` (default) runs a call of one query row as full attention, as
upstream does. ``head_aggregation``: per query head (default) or per KV group. ``estimator``: the
fused kernels on CUDA. The estimate in full, the memory formulas and the Triton path:
``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, field_validator, model_validator

from elasticfw.attention.layout import BlockLayout, causal_layout
from elasticfw.attention.mode import AttentionMode, ModeConfig
from elasticfw.attention.patterns import (
    antidiagonal_mass,
    antidiagonal_scores,
    iter_antidiagonal_mass,
    reduce_groups,
    threshold_select,
)
from elasticfw.attention.seq import SeqInfo
from elasticfw.kernels import choose_backend

__all__ = ["XAttention", "XAttentionConfig", "antidiagonal_scores", "block_mass", "select_blocks"]


class XAttentionConfig(ModeConfig):
    name: Literal["xattention"] = "xattention"
    block_size: int = Field(
        64, ge=16, description="Block size of the layout and of the selection; paper: 64."
    )
    stride: int = Field(
        16,
        ge=1,
        description="Antidiagonal stride S: each S x S tile of QK^T is scored by its antidiagonal sum.",
    )
    threshold: float = Field(
        0.9,
        description="Fraction tau of each query block's estimated attention mass the kept blocks must cover, "
        "in (0, 1]; 1.0 keeps every causal block.",
    )
    head_aggregation: Literal["query", "kv_group"] = Field(
        "query",
        description="`query`: select per query head (upstream; Hq-head layout); `kv_group`: sum the masses of a "
        "KV group's query heads and select once per KV head (Hkv-head layout).",
    )
    chunk_size: int = Field(
        16384,
        ge=1,
        description="Query positions estimated at once (a multiple of block_size); bounds memory, never changes "
        "the result. Paper: 16384.",
    )
    estimator: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="Planning backend (estimate and selection): `auto` runs the fused Triton kernels on CUDA "
        "when they can run there and the PyTorch reference elsewhere; `torch` always the reference; `triton` "
        "always the kernels (an error where they cannot run). Same masses up to float32 summation order.",
    )
    decode: Literal["full", "sparse"] = Field(
        "full",
        description="A call of one query row (a decode step): `full` attends every earlier key, as upstream "
        "XAttention decodes (dense decode attention; XAttention prunes the prefill); `sparse` estimates and "
        "selects blocks from that one query, as in prefill.",
    )

    @field_validator("threshold")
    @classmethod
    def _threshold_range(cls, value: float) -> float:
        if not (0.0 < value <= 1.0) or math.isnan(value):
            raise ValueError(
                f"threshold must be in (0, 1] (fraction of attention mass the kept blocks cover; 1.0 keeps "
                f"every causal block), got {value}"
            )
        return value

    @model_validator(mode="after")
    def _divisibility(self) -> XAttentionConfig:
        if self.block_size % self.stride:
            raise ValueError(
                f"block_size={self.block_size} must be a multiple of stride={self.stride}: the (block/stride)^2 "
                "antidiagonal groups of a block must tile it exactly"
            )
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size={self.chunk_size} must be a multiple of block_size={self.block_size} "
                "(the estimate is chunked over whole query blocks)"
            )
        return self


# ---------------------------------------------------------------------------------------
# Estimation and selection: the public building blocks (elasticfw.attention.patterns)
# ---------------------------------------------------------------------------------------

#: the estimate (module docstring), public as :func:`elasticfw.attention.patterns.antidiagonal_mass`
block_mass = antidiagonal_mass


def select_blocks(mass: torch.Tensor, row_block: torch.Tensor, threshold: float) -> torch.Tensor:
    """Threshold selection: bool like ``mass`` (B, H, T, NKB); ``row_block`` (B, T) absolute position block.

    :func:`~elasticfw.attention.patterns.threshold_select` over the causal blocks (``<= row_block``)
    with key block 0 and the diagonal forced: the other causal blocks in descending mass (ties:
    lower index first) while the cumulative kept mass *before* adding a block is below
    ``threshold * row_total`` (the crossing block is kept). ``threshold >= 1`` keeps every causal
    block.
    """
    kb = torch.arange(mass.shape[-1], device=mass.device)
    diag = row_block[:, None, :, None]
    causal = kb <= diag  # (B, 1, T, NKB)
    return threshold_select(mass, threshold, allowed=causal, forced=(kb == 0) | (kb == diag))


class XAttention(AttentionMode):
    """Block-sparse attention whose blocks are chosen by antidiagonal scoring (XAttention, "inverse")."""

    name = "xattention"
    config_class = XAttentionConfig
    config: XAttentionConfig

    def planning_backend(self, q: torch.Tensor) -> Literal["torch", "triton"]:
        """The backend :meth:`build_layout` uses for ``q`` (``estimator`` resolved on its device):
        ``auto`` picks the Triton kernels on CUDA when they can run, torch elsewhere; a pinned
        ``triton`` that cannot run raises :class:`~elasticfw.errors.BackendUnavailableError`."""
        def why_not() -> str | None:
            from elasticfw.kernels.xattention_estimate import unsupported

            return unsupported(q, block_size=self.config.block_size, stride=self.config.stride)

        return choose_backend(
            self.config.estimator, q.device, why_not, mode="xattention", field="estimator", label="XAttention"
        )

    def expected_density(self, length: int) -> float:
        """No estimate from the config: how many blocks reach ``threshold`` of the attention mass
        depends on the input alone, so this is 1.0 (counted as dense). Set the recipe's ``cost`` to
        ``1 - ESR`` measured on the task (e.g. the ``esr`` of ``elasticfw eval`` with every head in this mode:
        router ``fixed``, ``assign: all_sparse``)."""
        return 1.0

    def dense_at(self, seq: SeqInfo) -> bool:
        """``threshold >= 1`` (every causal block explicitly), at most two key blocks (key block 0
        and the diagonal, both always kept, are then every causal block), or a decode step (one
        query row) under ``decode: full``."""
        cfg = self.config
        return (
            cfg.threshold >= 1.0
            or seq.num_key_blocks(cfg.block_size) <= 2
            or (cfg.decode == "full" and seq.q_len == 1)
        )

    def build_layout(
        self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, *, scale: float | None = None
    ) -> BlockLayout:
        cfg = self.config
        bs = cfg.block_size
        seq.check(q, k)
        if self.dense_at(seq):
            if cfg.threshold < 1.0:  # a short prompt: a pinned estimator that cannot run still fails
                self.planning_backend(q)
            return causal_layout(seq, bs)
        backend = self.planning_backend(q)
        batch, hq = q.shape[:2]
        hkv = k.shape[1]
        by_group = cfg.head_aggregation == "kv_group"
        heads = hkv if by_group else hq
        nqb, nkb = seq.num_query_blocks(bs), seq.num_key_blocks(bs)
        blocks = torch.zeros(batch, heads, nqb, nkb, dtype=torch.bool, device=q.device)
        qbs = seq.q_block_start(bs)
        chunks = iter_antidiagonal_mass(
            q, k, seq, block_size=bs, stride=cfg.stride, chunk_size=cfg.chunk_size, scale=scale, backend=backend
        )
        if backend == "triton":
            from elasticfw.kernels.xattention_select import select_blocks_triton

            first_max = int(qbs.max().item()) if batch else 0
        for t0, t1, mass in chunks:
            if by_group:
                mass = reduce_groups(mass, hkv, "sum")
            row_block = qbs[:, None] + torch.arange(t0, t1, device=q.device)[None, :]
            if backend == "triton":
                select_blocks_triton(
                    mass, row_block, cfg.threshold, out=blocks[:, :, t0:t1], max_row_block=first_max + t1 - 1
                )
            else:
                blocks[:, :, t0:t1] = select_blocks(mass, row_block, cfg.threshold)
        return BlockLayout(blocks, bs)
