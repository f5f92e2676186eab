"""MoBA: mixture of block attention — each query attends to its top-k key blocks.

Sources: MoBA (Lu et al., 2025, arXiv 2502.13189) and its reference code, MoonshotAI/MoBA
``moba/moba_naive.py::moba_attn_varlen_naive``; defaults from Elastic Attention
(arXiv 2601.17367) Table 6: MoBA block 1024, top-k 8.

Semantics (per sample, per query head; a GQA group's query heads gate against their KV head's
keys, as upstream does after ``repeat_kv``):

* Keys are cut into MoBA blocks of ``moba_block_size`` tokens. The gate of query ``q`` for key
  block ``n`` is ``q · mean(K_n)`` in float32 (the mean over the block's real keys; upstream
  takes the mean in the input dtype, which differs only by rounding in bf16/fp16).
* The query's *current* block (the block holding its position) is always selected and attended
  causally. A block is a *candidate* only if it ends before the current block begins (upstream
  masks block ``n`` for every query before ``(n + 1) * moba_block_size``), so a candidate never
  holds a future or a padding key.
* ``top_k`` counts the current block: the ``top_k - 1`` candidates with the highest gates are
  added. **Ties** go to the lower block index (upstream leaves them to ``torch.topk``).

Query granularity:

* ``token`` (default; exactly upstream's per-token semantics): one selection per query token,
  kept as a ``(B, Hq, Sq, n_moba_blocks)`` bool tensor that the layout's token mask indexes; a
  layout tile computes the union of its rows' selections, and is ``partial`` where its rows
  disagree.
* ``block``: one selection per layout tile (``block_size`` query positions), gated with the
  **mean of the tile's real queries** (equivalently, the mean of their per-token gates, since
  the gate is linear in ``q``). The mean keeps the score on the same scale as a token's and
  rewards blocks the whole tile agrees on, where a max would let one outlier row choose for
  all. A row's output then depends on the later queries of its tile (not token-causal), and
  a decode step (one query) may select differently from the prefill tile it belongs to. No
  token mask is needed: the layout is exact at tile granularity.

``block_size`` is the layout tile the executor runs (as for every mode); ``moba_block_size``
must be a multiple of it, so one MoBA block is ``moba_block_size / block_size`` layout blocks.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, model_validator

from elasticfw.attention.layout import BlockLayout, block_grid
from elasticfw.attention.mode import AttentionMode, ModeConfig
from elasticfw.attention.seq import SeqInfo

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

    def build_layout(self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo) -> BlockLayout:
        seq.check(q, k)
        means = key_block_means(k, seq, self.config.moba_block_size)
        if self.config.query_granularity == "token":
            return self._token_layout(q, means, seq)
        return self._block_layout(q, means, seq)

    # -- granularity "token" ------------------------------------------------------------------
    def _token_layout(self, q: torch.Tensor, means: torch.Tensor, seq: SeqInfo) -> BlockLayout:
        cfg = self.config
        moba, bs = cfg.moba_block_size, cfg.block_size
        batch, hq, sq, _ = q.shape
        nmb = means.shape[2]
        current = torch.div(seq.query_positions(), moba, rounding_mode="floor").clamp(0, nmb - 1)  # (B, Sq)
        selected = torch.zeros(batch, hq, sq, nmb, dtype=torch.bool, device=q.device)
        for start in range(0, sq, GATE_CHUNK):
            rows = slice(start, min(sq, start + GATE_CHUNK))
            gates = _gates(q[:, :, rows], means)  # (B, Hq, R, NMB)
            cur = current[:, None, rows].expand(batch, hq, -1)
            selected[:, :, rows] = select_blocks(gates, cur, cfg.top_k)

        union, common = _tile_union(selected, seq, bs)
        blocks, partial = _to_layout(union, common, seq, bs, moba)
        if sq == 0:
            return BlockLayout(blocks, bs)
        q_start, last_row, last_block = seq.q_start, sq - 1, nmb - 1

        def token_mask(b, h, q_pos, kv_pos):  # type: ignore[no-untyped-def]
            row = (q_pos - q_start[b]).clamp(0, last_row)
            block = torch.div(kv_pos, moba, rounding_mode="floor").clamp(0, last_block)
            return selected[b, h, row, block]

        return BlockLayout(blocks, bs, token_mask, partial)

    # -- granularity "block" ------------------------------------------------------------------
    def _block_layout(self, q: torch.Tensor, means: torch.Tensor, seq: SeqInfo) -> BlockLayout:
        cfg = self.config
        moba, bs = cfg.moba_block_size, cfg.block_size
        batch, hq, sq, dim = q.shape
        nmb = means.shape[2]
        nqb = seq.num_query_blocks(bs)
        valid = seq.query_valid()  # (B, Sq)
        offsets = (seq.q_start % bs).tolist()
        pooled = torch.zeros(batch, hq, nqb, dim, dtype=torch.float32, device=q.device)
        counts = torch.zeros(batch, nqb, dtype=torch.float32, device=q.device)
        for b, off in enumerate(offsets):
            rows = torch.zeros(hq, nqb * bs, dim, dtype=torch.float32, device=q.device)
            rows[:, off : off + sq] = torch.where(valid[b, None, :, None], q[b].float(), 0.0)
            pooled[b] = rows.view(hq, nqb, bs, dim).sum(2)
            real = torch.zeros(nqb * bs, dtype=torch.float32, device=q.device)
            real[off : off + sq] = valid[b].float()
            counts[b] = real.view(nqb, bs).sum(1)
        pooled = pooled / counts.clamp_min(1)[:, None, :, None]
        current = torch.div(seq.query_block_positions(bs) * bs, moba, rounding_mode="floor").clamp(0, nmb - 1)
        selected = select_blocks(_gates(pooled, means), current[:, None].expand(batch, hq, -1), cfg.top_k)
        selected &= (counts > 0)[:, None, :, None]  # tiles without a real query compute nothing
        blocks, _ = _to_layout(selected, selected, seq, bs, moba)
        return BlockLayout(blocks, bs)


# ---------------------------------------------------------------------------------------
# Building blocks (plain PyTorch)
# ---------------------------------------------------------------------------------------


def key_block_means(k: torch.Tensor, seq: SeqInfo, moba_block_size: int) -> torch.Tensor:
    """(B, Hkv, NMB, D) float32 mean of each MoBA block's real keys (zeros for a block without any)."""
    batch, hkv, sk, dim = k.shape
    nmb = math.ceil(sk / moba_block_size)
    pad = nmb * moba_block_size - sk
    valid = seq.key_valid()  # (B, Sk)
    kf = torch.where(valid[:, None, :, None], k.float(), 0.0)
    kf = torch.nn.functional.pad(kf, (0, 0, 0, pad))
    sums = kf.view(batch, hkv, nmb, moba_block_size, dim).sum(3)
    counts = torch.nn.functional.pad(valid.float(), (0, pad)).view(batch, nmb, moba_block_size).sum(-1)
    return sums / counts.clamp_min(1)[:, None, :, None]


def _gates(q: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """(B, Hq, R, NMB) float32 ``q · mean(K_n)``; query head ``h`` uses KV head ``h // group``."""
    batch, hq, rows, dim = q.shape
    hkv = means.shape[1]
    grouped = q.float().view(batch, hkv, hq // hkv, rows, dim)
    return torch.einsum("bkgrd,bknd->bkgrn", grouped, means).reshape(batch, hq, rows, -1)


def select_blocks(gates: torch.Tensor, current: torch.Tensor, top_k: int) -> torch.Tensor:
    """(..., NMB) bool: the ``current`` block plus the ``top_k - 1`` best candidates before it.

    ``gates`` is (..., NMB); ``current`` (...) is each query's own block. Candidates are the
    blocks ``n < current``; among equal gates the lower block index wins (a stable descending
    sort keeps index order among ties).
    """
    nmb = gates.shape[-1]
    candidate = torch.arange(nmb, device=gates.device) < current[..., None]
    selected = torch.zeros_like(candidate)
    extra = min(top_k - 1, nmb)
    if extra > 0:
        ranked = gates.masked_fill(~candidate, -math.inf)
        order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :extra]
        selected.scatter_(-1, order, True)
        selected &= candidate
    selected.scatter_(-1, current[..., None], True)
    return selected


def _tile_union(selected: torch.Tensor, seq: SeqInfo, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layout tile (B, Hq, NQB, NMB): blocks any real row selects, and blocks every real row selects."""
    batch, hq, sq, nmb = selected.shape
    nqb = seq.num_query_blocks(bs)
    valid = seq.query_valid()[:, None, :, None]  # (B, 1, Sq, 1)
    union = torch.zeros(batch, hq, nqb, nmb, dtype=torch.bool, device=selected.device)
    common = torch.zeros_like(union)
    for b, off in enumerate((seq.q_start % bs).tolist()):
        any_rows = torch.zeros(hq, nqb * bs, nmb, dtype=torch.bool, device=selected.device)
        any_rows[:, off : off + sq] = selected[b] & valid[b]
        all_rows = torch.ones_like(any_rows)
        all_rows[:, off : off + sq] = selected[b] | ~valid[b]
        real = torch.zeros(nqb * bs, dtype=torch.bool, device=selected.device)
        real[off : off + sq] = valid[b, 0, :, 0]
        union[b] = any_rows.view(hq, nqb, bs, nmb).any(2)
        common[b] = all_rows.view(hq, nqb, bs, nmb).all(2) & real.view(nqb, bs).any(1)[None, :, None]
    return union, common


def _to_layout(
    union: torch.Tensor, common: torch.Tensor, seq: SeqInfo, bs: int, moba: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MoBA-block selections per tile -> layout ``blocks`` and ``partial`` (B, Hq, NQB, NKB), causal."""
    q_blocks, k_blocks = block_grid(seq, bs)  # (B, NQB, 1), (1, 1, NKB)
    owner = torch.div(k_blocks.reshape(-1) * bs, moba, rounding_mode="floor")  # MoBA block of each key block
    causal = (k_blocks <= q_blocks)[:, None]
    blocks = union[..., owner] & causal
    partial = blocks & ~common[..., owner]
    return blocks, partial
