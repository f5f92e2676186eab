"""The training objective of Elastic Attention (arXiv 2601.17367, §3.2, Eq. 8).

    max_{λ1, λ2} min_θ  CE(answer tokens) + λ1 · d + λ2 · d²,    d = Ω_MSR − t

with one pair (λ1, λ2) per task, updated by gradient *ascent* (Bhaskar et al., 2025; Sheared
LLaMA's Lagrangian), and one target t per task. The paper calls its constraints "non-tight"
(lower and upper bounds): a target may be an interval [t_lo, t_hi], in which case d is the
distance to the interval (0 inside it). ``d`` is computed per input, as Eq. 8 writes it, and
averaged over the global batch.

Sign convention (the paper's): the gradient of the objective with respect to λ1 is d, so ascent
moves λ1 *in the direction of d*. When the MSR is below its target (d < 0) λ1 goes down, and
the term λ1·d then rewards raising the MSR (its derivative in MSR, λ1 + 2 λ2 d, becomes more
negative); above the target the opposite. λ2's gradient d² ≥ 0 only ever raises it, tightening
the quadratic well around the target.

The same Lagrangian constrains the *expected cost* instead of the MSR (``train.constraint: cost``,
which training among K >= 3 modes needs): per sample

    C = mean over routed (layer, KV head) of sum_k m_k · cost_k,     d = C − t_cost

with m the router's straight-through one-hot (the MSR term's own decisions: forward the hard
routing, backward the relaxed probabilities) and cost_k mode k's relative cost at the sample's
prompt length (:class:`~elasticfw.attention.mode.ModeCosts`; full attention 1). For two modes C is
``cost_0 + (cost_1 − cost_0) · MSR``. The sign convention is the MSR's: above its target (too
dear) λ1 rises and the penalty's slope in C turns positive, so minimising lowers the cost.
"""

from __future__ import annotations

import torch
from torch import nn

from elasticfw.recipe.train_section import Target


def target_bounds(target: Target) -> tuple[float, float]:
    """(t_lo, t_hi) of a target: t gives (t, t)."""
    if isinstance(target, (int, float)):
        return float(target), float(target)
    lo, hi = target
    return float(lo), float(hi)


def constraint_gap(msr: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """d = MSR − t_hi above the interval, MSR − t_lo below it, 0 inside (elementwise)."""
    return torch.where(msr > hi, msr - hi, torch.where(msr < lo, msr - lo, torch.zeros_like(msr)))


class Lagrangian(nn.Module):
    """Per-task Lagrange multipliers λ1, λ2 and targets; trained by ascent on :meth:`penalty`."""

    lo: torch.Tensor
    hi: torch.Tensor

    def __init__(self, targets: list[Target], init: float = 0.0) -> None:
        super().__init__()
        bounds = [target_bounds(t) for t in targets]
        self.register_buffer("lo", torch.tensor([b[0] for b in bounds], dtype=torch.float32))
        self.register_buffer("hi", torch.tensor([b[1] for b in bounds], dtype=torch.float32))
        self.lambda1 = nn.Parameter(torch.full((len(targets),), float(init)))
        self.lambda2 = nn.Parameter(torch.full((len(targets),), float(init)))

    def penalty(self, msr: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
        """(B,) λ1[k]·d + λ2[k]·d² of each sample (``task`` (B,) int: its task index k). ``msr`` is the
        constrained quantity: the MSR, or the expected cost under ``train.constraint: cost``."""
        task = task.to(self.lo.device)
        msr = msr.float().to(self.lo.device)
        gap = constraint_gap(msr, self.lo[task], self.hi[task])
        return self.lambda1[task] * gap + self.lambda2[task] * gap * gap

    def gap(self, msr: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
        """(B,) d of each sample, detached."""
        task = task.to(self.lo.device)
        return constraint_gap(msr.detach().float().to(self.lo.device), self.lo[task], self.hi[task])


def answer_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the labelled positions (``labels`` −100 elsewhere), in fp32.

    ``logits`` (B, T, V) at positions 0..T−1 predict ``labels`` (B, T) — already shifted by the caller.
    """
    return nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
