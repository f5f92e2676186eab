"""Trained static gates at an exact MSR, as DuoAttention sets its sparsity: threshold the gates.

    python scripts/static_at_msr.py results/train/smollm2-fa-ssa/static/adapter \\
        recipes/train/smollm2-fa-ssa.yaml --msr 0.703 --tasks passkey niah_single \\
        --compare results/train/smollm2-fa-ssa/summary.json --out results/train/smollm2-fa-ssa/static_at_msr.json

Static per-head gates trained with the Lagrangian land near their target in training, but held
back their arg max rounds gates near 0.5 up or down, so the MSR they reach is not the one asked
for. This script ranks the adapter's (layer, KV head) gates by P(sparse), keeps the
``round((1 - msr) * heads)`` least sparse ones full and the rest sparse (a ``fixed`` router with
``assign: retrieval_heads``), and evaluates that assignment on the eval-split samples of the
recipe's training tasks named by ``--tasks`` (as ``elasticfw train`` evaluates held back). With
``--compare SUMMARY`` (a training run's ``summary.json`` on the same samples) each task also gets
the paired difference to each of that summary's routers and to full attention, with 95 %
intervals (:func:`elasticfw.training.evaluate.score_intervals`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from elasticfw.atomic import atomic_write_text
from elasticfw.eval.dataset import samples_from_dataset, task_dataset
from elasticfw.eval.generate import evaluate
from elasticfw.model.loading import load_model, make_elastic
from elasticfw.provenance import environment
from elasticfw.recipe import load_recipe
from elasticfw.registry import get_registry
from elasticfw.training.evaluate import score_intervals


def full_heads(adapter: Path, msr: float) -> tuple[list[tuple[int, int]], float]:
    """The (layer, KV head) pairs kept full for ``msr`` (the least sparse gates) and the MSR they give."""
    config = json.loads((adapter / "elastic_config.json").read_text())
    if config["elastic"]["router"]["name"] != "static":
        raise SystemExit(f"{adapter}: router {config['elastic']['router']['name']!r}, expected a static adapter")
    logits = load_file(str(adapter / "elastic_adapter.safetensors"))["logits"].float()  # (L, Hkv, 2)
    prob = torch.softmax(logits, dim=-1)[..., 1]
    layers = config["routed_layers"]
    n = prob.numel()
    keep = int(round((1.0 - msr) * n))
    order = torch.argsort(prob.flatten(), stable=True)[:keep]
    hkv = prob.shape[1]
    return sorted((layers[int(i) // hkv], int(i) % hkv) for i in order), 1.0 - keep / n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("adapter", type=Path, help="a static adapter folder (elastic_config.json + safetensors)")
    p.add_argument("recipe", type=Path, help="the training recipe (model, modes, tasks, eval samples)")
    p.add_argument("--msr", type=float, required=True, help="the MSR to reach, in [0, 1]")
    p.add_argument("--tasks", nargs="+", default=None, help="task labels of the recipe's train.tasks (default: all)")
    p.add_argument("--compare", type=Path, default=None, help="a summary.json of the same recipe's held-back run")
    p.add_argument("--device", default="cpu")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override (repeatable), e.g. train.tasks.0.task.context_tokens=2500")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if not 0.0 <= args.msr <= 1.0:
        raise SystemExit(f"--msr {args.msr}: expected a value in [0, 1]")
    heads, reached = full_heads(args.adapter, args.msr)
    overrides = [f"model.device={args.device}", "elastic.router.name=fixed", "elastic.router.assign=retrieval_heads",
                 "elastic.router.heads=" + json.dumps([list(h) for h in heads])]
    recipe = load_recipe(args.recipe, [*args.set, *overrides])
    registry = get_registry()
    model, tok = load_model(recipe.model, registry=registry)
    elastic = make_elastic(model, tok, recipe.elastic, registry=registry, base_model_name=recipe.model.name)
    elastic.eval()
    compare = json.loads(args.compare.read_text()) if args.compare else None
    tasks: dict = {}
    for entry in recipe.train.tasks:
        plugin = registry.make("task", entry.task.model_copy(update={"num_samples": entry.eval_samples}))
        label = entry.label or plugin.name
        if args.tasks and label not in args.tasks:
            continue
        samples = samples_from_dataset(task_dataset(plugin, tok, seed=recipe.seed, split="eval"))
        res = evaluate(elastic, tok, plugin, samples, batch_size=recipe.train.eval_batch_size,
                       max_new_tokens=plugin.max_new_tokens)
        scores = [r.score for r in res.results]
        row = {**res.summary(), **score_intervals(scores, []), "per_sample_score": scores}
        if compare is not None:
            for name, detail in compare["details"].items():
                other = [s["score"] for s in detail[label]["per_sample"]]
                # the other router's score minus this one's, paired sample by sample
                paired = score_intervals(other, scores)
                row[f"{name}_minus_this"] = {"score_ci": paired["ci"], "diff": paired["diff_to_full"],
                                             "diff_ci": paired["diff_ci"]}
        tasks[label] = row
        print(f"{label}: score {row['accuracy']:.3f} {row['ci']} MSR {row['msr']:.3f}", flush=True)
    out = {"adapter": str(args.adapter), "recipe": str(args.recipe), "msr_asked": args.msr, "msr": reached,
           "full_heads": heads, "tasks": tasks, "environment": environment(torch.device(args.device))}
    atomic_write_text(args.out, json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
