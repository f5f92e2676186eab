"""Resumable training checkpoints: safetensors + JSON, written atomically.

    <run>/checkpoints/step-000050/
        elastic_adapter.safetensors, elastic_config.json   the router, as a loadable adapter
        trainer_state.safetensors                         Lagrange multipliers, optimiser moments
        trainer_state.json                                step, schedules, optimiser hyper-parameters
    <run>/checkpoints/latest                              name of the newest complete checkpoint

A checkpoint is written into a temporary folder and renamed into place, then ``latest`` is
replaced atomically: a crash at any moment leaves the previous checkpoint intact and ``latest``
pointing at a complete one. Nothing is unpickled on load.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from elasticfw.atomic import atomic_write_text
from elasticfw.errors import CheckpointError
from elasticfw.model.checkpoint import save_adapter

STATE_WEIGHTS = "trainer_state.safetensors"
STATE_JSON = "trainer_state.json"
LATEST = "latest"


def optimizer_tensors(optimizer: torch.optim.Optimizer, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimiser's state dict into tensors (for safetensors) and JSON-able metadata."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}.{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def load_optimizer(optimizer: torch.optim.Optimizer, prefix: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith(prefix + "."):
            idx, key = name[len(prefix) + 1 :].split(".", 1)
            state.setdefault(int(idx), {})[key] = value
    for idx, scalars in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(scalars)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(
    run_dir: Path,
    step: int,
    elastic: Any,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    *,
    keep: int,
) -> Path:
    """Write checkpoint ``step`` atomically, point ``latest`` at it, prune old ones."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_adapter(elastic, tmp)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / STATE_WEIGHTS))
    atomic_write_text(tmp / STATE_JSON, json.dumps({"step": step, **meta}, indent=2))
    if final.exists():  # re-written after a resume: replace the older copy
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(root / LATEST, final.name + "\n")
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
    for old in done[:-keep]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    if not (path / STATE_JSON).is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which is not a complete checkpoint")
    return path


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    try:
        meta = json.loads((path / STATE_JSON).read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path / STATE_JSON}: not valid JSON ({exc.msg})") from None
    weights = path / STATE_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"checkpoint {path}: {STATE_WEIGHTS} is missing")
    return load_tensors(weights), meta


def load_tensors(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or a :class:`CheckpointError` naming it (truncated, not
    safetensors, unreadable)."""
    from safetensors import SafetensorError

    try:
        return load_file(str(path), device=device)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({str(exc).splitlines()[0][:200]}); "
                              "the checkpoint is damaged: resume from an earlier one or start again") from None
