"""Dense-mask SDPA executor: PyTorch's fused ``scaled_dot_product_attention`` with the layout's
exact boolean mask.

Computes exactly the reference executor's pairs (it builds the same mask with
:func:`elasticfw.attention.layout.dense_mask`, in query chunks) but runs the softmax-attention in
PyTorch's fused kernels, so it is several times faster than the float32 reference on a CPU.
Layouts that declare ``dense_causal`` on a plain prefill skip the mask (``is_causal``). Memory is
O(chunk x S) for the mask, so this is an executor for short and medium sequences — the CPU demo
and CPU evaluation — not for long-context GPU work (use ``flex``). The log-sum-exp is computed
(one extra pass) only when a caller needs it.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from elasticfw.attention.executor import Executor, ExecutorConfig
from elasticfw.attention.layout import BlockLayout, dense_mask
from elasticfw.attention.mode import AttentionOutput
from elasticfw.attention.seq import SeqInfo


class SDPAConfig(ExecutorConfig):
    name: Literal["sdpa"] = "sdpa"
    query_chunk: int = Field(2048, ge=1, description="Query rows per call (bounds the mask at chunk x S bools).")


class SDPAExecutor(Executor):
    """Fused SDPA over the layout's exact boolean mask (fast on CPU, O(chunk x S) memory)."""

    name = "sdpa"
    config_class = SDPAConfig
    config: SDPAConfig

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
        hq = q.shape[1]
        plain_prefill = seq.q_len == seq.kv_capacity and not bool(seq.q_start.any())
        if layout.dense_causal and plain_prefill and not need_lse:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            return AttentionOutput(out, None)
        outs, lses = [], []
        chunk = self.config.query_chunk
        for start in range(0, seq.q_len, chunk):
            rows = slice(start, min(seq.q_len, start + chunk))
            mask = dense_mask(layout, seq, rows, num_heads=hq)
            empty = ~mask.any(-1)  # rows that see no key: give SDPA one key, zero the result
            if bool(empty.any()):
                mask[..., 0] |= empty
            out = F.scaled_dot_product_attention(q[:, :, rows], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out = out.masked_fill(empty[..., None], 0.0)
            outs.append(out)
            if need_lse:
                group = hq // k.shape[1]
                scores = torch.matmul(q[:, :, rows].float(), k.float().repeat_interleave(group, 1).transpose(-1, -2))
                scores = (scores * scale).masked_fill(~mask, -math.inf)
                lses.append(torch.logsumexp(scores, -1).masked_fill(empty, -math.inf))
        out = torch.cat(outs, dim=2)
        return AttentionOutput(out, torch.cat(lses, dim=2) if need_lse else None)
