"""Validation of attention inputs: the one place every executor and mode checks what it is given.

Plugins do not call these functions themselves: :class:`~elasticfw.attention.executor.Executor`
wraps every subclass's ``attend`` (through :meth:`~elasticfw.attention.executor.Executor.
check_inputs`), :class:`~elasticfw.attention.mode.AttentionMode` every subclass's ``side_branch``,
and ``AttentionMode.attend`` checks its inputs against the executor before it builds a layout (the
data-dependent modes' ``build_layout`` also call :meth:`~elasticfw.attention.seq.SeqInfo.check`).
So a bad call raises :class:`~elasticfw.errors.UnsupportedInputError` before any torch kernel runs,
whichever plugin it reaches. The checks read tensor metadata (shapes, dtypes, devices) and, for a
layout, the number of query blocks (one host read of ``seq.q_start``); the values of ``seq`` are
checked once, when the :class:`~elasticfw.attention.seq.SeqInfo` is built. :func:`check_qkv`
(q, k and v against a ``SeqInfo``) is defined beside ``SeqInfo`` in :mod:`elasticfw.attention.seq`,
which this module builds on, and is importable from here too.

Every message names the argument, what it was (shape, device, dtype or value) and what was
expected, e.g.::

    executor 'flex': argument 'k' (shape (1, 2, 8, 16), device meta, dtype torch.float32) must be
    on the device of q (cpu)
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from elasticfw.attention.layout import BlockLayout
from elasticfw.attention.seq import SeqInfo, check_qkv, describe  # check_qkv, describe: re-exported
from elasticfw.errors import UnsupportedInputError


class _NotGiven:
    """Marks an argument a check was not asked to check (``None`` is a value to reject)."""

    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()


def _fail(context: str, name: str, value: Any, expected: str) -> UnsupportedInputError:
    return UnsupportedInputError(f"{context}: argument {name!r} ({describe(value)}) {expected}")


def check_scale(scale: Any, *, context: str = "attention") -> None:
    """Raise unless ``scale`` is a finite positive real number (a Python or NumPy scalar)."""
    ok = isinstance(scale, numbers.Real) and not isinstance(scale, bool)
    if ok:
        try:
            value = float(scale)
        except OverflowError:  # an int beyond float range
            value = math.inf
        ok = math.isfinite(value) and value > 0
    if not ok:
        text = repr(scale)
        raise UnsupportedInputError(
            f"{context}: argument 'scale' ({type(scale).__name__} {text[:80]}) must be a finite positive float "
            "(e.g. head_dim ** -0.5)"
        )


def check_layout(layout: Any, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, *, context: str = "attention") -> None:
    """Raise unless ``layout`` is a :class:`BlockLayout` over ``seq``'s block grid with 1, Hkv or
    Hq heads and a batch of 1 or B, on the device of q. Call after :func:`check_qkv`."""
    if not isinstance(layout, BlockLayout):
        raise _fail(context, "layout", layout, "must be an elasticfw.attention.layout.BlockLayout")
    blocks = layout.blocks
    batch, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
    bs = layout.block_size
    expected_grid = (seq.num_query_blocks(bs), seq.num_key_blocks(bs))
    problems = []
    if blocks.shape[0] not in (1, batch):
        problems.append(f"a batch of 1 or {batch}")
    if blocks.shape[1] not in (1, hkv, hq):
        problems.append(f"1, {hkv} (KV) or {hq} (query) heads")
    if tuple(blocks.shape[2:]) != expected_grid:
        problems.append(
            f"{expected_grid[0]} query blocks x {expected_grid[1]} key blocks (block size {bs} over seq's "
            f"q_len {seq.q_len}, kv_capacity {seq.kv_capacity})"
        )
    if blocks.device != q.device or (layout.partial is not None and layout.partial.device != q.device):
        problems.append(f"the device of q ({q.device})")
    if problems:
        raise UnsupportedInputError(
            f"{context}: argument 'layout' (blocks of shape {tuple(blocks.shape)}, device {blocks.device}, "
            f"block size {bs}) must have " + "; ".join(problems)
        )


def check_dtype_supported(q: torch.Tensor, dtypes: tuple[torch.dtype, ...], *, who: str) -> None:
    """Raise unless ``q.dtype`` is one of ``dtypes`` (k and v follow q, see :func:`check_qkv`)."""
    if q.dtype not in dtypes:
        raise UnsupportedInputError(
            f"{who} supports dtypes {[str(d) for d in dtypes]}, got {q.dtype} for argument 'q' ({describe(q)})"
        )


def check_attention_inputs(
    q: Any,
    k: Any,
    v: Any,
    seq: Any,
    *,
    scale: Any = NOT_GIVEN,
    layout: Any = NOT_GIVEN,
    dtypes: tuple[torch.dtype, ...] | None = None,
    context: str = "attention",
) -> None:
    """All checks of one attention call: :func:`check_qkv`, the dtype among ``dtypes`` (when
    given), and :func:`check_scale` and :func:`check_layout` unless ``scale`` / ``layout`` are
    :data:`NOT_GIVEN` (``None`` is checked, and rejected)."""
    check_qkv(q, k, v, seq, context=context)
    if dtypes is not None:
        check_dtype_supported(q, dtypes, who=context)
    if scale is not NOT_GIVEN:
        check_scale(scale, context=context)
    if layout is not NOT_GIVEN:
        check_layout(layout, q, k, seq, context=context)
