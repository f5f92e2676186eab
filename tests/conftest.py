"""Suite-wide set-up: without a GPU, Triton kernels run under Triton's interpreter.

``TRITON_INTERPRET`` must be set before a kernel module is imported (``triton.jit`` picks the
interpreter when a kernel is defined), so it is set here, before any test module loads.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
