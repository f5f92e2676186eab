"""Mode shares and expected cost of the variants that route among K >= 3 modes.

The rows of such a variant carry, per sample, ``shares`` (the share of routed (layer, KV head) in
each mode, in the variant's mode order) and ``cost`` (the expected cost of its routing: the mean
over those heads of their mode's relative cost at the prompt's length, full attention 1). Per
(variant, task, context length) this module gives the mean share of heads per mode and the mean
cost with its spread over the samples (population standard deviation, minimum, maximum).

Rows without them (two-mode variants) are left out; a run without any gives no table, so the
report of a two-mode sweep is what it was. A mode's label is its name, with its position appended
where two modes of the variant share a name (``streaming.2``), as in the training reports; the
labels come from the variant's entry in ``sweep.json`` (``mode_labels``), else ``mode 0``,
``mode 1``, ...
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elasticfw.report.runfile import CATEGORIES
from elasticfw.report.tables import MISSING, _md

LEGEND = (
    "share = mean over samples of the share of routed (layer, KV head) in each mode (— = a mode the variant "
    "does not have); cost = mean over samples of the expected cost of the routing, the mean over routed heads "
    "of their mode's relative cost at the prompt's length (full attention = 1), ± its standard deviation "
    "over samples, [min, max]; (n) = samples."
)


@dataclass(frozen=True)
class ModeCell:
    """One (variant, task, length) of a K-mode variant (``length`` None: every length pooled)."""

    variant: str
    modes: str
    task: str
    category: str
    length: int | None
    n: int
    cost: float
    cost_std: float
    cost_min: float
    cost_max: float
    shares: dict[str, float]


def _labels(meta: dict[str, Any] | None, k: int) -> list[str]:
    labels = (meta or {}).get("mode_labels")
    if isinstance(labels, list) and len(labels) == k and all(isinstance(n, str) for n in labels):
        return labels
    return [f"mode {i}" for i in range(k)]


def _costed(row: dict[str, Any]) -> bool:
    return isinstance(row.get("shares"), list) and row.get("cost") is not None


def mode_cells(
    rows: Sequence[dict[str, Any]],
    variants: Sequence[str],
    meta: Sequence[dict[str, Any]] = (),
    *,
    pool_lengths: bool = False,
) -> list[ModeCell]:
    """One :class:`ModeCell` per (variant, task, length) whose rows carry ``shares`` and ``cost``,
    ordered by variant (``variants`` order), task (sensitive first, then first appearance) and
    length (ascending, None first); per (variant, task) with every length pooled when ``pool_lengths``.
    ``meta``: the variants' entries of ``sweep.json`` (their ``mode_labels`` label the shares)."""
    entries = {v.get("label"): v for v in meta}
    costed = [r for r in rows if _costed(r)]
    tasks = sorted(dict.fromkeys((r["task"], r["category"]) for r in costed),
                   key=lambda t: CATEGORIES.index(t[1]) if t[1] in CATEGORIES else len(CATEGORIES))
    task_order = {t: i for i, (t, _) in enumerate(tasks)}
    groups: dict[tuple[str, str, int | None], list[dict[str, Any]]] = {}
    for r in costed:
        groups.setdefault((r["variant"], r["task"], None if pool_lengths else r["length"]), []).append(r)
    order = {v: i for i, v in enumerate(dict.fromkeys([*variants, *(r["variant"] for r in costed)]))}
    out = []
    for key in sorted(groups, key=lambda k: (order[k[0]], task_order[k[1]], k[2] is not None, k[2] or 0)):
        group = groups[key]
        k = max(len(r["shares"]) for r in group)
        labels = _labels(entries.get(key[0]), k)
        costs = [float(r["cost"]) for r in group]
        mean = math.fsum(costs) / len(costs)
        shares = {label: math.fsum(float(r["shares"][i]) for r in group if i < len(r["shares"])) / len(group)
                  for i, label in enumerate(labels)}
        names = (entries.get(key[0]) or {}).get("modes")
        out.append(ModeCell(
            variant=key[0], modes=names if isinstance(names, str) else "-".join(labels), task=key[1],
            category=group[0]["category"], length=key[2], n=len(group), cost=mean,
            cost_std=math.sqrt(math.fsum((c - mean) ** 2 for c in costs) / len(costs)),
            cost_min=min(costs), cost_max=max(costs), shares=shares,
        ))
    return out


def share_columns(cells: Sequence[ModeCell]) -> list[str]:
    """The mode labels of every cell, in order of first appearance (one share column each)."""
    return list(dict.fromkeys(label for c in cells for label in c.shares))


def _length(length: int | None) -> str:
    return "n/a" if length is None else str(length)


def format_cost(cell: ModeCell) -> str:
    return f"{cell.cost:.3f} ±{cell.cost_std:.3f} [{cell.cost_min:.3f}, {cell.cost_max:.3f}]"


def table_values(cell: ModeCell, columns: Sequence[str]) -> list[str]:
    """The printed cells of one line: variant, modes, task, length, one share per column, cost, n."""
    shares = [f"{cell.shares[c]:.3f}" if c in cell.shares else MISSING for c in columns]
    return [cell.variant, cell.modes, cell.task, _length(cell.length), *shares, format_cost(cell), str(cell.n)]


def table_headers(columns: Sequence[str]) -> list[str]:
    return ["variant", "modes", "task", "length", *(f"share {c}" for c in columns), "cost", "n"]


def modes_markdown(cells: Sequence[ModeCell]) -> str:
    """The "Mode shares and expected cost" section of ``table.md`` ("" without K-mode variants)."""
    if not cells:
        return ""
    columns = share_columns(cells)
    headers = table_headers(columns)
    lines = ["## Mode shares and expected cost (variants with K >= 3 modes)", "", LEGEND, "",
             "| " + " | ".join(_md(h) for h in headers) + " |",
             "|" + "|".join([":--", ":--", ":--", *["--:"] * (len(headers) - 3)]) + "|"]
    lines += ["| " + " | ".join(_md(v) for v in table_values(c, columns)) + " |" for c in cells]
    return "\n".join(lines) + "\n"


def modes_csv(cells: Sequence[ModeCell]) -> str:
    """``modes.csv``: one line per (variant, task, length): the cost's mean, standard deviation,
    minimum and maximum, and one ``share:<mode>`` column per mode label (empty where the variant
    has no such mode)."""
    columns = share_columns(cells)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["variant", "modes", "task", "category", "length", "n", "cost", "cost_std", "cost_min",
                     "cost_max", *(f"share:{c}" for c in columns)])
    for c in cells:
        writer.writerow([c.variant, c.modes, c.task, c.category, "" if c.length is None else str(c.length), str(c.n),
                         repr(c.cost), repr(c.cost_std), repr(c.cost_min), repr(c.cost_max),
                         *(repr(c.shares[m]) if m in c.shares else "" for m in columns)])
    return buf.getvalue()
