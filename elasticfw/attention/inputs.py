"""Validation of attention inputs: the one place every executor and mode checks what it is given.

Plugins do not call these functions themselves: :class:`~elasticfw.attention.executor.Executor`
wraps every subclass's ``attend`` (through :meth:`~elasticfw.attention.executor.Executor.
check_inputs`), :class:`~elasticfw.attention.mode.AttentionMode` every subclass's ``side_branch``,
and ``AttentionMode.attend`` checks its inputs against the executor before it builds a layout (the
data-dependent modes' ``build_layout`` also call :meth:`~elasticfw.attention.seq.SeqInfo.check`).
So a bad call raises :class:`~elasticfw.errors.UnsupportedInputError` before any torch kernel runs,
whichever plugin it reaches. The checks read tensor metadata (shapes, dtypes, devices) and, for a
layout, the number of query blocks (one host read of ``seq.q_start``); the values of ``seq`` are
checked once, when the :class:`~elasticfw.attention.seq.SeqInfo` is built.

Every message names the argument, what it was (shape, device, dtype or value) and what was
expected, e.g.::

    executor 'flex': argument 'k' (shape (1, 2, 8, 16), device meta, dtype torch.float32) must be
    on the device of q (cpu)
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any

import torch

from elasticfw.errors import UnsupportedInputError

if TYPE_CHECKING:
    from elasticfw.attention.seq import SeqInfo


class _NotGiven:
    """Marks an argument a check was not asked to check (``None`` is a value to reject)."""

    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()


def describe(t: Any) -> str:
    """``shape (..), device .., dtype ..`` of a tensor, or the type and repr of anything else."""
    if isinstance(t, torch.Tensor):
        return f"shape {tuple(t.shape)}, device {t.device}, dtype {t.dtype}"
    text = repr(t)
    return f"a {type(t).__name__}: {text[:80] + '...' if len(text) > 80 else text}"


def _fail(context: str, name: str, value: Any, expected: str) -> UnsupportedInputError:
    return UnsupportedInputError(f"{context}: argument {name!r} ({describe(value)}) {expected}")


def _check_tensor(context: str, name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(context, name, t, "must be a torch.Tensor of shape (batch, heads, seq, head_dim)")
    if t.layout != torch.strided:
        raise _fail(context, name, t, f"must be a dense (strided) tensor, not {t.layout}")
    if t.dim() != 4:
        raise _fail(context, name, t, f"must be 4-D (batch, heads, seq, head_dim), got {t.dim()}-D")
    if not t.dtype.is_floating_point:
        raise _fail(context, name, t, "must have a floating-point dtype")
    return t


def check_qkv(q: Any, k: Any, v: Any | None, seq: Any, *, context: str = "attention") -> None:
    """Raise :class:`UnsupportedInputError` unless q (B, Hq, Sq, D), start-aligned k and v
    (B, Hkv, Sk, D) and ``seq`` describe one non-empty attention call on one device.

    ``v`` may be ``None`` (layout construction sees only q and k).
    """
    from elasticfw.attention.seq import SeqInfo

    q = _check_tensor(context, "q", q)
    k = _check_tensor(context, "k", k)
    if v is not None:
        v = _check_tensor(context, "v", v)
    if not isinstance(seq, SeqInfo):
        raise _fail(context, "seq", seq, "must be an elasticfw.attention.seq.SeqInfo")

    batch, hq, sq, dim = q.shape
    if min(q.shape) == 0:
        raise _fail(context, "q", q, "must be non-empty: batch, query heads, query rows and head_dim all >= 1")
    if min(k.shape) == 0:
        raise _fail(context, "k", k, "must be non-empty: batch, kv heads, keys and head_dim all >= 1")
    for name, t in (("k", k), ("v", v)):
        if t is None:
            continue
        if t.device != q.device:
            raise _fail(context, name, t, f"must be on the device of q ({q.device})")
        if t.dtype != q.dtype:
            raise _fail(context, name, t, f"must have the dtype of q ({q.dtype})")
    if v is not None and v.shape != k.shape:
        raise _fail(context, "v", v, f"must have the shape of k {tuple(k.shape)}")
    if k.shape[0] != batch:
        raise _fail(context, "k", k, f"must have the batch size of q ({batch})")
    if k.shape[3] != dim:
        raise _fail(context, "k", k, f"must have the head_dim of q ({dim})")
    if hq % k.shape[1] != 0:
        expected = f"must have a number of KV heads ({k.shape[1]}) that divides the query heads of q ({hq}) (GQA)"
        raise _fail(context, "k", k, expected)

    if seq.device != q.device:
        raise UnsupportedInputError(
            f"{context}: argument 'seq' (q_start and kv_len on device {seq.device}) must be on the device of q "
            f"({q.device})"
        )
    if seq.batch != batch or seq.q_len != sq or seq.kv_capacity != k.shape[2]:
        raise UnsupportedInputError(
            f"{context}: argument 'seq' (batch {seq.batch}, q_len {seq.q_len}, kv_capacity {seq.kv_capacity}) "
            f"must match q ({describe(q)}) and k ({describe(k)}): batch {batch}, q_len {sq}, "
            f"kv_capacity {k.shape[2]}"
        )


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
    from elasticfw.attention.layout import BlockLayout

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
