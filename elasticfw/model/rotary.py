"""The key states before the rotary position embedding, for routers that pool them.

transformers hands the attention function keys *after* the rotary embedding (RoPE): key ``j`` is
rotated by an angle proportional to its absolute position. The LM's attention scores depend only
on relative positions, but a router that averages keys over a window sees vectors that turn with
the window's absolute position: the same question at the end of a 1K-token and of a 2.5K-token
prompt pools to different vectors. A router that declares :attr:`Router.reads_unrotated_keys`
gets the keys with the rotation undone instead, which depend on the tokens' content (and their
relative context) alone.

transformers computes the rotation once per forward, as ``position_embeddings = (cos, sin)``
given to every attention module, and applies ``k * cos + rotate_half(k) * sin`` (the half-split
convention of every Llama-family backbone). :class:`RotaryCapture` keeps each attention module's
``(cos, sin)`` through a forward pre-hook; :func:`unrotate` inverts the rotation exactly, scaled
rotations (``attention_scaling`` != 1) included.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from elasticfw.errors import UnsupportedInputError


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' half-split rotation: (x1, x2) -> (-x2, x1) over the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def unrotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``keys`` (B, H, S, D) rotated as ``k * cos + rotate_half(k) * sin`` with ``cos``/``sin``
    (B or 1, S, D), back to ``k`` (in float32). Per pair of dimensions (i, i + D/2) the rotation is
    ``a`` times an orthogonal one (``a`` = cos² + sin², 1 unless the embedding scales it), so
    ``(k' * cos - rotate_half(k') * sin) / (cos² + sin²)`` inverts it."""
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[-1] != keys.shape[-1] or cos.shape[-2] != keys.shape[-2]:
        raise UnsupportedInputError(
            f"the rotary embedding's cos/sin of shape {tuple(cos.shape)} / {tuple(sin.shape)} do not cover keys of "
            f"shape {tuple(keys.shape)} (batch, heads, tokens, head dim): elasticfw can undo a rotary embedding that "
            "rotates every dimension of every new key (no partial rotary)"
        )
    c, s = cos.float()[:, None], sin.float()[:, None]
    k = keys.float()
    return (k * c - rotate_half(k) * s) / (c * c + s * s)


class RotaryCapture:
    """Keeps the ``position_embeddings`` (cos, sin) each attention module is called with, by a forward
    pre-hook on each, until :meth:`remove`. ``latest[i]`` is attention module ``i``'s pair of its current
    call, until :meth:`pair` takes it (the layers of one forward share the tensors; nothing is copied)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.latest: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._handles = [
            module.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, module in enumerate(modules)
        ]

    def _hook(self, index: int):
        def keep(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            pair = kwargs.get("position_embeddings")
            self.latest[index] = tuple(pair) if isinstance(pair, (tuple, list)) and len(pair) == 2 else None
        return keep

    def pair(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention module ``layer_idx``'s (cos, sin) of its current call, handed over once (not kept
        alive beyond it: each is (batch, tokens, head dim), large at long prompts)."""
        pair = self.latest.pop(layer_idx, None)
        if pair is None:
            raise UnsupportedInputError(
                f"layer {layer_idx}: the router pools keys before the rotary embedding (router.pool_keys = "
                "'unrotated'), but this attention module was not given the rotary embedding's cos/sin as "
                "`position_embeddings`; this backbone has no rotary embedding elasticfw can undo: use "
                "router.pool_keys = 'rotated'"
            )
        return pair

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.latest.clear()
