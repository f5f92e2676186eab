"""Mistral family: Llama layout; ``config.sliding_window`` (if set) applies to every layer."""

from torch import nn

from elasticfw.model.adapter import BackboneAdapter


class MistralAdapter(BackboneAdapter):
    """Mistral decoders; the sliding window, when configured, is model-wide."""

    name = "mistral"
    model_types = ("mistral",)

    def sliding_window(self, model: nn.Module, layer_idx: int) -> int | None:
        return getattr(self.text_config(model.config), "sliding_window", None)
