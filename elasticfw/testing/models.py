"""Tiny random-initialised causal LMs of every supported family, built from configs (no network).

Sizes are chosen so a forward pass of a few hundred tokens takes milliseconds on a CPU while
keeping the features that matter: GQA (group 2 or 3), several layers, per-family quirks (QKV
bias, q/k norms, sliding-window layers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")


def tiny_config(family: str, **overrides: Any) -> Any:
    """A small config of ``family`` (4 layers, 6 query / 2 KV heads, head_dim 16)."""
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    common: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    cfg: PretrainedConfig
    if family == "llama":
        cfg = LlamaConfig(**common)
    elif family == "qwen2":
        cfg = Qwen2Config(**common)
    elif family == "qwen3":
        cfg = Qwen3Config(**common)
    elif family == "mistral":
        cfg = MistralConfig(**{**common, "sliding_window": None})
    elif family == "gemma3":
        cfg = Gemma3TextConfig(
            **{**common, "num_hidden_layers": 4},
            sliding_window=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
        )
    else:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """A random-initialised causal LM of ``family`` in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # random init gives near-uniform attention; sharpen it so sparse modes visibly matter
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model.eval()
