"""``elasticfw eval``: the recipe's own elastic section (or a trained adapter) on its tasks.

It is a sweep of one variant (:mod:`elasticfw.eval.sweep`): over ``eval.task`` with the ``eval``
settings, or over the recipe's ``sweep.tasks``/lengths/seeds when it has a ``sweep:`` section.
Rows stream to ``RUN/rows.jsonl`` as batches finish, ``--resume`` continues, and the report
(table, figures, HTML) is built at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elasticfw.errors import RecipeError
from elasticfw.eval.sweep import run_sweep
from elasticfw.registry import Registry


def run_evaluation(
    recipe: Any,
    *,
    output: str | None = None,
    adapter: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    report: bool = True,
    registry: Registry | None = None,
    progress: bool = True,
) -> Path:
    """Evaluate the recipe's ``elastic`` section, or the adapter at ``adapter`` (which carries its
    own), into the run folder ``output`` (default ``<output_dir or runs>/eval``); returns it."""
    if adapter is not None and not (Path(adapter).expanduser() / "elastic_config.json").is_file():
        raise RecipeError(f"--adapter {adapter!r} is not an adapter folder (no elastic_config.json in it)")
    label = "adapter" if adapter else "elastic"
    folder = output or str(Path(recipe.output_dir or "runs") / "eval")
    return run_sweep(recipe, output=folder, resume=resume, overwrite=overwrite, report=report, registry=registry,
                     progress=progress, variants=[(label, recipe.elastic, adapter)])
