"""Adapters on disk, PEFT-style: only the trained parts (safetensors) plus a JSON config.

    <dir>/elastic_adapter.safetensors   router (and any other trained) tensors
    <dir>/elastic_config.json           elasticfw version, base model name, model_type, head
                                        layout, the recipe's elastic section, router extra state

This module is the format and its writing and reading (:func:`save_adapter`,
:func:`read_adapter_config`); :mod:`elasticfw.model.checkpoint` loads an adapter onto a model and
re-exports these. Saving is atomic: both files are written into a temporary sibling folder that is
then swapped in, so a crash leaves the previous adapter (or none), never half of one; an existing
non-empty folder is replaced only with ``overwrite=True``, and only if it holds nothing but an
adapter. Nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from elasticfw import __version__
from elasticfw.atomic import atomic_replace_dir, atomic_write_text
from elasticfw.errors import CheckpointError

WEIGHTS = "elastic_adapter.safetensors"
CONFIG = "elastic_config.json"
FORMAT_VERSION = 1

#: keys every adapter config must have, and their JSON types (``int`` excludes booleans)
_REQUIRED: dict[str, type] = {
    "format_version": int,
    "base_model": str,
    "model_type": str,
    "routed_layers": list,
    "num_q_heads": int,
    "num_kv_heads": int,
    "head_dim": int,
    "elastic": dict,
}
#: keys that may be absent (older adapters), typed when present
_OPTIONAL: dict[str, type] = {"elasticfw_version": str, "base_model_name_or_path": str, "router_state": dict}
_JSON_TYPE = {int: "an integer", str: "a string", list: "a list", dict: "an object"}


# -- saving -------------------------------------------------------------------------------------
def save_adapter(elastic: Any, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write ``elastic``'s router and elastic section as an adapter folder at ``path``.

    The folder is written complete under a temporary sibling name and swapped in. An existing
    non-empty folder is refused unless ``overwrite=True``; even then a folder holding anything
    besides an adapter's two files is refused (nothing that elasticfw did not write is deleted).
    Non-finite router tensors are refused (such an adapter could not be loaded).
    """
    out = Path(path).expanduser()
    state = {k: v.detach().cpu().contiguous() for k, v in elastic.router.state_dict().items()}
    bad = _non_finite(state)
    if bad:
        raise CheckpointError(f"refusing to save adapter {str(out)!r}: the router's tensors hold NaN or Inf: {bad}")
    heads = elastic.heads
    meta = {
        "format_version": FORMAT_VERSION,
        "elasticfw_version": __version__,
        "base_model": elastic.base_model_name,
        "base_model_name_or_path": getattr(elastic.base.config, "_name_or_path", "") or "",
        "model_type": elastic.base.config.model_type,
        "routed_layers": list(heads.routed_layers),
        "num_q_heads": heads.num_q_heads,
        "num_kv_heads": heads.num_kv_heads,
        "head_dim": heads.head_dim,
        "elastic": elastic.elastic_config.model_dump(mode="json"),
        "router_state": elastic.router.extra_state(),
    }
    try:
        text = json.dumps(meta, indent=2, allow_nan=False)
    except ValueError:
        raise CheckpointError(
            f"refusing to save adapter {str(out)!r}: the router's extra state holds NaN or Inf "
            f"({_non_finite_json(meta['router_state'], 'router_state')})"
        ) from None
    _check_target(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        try:
            tmp.mkdir()
            save_file(state, str(tmp / WEIGHTS))
            with (tmp / WEIGHTS).open("rb") as f:
                os.fsync(f.fileno())
            atomic_write_text(tmp / CONFIG, text)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # an interrupted save leaves nothing behind
            raise

    return atomic_replace_dir(out, write)


def _check_target(out: Path, overwrite: bool) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise CheckpointError(f"cannot save an adapter to {str(out)!r}: it exists and is not a folder")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if not overwrite:
        raise CheckpointError(
            f"cannot save an adapter to {str(out)!r}: the folder exists and is not empty ({_names(entries)}); "
            "pass overwrite=True to replace the adapter in it, or choose another folder"
        )
    foreign = [name for name in entries if name not in (WEIGHTS, CONFIG)]
    if foreign:
        raise CheckpointError(
            f"cannot save an adapter to {str(out)!r} even with overwrite=True: the folder holds files that are "
            f"not part of an adapter ({_names(foreign)}) and replacing it would delete them; choose another folder"
        )


# -- reading the config -------------------------------------------------------------------------
def read_adapter_config(path: str | Path) -> dict[str, Any]:
    """The adapter's JSON config, with its keys and types checked (:class:`CheckpointError` if not)."""
    folder = Path(path).expanduser()
    cfg = folder / CONFIG
    if not folder.is_dir():
        raise CheckpointError(f"{str(path)!r} is not an elasticfw adapter: no such folder")
    if not cfg.is_file():
        raise CheckpointError(f"{str(path)!r} is not an elasticfw adapter: {CONFIG} is missing")
    try:
        meta = json.loads(cfg.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{cfg}: not valid JSON (the file is not UTF-8 text)") from None
    except OSError as exc:
        raise CheckpointError(f"{cfg}: cannot be read ({exc.strerror or exc})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{cfg}: expected a JSON object, got {type(meta).__name__}")
    if "format_version" in meta and meta["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{cfg}: format_version {meta['format_version']!r}, this elasticfw reads {FORMAT_VERSION}"
        )
    missing = [key for key in _REQUIRED if key not in meta]
    wrong = [
        f"{key!r} must be {_JSON_TYPE[kind]}, got {_json_type(meta[key])} ({_short(meta[key])})"
        for key, kind in {**_REQUIRED, **_OPTIONAL}.items()
        if key in meta and not _is(meta[key], kind)
    ]
    if "routed_layers" in meta and _is(meta["routed_layers"], list):
        if not all(_is(v, int) for v in meta["routed_layers"]):
            wrong.append(f"'routed_layers' must be a list of integers, got {_short(meta['routed_layers'])}")
    if missing or wrong:
        parts = ([f"missing keys {missing}"] if missing else []) + wrong
        raise CheckpointError(f"{cfg}: not a valid adapter config: {'; '.join(parts)}")
    return meta


def _is(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- helpers -------------------------------------------------------------------------------------
def _non_finite(state: dict[str, torch.Tensor]) -> str:
    """'' if every floating tensor is finite, else a description naming the tensors that are not."""
    found = []
    for name in sorted(state):
        t = state[name]
        if t.is_floating_point() or t.is_complex():
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            if nan or inf:
                found.append(f"{name!r} ({nan} NaN, {inf} Inf of {t.numel()} values)")
    return _names(found, quote=False) if found else ""


def _non_finite_json(value: Any, where: str) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where} = {value}"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite_json(item, f"{where}[{key!r}]" if isinstance(key, str) else f"{where}[{key}]")
        if found:
            return found
    return ""


def _names(names: list[str], *, limit: int = 8, quote: bool = True) -> str:
    shown = [repr(n) if quote else n for n in names[:limit]]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(shown) + more
