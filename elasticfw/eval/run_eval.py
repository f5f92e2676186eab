"""``elasticfw eval``: the recipe's elastic section (or a trained adapter) on its ``eval`` task; print
and save a JSON report. (``elasticfw compare`` is :mod:`elasticfw.eval.sweep`.)"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from elasticfw.atomic import atomic_write_text
from elasticfw.errors import RecipeError
from elasticfw.eval.dataset import samples_from_dataset, task_dataset
from elasticfw.eval.generate import evaluate
from elasticfw.model.checkpoint import load_adapter
from elasticfw.model.loading import load_model, make_elastic
from elasticfw.provenance import environment
from elasticfw.registry import get_registry


def _say(text: str) -> None:
    print(text, flush=True)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'variant':<24} {'accuracy':>9} {'MSR':>6} {'ESR':>6} {'ESR(last)':>9} {'samples':>7} {'time':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['label']:<24} {r['accuracy']:>9.3f} {r['msr']:>6.3f} {r['esr']:>6.3f} {r['esr_last_layer']:>9.3f} "
            f"{r['samples']:>7d} {r['seconds']:>7.1f}s"
        )
    return "\n".join(lines)


def run_evaluation(recipe: Any, *, out: str | None = None, adapter: str | None = None) -> dict[str, Any]:
    """The recipe's own ``elastic`` section on its ``eval`` task (``elasticfw eval``), or the trained
    ``adapter`` (which carries its own elastic section)."""
    if adapter is not None and not (Path(adapter) / "elastic_config.json").is_file():
        raise RecipeError(f"--adapter {adapter!r} is not an adapter folder (no elastic_config.json in it)")
    return run_variants(recipe, [("adapter" if adapter else "elastic", recipe.elastic, adapter)], out=out, kind="eval")


def run_variants(
    recipe: Any, variants: list[tuple[str, Any, str | None]], *, out: str | None, kind: str
) -> dict[str, Any]:
    if recipe.eval is None:
        raise RecipeError(f"eval: required by `elasticfw {kind}` (it names the task and generation settings)")
    registry = get_registry()
    t0 = time.perf_counter()
    _say(f"[elasticfw] loading model {recipe.model.name!r} ({recipe.model.dtype}, device {recipe.model.device})")
    model, tokenizer = load_model(recipe.model, registry=registry)
    task = registry.make("task", recipe.eval.task)
    samples = samples_from_dataset(task_dataset(task, tokenizer, seed=recipe.seed, split="eval"))
    lengths = [len(s.input_ids) for s in samples]
    _say(f"[elasticfw] {len(samples)} {task.name} samples, {min(lengths)}-{max(lengths)} tokens "
         f"(model ready in {time.perf_counter() - t0:.0f}s)")
    rows = []
    for label, section, adapter in variants:
        if adapter is not None:
            elastic = load_adapter(model, adapter, registry=registry)
            section = elastic.elastic_config
            _say(f"[elasticfw] variant {label!r}: adapter {adapter} (router {section.router.name}, "
                 f"{section.retrieval_mode.name}-{section.sparse_mode.name})")
        else:
            _say(f"[elasticfw] variant {label!r}: router {section.router.name}, "
                 f"{section.retrieval_mode.name}-{section.sparse_mode.name}")
            elastic = make_elastic(model, tokenizer, section, registry=registry,
                                   base_model_name=recipe.model.name, seed=recipe.seed)

        def progress(done: int, total: int, _label: str = label) -> None:
            print(f"\r  {_label}: {done}/{total} samples", end="" if done < total else "\n", flush=True)

        try:
            result = evaluate(elastic, tokenizer, task, samples, batch_size=recipe.eval.batch_size,
                              max_new_tokens=recipe.eval.max_new_tokens, padding_side=recipe.eval.padding_side,
                              progress=progress)
        finally:
            elastic.unwrap()
        row = {"label": label, **result.summary(),
               "completions": [r.completion for r in result.results],
               "per_sample": [{"score": r.score, "msr": r.msr, "esr": r.esr, "tokens": r.tokens}
                              for r in result.results],
               "elastic": section.model_dump(mode="json")}
        rows.append(row)
        _say(f"  {label}: accuracy {row['accuracy']:.3f}, MSR {row['msr']:.3f}, ESR {row['esr']:.3f}")
    _say("\n" + format_table(rows))
    report = {"recipe": recipe.model_dump(mode="json"), "environment": environment(next(model.parameters()).device), "rows": rows,
              "total_seconds": time.perf_counter() - t0}
    path = Path(out) if out else Path(recipe.output_dir or "results") / f"{kind}-{datetime.now():%Y%m%d-%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(report, indent=2))
    _say(f"\n[elasticfw] report written to {path}")
    sys.stdout.flush()
    return report
