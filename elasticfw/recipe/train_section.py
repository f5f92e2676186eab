"""The ``train:`` section of a recipe: the plugin-independent settings of router training.

The task mixture (``train.tasks``) and the baselines (``train.baselines``) hold plugin sections,
so they are built with the registry in :mod:`elasticfw.recipe.schema`; everything else is here.
Defaults are the paper's (arXiv 2601.17367, Table 6 and App. D.1).
"""

from __future__ import annotations

import math
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

#: a sparsity target: one value t, or an interval [t_lo, t_hi] with no penalty inside
Target = Union[float, tuple[float, float]]


def check_target(value: Target | None) -> Target | None:
    """A target is a number in [0, 1] or an interval [lo, hi] inside [0, 1] with lo <= hi."""
    if value is None:
        return None
    values = (value,) if isinstance(value, (int, float)) else tuple(value)
    for v in values:
        if not math.isfinite(v) or not 0.0 <= v <= 1.0:
            raise ValueError(f"a sparsity target must lie in [0, 1], got {v!r}")
    if len(values) == 2 and values[0] > values[1]:
        raise ValueError(f"a target interval [lo, hi] needs lo <= hi, got [{values[0]}, {values[1]}]")
    return value


def check_cost_target(value: Target | None) -> Target | None:
    """A cost target is a relative cost >= 0 (full attention = 1), or an interval [lo, hi] with lo <= hi.
    Whether the modes can reach it is checked against their costs (:mod:`elasticfw.recipe.train_checks`)."""
    if value is None:
        return None
    values = (value,) if isinstance(value, (int, float)) else tuple(value)
    for v in values:
        if not math.isfinite(v) or not 0.0 <= v <= 100.0:
            raise ValueError(f"a cost target is a relative cost in [0, 100] (full attention = 1), got {v!r}")
    if len(values) == 2 and values[0] > values[1]:
        raise ValueError(f"a cost target interval [lo, hi] needs lo <= hi, got [{values[0]}, {values[1]}]")
    return value


def check_share_targets(targets: dict[str, Target] | None, where: str = "") -> dict[str, Target] | None:
    """Share targets {mode: share of heads or [lo, hi]}: each share in [0, 1], and lower bounds that can
    hold together (their sum at most 1). Whether the modes exist is checked against ``elastic.modes``
    (:mod:`elasticfw.recipe.train_checks`). ``where``: a prefix for the messages."""
    if targets is None:
        return None
    for mode, target in targets.items():
        try:
            check_target(target)
        except ValueError as exc:
            raise ValueError(f"{where}{mode} = {target!r}: a share of heads; {exc}") from None
    lows = sum(t if isinstance(t, (int, float)) else t[0] for t in targets.values())
    if lows > 1.0 + 1e-9:
        raise ValueError(f"{where.rstrip('.') or 'share targets'}: the lower bounds of the share targets add up to "
                         f"{lows:.4g}, above 1; expected shares that can hold together")
    return targets


def _paper_targets() -> dict[Literal["sensitive", "robust"], Target]:
    return {"sensitive": 0.7, "robust": 1.0}


class TrainTaskBase(BaseModel):
    """What every ``train.tasks`` entry has beside its fields (built with the registry in
    :mod:`elasticfw.recipe.schema`): a dump leaves out an unset ``cost_target`` and ``share_targets``, so
    an entry that does not use them dumps as before."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        data = handler(self)
        for unset in ("cost_target", "share_targets"):
            if isinstance(data, dict) and unset in data and data[unset] is None:
                del data[unset]
        return data


class TrainSettings(BaseModel):
    """Router training: the Lagrangian sparsity objective (paper Eq. 8) and its optimisation."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    steps: int = Field(300, ge=1, le=10_000_000, description="Optimiser steps (paper: 300).")
    batch_size: int = Field(48, ge=1, le=1_000_000, description="Global batch: samples per optimiser step (paper: 48).")
    micro_batch_size: int = Field(
        4, ge=1, le=4096, description="Samples per forward pass; batch_size / (micro_batch_size x processes) are accumulated."
    )
    router_lr: float = Field(5e-4, gt=0, le=10, description="Peak learning rate of the router (paper: 5e-4).")
    lambda_lr: float = Field(1e-3, gt=0, le=10, description="Learning rate of the Lagrange multipliers, by gradient ascent (paper: 1e-3).")
    lambda_init: float = Field(0.0, ge=-1e3, le=1e3, description="Initial value of every Lagrange multiplier.")
    weight_decay: float = Field(0.1, ge=0, le=10, description="AdamW weight decay of the router (paper: 0.1).")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas (paper: 0.9, 0.95).")
    warmup_ratio: float = Field(0.2, ge=0, le=1, description="Linear warm-up over this fraction of the steps, then cosine decay (paper: 0.2).")
    max_grad_norm: float | None = Field(None, gt=0, description="Clip the router's gradient norm (off in the paper).")
    lr_scale: dict[str, float] = Field(
        default_factory=dict,
        description="Learning-rate multiplier per part of the router, by the names its parameter_groups() gives "
        "(mlp: task_mlp, router_mlp); unnamed parts keep router_lr (paper: one rate).",
    )
    logit_penalty: float = Field(
        0.0, ge=0, le=1e3,
        description="Weight of a margin term: the mean over samples, layers and KV heads of the variance of a "
        "decision's logits across modes ((z_sparse - z_full)^2 / 4 for two). It keeps logits within the Gumbel "
        "noise's scale, where every decision still passes a gradient (off in the paper: 0).",
    )
    diagnostics_every: int = Field(
        10, ge=0,
        description="Every N steps, log the router's gradient norm per part split into the LM loss's share and the "
        "sparsity penalty's (two extra backward passes on those steps); 0: never. Decision margins and P(sparse) "
        "per task, layer and head are logged at every step.",
    )
    targets: dict[Literal["sensitive", "robust"], Target] = Field(
        default_factory=lambda: _paper_targets(),
        description="Default sparsity target per task category (paper: 0.7 sensitive, 1.0 robust); a task entry's `target` overrides it.",
    )
    constraint: Literal["msr", "cost"] = Field(
        "msr",
        description="The quantity the Lagrangian constrains per task. msr: the model sparsity ratio (the share of "
        "heads not in mode 0) against `targets` (the paper; two modes). cost: the expected cost, per sample the mean "
        "over routed (layer, KV head) of sum_k m_k cost_k (m the router's straight-through one-hot, cost_k mode k's "
        "relative cost at the prompt's length), against `cost_targets`; needed to train among K >= 3 modes.",
    )
    cost_targets: dict[Literal["sensitive", "robust"], Target] = Field(
        default_factory=dict,
        description="With constraint: cost, the expected-cost target per task category: a relative cost (full "
        "attention = 1) between the cheapest and the dearest mode's, or an interval [lo, hi]; a task entry's "
        "`cost_target` overrides it.",
    )
    share_targets: dict[Literal["sensitive", "robust"], dict[str, Target]] = Field(
        default_factory=dict,
        description="Per task category, a target share of heads for some of the modes, by their name in "
        "elastic.modes (e.g. {sensitive: {full: [0.2, 1.0]}, robust: {streaming: [0.5, 1.0]}}): a share in [0, 1] "
        "or an interval. Each listed (task, mode) gets its own Lagrange multipliers, beside the MSR or cost "
        "constraint; modes not listed are free.",
    )
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="auto: bf16 autocast on CUDA, fp32 elsewhere."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute the frozen backbone's decoder layers in the backward pass (memory at long context)."
    )
    checkpoint_every: int = Field(50, ge=1, description="Write a resumable checkpoint every N steps (and at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="How many of the latest checkpoints to keep.")
    output_dir: str = Field("runs/train", min_length=1, description="The run folder (refused if it holds a run, unless --resume or --overwrite).")
    evaluate: bool = Field(True, description="After training, evaluate on each task's held-back samples (and full attention on the same samples).")
    eval_batch_size: int = Field(4, ge=1, le=4096, description="Samples per generate() call in the held-back evaluation.")

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"AdamW betas must lie in [0, 1), got {list(value)}")
        return value

    @field_validator("targets")
    @classmethod
    def _targets(cls, value: dict[str, Target]) -> dict[str, Target]:
        for target in value.values():
            check_target(target)
        return value

    @field_validator("cost_targets")
    @classmethod
    def _cost_targets(cls, value: dict[str, Target]) -> dict[str, Target]:
        for category, target in value.items():
            try:
                check_cost_target(target)
            except ValueError as exc:
                raise ValueError(f"{category} = {target!r}: {exc}") from None
        return value

    @field_validator("share_targets")
    @classmethod
    def _share_targets(cls, value: dict[str, dict[str, Target]]) -> dict[str, dict[str, Target]]:
        for category, targets in value.items():
            check_share_targets(targets, f"{category}.")
        return value

    @field_validator("lr_scale")
    @classmethod
    def _lr_scale(cls, value: dict[str, float]) -> dict[str, float]:
        for name, scale in value.items():
            if not math.isfinite(scale) or scale <= 0:
                raise ValueError(f"lr_scale.{name} must be a positive finite multiplier, got {scale!r}")
        return value

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        """The cost objective's and the share targets' fields are left out of dumps while unused: a section that does not set
        them dumps (and hashes) as before."""
        data = handler(self)
        if isinstance(data, dict) and data.get("constraint") == "msr" and not data.get("cost_targets"):
            data.pop("constraint", None)
            data.pop("cost_targets", None)
        if isinstance(data, dict) and not data.get("share_targets"):
            data.pop("share_targets", None)
        return data

    @model_validator(mode="after")
    def _batches(self) -> TrainSettings:
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of micro_batch_size ({self.micro_batch_size})"
            )
        return self
