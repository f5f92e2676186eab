"""Is a routed task's loss the router's choice of heads, or a mode's? Swap the modes, keep the heads.

    python scripts/mode_swap.py results/train/smollm2-xa-ssa/summary.json recipes/train/smollm2-xa-ssa.yaml \\
        --task passkey --variant "as trained|" \\
        --variant "full|retrieval_mode={name: full, block_size: 64}" \\
        --variant "xattention 0.95|retrieval_mode={name: xattention, block_size: 64, stride: 16, threshold: 0.95}" \\
        --out results/train/smollm2-xa-ssa/passkey_mode_swap.json

A trained router's held-back ``summary.json`` records, per task, the share of samples that routed
each (layer, KV head) to the sparse mode (``routing.sparse_share``). Where a task's routing is the
same for every sample (every share 0 or 1), that assignment is a ``fixed`` router
(``assign: sparse_heads``); this script evaluates it on the recipe's eval-split samples of the task
(those ``elasticfw train`` evaluates held back) with each ``--variant``'s modes in the two slots:
``LABEL|SLOT=YAML; SLOT=YAML`` with SLOT ``retrieval_mode`` or ``sparse_mode`` replaced whole (an
empty right side keeps the recipe's modes). ``--heads-from`` takes the assignment from another
summary (e.g. the FA-SSA router's heads under XAttention). ``--keep-router`` instead routes every
sample with the trained adapter itself (``RUN/ROUTER/adapter`` beside the summary; any task) and
swaps only the modes it routes to, e.g. a denser XAttention threshold at inference. The router then
reads the keys of the swapped model, so from its second routed layer on its decisions may differ
from the run's. Each variant gets its score with a 95 % interval and its paired difference
to full attention's per-sample scores in the summary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from elasticfw.atomic import atomic_write_text
from elasticfw.eval.dataset import samples_from_dataset, task_dataset
from elasticfw.eval.generate import evaluate
from elasticfw.model.checkpoint import load_adapter
from elasticfw.model.loading import load_model, make_elastic
from elasticfw.provenance import environment
from elasticfw.recipe import load_recipe, validate_recipe_data
from elasticfw.registry import get_registry
from elasticfw.training.evaluate import score_intervals

SLOTS = ("retrieval_mode", "sparse_mode")


def sparse_heads(summary: dict[str, Any], router: str, task: str, layers: list[int] | None = None) -> list[list[int]]:
    """The (layer, KV head) pairs that ``router`` sent to the sparse mode on every held-back sample of
    ``task``; refused where some head's share lies strictly between 0 and 1 (the routing differs
    between samples, so no single assignment stands for it). ``layers`` maps the share's rows to
    absolute layer indices (default: row i is layer i)."""
    try:
        share = summary["routers"][router]["routing"]["sparse_share"][task]
    except KeyError as exc:
        raise SystemExit(f"summary has no routers.{router}.routing.sparse_share.{task} ({exc} missing)") from None
    mixed = [(i, h, v) for i, row in enumerate(share) for h, v in enumerate(row) if 0.0 < v < 1.0]
    if mixed:
        i, h, v = mixed[0]
        raise SystemExit(f"task {task!r}: {len(mixed)} heads are routed sparse on some samples only (e.g. row {i}, "
                         f"head {h}: share {v:.3f}); expected one assignment for every sample")
    rows = layers if layers is not None else list(range(len(share)))
    if len(rows) != len(share):
        raise SystemExit(f"summary's sparse_share has {len(share)} rows, expected one per routed layer ({len(rows)})")
    return [[rows[i], h] for i, row in enumerate(share) for h, v in enumerate(row) if v >= 1.0]


def adapter_with_modes(adapter: Path, modes: dict[str, dict[str, Any]], into: Path) -> Path:
    """A copy of ``adapter`` in ``into`` whose elastic section has ``modes`` (slot -> mode section)
    in place of its own; its router (weights and state) unchanged."""
    config = json.loads((adapter / "elastic_config.json").read_text())
    config["elastic"].update(modes)
    into.mkdir(parents=True, exist_ok=True)
    shutil.copy(adapter / "elastic_adapter.safetensors", into / "elastic_adapter.safetensors")
    (into / "elastic_config.json").write_text(json.dumps(config))
    return into


def parse_variant(text: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """``LABEL|SLOT=YAML; SLOT=YAML`` -> (label, {slot: mode section})."""
    label, sep, rest = text.partition("|")
    if not sep or not label.strip():
        raise SystemExit(f"--variant {text!r}: expected 'LABEL|SLOT=YAML' (SLOT one of {SLOTS}), or 'LABEL|'")
    modes: dict[str, dict[str, Any]] = {}
    for part in filter(None, (p.strip() for p in rest.split(";"))):
        slot, eq, value = part.partition("=")
        if not eq or slot.strip() not in SLOTS:
            raise SystemExit(f"--variant {text!r}: {part!r} should be SLOT=YAML with SLOT one of {SLOTS}")
        section = yaml.safe_load(value)
        if not isinstance(section, dict) or "name" not in section:
            raise SystemExit(f"--variant {text!r}: {slot.strip()} should be a mode section with a name, got {value!r}")
        modes[slot.strip()] = section
    return label.strip(), modes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("summary", type=Path, help="a training run's held-back summary.json (full attention's scores)")
    p.add_argument("recipe", type=Path, help="the run's training recipe (model, modes, tasks, eval samples)")
    p.add_argument("--task", required=True, help="a task label of the recipe's train.tasks")
    p.add_argument("--router", default="mlp", help="the summary's router whose heads are kept")
    p.add_argument("--heads-from", type=Path, default=None, help="take the heads from this summary instead")
    p.add_argument("--keep-router", action="store_true",
                   help="route each sample with the trained adapter (RUN/ROUTER/adapter) instead of a fixed assignment")
    p.add_argument("--variant", action="append", required=True, help="'LABEL|SLOT=YAML; SLOT=YAML' (see above)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    summary = json.loads(args.summary.read_text())
    source = json.loads(args.heads_from.read_text()) if args.heads_from else summary
    recipe = load_recipe(args.recipe, [f"model.device={args.device}"])
    registry = get_registry()
    model, tok = load_model(recipe.model, registry=registry)
    adapter = (args.heads_from or args.summary).parent / args.router / "adapter"
    if args.keep_router and args.heads_from:
        raise SystemExit("--keep-router routes with the summary's own adapter; it excludes --heads-from")
    if args.keep_router and not (adapter / "elastic_config.json").exists():
        raise SystemExit(f"--keep-router: no adapter at {adapter}")
    config = adapter / "elastic_config.json"
    layers = json.loads(config.read_text())["routed_layers"] if config.exists() else None
    if layers is None:  # every layer routed
        layers = list(range(model.config.num_hidden_layers))
    heads = None if args.keep_router else sparse_heads(source, args.router, args.task, layers)
    entry = next((e for e in recipe.train.tasks if (e.label or e.task.name) == args.task), None)
    if entry is None:
        raise SystemExit(f"--task {args.task!r} is not among the recipe's train.tasks")
    plugin = registry.make("task", entry.task.model_copy(update={"num_samples": entry.eval_samples}))
    samples = samples_from_dataset(task_dataset(plugin, tok, seed=recipe.seed, split="eval"))
    full = [s["score"] for s in summary["details"]["full"][args.task]["per_sample"]]
    rows: dict[str, Any] = {}
    scratch = Path(tempfile.mkdtemp(prefix="mode_swap_"))
    for index, (label, modes) in enumerate(variants):
        if heads is None:
            swapped = adapter_with_modes(adapter, modes, scratch / str(index))
            elastic = load_adapter(model, swapped, registry=registry, base_model=recipe.model.name)
            used = {s: json.loads((swapped / "elastic_config.json").read_text())["elastic"][s] for s in SLOTS}
        else:
            data = recipe.model_dump(mode="json")
            data["elastic"].update(modes)
            data["elastic"]["router"] = {"name": "fixed", "assign": "sparse_heads", "heads": heads}
            section = validate_recipe_data(data, registry=registry).elastic
            elastic = make_elastic(model, tok, section, registry=registry, base_model_name=recipe.model.name)
            used = {s: data["elastic"][s] for s in SLOTS}
        elastic.eval()
        try:
            res = evaluate(elastic, tok, plugin, samples, batch_size=recipe.train.eval_batch_size,
                           max_new_tokens=plugin.max_new_tokens)
        finally:
            elastic.unwrap()
        scores = [r.score for r in res.results]
        rows[label] = {"modes": used, **res.summary(),
                       **score_intervals(scores, full), "per_sample_score": scores}
        r = rows[label]
        print(f"{label}: {r['accuracy']:.3f} {r['ci']} diff to full {r['diff_to_full']:+.3f} {r['diff_ci']} "
              f"MSR {r['msr']:.3f} ESR {r['esr']:.3f}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    if heads is None:
        routing: dict[str, Any] = {"routed_by": str(adapter)}
    else:
        total = sum(len(r) for r in source["routers"][args.router]["routing"]["sparse_share"][args.task])
        routing = {"heads_from": str(args.heads_from or args.summary), "sparse_heads": heads, "msr": len(heads) / total}
    out = {"summary": str(args.summary), "recipe": str(args.recipe), "task": args.task, "router": args.router,
           **routing, "variants": rows, "environment": environment(torch.device(args.device))}
    atomic_write_text(args.out, json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
