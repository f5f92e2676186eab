"""Streaming attention: attention sinks + a local window (SSA).

Sources: StreamingLLM (Xiao et al., 2023, arXiv 2309.17453); DuoAttention (Xiao et al., 2024,
arXiv 2410.10819) for the token-exact mask; Block-Sparse-Attention's block streaming for the
block-granular one; defaults from Elastic Attention (arXiv 2601.17367) Table 6: sink 128, local
2048, block 64.

Two semantics:

* ``granularity: block`` (canonical, what the paper's block-sparse kernel runs): query block
  ``i`` computes key blocks ``[0, sink/bs)`` and ``[i + 1 - local/bs, i]``, the diagonal block
  counted in the local window. ``sink_tokens`` and ``local_tokens`` must be multiples of the
  block size.
* ``granularity: token`` (DuoAttention's ``generate_streaming_mask``): key ``j`` is visible to
  position ``p`` iff ``j <= p`` and (``j < sink`` or ``j > p - local``).

At decode a streaming head reads its sink and its window only, so it declares them
(:meth:`StreamingAttention.decode_keep`) and a compact KV cache keeps nothing else for it.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from elasticfw.attention.layout import BlockLayout, block_grid, causal_layout
from elasticfw.attention.mode import AttentionMode, DecodeKeep, ModeConfig
from elasticfw.attention.seq import SeqInfo


class StreamingConfig(ModeConfig):
    name: Literal["streaming"] = "streaming"
    sink_tokens: int = Field(128, ge=0, description="Initial tokens every query sees (attention sinks).")
    local_tokens: int = Field(2048, ge=1, description="Most recent tokens every query sees, itself included.")
    block_size: int = Field(64, ge=16, description="Block size of the layout.")
    granularity: Literal["block", "token"] = Field(
        "block", description="`block`: whole sink/local blocks (paper kernel); `token`: exact token window."
    )

    @model_validator(mode="after")
    def _block_multiples(self) -> StreamingConfig:
        if self.granularity == "block":
            for field in ("sink_tokens", "local_tokens"):
                value = getattr(self, field)
                if value % self.block_size:
                    raise ValueError(
                        f"{field}={value} must be a multiple of block_size={self.block_size} with "
                        "granularity 'block' (use granularity 'token' for an exact token window)"
                    )
        return self


class StreamingAttention(AttentionMode):
    """Attention sinks + local window (StreamingLLM / DuoAttention streaming heads)."""

    name = "streaming"
    config_class = StreamingConfig
    layout_depends_on_inputs = False  # the layout is a function of seq and the config alone
    config: StreamingConfig

    def dense_at(self, seq: SeqInfo) -> bool:
        """Whether sink and window cover every key of ``seq``: at most ``sink_tokens + local_tokens``
        keys. Token granularity: position ``p`` drops key ``j`` only if ``sink <= j <= p - local``,
        which needs ``p >= sink + local``. Block granularity (sink and local whole blocks): query
        block ``i`` drops a block only if ``i >= (sink + local) / bs``, i.e. past the same key count."""
        cfg = self.config
        return seq.kv_capacity <= cfg.sink_tokens + cfg.local_tokens

    def build_layout(self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo) -> BlockLayout:
        cfg = self.config
        bs = cfg.block_size
        if self.dense_at(seq):
            return causal_layout(seq, bs)
        q_blocks, k_blocks = block_grid(seq, bs)  # (B,NQB,1), (1,1,NKB)
        causal = k_blocks <= q_blocks
        if cfg.granularity == "block":
            sink = k_blocks < cfg.sink_tokens // bs
            local = k_blocks > q_blocks - cfg.local_tokens // bs
            return BlockLayout(((sink | local) & causal)[:, None], bs)
        sink_blocks = (cfg.sink_tokens + bs - 1) // bs
        sink = k_blocks < sink_blocks
        # some position p of the tile sees some key j of the block with j > p - local
        local = (k_blocks * bs + bs - 1) > (q_blocks * bs) - cfg.local_tokens
        blocks = (sink | local) & causal
        whole_sink = (k_blocks * bs + bs) <= cfg.sink_tokens
        whole_local = (k_blocks * bs) > (q_blocks * bs + bs - 1) - cfg.local_tokens
        partial = blocks & ~(whole_sink | whole_local)
        sink_tokens, local_tokens = cfg.sink_tokens, cfg.local_tokens

        def token_mask(b, h, q_pos, kv_pos):
            return (kv_pos < sink_tokens) | (kv_pos > q_pos - local_tokens)

        return BlockLayout(blocks[:, None], bs, token_mask, partial[:, None])

    def expected_density(self, length: int) -> float:
        """Exact: the causal pairs the sink and the window cover at ``length`` tokens (prefill), under this
        config's granularity (the keys :meth:`decode_keep` declares are those of every query position).
        About ``2 (sink + local) / length`` once ``length`` is much longer than ``sink + local``; 1.0
        when they cover every key."""
        return self.decode_keep().density(length)

    def decode_keep(self) -> DecodeKeep:
        """Sink + window, exactly what :meth:`build_layout` reads at a decode position ``p``.

        Token granularity: ``j < sink`` or ``j > p - local``, a window of ``local`` tokens. Block
        granularity: key blocks ``[0, sink/bs)`` and ``[p//bs + 1 - local/bs, p//bs]``, i.e.
        ``j < sink`` or ``j >= (p//bs + 1)*bs - local`` — between ``local - bs + 1`` and ``local``
        window tokens depending on where ``p`` sits in its block, so the window is declared with
        ``granularity = block_size`` (``sink`` and ``local`` are block multiples there).
        """
        cfg = self.config
        granularity = cfg.block_size if cfg.granularity == "block" else 1
        return DecodeKeep(cfg.sink_tokens, cfg.local_tokens, granularity)
