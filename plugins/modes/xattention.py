"""XAttention: block-sparse attention with antidiagonal scoring (XA).

Sources: XAttention (Xu et al., 2025, arXiv 2503.16428; mit-han-lab/x-attention, ``xattn_estimate``
and ``find_blocks_chunked``, select mode "inverse"); defaults from Elastic Attention
(arXiv 2601.17367) Table 6: stride 16, threshold 0.9, block 64, chunk 16384, selection "inverse".
The method below is the reference; upstream's chunking quirks (only the diagonal forced in the
first chunk, earlier chunks masked when the keys need no padding) are deliberately not copied.

**Estimate** (all in float32, whatever the input dtype). Lay the queries of each sample on the
position grid (row ``r`` of the grid is position ``r``; grid rows that hold no real query of the
sample are zero vectors) and the keys start-aligned (keys ``>= kv_len`` are zero vectors). For
stride ``S`` the antidiagonal score of the ``S x S`` tile (strided query row ``m``, strided key
``n``) is::

    A[m, n] = sum_{i=0}^{S-1} q[m*S + i] . k[n*S + S-1-i]

computed as one matmul between queries concatenated ``S`` at a time in reverse order and keys
concatenated ``S`` at a time. Scores are scaled by ``scale / S`` (the call's attention scale,
``1 / sqrt(d)`` by default), masked causally at
strided granularity (keep ``n <= m``), soft-maxed over ``n`` and summed into
``(block/S) x (block/S)`` groups: ``mass[M, N]`` is the probability that the strided rows of
position block ``M`` put on key block ``N``. A strided row contributes only if it holds at least
one real query of the sample; its other (absent) query positions are zero vectors. So an
unaligned first block of a chunked prefill and a single decode query (``decode: sparse``) are
estimated from the real query rows present, and padding (keys past ``kv_len``, rows past the sample's end) never
reaches a real row's estimate. The strided diagonal tile may read keys later in the same
``S``-tile (hence the same block): the estimate is causal at block granularity, not per token.

**Selection** per (sample, head, query block ``M``), among causal key blocks ``N <= M``: key
block 0 and the diagonal block ``M`` are always kept; the other causal blocks are visited in
descending mass (ties: lower block index first) and block ``c_j`` is kept iff
``forced_mass + sum_{i<j} mass(c_i) < threshold * row_total``, i.e. blocks are added while the
cumulative mass is still below the target, *and the block that crosses it is included*
(upstream's rule). ``row_total`` is the row's summed mass (its number of real strided rows).
``threshold >= 1`` keeps every causal block explicitly, so rounding in cumulative sums can
never drop a block in the dense limit; that layout is marked ``dense_causal``.

**Decode.** Upstream XAttention prunes the prefill and decodes with dense attention
(``flashinfer.single_decode_with_kv_cache`` for a one-token query). ``decode: full`` (default) does
the same: a call of one query row is full attention over every earlier key (:meth:`dense_at`), no
estimate. ``decode: sparse`` estimates and selects from that query, as above.

**Heads.** Routing in Elastic Attention is per KV head, but XAttention selects per query head
(upstream repeats K/V). ``head_aggregation: query`` (default) returns one layout per query head
(``Hq`` heads); the query heads of a KV group then share the routing decision but not the block
pattern. ``kv_group`` sums the masses of a group's query heads before selecting and returns one
layout per KV head (``Hkv`` heads), shared by the group (a single pattern per routing unit).

**Memory.** The estimate is chunked over ``chunk_size`` query positions (``C = chunk_size``,
``Sk'`` = key capacity rounded up to a block, ``NQB``/``NKB`` layout rows/columns). Beyond the
inputs, the torch path's peak bytes are about::

    4*B*Hkv*Sk'*d                      float32 key copy (padding zeroed)
  + 4*B*Hq*(C/S)*(Sk'/S)               one float32 score tile per chunk, soft-maxed in place
  + 8*B*Hq*C*d                         the chunk's gathered and tile-reversed queries
  + ~30*B*Hq*(C/bs)*NKB                mass, sort values and indices of the chunk's rows
  + B*H*NQB*NKB                        the bool layout

e.g. 128K tokens, B=1, Hq=32, Hkv=8, d=128, S=16, bs=64, C=16384: 0.5 GiB keys + 1 GiB scores
+ 0.5 GiB queries + 0.5 GiB selection + 0.125 GiB layout (about 2.6 GiB; halve C to halve the
chunk terms). Keys are trimmed per chunk to the chunk's last causal block, so early chunks
cost less. The result does not depend on ``chunk_size``.

**Triton path** (``estimator``: ``auto`` on CUDA, or ``triton``): the fused estimator of
:mod:`elasticfw.kernels.xattention_estimate` reads ``q`` and ``k`` in place and in their dtype
(bfloat16 and float16 products are exact in float32 accumulation; float32 inputs are multiplied
in IEEE float32), in one pass over the strided scores (each row's block sums kept relative to
its running softmax maximum, rescaled once the row is done; no score tile is stored), and
:mod:`elasticfw.kernels.xattention_select` selects with a bisection over the masses' float32 bit
patterns per row (no sort) in one Triton program. Beyond the inputs it holds::

    4*B*Hq*(C/S)*NKB                   the chunk's per-row block sums (float32 scratch)
  + 4*B*Hq*(C/bs)*NKB                  the chunk's mass
  + B*H*NQB*NKB                        the bool layout

(128K with the sizes above: 256 MiB + 64 MiB + 128 MiB). Its masses equal the torch path's up to
float32 summation order; a block whose cumulative mass lies within rounding of the threshold
can therefore be decided differently (as between the torch path on a CPU and on a GPU).
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
