"""What a training run writes as it goes: JSONL metrics, TensorBoard scalars, a plot.

``metrics.jsonl`` has one JSON object per step (LM loss, sparsity loss, MSR / gap / λ1 / λ2 per
task, τ, learning rate, tokens/s, and the routing diagnostics of
:mod:`elasticfw.training.diagnostics`; with K >= 3 modes or ``train.constraint: cost`` also the
expected cost, its standard deviation over the step's samples and the share of heads per mode, per
task: ``cost``, ``cost_std``, ``mode_share``; ``gap`` is then the constrained quantity's); TensorBoard gets its numbers as scalars and its lists
(P(sparse) per task and head) as histograms. On resume, the lines after the checkpoint's step are dropped
(they will be recomputed) and TensorBoard is opened with ``purge_step`` for the same reason.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from elasticfw.errors import CheckpointError
from elasticfw.jsonl import read_jsonl, rewrite_jsonl

METRICS = "metrics.jsonl"


class MetricsLog:
    def __init__(self, run_dir: Path, *, resume_step: int | None, tensorboard: bool = True) -> None:
        self.path = run_dir / METRICS
        if resume_step is not None and self.path.exists():
            rewrite_jsonl(self.path, [row for row in read_metrics(run_dir) if row["step"] <= resume_step])
        elif self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = resume_step + 1 if resume_step is not None else None
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(row["step"])
            for key, value in _flatten(row).items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
                elif isinstance(value, list):  # e.g. P(sparse) per (layer, KV head) of a task: a histogram
                    numbers = _numbers(value)
                    if numbers:
                        self._tb.add_histogram(key, np.asarray(numbers, dtype=np.float64), step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _flatten(row: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "/"))
        else:
            out[name] = value
    return out


def _numbers(value: Any) -> list[float]:
    """The finite numbers of a nested list, flattened."""
    if isinstance(value, list):
        return [x for item in value for x in _numbers(item)]
    return [float(value)] if isinstance(value, (int, float)) and math.isfinite(value) else []


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The logged steps; a torn last line (a write cut short by a crash) is dropped."""
    return [row for _, row in read_jsonl(run_dir / METRICS, error=CheckpointError)[0]]


def plot_msr(
    rows: list[dict[str, Any]], out: Path, targets: dict[str, tuple[float, float]], *, key: str = "msr"
) -> Path:
    """MSR per task over steps (with each task's target band) and λ1 per task, as a PNG; ``key="cost"``:
    the expected cost per task instead (``train.constraint: cost``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    for i, label in enumerate(targets):
        color = f"C{i % 10}"
        pts = [(r["step"], r[key][label]) for r in rows if r.get(key, {}).get(label) is not None]
        if pts:
            ax.plot(*zip(*pts), label=label, color=color)
        lo, hi = targets[label]
        ax.axhspan(lo - 0.002, hi + 0.002, color=color, alpha=0.12)
        bx.plot(steps, [r["lambda1"][label] for r in rows], label=f"{label} λ1", color=color)
        bx.plot(steps, [r["lambda2"][label] for r in rows], color=color, linestyle="--")
    if key == "cost":
        top = max([hi for _, hi in targets.values()] + [v for r in rows for v in r.get(key, {}).values() if v is not None])
        ax.set(xlabel="step", ylabel="expected cost (batch mean)", title="Expected cost per task (full attention = 1)",
               ylim=(-0.02, max(1.02, top + 0.02)))
    else:
        ax.set(xlabel="step", ylabel="MSR (batch mean)", title="Model sparsity ratio per task", ylim=(-0.02, 1.02))
    ax.legend(fontsize=8)
    bx.set(xlabel="step", ylabel="multiplier", title="Lagrange multipliers (λ1 solid, λ2 dashed)")
    bx.legend(fontsize=8)
    fig.tight_layout()
    tmp = out.with_name(f".{out.stem}.tmp-{os.getpid()}{out.suffix}")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)
    return out
