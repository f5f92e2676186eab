"""The contract of an attention executor plugin (reference, flex, and later fused kernels)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from elasticfw.attention.layout import BlockLayout
from elasticfw.attention.mode import AttentionOutput
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError, UnsupportedInputError
from elasticfw.registry import PluginConfig


class ExecutorConfig(PluginConfig):
    """Base of every executor's recipe section."""


class Executor(ABC):
    """Runs attention for all heads of a layer over one per-head :class:`BlockLayout`.

    ``attend`` takes q (B, Hq, Sq, D) and start-aligned k, v (B, Hkv, Sk, D) with Hq a
    multiple of Hkv (GQA is handled inside, never by materialising repeated K/V in the
    contract), a layout with 1, Hkv or Hq heads, and returns :class:`AttentionOutput`.
    Gradients flow to q, k and v. Executors declare what they support through
    :meth:`availability` and :attr:`supported_dtypes`, and raise
    :class:`~elasticfw.errors.UnsupportedInputError` otherwise.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[ExecutorConfig]]
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)

    def __init__(self, config: ExecutorConfig | None = None) -> None:
        reason = self.availability()
        if reason is not None:
            raise BackendUnavailableError(f"executor {self.name!r} is not available here: {reason}")
        self.config = config if config is not None else self.config_class()

    @classmethod
    def availability(cls) -> str | None:
        """``None`` when usable on this machine, else the reason it is not."""
        return None

    @classmethod
    def is_available(cls) -> bool:
        return cls.availability() is None

    def check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqInfo) -> None:
        seq.check(q, k)
        if v.shape[:3] != k.shape[:3]:
            raise UnsupportedInputError(f"v {tuple(v.shape)} does not match k {tuple(k.shape)}")
        if q.dtype not in self.supported_dtypes:
            raise UnsupportedInputError(
                f"executor {self.name!r} supports dtypes {[str(d) for d in self.supported_dtypes]}, got {q.dtype}"
            )
        if not (q.dtype == k.dtype == v.dtype):
            raise UnsupportedInputError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BlockLayout,
        seq: SeqInfo,
        *,
        scale: float,
        need_lse: bool = True,
    ) -> AttentionOutput:
        """Attention of every head over the pairs ``layout`` (plus causality) allows.

        With ``need_lse=False`` an executor may skip the log-sum-exp (``lse=None``)."""
