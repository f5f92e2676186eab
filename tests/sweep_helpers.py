"""A tiny comparison sweep (tiny random Llama, the synthetic recall/repeat tasks) shared by the
sweep tests and the two-process worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training_helpers import TINY_ELASTIC


def tiny_sweep_recipe(out: Path | str, **sweep: Any) -> dict[str, Any]:
    """Three variants (full, all streaming, a random MLP router) x recall/repeat x two lengths."""
    settings: dict[str, Any] = {
        "tasks": [
            {"task": {"name": "recall", "num_samples": 3}},
            {"task": {"name": "repeat", "num_samples": 3}, "label": "rep"},
        ],
        "lengths": [40, 72],
        "batch_size": 2,
        "warmup": False,
        "output_dir": str(out),
    }
    settings.update(sweep)
    return {
        "model": {"name": "tiny-llama", "device": "cpu"},
        "elastic": TINY_ELASTIC,
        "compare": [
            {"label": "full", "elastic": {"router": {"name": "fixed", "assign": "all_retrieval"}}},
            {"label": "stream", "elastic": {"router": {"name": "fixed", "assign": "all_sparse"}}},
            {"label": "mlp", "elastic": {}},
        ],
        "sweep": settings,
    }
