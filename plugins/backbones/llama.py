"""Llama family (Llama 2/3/3.1, SmolLM2, TinyLlama, ...): the standard decoder layout."""

from elasticfw.model.adapter import BackboneAdapter


class LlamaAdapter(BackboneAdapter):
    """Llama-architecture decoders; global causal attention in every layer."""

    name = "llama"
    model_types = ("llama",)
