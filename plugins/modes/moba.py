"""MoBA: mixture of block attention — each query attends to its top-k key blocks.

Sources: MoBA (Lu et al., 2025, arXiv 2502.13189) and MoonshotAI/MoBA's
``moba/moba_naive.py::moba_attn_varlen_naive``; defaults from Elastic Attention (arXiv 2601.17367)
Table 6: MoBA block 1024, top-k 8. Keys are cut into MoBA blocks of ``moba_block_size`` tokens (a
multiple of ``block_size``); the gate of a query for block ``n`` is ``q · mean(K_n)`` in float32
over the block's real keys (a GQA group gates against its KV head). The query's current block is
always selected and attended causally; only blocks that end before it are candidates; ``top_k``
counts the current block; ties go to the lower block. ``query_granularity``: ``token`` (default;
upstream's per-token selection, carried as a row selection) or ``block`` (one selection per layout
tile, gated with the mean of its real queries: exact at tile granularity, not token-causal).
``decode: full`` (default) runs a call of one query row as full attention, as upstream does;
``decode: sparse`` gates it. ``planner``: the fused kernel (:mod:`elasticfw.kernels.moba_select`)
on CUDA, torch elsewhere. The semantics in full: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, model_validator

from elasticfw.attention.layout import BlockLayout, causal_layout
from elasticfw.attention.mode import AttentionMode, ModeConfig, causal_density
from elasticfw.attention.pattern_layouts import (
    key_blocks_to_layout,
    row_selection_layout,
    row_selection_layout_from_tiles,
)
from elasticfw.attention.patterns import gate_scores, mean_pool_keys, pool_tiles, query_grid, topk_select
from elasticfw.attention.seq import SeqInfo
from elasticfw.kernels import choose_backend

#: query rows gated at once (bounds the float32 gate scores at B x Hq x chunk x n_moba_blocks)
GATE_CHUNK = 4096


class MobaConfig(ModeConfig):
    name: Literal["moba"] = "moba"
    moba_block_size: int = Field(
        1024,
        ge=1,
        description="Tokens per MoBA key block, the unit the gate scores and selects; paper: 1024.",
    )
    top_k: int = Field(
        8, ge=1, description="MoBA blocks each query attends to, its own (current) block included; paper: 8."
    )
    block_size: int = Field(
        64,
        ge=1,
        description="Block size (tile) of the layout given to executors; must divide moba_block_size.",
    )
    query_granularity: Literal["token", "block"] = Field(
        "token",
        description="`token`: one selection per query token (upstream MoBA); `block`: one selection per "
        "layout tile, gated by the mean of the tile's queries.",
    )
    planner: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="Planning backend of granularity `token`: `auto` runs the fused Triton kernel on CUDA when "
        "it can run there and the PyTorch reference elsewhere; `torch` always the reference; `triton` always "
        "the kernel (an error where it cannot run). Same selection up to float32 rounding of the gates. "
        "Granularity `block` always plans in PyTorch (already cheap).",
    )
    decode: Literal["full", "sparse"] = Field(
        "full",
        description="A call of one query row (a decode step): `full` attends every earlier key, as upstream "
        "MoBA decodes (its `moba_layer` runs FlashAttention when q_len != kv_len); `sparse` gates and selects "
        "for that one query, as in prefill (granularity `token`: the very selection of that token's prefill row).",
    )

    @model_validator(mode="after")
    def _block_multiple(self) -> MobaConfig:
        if self.moba_block_size % self.block_size:
            raise ValueError(
                f"moba_block_size={self.moba_block_size} must be a multiple of block_size={self.block_size} "
                "(a MoBA block must be a whole number of layout blocks)"
            )
        return self


class MobaAttention(AttentionMode):
    """Mixture of block attention (MoBA): per-query top-k key blocks scored against mean-pooled keys."""

    name = "moba"
    config_class = MobaConfig
    config: MobaConfig

    def planning_backend(self, q: torch.Tensor, num_blocks: int) -> Literal["torch", "triton"]:
        """The backend the token-granular planner uses for ``q`` among ``num_blocks`` MoBA blocks
        (``planner`` resolved on its device): ``auto`` picks the Triton kernel on CUDA when it can
        run, torch elsewhere (never the interpreter on a CPU); a pinned ``triton`` that cannot run
        raises :class:`~elasticfw.errors.BackendUnavailableError`."""
        def why_not() -> str | None:
            from elasticfw.kernels.moba_select import unsupported

            return unsupported(q, num_blocks=num_blocks)

        return choose_backend(self.config.planner, q.device, why_not, mode="moba", field="planner", label="MoBA")

    def num_blocks(self, seq: SeqInfo) -> int:
        """The MoBA blocks of ``seq``'s keys (as :func:`key_block_means` cuts them)."""
        return math.ceil(seq.kv_capacity / self.config.moba_block_size)

    def selects_every_block(self, seq: SeqInfo) -> bool:
        """Whether ``top_k`` is at least the MoBA blocks of ``seq``: every block up to a query's own
        is then selected whatever the gates, and the layout is the dense causal one without gating
        (the same pairs, exactly; NSA's method of the same name decides the same for ``top_n``)."""
        return self.config.top_k >= self.num_blocks(seq)

    def dense_at(self, seq: SeqInfo) -> bool:
        """:meth:`selects_every_block` (every block up to a query's own is every causal key), or a
        decode step (one query row) under ``decode: full``."""
        return self.selects_every_block(seq) or (self.config.decode == "full" and seq.q_len == 1)

    def expected_density(self, length: int) -> float:
        """Which blocks depend on the gates, but not how many: the query at ``p`` (MoBA block
        ``c = p // moba_block_size``) reads its own block up to ``p`` and ``min(top_k - 1, c)`` whole
        earlier blocks. Exact for ``query_granularity: token``; an estimate for ``block`` (a tile's
        selection counted per token the same way)."""
        size = self.config.moba_block_size
        p = torch.arange(length, dtype=torch.float64)
        current = torch.div(p, size, rounding_mode="floor")
        return causal_density(p - current * size + 1 + current.clamp(max=self.config.top_k - 1) * size)

    def build_layout(self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo) -> BlockLayout:
        seq.check(q, k)
        num_blocks = self.num_blocks(seq)
        if self.dense_at(seq):  # whatever the gates: full attention (a pinned planner that cannot run still fails)
            if self.config.query_granularity == "token":
                self.planning_backend(q, num_blocks)
            return causal_layout(seq, self.config.block_size)
        if self.config.query_granularity == "token":
            return self._token_layout(q, k, seq, num_blocks)
        return self._block_layout(q, k, seq, num_blocks)

    # -- granularity "token" ------------------------------------------------------------------
    def _token_layout(self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, nmb: int) -> BlockLayout:
        cfg = self.config
        moba = cfg.moba_block_size
        batch, hq, sq, _ = q.shape
        backend = self.planning_backend(q, nmb)  # a pinned planner that cannot run fails, at every length
        current = torch.div(seq.query_positions(), moba, rounding_mode="floor").clamp(0, nmb - 1)  # (B, Sq)
        real = seq.query_valid()  # (B, Sq): padding rows select nothing
        means = key_block_means(k, seq, moba)
        if backend == "triton":
            from elasticfw.kernels.moba_select import moba_token_selection_triton

            selected, union, common = moba_token_selection_triton(
                q, means, seq, moba_block_size=moba, top_k=cfg.top_k, block_size=cfg.block_size
            )
            return row_selection_layout_from_tiles(
                selected, union, common, seq, cfg.block_size, key_block_size=moba
            )
        selected = torch.zeros(batch, hq, sq, nmb, dtype=torch.bool, device=q.device)
        for start in range(0, sq, GATE_CHUNK):
            rows = slice(start, min(sq, start + GATE_CHUNK))
            cur = current[:, None, rows].expand(batch, hq, -1)
            chosen = select_blocks(gate_scores(q[:, :, rows], means), cur, cfg.top_k)
            selected[:, :, rows] = chosen & real[:, None, rows, None]
        return row_selection_layout(selected, seq, cfg.block_size, key_block_size=moba)

    # -- granularity "block" ------------------------------------------------------------------
    def _block_layout(self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, nmb: int) -> BlockLayout:
        cfg = self.config
        moba, bs = cfg.moba_block_size, cfg.block_size
        batch, hq = q.shape[:2]
        current = torch.div(seq.query_block_positions(bs) * bs, moba, rounding_mode="floor").clamp(0, nmb - 1)
        grid, valid = query_grid(q.float(), seq, bs)
        pooled = pool_tiles(grid, valid, bs, "mean")  # (B, Hq, NQB, D): the mean of each tile's real queries
        means = key_block_means(k, seq, moba)
        selected = select_blocks(gate_scores(pooled, means), current[:, None].expand(batch, hq, -1), cfg.top_k)
        occupied = valid.view(batch, -1, bs).any(-1)
        selected &= occupied[:, None, :, None]  # tiles without a real query compute nothing
        return key_blocks_to_layout(selected, seq, bs, key_block_size=moba)


# ---------------------------------------------------------------------------------------
# Building blocks: the public ones (elasticfw.attention.patterns), with MoBA's names
# ---------------------------------------------------------------------------------------

#: (B, Hkv, NMB, D) float32 mean of each MoBA block's real keys (zeros for a block without any)
key_block_means = mean_pool_keys


def select_blocks(gates: torch.Tensor, current: torch.Tensor, top_k: int) -> torch.Tensor:
    """(..., NMB) bool: the ``current`` block plus the ``top_k - 1`` best candidates before it.

    ``gates`` is (..., NMB); ``current`` (...) is each query's own block. Candidates are the
    blocks ``n < current``; among equal gates the lower block index wins
    (:func:`~elasticfw.attention.patterns.topk_select` with the current block forced).
    """
    blocks = torch.arange(gates.shape[-1], device=gates.device)
    return topk_select(
        gates, top_k, candidates=blocks < current[..., None], forced=blocks == current[..., None]
    )
