"""The contract of an attention executor plugin (reference, flex, and later fused kernels)."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from elasticfw.attention.inputs import NOT_GIVEN, check_attention_inputs
from elasticfw.attention.layout import BlockLayout, routed_layout
from elasticfw.attention.output import AttentionOutput
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.registry import PluginConfig

#: marks an ``attend`` already wrapped by :meth:`Executor.__init_subclass__`
_CHECKED = "__elasticfw_checked__"


class ExecutorConfig(PluginConfig):
    """Base of every executor's recipe section."""

    def check_layout_block_size(self, block_size: int) -> None:
        """Raise ``ValueError`` if this executor cannot run layouts of ``block_size``-token blocks
        (called when a recipe is validated, once per mode block size; default: any size)."""


class Executor(ABC):
    """Runs attention for all heads of a layer over one per-head :class:`BlockLayout`.

    ``attend`` takes q (B, Hq, Sq, D) and start-aligned k, v (B, Hkv, Sk, D) with Hq a
    multiple of Hkv (GQA is handled inside, never by materialising repeated K/V in the
    contract), a layout with 1, Hkv or Hq heads, and returns :class:`AttentionOutput`.
    Gradients flow to q, k and v. Executors declare what they support through
    :meth:`availability` and :attr:`supported_dtypes`, and raise
    :class:`~elasticfw.errors.UnsupportedInputError` otherwise. Every subclass's ``attend`` is
    wrapped to run :meth:`check_inputs` (shapes, devices, dtypes, scale, layout grid) first, so an
    executor's own code only sees inputs that fit the contract.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[ExecutorConfig]]
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    #: whether :meth:`attend_routed` takes ``hard_host=``: the routing the caller already holds on the
    #: CPU (``hard``'s values), so that an executor choosing kernels on the host needs no device read
    #: of its own (on a GPU each waits for every queued kernel). An executor that sets it accepts
    #: the keyword; executors written before it keep the signature below and never receive it.
    takes_host_routing: ClassVar[bool] = False

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

    def check_inputs(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq: SeqInfo,
        layout: BlockLayout = NOT_GIVEN,
        *,
        scale: float = NOT_GIVEN,
    ) -> None:
        """Raise :class:`~elasticfw.errors.UnsupportedInputError` unless this executor can run the
        call: shapes, devices, dtypes among :attr:`supported_dtypes`, and ``layout`` and ``scale``
        when they are passed (see :mod:`elasticfw.attention.inputs`). ``attend`` runs it first."""
        check_attention_inputs(
            q, k, v, seq, scale=scale, layout=layout, dtypes=self.supported_dtypes, context=f"executor {self.name!r}"
        )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Wrap a subclass's ``attend`` so that :meth:`check_inputs` runs before it, whatever the
        plugin does (validation lives here, not in every executor)."""
        super().__init_subclass__(**kwargs)
        attend = cls.__dict__.get("attend")
        if attend is None or getattr(attend, "__isabstractmethod__", False) or getattr(attend, _CHECKED, False):
            return

        @functools.wraps(attend)
        def checked_attend(
            self: Executor,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            layout: BlockLayout,
            seq: SeqInfo,
            *,
            scale: float,
            **options: Any,
        ) -> AttentionOutput:
            self.check_inputs(q, k, v, seq, layout, scale=scale)
            return attend(self, q, k, v, layout, seq, scale=scale, **options)

        setattr(checked_attend, _CHECKED, True)
        cls.attend = checked_attend  # type: ignore[method-assign]

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

    def attend_routed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq: SeqInfo,
        *,
        hard: torch.Tensor,
        layouts: tuple[BlockLayout, BlockLayout],
        scale: float,
        need_lse: bool = True,
    ) -> AttentionOutput:
        """Attention of heads routed between two layouts: query head ``h`` of sample ``b`` computes
        ``layouts[1]`` (the sparse mode's) where ``hard[b, h]`` (B, Hq bool) is True, else
        ``layouts[0]`` (the retrieval mode's). Side branches are not included (the caller merges
        them). Same inputs, outputs and gradients as :meth:`attend` over the per-head combination.

        Default: one :meth:`attend` launch over :func:`~elasticfw.attention.layout.routed_layout`, so
        executors written before this hook keep working. An executor that runs head groups through
        different kernels (e.g. dense causal heads through a dense kernel) overrides it."""
        return self.attend(q, k, v, routed_layout(hard, layouts, seq), seq, scale=scale, need_lse=need_lse)
