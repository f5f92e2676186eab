"""Which tasks lose accuracy under sparse attention? Every registered task (or those named), at
several context lengths, under full attention and with every head in each sparse mode.

    python scripts/task_sensitivity.py --lengths 500 1500 --samples 30 --out results/tasks/sensitivity.json

The premise of Elastic Attention (arXiv 2601.17367, §1, §4): sparsity-sensitive tasks (retrieval,
QA) lose much more than sparsity-robust ones (code, in-context learning, summaries). Prints a
Markdown table and writes JSON with the environment block.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from elasticfw.errors import ElasticError
from elasticfw.eval.dataset import samples_from_dataset, task_dataset
from elasticfw.eval.generate import evaluate
from elasticfw.model.loading import load_model, make_elastic
from elasticfw.provenance import environment
from elasticfw.recipe import validate_recipe_data
from elasticfw.registry import get_registry

#: sparse modes compared (every head in the mode), as elastic sections with a fixed router
MODES = {
    "streaming": {"name": "streaming", "sink_tokens": 64, "local_tokens": 192, "block_size": 64},
    "xattention": {"name": "xattention", "block_size": 64, "stride": 16, "threshold": 0.9},
}
SKIP = {"dataset"}  # needs user data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", nargs="*", help="task names (default: every registered task but 'dataset')")
    ap.add_argument("--lengths", nargs="+", type=int, default=[500, 1500])
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--executor", default="sdpa")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task-option", action="append", default=[], metavar="TASK.FIELD=JSON",
                    help="a task config field, e.g. fewshot.labels='[\"email\",\"xml\"]'")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"{out} exists; remove it or choose another --out")
    registry = get_registry()
    names = args.tasks or [n for n in registry.names("task") if n not in SKIP]
    options: dict[str, dict] = {}
    for opt in args.task_option:
        key, _, value = opt.partition("=")
        task, _, field = key.partition(".")
        options.setdefault(task, {})[field] = json.loads(value)
    base = {"model": {"name": args.model}, "elastic": {"executor": {"name": args.executor},
                                                       "retrieval_mode": {"name": "full", "block_size": 64}}}
    recipe = validate_recipe_data(base, registry=registry)
    model, tokenizer = load_model(recipe.model, registry=registry)
    variants = {"full": None, **MODES}
    rows = []
    t0 = time.perf_counter()
    for name in names:
        for length in args.lengths:
            cfg = {"name": name, "num_samples": args.samples, **options.get(name, {})}
            if "context_tokens" in registry.entry("task", name).config_class.model_fields:
                cfg["context_tokens"] = length
            try:
                section = validate_recipe_data({**base, "eval": {"task": cfg}}, registry=registry)
            except ElasticError as exc:
                print(f"skip {name}@{length}: {exc}")
                continue
            task = registry.make("task", section.eval.task)
            samples = samples_from_dataset(task_dataset(task, tokenizer, seed=0, split="eval"))
            row = {"task": name, "category": task.category, "metric": task.metric, "length": length,
                   "tokens": sum(len(s.input_ids) for s in samples) / len(samples), "samples": len(samples)}
            for label, mode in variants.items():
                elastic_cfg = {**base["elastic"],
                               "sparse_mode": mode or MODES["streaming"],
                               "router": {"name": "fixed", "assign": "all_sparse" if mode else "all_retrieval"}}
                el_section = validate_recipe_data({**base, "elastic": elastic_cfg}, registry=registry).elastic
                elastic = make_elastic(model, tokenizer, el_section, registry=registry)
                try:
                    res = evaluate(elastic, tokenizer, task, samples, batch_size=args.batch,
                                   max_new_tokens=task.max_new_tokens)
                finally:
                    elastic.unwrap()
                summary = res.summary()
                row[label] = summary["accuracy"]
                row[f"{label}_esr"] = summary["esr"]
            rows.append(row)
            print(f"{name:<18} {task.category:<9} {length:>5} full {row['full']:.3f} "
                  + " ".join(f"{m} {row[m]:.3f} (ESR {row[m + '_esr']:.2f})" for m in MODES), flush=True)
    table = ["| task | category | metric | tokens | full | " + " | ".join(MODES) + " |",
             "|---|---|---|---|---|" + "---|" * len(MODES)]
    for r in rows:
        table.append(f"| {r['task']} | {r['category']} | {r['metric']} | {r['tokens']:.0f} | {r['full']:.3f} | "
                     + " | ".join(f"{r[m]:.3f} (ESR {r[m + '_esr']:.2f})" for m in MODES) + " |")
    for cat in ("sensitive", "robust"):
        sel = [r for r in rows if r["category"] == cat]
        if sel:
            drops = {m: sum(r["full"] - r[m] for r in sel) / len(sel) for m in MODES}
            table.append(f"| **{cat} mean drop** | | | | | " + " | ".join(f"{drops[m]:+.3f}" for m in MODES) + " |")
    print("\n".join(table))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"rows": rows, "table": table, "args": vars(args), "modes": MODES,
                               "seconds": time.perf_counter() - t0,
                               "environment": environment(next(model.parameters()).device)}, indent=2))
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
