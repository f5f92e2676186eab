"""Load the backbone a recipe names and make it elastic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from elasticfw.errors import BackendUnavailableError
from elasticfw.registry import Registry, get_registry

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError(f"model.device = {spec!r} but this machine has no CUDA device (use auto or cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise BackendUnavailableError(
            f"model.device = {spec!r} but only {torch.cuda.device_count()} CUDA device(s) are visible"
        )
    return device


def load_model(section: Any, *, registry: Registry | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) for a recipe's ``model`` section: a registered short name, a local
    path or a hub id (the latter two through ``transformers.AutoModelForCausalLM``)."""
    registry = registry or get_registry()
    dtype, device = DTYPES[section.dtype], resolve_device(section.device)
    if ("model", section.name) in registry:
        return registry.get("model", section.name)().load(dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_source(section.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(section.name, revision=section.revision)
        # an nn.Module: transformers' @wraps(nn.Module.to) on PreTrainedModel.to mis-types the bound call
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
            section.name, dtype=dtype, revision=section.revision
        )
    except OSError as exc:  # transformers' "not found / cannot download" family
        raise BackendUnavailableError(
            f"model.name = {section.name!r}: transformers could not load it ({str(exc).splitlines()[0][:300]}); "
            "for a hub id the machine needs network access or the model in its Hugging Face cache"
        ) from None
    return model.to(device).eval(), tokenizer


def check_model_source(name: str) -> None:
    """Refuse a local path that cannot be a Hugging Face model folder before transformers tries it
    (an empty folder otherwise fails with a misleading "You need to have sentencepiece ...")."""
    path = Path(name).expanduser()
    try:
        exists = path.exists()
    except (OSError, ValueError):  # a name too long or holding a NUL: not a path
        exists = False
    if not exists:
        return  # a hub id: transformers resolves it
    if not path.is_dir():
        raise BackendUnavailableError(f"model.name = {name!r} is a file; give the folder holding config.json")
    if not (path / "config.json").is_file():
        raise BackendUnavailableError(
            f"model.name = {name!r} is a folder without config.json: not a saved Hugging Face model "
            "(save one with model.save_pretrained(folder) and tokenizer.save_pretrained(folder))"
        )
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json")]
    if not weights:
        raise BackendUnavailableError(
            f"model.name = {name!r} has a config.json but no weights (*.safetensors or *.bin)"
        )


def make_elastic(model: Any, tokenizer: Any, elastic_section: Any, *, registry: Registry | None = None,
                 base_model_name: str | None = None, seed: int = 0) -> Any:
    """Wrap ``model`` and let the router prepare itself (e.g. retrieval-score calibration)."""
    from elasticfw.model.elastic import ElasticModel

    torch.manual_seed(seed)
    elastic = ElasticModel(model, elastic_section, registry=registry, base_model_name=base_model_name)
    try:
        elastic.router.prepare(elastic, tokenizer, seed=seed)
    except BaseException:
        elastic.unwrap()  # the model is left as it came, ready for another variant
        raise
    return elastic
