"""The contract of a router plugin."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import ElasticError
from elasticfw.registry import PluginConfig


class RouterConfig(PluginConfig):
    """Base of every router's recipe section."""


@dataclass(frozen=True)
class HeadLayout:
    """What a router needs to know about the backbone."""

    routed_layers: tuple[int, ...]  # absolute layer indices the router decides for
    num_kv_heads: int
    num_q_heads: int
    head_dim: int

    @property
    def num_routed(self) -> int:
        return len(self.routed_layers)


class HostCopy:
    """A CPU copy of a (small) tensor that routers keep for :attr:`RouterDecision.host`: read from
    the device once, and again only after the tensor changed (an in-place edit bumps its version; a
    move to another device or dtype gives it new storage). A tensor made under
    ``torch.inference_mode()`` has no version counter, so it is read at every call: a router built
    outside inference mode is read once."""

    def __init__(self) -> None:
        self._key: tuple[int, int, torch.dtype] | None = None
        self._copy: torch.Tensor | None = None

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_inference():
            return tensor.detach().cpu()
        key = (tensor._version, tensor.data_ptr(), tensor.dtype)
        if self._copy is None or self._key != key:
            self._copy, self._key = tensor.detach().cpu(), key
        return self._copy


@dataclass(frozen=True)
class RouterDecision:
    """Per (sample, KV head) decision of one layer. ``sparse`` is 1.0 for the sparse mode and
    0.0 for the retrieval mode; in training it carries the straight-through gradient of
    ``prob_sparse``. ``logits`` is optional (learned routers). ``host`` is optional: ``sparse``'s
    values as a CPU tensor, for a router that knows them without computing on the device
    (input-independent routers); the runtime then chooses kernels without reading the device,
    which on a GPU waits for every queued kernel."""

    sparse: torch.Tensor  # (B, Hkv) float
    prob_sparse: torch.Tensor  # (B, Hkv) float in [0, 1]
    logits: torch.Tensor | None = None
    host: torch.Tensor | None = None  # (B, Hkv) float on the CPU, equal to sparse

    def __post_init__(self) -> None:
        if self.host is not None and (self.host.device.type != "cpu" or self.host.shape != self.sparse.shape):
            raise ValueError(
                f"RouterDecision.host must be a CPU tensor of sparse's shape {tuple(self.sparse.shape)}, got "
                f"{tuple(self.host.shape)} on {self.host.device}"
            )

    @classmethod
    def constant(
        cls, row: torch.Tensor, batch: int, device: torch.device, *, host_row: torch.Tensor | None = None
    ) -> RouterDecision:
        """The same 0/1 assignment ``row`` (Hkv,) for every sample (input-independent routers);
        ``host_row``: the same values on the CPU (the decision's ``host``)."""
        sparse = row.to(device)[None, :].expand(batch, -1)
        host = None if host_row is None else host_row[None, :].expand(batch, -1)
        return cls(sparse=sparse, prob_sparse=sparse, host=host)


class Router(nn.Module, ABC):
    """Decides, per input and per (routed layer, KV head), retrieval mode vs sparse mode.

    One router instance serves every routed layer of a model (``layer`` below is the position
    in ``heads.routed_layers``). Learned routers hold their parameters as ordinary
    ``nn.Module`` parameters: they are the only parameters an elastic model trains and saves.
    ``decide`` gets the layer's start-aligned key states (B, Hkv, Sk, D) — exactly what the
    attention kernel sees — and the batch's :class:`SeqInfo`.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[RouterConfig]]
    def __init__(self, config: RouterConfig, heads: HeadLayout) -> None:
        super().__init__()
        self.config = config
        self.heads = heads
        self.progress = 0.0  # training progress in [0, 1], drives temperature schedules
        self._noise: torch.Tensor | None = None  # preset Gumbel noise (B, L_routed, Hkv, 2), see set_noise

    @abstractmethod
    def decide(self, layer: int, keys: torch.Tensor, seq: SeqInfo) -> RouterDecision:
        """Decision for routed layer ``layer``; ``self.training`` selects stochastic/hard."""

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """The trainable parameters by part, for per-part learning rates (``train.lr_scale``) and the
        trainer's per-part gradient norms. Default: one group, ``router``."""
        return {"router": [p for p in self.parameters() if p.requires_grad]}

    def prepare(self, elastic: Any, tokenizer: Any, *, seed: int = 0) -> None:
        """Called once after the router is attached to a model (default: nothing).

        Training-free routers calibrate here (e.g. ranking heads on probe inputs)."""

    def set_progress(self, progress: float) -> None:
        self.progress = float(min(max(progress, 0.0), 1.0))

    def set_noise(self, noise: torch.Tensor | None) -> None:
        """Preset the Gumbel noise of the next forwards: (B, L_routed, Hkv, 2), one row per sample
        (:func:`elasticfw.routing.gumbel.sample_noise`), or ``None`` to draw fresh noise. The
        trainer sets it so a sample's routing noise does not depend on batching or resumption."""
        if noise is not None and tuple(noise.shape[1:]) != (self.heads.num_routed, self.heads.num_kv_heads, 2):
            raise ElasticError(
                f"router noise must be (batch, {self.heads.num_routed}, {self.heads.num_kv_heads}, 2), "
                f"got {tuple(noise.shape)}"
            )
        self._noise = noise

    def preset_noise(self, layer: int, logits: torch.Tensor) -> torch.Tensor | None:
        """The preset noise of routed layer ``layer`` for ``logits`` (B, Hkv, 2), or ``None``."""
        if self._noise is None:
            return None
        noise = self._noise[:, layer]
        if noise.shape != logits.shape:
            raise ElasticError(
                f"preset router noise {tuple(noise.shape)} does not fit the logits {tuple(logits.shape)} of this "
                "batch; set_noise() with one row per sample of the batch"
            )
        return noise

    def extra_state(self) -> dict:
        """JSON-serialisable state saved beside the weights (e.g. calibrated head lists)."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        """Restore what :meth:`extra_state` returned."""
