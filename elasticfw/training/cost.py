"""The expected cost of a routing among K modes: per-step statistics, checks of the cost targets
against the modes' costs, and the per-task summaries of the reports.

A sample's expected cost is the mean over routed (layer, KV head) of ``sum_k m_k cost_k``
(:meth:`~elasticfw.model.elastic.ElasticModel.expected_cost`): at inference, where ``m`` is the
hard routing, the cost of the routing it got; in training, the quantity ``train.constraint: cost``
constrains. The reports give it per task (mean and spread) beside the share of heads per mode;
they do so when the model routes among K >= 3 modes or the recipe constrains the cost.
"""

from __future__ import annotations

from typing import Any

import torch

from elasticfw.errors import UnsupportedInputError


def mode_labels(names: list[str]) -> list[str]:
    """Report labels of K modes in routing order: each mode's name, with its position appended
    (``streaming.2``) where two modes share a name."""
    return [f"{n}.{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def reports_cost(num_modes: int, constraint: str) -> bool:
    """Whether the reports give expected costs and mode shares: K >= 3 modes, or a cost constraint
    (two modes under the MSR constraint report as before)."""
    return num_modes > 2 or constraint == "cost"


def check_cost_targets(costs: Any, mixture: list[Any]) -> None:
    """Each task's cost target within the range its training samples' expected cost can take: from
    the cheapest mode's cost to the dearest's at the samples' prompt lengths (``costs``: a
    :class:`~elasticfw.attention.mode.ModeCosts`)."""
    for index, task in enumerate(mixture):
        target = task.cost_target
        values = (target,) if isinstance(target, (int, float)) else tuple(target)
        lo, hi = costs.bounds([len(it.prompt) for it in task.items])
        if min(values) < lo - 1e-9 or max(values) > hi + 1e-9:
            names = ", ".join(m.name for m in costs.modes)
            raise UnsupportedInputError(
                f"train.tasks.{index} ({task.label!r}): cost target {target} (its `cost_target` or "
                f"train.cost_targets.{task.category}) lies outside [{lo:.4g}, {hi:.4g}], the costs of the cheapest "
                f"and the dearest of the modes ({names}) at its training prompts' lengths; expected a target in "
                "that range"
            )


def spread(values: list[float], name: str) -> dict[str, float]:
    """``{name}_std`` (population), ``{name}_min``, ``{name}_max`` of ``values`` ({} when empty)."""
    if not values:
        return {}
    mean = sum(values) / len(values)
    return {
        f"{name}_std": (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5,
        f"{name}_min": min(values),
        f"{name}_max": max(values),
    }


def cost_summary(rows: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """A task's expected cost (mean, spread) and mean share of heads per mode, from per-sample rows
    with ``cost`` and ``shares`` (K values in ``labels``' order)."""
    costs = [r["cost"] for r in rows]
    if not costs:
        return {}
    shares = torch.tensor([r["shares"] for r in rows], dtype=torch.float64).mean(0)
    return {
        "cost": sum(costs) / len(costs),
        **spread(costs, "cost"),
        "mode_share": {label: round(float(s), 6) for label, s in zip(labels, shares)},
    }


class StepCost:
    """One step's expected cost and mode shares per task, summed over its micro-batches (and processes)."""

    def __init__(self, tasks: int, modes: int, device: torch.device) -> None:
        self.tasks, self.modes = tasks, modes
        # per task: cost sum, cost square sum, sample count, then the K share sums
        self.stats = torch.zeros(tasks, 3 + modes, dtype=torch.float64, device=device)

    def add(self, cost: torch.Tensor, shares: torch.Tensor, task: torch.Tensor) -> None:
        """``cost`` (B,) expected costs, ``shares`` (B, K) mode shares, ``task`` (B,) task indices."""
        cost = cost.detach().double().to(self.stats.device)
        rows = torch.cat([cost[:, None], (cost * cost)[:, None], torch.ones_like(cost)[:, None],
                          shares.detach().double().to(self.stats.device)], dim=1)
        self.stats.index_add_(0, task.to(self.stats.device), rows)

    def row(self, tasks: list[str], modes: list[str]) -> dict[str, Any]:
        """``cost`` and ``cost_std`` (over the step's samples) and ``mode_share`` ({mode: share}) per
        task; ``None`` for a task without samples this step."""
        cost: dict[str, float | None] = {}
        std: dict[str, float | None] = {}
        share: dict[str, dict[str, float] | None] = {}
        for k, label in enumerate(tasks):
            total, squares, n = (float(x) for x in self.stats[k, :3])
            if n == 0:
                cost[label] = std[label] = share[label] = None
                continue
            cost[label] = total / n
            std[label] = max(squares / n - (total / n) ** 2, 0.0) ** 0.5
            share[label] = {m: round(float(s) / n, 6) for m, s in zip(modes, self.stats[k, 3:])}
        return {"cost": cost, "cost_std": std, "mode_share": share}
