"""The contract of a router plugin."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import ElasticError, UnsupportedInputError
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
    #: K, the modes a head is routed among (``elastic.modes``; 2: the retrieval and the sparse mode)
    num_modes: int = 2

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
    #: K >= 3 modes (:meth:`of_modes`): (B, Hkv, K) one-hot, in training with the straight-through
    #: gradient of ``probs``; ``None`` for two modes, where ``sparse`` is the decision
    modes: torch.Tensor | None = None
    probs: torch.Tensor | None = None  # (B, Hkv, K) the modes' probabilities
    index_host: torch.Tensor | None = None  # (B, Hkv) int64 on the CPU: each head's mode, when known there

    def __post_init__(self) -> None:
        if self.host is not None and (self.host.device.type != "cpu" or self.host.shape != self.sparse.shape):
            raise ValueError(
                f"RouterDecision.host must be a CPU tensor of sparse's shape {tuple(self.sparse.shape)}, got "
                f"{tuple(self.host.shape)} on {self.host.device}"
            )
        if self.modes is not None and (self.modes.dim() != 3 or self.modes.shape[:2] != self.sparse.shape):
            raise ValueError(
                f"RouterDecision.modes must be (batch, KV heads, K) = {tuple(self.sparse.shape)} + (K,), got "
                f"{tuple(self.modes.shape)}"
            )
        if self.index_host is not None and (self.index_host.device.type != "cpu"
                                            or self.index_host.shape != self.sparse.shape):
            raise ValueError(
                f"RouterDecision.index_host must be a CPU tensor of sparse's shape {tuple(self.sparse.shape)}, got "
                f"{tuple(self.index_host.shape)} on {self.index_host.device}"
            )

    @classmethod
    def of_modes(
        cls,
        modes: torch.Tensor,
        probs: torch.Tensor,
        logits: torch.Tensor | None = None,
        *,
        index_host: torch.Tensor | None = None,
    ) -> RouterDecision:
        """A decision among K >= 2 modes: ``modes`` (B, Hkv, K) one-hot (with its gradient in
        training), ``probs`` their probabilities. ``sparse`` is then "not in mode 0" (the MSR of K
        modes: the share of heads not in the first, retrieval mode) and ``prob_sparse`` its probability."""
        return cls(sparse=1 - modes[..., 0], prob_sparse=1 - probs[..., 0], logits=logits,
                   host=None if index_host is None else (index_host != 0).float(),
                   modes=modes, probs=probs, index_host=index_host)

    @property
    def num_modes(self) -> int:
        return 2 if self.modes is None else int(self.modes.shape[-1])

    def one_hot(self) -> torch.Tensor:
        """(B, Hkv, K) each head's mode as a one-hot row (two modes: ``[1 - sparse, sparse]``), with
        the decision's gradient."""
        if self.modes is not None:
            return self.modes
        return torch.stack([1 - self.sparse, self.sparse], dim=-1)

    def index(self) -> torch.Tensor:
        """(B, Hkv) int64: each head's mode (0: the retrieval mode)."""
        if self.modes is None:
            return (self.sparse.detach() > 0.5).long()
        return self.modes.detach().argmax(-1)

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
    """Decides, per input and per (routed layer, KV head), retrieval mode vs sparse mode (or, with
    ``heads.num_modes`` K >= 3, one of K modes: :meth:`RouterDecision.of_modes`).

    One router instance serves every routed layer of a model (``layer`` below is the position
    in ``heads.routed_layers``). Learned routers hold their parameters as ordinary
    ``nn.Module`` parameters: they are the only parameters an elastic model trains and saves.
    ``decide`` gets the layer's start-aligned key states (B, Hkv, Sk, D) — exactly what the
    attention kernel sees, or the same keys before the rotary embedding where the router says so
    (:attr:`reads_unrotated_keys`) — and the batch's :class:`SeqInfo`.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[RouterConfig]]
    #: whether the router decides among K >= 3 modes (``heads.num_modes``); ``False``: construction with
    #: more than two modes is refused
    routes_k_modes: ClassVar[bool] = False

    @property
    def reads_unrotated_keys(self) -> bool:
        """Whether :meth:`decide` gets the keys with the rotary position embedding undone
        (:mod:`elasticfw.model.rotary`) instead of as attention sees them (default)."""
        return False

    def __init__(self, config: RouterConfig, heads: HeadLayout) -> None:
        super().__init__()
        if heads.num_modes > 2 and not self.routes_k_modes:
            raise UnsupportedInputError(
                f"router {self.name!r} decides between two modes only, and elastic.modes gives {heads.num_modes}; "
                "use a router that takes K modes (mlp, static, fixed) or give two modes"
            )
        self.config = config
        self.heads = heads
        self.progress = 0.0  # training progress in [0, 1], drives temperature schedules
        self._noise: torch.Tensor | None = None  # preset Gumbel noise (B, L_routed, Hkv, K), see set_noise

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
        """Preset the Gumbel noise of the next forwards: (B, L_routed, Hkv, K), one row per sample
        (:func:`elasticfw.routing.gumbel.sample_noise`), or ``None`` to draw fresh noise. The
        trainer sets it so a sample's routing noise does not depend on batching or resumption."""
        want = (self.heads.num_routed, self.heads.num_kv_heads, self.heads.num_modes)
        if noise is not None and tuple(noise.shape[1:]) != want:
            raise ElasticError(
                f"router noise must be (batch, {', '.join(map(str, want))}), got {tuple(noise.shape)}"
            )
        self._noise = noise

    def preset_noise(self, layer: int, logits: torch.Tensor) -> torch.Tensor | None:
        """The preset noise of routed layer ``layer`` for ``logits`` (B, Hkv, K), or ``None``."""
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
