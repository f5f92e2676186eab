"""Qwen3: Llama layout with per-head q/k RMSNorm (keys arrive normalised and rotated)."""

from elasticfw.model.adapter import BackboneAdapter


class Qwen3Adapter(BackboneAdapter):
    """Qwen3-architecture decoders."""

    name = "qwen3"
    model_types = ("qwen3",)
