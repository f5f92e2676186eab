"""Read a sweep run folder and summarise it: per-cell statistics and the paper-Table-1 rows.

A *cell* is one (variant, task, context length) with every seed pooled. Its speed-up is measured
against the run's reference variant on the samples both evaluated: a sample is identified by
(task, length, seed, index), and ``speedup = Σ prefill_seconds(reference) / Σ prefill_seconds(variant)``
over the samples the two share (``> 1`` means faster than the reference). It is ``None`` without a
reference, without shared samples, or when the variant's summed time is 0.

A *table row* is one variant in one block (one context length, or all lengths pooled): each task's
cell, the per-category and overall averages (plain means of the task means, with the
normal-approximation half-width of :func:`elasticfw.report.stats.average_interval`), the mean of
its cells' MSR and of their speed-ups, and the number of samples. An average over fewer tasks than
the sweep has (a partial run) is flagged ``complete=False``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from elasticfw.report.runfile import CATEGORIES, Run, TaskInfo, load_run, sample_key
from elasticfw.report.stats import average_interval, mean_interval, standard_error

__all__ = [
    "ALL_LENGTHS",
    "Average",
    "Cell",
    "Run",
    "TableRow",
    "TaskInfo",
    "cells",
    "length_label",
    "load_run",
    "table_rows",
    "tasks_from_rows",
]

ALL_LENGTHS = "all lengths"


@dataclass(frozen=True)
class Cell:
    """Statistics of one (variant, task, length); ``pooled`` cells pool every length (length None)."""

    variant: str
    task: str
    category: str
    metric: str
    length: int | None
    pooled: bool
    n: int
    seeds: int
    score: float
    lo: float
    hi: float
    method: str
    se: float
    msr: float | None
    esr: float | None
    esr_last_layer: float | None
    tokens: float
    tokens_total: int
    prefill_seconds: float
    tokens_per_second: float | None
    speedup: float | None
    speedup_pairs: int

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2


@dataclass(frozen=True)
class Average:
    """Plain average of ``k`` task means (of ``expected`` tasks) with its CI half-width."""

    mean: float
    half: float
    k: int
    expected: int

    @property
    def complete(self) -> bool:
        return self.k == self.expected


@dataclass(frozen=True)
class TableRow:
    """One variant in one block of the table (``block`` is a length's label or ``ALL_LENGTHS``)."""

    variant: str
    block: str
    length: int | None
    pooled: bool
    cells: dict[str, Cell]
    averages: dict[str, Average | None]
    msr: float | None
    speedup: float | None
    n: int


def length_label(length: int | None) -> str:
    """How a context length is printed (``n/a`` for tasks without one)."""
    return "n/a" if length is None else str(length)


def _mean(values: Iterable[float | None]) -> float | None:
    """Mean of the finite values (``None`` when there are none)."""
    kept = [float(v) for v in values if v is not None and math.isfinite(v)]
    return math.fsum(kept) / len(kept) if kept else None


def _geometric_mean(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the finite positive values (the mean of ratios: 2x and 0.5x average to 1x)."""
    kept = [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    return math.exp(math.fsum(math.log(v) for v in kept) / len(kept)) if kept else None


def _first_seen(values: Iterable[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


def tasks_from_rows(rows: Sequence[dict[str, Any]]) -> list[TaskInfo]:
    """Task labels in order of first appearance, sensitive ones first."""
    seen: dict[str, TaskInfo] = {}
    for r in rows:
        seen.setdefault(r["task"], TaskInfo(r["task"], r["task"], r["category"], r["metric"]))
    return sorted(seen.values(), key=lambda t: CATEGORIES.index(t.category))


def _summarise(
    group: list[dict[str, Any]],
    *,
    length: int | None,
    pooled: bool,
    reference_times: dict[tuple[Any, ...], float] | None,
    confidence: float,
) -> Cell:
    first = group[0]
    scores = [float(r["score"]) for r in group]
    interval = mean_interval(scores, confidence)
    tokens_total = sum(int(r["tokens"]) for r in group)
    seconds = math.fsum(float(r["prefill_seconds"]) for r in group)
    speedup, pairs = None, 0
    if reference_times is not None:
        own = {sample_key(r): float(r["prefill_seconds"]) for r in group}
        shared = [k for k in own if k in reference_times]
        pairs = len(shared)
        own_time = math.fsum(own[k] for k in shared)
        if shared and own_time > 0:
            speedup = math.fsum(reference_times[k] for k in shared) / own_time
    return Cell(
        variant=first["variant"],
        task=first["task"],
        category=first["category"],
        metric=first["metric"],
        length=length,
        pooled=pooled,
        n=len(group),
        seeds=len({r["seed"] for r in group}),
        score=interval.mean,
        lo=interval.lo,
        hi=interval.hi,
        method=interval.method,
        se=standard_error(scores, confidence),
        msr=_mean(r["msr"] for r in group),
        esr=_mean(r["esr"] for r in group),
        esr_last_layer=_mean(r.get("esr_last_layer") for r in group),
        tokens=tokens_total / len(group),
        tokens_total=tokens_total,
        prefill_seconds=seconds,
        tokens_per_second=tokens_total / seconds if seconds > 0 else None,
        speedup=speedup,
        speedup_pairs=pairs,
    )


def cells(
    rows: Sequence[dict[str, Any]],
    reference: str | None = None,
    *,
    pool_lengths: bool = False,
    confidence: float = 0.95,
) -> list[Cell]:
    """One :class:`Cell` per (variant, task, length) present in ``rows`` (seeds pooled), or per
    (variant, task) with every length pooled when ``pool_lengths``. Ordered by variant (first
    appearance), task (sensitive first, then first appearance) and length (ascending, None first)."""
    task_order = {t.label: i for i, t in enumerate(tasks_from_rows(rows))}
    variant_order = {v: i for i, v in enumerate(_first_seen(r["variant"] for r in rows))}
    groups: dict[tuple[str, str, int | None], list[dict[str, Any]]] = {}
    for r in rows:
        length = None if pool_lengths else r["length"]
        groups.setdefault((r["variant"], r["task"], length), []).append(r)
    ref_times: dict[str, dict[tuple[Any, ...], float]] | None = None
    if reference is not None:
        ref_times = {}
        for r in rows:
            if r["variant"] == reference:
                ref_times.setdefault(r["task"], {})[sample_key(r)] = float(r["prefill_seconds"])

    def order(key: tuple[str, str, int | None]) -> tuple[int, int, int, int]:
        variant, task, length = key
        return (variant_order[variant], task_order[task], length is not None, length or 0)

    out = []
    for key in sorted(groups, key=order):
        times = None if ref_times is None else ref_times.get(key[1], {})
        out.append(
            _summarise(
                groups[key], length=key[2], pooled=pool_lengths, reference_times=times, confidence=confidence
            )
        )
    return out


def _average(found: list[Cell], expected: int, confidence: float) -> Average | None:
    if not found:
        return None
    mean, half = average_interval([c.score for c in found], [c.se for c in found], confidence)
    return Average(mean, half, len(found), expected)


def _row(
    variant: str,
    block: str,
    length: int | None,
    pooled: bool,
    by_task: dict[str, Cell],
    tasks: Sequence[TaskInfo],
    confidence: float,
) -> TableRow:
    averages: dict[str, Average | None] = {}
    for category in CATEGORIES:
        members = [t.label for t in tasks if t.category == category]
        if members:
            found = [by_task[t] for t in members if t in by_task]
            averages[category] = _average(found, len(members), confidence)
    present = [by_task[t.label] for t in tasks if t.label in by_task]
    averages["overall"] = _average(present, len(tasks), confidence)
    return TableRow(
        variant=variant,
        block=block,
        length=length,
        pooled=pooled,
        cells={c.task: c for c in present},
        averages=averages,
        msr=_mean(c.msr for c in present),
        speedup=_geometric_mean(c.speedup for c in present),
        n=sum(c.n for c in present),
    )


def table_rows(
    rows: Sequence[dict[str, Any]],
    *,
    tasks: Sequence[TaskInfo] | None = None,
    variants: Sequence[str] | None = None,
    lengths: Sequence[int | None] | None = None,
    reference: str | None = None,
    confidence: float = 0.95,
) -> list[TableRow]:
    """Table-1 rows: for each length (in ``lengths`` order, then any other length the rows have)
    one row per variant, then — when there is more than one length — an ``ALL_LENGTHS`` block
    pooling every length. Every variant gets a row in every block, with no cells if it has no rows
    there (a partial run). Tasks and variants the rows have beyond ``tasks``/``variants`` (the
    sweep's declared ones) are added in order of appearance; tasks are put sensitive first."""
    known = list(tasks or [])
    extra = [t for t in tasks_from_rows(rows) if t.label not in {k.label for k in known}]
    tasks = sorted(known + extra, key=lambda t: CATEGORIES.index(t.category))
    variants = _first_seen([*(variants or []), *(r["variant"] for r in rows)])
    all_lengths: list[int | None] = _first_seen([*(lengths or []), *(r["length"] for r in rows)])
    out: list[TableRow] = []
    per_length = cells(rows, reference, confidence=confidence)
    for length in all_lengths:
        for variant in variants:
            by_task = {c.task: c for c in per_length if c.variant == variant and c.length == length}
            out.append(_row(variant, length_label(length), length, False, by_task, tasks, confidence))
    if len(all_lengths) > 1:
        pooled = cells(rows, reference, pool_lengths=True, confidence=confidence)
        for variant in variants:
            by_task = {c.task: c for c in pooled if c.variant == variant}
            out.append(_row(variant, ALL_LENGTHS, None, True, by_task, tasks, confidence))
    return out
