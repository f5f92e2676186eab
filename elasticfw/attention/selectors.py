"""Selectors of data-dependent modes: from per-row scores, the entries a row keeps.

The second step of a data-dependent mode (:mod:`elasticfw.attention.patterns` holds the first,
estimation, and re-exports these; :mod:`elasticfw.attention.pattern_layouts` the third). Each
selector works on the last dimension of a score tensor, whatever it indexes (key blocks, key
columns, diagonals), and returns a bool tensor of the same shape.

* :func:`topk_select` — ``forced`` entries plus the best other ``candidates`` up to ``k`` in all
  (forced entries count toward ``k`` and are kept even beyond it).
* :func:`threshold_select` — ``forced`` entries plus the best other ``allowed`` entries while the
  kept mass is below ``threshold`` times the row's total (the crossing entry is kept).

Both break ties deterministically: among equal scores the **lower index wins** (a stable
descending sort), whatever the device. Scores must not be NaN.
"""

from __future__ import annotations

import torch

__all__ = ["threshold_select", "topk_select"]


def _descending(scores: torch.Tensor, eligible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the last dim with the eligible entries first, by descending score, ties to the
    lower index (two stable sorts: a score of -inf never lets an ineligible entry jump ahead);
    returns (order, eligible in that order)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    sorted_eligible = eligible.gather(-1, order)
    regroup = torch.sort((~sorted_eligible).to(torch.uint8), dim=-1, stable=True).indices
    order = order.gather(-1, regroup)
    return order, eligible.gather(-1, order)


def topk_select(
    scores: torch.Tensor,
    k: int | torch.Tensor,
    *,
    candidates: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool like ``scores`` (..., N): per row, the ``forced`` entries plus the best other candidates.

    ``k`` (an int, or a tensor broadcastable to (..., 1)) counts the forced entries: the
    ``max(k - #forced, 0)`` highest-scoring entries of ``candidates & ~forced`` are added, and every
    forced entry is kept even beyond ``k``. ``candidates`` (default: all) and ``forced`` (default:
    none) are bool, broadcastable to ``scores``. Among equal scores the lower index wins. This is
    MoBA's rule (``forced`` = the current block), NSA's (initial + local blocks) and MInference's
    (sink columns, local diagonals).
    """
    shape = scores.shape
    forced_t = (
        torch.zeros(shape, dtype=torch.bool, device=scores.device) if forced is None else forced.expand(shape)
    )
    eligible = ~forced_t if candidates is None else candidates.expand(shape) & ~forced_t
    budget = torch.as_tensor(k, device=scores.device) - forced_t.sum(-1, keepdim=True)
    order, sorted_eligible = _descending(scores, eligible)
    rank = torch.arange(shape[-1], device=scores.device).expand(shape)
    take = sorted_eligible & (rank < budget)
    chosen = torch.zeros(shape, dtype=torch.bool, device=scores.device).scatter_(-1, order, take)
    return chosen | forced_t


def threshold_select(
    scores: torch.Tensor,
    threshold: float,
    *,
    allowed: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool like ``scores`` (..., N) of non-negative masses: cumulative-mass selection per row.

    The row total is the mass of the ``allowed`` entries (default: all). ``forced & allowed``
    entries are always kept; the other allowed entries are visited by descending mass (ties: the
    lower index first) and entry ``c_j`` is kept iff ``forced_mass + sum_{i<j} mass(c_i) <
    threshold * total``: entries are added while the kept mass is below the target, and the one
    that crosses it is included (XAttention's rule). ``threshold >= 1`` keeps every allowed entry
    (no rounding in a cumulative sum can drop one).
    """
    shape = scores.shape
    allowed_t = torch.ones(shape, dtype=torch.bool, device=scores.device) if allowed is None else allowed.expand(shape)
    if threshold >= 1.0:
        return allowed_t.clone()
    forced_t = torch.zeros_like(allowed_t) if forced is None else allowed_t & forced
    zero = torch.zeros((), device=scores.device, dtype=scores.dtype)
    mass = torch.where(allowed_t, scores, zero)
    total = mass.sum(-1, keepdim=True)
    forced_mass = torch.where(forced_t, mass, zero).sum(-1, keepdim=True)
    candidate = allowed_t & ~forced_t
    # masses are >= 0, so -1 sorts non-candidates last
    values = torch.where(candidate, mass, torch.full((), -1.0, device=scores.device, dtype=scores.dtype))
    sorted_values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    sorted_candidate = candidate.gather(-1, order)
    contrib = torch.where(sorted_candidate, sorted_values, zero)
    before = torch.cat([forced_mass, contrib[..., :-1]], dim=-1).cumsum(-1)
    take = sorted_candidate & (before < threshold * total)
    chosen = torch.zeros_like(take).scatter_(-1, order, take)
    return chosen | forced_t
