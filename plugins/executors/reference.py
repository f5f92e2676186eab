"""Reference executor: plain PyTorch, float32 accumulation, exact. The oracle every other
executor is tested against; fine on CPU for short sequences (memory O(rows_per_chunk * S))."""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from elasticfw.attention.executor import Executor, ExecutorConfig
from elasticfw.attention.layout import BlockLayout, dense_mask
from elasticfw.attention.mode import AttentionOutput
from elasticfw.attention.seq import SeqInfo


class ReferenceConfig(ExecutorConfig):
    name: Literal["reference"] = "reference"
    query_chunk: int = Field(
        1024, ge=1, description="Query rows processed at once (bounds memory at chunk x S scores)."
    )


class ReferenceExecutor(Executor):
    """Masked softmax attention in float32 over the layout's exact (query, key) pairs."""

    name = "reference"
    config_class = ReferenceConfig
    config: ReferenceConfig

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BlockLayout,
        seq: SeqInfo,
        *,
        scale: float,
        need_lse: bool = True,
    ) -> AttentionOutput:
        batch, hq, sq, dim = q.shape
        group = hq // k.shape[1]
        kf = k.float().repeat_interleave(group, dim=1)
        vf = v.float().repeat_interleave(group, dim=1)
        outs, lses = [], []
        chunk = self.config.query_chunk
        for start in range(0, sq, chunk):
            rows = slice(start, min(sq, start + chunk))
            mask = dense_mask(layout, seq, rows, num_heads=hq)
            scores = torch.matmul(q[:, :, rows].float(), kf.transpose(-1, -2)) * scale
            scores = scores.masked_fill(~mask, -math.inf)
            lse = torch.logsumexp(scores, dim=-1)
            safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
            probs = torch.exp(scores - safe[..., None])
            outs.append(torch.matmul(probs, vf))
            lses.append(lse)
        out = torch.cat(outs, dim=2) if outs else q.new_zeros(batch, hq, 0, dim, dtype=torch.float32)
        lse = torch.cat(lses, dim=2) if lses else q.new_zeros(batch, hq, 0, dtype=torch.float32)
        return AttentionOutput(out.to(q.dtype), lse)
