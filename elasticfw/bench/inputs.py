"""Benchmark inputs with the structure of a real model's attention: sinks, locality, recurring topics.

Random Gaussian q/k make every key block equally important, so a data-dependent mode keeps nearly
everything and its timing says nothing about the work it skips on real inputs.
:func:`structured_qkv` builds q/k with attention sinks (``sink_tokens`` keys every query attends
to), RoPE locality (a per-KV-head content vector rotated with Llama-3 frequencies) and recurring
topics (segments sharing one of ``topics`` directions), plus unit Gaussian noise, and Gaussian v.
Everything is generated on the CPU from ``seed`` in float32 and then cast, so a benchmark JSON
that records the parameters (:func:`describe`) can be reproduced. The construction and what the
defaults give: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

__all__ = ["InputStructure", "describe", "random_qkv", "structured_qkv"]


@dataclass(frozen=True)
class InputStructure:
    """The parameters of :func:`structured_qkv` (logits are after the ``1/sqrt(d)`` scale)."""

    sink_tokens: int = 4
    sink_logit: float = 11.0
    local_logit: float = 6.0
    topic_logit: float = 4.0
    topics: int = 16
    segment_tokens: int = 1024
    rope_base: float = 500000.0
    noise: float = 1.0


def describe(structure: InputStructure | None) -> dict:
    """JSON-ready description of the inputs a benchmark used."""
    if structure is None:
        return {"kind": "random", "note": "standard Gaussian q, k, v"}
    return {"kind": "structured", "generator": "elasticfw.bench.inputs.structured_qkv", **asdict(structure)}


def random_qkv(
    batch: int, q_heads: int, kv_heads: int, seq: int, dim: int, *, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standard Gaussian q (B, Hq, S, D), k and v (B, Hkv, S, D), float32 on the CPU."""
    q = torch.randn(batch, q_heads, seq, dim, generator=generator)
    k = torch.randn(batch, kv_heads, seq, dim, generator=generator)
    v = torch.randn(batch, kv_heads, seq, dim, generator=generator)
    return q, k, v


def _rotate(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE (rotate-half convention, as transformers' Llama) of x (..., S, D) at ``positions`` (S,)."""
    dim = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.double()[:, None] * inv_freq[None, :]  # (S, D/2)
    cos = torch.cat([angles.cos(), angles.cos()], -1).float()
    sin = torch.cat([angles.sin(), angles.sin()], -1).float()
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def structured_qkv(
    batch: int,
    q_heads: int,
    kv_heads: int,
    seq: int,
    dim: int,
    *,
    structure: InputStructure | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, Hq, S, D), k and v (B, Hkv, S, D), float32 on the CPU, with sinks, locality and
    recurring topics (module docstring). ``dim`` must be even (RoPE pairs)."""
    st = structure or InputStructure()
    if dim % 2 or dim < 4:
        raise ValueError(f"structured_qkv: head dim must be even and >= 4 (RoPE pairs), got {dim}")
    if q_heads % kv_heads:
        raise ValueError(f"structured_qkv: {q_heads} query heads are not a multiple of {kv_heads} KV heads")
    if st.segment_tokens < 1 or st.topics < 1 or st.sink_tokens < 0:
        raise ValueError(f"structured_qkv: segment_tokens and topics must be >= 1, sink_tokens >= 0: {st}")
    g = torch.Generator().manual_seed(seed)
    group = q_heads // kv_heads
    root = math.sqrt(math.sqrt(dim))  # a component of norm r on both q and k gives logit r^2 / sqrt(d)
    half = dim // 2
    # the sink direction: the lowest-frequency RoPE pair (coordinates half-1 and dim-1), barely rotating
    sink_dir = torch.zeros(dim)
    sink_dir[half - 1] = sink_dir[dim - 1] = math.sqrt(0.5)
    free = torch.ones(dim)
    free[half - 1] = free[dim - 1] = 0.0

    def unit(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, dim, generator=g) * free
        return x / x.norm(dim=-1, keepdim=True)

    positions = torch.arange(seq)
    content = unit(batch, kv_heads, 1) * (math.sqrt(st.local_logit) * root)  # (B, Hkv, 1, D)
    local = _rotate(content.expand(batch, kv_heads, seq, dim), positions, st.rope_base)
    topic_dirs = unit(batch, kv_heads, st.topics) * (math.sqrt(st.topic_logit) * root)  # (B, Hkv, T, D)
    n_seg = math.ceil(seq / st.segment_tokens)
    seg_topic = torch.randint(0, st.topics, (batch, kv_heads, n_seg), generator=g)
    per_token = seg_topic.repeat_interleave(st.segment_tokens, dim=-1)[..., :seq]  # (B, Hkv, S)
    topic = topic_dirs.gather(2, per_token[..., None].expand(batch, kv_heads, seq, dim))
    shared = local + topic  # (B, Hkv, S, D), the part a GQA group's queries and its keys share

    k = shared + st.noise * torch.randn(batch, kv_heads, seq, dim, generator=g)
    if st.sink_tokens:
        k[:, :, : st.sink_tokens] += sink_dir * (math.sqrt(st.sink_logit) * root)
    q = shared.repeat_interleave(group, dim=1) + st.noise * torch.randn(batch, q_heads, seq, dim, generator=g)
    q = q + sink_dir * (math.sqrt(st.sink_logit) * root)
    v = torch.randn(batch, kv_heads, seq, dim, generator=g)
    return q, k, v
