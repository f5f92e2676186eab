"""One trainer for every router, mode pair and backbone: the Lagrangian sparsity objective.

Each step: the global batch of the step (a deterministic draw from the task mixture) is split
over processes and micro-batches; every micro-batch runs the elastic model in training mode
(every head computes both modes, mixed by the router's straight-through decision), the loss is
``CE(target tokens) / global target tokens + Σ penalty(MSR_i) / global batch`` (the expected cost
C_i instead of MSR_i under ``train.constraint: cost``; plus the per-mode share penalties of
``train.share_targets`` (:mod:`elasticfw.training.shares`) and ``train.logit_penalty`` times the
mean logit spread, when set), and after the
last micro-batch the router takes an AdamW step (warm-up + cosine) and the Lagrange multipliers
an Adam step of gradient *ascent*. Only router parameters and multipliers change: the backbone
is frozen and :func:`train_router` checks it is bit-identical at the end.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from elasticfw.errors import CheckpointError, TrainingError, UnsupportedInputError
from elasticfw.routing.gumbel import sample_noise
from elasticfw.training.cost import StepCost, check_cost_targets, mode_labels, reports_cost
from elasticfw.training.data import MixtureTask, collate, shard, step_slots
from elasticfw.training.diagnostics import GradientSplit, StepRouting, decision_probabilities, logit_spread
from elasticfw.training.distributed import DistContext
from elasticfw.training.logs import MetricsLog, plot_msr, read_metrics
from elasticfw.training.objective import Lagrangian, answer_cross_entropy, target_bounds
from elasticfw.training.shares import ShareConstraint, share_constraint
from elasticfw.training.state import (
    latest_checkpoint,
    load_optimizer,
    optimizer_tensors,
    read_checkpoint,
    save_checkpoint,
)


@dataclass
class TrainResult:
    run_dir: Path
    adapter_dir: Path
    steps: int
    last: dict[str, Any] = field(default_factory=dict)


def cosine_with_warmup(step: int, total: int, warmup_ratio: float) -> float:
    """LR multiplier: linear warm-up over ``warmup_ratio * total`` steps, then cosine decay to 0."""
    warm = int(round(warmup_ratio * total))
    if step < warm:
        return (step + 1) / warm
    rest = max(total - warm, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(step - warm, rest) / rest))


def _autocast(settings: Any, device: torch.device) -> contextlib.AbstractContextManager:
    precision = settings.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def checkpointed_backbone(model: Any, enabled: bool):
    """Gradient checkpointing of the frozen backbone's decoder layers (transformers' own mechanism;
    only the layers' ``training`` flag is set, so dropout and the like stay in eval mode)."""
    if not enabled:
        yield
        return
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UnsupportedInputError(
            f"train.gradient_checkpointing is on but {type(model).__name__} does not support gradient checkpointing"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer in layers:
            layer.training = False
        model.gradient_checkpointing_disable()


def _backbone_versions(model: Any) -> dict[str, int]:
    """Autograd version counter of every parameter and buffer: any in-place change bumps it (no copy
    of the weights, which would double the memory of a large backbone)."""
    return {k: v._version for k, v in model.state_dict(keep_vars=True).items()}


def train_router(
    elastic: Any,
    mixture: list[MixtureTask],
    settings: Any,
    run_dir: Path,
    *,
    seed: int,
    pad_id: int,
    resume: bool = False,
    dist: DistContext | None = None,
    progress: bool = True,
    check_frozen: bool = True,
) -> TrainResult:
    """Train ``elastic``'s router on ``mixture`` with ``settings`` (a recipe's ``train`` section)."""
    dist = dist or DistContext()
    device = next(elastic.base.parameters()).device
    params = elastic.trainable_parameters()
    if not params:
        raise UnsupportedInputError(
            f"elastic.router.name = {elastic.router.name!r} has no trainable parameters; train a learnable "
            "router (e.g. mlp or static)"
        )
    world = dist.world
    per_rank = settings.batch_size // world
    if settings.batch_size % world or per_rank % settings.micro_batch_size:
        raise UnsupportedInputError(
            f"train.batch_size ({settings.batch_size}) must split into {world} process(es) x whole micro-batches of "
            f"train.micro_batch_size ({settings.micro_batch_size})"
        )
    constraint = settings.constraint
    heads = elastic.heads
    if heads.num_modes > 2 and constraint != "cost":
        raise UnsupportedInputError(
            f"train.constraint = {constraint!r} with {heads.num_modes} modes: the MSR counts the heads not in mode 0 "
            "and cannot tell the other modes apart; expected train.constraint: cost with train.cost_targets"
        )
    if constraint == "cost":
        check_cost_targets(elastic.costs, mixture)
    lagrangian = Lagrangian([t.constrained_target(constraint) for t in mixture], settings.lambda_init).to(device)
    modes = mode_labels([m.name for m in elastic.modes])
    shares_c = share_constraint(mixture, modes, settings.lambda_init)
    if shares_c is not None:
        shares_c.to(device)
    multipliers = [*lagrangian.parameters(), *(shares_c.parameters() if shares_c is not None else [])]
    groups = router_groups(elastic.router, params, settings.lr_scale)
    optimizer = torch.optim.AdamW(
        [{"params": ps, "lr": settings.router_lr * settings.lr_scale.get(name, 1.0), "name": name}
         for name, ps in groups.items()],
        lr=settings.router_lr, betas=settings.betas, weight_decay=settings.weight_decay,
    )
    lambda_opt = torch.optim.Adam(multipliers, lr=settings.lambda_lr, maximize=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cosine_with_warmup(s, settings.steps, settings.warmup_ratio)
    )
    start = 0
    if resume:
        start = _restore(run_dir, elastic, lagrangian, optimizer, lambda_opt, scheduler, mixture, settings, seed, shares_c)

    model: Any = elastic
    if dist.enabled:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(elastic, device_ids=ids, broadcast_buffers=False)
    frozen = _backbone_versions(elastic.base) if check_frozen else None  # after DDP's initial broadcast
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(run_dir, resume_step=start if resume else None) if dist.is_main else None
    labels = [t.label for t in mixture]
    with_cost = reports_cost(heads.num_modes, constraint) or shares_c is not None
    bar = None
    if progress and dist.is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=settings.steps, initial=start, desc=f"train {elastic.router.name}", unit="step")
    elastic.train()
    last: dict[str, Any] = {}
    try:
        with checkpointed_backbone(elastic.base, settings.gradient_checkpointing):
            for step in range(start, settings.steps):
                t0 = time.perf_counter()
                elastic.set_progress(step / settings.steps)
                slots = step_slots(mixture, step, settings.batch_size, seed)
                target_tokens = sum(len(mixture[s.task].items[s.item].target) for s in slots)
                mine = shard(slots, dist.rank, world)
                optimizer.zero_grad(set_to_none=True)
                lambda_opt.zero_grad(set_to_none=True)
                # per task: msr sum, gap sum, count; then ce sum, penalty sum, tokens
                stats = torch.zeros(len(mixture) * 3 + 4, dtype=torch.float64, device=device)
                routing = StepRouting(len(mixture), heads.num_routed, heads.num_kv_heads, device)
                costs = StepCost(len(mixture), heads.num_modes, device) if with_cost else None
                every = settings.diagnostics_every
                split = GradientSplit(groups) if every and (step + 1) % every == 0 else None
                chunks = [mine[i : i + settings.micro_batch_size] for i in range(0, len(mine), settings.micro_batch_size)]
                for j, chunk in enumerate(chunks):
                    items = [mixture[s.task].items[s.item] for s in chunk]
                    batch = collate(items, pad_id).to(device)
                    elastic.router.set_noise(
                        sample_noise([s.noise_seed for s in chunk], heads.num_routed, heads.num_kv_heads, device,
                                     modes=heads.num_modes)
                    )
                    elastic.runtime.route_lengths = batch.route_lengths
                    sync = contextlib.nullcontext()
                    if dist.enabled and j < len(chunks) - 1:
                        sync = model.no_sync()
                    with sync:
                        with _autocast(settings, device):
                            out = model(
                                input_ids=batch.input_ids,
                                attention_mask=batch.attention_mask,
                                position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp_min(0),
                                logits_to_keep=batch.keep,
                                use_cache=False,
                            )
                        ce = answer_cross_entropy(out.logits, batch.labels)
                        msr = elastic.msr()
                        constrained = msr
                        if costs is not None:
                            shares = elastic.mode_shares()
                            table = elastic.costs.table([len(it.prompt) for it in items])  # at the prompt lengths
                            cost = (shares * table.to(shares.device, shares.dtype)).sum(-1)
                            if constraint == "cost":
                                constrained = cost
                        penalty = lagrangian.penalty(constrained, batch.task)
                        if shares_c is not None:
                            penalty = penalty + shares_c.penalty(shares, batch.task)
                        terms = {"penalty": penalty.sum() / settings.batch_size}
                        spread = logit_spread(elastic) if settings.logit_penalty else None
                        if spread is not None:
                            terms["logit"] = settings.logit_penalty * spread.sum() / settings.batch_size
                        if split is not None:
                            for name, term in terms.items():
                                split.add(name, term * world)
                        loss = ce / target_tokens + sum(terms.values())
                        (loss * world).backward()
                    with torch.no_grad():
                        gap = lagrangian.gap(constrained, batch.task)
                        if costs is not None:
                            costs.add(cost, shares, batch.task)
                        n = len(mixture)
                        stats.index_add_(0, batch.task, msr.detach().double())
                        stats.index_add_(0, batch.task + n, gap.double())
                        stats.index_add_(0, batch.task + 2 * n, torch.ones_like(gap, dtype=torch.float64))
                        stats[3 * n] += ce.detach().double()
                        stats[3 * n + 1] += penalty.detach().sum().double()
                        stats[3 * n + 2] += batch.tokens
                        if spread is not None:
                            stats[3 * n + 3] += spread.detach().sum().double()
                        prob = decision_probabilities(elastic)
                        if prob is not None:
                            routing.add(prob, batch.task)
                dist.all_reduce_(stats)
                dist.all_reduce_(routing.stats)
                if costs is not None:
                    dist.all_reduce_(costs.stats)
                for p in multipliers:
                    if p.grad is not None:
                        dist.all_reduce_(p.grad).div_(world)
                lm_loss = float(stats[3 * len(mixture)]) / target_tokens
                reg_loss = float(stats[3 * len(mixture) + 1]) / settings.batch_size
                if not (math.isfinite(lm_loss) and math.isfinite(reg_loss)) or not _grads_finite(params):
                    ckpt = latest_checkpoint(run_dir)
                    raise TrainingError(
                        f"step {step}: the loss is not finite (LM loss {lm_loss}, sparsity loss {reg_loss}) or the "
                        f"router's gradient is; training stopped before the update. The last good checkpoint is "
                        f"{str(ckpt) if ckpt else 'none (no checkpoint was written yet)'}; resume from it with "
                        "--resume after lowering train.router_lr / train.lambda_lr or using train.precision=fp32"
                    )
                parts = None
                if split is not None:  # before clipping; the terms averaged over processes like the total
                    split.reduce(lambda t: dist.all_reduce_(t).div_(world))
                    parts = split.row()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm or float("inf")))
                lr = settings.router_lr * cosine_with_warmup(step, settings.steps, settings.warmup_ratio)
                optimizer.step()
                lambda_opt.step()
                scheduler.step()
                for buffer in elastic.router.buffers():  # running statistics (e.g. input_norm) agree across processes
                    if buffer.is_floating_point():
                        dist.all_reduce_(buffer).div_(world)
                elapsed = time.perf_counter() - t0
                last = _row(step + 1, stats, mixture, lagrangian, lm_loss, reg_loss, lr, grad_norm, elastic, elapsed)
                last.update(routing.row(labels))
                if costs is not None:
                    last.update(costs.row(labels, modes))
                if shares_c is not None:
                    last.update(shares_c.row(labels, modes))
                if settings.logit_penalty:
                    last["logit_spread"] = float(stats[3 * len(mixture) + 3]) / settings.batch_size
                if parts is not None:
                    last["grad_norm_parts"] = parts
                if log is not None:
                    log.write(last)
                if bar is not None:
                    bar.update(1)
                    shown = "cost" if constraint == "cost" else "msr"
                    bar.set_postfix({"lm": f"{lm_loss:.3f}", "reg": f"{reg_loss:.3f}", shown: "/".join(
                        f"{last[shown][x]:.2f}" if last[shown][x] is not None else "-" for x in labels)})
                done = step + 1
                if done % settings.checkpoint_every == 0 or done == settings.steps:
                    if dist.is_main:
                        _save(run_dir, done, elastic, lagrangian, optimizer, lambda_opt, scheduler, mixture, settings, seed,
                              shares_c)
                    dist.barrier()
    finally:
        elastic.router.set_noise(None)
        elastic.runtime.route_lengths = None
        elastic.eval()
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
    if frozen is not None:
        changed = [k for k, v in _backbone_versions(elastic.base).items() if v != frozen.get(k)]
        if changed or any(p.requires_grad for p in elastic.base.parameters()):
            raise TrainingError(f"the frozen backbone changed during training ({changed[:3]}); this is a bug")
    adapter = run_dir / "adapter"
    if dist.is_main:
        elastic.save_adapter(adapter, overwrite=True)  # atomic; a resumed run replaces its adapter
        rows = read_metrics(run_dir)
        if rows and constraint == "cost":
            plot_msr(rows, run_dir / "cost.png", {t.label: target_bounds(t.cost_target) for t in mixture}, key="cost")
        elif rows:
            plot_msr(rows, run_dir / "msr.png", {t.label: target_bounds(t.target) for t in mixture})
    dist.barrier()
    return TrainResult(run_dir, adapter, settings.steps, last)


def router_groups(router: Any, params: list[torch.nn.Parameter], lr_scale: dict[str, float]) -> dict[str, list]:
    """The router's parameter groups (:meth:`~elasticfw.routing.base.Router.parameter_groups`), checked
    against the trainable parameters and ``train.lr_scale``'s names."""
    groups = {name: [p for p in ps if p.requires_grad] for name, ps in router.parameter_groups().items()}
    grouped = [id(p) for ps in groups.values() for p in ps]
    if sorted(grouped) != sorted(id(p) for p in params):
        raise TrainingError(
            f"router {router.name!r}: parameter_groups() must list every trainable parameter exactly once "
            f"({len(grouped)} listed, {len(params)} trainable); this is a bug in the router plugin"
        )
    unknown = sorted(set(lr_scale) - set(groups))
    if unknown:
        raise UnsupportedInputError(
            f"train.lr_scale names {unknown}, but router {router.name!r} has the parameter groups {sorted(groups)}"
        )
    return groups


def _grads_finite(params: list[torch.nn.Parameter]) -> bool:
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)


def _row(step, stats, mixture, lagrangian, lm_loss, reg_loss, lr, grad_norm, elastic, elapsed) -> dict[str, Any]:
    n = len(mixture)
    counts = stats[2 * n : 3 * n].tolist()
    msr = {t.label: (stats[i].item() / counts[i] if counts[i] else None) for i, t in enumerate(mixture)}
    gap = {t.label: (stats[n + i].item() / counts[i] if counts[i] else None) for i, t in enumerate(mixture)}
    tau = getattr(elastic.router, "temperature", None)
    schedule = getattr(elastic.router, "schedule", None)
    return {
        "step": step,
        "lm_loss": lm_loss,
        "reg_loss": reg_loss,
        "loss": lm_loss + reg_loss,
        "msr": msr,
        "gap": gap,
        "samples": {t.label: int(counts[i]) for i, t in enumerate(mixture)},
        "lambda1": {t.label: float(lagrangian.lambda1[i].detach()) for i, t in enumerate(mixture)},
        "lambda2": {t.label: float(lagrangian.lambda2[i].detach()) for i, t in enumerate(mixture)},
        "tau": float(tau()) if callable(tau) else (float(schedule(elastic.router.progress)) if schedule else None),
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": float(stats[3 * n + 2]) / max(elapsed, 1e-9),
        "seconds": elapsed,
    }


def _save(run_dir, step, elastic, lagrangian, optimizer, lambda_opt, scheduler, mixture, settings, seed,
          shares: ShareConstraint | None = None) -> None:
    r_tensors, r_meta = optimizer_tensors(optimizer, "router_opt")
    l_tensors, l_meta = optimizer_tensors(lambda_opt, "lambda_opt")
    tensors = {**r_tensors, **l_tensors, "lagrangian.lambda1": lagrangian.lambda1, "lagrangian.lambda2": lagrangian.lambda2}
    if shares is not None:
        tensors.update({"shares.lambda1": shares.inner.lambda1, "shares.lambda2": shares.inner.lambda2})
    meta = {
        "router_opt": r_meta,
        "lambda_opt": l_meta,
        "scheduler": scheduler.state_dict() | {"lr_lambdas": None},
        "tasks": [t.label for t in mixture],
        "targets": [list(target_bounds(t.constrained_target(settings.constraint))) for t in mixture],
        **({"constraint": settings.constraint} if settings.constraint != "msr" else {}),
        **({"share_targets": _share_meta(shares)} if shares is not None else {}),
        "steps": settings.steps,
        "batch_size": settings.batch_size,
        "seed": seed,
    }
    save_checkpoint(run_dir, step, elastic, tensors, meta, keep=settings.keep_checkpoints)


def _share_meta(shares: ShareConstraint | None) -> list[dict[str, list[float]]] | None:
    """Each task's share targets for a checkpoint's JSON metadata: [lo, hi] by mode index (as text)."""
    return None if shares is None else [{str(k): b for k, b in per.items()} for per in shares.bounds()]


def _restore(run_dir, elastic, lagrangian, optimizer, lambda_opt, scheduler, mixture, settings, seed,
             shares: ShareConstraint | None = None) -> int:
    from elasticfw.model.checkpoint import WEIGHTS, read_adapter_config
    from elasticfw.training.state import load_tensors

    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(f"--resume: {run_dir} has no checkpoint to resume from (checkpoints/latest is missing)")
    tensors, meta = read_checkpoint(ckpt)
    labels = [t.label for t in mixture]
    for key, now in (("steps", settings.steps), ("batch_size", settings.batch_size), ("seed", seed)):
        if key in meta and meta[key] != now:
            raise CheckpointError(
                f"--resume: checkpoint {ckpt} was trained with {key}={meta[key]}, the recipe now has {now}; the "
                "steps' samples and the schedule would differ (start a new run, or resume with the old value)"
            )
    targets = [list(target_bounds(t.constrained_target(settings.constraint))) for t in mixture]
    if meta.get("constraint", "msr") != settings.constraint:
        raise CheckpointError(
            f"--resume: checkpoint {ckpt} was trained with train.constraint = {meta.get('constraint', 'msr')!r}, the "
            f"recipe now has {settings.constraint!r}; start a new run, or resume with the old constraint"
        )
    if meta.get("share_targets") != _share_meta(shares):
        raise CheckpointError(
            f"--resume: checkpoint {ckpt} was trained with share targets {meta.get('share_targets')} (task -> mode "
            f"index -> [lo, hi]), the recipe now has {_share_meta(shares)}; start a new run, or resume with the old ones"
        )
    if meta.get("tasks") != labels or meta.get("targets") != targets:
        raise CheckpointError(
            f"--resume: checkpoint {ckpt} was trained on tasks {meta.get('tasks')} with targets {meta.get('targets')}; "
            f"the recipe now has {labels} with {targets}"
        )
    saved = read_adapter_config(ckpt)
    if saved.get("elastic", {}).get("router", {}).get("name") != elastic.router.name:
        raise CheckpointError(
            f"--resume: checkpoint {ckpt} holds router {saved.get('elastic', {}).get('router', {}).get('name')!r}, "
            f"the recipe trains {elastic.router.name!r}"
        )
    device = next(elastic.router.parameters()).device
    state = load_tensors(ckpt / WEIGHTS, device=str(device))
    try:
        elastic.router.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # missing/unexpected keys or shapes: another router's checkpoint
        raise CheckpointError(f"--resume: {ckpt / WEIGHTS} does not fit router {elastic.router.name!r}: "
                              f"{str(exc).splitlines()[0][:300]}") from None
    elastic.router.load_extra_state(saved.get("router_state") or {})
    with torch.no_grad():
        lagrangian.lambda1.copy_(tensors["lagrangian.lambda1"])
        lagrangian.lambda2.copy_(tensors["lagrangian.lambda2"])
        if shares is not None:
            shares.inner.lambda1.copy_(tensors["shares.lambda1"])
            shares.inner.lambda2.copy_(tensors["shares.lambda2"])
    # (load_state_dict moves each moment to its parameter's device)
    try:
        load_optimizer(optimizer, "router_opt", tensors, meta["router_opt"])
        load_optimizer(lambda_opt, "lambda_opt", tensors, meta["lambda_opt"])
    except (ValueError, KeyError) as exc:  # another optimiser layout (e.g. parameter groups of an older version)
        raise CheckpointError(
            f"--resume: the optimiser state in {ckpt} does not fit this router's parameter groups "
            f"({', '.join(g.get('name', '?') for g in optimizer.param_groups)}): {exc}"
        ) from None
    sched = dict(meta["scheduler"])
    sched.pop("lr_lambdas", None)
    scheduler.load_state_dict(sched | {"lr_lambdas": [None]})
    # the recipe's rates win over the saved ones (e.g. a lower lr after a non-finite loss); unchanged
    # settings give back exactly the saved values
    start = int(meta["step"])
    peaks = [settings.router_lr * settings.lr_scale.get(group.get("name", ""), 1.0) for group in optimizer.param_groups]
    scheduler.base_lrs = peaks
    for group, peak in zip(optimizer.param_groups, peaks):
        group.update(initial_lr=peak, weight_decay=settings.weight_decay, betas=settings.betas,
                     lr=peak * cosine_with_warmup(start, settings.steps, settings.warmup_ratio))
    for group in lambda_opt.param_groups:
        group["lr"] = settings.lambda_lr
    return start
