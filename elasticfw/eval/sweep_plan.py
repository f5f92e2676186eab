"""What a comparison sweep runs: its variants, tasks and cells, from a validated recipe.

``compare:`` lists the variants (an elastic section, or a trained adapter folder), ``sweep:``
the tasks, lengths and seeds, or an explicit list of cells. A recipe with ``compare:`` and
``eval:`` but no ``sweep:`` sweeps its ``eval.task`` with the eval settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticfw.errors import RecipeError
from elasticfw.model.checkpoint import WEIGHTS, read_adapter_config
from elasticfw.provenance import file_sha256
from elasticfw.recipe.schema import sweep_task_entries


@dataclass(frozen=True)
class Variant:
    label: str
    elastic: Any  # the recipe's section; unused by an adapter variant, which runs its own
    adapter: str | None
    #: what the variant runs, as data: the elastic section (an adapter's own), and an adapter's
    #: weights hash, so a resumed sweep notices a retrained adapter
    spec: dict[str, Any]


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
    reference_explicit: bool  # named in the recipe (a resumed sweep otherwise keeps its own)
    batch_size: int
    max_new_tokens: int | None
    padding_side: str
    warmup: bool
    on_error: str
    output_dir: str


def variant_spec(elastic: Any, adapter: str | None) -> dict[str, Any]:
    """The elastic section a variant runs (an adapter's stored one) and its adapter's identity."""
    if adapter is None:
        return {"elastic": elastic.model_dump(mode="json"), "adapter": None}
    folder = Path(adapter).expanduser()
    return {"elastic": read_adapter_config(folder)["elastic"], "adapter": adapter,
            "adapter_sha256": file_sha256(folder / WEIGHTS)}


def make_plan(recipe: Any, variants: list[tuple[str, Any, str | None]] | None = None) -> Plan:
    """The sweep a recipe describes (its validation already checked labels, cells and lengths).
    ``variants`` (label, elastic section, adapter) replaces the recipe's ``compare:`` list
    (``elasticfw eval`` runs the recipe's own section this way)."""
    if variants is None:
        if not recipe.compare:
            raise RecipeError("compare: the recipe has no `compare:` list of variants to run")
        variants = [(v.label, v.elastic, v.adapter) for v in recipe.compare]
    sweep = recipe.sweep
    entries = sweep_task_entries(recipe)
    if not entries:
        raise RecipeError("eval: this command needs tasks: a `sweep.tasks` list or an `eval.task`")
    runs = [Variant(label, elastic, adapter, variant_spec(elastic, adapter)) for label, elastic, adapter in variants]
    tasks = [SweepTask(label, config, category) for label, config, category in entries]
    labels = {v.label for v in runs}
    if sweep is not None and sweep.cells and any(c.variant not in labels for c in sweep.cells):
        raise RecipeError(f"sweep.cells name variants this command does not run (it runs: {', '.join(sorted(labels))})")
    if sweep is not None and sweep.cells:
        cells = [Cell(c.variant, c.task, c.length, recipe.seed if c.seed is None else c.seed) for c in sweep.cells]
        lengths = list(dict.fromkeys(c.length for c in cells))
        seeds = list(dict.fromkeys(c.seed for c in cells))
    else:
        lengths = list(sweep.lengths) if sweep is not None and sweep.lengths else [None]
        seeds = list(sweep.seeds) if sweep is not None and sweep.seeds else [recipe.seed]
        cells = [Cell(v.label, t.label, n, s) for v in runs for t in tasks for n in lengths for s in seeds]
    ev = recipe.eval
    explicit = sweep is not None and sweep.reference is not None
    return Plan(
        variants=runs, tasks=tasks, cells=cells, lengths=lengths, seeds=seeds,
        reference=sweep.reference if explicit and sweep.reference in labels else runs[0].label,
        reference_explicit=explicit and sweep.reference in labels,
        batch_size=sweep.batch_size if sweep is not None else ev.batch_size,
        max_new_tokens=sweep.max_new_tokens if sweep is not None else ev.max_new_tokens,
        padding_side=sweep.padding_side if sweep is not None else ev.padding_side,
        warmup=sweep.warmup if sweep is not None else True,
        on_error=sweep.on_error if sweep is not None else "continue",
        output_dir=sweep.output_dir if sweep is not None else str(Path(recipe.output_dir or "runs") / "compare"),
    )
