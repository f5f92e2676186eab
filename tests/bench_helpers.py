"""Helpers for the benchmark tests."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest


def record_complete_flags(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> list[bool]:
    """The ``complete`` flag of every JSON file ``module`` (a benchmark) writes, in order; the writes
    still happen."""
    flags: list[bool] = []
    real = module.atomic_write_text

    def write(path: Any, text: str, *args: Any, **kwargs: Any) -> None:
        flags.append(json.loads(text)["complete"])
        real(path, text, *args, **kwargs)

    monkeypatch.setattr(module, "atomic_write_text", write)
    return flags
