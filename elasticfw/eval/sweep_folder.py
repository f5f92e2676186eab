"""A sweep's run folder: checked before any work, described by ``sweep.json``.

``sweep.json`` holds the resolved recipe, the *definition* rows depend on (model, generation
settings, router seed, what every variant and task runs), the variants, tasks, lengths and seeds,
the reference of the speed-ups, and one entry per attempt (start time, processes, provenance).
A resumed sweep must agree with the definition of every variant and task it already has rows
for; it may add new ones.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from elasticfw.atomic import atomic_write_text
from elasticfw.errors import ElasticError
from elasticfw.eval.rows import repair_rows
from elasticfw.eval.sweep_plan import Plan
from elasticfw.training.cost import mode_labels
from elasticfw.training.distributed import DistContext

META, ROWS, FAILURES = "sweep.json", "rows.jsonl", "failures.jsonl"
#: what a sweep writes into its folder (and --overwrite removes); anything else there is not ours
OWNED = (META, ROWS, FAILURES, "table.md", "table.csv", "cells.csv", "modes.csv", "report.html", "figures")


class SweepError(ElasticError):
    """A sweep that cannot start, or one whose variants or cells failed."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def definition(recipe: Any, plan: Plan) -> dict[str, Any]:
    """What rows depend on: a resumed sweep must agree with the rows it continues."""
    return {
        "model": recipe.model.model_dump(mode="json", exclude={"device"}),
        "generation": {"batch_size": plan.batch_size, "max_new_tokens": plan.max_new_tokens,
                       "padding_side": plan.padding_side},
        "router_seed": recipe.seed,
        "variants": {v.label: v.spec for v in plan.variants},
        "tasks": {t.label: {"task": t.config.model_dump(mode="json"), "category": t.category} for t in plan.tasks},
    }


def conflicts(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What a resumed recipe changed that the rows already written depend on."""
    names = {"model": "model", "generation": "generation settings (batch_size, max_new_tokens, padding_side)",
             "router_seed": "seed"}
    out = [names[key] for key in names if old.get(key) != new[key]]
    for group in ("variants", "tasks"):
        for label, spec in new[group].items():
            if label in old.get(group, {}) and old[group][label] != spec:
                out.append(f"{group[:-1]} {label!r}")
    return out


def leftover(name: str) -> bool:
    """A temporary file of an atomic write that a kill interrupted (``.NAME.tmp-PID``)."""
    return name.startswith(".") and ".tmp-" in name and name[1:].split(".tmp-")[0] in OWNED


def _check(path: Path, recipe: Any, plan: Plan, *, resume: bool, overwrite: bool) -> dict[str, Any]:
    """The checks, then the folder's new ``sweep.json`` content (nothing is written here)."""
    if resume and overwrite:
        raise SweepError("--resume and --overwrite exclude one another")
    if path.exists() and not path.is_dir():
        raise SweepError(f"sweep.output_dir {str(path)!r} exists and is not a folder")
    present = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    foreign = [name for name in present if name not in OWNED and not leftover(name)]
    if foreign:
        raise SweepError(f"sweep.output_dir {str(path)!r} holds files a sweep did not write ({', '.join(foreign[:5])}); "
                         "choose an empty or new folder")
    is_sweep = (path / META).is_file()
    if any(not leftover(n) for n in present) and not is_sweep:
        raise SweepError(f"sweep.output_dir {str(path)!r} holds sweep outputs but no {META}; choose another folder")
    if resume and not is_sweep:
        raise SweepError(f"--resume: {str(path)!r} holds no sweep to resume")
    if is_sweep and not resume and not overwrite:
        raise SweepError(f"sweep.output_dir {str(path)!r} already holds a sweep; pass --resume to continue it, "
                         "--overwrite to replace it, or choose another output_dir")
    new = definition(recipe, plan)
    old: dict[str, Any] = json.loads((path / META).read_text(encoding="utf-8")) if resume else {}
    if resume:
        bad = conflicts(old.get("definition", {}), new)
        if bad:
            raise SweepError(f"--resume: the recipe changed the {', '.join(bad)} since {str(path)!r} was started; "
                             "rows computed under the old settings would be mixed with new ones. Use another "
                             "output_dir, or --overwrite")
        for group in ("variants", "tasks"):  # a resumed sweep may add variants and tasks; it keeps the old
            new[group] = {**new[group], **{k: v for k, v in old["definition"][group].items() if k not in new[group]}}
    reference = plan.reference if plan.reference_explicit or not old.get("reference") else old["reference"]
    return {
        "recipe": recipe.model_dump(mode="json"),
        "definition": new,
        "variants": _merge(_variant_rows(plan), old.get("variants", [])),
        "tasks": old.get("tasks", []),
        "lengths": list(dict.fromkeys([*plan.lengths, *old.get("lengths", [])])),
        "seeds": list(dict.fromkeys([*plan.seeds, *old.get("seeds", [])])),
        "reference": reference,
        "started": old.get("started") or _now(),
        "attempts": old.get("attempts", []),
    }


def prepare_run_dir(path: Path, recipe: Any, plan: Plan, *, resume: bool, overwrite: bool, dist: DistContext) -> int:
    """Check the run folder before any work (rank 0; every process raises its error): refuse a
    folder holding other files, a sweep unless --resume/--overwrite, and a resume whose recipe
    disagrees with the rows already there. Returns the attempt number (0 for a new sweep)."""
    error, attempt = None, 0
    if dist.is_main:
        try:
            meta = _check(path, recipe, plan, resume=resume, overwrite=overwrite)
        except ElasticError as exc:
            error = str(exc)
        else:
            present = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
            for name in present:
                target = path / name
                if leftover(name):
                    target.unlink(missing_ok=True)
                elif overwrite:
                    shutil.rmtree(target) if target.is_dir() else target.unlink()
            path.mkdir(parents=True, exist_ok=True)
            repair_rows(path / ROWS)
            (path / FAILURES).unlink(missing_ok=True)  # failures describe the latest attempt only
            attempt = len(meta["attempts"])
            meta["attempts"].append({"started": _now(), "processes": dist.world})
            atomic_write_text(path / META, json.dumps(meta, indent=2))
    error, attempt = dist.all_gather_object((error, attempt))[0]
    if error is not None:
        raise SweepError(error)
    return int(attempt)


def _variant_rows(plan: Plan) -> list[dict[str, Any]]:
    rows = []
    for v in plan.variants:
        elastic = v.spec["elastic"]
        modes = elastic.get("modes") or [elastic["retrieval_mode"], elastic["sparse_mode"]]  # K >= 3: the list
        row = {"label": v.label, "adapter": v.adapter, "router": elastic["router"]["name"],
               "retrieval_mode": modes[0]["name"], "sparse_mode": modes[-1]["name"],
               "executor": elastic["executor"]["name"]}
        if len(modes) > 2:  # the whole list, and the labels of the rows' per-mode shares
            row["modes"] = "-".join(m["name"] for m in modes)
            row["mode_labels"] = mode_labels([m["name"] for m in modes])
        rows.append(row)
    return rows


def _merge(new: list[dict[str, Any]], old: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recipe's entries in its order, then those of earlier attempts it no longer names."""
    labels = {v["label"] for v in new}
    return [*new, *(v for v in old if v["label"] not in labels)]


def update_meta(path: Path, **fields: Any) -> None:
    """Set top-level fields of ``sweep.json``; ``attempt=...`` updates the latest attempt's entry."""
    meta = json.loads((path / META).read_text(encoding="utf-8"))
    if "attempt" in fields:
        meta["attempts"][-1].update(fields.pop("attempt"))
    if "tasks" in fields:
        fields["tasks"] = _merge(fields["tasks"], meta.get("tasks", []))
    meta.update(fields)
    atomic_write_text(path / META, json.dumps(meta, indent=2))
