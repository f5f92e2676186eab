"""Per-mode share targets (``train.share_targets``): the Lagrangian on the share of heads each task
sends to a mode, beside the MSR or cost constraint.

For task t and a listed mode k, per sample

    s_k = mean over routed (layer, KV head) of m_k,      d = s_k − t_share(t, k)

(``m`` the router's straight-through one-hot, the shares the cost term uses), with its own λ1, λ2
and the sign convention of :mod:`elasticfw.training.objective`: the penalty λ1·d + λ2·d² of every
listed (task, mode) pair is added to the sample's penalty. A cost target says how much a task may
spend; share targets say on what, e.g. "at least 20 % of the heads full on retrieval" or "at most
10 % on XAttention".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from elasticfw.recipe.train_section import Target
from elasticfw.training.objective import Lagrangian, target_bounds


class ShareConstraint(nn.Module):
    """Lagrange multipliers per (task, mode) on the mode shares; pairs without a target are free
    (their interval is [0, 1], which no share leaves, so their penalty and gradients are 0)."""

    active: torch.Tensor

    def __init__(self, targets: list[dict[int, Target]], num_modes: int, init: float = 0.0) -> None:
        super().__init__()
        self.num_modes = num_modes
        flat: list[Target] = [(0.0, 1.0)] * (len(targets) * num_modes)
        active = torch.zeros(len(targets), num_modes, dtype=torch.bool)
        for t, per_mode in enumerate(targets):
            for k, target in per_mode.items():
                flat[t * num_modes + k] = target
                active[t, k] = True
        self.inner = Lagrangian(flat, init)
        self.register_buffer("active", active)
        self.targets = targets

    def _index(self, task: torch.Tensor) -> torch.Tensor:
        task = task.to(self.active.device)
        return task[:, None] * self.num_modes + torch.arange(self.num_modes, device=task.device)[None, :]

    def penalty(self, shares: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
        """(B,) sum over the task's listed modes of λ1·d + λ2·d² (``shares`` (B, K), ``task`` (B,))."""
        index = self._index(task)
        per_mode = self.inner.penalty(shares.reshape(-1), index.reshape(-1)).view(index.shape)
        return (per_mode * self.active[task.to(self.active.device)]).sum(-1)

    def gap(self, shares: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
        """(B, K) d of each sample and mode, detached (0 for free pairs)."""
        index = self._index(task)
        return self.inner.gap(shares.reshape(-1), index.reshape(-1)).view(index.shape)

    def row(self, tasks: list[str], modes: list[str]) -> dict[str, Any]:
        """The multipliers of the listed pairs for the metrics log: ``share_lambda1`` and ``share_lambda2``
        as {task: {mode: value}}."""
        out: dict[str, Any] = {"share_lambda1": {}, "share_lambda2": {}}
        for name, param in (("share_lambda1", self.inner.lambda1), ("share_lambda2", self.inner.lambda2)):
            values = param.detach().view(len(tasks), self.num_modes)
            for t, label in enumerate(tasks):
                listed = {modes[k]: float(values[t, k]) for k in range(self.num_modes) if bool(self.active[t, k])}
                if listed:
                    out[name][label] = listed
        return out

    def bounds(self) -> list[dict[int, list[float]]]:
        """Each task's listed targets as [lo, hi] by mode index (checkpoint metadata)."""
        return [{k: list(target_bounds(t)) for k, t in per_mode.items()} for per_mode in self.targets]


def share_constraint(mixture: list[Any], modes: list[str], init: float) -> ShareConstraint | None:
    """The constraint of the mixture's share targets (each task's ``share_targets``: its entry's, else
    ``train.share_targets`` of its category; modes by their :func:`~elasticfw.training.cost.mode_labels`
    label), or ``None`` where no task has one."""
    targets = [{modes.index(m): t for m, t in task.share_targets.items()} for task in mixture]
    if not any(targets):
        return None
    return ShareConstraint(targets, len(modes), init)
