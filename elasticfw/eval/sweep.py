"""``elasticfw compare``: a sweep of variants × tasks × context lengths × seeds.

The plan comes from the recipe: ``compare:`` lists the variants (an elastic section or a trained
adapter each), ``sweep:`` the tasks, lengths and seeds (or an explicit list of cells), batching
and the run folder. A recipe with ``compare:`` and ``eval:`` but no ``sweep:`` sweeps its
``eval.task`` with the eval settings.

Every sample becomes one row of ``RUN/rows.jsonl`` (see :mod:`elasticfw.eval.rows`), appended as
its batch finishes: score, MSR, ESR, the routing decision of every KV head, the prefill time and
tokens. ``--resume`` skips every sample already there; a variant or cell that raises is written to
``RUN/failures.jsonl`` and the others go on (``sweep.on_error: stop`` stops instead). At the end
the report (tables, figures, HTML) is built from the rows (:mod:`elasticfw.report`).

Under ``torchrun`` every process loads the model on its own GPU and evaluates every
``world``-th sample of each cell; after each batch step the processes gather their rows and rank
0 appends them, so the JSONL and the table are those of one process.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm import tqdm

from elasticfw.atomic import atomic_write_text
from elasticfw.errors import ElasticError, RecipeError
from elasticfw.eval.dataset import samples_from_dataset, task_dataset
from elasticfw.eval.generate import generate_batch
from elasticfw.eval.rows import repair_rows, row_key
from elasticfw.eval.task import Sample, Task, check_context, context_window
from elasticfw.jsonl import append_jsonl
from elasticfw.model.checkpoint import load_adapter
from elasticfw.model.loading import load_model, make_elastic
from elasticfw.provenance import environment
from elasticfw.recipe.schema import sweep_task_entries, task_at_length
from elasticfw.registry import Registry, get_registry
from elasticfw.training.distributed import DistContext, init_distributed, shutdown

META, ROWS, FAILURES = "sweep.json", "rows.jsonl", "failures.jsonl"
#: what a sweep writes into its folder (and --overwrite removes); anything else there is not ours
OWNED = (META, ROWS, FAILURES, "table.md", "table.csv", "cells.csv", "report.html", "figures")


class SweepError(ElasticError):
    """A sweep that cannot start, or one whose variants or cells failed."""


@dataclass(frozen=True)
class Variant:
    label: str
    elastic: Any  # the elastic section (an adapter's own section once loaded)
    adapter: str | None


@dataclass(frozen=True)
class SweepTask:
    label: str
    config: Any
    category: str | None  # the recipe's override; None: the task's own


@dataclass(frozen=True)
class Cell:
    variant: str
    task: str
    length: int | None
    seed: int


@dataclass(frozen=True)
class Plan:
    variants: list[Variant]
    tasks: list[SweepTask]
    cells: list[Cell]
    lengths: list[int | None]
    seeds: list[int]
    reference: str
    batch_size: int
    max_new_tokens: int | None
    padding_side: str
    warmup: bool
    on_error: str
    output_dir: str


def make_plan(recipe: Any) -> Plan:
    """The sweep a recipe describes (its validation already checked labels, cells and lengths)."""
    if not recipe.compare:
        raise RecipeError("compare: the recipe has no `compare:` list of variants to run")
    sweep = recipe.sweep
    entries = sweep_task_entries(recipe)
    if not entries:
        raise RecipeError("eval: `elasticfw compare` needs tasks: a `sweep.tasks` list or an `eval.task`")
    variants = [Variant(v.label, v.elastic, v.adapter) for v in recipe.compare]
    tasks = [SweepTask(label, config, category) for label, config, category in entries]
    lengths: list[int | None] = list(sweep.lengths) if sweep is not None and sweep.lengths else [None]
    seeds = list(sweep.seeds) if sweep is not None and sweep.seeds else [recipe.seed]
    if sweep is not None and sweep.cells:
        cells = [Cell(c.variant, c.task, c.length, recipe.seed if c.seed is None else c.seed) for c in sweep.cells]
    else:
        cells = [Cell(v.label, t.label, n, s) for v in variants for t in tasks for n in lengths for s in seeds]
    ev = recipe.eval
    return Plan(
        variants=variants, tasks=tasks, cells=cells, lengths=lengths, seeds=seeds,
        reference=(sweep.reference if sweep is not None and sweep.reference else variants[0].label),
        batch_size=sweep.batch_size if sweep is not None else ev.batch_size,
        max_new_tokens=sweep.max_new_tokens if sweep is not None else ev.max_new_tokens,
        padding_side=sweep.padding_side if sweep is not None else ev.padding_side,
        warmup=sweep.warmup if sweep is not None else True,
        on_error=sweep.on_error if sweep is not None else "continue",
        output_dir=sweep.output_dir if sweep is not None else str(Path(recipe.output_dir or "runs") / "compare"),
    )


# -- the run folder ---------------------------------------------------------------------------------
def _definition(recipe: Any, plan: Plan) -> dict[str, Any]:
    """What rows depend on: a resumed sweep must agree with the rows it continues."""
    return {
        "model": recipe.model.model_dump(mode="json", exclude={"device"}),
        "generation": {"batch_size": plan.batch_size, "max_new_tokens": plan.max_new_tokens,
                       "padding_side": plan.padding_side},
        "router_seed": recipe.seed,
        "variants": {v.label: {"elastic": v.elastic.model_dump(mode="json"), "adapter": v.adapter} for v in plan.variants},
        "tasks": {t.label: {"task": t.config.model_dump(mode="json"), "category": t.category} for t in plan.tasks},
    }


def _conflicts(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = [key for key in ("model", "generation", "router_seed") if old.get(key) != new[key]]
    for group in ("variants", "tasks"):
        for label, spec in new[group].items():
            if label in old.get(group, {}) and old[group][label] != spec:
                out.append(f"{group[:-1]} {label!r}")
    return out


def prepare_run_dir(path: Path, recipe: Any, plan: Plan, *, resume: bool, overwrite: bool, dist: DistContext) -> None:
    """Check the run folder before any work: refuse a folder holding other files, a sweep unless
    --resume/--overwrite, and a resume whose recipe disagrees with the rows already there."""
    if resume and overwrite:
        raise SweepError("--resume and --overwrite exclude one another")
    if path.exists() and not path.is_dir():
        raise SweepError(f"sweep.output_dir {str(path)!r} exists and is not a folder")
    present = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    foreign = [name for name in present if name not in OWNED and not _leftover(name)]
    if foreign:
        raise SweepError(f"sweep.output_dir {str(path)!r} holds files a sweep did not write ({', '.join(foreign[:5])}); "
                         "choose an empty or new folder")
    is_sweep = (path / META).is_file()
    if present and not is_sweep:
        raise SweepError(f"sweep.output_dir {str(path)!r} holds sweep outputs but no {META}; choose another folder")
    if resume and not is_sweep:
        raise SweepError(f"--resume: {str(path)!r} holds no sweep to resume")
    if is_sweep and not resume and not overwrite:
        raise SweepError(f"sweep.output_dir {str(path)!r} already holds a sweep; pass --resume to continue it, "
                         "--overwrite to replace it, or choose another output_dir")
    definition = _definition(recipe, plan)
    meta: dict[str, Any] = {}
    if resume:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
        bad = _conflicts(meta.get("definition", {}), definition)
        if bad:
            raise SweepError(f"--resume: the recipe changed {', '.join(bad)} since {str(path)!r} was started; rows "
                             "computed under the old settings would be mixed with new ones. Use another output_dir")
        for group in ("variants", "tasks"):  # a resumed sweep may add variants and tasks; it keeps the old
            definition[group] = {**meta["definition"][group], **definition[group]}
    if dist.is_main:
        for name in (n for n in present if _leftover(n)):
            (path / name).unlink(missing_ok=True)
        if overwrite:
            for name in (n for n in present if not _leftover(n)):
                target = path / name
                shutil.rmtree(target) if target.is_dir() else target.unlink()
        path.mkdir(parents=True, exist_ok=True)
        repair_rows(path / ROWS)
        (path / FAILURES).unlink(missing_ok=True)  # failures describe the latest attempt only
        meta = {
            "recipe": recipe.model_dump(mode="json"),
            "definition": definition,
            "variants": _variant_list(meta.get("variants", []), plan),
            "tasks": meta.get("tasks", []),
            "lengths": sorted({*meta.get("lengths", []), *plan.lengths}, key=lambda n: (n is not None, n or 0)),
            "seeds": sorted({*meta.get("seeds", []), *plan.seeds}),
            "reference": plan.reference,
            "started": meta.get("started") or datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "resumed": [*meta.get("resumed", []), datetime.now(timezone.utc).isoformat(timespec="seconds")] if resume
            else [],
        }
        atomic_write_text(path / META, json.dumps(meta, indent=2))
    dist.barrier()


def _leftover(name: str) -> bool:
    """A temporary file of an atomic write that a kill interrupted (``.NAME.tmp-PID``)."""
    return name.startswith(".") and ".tmp-" in name and name[1:].split(".tmp-")[0] in OWNED


def _variant_list(old: list[dict[str, Any]], plan: Plan) -> list[dict[str, Any]]:
    new = [
        {"label": v.label, "adapter": v.adapter, "router": v.elastic.router.name,
         "retrieval_mode": v.elastic.retrieval_mode.name, "sparse_mode": v.elastic.sparse_mode.name,
         "executor": v.elastic.executor.name}
        for v in plan.variants
    ]
    labels = {v["label"] for v in new}
    return [*(v for v in old if v["label"] not in labels), *new]


def _update_meta(path: Path, **fields: Any) -> None:
    meta = json.loads((path / META).read_text(encoding="utf-8"))
    meta.update(fields)
    atomic_write_text(path / META, json.dumps(meta, indent=2))


# -- running -------------------------------------------------------------------------------------------
class _Samples:
    """Each (task, length, seed)'s samples, built once and shared by every variant."""

    def __init__(self, plan: Plan, tokenizer: Any, model: Any, registry: Registry) -> None:
        self.tasks = {t.label: t for t in plan.tasks}
        self.tokenizer, self.model, self.registry = tokenizer, model, registry
        self.max_new_tokens = plan.max_new_tokens
        self._cache: dict[tuple[str, int | None, int], tuple[Task, list[Sample]]] = {}

    def get(self, task: str, length: int | None, seed: int) -> tuple[Task, list[Sample]]:
        key = (task, length, seed)
        if key not in self._cache:
            entry = self.tasks[task]
            plugin = self.registry.make("task", task_at_length(entry.config, length))
            samples = samples_from_dataset(task_dataset(plugin, self.tokenizer, seed=seed, split="eval"))
            check_context(entry.label, samples, context_window(self.model), extra=self.new_tokens(plugin))
            self._cache[key] = (plugin, samples)
        return self._cache[key]

    def new_tokens(self, task: Task) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else task.max_new_tokens

    def category(self, label: str, task: Task) -> str:
        return self.tasks[label].category or task.category


def _build(variant: Variant, model: Any, tokenizer: Any, recipe: Any, registry: Registry) -> Any:
    if variant.adapter is not None:
        return load_adapter(model, variant.adapter, registry=registry)
    return make_elastic(model, tokenizer, variant.elastic, registry=registry, base_model_name=recipe.model.name,
                        seed=recipe.seed)


def _failure(cell: Cell | None, variant: str, exc: BaseException) -> dict[str, Any]:
    return {"variant": variant, "task": cell.task if cell else None, "length": cell.length if cell else None,
            "seed": cell.seed if cell else None, "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(exc))}


def _row(cell: Cell, index: int, category: str, task: Task, sample: Sample, r: Any) -> dict[str, Any]:
    return {
        "variant": cell.variant, "task": cell.task, "category": category, "metric": task.metric,
        "length": cell.length, "seed": cell.seed, "index": index, "tokens": r.tokens, "score": r.score,
        "msr": r.msr, "esr": r.esr, "esr_last_layer": r.esr_last_layer, "decisions": r.decisions,
        "routed_layers": r.routed_layers, "prefill_seconds": r.prefill_seconds,
        "batch_prefill_seconds": r.batch_prefill_seconds, "batch_size": r.batch_size, "batch_tokens": r.batch_tokens,
        "generate_seconds": r.generate_seconds, "completion": r.completion, "answer": sample.answer,
    }


def _say(dist: DistContext, text: str) -> None:
    if dist.is_main:
        print(f"[elasticfw] {text}", flush=True)


def run_sweep(
    recipe: Any,
    *,
    output: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    report: bool = True,
    registry: Registry | None = None,
    progress: bool = True,
) -> Path:
    """Run the recipe's sweep into its run folder (see the module docstring); returns the folder.

    Raises :class:`SweepError` at the end if some variant or cell failed (the other rows are kept)."""
    plan = make_plan(recipe)
    registry = registry or get_registry()
    dist = init_distributed(recipe.model.device)
    try:
        root = Path(output or plan.output_dir).expanduser()
        prepare_run_dir(root, recipe, plan, resume=resume, overwrite=overwrite, dist=dist)
        done = {row_key(r) for r in repair_rows(root / ROWS)} if dist.is_main else set()
        done = dist.all_gather_object(done)[0]
        section = recipe.model if dist.device is None else recipe.model.model_copy(update={"device": str(dist.device)})
        t0 = time.perf_counter()
        _say(dist, f"loading model {recipe.model.name!r} ({section.dtype}, {section.device})")
        model, tokenizer = load_model(section, registry=registry)
        _update_meta_main(dist, root, environment=environment(next(model.parameters()).device), world_size=dist.world)
        samples = _Samples(plan, tokenizer, model, registry)
        if not dist.is_main:  # rank 0 fills the sample cache first; the others then read it
            dist.barrier()
        for t in plan.tasks:
            for length in sorted({c.length for c in plan.cells if c.task == t.label}, key=lambda n: n or 0):
                for seed in sorted({c.seed for c in plan.cells if c.task == t.label and c.length == length}):
                    samples.get(t.label, length, seed)
        if dist.is_main:
            dist.barrier()
        _update_meta_main(dist, root, tasks=_task_list(root, samples, plan))
        _say(dist, f"{len(plan.variants)} variants, {len(plan.cells)} cells, model ready in {time.perf_counter() - t0:.0f}s"
             f"{f', {dist.world} processes' if dist.enabled else ''}; rows -> {root / ROWS}")
        failures: list[dict[str, Any]] = []
        for variant in plan.variants:
            failures += _run_variant(variant, plan, recipe, model, tokenizer, samples, done, root, registry, dist,
                                     progress)
            if failures and plan.on_error == "stop":
                break
        written: dict[str, Any] = {}
        if report and dist.is_main and (root / ROWS).is_file() and (root / ROWS).stat().st_size:
            from elasticfw.report import build_report

            written = build_report(root)
            table = root / "table.md"
            if table.is_file():
                print("\n" + table.read_text(encoding="utf-8"), flush=True)
            _say(dist, f"report: {root / 'report.html'} ({sum(len(v) for v in written.values())} files)")
        dist.barrier()
        if failures:
            names = sorted({f"{f['variant']}" + (f"/{f['task']}@{f['length']}" if f["task"] else "") for f in failures})
            raise SweepError(f"{len(failures)} failure(s) in the sweep ({', '.join(names[:6])}"
                             f"{', ...' if len(names) > 6 else ''}); the other rows are in {root / ROWS}, the errors "
                             f"and tracebacks in {root / FAILURES}. Fix them and run again with --resume")
        return root
    finally:
        shutdown(dist)


def _task_list(root: Path, samples: _Samples, plan: Plan) -> list[dict[str, Any]]:
    """The tasks for sweep.json (a resumed sweep keeps the tasks it no longer runs)."""
    new = []
    for t in plan.tasks:
        plugin = samples.registry.make("task", t.config)
        new.append({"label": t.label, "task": t.config.name, "category": t.category or plugin.category,
                    "metric": plugin.metric})
    labels = {t["label"] for t in new}
    old = json.loads((root / META).read_text(encoding="utf-8")).get("tasks", []) if (root / META).is_file() else []
    return [*(t for t in old if t["label"] not in labels), *new]


def _update_meta_main(dist: DistContext, root: Path, **fields: Any) -> None:
    if dist.is_main:
        _update_meta(root, **fields)


def _run_variant(
    variant: Variant, plan: Plan, recipe: Any, model: Any, tokenizer: Any, samples: _Samples, done: set[Any],
    root: Path, registry: Registry, dist: DistContext, progress: bool,
) -> list[dict[str, Any]]:
    """Every cell of one variant; returns the failures (also written to failures.jsonl)."""
    cells = [c for c in plan.cells if c.variant == variant.label]
    todo = {}
    for cell in cells:
        _, items = samples.get(cell.task, cell.length, cell.seed)
        todo[cell] = [i for i in range(len(items)) if (cell.variant, cell.task, cell.length, cell.seed, i) not in done]
    if not any(todo.values()):
        _say(dist, f"variant {variant.label!r}: every sample already in the rows, skipped")
        return []
    failures: list[dict[str, Any]] = []

    def record(cell: Cell | None, errors: list[dict[str, Any]]) -> None:
        failure = errors[0]
        failures.append(failure)
        _say(dist, f"  FAILED {variant.label}" + (f" {cell.task} length {cell.length} seed {cell.seed}" if cell else "")
             + f": {failure['error']}")
        if dist.is_main:
            append_jsonl(root / FAILURES, [failure])

    status: Any
    try:
        elastic = _build(variant, model, tokenizer, recipe, registry)
        status = None
    except Exception as exc:  # noqa: BLE001 -- recorded with its traceback; the sweep fails at the end
        elastic, status = None, _failure(None, variant.label, exc)
    errors = [s for s in dist.all_gather_object(status) if s is not None]
    if errors:
        if elastic is not None:
            elastic.unwrap()
        record(None, errors)
        return failures
    section = elastic.elastic_config
    _say(dist, f"variant {variant.label!r}: router {section.router.name}, {section.retrieval_mode.name}-"
         f"{section.sparse_mode.name}, executor {section.executor.name}"
         + (f" (adapter {variant.adapter})" if variant.adapter else ""))
    try:
        warmup = plan.warmup
        for cell in cells:
            if not todo[cell]:
                continue
            task, items = samples.get(cell.task, cell.length, cell.seed)
            error = _run_cell(cell, todo[cell], task, items, samples.category(cell.task, task), samples.new_tokens(task),
                              elastic, tokenizer, plan, root, dist, progress, warmup=warmup)
            warmup = False
            if error:
                record(cell, error)
                if plan.on_error == "stop":
                    break
    finally:
        elastic.unwrap()
    return failures


def _run_cell(
    cell: Cell, todo: list[int], task: Task, items: list[Sample], category: str, new_tokens: int, elastic: Any,
    tokenizer: Any, plan: Plan, root: Path, dist: DistContext, progress: bool, *, warmup: bool,
) -> list[dict[str, Any]]:
    """One cell: this process's share of the remaining samples, in batches; rank 0 appends the
    gathered rows after each batch step. ``warmup``: first one untimed generate of one token.
    Returns the failures (empty when it went through)."""
    mine = todo[dist.rank :: dist.world]
    steps = math.ceil(math.ceil(len(todo) / dist.world) / plan.batch_size)
    bar = tqdm(total=len(todo), desc=f"{cell.variant} {cell.task}" + (f"@{cell.length}" if cell.length else ""),
               disable=not (progress and dist.is_main), leave=False)
    scores: list[float] = []
    msrs: list[float] = []
    prefill = 0.0
    try:
        for step in range(steps):
            chunk = mine[step * plan.batch_size : (step + 1) * plan.batch_size]
            payload: Any
            try:
                if warmup and step == 0:
                    generate_batch(elastic, tokenizer, task, items[: plan.batch_size], max_new_tokens=1,
                                   padding_side=plan.padding_side)
                results = generate_batch(elastic, tokenizer, task, [items[i] for i in chunk],
                                         max_new_tokens=new_tokens, padding_side=plan.padding_side) if chunk else []
                payload = [_row(cell, i, category, task, items[i], r) for i, r in zip(chunk, results)]
            except Exception as exc:  # noqa: BLE001 -- every process learns of it through the gather below
                payload = _failure(cell, cell.variant, exc)
            gathered = dist.all_gather_object(payload)
            errors = [g for g in gathered if isinstance(g, dict)]
            rows = sorted((r for g in gathered if isinstance(g, list) for r in g), key=lambda r: r["index"])
            if dist.is_main:
                append_jsonl(root / ROWS, rows)  # what finished is kept even if a process failed
            scores += [r["score"] for r in rows]
            msrs += [r["msr"] for r in rows]
            prefill += sum(r["prefill_seconds"] for r in rows)
            bar.update(len(rows))
            if errors:
                return errors
    finally:
        bar.close()
    if scores:
        tokens = sum(len(items[i].input_ids) for i in todo)
        _say(dist, f"  {cell.variant:<16} {cell.task:<18} length {str(cell.length or '-'):>6} seed {cell.seed}: "
             f"{task.metric} {sum(scores) / len(scores):.3f}  MSR {sum(msrs) / len(msrs):.3f}  "
             f"prefill {tokens / max(prefill, 1e-12):,.0f} tok/s  ({len(scores)} samples)")
    return []
