"""Does a trained router's routing move with prompt length because of the rotary embedding?

The MLP router averages the key states of a prompt's first and last ``pool_tokens`` tokens. With
``pool_keys: rotated`` (the paper's) those keys are rotated by their absolute position, so the
last window of a longer prompt pools to a turned vector even where its content is the same. This
probe routes each prompt twice with an adapter: as it is, and with the last window's keys moved
(rotation undone at their positions, redone at the positions they would have in a prompt of
``--reference`` tokens: the training length) before the router reads them; the first window
already sits at the same positions in every prompt. If the MSR of a task stays put across lengths
once moved, the length effect is the rotation's, not the content's. ``--score`` also generates an
answer to each prompt, as it is, moved, and under full attention (the plain model), and scores it
with the task's metric: whether moving the window also gives back what the length took.

A router that pools unrotated keys (``pool_keys: unrotated``) reads no position: the probe routes
and scores its prompts as they are only (``probe_variants``), and its rows have no ``moved`` entries.

    python scripts/rope_phase_probe.py results/train/smollm2-fa-ssa/mlp/adapter \\
        recipes/train/smollm2-fa-ssa.yaml --tasks passkey code_completion --lengths 500 1000 2500 \\
        --samples 8 --reference 1000 --out results/train/smollm2-fa-ssa/rope_phase_probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from elasticfw.atomic import atomic_write_text
from elasticfw.eval.dataset import samples_from_dataset, task_dataset
from elasticfw.eval.generate import evaluate
from elasticfw.model.checkpoint import load_adapter
from elasticfw.model.loading import load_model
from elasticfw.model.rotary import rotate_half, unrotate
from elasticfw.provenance import environment
from elasticfw.recipe import load_recipe
from elasticfw.registry import get_registry
from elasticfw.routing.base import Router
from elasticfw.training.inspect import route_samples


def move_last_window(keys: torch.Tensor, rotary: torch.nn.Module, window: int, reference: int) -> torch.Tensor:
    """``keys`` (1, H, S, D) of one unpadded prompt at positions 0..S-1, with the last ``window`` keys'
    rotation moved from positions S-window.. to reference-window.. (the rest unchanged)."""
    s = keys.shape[2]
    if keys.shape[0] != 1 or s < window:
        raise ValueError(f"move_last_window takes one prompt of at least {window} keys, got {tuple(keys.shape)}")
    last = keys[:, :, s - window :]
    at = torch.arange(s - window, s, device=keys.device)[None]
    cos, sin = rotary(last, at)
    plain = unrotate(last, cos, sin)
    cos, sin = rotary(last, at - s + reference)
    moved = plain * cos.float()[:, None] + rotate_half(plain) * sin.float()[:, None]
    return torch.cat([keys[:, :, : s - window], moved.to(keys.dtype)], dim=2)


def probe_variants(router: Router) -> tuple[bool, ...]:
    """The routings to probe, ``moved`` or not: both for a router that reads the rotated keys; only
    as is for one that reads them unrotated (its keys carry no position to move; moving them would
    rotate keys that hold no rotation)."""
    return (False,) if router.reads_unrotated_keys else (False, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("adapter")
    ap.add_argument("recipe")
    ap.add_argument("--tasks", nargs="+", required=True, help="task names of the recipe's train.tasks")
    ap.add_argument("--lengths", nargs="+", type=int, required=True, help="prompt lengths (context_tokens)")
    ap.add_argument("--samples", type=int, default=8, help="eval-split prompts per task and length")
    ap.add_argument("--reference", type=int, required=True, help="the prompt length the router was trained at")
    ap.add_argument("--score", action="store_true", help="also generate and score (as is, moved, full attention)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    recipe, registry = load_recipe(args.recipe), get_registry()
    model, tok = load_model(recipe.model, registry=registry)
    elastic = load_adapter(model, args.adapter, registry=registry, base_model=recipe.model.name)
    elastic.eval()
    decide, moving = elastic.router.decide, [False]
    window = elastic.router.config.pool_tokens

    def probe(layer, keys, seq):
        if moving[0]:
            keys = move_last_window(keys, model.model.rotary_emb, window, args.reference)
        return decide(layer, keys, seq)

    elastic.router.decide = probe
    entries = {e.task.name: e for e in recipe.train.tasks}
    unknown = sorted(set(args.tasks) - set(entries))
    if unknown:
        raise SystemExit(f"--tasks {unknown} are not among the recipe's train.tasks {sorted(entries)}")
    rows = []
    for name in args.tasks:
        for length in args.lengths:
            task = entries[name].task.model_copy(update={"num_samples": args.samples, "context_tokens": length})
            prompts = samples_from_dataset(task_dataset(registry.make("task", task), tok, seed=recipe.seed, split="eval"))
            row = {"task": name, "context_tokens": length,
                   "prompt_tokens": statistics.mean(len(p.input_ids) for p in prompts)}
            plugin = registry.make("task", task)
            for moved in probe_variants(elastic.router):
                moving[0] = moved
                msr = [r["msr"] for r in route_samples(elastic, tok, prompts, 1)]  # one at a time: no padding
                key = "moved" if moved else "as_is"
                row[f"msr_{key}"], row[f"msr_sd_{key}"] = statistics.mean(msr), statistics.pstdev(msr)
                if args.score:  # batches of one: the moved window needs an unpadded prompt
                    res = evaluate(elastic, tok, plugin, prompts, batch_size=1, max_new_tokens=plugin.max_new_tokens)
                    row[f"score_{key}"] = [r.score for r in res.results]
            if args.score:
                elastic.unwrap()
                res = evaluate(model, tok, plugin, prompts, batch_size=1, max_new_tokens=plugin.max_new_tokens)
                row["score_full"] = [r.score for r in res.results]
                elastic = load_adapter(model, args.adapter, registry=registry, base_model=recipe.model.name)
                elastic.eval()
                decide = elastic.router.decide
                elastic.router.decide = probe
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"adapter": args.adapter, "recipe": args.recipe, "reference": args.reference, "pool_tokens": window,
           "samples": args.samples, "rows": rows, "environment": environment(next(model.parameters()).device)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(args.out), json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
