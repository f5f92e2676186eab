"""Tiny random-initialised causal LMs of every supported family, built from configs (no network).

Sizes are chosen so a forward pass of a few hundred tokens takes milliseconds on a CPU while
keeping the features that matter: GQA (group 2 or 3), several layers, per-family quirks (QKV
bias, q/k norms, sliding-window layers).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig

#: family -> (transformers model_type, what differs from the common tiny sizes)
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "gemma3": (
        "gemma3_text",
        {
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 16,
        },
    ),
}
FAMILIES = tuple(TINY_FAMILIES)

COMMON: dict[str, Any] = dict(
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


def tiny_config(family: str, **overrides: Any) -> PretrainedConfig:
    """A small config of ``family`` (4 layers, 6 query / 2 KV heads, head_dim 16); ``overrides``
    are set on it afterwards."""
    from transformers import AutoConfig

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    model_type, extra = TINY_FAMILIES[family]
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **extra})
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


def padded_batch(
    lengths: list[int], *, side: str = "left", seed: int = 0, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (3..249, valid for every tiny model) of the given lengths, padded with id 0
    on ``side`` ("left" or "right") to the longest, and their attention mask (1 on real tokens)."""
    if side not in ("left", "right"):
        raise ValueError(f"padded_batch: side must be 'left' or 'right', got {side!r}")
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        sl = slice(width - n, width) if side == "left" else slice(0, n)
        ids[i, sl], mask[i, sl] = torch.randint(3, 250, (n,), generator=g), 1
    return ids.to(device), mask.to(device)
