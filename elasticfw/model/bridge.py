"""The bridge into transformers: one attention implementation and one mask function, both
registered under the name ``"elasticfw"`` through transformers' public interfaces
(``AttentionInterface`` / ``AttentionMaskInterface``). No modeling file is copied and no
``forward`` is patched.

The mask function does not build an S×S mask: it returns :class:`KeyPaddingInfo`, the 2-D
padding mask (sliced to the layer's keys) plus where the queries sit in the key array. The
attention function finds the elastic runtime bound to the calling attention module and hands
it q, k, v and that information.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from elasticfw.errors import ElasticError, UnsupportedInputError

IMPLEMENTATION = "elasticfw"
BINDING_ATTR = "_elasticfw_binding"


@dataclass(frozen=True)
class KeyPaddingInfo:
    """What the elastic attention needs from transformers' mask machinery, in O(B·S).

    ``key_mask`` is (B, kv_length) bool (True = real token) or ``None`` when nothing is padded;
    query row 0 sits at key index ``query_index``.
    """

    key_mask: torch.Tensor | None
    query_index: int
    q_length: int
    kv_length: int


def elastic_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    **_: Any,
) -> KeyPaddingInfo:
    """Mask function registered in ``AttentionMaskInterface`` (signature of transformers' own).

    transformers turns ``allow_is_causal_skip`` off exactly when the mask is more than causal +
    padding (+ the layer's sliding window, which reaches the attention function separately):
    packed sequences, bidirectional or image-token overlays, chunked attention, static-cache
    decoding. elasticfw cannot honour those patterns, so it refuses them instead of computing a
    plain causal mask.
    """
    if not allow_is_causal_skip:
        raise UnsupportedInputError(
            "transformers asked for an attention mask that is not plain causal + padding (packed sequences, "
            "bidirectional or image-token overlays, chunked attention, or a static cache); elasticfw supports "
            "causal decoder attention with a 2-D padding mask and a dynamic cache only"
        )
    if isinstance(q_offset, torch.Tensor):
        q_offset = int(q_offset.item())
    key_mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise UnsupportedInputError(
                f"elasticfw takes a 2-D attention_mask (batch, tokens) marking padding, got shape "
                f"{tuple(attention_mask.shape)}; custom 4-D masks are not supported"
            )
        key_mask = attention_mask[:, -kv_length:].to(torch.bool)
        if key_mask.shape[1] != kv_length:
            raise UnsupportedInputError(
                f"attention_mask covers {key_mask.shape[1]} tokens but the layer has {kv_length} keys "
                "(static caches are not supported by elasticfw)"
            )
        if bool(key_mask.all()):
            key_mask = None
    return KeyPaddingInfo(key_mask, int(q_offset) - int(kv_offset), q_length, kv_length)


def elastic_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function registered in ``AttentionInterface``; returns (B, Sq, Hq, D)."""
    binding = getattr(module, BINDING_ATTR, None)
    if binding is None:
        raise ElasticError(
            f"{type(module).__name__} runs attn_implementation={IMPLEMENTATION!r} but is not part of an "
            "elastic model; build one with elasticfw.model.ElasticModel"
        )
    if dropout:
        raise UnsupportedInputError(f"attention dropout ({dropout}) is not supported by elasticfw")
    if kwargs.get("softcap") is not None:
        raise UnsupportedInputError("attention logit soft-capping is not supported by elasticfw")
    if attention_mask is not None and not isinstance(attention_mask, KeyPaddingInfo):
        raise UnsupportedInputError(
            f"elasticfw expected its own mask information, got {type(attention_mask).__name__}; "
            "pass a 2-D attention_mask to the model, not a prepared 4-D mask"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = binding.runtime.attend(
        binding.layer_idx, query, key, value, attention_mask, scale=scale, sliding_window=kwargs.get("sliding_window")
    )
    return out.transpose(1, 2).contiguous(), None


_registered = False


def register_implementation() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, elastic_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, elastic_mask)
    _registered = True
