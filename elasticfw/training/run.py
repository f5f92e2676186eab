"""``elasticfw train RECIPE``: train the recipe's router (and its baselines), then evaluate them
and full attention on every task's held-back samples.

    <output_dir>/
        recipe.yaml                 the resolved recipe
        <router label>/             one folder per trained router (the recipe's, then each baseline)
            adapter/                the trained router: load with elasticfw.model.checkpoint.load_adapter
            checkpoints/            resumable state (--resume)
            metrics.jsonl           one line per step;  tensorboard/  TensorBoard logs
            msr.png                 MSR per task and the Lagrange multipliers over the steps
            cost.png                under train.constraint: cost, instead of msr.png: the expected cost per task
        summary.json                per router and task: MSR, accuracy, full attention's accuracy (K >= 3
                                    modes or train.constraint: cost: also the expected cost and mode shares)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from elasticfw.atomic import atomic_write_text
from elasticfw.errors import CheckpointError, TrainingError
from elasticfw.eval.dataset import samples_from_dataset, task_dataset
from elasticfw.eval.task import context_window
from elasticfw.model.loading import load_model, make_elastic
from elasticfw.registry import Registry, get_registry
from elasticfw.training.data import MixtureTask, check_items, encode_targets
from elasticfw.training.distributed import DistContext, init_distributed, shutdown
from elasticfw.training.trainer import TrainResult, train_router

SUMMARY = "summary.json"


def _say(text: str) -> None:
    print(f"[elasticfw] {text}", file=sys.stderr, flush=True)


def build_mixture(recipe: Any, tokenizer: Any, model: Any, registry: Registry) -> list[MixtureTask]:
    """The training pool of every task of ``recipe.train.tasks`` (split "train")."""
    settings = recipe.train
    mixture = []
    for index, entry in enumerate(settings.tasks):
        task = registry.make("task", entry.task)
        label = entry.label or task.name
        category = entry.category or task.category
        target = entry.target if entry.target is not None else settings.targets.get(category)
        if target is None:
            raise TrainingError(
                f"train.tasks.{index} ({label!r}): no sparsity target: set its `target` or train.targets.{category}"
            )
        cost_target = None
        if settings.constraint == "cost":
            cost_target = entry.cost_target if entry.cost_target is not None else settings.cost_targets.get(category)
            if cost_target is None:
                raise TrainingError(
                    f"train.tasks.{index} ({label!r}): train.constraint = 'cost' and no cost target; expected its "
                    f"`cost_target` or train.cost_targets.{category} (a relative cost, full attention = 1)"
                )
        samples = samples_from_dataset(task_dataset(task, tokenizer, seed=recipe.seed, split="train"))
        items = encode_targets(task, samples, tokenizer, index, label)
        check_items(label, items, context_window(model))
        shares = entry.share_targets if entry.share_targets is not None else settings.share_targets.get(category, {})
        mixture.append(MixtureTask(label, task, category, target, entry.weight, items, cost_target, dict(shares)))
    return mixture


def prepare_run_dir(path: Path, *, resume: bool, overwrite: bool, dist: DistContext) -> None:
    """Refuse to mix a new run into an existing one unless asked (--resume / --overwrite)."""
    if resume and overwrite:
        raise TrainingError("--resume and --overwrite exclude one another")
    if path.exists() and not path.is_dir():
        raise TrainingError(f"train.output_dir {str(path)!r} exists and is not a folder")
    busy = path.is_dir() and any(path.iterdir())
    if resume and not busy:
        raise TrainingError(f"--resume: {str(path)!r} holds no run to resume")
    if busy and not resume and not overwrite:
        raise TrainingError(
            f"train.output_dir {str(path)!r} already holds a run; pass --resume to continue it, --overwrite to "
            "replace it, or choose another output_dir"
        )
    if dist.is_main:
        if busy and overwrite:
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()


def _router_runs(recipe: Any) -> list[tuple[str, Any, Any]]:
    """(label, elastic section, train settings) of the recipe's router, then of each baseline."""
    main = recipe.elastic.router
    runs = [(main.name, recipe.elastic, recipe.train)]
    for b in recipe.train.baselines:
        settings = recipe.train if b.router_lr is None else recipe.train.model_copy(update={"router_lr": b.router_lr})
        runs.append((b.label or b.router.name, recipe.elastic.model_copy(update={"router": b.router}), settings))
    labels = [label for label, _, _ in runs]
    if len(set(labels)) != len(labels):
        raise TrainingError(
            f"train.baselines: a baseline is called like the recipe's own router ({labels}); give it a `label`"
        )
    return runs


def _has_checkpoint(run_dir: Path) -> bool:
    from elasticfw.training.state import latest_checkpoint

    try:
        return latest_checkpoint(run_dir) is not None
    except CheckpointError:
        return False


def _finished(run_dir: Path, steps: int) -> bool:
    """A router folder whose adapter was written after its last step."""
    from elasticfw.training.state import latest_checkpoint

    try:
        ckpt = latest_checkpoint(run_dir)
    except CheckpointError:
        return False
    return (run_dir / "adapter").is_dir() and ckpt is not None and ckpt.name == f"step-{steps:06d}"


def run_training(
    recipe: Any,
    *,
    output: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    registry: Registry | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train, evaluate, summarise (see the module docstring). Returns the summary."""
    if recipe.train is None:
        raise TrainingError("train: the recipe has no `train:` section (tasks, targets, steps); see docs/how-to/train-a-router.md")
    registry = registry or get_registry()
    dist = init_distributed(recipe.model.device)
    try:
        runs = _router_runs(recipe)  # label clashes are refused before anything is loaded
        root = Path(output or recipe.train.output_dir)
        prepare_run_dir(root, resume=resume, overwrite=overwrite, dist=dist)
        section = recipe.model
        if dist.device is not None:
            section = section.model_copy(update={"device": str(dist.device)})
        _say(f"loading model {recipe.model.name!r} ({section.dtype}, {section.device})")
        model, tokenizer = load_model(section, registry=registry)
        if dist.is_main:
            atomic_write_text(root / "recipe.yaml", yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
        if not dist.is_main:  # rank 0 fills the sample cache first; the others then read it
            dist.barrier()
        mixture = build_mixture(recipe, tokenizer, model, registry)
        if dist.is_main:
            dist.barrier()
        for t in mixture:
            lengths = [it.length for it in t.items]
            goal = f"cost target {t.cost_target}" if recipe.train.constraint == "cost" else f"target {t.target}"
            _say(f"task {t.label!r} ({t.category}, {goal}): {len(t.items)} training samples, "
                 f"{min(lengths)}-{max(lengths)} tokens")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        results: dict[str, TrainResult | Path] = {}
        for label, elastic_section, settings in runs:
            run_dir = root / label
            if resume and _finished(run_dir, recipe.train.steps):
                _say(f"router {label!r}: already trained, kept")
                results[label] = run_dir / "adapter"
                continue
            again = resume and _has_checkpoint(run_dir)
            if dist.is_main:
                run_dir.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            elastic = make_elastic(model, tokenizer, elastic_section, registry=registry,
                                   base_model_name=recipe.model.name, seed=recipe.seed)
            try:
                _say(f"training router {label!r} ({elastic_section.modes_label()}), "
                     f"{recipe.train.steps} steps x {recipe.train.batch_size} samples")
                results[label] = train_router(elastic, mixture, settings, run_dir, seed=recipe.seed, pad_id=pad_id,
                                              resume=again, dist=dist, progress=progress)
            finally:
                elastic.unwrap()
        summary: dict[str, Any] = {}
        if recipe.train.evaluate and dist.is_main:
            from elasticfw.training.evaluate import (
                evaluate_heldout,
                format_summary,
                summary_dict,
                write_routing_figures,
            )

            adapters = {label: (r.adapter_dir if isinstance(r, TrainResult) else r) for label, r in results.items()}
            evals = evaluate_heldout(recipe, model, tokenizer, mixture, adapters, registry=registry, progress=progress)
            summary = summary_dict(recipe, mixture, evals, model)
            atomic_write_text(root / SUMMARY, json.dumps(summary, indent=2))
            write_routing_figures(evals, mixture, root)
            print(format_summary(summary), flush=True)
            _say(f"summary written to {root / SUMMARY}")
        dist.barrier()
        return summary
    finally:
        shutdown(dist)
