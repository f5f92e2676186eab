"""The contract of a backbone adapter plugin: only what differs between model families."""

from __future__ import annotations

from typing import Any, ClassVar, cast

from torch import nn

from elasticfw.errors import UnsupportedInputError


class BackboneAdapter:
    """Maps a Hugging Face causal-LM family onto what elasticfw needs.

    The defaults fit transformers' standard decoder layout (``model.model.layers[i].self_attn``
    with ``num_attention_heads`` / ``num_key_value_heads`` / ``head_dim`` in the config and the
    per-layer ``sliding_window`` attribute on the attention module); a family overrides only
    what differs. ``model_types`` lists the ``config.model_type`` values it serves.
    """

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]

    def text_config(self, config: Any) -> Any:
        """The config holding the decoder's sizes (multimodal wrappers nest it)."""
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        base = getattr(model, "model", model)
        base = getattr(base, "language_model", base)
        layers = getattr(base, "layers", None)
        if layers is None:
            raise UnsupportedInputError(
                f"{type(model).__name__}: adapter {self.name!r} found no decoder layers at model.model.layers"
            )
        return list(layers)

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [cast(nn.Module, layer.self_attn) for layer in self.decoder_layers(model)]

    def head_layout(self, config: Any) -> tuple[int, int, int, int]:
        """(num_layers, num_query_heads, num_kv_heads, head_dim)."""
        cfg = self.text_config(config)
        hq = cfg.num_attention_heads
        hkv = getattr(cfg, "num_key_value_heads", None) or hq
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
        return cfg.num_hidden_layers, hq, hkv, head_dim

    def sliding_window(self, model: nn.Module, layer_idx: int) -> int | None:
        """The native sliding window of a layer (``None`` for global attention)."""
        return getattr(self.attention_modules(model)[layer_idx], "sliding_window", None)

    def check_supported(self, config: Any) -> None:
        """Raise :class:`UnsupportedInputError` for features elasticfw cannot reproduce."""
        cfg = self.text_config(config)
        softcap = getattr(cfg, "attn_logit_softcapping", None)
        if softcap is not None:
            raise UnsupportedInputError(
                f"{cfg.model_type}: attention logit soft-capping ({softcap}) is not supported by elasticfw executors"
            )
