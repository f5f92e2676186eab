"""Fixed router: an explicit, input-independent assignment of KV heads.

For baselines: all heads on the retrieval mode (plain full attention), all heads on the sparse
mode (e.g. an XAttention-only or streaming-only model), or an explicit head list.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import UnsupportedInputError
from elasticfw.routing.base import HeadLayout, HostCopy, Router, RouterConfig, RouterDecision


class FixedConfig(RouterConfig):
    name: Literal["fixed"] = "fixed"
    assign: Literal["all_retrieval", "all_sparse", "sparse_heads", "retrieval_heads"] = Field(
        "all_retrieval",
        description="all_retrieval, all_sparse, or an explicit list in sparse_heads / retrieval_heads.",
    )
    heads: list[tuple[int, int]] = Field(
        default_factory=list,
        description="(layer, kv_head) pairs for assign sparse_heads / retrieval_heads; layer is the absolute index.",
    )

    @model_validator(mode="after")
    def _heads_only_with_lists(self) -> FixedConfig:
        if self.assign.startswith("all_") and self.heads:
            raise ValueError(f"heads is only used with assign sparse_heads or retrieval_heads, not {self.assign!r}")
        return self


class FixedRouter(Router):
    """Explicit head assignment (no parameters, no input dependence)."""

    name = "fixed"
    config_class = FixedConfig
    config: FixedConfig
    table: torch.Tensor  # (routed layers, Hkv) buffer: 1.0 sparse, 0.0 retrieval

    def __init__(self, config: FixedConfig, heads: HeadLayout) -> None:
        super().__init__(config, heads)
        table = torch.zeros(heads.num_routed, heads.num_kv_heads)
        if config.assign == "all_sparse":
            table.fill_(1.0)
        elif config.assign in ("sparse_heads", "retrieval_heads"):
            index = {layer: i for i, layer in enumerate(heads.routed_layers)}
            for n, (layer, head) in enumerate(config.heads):
                if layer not in index or not 0 <= head < heads.num_kv_heads:
                    raise UnsupportedInputError(
                        f"elastic.router.heads[{n}] = ({layer}, {head}): expected a routed layer in "
                        f"{list(heads.routed_layers)} and a KV head in [0, {heads.num_kv_heads})"
                    )
                table[index[layer], head] = 1.0
            if config.assign == "retrieval_heads":
                table = 1.0 - table
        self.register_buffer("table", table, persistent=False)
        self._host = HostCopy()  # the table on the CPU: the decisions' ``host``

    def decide(self, layer: int, keys: torch.Tensor, seq: SeqInfo) -> RouterDecision:
        return RouterDecision.constant(self.table[layer], keys.shape[0], keys.device, host_row=self._host(self.table)[layer])
