"""Cross-section checks of the training objective: which quantity ``train.constraint`` constrains,
whether the modes allow it, and whether each task's cost target lies within the modes' costs.

Training among K >= 3 modes needs ``train.constraint: cost``: the MSR counts the heads that leave
mode 0 and cannot tell a cheap mode from a dear one. Cost targets are checked against the costs of
the modes (:meth:`~elasticfw.attention.mode.AttentionMode.cost`) at a task's ``context_tokens``
where the task has that field; the trainer checks them again at the training prompts' own lengths.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationInfo

from elasticfw.attention.mode import ModeCosts
from elasticfw.registry import Registry, get_registry
from elasticfw.training.cost import mode_labels

#: an example of the cost targets, for the messages
_EXAMPLE = "{sensitive: 0.6, robust: 0.45}"


def check_train_objective(recipe: Any, info: ValidationInfo) -> Any:
    """The ``train`` section's constraint against the ``elastic`` section's modes (see the module)."""
    train = recipe.train
    if train is None:
        return recipe
    elastic = recipe.elastic
    k, names = elastic.num_modes, ", ".join(m.name for m in elastic.mode_configs())
    given = [i for i, entry in enumerate(train.tasks) if entry.cost_target is not None]
    mode_names = [m.name for m in elastic.mode_configs()]
    for category, targets in train.share_targets.items():
        _check_share_targets(targets, mode_names, f"train.share_targets.{category}")
    for i, entry in enumerate(train.tasks):
        if entry.share_targets:
            _check_share_targets(entry.share_targets, mode_names, f"train.tasks.{i}.share_targets")
    if train.constraint == "msr":
        if k > 2:
            raise ValueError(
                f"train.constraint = 'msr' with {k} modes in elastic.modes ({names}): the MSR counts the heads not "
                "in mode 0 and cannot tell the other modes apart, so training among K >= 3 modes constrains the "
                f"expected cost; expected train.constraint: cost and train.cost_targets per category (e.g. {_EXAMPLE}: "
                "relative costs, full attention = 1); see docs/how-to/route-among-modes.md"
            )
        if train.cost_targets or given:
            where = "train.cost_targets" if train.cost_targets else f"train.tasks.{given[0]}.cost_target"
            raise ValueError(
                f"{where} is set but train.constraint = 'msr' constrains the MSR against train.targets; expected "
                "train.constraint: cost to constrain the expected cost (or drop the cost targets)"
            )
        return recipe
    registry: Registry = (info.context or {}).get("registry") or get_registry()
    costs = ModeCosts([registry.make("sparse_mode", config) for config in elastic.mode_configs()])
    for i, entry in enumerate(train.tasks):
        category = entry.category or getattr(registry.get("task", entry.task.name), "category", None)
        label = entry.label or entry.task.name
        if entry.cost_target is not None:
            target, where = entry.cost_target, f"train.tasks.{i}.cost_target"
        else:
            target, where = train.cost_targets.get(category), f"train.cost_targets.{category}"
        if target is None:
            raise ValueError(
                f"train.constraint = 'cost' and train.tasks.{i} ({label!r}, {category}) has no cost target: "
                f"train.cost_targets.{category} is not set; expected train.cost_targets (e.g. {_EXAMPLE}) or the "
                "task's `cost_target` (a relative cost, full attention = 1)"
            )
        length = getattr(entry.task, "context_tokens", None)
        if not isinstance(length, int) or length < 1:
            continue  # the trainer checks it at the prompts' lengths
        lo, hi = costs.bounds([length])
        values = (target,) if isinstance(target, (int, float)) else tuple(target)
        if min(values) < lo - 1e-9 or max(values) > hi + 1e-9:
            shown = list(target) if isinstance(target, tuple) else target
            raise ValueError(
                f"{where} = {shown}: outside [{lo:.4g}, {hi:.4g}], the costs of the cheapest and the dearest of "
                f"elastic.modes ({names}) at the {length} tokens of task {label!r}; expected a cost in that range (a mode's "
                "`cost` overrides its estimate)"
            )
    return recipe


def _check_share_targets(targets: dict[str, Any], names: list[str], where: str) -> None:
    """Share targets (at recipe field ``where``) name modes of ``elastic.modes`` (by
    :func:`~elasticfw.training.cost.mode_labels`), and where they list every mode their upper bounds
    leave room for all heads."""
    labels = mode_labels(names)
    unknown = sorted(set(targets) - set(labels))
    if unknown:
        raise ValueError(f"{where} names {unknown}, which are not modes of elastic.modes; expected some of {labels}")
    if set(targets) == set(labels):
        highs = sum(t if isinstance(t, (int, float)) else t[1] for t in targets.values())
        if highs < 1.0 - 1e-9:
            raise ValueError(
                f"{where} lists every mode, and their upper bounds add up to {highs:.4g}, below 1; expected shares "
                "that can account for every head"
            )
