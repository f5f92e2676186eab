"""JSON-lines files that are appended to while a run goes on (training metrics, sweep rows).

A process killed mid-write leaves its last line cut short, so readers skip an invalid *last*
line and report it as torn; an invalid line anywhere else is corruption and is refused with the
file and line. Appends are flushed to disk before they return.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from elasticfw.atomic import atomic_write_text
from elasticfw.errors import ElasticError


def read_jsonl(path: Path, *, error: type[Exception] = ElasticError) -> tuple[list[tuple[int, Any]], bool]:
    """``([(line_number, value), ...], torn)``; blank lines are ignored and a last line that is not
    valid JSON is skipped (``torn``). An invalid line elsewhere raises ``error``."""
    lines = [(i, line) for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
    out: list[tuple[int, Any]] = []
    for pos, (lineno, line) in enumerate(lines):
        try:
            out.append((lineno, json.loads(line)))
        except json.JSONDecodeError as err:
            if pos == len(lines) - 1:
                return out, True
            raise error(
                f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno}); only the last line "
                "of a JSONL file may be incomplete (a run cut short), this one is followed by others"
            ) from err
    return out, False


def append_jsonl(path: Path, records: Iterable[Any]) -> None:
    """Append ``records`` as JSON lines and push them to disk before returning."""
    text = "".join(json.dumps(r) + "\n" for r in records)
    if not text:
        return
    with path.open("a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def rewrite_jsonl(path: Path, records: Iterable[Any]) -> None:
    """Replace ``path`` by ``records`` as JSON lines, atomically."""
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
