"""Adapters on disk, PEFT-style: only the trained parts (safetensors) plus a JSON config.

    <dir>/elastic_adapter.safetensors   router (and any other trained) tensors
    <dir>/elastic_config.json           elasticfw version, base model name, model_type, head
                                        layout, the recipe's elastic section, router extra state

Saving is atomic: both files are written into a temporary sibling folder that is then swapped
in, so a crash leaves the previous adapter (or none), never half of one; an existing non-empty
folder is replaced only with ``overwrite=True``, and only if it holds nothing but an adapter.

Loading is transactional: every check (JSON keys and types, base model, architecture and head
layout, the weights file's integrity, tensor names, shapes and finiteness) either passes or
raises :class:`~elasticfw.errors.CheckpointError` naming the file and what is wrong, and a
failed load leaves the model exactly as it was (not wrapped, its attention implementation,
``requires_grad`` flags and train/eval modes restored). Nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from elasticfw.atomic import atomic_replace_dir, atomic_write_text
from elasticfw.errors import CheckpointError, ElasticError
from elasticfw.registry import Registry, get_registry

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
    from elasticfw import __version__

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


# -- loading ------------------------------------------------------------------------------------
def load_adapter(
    model: Any,
    path: str | Path,
    *,
    registry: Registry | None = None,
    base_model: str | None = None,
    strict_base_model: bool = True,
) -> Any:
    """Make ``model`` (a loaded Hugging Face causal LM) elastic with the adapter at ``path``.

    ``base_model``: the name the caller loaded ``model`` under (e.g. a recipe's ``model.name``);
    when given, an adapter recorded for another base model is refused unless
    ``strict_base_model=False``. Any failure raises :class:`CheckpointError` and leaves ``model``
    as it was.
    """
    from elasticfw.model.elastic import ElasticModel, resolve_adapter
    from elasticfw.recipe import format_validation_error
    from elasticfw.recipe.schema import recipe_model

    registry = registry or get_registry()
    folder = Path(path).expanduser()
    meta = read_adapter_config(folder)
    where = f"adapter {str(path)!r}"
    if base_model is not None and strict_base_model:
        _check_base_model(meta, model, base_model, where)
    model_type = model.config.model_type
    if model_type != meta["model_type"]:
        raise CheckpointError(
            f"{where} was trained on a {meta['model_type']!r} model ({meta['base_model']!r}); "
            f"the given model is {model_type!r}"
        )
    layers, hq, hkv, head_dim = resolve_adapter(model.config, registry).head_layout(model.config)
    have = {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": head_dim}
    for key, value in have.items():
        if meta[key] != value:
            raise CheckpointError(
                f"{where}: {key} is {meta[key]} but the given model has {value} "
                f"(adapter base model: {meta['base_model']!r})"
            )
    section_cls = recipe_model(registry).model_fields["elastic"].annotation
    # the recipe model always declares its elastic section's class
    assert isinstance(section_cls, type) and issubclass(section_cls, BaseModel)
    try:
        elastic_cfg = section_cls.model_validate(meta["elastic"], context={"registry": registry})
    except ValidationError as exc:  # e.g. a router plugin that is not installed here
        problems = format_validation_error(exc, meta["elastic"], str(folder / CONFIG), section_cls, registry)
        listed = problems.partition("\n")[2]  # the problems, without format_validation_error's recipe heading
        raise CheckpointError(f"{folder / CONFIG}: its 'elastic' section is not valid here:\n{listed}") from None
    except (ValueError, ElasticError) as exc:
        raise CheckpointError(f"{folder / CONFIG}: its 'elastic' section is not valid here: {exc}") from None
    bad_state = _non_finite_json(meta.get("router_state") or {}, "router_state")
    if bad_state:
        raise CheckpointError(f"{folder / CONFIG}: refusing an adapter whose router state holds NaN or Inf: {bad_state}")
    weights = folder / WEIGHTS
    state = _read_weights(weights, where)

    with _restored_on_failure(model):
        elastic = ElasticModel(model, elastic_cfg, registry=registry, base_model_name=meta["base_model"])
        try:
            if list(elastic.heads.routed_layers) != meta["routed_layers"]:
                raise CheckpointError(
                    f"{where} routes layers {meta['routed_layers']} but this model routes "
                    f"{list(elastic.heads.routed_layers)}"
                )
            _load_router_state(elastic.router, state, weights)
            try:
                elastic.router.load_extra_state(meta.get("router_state") or {})
            except (ElasticError, ValueError, TypeError, KeyError) as exc:
                raise CheckpointError(
                    f"{folder / CONFIG}: 'router_state' does not fit router {elastic.router.name!r}: {exc}"
                ) from None
        except BaseException:
            elastic.unwrap()
            raise
    return elastic


def _check_base_model(meta: dict[str, Any], model: Any, base_model: str, where: str) -> None:
    """Refuse an adapter recorded for another base model. Each side may know the model under two
    names (the recipe's name and transformers' ``_name_or_path``); one shared name is a match, and
    an adapter that recorded no name is not checked."""
    recorded = {_norm(meta["base_model"]), _norm(meta.get("base_model_name_or_path") or "")} - {""}
    given = {_norm(base_model), _norm(getattr(model.config, "_name_or_path", "") or "")} - {""}
    if recorded and given and not recorded & given:
        raise CheckpointError(
            f"{where} was trained on base model {meta['base_model']!r} but is being loaded onto {base_model!r}; "
            "a router trained on other weights routes them wrongly. If it is the same model under another name, "
            f"pass strict_base_model=False to load_adapter (or load the model under the name {meta['base_model']!r})"
        )


def _norm(name: str) -> str:
    return name.strip().rstrip("/")


def _read_weights(weights: Path, where: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors (on the CPU), refused when unreadable or non-finite."""
    if not weights.is_file():
        raise CheckpointError(f"{where}: {WEIGHTS} is missing")
    try:
        state = load_file(str(weights))
    except SafetensorError as exc:
        text = str(exc)
        truncated = any(s in text for s in ("header too small", "invalid header length", "incomplete metadata"))
        what = "the file is truncated" if truncated else "the file is not in safetensors format (corrupt?)"
        raise CheckpointError(f"{weights}: not a readable safetensors file: {what} (safetensors: {text})") from None
    except OSError as exc:
        raise CheckpointError(f"{weights}: cannot be read ({exc.strerror or exc})") from None
    bad = _non_finite(state)
    if bad:
        raise CheckpointError(f"{weights}: refusing an adapter whose weights hold NaN or Inf: {bad}")
    return state


def _load_router_state(router: Any, state: dict[str, torch.Tensor], weights: Path) -> None:
    expected = router.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = ([f"missing tensors [{_names(missing)}]"] if missing else []) + (
            [f"unexpected tensors [{_names(unexpected)}]"] if unexpected else []
        )
        raise CheckpointError(
            f"{weights}: does not fit router {router.name!r} (as configured in {CONFIG}): {'; '.join(parts)}"
        )
    shapes = [
        f"{k}: expected {tuple(expected[k].shape)}, got {tuple(state[k].shape)}"
        for k in sorted(state)
        if tuple(state[k].shape) != tuple(expected[k].shape)
    ]
    kinds = [
        f"{k}: expected a {expected[k].dtype} tensor, got {state[k].dtype}"
        for k in sorted(state)
        if state[k].is_floating_point() != expected[k].is_floating_point()
    ]
    if shapes or kinds:
        raise CheckpointError(
            f"{weights}: tensors do not fit router {router.name!r} ({CONFIG} routes "
            f"{router.heads.num_routed} layers x {router.heads.num_kv_heads} KV heads, head_dim "
            f"{router.heads.head_dim}): {'; '.join(shapes + kinds)}"
        )
    try:
        router.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # a router's own load hooks; the checks above cover the standard cases
        raise CheckpointError(f"{weights}: does not fit router {router.name!r}: {exc}") from None


@contextmanager
def _restored_on_failure(model: Any) -> Iterator[None]:
    """Undo what wrapping changes on ``model`` (attention implementation, ``requires_grad``,
    train/eval modes, the wrapped flag) if the block raises."""
    from elasticfw.model.bridge import BINDING_ATTR

    impl = model.config._attn_implementation
    grads = [(p, p.requires_grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    bound = {id(m) for m in model.modules() if hasattr(m, BINDING_ATTR)}
    had_flag = "_elasticfw_wrapped" in vars(model)
    flag = vars(model).get("_elasticfw_wrapped")
    try:
        yield
    except BaseException:
        for m in model.modules():
            if hasattr(m, BINDING_ATTR) and id(m) not in bound:
                delattr(m, BINDING_ATTR)
        if model.config._attn_implementation != impl:
            model.set_attn_implementation(impl)
        for p, requires_grad in grads:
            p.requires_grad_(requires_grad)
        for m, training in modes:
            m.training = training
        if had_flag:
            model._elasticfw_wrapped = flag
        elif "_elasticfw_wrapped" in vars(model):
            del model._elasticfw_wrapped
        raise


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
