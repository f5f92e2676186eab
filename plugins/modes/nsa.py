"""NSA-like sparse attention, training-free: top-n selected blocks + sliding window (+ optional
compressed keys), scored by parameter-free mean pooling.

Sources: NSA (Yuan et al., 2025, arXiv 2502.11089) §3.3, Eq. 7, 9 and 10; InfLLM-v2 (arXiv
2509.24663), fla-org's ``native-sparse-attention`` and XunhaoLai's ``native-sparse-attention-triton``
for mean pooling; defaults from Elastic Attention (arXiv 2601.17367) Table 6: block 64, top-k 128,
window 512, kernel 32, stride 16, and NSA's 1 initial and 2 local blocks. Nothing is learned:
compressed key ``m`` is the mean of keys ``[m*stride, m*stride + kernel)``, valid for position ``p``
iff ``m*stride + kernel <= p + 1``; a key block's importance is the softmax over the valid
compressed keys spread by overlap (Eq. 9), summed over the GQA group (Eq. 10) and, for
``query_granularity: block`` (default), over the layout tile's rows (block-causal; ``token``:
upstream's per-token selection, token-causal). The ``init_blocks`` first and ``local_blocks`` last
causal blocks are forced and count toward ``top_n``; ties go to the lower block; a token-exact
sliding ``window`` is OR'ed in; ``compression_branch`` adds the compressed keys, merged by
log-sum-exp. ``scorer``: the fused kernels (:mod:`elasticfw.kernels.nsa_importance`) on CUDA for
``block``. The rules in full and the cost of each granularity: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Literal

import torch
from pydantic import Field, model_validator

from elasticfw.attention.layout import BlockLayout, RowSelection, block_grid, causal_layout
from elasticfw.attention.mode import AttentionMode, AttentionOutput, ModeConfig, causal_density
from elasticfw.attention.pattern_layouts import tile_union
from elasticfw.attention.patterns import topk_select, window_means
from elasticfw.attention.seq import SeqInfo
from elasticfw.kernels import choose_backend


class NSAConfig(ModeConfig):
    name: Literal["nsa"] = "nsa"
    block_size: int = Field(
        64, ge=16, description="Selection block size, also the layout's block size; paper: 64."
    )
    top_n: int = Field(
        128,
        ge=1,
        description="Selected blocks per query block (or token), initial and local blocks included; paper Table 6: 128 "
        "(native NSA: 16).",
    )
    window: int = Field(
        512,
        ge=0,
        description="Sliding window in tokens (key j visible to position p iff p - window < j); 0 disables it.",
    )
    compress_kernel: int = Field(
        32, ge=1, description="Tokens mean-pooled into one compressed key; paper: 32."
    )
    compress_stride: int = Field(16, ge=1, description="Stride between compression windows; paper: 16.")
    init_blocks: int = Field(
        1, ge=0, description="Leading key blocks every query block (or token) keeps (NSA: 1)."
    )
    local_blocks: int = Field(
        2,
        ge=1,
        description="Most recent key blocks every query block (or token) keeps, the diagonal included "
        "(NSA: 2).",
    )
    compression_branch: bool = Field(
        False,
        description="Also attend to the valid mean-pooled compressed keys/values, merged by log-sum-exp "
        "(NSA's compression branch without its learned gate).",
    )
    query_granularity: Literal["token", "block"] = Field(
        "block",
        description="`block` (default): one selection per query block, scored by the sum of its rows' "
        "importances: what block kernels run at full speed, but block-causal, and a decode step may select "
        "other blocks than prefill. `token`: one selection per query token, as upstream NSA: token-causal, "
        "prefill and decode agree, but the tiles of the chosen blocks are token-masked (about 2x slower "
        "with flex at 32K) and an S^2/block_size table is kept.",
    )
    score_chunk: int = Field(
        512,
        ge=1,
        description="Query rows scored at once (bounds memory at chunk x S/stride scores per head).",
    )
    score_keys: Literal["input", "float32"] = Field(
        "input",
        description="Precision of the compressed keys the importance scores use (both scorers): `input` (default), "
        "the float32 window means rounded to the inputs' dtype, as a model computing in bfloat16 / float16 holds and "
        "scores them (NSA's own kernels score bfloat16 compressed keys), one tensor-core term for the Triton scorer; "
        "`float32`, the float32 means themselves (the Triton scorer reads them as two 16-bit terms, about 2^-18 "
        "relative): importances about 1e-3 closer to float32 arithmetic, for about 1.5x the planning time of "
        "16-bit inputs (0.18x against 0.12x a dense layer at 128K on an H200). Float32 inputs score the same "
        "either way.",
    )
    scorer: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="Importance backend of `query_granularity: block`: `auto` runs the fused Triton kernels on "
        "CUDA when they can run there (and autograd is not recording through q or k) and the PyTorch reference "
        "elsewhere; `torch` always the reference; `triton` always the kernels (an error where they cannot "
        "run). Same importances up to float32 rounding. `token` granularity always scores in PyTorch.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> NSAConfig:
        if self.compress_kernel % self.compress_stride:
            raise ValueError(
                f"compress_kernel={self.compress_kernel} must be a multiple of compress_stride="
                f"{self.compress_stride} (compression windows are whole stride steps)"
            )
        if self.block_size % self.compress_stride:
            raise ValueError(
                f"block_size={self.block_size} must be a multiple of compress_stride={self.compress_stride} "
                "(compressed scores are mapped onto selection blocks stride by stride)"
            )
        if self.top_n < self.init_blocks + self.local_blocks:
            raise ValueError(
                f"top_n={self.top_n} must be at least init_blocks + local_blocks = "
                f"{self.init_blocks} + {self.local_blocks} (the always-kept blocks count towards top_n)"
            )
        return self


#: (B, H, S, D) -> (B, H, M, D) float32 window means (:func:`elasticfw.attention.patterns.window_means`)
compress_mean = window_means


def window_valid(seq: SeqInfo, rows: slice, num_windows: int, kernel: int, stride: int) -> torch.Tensor:
    """(B, R, M) bool: compressed key ``m`` lies at or before the row's position and inside the sample."""
    pos = seq.query_positions()[:, rows]  # (B, R)
    limit = torch.minimum(pos + 1, seq.kv_len[:, None])
    ends = torch.arange(num_windows, device=seq.device) * stride + kernel
    return ends[None, None, :] <= limit[:, :, None]


def chunk_windows(
    seq: SeqInfo, chunk: int, num_windows: int, kernel: int, stride: int
) -> list[tuple[slice, int]]:
    """Query-row chunks and, for each, how many leading compressed keys any of its rows can see
    (causality bounds the rest; one host sync for all chunks)."""
    starts = list(range(0, seq.q_len, chunk))
    if not starts:
        return []
    last = torch.tensor([min(seq.q_len, s + chunk) - 1 for s in starts], device=seq.device)
    limit = torch.minimum(seq.q_start[:, None] + last[None, :] + 1, seq.kv_len[:, None]).amax(0)
    needed = (torch.div(limit - kernel, stride, rounding_mode="floor") + 1).clamp(0, num_windows)
    return [(slice(s, min(seq.q_len, s + chunk)), int(n)) for s, n in zip(starts, needed.tolist())]


def top_n_blocks(importance: torch.Tensor, current: torch.Tensor, cfg: NSAConfig) -> torch.Tensor:
    """(..., X, NKB) bool: for each of ``X`` query blocks or query tokens whose position block is
    ``current`` (broadcastable to (..., X, 1)), the causal blocks ``j <= current``: the
    ``init_blocks`` first and the ``local_blocks`` last, then the most important other causal blocks
    up to ``top_n`` in all (ties: the lower block), by :func:`~elasticfw.attention.patterns.topk_select`."""
    k_blocks = torch.arange(importance.shape[-1], device=importance.device)
    causal = k_blocks <= current
    forced = causal & ((k_blocks < cfg.init_blocks) | (k_blocks > current - cfg.local_blocks))
    return topk_select(importance, cfg.top_n, candidates=causal, forced=forced)


def window_blocks(seq: SeqInfo, bs: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, NQB, NKB) bool each: causal key blocks the sliding window reaches from some position of
    the tile (its first position sees the block's last key), and blocks wholly inside the window
    of every position of the tile (its last position sees the block's first key)."""
    q_blocks, k_blocks = block_grid(seq, bs)
    reach = ((k_blocks * bs + bs - 1) > q_blocks * bs - window) & (k_blocks <= q_blocks)
    inside = (k_blocks * bs) > (q_blocks * bs + bs - 1 - window)
    return reach, inside


class NSAAttention(AttentionMode):
    """Training-free NSA: group-consistent top-n block selection + sliding window (+ compressed keys)."""

    name = "nsa"
    config_class = NSAConfig
    config: NSAConfig

    # -- importance -------------------------------------------------------------------------
    def row_importance(
        self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, scale: float | None = None
    ) -> Iterator[tuple[slice, torch.Tensor]]:
        """Per chunk of query rows: ``(rows, (B, Hkv, R, NKB) float32)``, the compressed-attention
        importance of every key block for every row, summed over the group's query heads (zeros for
        padding rows and rows without a valid compressed key)."""
        cfg = self.config
        bs, kernel, stride = cfg.block_size, cfg.compress_kernel, cfg.compress_stride
        batch, hq, _, dim = q.shape
        hkv = k.shape[1]
        group = hq // hkv
        nkb = seq.num_key_blocks(bs)
        ck = compress_mean(k, kernel, stride)  # (B, Hkv, M, D)
        if cfg.score_keys == "input":  # the means as the inputs' dtype holds them (exact again in float32)
            ck = ck.to(k.dtype).float()
        num_windows = ck.shape[2]
        per_kernel = kernel // stride
        chunks = nkb * (bs // stride)  # stride-sized sub-chunks of the key blocks
        scale = scale if scale is not None else dim**-0.5  # the call's attention scale
        real = seq.query_valid()
        for rows, seen in chunk_windows(seq, cfg.score_chunk, num_windows, kernel, stride):
            nrows = rows.stop - rows.start
            if seen == 0:
                yield rows, torch.zeros(batch, hkv, nrows, nkb, dtype=torch.float32, device=q.device)
                continue
            qc = q[:, :, rows].float().reshape(batch, hkv, group, nrows, dim)
            scores = torch.einsum("bhgrd,bhmd->bhgrm", qc, ck[:, :, :seen]) * scale
            valid = window_valid(seq, rows, seen, kernel, stride)[:, None, None]  # (B,1,1,R,M')
            scores = scores.masked_fill(~valid, -math.inf)
            probs = torch.softmax(scores, dim=-1)
            usable = valid.any(-1, keepdim=True) & real[:, None, None, rows, None]
            probs = torch.where(usable, probs, torch.zeros_like(probs)).sum(2)  # (B, Hkv, R, M')
            # window m covers sub-chunks m .. m + kernel/stride - 1: weight overlap / stride per block
            padded = torch.nn.functional.pad(probs, (per_kernel - 1, chunks - seen))
            cover = padded[..., per_kernel - 1 : per_kernel - 1 + chunks]
            for a in range(1, per_kernel):
                cover = cover + padded[..., per_kernel - 1 - a : per_kernel - 1 - a + chunks]
            yield rows, cover.reshape(batch, hkv, nrows, nkb, bs // stride).sum(-1)  # (B, Hkv, R, NKB)

    def scoring_backend(self, q: torch.Tensor, k: torch.Tensor) -> Literal["torch", "triton"]:
        """The backend :meth:`block_importance` uses for ``q`` / ``k`` (``scorer`` resolved on their
        device): ``auto`` picks the Triton kernels on CUDA when they can run and autograd is not
        recording through ``q`` or ``k``, torch elsewhere; a pinned ``triton`` that cannot run raises
        :class:`~elasticfw.errors.BackendUnavailableError`."""
        cfg = self.config

        def why_not() -> str | None:
            from elasticfw.kernels.nsa_importance import unsupported

            return unsupported(q, block_size=cfg.block_size, kernel=cfg.compress_kernel, stride=cfg.compress_stride)

        recording = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        return choose_backend(
            cfg.scorer, q.device, why_not, mode="nsa", field="scorer", label="NSA", eligible=not recording
        )

    def block_importance(
        self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, scale: float | None = None
    ) -> torch.Tensor:
        """(B, Hkv, NQB, NKB) float32: compressed-attention importance of every key block for every
        layout tile, summed over the group's query heads and the tile's real rows. On the backend
        :meth:`scoring_backend` picks: the torch reference below (chunks of :meth:`row_importance`
        scattered into their tiles), or :func:`elasticfw.kernels.nsa_importance.nsa_block_importance_triton`
        (no gradient flows through it)."""
        cfg = self.config
        if self.scoring_backend(q, k) == "triton":
            from elasticfw.kernels.nsa_importance import nsa_block_importance_triton

            return nsa_block_importance_triton(
                q, k, seq, block_size=cfg.block_size, kernel=cfg.compress_kernel, stride=cfg.compress_stride,
                scale=scale, split=1 if cfg.score_keys == "input" else None,
            )
        bs = cfg.block_size
        batch, hkv = q.shape[0], k.shape[1]
        nqb, nkb = seq.num_query_blocks(bs), seq.num_key_blocks(bs)
        importance = torch.zeros(batch, hkv, nqb, nkb, dtype=torch.float32, device=q.device)
        tiles = torch.div(seq.query_positions(), bs, rounding_mode="floor") - seq.q_block_start(bs)[:, None]
        for rows, per_block in self.row_importance(q, k, seq, scale):
            nrows = rows.stop - rows.start
            idx = tiles[:, None, rows, None].clamp(0, max(nqb - 1, 0)).expand(batch, hkv, nrows, nkb)
            importance.scatter_add_(2, idx, per_block)
        return importance

    # -- selection ------------------------------------------------------------------------
    def select_blocks(self, importance: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
        """(B, Hkv, NQB, NKB) bool: per tile, initial + local blocks, then the most important causal
        blocks up to top_n."""
        q_blocks, _ = block_grid(seq, self.config.block_size)  # (B, NQB, 1)
        return top_n_blocks(importance, q_blocks[:, None], self.config)

    def token_selection(
        self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, scale: float | None = None
    ) -> torch.Tensor:
        """(B, Hkv, Sq, NKB) bool: per query token, initial + local blocks of its own position block,
        then the blocks most important to that token alone, up to top_n (granularity ``token``)."""
        bs = self.config.block_size
        batch, hkv, sq = q.shape[0], k.shape[1], q.shape[2]
        selected = torch.zeros(batch, hkv, sq, seq.num_key_blocks(bs), dtype=torch.bool, device=q.device)
        current = torch.div(seq.query_positions(), bs, rounding_mode="floor")  # (B, Sq)
        if self.selects_every_block(seq):  # no scoring: any importance selects every causal block
            blocks = torch.arange(selected.shape[-1], device=q.device)
            return (blocks <= current[:, None, :, None]).expand(selected.shape).contiguous()
        for rows, per_row in self.row_importance(q, k, seq, scale):
            selected[:, :, rows] = top_n_blocks(per_row, current[:, None, rows, None], self.config)
        return selected

    # -- layouts --------------------------------------------------------------------------
    def build_layout(
        self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, *, scale: float | None = None
    ) -> BlockLayout:
        seq.check(q, k)
        if self.dense_at(seq):  # whatever the importance: full attention (a pinned scorer that cannot run still fails)
            if self.config.query_granularity == "block":
                self.scoring_backend(q, k)
            return causal_layout(seq, self.config.block_size)
        if self.config.query_granularity == "token":
            return self._token_layout(q, k, seq, scale)
        return self._block_layout(q, k, seq, scale)

    def selects_every_block(self, seq: SeqInfo) -> bool:
        """Whether ``top_n`` is at least the key blocks of ``seq``: every causal block is then selected
        whatever the importance, and the layout is the dense causal one (no scoring; the same pairs,
        exactly: the window adds nothing)."""
        return self.config.top_n >= seq.num_key_blocks(self.config.block_size)

    def expected_density(self, length: int) -> float:
        """An estimate (which blocks the importance picks depends on q and k): the query at ``p`` reads
        at most ``top_n`` whole selected blocks and the part of the window beyond its local blocks,
        never more than its ``p + 1`` causal keys; with the compression branch, also the compressed
        keys it sees, ``(p + 1 - compress_kernel) // compress_stride + 1``."""
        cfg = self.config
        p1 = torch.arange(1, length + 1, dtype=torch.float64)
        beyond_local = max(cfg.window - cfg.local_blocks * cfg.block_size, 0)
        keys = p1.clamp(max=cfg.top_n * cfg.block_size + beyond_local)
        if cfg.compression_branch:
            keys = keys + (torch.div(p1 - cfg.compress_kernel, cfg.compress_stride, rounding_mode="floor") + 1).clamp(min=0)
        return causal_density(keys)

    def dense_at(self, seq: SeqInfo) -> bool:
        """:meth:`selects_every_block` (the compression branch, if on, is still merged)."""
        return self.selects_every_block(seq)

    def _block_layout(self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, scale: float | None) -> BlockLayout:
        cfg = self.config
        bs, window = cfg.block_size, cfg.window
        selected = self.select_blocks(self.block_importance(q, k, seq, scale), seq)  # (B, Hkv, NQB, NKB)
        if window == 0:
            return BlockLayout(selected, bs)
        reach, inside = window_blocks(seq, bs, window)
        blocks = selected | reach[:, None]
        partial = blocks & ~selected & ~inside[:, None]
        q_block_start = seq.q_block_start(bs)
        _, heads, nqb, nkb = selected.shape

        def token_mask(b, h, q_pos, kv_pos):  # type: ignore[no-untyped-def]
            t = (torch.div(q_pos, bs, rounding_mode="floor") - q_block_start[b]).clamp(0, nqb - 1)
            j = torch.div(kv_pos, bs, rounding_mode="floor").clamp(0, nkb - 1)
            return (kv_pos > q_pos - window) | selected[b, h.clamp(0, heads - 1), t, j]

        selection = RowSelection(selected, bs, row_block=bs, window=window)
        return BlockLayout(blocks, bs, token_mask, partial, row_selection=selection)

    def _token_layout(self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, scale: float | None) -> BlockLayout:
        cfg = self.config
        bs, window = cfg.block_size, cfg.window
        selected = self.token_selection(q, k, seq, scale)  # (B, Hkv, Sq, NKB), causal per row
        union, common, occupied = tile_union(selected, seq, bs)  # (B, Hkv, NQB, NKB) x 2, (B, NQB)
        if window > 0:
            reach, inside = window_blocks(seq, bs, window)
            blocks = union | (reach & occupied[:, :, None])[:, None]
            partial = blocks & ~common & ~inside[:, None]
        else:
            blocks, partial = union, union & ~common
        _, heads, sq, nkb = selected.shape
        if sq == 0:
            return BlockLayout(blocks, bs)
        q_start = seq.q_start

        def token_mask(b, h, q_pos, kv_pos):  # type: ignore[no-untyped-def]
            row = (q_pos - q_start[b]).clamp(0, sq - 1)
            j = torch.div(kv_pos, bs, rounding_mode="floor").clamp(0, nkb - 1)
            chosen = selected[b, h.clamp(0, heads - 1), row, j]
            return (kv_pos > q_pos - window) | chosen if window > 0 else chosen

        return BlockLayout(blocks, bs, token_mask, partial, row_selection=RowSelection(selected, bs, window=window))

    # -- compression branch -----------------------------------------------------------------
    def side_branch(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqInfo, *, scale: float
    ) -> AttentionOutput | None:
        """Attention of every query over its valid mean-pooled compressed keys/values (float32)."""
        cfg = self.config
        if not cfg.compression_branch:
            return None
        kernel, stride = cfg.compress_kernel, cfg.compress_stride
        batch, hq, sq, dim = q.shape
        group = hq // k.shape[1]
        ck = compress_mean(k, kernel, stride).repeat_interleave(group, dim=1)  # (B, Hq, M, D)
        cv = compress_mean(v, kernel, stride).repeat_interleave(group, dim=1)
        num_windows = ck.shape[2]
        if num_windows == 0 or sq == 0:
            out = q.new_zeros(batch, hq, sq, v.shape[-1])
            return AttentionOutput(out, torch.full((batch, hq, sq), -math.inf, device=q.device))
        outs, lses = [], []
        for rows, seen in chunk_windows(seq, cfg.score_chunk, num_windows, kernel, stride):
            seen = max(seen, 1)  # keep one (masked) column so that every chunk has the same layout
            valid = window_valid(seq, rows, seen, kernel, stride)[:, None]  # (B, 1, R, M')
            has_any = valid.any(-1)  # (B, 1, R)
            scores = torch.matmul(q[:, :, rows].float(), ck[:, :, :seen].transpose(-1, -2)) * scale
            # rows without a valid key get finite dummy scores so that no NaN reaches the gradients
            scores = torch.where(valid, scores, torch.full_like(scores, -math.inf))
            scores = torch.where(has_any[..., None], scores, torch.zeros_like(scores))
            lse = torch.logsumexp(scores, dim=-1)
            probs = torch.where(valid, torch.exp(scores - lse[..., None]), torch.zeros_like(scores))
            outs.append(torch.matmul(probs, cv[:, :, :seen]))
            lses.append(torch.where(has_any, lse, torch.full_like(lse, -math.inf)))
        return AttentionOutput(torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2))
