"""Adapters on disk, PEFT-style: only the trained parts (safetensors) plus a JSON config.

    <dir>/elastic_adapter.safetensors   router (and any other trained) tensors
    <dir>/elastic_config.json           elasticfw version, base model name, model_type, head
                                        layout, the recipe's elastic section, router extra state

This module loads an adapter onto a model (:func:`load_adapter`); the format, atomic saving
(:func:`save_adapter`) and reading the config (:func:`read_adapter_config`) are
:mod:`elasticfw.model.adapter_files`'s, importable from here too. Loading is transactional: every
check (JSON keys and types, base model, architecture and head layout, the weights file's
integrity, tensor names, shapes and finiteness) either passes or raises
:class:`~elasticfw.errors.CheckpointError` naming the file and what is wrong, and a failed load
leaves the model exactly as it was. Nothing is unpickled.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file

from elasticfw.errors import CheckpointError, ElasticError
from elasticfw.model.adapter_files import (  # the format, saving, reading: also importable from here
    CONFIG,
    FORMAT_VERSION,
    WEIGHTS,
    _names,
    _non_finite,
    _non_finite_json,
    read_adapter_config,
    save_adapter,
)
from elasticfw.model.bridge import BINDING_ATTR
from elasticfw.model.elastic import ElasticModel, resolve_adapter
from elasticfw.recipe import format_validation_error
from elasticfw.recipe.schema import recipe_model
from elasticfw.registry import Registry, get_registry

__all__ = ["CONFIG", "FORMAT_VERSION", "WEIGHTS", "load_adapter", "read_adapter_config", "save_adapter"]


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
