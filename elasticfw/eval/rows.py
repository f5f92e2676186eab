"""The rows of a comparison sweep: one JSON object per evaluated sample, in ``RUN/rows.jsonl``.

Rows are appended (and flushed to disk) as batches finish, so a sweep that is killed keeps
everything it computed. A kill can cut the last line short, or keep it whole but lose its
newline: :func:`repair_rows` mends the file before more rows are appended (:mod:`elasticfw.jsonl`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elasticfw.errors import ElasticError
from elasticfw.jsonl import read_jsonl, rewrite_jsonl

#: the fields that identify a row: the same key in two runs is the same sample of the same cell
KEY_FIELDS = ("variant", "task", "length", "seed", "index")


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row[f] for f in KEY_FIELDS)


def read_rows(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The rows of ``path`` (none if it does not exist) and whether its last line was torn."""
    if not path.exists():
        return [], False
    parsed, torn = read_jsonl(path)
    for lineno, row in parsed:
        if not isinstance(row, dict) or any(f not in row for f in KEY_FIELDS):
            raise ElasticError(f"{path}:{lineno}: not a sweep row (an object with {', '.join(KEY_FIELDS)})")
    return [row for _, row in parsed], torn


def repair_rows(path: Path) -> list[dict[str, Any]]:
    """Read ``path`` and, if its last line was torn, rewrite it without that line."""
    rows, torn = read_rows(path)
    # a kill can also keep a whole row but lose its newline: the next append would join two rows
    if torn or (rows and not path.read_bytes().endswith(b"\n")):
        rewrite_jsonl(path, rows)
    return rows
