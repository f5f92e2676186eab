"""Fixed router: an explicit, input-independent assignment of KV heads.

For baselines: all heads on the retrieval mode (plain full attention), all heads on the sparse
mode (e.g. an XAttention-only or streaming-only model), an explicit head list, or (any number of
modes, ``elastic.modes``) each head's mode index.
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
    assign: Literal["all_retrieval", "all_sparse", "sparse_heads", "retrieval_heads", "mode_heads"] = Field(
        "all_retrieval",
        description="all_retrieval, all_sparse, an explicit list in sparse_heads / retrieval_heads, or (any "
        "number of modes) mode_heads: each head's mode index in head_modes, default_mode for the others.",
    )
    heads: list[tuple[int, int]] = Field(
        default_factory=list,
        description="(layer, kv_head) pairs for assign sparse_heads / retrieval_heads; layer is the absolute index.",
    )
    head_modes: list[tuple[int, int, int]] = Field(
        default_factory=list,
        description="assign mode_heads: (layer, kv_head, mode) triples, mode an index into elastic.modes "
        "(0: the first); layer is the absolute index.",
    )
    default_mode: int = Field(0, ge=0, description="assign mode_heads: the mode index of heads head_modes does not list.")

    @model_validator(mode="after")
    def _heads_only_with_lists(self) -> FixedConfig:
        if self.assign.startswith("all_") and self.heads:
            raise ValueError(f"heads is only used with assign sparse_heads or retrieval_heads, not {self.assign!r}")
        if self.assign == "mode_heads" and self.heads:
            raise ValueError("heads is not used with assign mode_heads: list (layer, kv_head, mode) in head_modes")
        if self.assign != "mode_heads" and (self.head_modes or self.default_mode):
            raise ValueError(f"head_modes and default_mode are only used with assign mode_heads, not {self.assign!r}")
        return self


class FixedRouter(Router):
    """Explicit head assignment (no parameters, no input dependence)."""

    name = "fixed"
    config_class = FixedConfig
    config: FixedConfig
    routes_k_modes = True  # assign mode_heads: any number of modes
    table: torch.Tensor  # (routed layers, Hkv) buffer: 1.0 sparse, 0.0 retrieval

    def __init__(self, config: FixedConfig, heads: HeadLayout) -> None:
        super().__init__(config, heads)
        k = heads.num_modes
        if k > 2 and config.assign not in ("all_retrieval", "mode_heads"):
            raise UnsupportedInputError(
                f"elastic.router.assign = {config.assign!r} names the two-mode split and elastic.modes has {k} modes; "
                "use assign: mode_heads with head_modes [(layer, kv_head, mode), ...] (or all_retrieval)"
            )
        #: (routed layers, Hkv) int64 buffer: each head's mode index
        self.register_buffer("mode_index", self._mode_table(config, heads), persistent=False)
        if k > 2:
            one_hot = torch.nn.functional.one_hot(self.mode_index, k).float()
            self.register_buffer("one_hot", one_hot, persistent=False)
            self._host_index = HostCopy()
        table = torch.zeros(heads.num_routed, heads.num_kv_heads)
        if config.assign == "mode_heads":  # (two modes: the sparse heads are those of mode 1)
            table = (self.mode_index == 1).float()
        elif config.assign == "all_sparse":
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

    @staticmethod
    def _mode_table(config: FixedConfig, heads: HeadLayout) -> torch.Tensor:
        index = torch.zeros(heads.num_routed, heads.num_kv_heads, dtype=torch.long)
        if config.assign != "mode_heads":
            return index
        k = heads.num_modes
        if config.default_mode >= k:
            raise UnsupportedInputError(
                f"elastic.router.default_mode = {config.default_mode}: expected a mode index in [0, {k})"
            )
        index.fill_(config.default_mode)
        routed = {layer: i for i, layer in enumerate(heads.routed_layers)}
        for n, (layer, head, mode) in enumerate(config.head_modes):
            if layer not in routed or not 0 <= head < heads.num_kv_heads or not 0 <= mode < k:
                raise UnsupportedInputError(
                    f"elastic.router.head_modes[{n}] = ({layer}, {head}, {mode}): expected a routed layer in "
                    f"{list(heads.routed_layers)}, a KV head in [0, {heads.num_kv_heads}) and a mode in [0, {k})"
                )
            index[routed[layer], head] = mode
        return index

    def decide(self, layer: int, keys: torch.Tensor, seq: SeqInfo) -> RouterDecision:
        if self.heads.num_modes > 2:
            batch = keys.shape[0]
            modes = self.one_hot[layer].to(keys.device)[None].expand(batch, -1, -1)
            host = self._host_index(self.mode_index)[layer][None].expand(batch, -1)
            return RouterDecision.of_modes(modes, modes, index_host=host)
        return RouterDecision.constant(self.table[layer], keys.shape[0], keys.device, host_row=self._host(self.table)[layer])
