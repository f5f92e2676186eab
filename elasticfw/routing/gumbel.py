"""Gumbel-softmax relaxation, straight-through estimator and temperature schedule (paper §3.2, App. F)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from elasticfw.routing.base import RouterDecision

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


def gumbel_softmax_probs(
    logits: torch.Tensor, tau: float, *, noise: bool, gumbel: torch.Tensor | None = None
) -> torch.Tensor:
    """(..., K) probabilities of K modes from K logits: the Gumbel-softmax relaxation
    ``softmax((z + g) / tau)`` with ``noise`` (``gumbel``: noise drawn beforehand, of the logits'
    shape), the plain softmax without it."""
    z = logits.float()
    if noise:
        if gumbel is None:
            gumbel = gumbel_noise(z.shape, device=z.device)
        z = (z + gumbel.to(device=z.device, dtype=z.dtype)) / tau
    return torch.softmax(z, dim=-1)


class _StraightThroughOneHot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # the arg max (the first of equal maxima: a tie goes to the lower mode, as 2 modes send it to retrieval)
        return torch.nn.functional.one_hot(probs.argmax(-1), probs.shape[-1]).to(probs.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def straight_through_one_hot(probs: torch.Tensor) -> torch.Tensor:
    """(..., K) the arg max of ``probs`` as an exact one-hot in the forward pass, the gradient of
    ``probs`` in the backward pass (``hard + soft - soft.detach()``, computed exactly)."""
    return _StraightThroughOneHot.apply(probs)


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


def sample_noise(
    seeds: list[int], layers: int, heads: int, device: torch.device | str = "cpu", modes: int = 2
) -> torch.Tensor:
    """(B, layers, heads, modes) Gumbel noise, sample ``b``'s drawn from its own seed ``seeds[b]``.

    A sample's noise then depends on its seed alone, not on which process, micro-batch or
    position it lands in: training is reproducible across resumption, gradient accumulation and
    data-parallel layouts.
    """
    rows = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(int(seed) % (2**63))
        rows.append(gumbel_noise((layers, heads, modes), device="cpu", generator=gen))
    if not rows:
        return torch.zeros(0, layers, heads, modes, device=device)
    return torch.stack(rows).to(device)


def initial_bias(init_sparse_prob: float, modes: int) -> torch.Tensor:
    """(K,) biases of the last layer: P(mode 0) = 1 - p and p shared equally by the other K - 1
    modes (two modes: ``[0, log(p / (1 - p))]``, as the paper)."""
    p = init_sparse_prob
    if modes == 2:
        return torch.tensor([0.0, float(torch.log(torch.tensor(p / (1 - p))))])
    other = float(torch.log(torch.tensor(p / ((1 - p) * (modes - 1)))))
    return torch.tensor([0.0] + [other] * (modes - 1))


def k_mode_decision(
    logits: torch.Tensor, training: bool, tau: float, gumbel: torch.Tensor | None
) -> RouterDecision:
    """A K-mode decision from (B, H, K) logits: training, a Gumbel-softmax at ``tau`` with a
    straight-through one-hot (forward: the arg max; backward: the relaxed probabilities'
    gradient); inference, the arg max of the softmax without noise (a tie goes to the lower mode)."""
    probs = gumbel_softmax_probs(logits, tau, noise=training, gumbel=gumbel)
    if training:
        return RouterDecision.of_modes(straight_through_one_hot(probs), probs, logits)
    hard = torch.nn.functional.one_hot(probs.argmax(-1), probs.shape[-1]).to(probs.dtype)
    return RouterDecision.of_modes(hard, probs, logits)
