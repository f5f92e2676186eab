"""Static router: one learnable gate per (layer, KV head), independent of the input.

The DuoAttention (arXiv 2410.10819) / PruLong (Bhaskar et al., 2025, "Cache me if you can") family of
baselines: the gate is trained (here with the same Gumbel-sigmoid straight-through relaxation
as the elastic router, so the comparison isolates input dependence) and then frozen into a
per-head assignment that every input shares.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from elasticfw.attention.seq import SeqInfo
from elasticfw.routing.base import HeadLayout, Router, RouterConfig, RouterDecision
from elasticfw.routing.gumbel import (
    TemperatureSchedule,
    gumbel_softmax_sparse_prob,
    initial_bias,
    k_mode_decision,
    straight_through,
)


class StaticConfig(RouterConfig):
    name: Literal["static"] = "static"
    init_sparse_prob: float = Field(0.5, gt=0.0, lt=1.0, description="Initial probability of the sparse mode.")
    tau_init: float = Field(1.0, gt=0, description="Initial Gumbel temperature.")
    tau_min: float = Field(0.3, gt=0, description="Temperature floor.")
    tau_rate: float = Field(0.6, ge=0, description="Decay rate r of tau(p) = max(tau_min, tau_init exp(-r p)).")
    tau_units: float = Field(10.0, gt=0, description="p at the end of training (p = progress * tau_units).")


class StaticRouter(Router):
    """One input-independent learnable gate per (layer, KV head): K logits among K modes."""

    name = "static"
    config_class = StaticConfig
    config: StaticConfig
    routes_k_modes = True  # K gates per head (logits (L, Hkv, K))

    def __init__(self, config: StaticConfig, heads: HeadLayout) -> None:
        super().__init__(config, heads)
        p = config.init_sparse_prob
        if heads.num_modes == 2:
            logit = torch.log(torch.tensor(p / (1 - p)))
            init = torch.zeros(heads.num_routed, heads.num_kv_heads, 2)
            init[..., 1] = logit
        else:  # P(mode 0) = 1 - p, the other modes share p
            init = initial_bias(p, heads.num_modes).expand(heads.num_routed, heads.num_kv_heads, -1).clone()
        self.logits = nn.Parameter(init)
        self.schedule = TemperatureSchedule(config.tau_init, config.tau_min, config.tau_rate, config.tau_units)

    def decide(self, layer: int, keys: torch.Tensor, seq: SeqInfo) -> RouterDecision:
        logits = self.logits[layer][None].expand(keys.shape[0], -1, -1)
        if self.heads.num_modes > 2:
            tau = self.schedule(self.progress)
            return k_mode_decision(logits, self.training, tau, self.preset_noise(layer, logits))
        if self.training:
            prob = gumbel_softmax_sparse_prob(
                logits, self.schedule(self.progress), noise=True, gumbel=self.preset_noise(layer, logits)
            )
            return RouterDecision(straight_through(prob), prob, logits)
        prob = torch.softmax(logits.float(), dim=-1)[..., 1]
        return RouterDecision((prob > 0.5).float(), prob, logits)
