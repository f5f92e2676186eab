"""Gumbel-softmax relaxation, straight-through estimator and temperature schedule (paper §3.2, App. F)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EPS = 1e-10


def gumbel_noise(shape: torch.Size | tuple[int, ...], *, device, generator: torch.Generator | None = None) -> torch.Tensor:
    """``g = -log(-log(u + eps) + eps)``, u ~ U(0, 1) (paper Eq. 12)."""
    u = torch.rand(shape, device=device, generator=generator, dtype=torch.float32)
    return -torch.log(-torch.log(u + EPS) + EPS)


def gumbel_softmax_sparse_prob(
    logits: torch.Tensor,
    tau: float,
    *,
    noise: bool,
    generator: torch.Generator | None = None,
    gumbel: torch.Tensor | None = None,
) -> torch.Tensor:
    """Probability of the sparse class from 2-class logits ``(..., 2)`` (index 1 = sparse).

    With ``noise`` this is the Gumbel-softmax relaxation at temperature ``tau`` (``gumbel``: noise
    drawn beforehand, of the logits' shape; otherwise it is drawn here); without it, the plain
    softmax (used for reporting and at inference, where the decision is the arg max).
    """
    z = logits.float()
    if noise:
        if gumbel is None:
            gumbel = gumbel_noise(z.shape, device=z.device, generator=generator)
        z = z + gumbel.to(device=z.device, dtype=z.dtype)
        z = z / tau
    return torch.softmax(z, dim=-1)[..., 1]


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, prob: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (prob > 0.5).to(prob.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def straight_through(prob: torch.Tensor) -> torch.Tensor:
    """Hard 0/1 decision in the forward pass, gradient of ``prob`` in the backward pass.

    The paper's ``hard + soft - soft.detach()``, computed exactly: the forward value is exactly
    0 or 1 (the arithmetic form can leave 0.99999994), the gradient is the identity.
    """
    return _StraightThrough.apply(prob)


@dataclass(frozen=True)
class TemperatureSchedule:
    """``tau(p) = max(tau_min, tau_init * exp(-rate * p))``; ``p`` is training progress.

    The paper (App. F.3) gives rate r = 0.6 and leaves p's unit open; here ``p`` is measured in
    ``unit``-sized steps of progress: ``p = progress * total_units`` with ``progress`` in [0, 1].
    """

    tau_init: float = 1.0
    tau_min: float = 0.3
    rate: float = 0.6
    total_units: float = 10.0

    def __call__(self, progress: float) -> float:
        p = progress * self.total_units
        return max(self.tau_min, self.tau_init * math.exp(-self.rate * p))


def sample_noise(seeds: list[int], layers: int, heads: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(B, layers, heads, 2) Gumbel noise, sample ``b``'s drawn from its own seed ``seeds[b]``.

    A sample's noise then depends on its seed alone, not on which process, micro-batch or
    position it lands in: training is reproducible across resumption, gradient accumulation and
    data-parallel layouts.
    """
    rows = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(int(seed) % (2**63))
        rows.append(gumbel_noise((layers, heads, 2), device="cpu", generator=gen))
    if not rows:
        return torch.zeros(0, layers, heads, 2, device=device)
    return torch.stack(rows).to(device)
