"""Tables, confidence intervals, figures and an HTML page summarising a comparison sweep's run folder.

``build_report(RUN)`` reads ``RUN/sweep.json``, ``RUN/rows.jsonl`` and ``RUN/failures.jsonl`` (see
:mod:`elasticfw.report.runfile`) and writes, each file atomically:

* ``RUN/table.md`` — the paper-Table-1 tables (one per context length, plus all lengths pooled),
  and how input-adaptive each method's routing is (:mod:`elasticfw.report.routing`);
* ``RUN/table.csv`` — the same rows in wide form with exact interval bounds;
* ``RUN/cells.csv`` — one line per (variant, task, length) cell;
* ``RUN/modes.csv`` — for variants that route among K >= 3 modes only: per (variant, task, length)
  the mean share of heads in each mode and the expected cost with its spread over samples
  (:mod:`elasticfw.report.modes`); ``table.md`` and the HTML page get the same table;
* ``RUN/figures/*.png`` and ``*.svg`` — see :mod:`elasticfw.report.plots`;
* ``RUN/report.html`` — a self-contained page with all of the above and the run's provenance.

It can be run on a sweep still in progress (some variants missing some cells).
"""

from __future__ import annotations

from pathlib import Path

from elasticfw.atomic import atomic_write_text
from elasticfw.report.aggregate import Cell, Run, TableRow, cells, load_run, table_rows
from elasticfw.report.errors import ReportError
from elasticfw.report.html import render_html
from elasticfw.report.modes import ModeCell, mode_cells, modes_csv, modes_markdown
from elasticfw.report.plots import pareto_skip_reason, write_figures
from elasticfw.report.routing import RoutingSummary, routing_markdown, routing_summaries
from elasticfw.report.stats import mean_interval, wilson_interval
from elasticfw.report.tables import cells_csv, markdown_table, wide_csv

__all__ = [
    "Cell",
    "ReportError",
    "Run",
    "TableRow",
    "ModeCell",
    "build_report",
    "cells",
    "mode_cells",
    "load_run",
    "mean_interval",
    "report_tables",
    "table_rows",
    "wilson_interval",
]


def _contents(run: Run, confidence: float) -> tuple[dict[str, str], list[TableRow], list[Cell], list[RoutingSummary], list[ModeCell]]:
    if not run.rows:
        raise ReportError(
            f"{run.path}: no rows yet (rows.jsonl is missing or empty); the sweep has not finished a sample"
        )
    rows = table_rows(
        run.rows,
        tasks=run.tasks,
        variants=run.variants,
        lengths=run.lengths,
        reference=run.reference,
        confidence=confidence,
    )
    per_length = cells(run.rows, run.reference, confidence=confidence)
    title = f"Sweep report: {run.path.name}"
    routing = routing_summaries(run.rows, run.variants)
    modes = mode_cells(run.rows, run.variants, run.meta.get("variants", []))
    tables = {
        "table.md": markdown_table(rows, run.tasks, title=title, reference=run.reference)
        + ("\n" + modes_markdown(modes) if modes else "")
        + ("\n" + routing_markdown(routing) if routing else ""),
        "table.csv": wide_csv(rows, run.tasks),
        "cells.csv": cells_csv(per_length),
    }
    if modes:  # variants with K >= 3 modes: their mode shares and expected cost
        tables["modes.csv"] = modes_csv(modes)
    return tables, rows, per_length, routing, modes


def report_tables(run_dir: Path | str, *, confidence: float = 0.95) -> dict[str, str]:
    """The text of the tables :func:`build_report` writes (file name: content), without writing
    anything or drawing the figures."""
    return _contents(load_run(run_dir), confidence)[0]


def build_report(run_dir: Path | str, *, confidence: float = 0.95) -> dict[str, list[Path]]:
    """Write the tables, figures and ``report.html`` of a sweep run folder. Returns the written
    files: ``{"tables": [table.md, table.csv, cells.csv (, modes.csv)], "figures": [...],
    "html": [report.html]}``. Raises :class:`ReportError` when the folder is not a sweep run or has
    no rows yet."""
    run = load_run(run_dir)
    tables, rows, per_length, routing, modes = _contents(run, confidence)
    written: dict[str, list[Path]] = {"tables": [], "figures": [], "html": []}
    for name, text in tables.items():
        atomic_write_text(run.path / name, text)
        written["tables"].append(run.path / name)
    written["figures"] = write_figures(run, run.path / "figures", confidence=confidence)
    note = pareto_skip_reason(run.reference, per_length)
    page = render_html(run, rows, figures=written["figures"], notes=[note] if note else [],
                       title=f"Sweep report: {run.path.name}", routing=routing, modes=modes)
    atomic_write_text(run.path / "report.html", page)
    written["html"].append(run.path / "report.html")
    return written
