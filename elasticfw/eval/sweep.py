"""``elasticfw compare``: a sweep of variants × tasks × context lengths × seeds.

The plan comes from the recipe: ``compare:`` lists the variants (an elastic section or a trained
adapter each), ``sweep:`` the tasks, lengths and seeds (or an explicit list of cells), batching
and the run folder. A recipe with ``compare:`` and ``eval:`` but no ``sweep:`` sweeps its
``eval.task`` with the eval settings.

Every sample becomes one row of ``RUN/rows.jsonl`` (see :mod:`elasticfw.eval.rows`), appended as
its batch finishes: score, MSR, ESR, the routing decision of every KV head, the prefill time and
tokens; with K >= 3 modes also each head's mode, the share of heads per mode and the expected
cost. ``--resume`` skips every sample already there; a variant or cell that raises is written to
``RUN/failures.jsonl`` and the others go on (``sweep.on_error: stop`` stops instead). At the end
the report (tables, figures, HTML) is built from the rows (:mod:`elasticfw.report`).

A cell's remaining samples are cut into batches of ``batch_size`` by sample index, whatever the
number of processes. Under ``torchrun`` every process loads the model on its own GPU and takes
every ``world``-th batch; after each batch step the processes gather their rows and rank 0
appends them, so the rows (and the table) are those of one process.
"""

from __future__ import annotations

import math
import time
import traceback
from pathlib import Path
from typing import Any

from tqdm import tqdm

from elasticfw.eval.dataset import samples_from_dataset, task_dataset
from elasticfw.eval.generate import generate_batch
from elasticfw.eval.rows import repair_rows, row_key
from elasticfw.eval.sweep_folder import FAILURES, ROWS, SweepError, prepare_run_dir, update_meta
from elasticfw.eval.sweep_plan import Cell, Plan, Variant, make_plan
from elasticfw.eval.task import Sample, Task, check_context, context_window
from elasticfw.jsonl import append_jsonl
from elasticfw.model.checkpoint import load_adapter
from elasticfw.model.loading import load_model, make_elastic
from elasticfw.provenance import environment
from elasticfw.recipe.schema import task_at_length
from elasticfw.registry import Registry, get_registry
from elasticfw.training.distributed import DistContext, init_distributed, shutdown

__all__ = ["SweepError", "run_sweep"]


class _Samples:
    """Each (task, length, seed)'s samples, built once and shared by every variant. A cell whose
    samples cannot be built (a prompt longer than the context window ...) keeps its error, which
    fails that cell only."""

    def __init__(self, plan: Plan, tokenizer: Any, model: Any, registry: Registry) -> None:
        self.tasks = {t.label: t for t in plan.tasks}
        self.tokenizer, self.model, self.registry = tokenizer, model, registry
        self.max_new_tokens = plan.max_new_tokens
        self._cache: dict[tuple[str, int | None, int], tuple[Task, list[Sample]] | BaseException] = {}

    def build(self, task: str, length: int | None, seed: int) -> None:
        key = (task, length, seed)
        if key in self._cache:
            return
        entry = self.tasks[task]
        try:
            plugin = self.registry.make("task", task_at_length(entry.config, length))
            samples = samples_from_dataset(task_dataset(plugin, self.tokenizer, seed=seed, split="eval"))
            check_context(entry.label, samples, context_window(self.model), extra=self.new_tokens(plugin))
            self._cache[key] = (plugin, samples)
        except Exception as exc:  # noqa: BLE001 -- kept and reported as the failure of every cell using it
            self._cache[key] = exc

    def get(self, task: str, length: int | None, seed: int) -> tuple[Task, list[Sample]]:
        self.build(task, length, seed)
        found = self._cache[(task, length, seed)]
        if isinstance(found, BaseException):
            raise found
        return found

    def new_tokens(self, task: Task) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else task.max_new_tokens

    def category(self, label: str, task: Task) -> str:
        return self.tasks[label].category or task.category


def _build(variant: Variant, model: Any, tokenizer: Any, recipe: Any, registry: Registry) -> Any:
    if variant.adapter is not None:
        return load_adapter(model, variant.adapter, registry=registry, base_model=recipe.model.name)
    return make_elastic(model, tokenizer, variant.elastic, registry=registry, base_model_name=recipe.model.name,
                        seed=recipe.seed)


def _failure(cell: Cell | None, variant: str, exc: BaseException) -> dict[str, Any]:
    return {"variant": variant, "task": cell.task if cell else None, "length": cell.length if cell else None,
            "seed": cell.seed if cell else None, "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(exc))}


def _row(cell: Cell, index: int, category: str, task: Task, sample: Sample, r: Any, attempt: int) -> dict[str, Any]:
    return {
        "variant": cell.variant, "task": cell.task, "category": category, "metric": task.metric,
        "length": cell.length, "seed": cell.seed, "index": index, "tokens": r.tokens, "score": r.score,
        "msr": r.msr, "esr": r.esr, "esr_last_layer": r.esr_last_layer, "decisions": r.decisions,
        "routed_layers": r.routed_layers, "prefill_seconds": r.prefill_seconds,
        "batch_prefill_seconds": r.batch_prefill_seconds, "batch_size": r.batch_size, "batch_tokens": r.batch_tokens,
        "generate_seconds": r.generate_seconds, "completion": r.completion, "answer": sample.answer,
        "attempt": attempt,
        # K >= 3 modes: each head's mode, the share of heads per mode and the expected cost (two-mode rows
        # keep their keys: their decisions say it all)
        **({"modes": r.modes, "shares": r.shares, "cost": r.cost} if r.modes is not None else {}),
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
    variants: list[tuple[str, Any, str | None]] | None = None,
) -> Path:
    """Run the recipe's sweep into its run folder (see the module docstring); returns the folder.
    ``variants`` (label, elastic section, adapter folder) replaces the recipe's ``compare:`` list.

    Raises :class:`SweepError` at the end if some variant or cell failed (the other rows are kept)."""
    plan = make_plan(recipe, variants)
    registry = registry or get_registry()
    dist = init_distributed(recipe.model.device)
    try:
        root = Path(output or plan.output_dir).expanduser()
        attempt = prepare_run_dir(root, recipe, plan, resume=resume, overwrite=overwrite, dist=dist)
        done = dist.all_gather_object({row_key(r) for r in repair_rows(root / ROWS)} if dist.is_main else None)[0]
        section = recipe.model if dist.device is None else recipe.model.model_copy(update={"device": str(dist.device)})
        t0 = time.perf_counter()
        _say(dist, f"loading model {recipe.model.name!r} ({section.dtype}, {section.device})")
        model, tokenizer = load_model(section, registry=registry)
        samples = _Samples(plan, tokenizer, model, registry)
        if not dist.is_main:  # rank 0 fills the sample cache first; the others then read it
            dist.barrier()
        for cell in plan.cells:
            samples.build(cell.task, cell.length, cell.seed)
        if dist.is_main:
            dist.barrier()
            update_meta(root, tasks=_task_list(samples, plan),
                        attempt={"environment": environment(next(model.parameters()).device)})
        _say(dist, f"{len(plan.variants)} variants, {len(plan.cells)} cells, model ready in {time.perf_counter() - t0:.0f}s"
             f"{f', {dist.world} processes' if dist.enabled else ''}; rows -> {root / ROWS}")
        failures: list[dict[str, Any]] = []
        for variant in plan.variants:
            failures += _run_variant(variant, plan, recipe, model, tokenizer, samples, done, root, registry, dist,
                                     progress, attempt)
            if failures and plan.on_error == "stop":
                break
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


def _task_list(samples: _Samples, plan: Plan) -> list[dict[str, Any]]:
    """The tasks for sweep.json: label, task plugin, category, metric."""
    out = []
    for t in plan.tasks:
        plugin = samples.registry.make("task", t.config)
        out.append({"label": t.label, "task": t.config.name, "category": t.category or plugin.category,
                    "metric": plugin.metric})
    return out


def _run_variant(
    variant: Variant, plan: Plan, recipe: Any, model: Any, tokenizer: Any, samples: _Samples, done: set[Any],
    root: Path, registry: Registry, dist: DistContext, progress: bool, attempt: int,
) -> list[dict[str, Any]]:
    """Every cell of one variant; returns the failures (also written to failures.jsonl)."""
    failures: list[dict[str, Any]] = []

    def record(cell: Cell | None, failure: dict[str, Any]) -> None:
        failures.append(failure)
        _say(dist, f"  FAILED {variant.label}" + (f" {cell.task} length {cell.length} seed {cell.seed}" if cell else "")
             + f": {failure['error']}")
        if dist.is_main:
            append_jsonl(root / FAILURES, [failure])

    cells = [c for c in plan.cells if c.variant == variant.label]
    todo: dict[Cell, list[int]] = {}
    for cell in cells:
        try:
            _, items = samples.get(cell.task, cell.length, cell.seed)
        except Exception as exc:  # noqa: BLE001 -- the same error on every process: this cell fails
            record(cell, _failure(cell, variant.label, exc))
            if plan.on_error == "stop":
                return failures
            continue
        todo[cell] = [i for i in range(len(items)) if (cell.variant, cell.task, cell.length, cell.seed, i) not in done]
    if not any(todo.values()):
        if todo:
            _say(dist, f"variant {variant.label!r}: every sample already in the rows, skipped")
        return failures
    status: Any = None
    elastic = None
    try:
        elastic = _build(variant, model, tokenizer, recipe, registry)
    except Exception as exc:  # noqa: BLE001 -- recorded with its traceback; the sweep fails at the end
        status = _failure(None, variant.label, exc)
    errors = [s for s in dist.all_gather_object(status) if s is not None]
    if errors:
        if elastic is not None:
            elastic.unwrap()
        record(None, errors[0])
        return failures
    assert elastic is not None
    section = elastic.elastic_config
    _say(dist, f"variant {variant.label!r}: router {section.router.name}, {section.modes_label()}, "
         f"executor {section.executor.name}"
         + (f" (adapter {variant.adapter})" if variant.adapter else ""))
    warmed: set[int | None] = set()
    try:
        for cell, indices in todo.items():
            if not indices:
                continue
            task, items = samples.get(cell.task, cell.length, cell.seed)
            error = _run_cell(cell, indices, task, items, samples.category(cell.task, task), samples.new_tokens(task),
                              elastic, tokenizer, plan, root, dist, progress, attempt,
                              warmup=plan.warmup and cell.length not in warmed)
            warmed.add(cell.length)
            if error:
                record(cell, error)
                if plan.on_error == "stop":
                    break
    finally:
        elastic.unwrap()
    return failures


def _run_cell(
    cell: Cell, todo: list[int], task: Task, items: list[Sample], category: str, new_tokens: int, elastic: Any,
    tokenizer: Any, plan: Plan, root: Path, dist: DistContext, progress: bool, attempt: int, *, warmup: bool,
) -> dict[str, Any] | None:
    """One cell: the remaining samples in batches of ``batch_size`` by index, every ``world``-th
    batch on this process; rank 0 appends the gathered rows after each batch step. ``warmup``:
    first one untimed generate of one token at this length. Returns the failure, if any."""
    batches = [todo[i : i + plan.batch_size] for i in range(0, len(todo), plan.batch_size)]
    mine = batches[dist.rank :: dist.world]
    steps = math.ceil(len(batches) / dist.world)
    bar = tqdm(total=len(todo), desc=f"{cell.variant} {cell.task}" + (f"@{cell.length}" if cell.length else ""),
               disable=not (progress and dist.is_main), leave=False)
    scores: list[float] = []
    msrs: list[float] = []
    prefill = 0.0
    try:
        for step in range(steps):
            chunk = mine[step] if step < len(mine) else []
            payload: Any
            try:
                if warmup and step == 0:
                    generate_batch(elastic, tokenizer, task, [items[i] for i in batches[0]], max_new_tokens=1,
                                   padding_side=plan.padding_side)
                results = generate_batch(elastic, tokenizer, task, [items[i] for i in chunk],
                                         max_new_tokens=new_tokens, padding_side=plan.padding_side) if chunk else []
                payload = [_row(cell, i, category, task, items[i], r, attempt) for i, r in zip(chunk, results)]
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
                return errors[0]
    finally:
        bar.close()
    if scores:
        tokens = sum(len(items[i].input_ids) for i in todo)
        _say(dist, f"  {cell.variant:<16} {cell.task:<18} length {str(cell.length or '-'):>6} seed {cell.seed}: "
             f"{task.metric} {sum(scores) / len(scores):.3f}  MSR {sum(msrs) / len(msrs):.3f}  "
             f"prefill {tokens / max(prefill, 1e-12):,.0f} tok/s  ({len(scores)} samples)")
    return None
