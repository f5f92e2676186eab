"""The ``sweep:`` section of a recipe: what ``elasticfw compare`` runs besides the variants.

A sweep is the grid *variants × tasks × context lengths × seeds* (``compare:`` lists the
variants, ``sweep.tasks`` the tasks), or an explicit list of ``sweep.cells``. The task entries
hold plugin sections, so they are added with the registry in :mod:`elasticfw.recipe.schema`;
the plugin-free settings are here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

PaddingSide = Literal["left", "right"]


class SweepCell(BaseModel):
    """One cell of an explicit sweep: a variant on a task at a length with a seed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    variant: str = Field(..., min_length=1, description="A `compare[i].label`.")
    task: str = Field(..., min_length=1, description="A `sweep.tasks[i].label` (default label: the task's name).")
    length: int | None = Field(None, ge=1, le=10_000_000, description="Context length (the task's `context_tokens`); "
                               "default: the task's own.")
    seed: int | None = Field(None, description="Sample seed; default: the recipe's `seed`.")


def _unique(name: str, values: list[int] | None) -> list[int] | None:
    if values is not None and len(set(values)) != len(values):
        dupes = sorted({v for v in values if values.count(v) > 1})
        raise ValueError(f"{name} lists {dupes[0]} twice")
    return values


class SweepSettings(BaseModel):
    """How ``elasticfw compare`` sweeps: lengths, seeds, batching, timing, where rows go."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    lengths: list[int] | None = Field(
        None, min_length=1,
        description="Context lengths: each task's `context_tokens` is set to each (tasks must have that field). "
        "Default: each task's own.",
    )
    seeds: list[int] | None = Field(
        None, min_length=1,
        description="Sample seeds (each re-draws the task samples; routers are built with the recipe's `seed`). "
        "Default: [seed].",
    )
    cells: list[SweepCell] | None = Field(
        None, min_length=1, description="An explicit list of cells instead of the full grid."
    )
    reference: str | None = Field(
        None, description="The `compare` label speed-ups are measured against (default: the first variant)."
    )
    batch_size: int = Field(1, ge=1, le=4096, description="Samples per generate() call (1: clean per-sample timing).")
    max_new_tokens: int | None = Field(
        None, ge=1, le=4096, description="Greedy tokens per sample (default: each task's own)."
    )
    padding_side: PaddingSide = Field("left", description="Where a batch is padded.")
    warmup: bool = Field(
        True, description="Before each variant's first cell, one untimed generate (kernel compilation, caches)."
    )
    on_error: Literal["continue", "stop"] = Field(
        "continue",
        description="A variant or cell that raises: record it in failures.jsonl and go on with the others "
        "(the command still exits with an error at the end), or stop at once.",
    )
    output_dir: str = Field("runs/compare", min_length=1, description="The sweep's run folder.")

    @field_validator("lengths")
    @classmethod
    def _lengths(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(v < 1 for v in value):
            raise ValueError(f"every length must be a positive number of tokens, got {value}")
        return _unique("lengths", value)

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, value: list[int] | None) -> list[int] | None:
        return _unique("seeds", value)
