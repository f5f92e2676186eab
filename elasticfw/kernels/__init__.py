"""Triton kernels behind the public building blocks (optional: ``pip install elasticfw[triton]``).

Each kernel has a plain-PyTorch definition elsewhere in elasticfw (the building block it
accelerates) and is tested against it: on a GPU at long lengths, and on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, small shapes), so CI covers the kernels' logic.

:func:`triton_unavailable` says whether a kernel can run on a tensor's device; callers that pick
a backend with ``auto`` use the kernel only when it returns ``None`` and name the reason when a
recipe pins ``triton`` and it cannot run.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Literal

import torch

from elasticfw.errors import BackendUnavailableError

__all__ = [
    "cdiv",
    "choose_backend",
    "interpreting",
    "next_pow2",
    "shared_memory_budget",
    "hopper_or_newer",
    "shared_memory_limit",
    "triton_unavailable",
    "unsupported_tensor",
]

#: the dtypes every kernel here takes (16-bit products on tensor cores, float32 in IEEE float32)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ``b > 0``, in plain Python: host code of the kernels calls it per launch, where
    ``triton.cdiv`` (a Triton function unwrapping its arguments) costs several microseconds a call."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """The least power of two at or above ``x`` (1 for ``x <= 1``): kernel tile widths."""
    return 1 << max(0, (x - 1).bit_length())


#: shared memory a kernel keeps free for what is not its operand pipeline (reductions, layout
#: conversions) when :func:`shared_memory_budget` reads a GPU's limit
SHARED_MEMORY_RESERVE = 24 * 1024


@functools.cache
def _shared_memory_optin(index: int) -> int | None:
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", None)


def shared_memory_budget(device: torch.device, cap: int) -> int:
    """Bytes of shared memory a kernel may plan its operand pipeline (tiles x stages) for on
    ``device``: ``cap``, lowered on a GPU whose per-block limit (``shared_memory_per_block_optin``,
    227 KB on Hopper, 163 KB on A100, 99 KB on consumer Ampere/Ada) minus
    :data:`SHARED_MEMORY_RESERVE` is below it. Elsewhere (the interpreter) ``cap``."""
    if device.type != "cuda":
        return cap
    index = device.index if device.index is not None else torch.cuda.current_device()
    optin = _shared_memory_optin(index)
    return cap if optin is None else min(cap, optin - SHARED_MEMORY_RESERVE)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def hopper_or_newer(device: torch.device) -> bool:
    """Whether ``device`` is a GPU of compute capability 9.0 or above (Triton's pipelines keep
    ``num_stages`` K/V buffers there, one fewer below; :func:`~elasticfw.kernels.block_sparse_attention.pipeline_bytes`)."""
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def shared_memory_limit(device: torch.device) -> int | None:
    """The per-block shared memory limit of a GPU (``shared_memory_per_block_optin``: 232,448 bytes
    on an H100 / H200), ``None`` elsewhere (the interpreter has none) or where torch does not say."""
    if device.type != "cuda":
        return None
    return _shared_memory_optin(device.index if device.index is not None else torch.cuda.current_device())


def interpreting() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET=1``: kernels run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_unavailable(device: torch.device) -> str | None:
    """``None`` when a Triton kernel can run on tensors of ``device``, else why not.

    CUDA tensors need the ``triton`` package; CPU tensors need it and ``TRITON_INTERPRET=1`` set
    before the kernel module was imported (the interpreter is chosen when a kernel is defined).
    """
    if not _triton_installed():  # looked up once per process (routers ask at every layer)
        return "the triton package is not installed (pip install 'elasticfw[triton]')"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreting():
        return None
    return f"Triton kernels run on CUDA tensors (or on the CPU under TRITON_INTERPRET=1), not on {device.type}"


def unsupported_tensor(x: torch.Tensor, kernel: str) -> str | None:
    """``None`` when a kernel of this package can take ``x`` (its device, a dtype of
    :data:`KERNEL_DTYPES`), else why not, naming ``kernel``."""
    reason = triton_unavailable(x.device)
    if reason is not None:
        return reason
    if x.dtype not in KERNEL_DTYPES:
        return f"the {kernel} takes float16, bfloat16 or float32 inputs, not {x.dtype}"
    return None


def choose_backend(
    choice: str,
    device: torch.device,
    why_not: Callable[[], str | None],
    *,
    mode: str,
    field: str,
    label: str,
    eligible: bool = True,
) -> Literal["torch", "triton"]:
    """Resolve a mode's ``auto | torch | triton`` planning-backend field for tensors on ``device``.

    ``why_not`` gives the kernel's own reason not to run (its module's ``unsupported``; it is
    called only where Triton can run, so it may import the kernel module). ``auto`` takes the
    kernel on CUDA when it can run and ``eligible`` (e.g. autograd not recording), never the
    interpreter on a CPU; a pinned ``triton`` that cannot run raises
    :class:`~elasticfw.errors.BackendUnavailableError` naming ``mode.field`` and the recipe
    fields it comes from (``label`` is the mode's name in prose).
    """
    if choice == "torch":
        return "torch"
    reason = triton_unavailable(device)
    if reason is None:
        try:
            reason = why_not()
        except ImportError as exc:  # an installed but broken triton
            reason = f"the Triton kernels failed to import ({exc})"
    if choice == "auto":
        return "triton" if reason is None and device.type == "cuda" and eligible else "torch"
    if reason is not None:
        raise BackendUnavailableError(
            f"{mode}.{field} = 'triton' (elastic.sparse_mode.{field}, or elastic.retrieval_mode.{field} when "
            f"{label} is the retrieval mode) cannot run here: {reason} (set {mode}.{field} to 'auto' or 'torch')"
        )
    return "triton"
