"""Load a Python file that is not part of a package (a script under ``scripts/``, a docs generator)
as a module, for the tests of its functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_file(path: Path, name: str) -> ModuleType:
    """The module defined by ``path``, executed under ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_script(stem: str, name: str | None = None) -> ModuleType:
    """``scripts/<stem>.py`` as a module (``name`` defaults to ``stem``)."""
    return load_file(ROOT / "scripts" / f"{stem}.py", name or stem)
