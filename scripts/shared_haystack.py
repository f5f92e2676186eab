"""Per-input routing on shared haystacks: does a trained adapter route a prompt by its own content?

For each pair (a sample of task A, a sample of task B) it builds the prompt "A's prompt with its
last K tokens replaced by B's last K tokens": A's haystack (and the router's first pooling window)
with B's question (the last pooling window). It prefills the original prompts and the swapped
ones and writes each one's MSR. A router that routes by task label alone (it cannot: it never sees
one) or by the haystack would give a swapped prompt the MSR of its haystack's task; a router that
reads the question moves it toward the question's task.

    python scripts/shared_haystack.py ADAPTER RECIPE --pairs passkey:code_completion passkey:fewshot \
        niah_single:code_completion --samples 12 --swap 120 --out results/train/smollm2-fa-ssa/shared_haystack.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from elasticfw.eval.dataset import samples_from_dataset, task_dataset
from elasticfw.eval.task import Sample
from elasticfw.model.checkpoint import load_adapter
from elasticfw.model.loading import load_model
from elasticfw.provenance import environment
from elasticfw.recipe import load_recipe
from elasticfw.registry import get_registry
from elasticfw.training.inspect import route_samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("adapter")
    ap.add_argument("recipe")
    ap.add_argument("--pairs", nargs="+", required=True, help="HAYSTACK_TASK:QUESTION_TASK labels of train.tasks")
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--swap", type=int, default=120, help="tokens of the question task's ending put in (>= pool_tokens)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    recipe = load_recipe(args.recipe)
    registry = get_registry()
    model, tok = load_model(recipe.model, registry=registry)
    prompts = {}
    for entry in recipe.train.tasks:
        plugin = registry.make("task", entry.task.model_copy(update={"num_samples": args.samples}))
        prompts[entry.label or plugin.name] = samples_from_dataset(task_dataset(plugin, tok, seed=recipe.seed, split="eval"))
    elastic = load_adapter(model, args.adapter, registry=registry, base_model=recipe.model.name)
    elastic.eval()
    own = {name: [r["msr"] for r in route_samples(elastic, tok, ps, 4)] for name, ps in prompts.items()}
    rows = []
    for pair in args.pairs:
        hay, question = pair.split(":")
        swapped = [Sample(list(a.input_ids[: -args.swap]) + list(b.input_ids[-args.swap:]), "")
                   for a, b in zip(prompts[hay], prompts[question])]
        msr = [r["msr"] for r in route_samples(elastic, tok, swapped, 4)]
        rows.append({
            "haystack": hay, "question": question, "samples": len(msr),
            "msr_haystack_task": statistics.fmean(own[hay]), "msr_question_task": statistics.fmean(own[question]),
            "msr_swapped": statistics.fmean(msr), "msr_swapped_std": statistics.pstdev(msr), "per_sample": msr,
        })
        print(f"{hay} haystack + {question} question: MSR {statistics.fmean(msr):.3f} ± {statistics.pstdev(msr):.3f} "
              f"(own prompts: {hay} {statistics.fmean(own[hay]):.3f}, {question} {statistics.fmean(own[question]):.3f})",
              flush=True)
    elastic.unwrap()
    out = {"adapter": args.adapter, "recipe": args.recipe, "swap_tokens": args.swap,
           "own": {k: {"msr": statistics.fmean(v), "msr_std": statistics.pstdev(v), "per_sample": v} for k, v in own.items()},
           "pairs": rows, "environment": environment(torch.device("cpu"))}
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
