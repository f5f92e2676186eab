"""The Table-1 results as Markdown (``table.md``) and CSV (``table.csv`` wide, ``cells.csv`` long).

In the Markdown table a task cell reads ``0.975 ±0.05 (40)``: mean score, half-width of its 95%
confidence interval, number of samples. Averages read ``0.812 ±0.03``, with ``*`` when the variant
lacks some of the tasks averaged (a partial run). The CSV files carry the exact interval bounds.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from elasticfw.report.aggregate import Average, Cell, TableRow, TaskInfo
from elasticfw.report.runfile import CATEGORIES

MISSING = "—"
SHORT = {"sensitive": "S", "robust": "R", "overall": "all"}
LEGEND = (
    "± = half-width of the 95% confidence interval (Wilson score interval for 0/1 accuracies, Student-t "
    "for continuous scores; averages: normal approximation over the task means); (n) = samples; "
    "S = retrieval-sensitive task, R = robust task; avg = plain mean of the task means, * = over the "
    "tasks present only; MSR = mean model sparsity ratio; speed-up = reference prefill time / this "
    "variant's on the same samples, geometric mean over tasks."
)


@dataclass(frozen=True)
class Column:
    """A score column of the table: a task (``key`` = its label) or an average (``key`` = a
    category or ``overall``)."""

    kind: str
    key: str
    header: str
    group: str


def table_columns(tasks: Sequence[TaskInfo]) -> list[Column]:
    """Task columns grouped by category (sensitive first), each group followed by its average,
    then the overall average."""
    out: list[Column] = []
    for category in CATEGORIES:
        members = [t for t in tasks if t.category == category]
        for t in members:
            out.append(Column("task", t.label, t.label, category))
        if members:
            out.append(Column("average", category, f"avg {SHORT[category]}", category))
    out.append(Column("average", "overall", "avg all", "overall"))
    return out


def blocks(rows: Sequence[TableRow]) -> dict[str, list[TableRow]]:
    """Table rows by block (a length's label, or all lengths), in order."""
    out: dict[str, list[TableRow]] = {}
    for r in rows:
        out.setdefault(r.block, []).append(r)
    return out


def block_title(block: str) -> str:
    return "All lengths (pooled)" if block == "all lengths" else f"Context length {block}"


def format_cell(cell: Cell | None) -> str:
    return MISSING if cell is None else f"{cell.score:.3f} ±{cell.half_width:.2f} ({cell.n})"


def format_average(avg: Average | None) -> str:
    if avg is None:
        return MISSING
    return f"{avg.mean:.3f} ±{avg.half:.2f}{'' if avg.complete else '*'}"


def format_msr(msr: float | None) -> str:
    return MISSING if msr is None else f"{msr:.3f}"


def format_speedup(speedup: float | None) -> str:
    return MISSING if speedup is None else f"{speedup:.2f}×"


def row_values(row: TableRow, columns: Sequence[Column]) -> list[str]:
    """The printed cells of one table row: variant, score columns, MSR, speed-up, n."""
    scores = [
        format_cell(row.cells.get(c.key)) if c.kind == "task" else format_average(row.averages.get(c.key))
        for c in columns
    ]
    return [row.variant, *scores, format_msr(row.msr), format_speedup(row.speedup), str(row.n)]


def _md(text: str) -> str:
    text = " ".join(text.split())
    for ch in "\\|<>":  # backslash first; < and > would otherwise read as inline HTML
        text = text.replace(ch, "\\" + ch)
    return text


def markdown_table(
    rows: Sequence[TableRow], tasks: Sequence[TaskInfo], *, title: str, reference: str | None
) -> str:
    """``table.md``: one Markdown table per block, with a legend."""
    columns = table_columns(tasks)
    headers = [
        "variant",
        *(f"{SHORT[c.group]} · {c.header}" if c.kind == "task" else c.header for c in columns),
        "MSR",
        "speed-up",
        "n",
    ]
    ref = f"speed-ups against `{_md(reference)}`" if reference else "no reference variant: no speed-ups"
    lines = [f"# {_md(title)}", "", LEGEND, "", f"Tasks: {_task_list(tasks)}; {ref}.", ""]
    for block, members in blocks(rows).items():
        lines += [f"## {block_title(block)}", ""]
        lines.append("| " + " | ".join(_md(h) for h in headers) + " |")
        lines.append("|" + "|".join([":--", *["--:"] * (len(headers) - 1)]) + "|")
        for row in members:
            lines.append("| " + " | ".join(_md(v) for v in row_values(row, columns)) + " |")
        lines.append("")
    return "\n".join(lines)


def _task_list(tasks: Sequence[TaskInfo]) -> str:
    return ", ".join(f"{_md(t.label)} ({SHORT[t.category]}, {_md(t.metric or '?')})" for t in tasks)


def _num(x: float | int | None) -> str:
    return "" if x is None else repr(x)


def wide_csv(rows: Sequence[TableRow], tasks: Sequence[TaskInfo]) -> str:
    """``table.csv``: one line per table row; per task ``score``/``lo``/``hi``/``n``, per average
    ``mean``/``half``/``tasks`` (how many tasks it averages), then MSR, speed-up, n."""
    columns = table_columns(tasks)
    header = ["block", "length", "variant"]
    for c in columns:
        if c.kind == "task":
            header += [f"{c.key}:score", f"{c.key}:lo", f"{c.key}:hi", f"{c.key}:n"]
        else:
            header += [f"avg_{c.key}", f"avg_{c.key}:half", f"avg_{c.key}:tasks"]
    header += ["msr", "speedup", "n"]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        line = [row.block, _num(row.length), row.variant]
        for c in columns:
            if c.kind == "task":
                cell = row.cells.get(c.key)
                line += (
                    [""] * 4
                    if cell is None
                    else [_num(cell.score), _num(cell.lo), _num(cell.hi), str(cell.n)]
                )
            else:
                avg = row.averages.get(c.key)
                line += [""] * 3 if avg is None else [_num(avg.mean), _num(avg.half), str(avg.k)]
        line += [_num(row.msr), _num(row.speedup), str(row.n)]
        writer.writerow(line)
    return buf.getvalue()


def cells_csv(cells: Sequence[Cell]) -> str:
    """``cells.csv``: one line per (variant, task, length) cell, every statistic of :class:`Cell`."""
    names = [f.name for f in fields(Cell) if f.name != "pooled"]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*names, "half_width"])
    for cell in cells:
        data = asdict(cell)
        values = [v if isinstance(v, str) else _num(v) for v in (data[n] for n in names)]
        writer.writerow([*values, _num(cell.half_width)])
    return buf.getvalue()
