"""Adapters on disk, PEFT-style: only the trained parts (safetensors) plus a JSON config.

    <dir>/elastic_adapter.safetensors   router (and any other trained) tensors
    <dir>/elastic_config.json           elasticfw version, base model name, model_type, head
                                        layout, the recipe's elastic section, router extra state

Loading checks the base model's architecture and head layout against the JSON and refuses a
mismatch with a message naming both. Nothing is unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from elasticfw.atomic import atomic_write_text
from elasticfw.errors import CheckpointError
from elasticfw.registry import Registry, get_registry

WEIGHTS = "elastic_adapter.safetensors"
CONFIG = "elastic_config.json"
FORMAT_VERSION = 1


def save_adapter(elastic: Any, path: str | Path) -> Path:
    from elasticfw import __version__

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in elastic.router.state_dict().items()}
    save_file(state, str(out / WEIGHTS))
    heads = elastic.heads
    meta = {
        "format_version": FORMAT_VERSION,
        "elasticfw_version": __version__,
        "base_model": elastic.base_model_name,
        "model_type": elastic.base.config.model_type,
        "routed_layers": list(heads.routed_layers),
        "num_q_heads": heads.num_q_heads,
        "num_kv_heads": heads.num_kv_heads,
        "head_dim": heads.head_dim,
        "elastic": elastic.elastic_config.model_dump(mode="json"),
        "router_state": elastic.router.extra_state(),
    }
    atomic_write_text(out / CONFIG, json.dumps(meta, indent=2))
    return out


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    cfg = Path(path).expanduser() / CONFIG
    if not cfg.is_file():
        raise CheckpointError(f"{str(path)!r} is not an elasticfw adapter: {CONFIG} is missing")
    try:
        meta = json.loads(cfg.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{cfg}: format_version {meta.get('format_version')!r}, this elasticfw reads {FORMAT_VERSION}"
        )
    return meta


def load_adapter(model: Any, path: str | Path, *, registry: Registry | None = None) -> Any:
    """Make ``model`` (a loaded Hugging Face causal LM) elastic with the adapter at ``path``."""
    from elasticfw.model.elastic import ElasticModel, resolve_adapter
    from elasticfw.recipe.schema import recipe_model

    registry = registry or get_registry()
    meta = read_adapter_config(path)
    model_type = model.config.model_type
    if model_type != meta["model_type"]:
        raise CheckpointError(
            f"adapter {str(path)!r} was trained on a {meta['model_type']!r} model ({meta['base_model']!r}); "
            f"the given model is {model_type!r}"
        )
    layers, hq, hkv, head_dim = resolve_adapter(model.config, registry).head_layout(model.config)
    have = {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": head_dim}
    for key, value in have.items():
        if meta[key] != value:
            raise CheckpointError(
                f"adapter {str(path)!r}: {key} is {meta[key]} but the given model has {value} "
                f"(adapter base model: {meta['base_model']!r})"
            )
    section_cls = recipe_model(registry).model_fields["elastic"].annotation
    assert section_cls is not None  # the recipe model always declares its elastic section's class
    elastic_cfg = section_cls.model_validate(meta["elastic"], context={"registry": registry})
    elastic = ElasticModel(model, elastic_cfg, registry=registry, base_model_name=meta["base_model"])
    if list(elastic.heads.routed_layers) != meta["routed_layers"]:
        elastic.unwrap()
        raise CheckpointError(
            f"adapter {str(path)!r} routes layers {meta['routed_layers']} but this model routes "
            f"{list(elastic.heads.routed_layers)}"
        )
    weights = Path(path).expanduser() / WEIGHTS
    if not weights.is_file():
        elastic.unwrap()
        raise CheckpointError(f"adapter {str(path)!r}: {WEIGHTS} is missing")
    state = load_file(str(weights), device=str(next(model.parameters()).device))
    missing, unexpected = elastic.router.load_state_dict(state, strict=False)
    if missing or unexpected:
        elastic.unwrap()
        raise CheckpointError(
            f"adapter {str(path)!r} does not fit router {elastic.router.name!r}: missing {missing}, unexpected {unexpected}"
        )
    elastic.router.load_extra_state(meta.get("router_state") or {})
    return elastic
