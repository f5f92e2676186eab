"""What an attention call returns (:class:`AttentionOutput`), and how two such results over disjoint
key sets combine (:func:`merge_lse`): the contract executors and modes share. Both are importable
from :mod:`elasticfw.attention.mode` too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionOutput:
    """``out`` (B, Hq, Sq, D) in the input dtype and ``lse`` (B, Hq, Sq) float32 (natural log).

    Rows that attend to nothing have ``out == 0`` and ``lse == -inf``. ``lse`` may be ``None``
    when the caller did not ask for it (``need_lse=False``) and the executor skips it.
    """

    out: torch.Tensor
    lse: torch.Tensor | None


def merge_lse(a: AttentionOutput, b: AttentionOutput) -> AttentionOutput:
    """Combine two attentions over disjoint key sets as one softmax over their union."""
    if a.lse is None or b.lse is None:
        raise ValueError("merge_lse needs both log-sum-exps: call the executor with need_lse=True")
    lse = torch.logaddexp(a.lse, b.lse)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.where(torch.isfinite(a.lse), torch.exp(a.lse - safe), torch.zeros_like(lse))
    wb = torch.where(torch.isfinite(b.lse), torch.exp(b.lse - safe), torch.zeros_like(lse))
    out = a.out.float() * wa[..., None] + b.out.float() * wb[..., None]
    return AttentionOutput(out.to(a.out.dtype), lse)
