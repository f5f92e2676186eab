"""The Elastic Attention router (arXiv 2601.17367, §3.1, App. D.1 and F).

Per routed layer, head-agnostic weights applied to every KV head:

1. boundary pooling: mean of the key states of the first ``pool_tokens`` and the last
   ``pool_tokens`` real tokens of each sequence (their union when the sequence is shorter
   than 2 x pool_tokens; padding never enters), giving x'_K in R^{H x d'};
2. task MLP d' -> 4d' -> d' (SiLU), router MLP d' -> 4d' -> d' -> 2 (SiLU) -> logits z;
3. training: Gumbel-softmax at temperature tau(progress), hard decision with a
   straight-through gradient; inference: no noise, arg max.

About 0.27M parameters per layer at d' = 128, as in the paper.

``pool_keys: unrotated`` (not in the paper; off by default) pools the keys with the rotary
position embedding undone (:mod:`elasticfw.model.rotary`): the keys attention sees are rotated by
their absolute position, so a window's mean, and the routing, changes with the prompt's length.

``input_norm: standardize`` (not in the paper; off by default) subtracts from each pooled vector
the running mean of its (layer, KV head) and divides by that pair's running scale, statistics
kept as buffers (saved with the adapter), updated in training and frozen at inference. The pooled
keys of one head differ little between inputs next to how much heads differ (on the default
model: cosine 0.97-0.99 between the task means), so without it the head-agnostic MLP learns a
per-head assignment and saturates before it can read the input; see
``docs/explanation/routing-and-training.md``.

At inference the eager path costs the dispatch of about eleven small operations per layer. The
``kernel`` field selects instead one fused Triton kernel per layer
(:mod:`elasticfw_plugins.routers.mlp_fused`): pooling, both MLPs, softmax and the decision in one
launch, when the keys take the pooling fast path (no padding, Sk >= 2 x pool_tokens). Training
always runs the eager operations, which autograd differentiates.
"""

from __future__ import annotations

from typing import Any, Literal, NoReturn, cast

import torch
from pydantic import Field
from torch import nn
from torch.nn import functional as F

from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError, UnsupportedInputError
from elasticfw.kernels import triton_unavailable
from elasticfw.routing.base import HeadLayout, Router, RouterConfig, RouterDecision
from elasticfw.routing.gumbel import (
    TemperatureSchedule,
    gumbel_softmax_sparse_prob,
    initial_bias,
    k_mode_decision,
    straight_through,
)

#: :mod:`elasticfw_plugins.routers.mlp_fused` once imported (it imports Triton): a module global, not a
#: router attribute, so that a router stays deep-copyable and picklable after a fused decision
_FUSED: list[Any] = []


def _fused_kernels() -> Any:
    """The fused kernel module, imported on first use."""
    if not _FUSED:
        from elasticfw_plugins.routers import mlp_fused

        _FUSED.append(mlp_fused)
    return _FUSED[0]


class MLPRouterConfig(RouterConfig):
    name: Literal["mlp"] = "mlp"
    pool_tokens: int = Field(100, ge=1, description="Boundary pooling: first and last N tokens (paper: 100).")
    hidden_mult: int = Field(4, ge=1, description="Hidden width of both MLPs, in multiples of head_dim (paper: 4).")
    init_sparse_prob: float = Field(0.5, gt=0.0, lt=1.0, description="Initial probability of the sparse mode.")
    tau_init: float = Field(1.0, gt=0, description="Initial Gumbel temperature (authors' code: clamp to [0.3, 1]).")
    tau_min: float = Field(0.3, gt=0, description="Temperature floor.")
    tau_rate: float = Field(0.6, ge=0, description="Decay rate r of tau(p) = max(tau_min, tau_init exp(-r p)) (paper: 0.6).")
    tau_units: float = Field(10.0, gt=0, description="p at the end of training (p = progress * tau_units).")
    input_norm: Literal["none", "standardize"] = Field(
        "none",
        description=(
            "none: the pooled keys enter the task MLP as they are (paper). standardize: minus the running mean "
            "of their (layer, KV head), divided by that pair's running scale (root mean variance over the head "
            "dimension); the statistics are updated in training, frozen at inference and saved with the adapter."
        ),
    )
    norm_momentum: float = Field(
        0.01, gt=0, le=1,
        description="input_norm statistics: a cumulative average over the first 1/momentum samples, then an "
        "exponential moving average with this weight per sample.",
    )
    pool_keys: Literal["rotated", "unrotated"] = Field(
        "rotated",
        description=(
            "Which key states are pooled. rotated: as attention sees them, after the rotary position embedding "
            "(paper); their window means turn with the windows' absolute positions, so one question routes "
            "differently at the end of a longer prompt. unrotated: the same keys with the rotation undone "
            "(content only), which makes the routing independent of where the pooled tokens sit."
        ),
    )
    kernel: Literal["auto", "eager", "triton"] = Field(
        "auto",
        description=(
            "Inference path (training is always eager). eager: one PyTorch operation at a time. triton: "
            "one fused Triton kernel per layer (pooling, both MLPs, decision), an error if Triton cannot run "
            "on the keys' device; keys with padding or Sk < 2 x pool_tokens are pooled eagerly, then the "
            "fused kernel runs the rest; its results carry no autograd history. auto: triton for CUDA keys "
            "on the pooling fast path when Triton is usable and autograd would not record, else eager."
        ),
    )


def pool_fast_path(keys: torch.Tensor, seq: SeqInfo, pool_tokens: int) -> bool:
    """Whether every sample's first and last ``pool_tokens`` keys are the two ends of ``keys``:
    no padding and Sk >= 2 x pool_tokens (no gather needed)."""
    sk = keys.shape[2]
    return sk >= 2 * pool_tokens and sk == seq.kv_capacity and seq.keys_unpadded()


def boundary_pool(keys: torch.Tensor, seq: SeqInfo, pool_tokens: int) -> torch.Tensor:
    """(B, H, Sk, D) start-aligned keys -> (B, H, D) mean over the first and last N real tokens.

    Only those (at most 2N) tokens are read, so the cost does not grow with the sequence.
    """
    batch, heads, sk, dim = keys.shape
    if pool_fast_path(keys, seq, pool_tokens):  # no padding, no gather
        # the first and last N tokens as one (B, H, 2, N, D) strided view of ``keys``: one reduction
        s0, s1, s2, s3 = keys.stride()
        ends = keys.as_strided(
            (batch, heads, 2, pool_tokens, dim), (s0, s1, (sk - pool_tokens) * s2, s2, s3), keys.storage_offset()
        )
        return ends.sum((2, 3), dtype=torch.float32).div_(2 * pool_tokens)
    n = seq.kv_len.to(keys.device)[:, None]  # (B, 1)
    offs = torch.arange(pool_tokens, device=keys.device)[None, :]
    first = offs.expand(batch, -1)
    last = n - pool_tokens + offs
    valid = torch.cat([first < n, last >= pool_tokens], dim=1)  # a token in both windows counts once
    idx = torch.cat([first, last], dim=1).clamp(0, max(sk - 1, 0))
    weights = valid.to(torch.float32)
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1.0)
    picked = keys.gather(2, idx[:, None, :, None].expand(batch, heads, idx.shape[1], dim))
    return torch.einsum("bhnd,bn->bhd", picked.float(), weights)


class _LayerRouter(nn.Module):
    def __init__(self, dim: int, mult: int, modes: int = 2) -> None:
        super().__init__()
        hidden = mult * dim
        self.task_mlp = nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, dim))
        self.router_mlp = nn.Sequential(
            nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, dim), nn.SiLU(), nn.Linear(dim, modes)
        )

    def kernel_params(self) -> tuple[torch.Tensor, ...]:
        """The ten weights and biases in the fused kernel's order (task MLP, then router MLP),
        read through the module dictionaries: attribute lookup on modules costs microseconds."""
        task, router = self._modules["task_mlp"]._modules, self._modules["router_mlp"]._modules  # type: ignore[union-attr]
        out: list[torch.Tensor] = []
        for lin in (task["0"], task["2"], router["0"], router["2"], router["4"]):
            out += (lin._parameters["weight"], lin._parameters["bias"])  # type: ignore[union-attr, arg-type]
        return tuple(out)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        # the Sequentials' layers applied directly (same parameters and result): a router runs once
        # per layer per forward on a (B, H, d) input, so its cost is the dispatch of each operation
        t1, _, t2 = self.task_mlp
        r1, _, r2, _, r3 = self.router_mlp
        h = F.silu(F.linear(pooled, t1.weight, t1.bias), inplace=True)
        h = F.linear(h, t2.weight, t2.bias)
        h = F.silu(F.linear(h, r1.weight, r1.bias), inplace=True)
        h = F.silu(F.linear(h, r2.weight, r2.bias), inplace=True)
        return F.linear(h, r3.weight, r3.bias)


class InputStatistics(nn.Module):
    """Running per-(layer, KV head) statistics of the pooled keys, and the standardisation they
    define: ``(x - mean) / scale`` with ``scale = sqrt(mean over d of var + eps)``.

    Each update weighs the batch's samples as a cumulative average until ``1 / momentum`` samples
    have been seen, then as an exponential moving average (weight ``momentum`` per sample). Before
    its first update a layer's statistics (mean 0, E[x^2] 1) leave the input unchanged up to the
    1e-6 added to the variance."""

    mean: torch.Tensor
    sq: torch.Tensor
    count: torch.Tensor

    def __init__(self, layers: int, heads: int, dim: int, momentum: float) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("mean", torch.zeros(layers, heads, dim))
        self.register_buffer("sq", torch.ones(layers, heads, dim))  # running E[x^2]
        self.register_buffer("count", torch.zeros(layers))

    @torch.no_grad()
    def update(self, layer: int, pooled: torch.Tensor) -> None:
        """Fold a batch of pooled vectors (B, H, D) of routed layer ``layer`` into the statistics."""
        x = pooled.detach().float()
        seen = float(self.count[layer]) + x.shape[0]
        cap = 1.0 / self.momentum
        weight = x.shape[0] / seen if seen <= cap else 1.0 - (1.0 - self.momentum) ** x.shape[0]
        self.mean[layer].lerp_(x.mean(0), weight)
        self.sq[layer].lerp_((x * x).mean(0), weight)
        self.count[layer] = min(seen, cap)

    def scale(self, layer: int) -> torch.Tensor:
        """(H, 1) the root mean variance of each head's pooled features."""
        var = (self.sq[layer] - self.mean[layer] ** 2).clamp_min(0).mean(-1, keepdim=True)
        return (var + 1e-6).sqrt()

    def forward(self, layer: int, pooled: torch.Tensor) -> torch.Tensor:
        # (no host read: before any update the mean is 0 and E[x^2] is 1, so this is the identity)
        return (pooled - self.mean[layer].to(pooled.dtype)) / self.scale(layer).to(pooled.dtype)


class MLPRouter(Router):
    """Input-dependent router: boundary pooling + task MLP + router MLP + Gumbel/STE (K logits
    and a straight-through one-hot when routing among K >= 3 modes)."""

    name = "mlp"
    config_class = MLPRouterConfig
    config: MLPRouterConfig
    routes_k_modes = True

    def __init__(self, config: MLPRouterConfig, heads: HeadLayout) -> None:
        super().__init__(config, heads)
        k = heads.num_modes
        self.layers = nn.ModuleList(_LayerRouter(heads.head_dim, config.hidden_mult, k) for _ in heads.routed_layers)
        with torch.no_grad():
            for layer in self.layers:
                last = layer.router_mlp[-1]
                nn.init.normal_(last.weight, std=0.02)
                last.bias.copy_(initial_bias(config.init_sparse_prob, k))
        self.schedule = TemperatureSchedule(config.tau_init, config.tau_min, config.tau_rate, config.tau_units)
        #: per-(layer, head) statistics of the pooled keys (``input_norm: standardize``), else None
        self.input_stats = (
            InputStatistics(heads.num_routed, heads.num_kv_heads, heads.head_dim, config.norm_momentum)
            if config.input_norm == "standardize" else None
        )
        #: the fused kernel's verdict per (layer, key dtype, device, head dim, weight dtype, device): None = runs
        self._fused_reasons: dict[tuple, str | None] = {}

    @property
    def reads_unrotated_keys(self) -> bool:
        return self.config.pool_keys == "unrotated"

    def temperature(self) -> float:
        return self.schedule(self.progress)

    def decide(self, layer: int, keys: torch.Tensor, seq: SeqInfo) -> RouterDecision:
        # the ModuleList's dictionary: its indexing costs microseconds, and this runs once per layer
        module = self.layers._modules.get(str(layer))
        if module is None or keys.dim() != 4 or keys.shape[-1] != self.heads.head_dim:
            self._refuse(layer, keys)
        if not self.training and self.config.kernel != "eager":
            fused = self._fused_decide(layer, cast(_LayerRouter, module), keys, seq)
            if fused is not None:
                return fused
        pooled = self._features(layer, boundary_pool(keys, seq, self.config.pool_tokens))
        logits = module(pooled.to(module.task_mlp[0].weight.dtype))  # (B, H, K)
        if self.heads.num_modes > 2:
            return k_mode_decision(logits, self.training, self.temperature(), self.preset_noise(layer, logits))
        if self.training:
            prob = gumbel_softmax_sparse_prob(
                logits, self.temperature(), noise=True, gumbel=self.preset_noise(layer, logits)
            )
            return RouterDecision(straight_through(prob), prob, logits)
        # softmax over the two logits; arg max: sparse iff P(sparse) > 0.5 (a tie, and a NaN from
        # non-finite keys, go to the retrieval mode, as in the fused kernel)
        prob = torch.softmax(logits.float(), dim=-1)[..., 1]
        return RouterDecision((prob > 0.5).to(prob.dtype), prob, logits)

    def _features(self, layer: int, pooled: torch.Tensor) -> torch.Tensor:
        """The task MLP's input: the pooled keys, standardised under ``input_norm: standardize``
        (whose statistics a training forward updates first)."""
        stats = self.input_stats
        if stats is None:
            return pooled
        if self.training:
            stats.update(layer, pooled)
        return stats(layer, pooled)

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        return {
            "task_mlp": [p for layer in self.layers for p in layer.task_mlp.parameters()],
            "router_mlp": [p for layer in self.layers for p in layer.router_mlp.parameters()],
        }

    def _refuse(self, layer: int, keys: torch.Tensor) -> NoReturn:
        """The error for a ``decide`` call this router cannot take (a layer it has no weights for, keys
        not (B, Hkv, S, head dim) of its backbone's head dim)."""
        if not 0 <= layer < len(self.layers):
            raise UnsupportedInputError(
                f"router 'mlp': layer {layer} is not a routed layer's position (0 to {len(self.layers) - 1})"
            )
        raise UnsupportedInputError(
            f"router 'mlp': keys of shape {tuple(keys.shape)}, expected (batch, KV heads, tokens, "
            f"{self.heads.head_dim}): the router was built for head dim {self.heads.head_dim}"
        )

    def _fused_decide(
        self, layer: int, module: _LayerRouter, keys: torch.Tensor, seq: SeqInfo
    ) -> RouterDecision | None:
        if self.heads.num_modes > 2:  # the kernel computes two logits
            if self.config.kernel == "triton":
                raise BackendUnavailableError(
                    f"elastic.router.kernel = 'triton': the fused router kernel decides between two modes and "
                    f"elastic.modes has {self.heads.num_modes}; use kernel: auto or eager"
                )
            return None
        return self._fused_two_modes(layer, module, keys, seq)

    def _fused_two_modes(
        self, layer: int, module: _LayerRouter, keys: torch.Tensor, seq: SeqInfo
    ) -> RouterDecision | None:
        """The inference decision from the fused kernel, or ``None`` where ``kernel: auto`` keeps the
        eager path. ``kernel: triton`` raises when the kernel cannot run.

        This runs once per layer per forward and its host time is most of the router's cost on a GPU,
        so it reads tensor attributes that need no ``torch.device`` object (``is_cuda``,
        ``get_device``) and imports the kernel module once."""
        pool_tokens = self.config.pool_tokens
        pinned = self.config.kernel == "triton"
        params = module.kernel_params()
        weight = params[0]
        if not pinned and (not keys.is_cuda or (weight.requires_grad and torch.is_grad_enabled())):
            return None
        fast = pool_fast_path(keys, seq, pool_tokens)
        if not pinned and not fast:
            return None
        # whether the kernel takes these weights and keys: asked once per (layer, dtypes, devices, head dim)
        check = (id(module), keys.dtype, keys.is_cuda, keys.get_device(), keys.shape[-1], weight.dtype,
                 weight.is_cuda, weight.get_device())
        reason = self._fused_reasons.get(check, "")
        if reason == "":
            reason = triton_unavailable(keys.device)
            if reason is None:
                reason = _fused_kernels().unsupported(params, keys)
            self._fused_reasons[check] = reason
        if reason is not None:
            if not pinned:
                return None
            raise BackendUnavailableError(
                f"elastic.router.kernel = 'triton' but the fused router kernel cannot run here: {reason}; "
                "use kernel: auto (fused where it can run, else eager) or eager"
            )
        mlp_fused = _fused_kernels()
        if self.input_stats is not None:  # standardised features: pooled eagerly, then the fused MLPs
            hard, prob, logits = mlp_fused.fused_mlp(params, self._features(layer, boundary_pool(keys, seq, pool_tokens)))
        elif fast:
            hard, prob, logits = mlp_fused.fused_decide(params, keys, pool_tokens)
        else:  # padding or a short sequence: the eager gather pooling, then the fused MLPs and decision
            hard, prob, logits = mlp_fused.fused_mlp(params, boundary_pool(keys, seq, pool_tokens))
        return RouterDecision(hard, prob, logits)
