"""Gemma 3: interleaved sliding-window (local) and global layers, q/k norms,
``query_pre_attn_scalar`` scaling (arrives as the attention ``scaling``); text-only and
multimodal checkpoints (the decoder config is nested in ``text_config``)."""

from elasticfw.model.adapter import BackboneAdapter


class Gemma3Adapter(BackboneAdapter):
    """Gemma 3 decoders (local layers keep their native window unless routed)."""

    name = "gemma3"
    model_types = ("gemma3", "gemma3_text")
