"""The contract of a model source plugin: a short recipe name for a downloadable model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch


class ModelSource(ABC):
    """Resolves a short name (``model: {name: smollm2-135m}``) to a model and tokenizer."""

    name: ClassVar[str]

    @abstractmethod
    def load(self, *, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
        """Return ``(model, tokenizer)``, the model in eval mode on ``device``."""

    def describe(self) -> str:
        return (self.__doc__ or "").strip().splitlines()[0] if self.__doc__ else ""
