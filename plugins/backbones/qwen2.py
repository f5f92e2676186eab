"""Qwen2 / Qwen2.5: Llama layout with QKV bias; optional sliding-window layers (``layer_types``)."""

from elasticfw.model.adapter import BackboneAdapter


class Qwen2Adapter(BackboneAdapter):
    """Qwen2-architecture decoders."""

    name = "qwen2"
    model_types = ("qwen2",)
