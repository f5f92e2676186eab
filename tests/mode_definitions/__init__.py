"""Independent token-level definitions of the built-in modes, one module per mode.

Each module defines ``DEFINITION = dict(small_config=..., dense_config=..., token_causal=...,
token_reference=fn)`` where ``fn(q, k, seq, config) -> (B, Hq, Sq, Sk) bool`` is written from
the paper / upstream description in plain PyTorch, never by calling the plugin's layout code.
"""

from __future__ import annotations

import importlib
import pkgutil


def all_definitions() -> dict[str, dict]:
    out = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if module.DEFINITION is not None:
            out[info.name] = module.DEFINITION
    return out
