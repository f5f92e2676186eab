"""Figures of a sweep, each written as PNG and SVG under ``RUN/figures/``.

* ``score_vs_length``: one panel per task, mean score (with its 95% CI as error bars) against the
  context length, one line per variant (points only when there is a single length).
* ``msr_per_task``: grouped bars, the mean model sparsity ratio of each variant on each task
  (every length pooled).
* ``pareto``: each variant's mean prefill speed-up against the reference (x, mean of its cells'
  speed-ups) and mean score (y, mean of its cells' scores), with the Pareto front (both maximised).
  Skipped when there are no speed-ups (:func:`pareto_skip_reason` says why).
* ``heads_<variant>``: for a variant whose rows carry routing decisions, the fraction of samples
  that route each (layer, KV head) to the retrieval mode (full attention in FA-* variants), one panel
  per task, sensitive tasks first (paper Fig. 6).
* ``mode_shares``: for the variants that route among K >= 3 modes, the mean share of heads in each
  mode per task (every length pooled), one stacked bar per (variant, task), labelled with its mean
  expected cost.

Figures are drawn on :class:`matplotlib.figure.Figure` objects directly, not through pyplot, so no
display backend is needed and the caller's pyplot state and backend are left alone.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from elasticfw.report.aggregate import Cell, Run, cells, length_label
from elasticfw.report.errors import ReportError
from elasticfw.report.modes import ModeCell, mode_cells, share_columns
from elasticfw.report.runfile import CATEGORIES

CAPTIONS = {
    "score_vs_length": "Mean score of each task against the context length, one line per variant; error bars "
    "are 95% confidence intervals (Wilson for accuracies, Student-t for continuous scores).",
    "msr_per_task": "Mean model sparsity ratio (fraction of KV heads routed to the sparse mode) of each "
    "variant on each task, every length pooled; 0 = every head in the retrieval mode (e.g. full attention).",
    "pareto": "Each variant's mean prefill speed-up against the reference (x) and mean score over its cells "
    "(y); ringed points form the Pareto front (no other variant is both faster and better), drawn as a step line.",
    "mode_shares": "Variants with K >= 3 modes: mean share of routed (layer, KV head) in each mode per task, every "
    "length pooled, one stacked bar per variant and task; the number after each bar is its mean expected cost "
    "(full attention = 1).",
    "heads": "Fraction of samples that route each KV head (x) of each routed layer (y) to the retrieval mode "
    "(full attention in FA-* variants, e.g. XAttention in XA-SSA), per task category; bright = mostly retrieval "
    "mode, dark = mostly the sparse mode.",
}


def caption(stem: str) -> str:
    """The one-line reading guide of a figure, from its file stem."""
    return CAPTIONS["heads" if stem.startswith("heads_") else stem]


def safe_name(label: str) -> str:
    """A file-name-safe form of a variant label (letters, digits, ``.``, ``_``, ``-``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._") or "variant"


def _text(label: str) -> str:
    """A label as matplotlib should print it: ``$`` is not mathtext, a leading ``_`` is not hidden."""
    label = label.replace("$", r"\$")
    return " " + label if label.startswith("_") else label


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (at least as large in both coordinates and
    larger in one), sorted by x."""
    front = [
        i
        for i, (x, y) in enumerate(points)
        if not any(ox >= x and oy >= y and (ox > x or oy > y) for ox, oy in points)
    ]
    return sorted(front, key=lambda i: points[i])


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def variant_points(per_length: Sequence[Cell]) -> dict[str, tuple[float, float]]:
    """``variant -> (geometric-mean speed-up, mean score)`` over its cells, for variants with a speed-up."""
    out: dict[str, tuple[float, float]] = {}
    for variant in dict.fromkeys(c.variant for c in per_length):
        own = [c for c in per_length if c.variant == variant]
        speedups = [c.speedup for c in own if c.speedup is not None and c.speedup > 0]
        if speedups:
            out[variant] = (math.exp(_mean([math.log(s) for s in speedups])), _mean([c.score for c in own]))
    return out


def pareto_skip_reason(reference: str | None, per_length: Sequence[Cell]) -> str | None:
    """Why the Pareto figure cannot be drawn (``None`` when it can)."""
    if reference is None:
        return "The sweep names no reference variant, so there are no speed-ups and no Pareto plot."
    if not any(c.variant == reference for c in per_length):
        return f"The reference variant {reference!r} has no rows yet, so there are no speed-ups and no Pareto plot."
    if not variant_points(per_length):
        return "No variant shares samples with the reference yet, so there is no Pareto plot."
    return None


def _save(fig: Figure, out_dir: Path, stem: str) -> list[Path]:
    written = []
    for fmt in ("png", "svg"):
        path = out_dir / f"{stem}.{fmt}"
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        fig.savefig(tmp, format=fmt, dpi=110, metadata={"Date": None} if fmt == "svg" else None)
        os.replace(tmp, path)
        written.append(path)
    return written


def _grid(n: int, width: float, height: float) -> tuple[Figure, list[Any]]:
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = list(np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel())
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _score_vs_length(run: Run, per_length: Sequence[Cell], colors: dict[str, str]) -> Figure:
    tasks = [t for t in run.tasks if any(c.task == t.label for c in per_length)]
    lengths = [x for x in run.lengths if any(c.length == x for c in per_length)]
    variants = [v for v in run.variants if any(c.variant == v for c in per_length)]
    fig, axes = _grid(len(tasks), 4.2, 3.3)
    spread = 0.5 / max(1, len(variants))
    for ax, task in zip(axes, tasks):
        for i, variant in enumerate(variants):
            pts = [
                (lengths.index(c.length), c)
                for c in per_length
                if c.variant == variant and c.task == task.label and c.length in lengths
            ]
            if not pts:
                continue
            xs = [x + (i - (len(variants) - 1) / 2) * spread for x, _ in pts]
            ys = [c.score for _, c in pts]
            err = [[c.score - c.lo for _, c in pts], [c.hi - c.score for _, c in pts]]
            ax.errorbar(
                xs,
                ys,
                yerr=err,
                fmt="-o" if len(lengths) > 1 else "o",
                color=colors[variant],
                label=_text(variant),
                capsize=3,
                markersize=4,
            )
        ax.set_xticks(range(len(lengths)), [length_label(x) for x in lengths])
        ax.set_xlim(-0.6, len(lengths) - 0.4)
        ax.set_ylim(-0.05, 1.05)
        ax.set(title=_text(f"{task.label} ({task.category}, {task.metric or '?'})"), xlabel="context length")
        ax.set_ylabel("mean score")
    handles = [h for ax in axes for h in ax.get_legend_handles_labels()[0]]
    labels = [lab for ax in axes for lab in ax.get_legend_handles_labels()[1]]
    unique = dict(zip(labels, handles))
    fig.legend(
        unique.values(), unique.keys(), loc="outside lower center", ncol=min(4, len(unique)), fontsize=8
    )
    return fig


def _msr_per_task(run: Run, pooled: Sequence[Cell], colors: dict[str, str]) -> Figure:
    tasks = [t.label for t in run.tasks if any(c.task == t.label for c in pooled)]
    variants = [v for v in run.variants if any(c.variant == v for c in pooled)]
    fig = Figure(
        figsize=(max(5.0, 1.1 * len(tasks) * max(1, len(variants)) ** 0.5 + 2), 3.8), layout="constrained"
    )
    ax = fig.subplots()
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        by_task = {c.task: c.msr for c in pooled if c.variant == variant}
        bars = [
            (j + (i - (len(variants) - 1) / 2) * width, by_task[t])
            for j, t in enumerate(tasks)
            if by_task.get(t) is not None
        ]
        xs, ys = [x for x, _ in bars], [float(y) for _, y in bars if y is not None]
        ax.bar(xs, ys, width=width, color=colors[variant], label=_text(variant))
    ax.set_xticks(range(len(tasks)), [_text(t) for t in tasks], rotation=20, ha="right")
    ax.set(ylabel="mean MSR", ylim=(0, 1.02), title="Model sparsity ratio per task")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the bars reach 1
    return fig


def _pareto(points: dict[str, tuple[float, float]], reference: str, colors: dict[str, str]) -> Figure:
    fig = Figure(figsize=(5.6, 4.2), layout="constrained")
    ax = fig.subplots()
    labels = list(points)
    coords = [points[v] for v in labels]
    xs, ys = [x for x, _ in coords], [y for _, y in coords]
    dx, dy = 0.15 * ((max(xs) - min(xs)) or 1.0), 0.04 * ((max(ys) - min(ys)) or 1.0)
    placed: list[tuple[float, float]] = []
    for v, (x, y) in points.items():
        ax.scatter([x], [y], color=colors[v], zorder=3)
        # labels of points close to earlier ones step down a line each, so they do not overprint
        crowd = sum(abs(x - px) < dx and abs(y - py) < dy for px, py in placed)
        placed.append((x, y))
        ax.annotate(_text(v), (x, y), textcoords="offset points", xytext=(5, 4 - 10 * crowd), fontsize=8)
    front = pareto_front(coords)
    ax.step(
        [coords[i][0] for i in front], [coords[i][1] for i in front], where="pre", color="0.3", linestyle="--"
    )
    ax.scatter(
        [coords[i][0] for i in front],
        [coords[i][1] for i in front],
        s=160,
        facecolors="none",
        edgecolors="0.2",
        zorder=4,
        label="Pareto front",
    )
    ax.axvline(1.0, color="0.7", linewidth=0.8)
    ax.margins(0.15)
    ax.set(
        xlabel=_text(f"mean prefill speed-up vs {reference}"),
        ylabel="mean score over cells",
        title="Speed-up vs score",
    )
    ax.legend(fontsize=8)
    return fig


def heads_figure(rows: list[dict[str, Any]], variant: str) -> Figure:
    """Per task (sensitive tasks first), the fraction of samples routing each (layer, KV head) to
    the retrieval mode."""
    shapes = {np.asarray(r["decisions"], dtype=float).shape for r in rows}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ReportError(
            f"variant {variant!r}: routing decisions must be layers × KV heads of one shape in every row, "
            f"got shapes {sorted(shapes)}"
        )
    layer_ids = next((r["routed_layers"] for r in rows if r.get("routed_layers")), None)
    groups: dict[str, list[np.ndarray]] = {}
    for category in CATEGORIES:
        for r in rows:
            if r["category"] == category:
                groups.setdefault(f"{r.get('task') or category} ({category})", []).append(np.asarray(r["decisions"], float))
    return head_panels(groups, layer_ids, _text(f"Head routing of {variant}"))


def head_panels(groups: dict[str, list[np.ndarray]], layer_ids: Sequence[int] | None, title: str) -> Figure:
    """One panel per group: the fraction of its samples (each a layers × KV heads 0/1 array, 1 =
    sparse) that route each (layer, KV head) to the retrieval mode (paper Fig. 6)."""
    n_layers, n_heads = next(iter(groups.values()))[0].shape
    if layer_ids is None or len(layer_ids) != n_layers:
        layer_ids = list(range(n_layers))
    fig = Figure(figsize=(1.5 + 2.6 * len(groups), 1.6 + 0.22 * n_layers), layout="constrained")
    axes = list(np.atleast_1d(fig.subplots(1, len(groups), squeeze=False)).ravel())
    for ax, (name, chosen) in zip(axes, groups.items()):
        full = 1.0 - np.mean(chosen, axis=0)
        ax.imshow(full, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", interpolation="nearest")
        ystep, xstep = max(1, math.ceil(n_layers / 16)), max(1, math.ceil(n_heads / 16))
        ax.set_yticks(range(0, n_layers, ystep), [str(x) for x in list(layer_ids)[::ystep]])
        ax.set_xticks(range(0, n_heads, xstep))
        ax.set(title=f"{name}\n{len(chosen)} samples, MSR {float(np.mean(chosen)):.3f}", xlabel="KV head", ylabel="layer")
        ax.title.set_fontsize(9)
    scale = ScalarMappable(Normalize(0.0, 1.0), cmap="viridis")
    fig.colorbar(scale, ax=axes, label="fraction routed to the retrieval mode")
    fig.suptitle(title)
    return fig


def _mode_shares(pooled: Sequence[ModeCell]) -> Figure:
    columns = share_columns(pooled)
    fig = Figure(figsize=(7.0, 1.0 + 0.32 * len(pooled)), layout="constrained")
    ax = fig.subplots()
    ys = list(range(len(pooled)))[::-1]
    left = [0.0] * len(pooled)
    for k, mode in enumerate(columns):
        widths = [c.shares.get(mode, 0.0) for c in pooled]
        ax.barh(ys, widths, left=left, color=f"C{k % 10}", label=_text(mode))
        left = [a + b for a, b in zip(left, widths)]
    for y, c in zip(ys, pooled):
        ax.text(1.01, y, f"{c.cost:.3f}", va="center", fontsize=8)
    ax.set_yticks(ys, [_text(f"{c.variant} · {c.task}") for c in pooled], fontsize=8)
    ax.set(xlabel="share of routed heads (number: mean expected cost)", xlim=(0, 1.1),
           title="Mode shares per task")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def write_figures(run: Run, out_dir: Path, *, confidence: float = 0.95) -> list[Path]:
    """Draw every figure of ``run`` into ``out_dir`` (created); the PNG and SVG paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    per_length = cells(run.rows, run.reference, confidence=confidence)
    pooled = cells(run.rows, run.reference, pool_lengths=True, confidence=confidence)
    colors = {v: f"C{i % 10}" for i, v in enumerate(run.variants)}
    written: list[Path] = []
    if not per_length:
        return written
    written += _save(_score_vs_length(run, per_length, colors), out_dir, "score_vs_length")
    written += _save(_msr_per_task(run, pooled, colors), out_dir, "msr_per_task")
    if run.reference is not None and pareto_skip_reason(run.reference, per_length) is None:
        written += _save(_pareto(variant_points(per_length), run.reference, colors), out_dir, "pareto")
    shares = mode_cells(run.rows, run.variants, run.meta.get("variants", []), pool_lengths=True)
    if shares:
        written += _save(_mode_shares(shares), out_dir, "mode_shares")
    used: set[str] = set()
    for variant in run.variants:
        routed = [r for r in run.rows if r["variant"] == variant and r.get("decisions")]
        if routed:
            stem = name = f"heads_{safe_name(variant)}"
            k = 2
            while stem in used:
                stem, k = f"{name}-{k}", k + 1
            used.add(stem)
            written += _save(heads_figure(routed, variant), out_dir, stem)
    return written
