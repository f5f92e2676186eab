"""Atomic writes: a reader (or a crash) sees the old file or folder, or the new one, never half of one."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_replace_dir(path: Path, write: Callable[[Path], Any]) -> Path:
    """``write(tmp)`` a folder next to ``path``, then swap it into place (the old one, if any, is
    removed only after the new one is complete)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    write(tmp)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        shutil.rmtree(old)
    return path
