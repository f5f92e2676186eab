"""What the attention benchmark runs, from its arguments: the registered modes with ``--set``
overrides, the flex executor's config from ``--implementation`` and ``--flex-set``, and the
Elastic Attention hybrid (the first KV heads full, the rest in a sparse mode)."""

from __future__ import annotations

import argparse
from typing import Any

import torch
import yaml

from elasticfw.attention.layout import BlockLayout, causal_layout, select_heads
from elasticfw.attention.mode import AttentionMode
from elasticfw.attention.seq import SeqInfo
from elasticfw.registry import get_registry

__all__ = ["bench_modes", "flex_config", "hybrid", "hybrid_heads", "inner_flex"]


def flex_config(args: argparse.Namespace) -> dict[str, Any]:
    """The flex executor's config from ``--implementation`` and ``--flex-set FIELD=VALUE`` items."""
    config: dict[str, Any] = {"implementation": args.implementation}
    for item in getattr(args, "flex_set", None) or []:
        field, sep, raw = item.partition("=")
        if not (sep and field):
            raise SystemExit(f"--flex-set {item!r}: expected FIELD=VALUE, e.g. kernel_block_size=64")
        config[field] = yaml.safe_load(raw)
    return config


def inner_flex(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """``{"flex": ...}`` for an executor whose config nests flex options (split's sparse path), so
    that ``--flex-set`` reaches it too; ``{}`` without ``--flex-set`` or such a field."""
    fields = get_registry().entry("executor", name).config_class.model_fields  # type: ignore[union-attr]
    if not getattr(args, "flex_set", None) or "flex" not in fields:
        return {}
    return {"flex": {k: v for k, v in flex_config(args).items() if k != "implementation"}}


def bench_modes(args: argparse.Namespace) -> list[AttentionMode]:
    registry = get_registry()
    names = registry.names("sparse_mode") if not args.modes else args.modes
    overrides: dict[str, dict[str, Any]] = {}
    for item in args.set or []:
        key, sep, raw = item.partition("=")
        name, dot, field = key.partition(".")
        if not (sep and dot and field):
            raise SystemExit(f"--set {item!r}: expected MODE.FIELD=VALUE, e.g. moba.query_granularity=block")
        overrides.setdefault(name, {})[field] = yaml.safe_load(raw)
    out = []
    for name in names:
        entry = registry.entry("sparse_mode", name)
        config = entry.config_class.model_validate({"name": name, **overrides.get(name, {})})  # type: ignore[union-attr]
        out.append(entry.cls(config))
    return out


def hybrid_heads(seq: SeqInfo, hq: int, hkv: int, msr: float) -> torch.Tensor:
    """(B, Hq) bool, True on the sparse heads: all but the first ``round((1 - msr) * hkv)`` KV heads."""
    n_full = int(round((1.0 - msr) * hkv))
    group = hq // hkv
    return (torch.arange(hq, device=seq.device) // group >= n_full)[None, :].expand(seq.batch, hq)


def hybrid(sparse: BlockLayout, seq: SeqInfo, hq: int, hkv: int, msr: float) -> BlockLayout:
    """First ``round((1 - msr) * hkv)`` KV heads full (causal), the rest ``sparse`` (per query head)."""
    full = causal_layout(seq, sparse.block_size)
    return select_heads(~hybrid_heads(seq, hq, hkv, msr), full, sparse)
