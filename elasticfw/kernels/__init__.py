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

import torch

__all__ = ["interpreting", "triton_unavailable"]


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
