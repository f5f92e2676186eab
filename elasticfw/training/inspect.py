"""``elasticfw inspect ADAPTER RECIPE``: how a trained adapter routes held-back samples.

Each task of the recipe's ``train.tasks`` gives ``samples`` prompts of its eval split; each prompt
is prefilled once (no generation) and its routing kept. The result, printed and written to
``--out``: per task the MSR's mean, spread, minimum and maximum, the decision margins, the share of
samples routing each (layer, KV head) sparse (``routing.json``) and the heat map of the paper's
Fig. 6 (``routing.png``). With K >= 3 modes (or a recipe that constrains the cost) also per task the
expected cost's mean and spread and the share of heads per mode, and per sample its cost. A router
whose MSR has no spread within a task and no difference between tasks routes like a static assignment.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from elasticfw.atomic import atomic_write_text
from elasticfw.errors import TrainingError
from elasticfw.eval.dataset import samples_from_dataset, task_dataset
from elasticfw.eval.generate import pad_batch
from elasticfw.model.checkpoint import load_adapter
from elasticfw.model.loading import load_model
from elasticfw.registry import Registry, get_registry
from elasticfw.training.cost import cost_summary, mode_labels, reports_cost
from elasticfw.training.evaluate import msr_spread, routing_block


def route_samples(
    elastic: Any, tokenizer: Any, samples: list[Any], batch_size: int, *, costs: bool = False
) -> list[dict[str, Any]]:
    """Prefill ``samples`` in left-padded batches; per sample its MSR, decisions and P(sparse) (and,
    with ``costs``, its expected cost, mode shares and, for K >= 3 modes, each head's mode)."""
    device = next(elastic.base.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = []
    for i in range(0, len(samples), batch_size):
        ids, mask = pad_batch(samples[i : i + batch_size], pad_id, "left", device)
        with torch.no_grad():
            elastic(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                    logits_to_keep=1, use_cache=False)
        report = elastic.routing
        if costs:
            shares = report.mode_shares()
            cost = (shares * elastic.costs.table([len(s.input_ids) for s in samples[i : i + batch_size]])).sum(-1)
        for b in range(ids.shape[0]):
            rows.append({"msr": float(report.msr[b]), "decisions": report.decisions[b].int().tolist(),
                         "prob_sparse": report.prob_sparse[b].float().round(decimals=4).tolist()})
            if costs:
                rows[-1].update(cost=float(cost[b]), shares=shares[b].tolist())
                if report.mode_index is not None:
                    rows[-1]["modes"] = report.mode_index[b].tolist()
    return rows


def inspect_adapter(
    recipe: Any, adapter: str | Path, *, samples: int = 16, out: str | Path | None = None,
    registry: Registry | None = None, batch_size: int = 4,
) -> dict[str, Any]:
    """Route ``samples`` eval-split prompts of every training task through ``adapter``; the table
    (also written to ``out``/routing.json, with ``out``/routing.png, when ``out`` is given)."""
    if recipe.train is None or not recipe.train.tasks:
        raise TrainingError("inspect: the recipe has no train.tasks to draw held-back prompts from")
    registry = registry or get_registry()
    model, tokenizer = load_model(recipe.model, registry=registry)
    elastic = load_adapter(model, adapter, registry=registry, base_model=recipe.model.name)
    elastic.eval()
    rows: list[dict[str, Any]] = []
    tasks: dict[str, Any] = {}
    costed = reports_cost(elastic.heads.num_modes, recipe.train.constraint)
    modes = mode_labels([m.name for m in elastic.modes])
    try:
        for entry in recipe.train.tasks:
            plugin = registry.make("task", entry.task.model_copy(update={"num_samples": samples}))
            label = entry.label or plugin.name
            category = entry.category or plugin.category
            prompts = samples_from_dataset(task_dataset(plugin, tokenizer, seed=recipe.seed, split="eval"))
            routed = route_samples(elastic, tokenizer, prompts, batch_size, costs=costed)
            rows += [{"variant": "adapter", "task": label, "category": category, **r} for r in routed]
            msrs = [r["msr"] for r in routed]
            tasks[label] = {"category": category, "samples": len(msrs), "msr": sum(msrs) / len(msrs), **msr_spread(msrs)}
            if costed:
                tasks[label].update(cost_summary(routed, modes))
    finally:
        elastic.unwrap()
    result = {"adapter": str(adapter), "tasks": tasks, "routing": routing_block(rows, "adapter"),
              "per_sample": [{k: r[k] for k in ("task", "msr", "cost") if k in r} for r in rows]}
    if out is not None:
        from elasticfw.report.plots import heads_figure

        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / "routing.json", json.dumps(result, indent=2))
        heads_figure(rows, Path(adapter).name).savefig(folder / "routing.png", dpi=110)
    return result


def format_inspection(result: dict[str, Any]) -> str:
    """A plain-text table: per task its MSR mean, spread and range; then the decision margins."""
    costed = all("cost" in t for t in result["tasks"].values())
    lines = [f"{'task':<22} {'category':<9} {'n':>4} {'MSR':>6} {'std':>6} {'min':>6} {'max':>6}"
             + (f" {'cost':>6} {'std':>6} {'min':>6} {'max':>6}  share per mode" if costed else "")]
    for name, t in result["tasks"].items():
        line = (f"{name:<22} {t['category']:<9} {t['samples']:>4} {t['msr']:>6.3f} {t['msr_std']:>6.3f} "
                f"{t['msr_min']:>6.3f} {t['msr_max']:>6.3f}")
        if costed:
            line += (f" {t['cost']:>6.3f} {t['cost_std']:>6.3f} {t['cost_min']:>6.3f} {t['cost_max']:>6.3f}  "
                     + " ".join(f"{mode} {share:.3f}" for mode, share in t["mode_share"].items()))
        lines.append(line)
    m, r = result["routing"]["margins"], result["routing"]
    if m is not None:
        lines.append(f"decision margin |P(sparse) - 0.5|: median {m['p50']:.3f}, saturated (> 0.49) "
                     f"{m['saturated']:.1%}, near the boundary (< 0.05) {m['near_boundary']:.1%}")
    lines.append(f"samples routed unlike the majority assignment: {r['adaptive_samples']:.1%}; heads whose routing "
                 f"differs between sensitive and robust tasks by > 0.1: {len(r['task_dependent_heads'])}")
    return "\n".join(lines)
