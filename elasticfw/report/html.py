"""``report.html``: one self-contained page (PNG figures inlined as base64, no external resources)
with the run's provenance, the Table-1 tables, the failures and every figure with a reading guide.
Every piece of text from the run is escaped with :func:`html.escape`."""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elasticfw.report.aggregate import Run, TableRow, TaskInfo, length_label
from elasticfw.report.modes import LEGEND as MODES_LEGEND
from elasticfw.report.modes import ModeCell, share_columns, table_headers, table_values
from elasticfw.report.plots import caption
from elasticfw.report.routing import RoutingSummary
from elasticfw.report.tables import LEGEND, block_title, blocks, row_values, table_columns

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1300px; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.6em 0 1.4em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.55em; }
th { background: #f2f2f2; }
td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
td.avg, th.avg { background: #f7f7fb; }
.note { color: #555; font-size: 0.9em; }
figure { margin: 1em 0 2em; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #444; font-size: 0.9em; margin-top: 0.3em; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 0.85em; }
"""


def _e(value: Any) -> str:
    """Escaped text of a value (JSON for anything that is not a string)."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return html.escape(text)


def _table(headers: Sequence[str] | None, rows: Sequence[Sequence[Any]]) -> str:
    head = (
        ""
        if headers is None
        else "<thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in headers) + "</tr></thead>"
    )
    body = "".join("<tr>" + "".join(f"<td>{_e(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table>{head}<tbody>{body}</tbody></table>"


def _status(run: Run) -> str:
    present = {(r["variant"], r["task"], r["length"]) for r in run.rows}
    # expected: every variant on every (task, length) that some variant has rows for
    expected = len(run.variants) * len({(r["task"], r["length"]) for r in run.rows})
    idle = [v for v in run.variants if not any(r["variant"] == v for r in run.rows)]
    parts = [
        f"{len(run.rows)} samples in {len(present)} of {expected} (variant, task, length) cells "
        f"(every variant × every task and length with rows); {len(run.failures)} failure(s)."
    ]
    if idle:
        parts.append(f"Variants without rows yet: {', '.join(idle)}.")
    if run.torn:
        parts.append(
            f"The incomplete last line of {', '.join(run.torn)} was skipped (a run still writing or cut short)."
        )
    if run.duplicates:
        parts.append(
            f"{run.duplicates} sample(s) appeared more than once; the last occurrence of each was kept."
        )
    return "".join(f'<p class="note">{_e(p)}</p>' for p in parts)


def _provenance(run: Run) -> str:
    meta = run.meta
    out = ["<h2>Provenance</h2>"]
    facts = [
        ("run folder", str(run.path)),
        ("started", meta.get("started", "?")),
        ("context lengths", ", ".join(length_label(x) for x in run.lengths) or "?"),
        ("seeds", ", ".join(str(s) for s in meta.get("seeds", [])) or "?"),
        ("reference", meta.get("reference") or "none (no speed-ups)"),
    ]
    out.append(_table(None, facts))
    attempts = [a for a in meta.get("attempts", []) if isinstance(a, dict)]
    if not attempts and isinstance(meta.get("environment"), dict):
        attempts = [{"environment": meta["environment"]}]
    for i, attempt in enumerate(attempts):
        env = attempt.get("environment")
        facts_i = [(k, v) for k, v in attempt.items() if k != "environment"]
        if isinstance(env, dict):
            facts_i += list(env.items())
        if facts_i:
            title = "Environment" if len(attempts) == 1 else f"Environment of attempt {i} (rows carry `attempt`)"
            out += [f"<h3>{_e(title)}</h3>", _table(["key", "value"], facts_i)]
    variant_fields = ["label", "adapter", "router", "retrieval_mode", "sparse_mode", "executor"]
    entries = meta.get("variants", [])
    if any(v.get("modes") for v in entries):  # some variant routes among K >= 3 modes: name every list whole
        variant_fields = ["label", "adapter", "router", "modes", "executor"]
        entries = [v if v.get("modes") or v.get("retrieval_mode") is None or v.get("sparse_mode") is None
                   else {**v, "modes": f"{v['retrieval_mode']}-{v['sparse_mode']}"} for v in entries]
    variants = [[v.get(f) if v.get(f) is not None else "—" for f in variant_fields] for v in entries]
    if variants:
        out += ["<h3>Variants</h3>", _table(variant_fields, variants)]
    tasks = [[t.label, t.task, t.category, t.metric] for t in run.tasks]
    out += ["<h3>Tasks</h3>", _table(["label", "task", "category", "metric"], tasks)]
    if meta.get("recipe") is not None:
        recipe = json.dumps(meta["recipe"], indent=2, default=str)
        out.append(f"<details><summary>Recipe</summary><pre>{html.escape(recipe)}</pre></details>")
    return "\n".join(out)


def _results(rows: Sequence[TableRow], tasks: Sequence[TaskInfo]) -> str:
    columns = table_columns(tasks)
    groups: list[tuple[str, int]] = []
    for c in columns:
        if groups and groups[-1][0] == c.group:
            groups[-1] = (c.group, groups[-1][1] + 1)
        else:
            groups.append((c.group, 1))
    top = '<th rowspan="2">variant</th>'
    top += "".join(f'<th colspan="{n}">{_e(g)}</th>' if g != "overall" else "" for g, n in groups)
    top += '<th rowspan="2" class="avg">avg all</th>'
    top += "".join(f'<th rowspan="2">{h}</th>' for h in ("MSR", "speed-up", "n"))
    second = "".join(
        f'<th class="{"avg" if c.kind == "average" else ""}">{_e(c.header)}</th>'
        for c in columns
        if c.group != "overall"
    )
    out = ["<h2>Results</h2>", f'<p class="note">{_e(LEGEND)}</p>']
    for block, members in blocks(rows).items():
        body = []
        for row in members:
            values = row_values(row, columns)
            classes = [
                "",
                *("num avg" if c.kind == "average" else "num" for c in columns),
                "num",
                "num",
                "num",
            ]
            body.append(
                "<tr>" + "".join(f'<td class="{k}">{_e(v)}</td>' for k, v in zip(classes, values)) + "</tr>"
            )
        out.append(f"<h3>{_e(block_title(block))}</h3>")
        out.append(
            f"<table><thead><tr>{top}</tr><tr>{second}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        )
    return "\n".join(out)


def _failures(run: Run) -> str:
    if not run.failures:
        return ""
    out = [f"<h2>Failures ({len(run.failures)})</h2>"]
    for f in run.failures:
        where = ", ".join(
            f"{k} {f[k]}" if k != "variant" else str(f[k])
            for k in ("variant", "task", "length", "seed")
            if f.get(k) is not None
        )
        out.append(f"<p><b>{_e(where)}</b>: {_e(f['error'])}</p>")
        if f.get("traceback"):
            out.append(f"<details><summary>traceback</summary><pre>{_e(str(f['traceback']))}</pre></details>")
    return "\n".join(out)


def _figures(figures: Sequence[Path], notes: Sequence[str]) -> str:
    out = ["<h2>Figures</h2>"]
    out += [f'<p class="note">{_e(n)}</p>' for n in notes]
    for path in figures:
        if path.suffix != ".png":
            continue
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        text = f"{caption(path.stem)} (vector version: figures/{path.stem}.svg)"
        out.append(
            f'<figure><img alt="{_e(path.stem)}" src="data:image/png;base64,{data}">'
            f"<figcaption><b>{_e(path.stem)}</b>: {_e(text)}</figcaption></figure>"
        )
    return "\n".join(out)


def _routing(summaries: Sequence[RoutingSummary]) -> str:
    if not summaries:
        return ""
    headers = ["variant", "heads", "retrieval heads, sensitive", "retrieval heads, robust", "adaptive samples",
               "task-dependent heads (layer/head: sensitive vs robust)"]
    body = [
        [s.variant, s.heads, *(f"{s.retrieval_heads[c]:.1f}" if c in s.retrieval_heads else "—"
                               for c in ("sensitive", "robust")),
         f"{s.adaptive_samples:.2f}",
         ", ".join(f"L{layer}/H{head}: {a:.2f} vs {b:.2f}" for layer, head, a, b in s.task_dependent_heads) or "none"]
        for s in summaries
    ]
    return ("<h2>Routing: how input-adaptive is each method?</h2>"
            "<p class=\"note\">Retrieval heads: mean KV heads per sample in the retrieval mode. Adaptive samples: "
            "fraction of samples whose assignment differs anywhere from the method's majority assignment (0 for a "
            "static assignment). Task-dependent heads: retrieval frequency differs by more than 0.1 between task "
            "categories.</p>" + _table(headers, body))


def _modes(cells: Sequence[ModeCell]) -> str:
    if not cells:
        return ""
    columns = share_columns(cells)
    return ("<h2>Mode shares and expected cost (variants with K >= 3 modes)</h2>"
            f'<p class="note">{_e(MODES_LEGEND)}</p>'
            + _table(table_headers(columns), [table_values(c, columns) for c in cells]))


def render_html(
    run: Run,
    rows: Sequence[TableRow],
    *,
    figures: Sequence[Path],
    notes: Sequence[str] = (),
    title: str | None = None,
    routing: Sequence[RoutingSummary] = (),
    modes: Sequence[ModeCell] = (),
) -> str:
    """The whole page. ``figures`` are the written figure files (PNGs are inlined, SVGs ignored);
    ``notes`` are shown above them (e.g. why a figure was skipped); ``modes``: the mode shares and
    expected costs of the variants with K >= 3 modes (none: no such section)."""
    title = title or f"Sweep report: {run.path.name}"
    tasks = run.tasks
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        _status(run),
        _provenance(run),
        _results(rows, tasks),
        _modes(modes),
        _routing(routing),
        _failures(run),
        _figures(figures, notes),
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p) + "\n"
