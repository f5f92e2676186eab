"""Held-back evaluation after training: every trained router and full attention (the unmodified
backbone) on the same eval-split samples of every training task; the summary JSON and table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elasticfw.eval.dataset import samples_from_dataset, task_dataset
from elasticfw.eval.generate import evaluate
from elasticfw.model.checkpoint import load_adapter
from elasticfw.provenance import environment
from elasticfw.registry import Registry
from elasticfw.report.stats import mean_interval
from elasticfw.training.cost import cost_summary, mode_labels, reports_cost, spread
from elasticfw.training.data import MixtureTask
from elasticfw.training.objective import target_bounds

FULL = "full"


def heldout_samples(recipe: Any, mixture: list[MixtureTask], tokenizer: Any) -> dict[str, tuple[Any, list[Any]]]:
    """``eval_samples`` samples of the eval split of every task (its own pool, disjoint from training's)."""
    out = {}
    for entry, task in zip(recipe.train.tasks, mixture):
        if entry.eval_samples == 0:
            continue
        plugin = type(task.task)(entry.task.model_copy(update={"num_samples": entry.eval_samples}))
        out[task.label] = (plugin, samples_from_dataset(task_dataset(plugin, tokenizer, seed=recipe.seed, split="eval")))
    return out


def evaluate_heldout(
    recipe: Any,
    model: Any,
    tokenizer: Any,
    mixture: list[MixtureTask],
    adapters: dict[str, Path],
    *,
    registry: Registry | None = None,
    progress: bool = True,
) -> dict[str, dict[str, dict[str, Any]]]:
    """{variant: {task label: summary + per-sample rows}} for full attention and each adapter."""
    sets = heldout_samples(recipe, mixture, tokenizer)
    settings = recipe.train
    results: dict[str, dict[str, dict[str, Any]]] = {}
    variants: list[tuple[str, Path | None]] = [(FULL, None), *adapters.items()]
    for label, adapter in variants:
        subject = model if adapter is None else load_adapter(
            model, adapter, registry=registry, base_model=recipe.model.name)
        try:
            per_task = {}
            costed = adapter is not None and reports_cost(subject.heads.num_modes, settings.constraint)
            for task_label, (task, samples) in sets.items():
                res = evaluate(subject, tokenizer, task, samples, batch_size=settings.eval_batch_size,
                               max_new_tokens=task.max_new_tokens)
                per_task[task_label] = {
                    **res.summary(),
                    "per_sample": [{"score": r.score, "msr": r.msr, "esr": r.esr, "tokens": r.tokens,
                                    "completion": r.completion, "decisions": r.decisions,
                                    "prob_sparse": r.prob_sparse,
                                    **({"modes": r.modes} if costed and r.modes is not None else {}),
                                    **({"cost": r.cost, "shares": r.shares} if costed else {})}
                                   for r in res.results],
                }
                if progress:
                    s = per_task[task_label]
                    cost = (f"cost {sum(r.cost for r in res.results if r.cost is not None) / len(res.results):.3f}  "
                            if costed and res.results else "")
                    print(f"  {label:<10} {task_label:<22} {task.metric} {s['accuracy']:.3f}  MSR {s['msr']:.3f}  "
                          f"{cost}({s['samples']} samples, {s['seconds']:.0f}s)", flush=True)
            results[label] = per_task
        finally:
            if adapter is not None:
                subject.unwrap()
    return results


def summary_dict(recipe: Any, mixture: list[MixtureTask], evals: dict[str, Any], model: Any) -> dict[str, Any]:
    """The run's summary: per router and task, MSR, accuracy and full attention's accuracy; with K >= 3
    modes or ``train.constraint: cost`` also the expected cost (mean, spread), its target, and the share
    of heads per mode."""
    import torch

    full = evals.get(FULL, {})
    modes = mode_labels([m.name for m in recipe.elastic.mode_configs()])
    routers: dict[str, Any] = {}
    for label, per_task in evals.items():
        if label == FULL:
            continue
        tasks = {}
        for t in mixture:
            if t.label not in per_task:
                continue
            r, f = per_task[t.label], full.get(t.label, {})
            tasks[t.label] = {
                "category": t.category,
                "metric": t.task.metric,
                "target": list(target_bounds(t.target)),
                "msr": r["msr"],
                **msr_spread([row["msr"] for row in r["per_sample"]]),
                "esr": r["esr"],
                "accuracy": r["accuracy"],
                "full_accuracy": f.get("accuracy"),
                "samples": r["samples"],
                **score_intervals(
                    [row["score"] for row in r["per_sample"]], [row["score"] for row in f.get("per_sample", [])]
                ),
            }
            costed = [row for row in r["per_sample"] if row.get("cost") is not None]
            if costed:
                if t.cost_target is not None:
                    tasks[t.label]["cost_target"] = list(target_bounds(t.cost_target))
                tasks[t.label].update(cost_summary(costed, modes))
        routers[label] = {"tasks": tasks, **_means(tasks)}
    for label, rows in routing_rows(evals, mixture).items():
        routers[label]["routing"] = routing_block(rows, label)
    device = next(model.parameters()).device
    return {
        "model": recipe.model.name,
        "modes": recipe.elastic.modes_label(),
        "routers": routers,
        "full": {k: {"accuracy": v["accuracy"], "samples": v["samples"]} for k, v in full.items()},
        "train": {"steps": recipe.train.steps, "batch_size": recipe.train.batch_size},
        "details": evals,
        "recipe": recipe.model_dump(mode="json"),
        "environment": environment(device if isinstance(device, torch.device) else torch.device("cpu")),
    }


def routing_rows(evals: dict[str, Any], mixture: list[MixtureTask]) -> dict[str, list[dict[str, Any]]]:
    """Per trained router, one row per held-back sample that has routing decisions: its task,
    category, MSR, decisions (layers x KV heads, 1 = sparse) and noise-free P(sparse)."""
    categories = {t.label: t.category for t in mixture}
    out: dict[str, list[dict[str, Any]]] = {}
    for label, per_task in evals.items():
        if label == FULL:
            continue
        rows = [
            {"variant": label, "task": task, "category": categories.get(task, ""), "msr": r["msr"],
             "decisions": r["decisions"], "prob_sparse": r.get("prob_sparse")}
            for task, res in per_task.items() for r in res["per_sample"] if r.get("decisions")
        ]
        if rows:
            out[label] = rows
    return out


def routing_block(rows: list[dict[str, Any]], label: str) -> dict[str, Any]:
    """The held-back routing of one router: decision margins, how many samples differ from the
    majority assignment, the heads whose routing differs between task categories, and per task
    the fraction of samples routing each (layer, KV head) sparse."""
    import torch

    from elasticfw.report.routing import routing_summaries
    from elasticfw.training.diagnostics import margin_histogram, margin_summary

    probs = [torch.tensor(r["prob_sparse"]) for r in rows if r.get("prob_sparse") is not None]
    summary = routing_summaries(rows, [label])[0]
    per_task: dict[str, list[list[float]]] = {}
    for task in dict.fromkeys(r["task"] for r in rows):
        grids = torch.tensor([r["decisions"] for r in rows if r["task"] == task], dtype=torch.float64)
        per_task[task] = grids.mean(0).round(decimals=4).tolist()
    return {
        "margins": margin_summary(margin_histogram(torch.cat([p.flatten() for p in probs]))) if probs else None,
        "adaptive_samples": summary.adaptive_samples,
        "task_dependent_heads": [list(h) for h in summary.task_dependent_heads],
        "sparse_share": per_task,
    }


def write_routing_figures(evals: dict[str, Any], mixture: list[MixtureTask], root: Path) -> list[Path]:
    """``<root>/<router>/routing.png``: per task, the share of samples routing each (layer, KV head)
    to the retrieval mode (paper Fig. 6)."""
    from elasticfw.report.plots import heads_figure

    written = []
    for label, rows in routing_rows(evals, mixture).items():
        out = root / label / "routing.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        heads_figure(rows, label).savefig(out, dpi=110)
        written.append(out)
    return written


def score_intervals(scores: list[float], full_scores: list[float]) -> dict[str, Any]:
    """The score's 95 % interval (``ci``) and, when full attention scored the same samples in the
    same order, the paired difference to it (``diff_to_full``, the mean of the per-sample
    differences) with its 95 % interval (``diff_ci``); both by
    :func:`~elasticfw.report.stats.mean_interval` (Wilson for 0/1 values, else Student-t)."""
    if not scores:
        return {}
    ci = mean_interval(scores)
    out: dict[str, Any] = {"ci": [ci.lo, ci.hi]}
    if len(full_scores) == len(scores):
        diff = mean_interval([a - b for a, b in zip(scores, full_scores)])
        out.update(diff_to_full=diff.mean, diff_ci=[diff.lo, diff.hi])
    return out


def msr_spread(values: list[float]) -> dict[str, float]:
    """The per-sample MSR's spread: standard deviation (population), minimum and maximum."""
    return spread(values, "msr")


def _means(tasks: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cat in ("sensitive", "robust"):
        rows = [t for t in tasks.values() if t["category"] == cat]
        if rows:
            out[f"{cat}_msr"] = sum(r["msr"] for r in rows) / len(rows)
            out[f"{cat}_accuracy"] = sum(r["accuracy"] for r in rows) / len(rows)
            if all("cost" in r for r in rows):
                out[f"{cat}_cost"] = sum(r["cost"] for r in rows) / len(rows)
    if tasks:
        out["mean_msr"] = sum(t["msr"] for t in tasks.values()) / len(tasks)
        if all("cost" in t for t in tasks.values()):
            out["mean_cost"] = sum(t["cost"] for t in tasks.values()) / len(tasks)
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """A plain-text table: one row per task, score and MSR per router, full attention's score."""
    routers = list(summary["routers"])
    tasks: list[tuple[str, str]] = []
    for r in routers:
        for name, row in summary["routers"][r]["tasks"].items():
            if (name, row["category"]) not in tasks:
                tasks.append((name, row["category"]))
    costed = {r for r in routers if any("cost" in t for t in summary["routers"][r]["tasks"].values())}
    head = f"{'task':<22} {'category':<9} {'full':>6}" + "".join(
        f" {r + ' score':>14} {'MSR':>5}" + (f" {'cost':>5}" if r in costed else "") for r in routers)
    lines = [head, "-" * len(head)]
    for name, cat in tasks:
        full = summary["full"].get(name, {}).get("accuracy")
        line = f"{name:<22} {cat:<9} {full if full is not None else float('nan'):>6.3f}"
        for r in routers:
            row = summary["routers"][r]["tasks"].get(name)
            line += f" {row['accuracy']:>14.3f} {row['msr']:>5.2f}" if row else f" {'-':>14} {'-':>5}"
            if r in costed:
                line += f" {row['cost']:>5.2f}" if row and "cost" in row else f" {'-':>5}"
        lines.append(line)
    return "\n".join(lines)
