"""Reading a sweep run folder: ``sweep.json``, ``rows.jsonl`` and (optionally) ``failures.jsonl``.

The JSONL files are appended to while the sweep runs, so their last line may be cut short (a
killed run, or a read racing a write): a last line that is not valid JSON is skipped and reported
in :attr:`Run.torn`; an invalid line anywhere else is an error. Every row is checked for the
fields the report uses, with an error naming the file and line. A sample evaluated twice by the
same variant (same variant, task, length, seed and index — e.g. a cell re-run after a crash) is
kept once, its last occurrence, and counted in :attr:`Run.duplicates`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticfw.jsonl import read_jsonl as _read_jsonl
from elasticfw.report.errors import ReportError

SWEEP, ROWS, FAILURES = "sweep.json", "rows.jsonl", "failures.jsonl"
CATEGORIES = ("sensitive", "robust")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite_nonneg(v: Any) -> bool:
    return _is_number(v) and math.isfinite(v) and v >= 0


# field -> (check, what the check expects, in words)
_Check = tuple[Callable[[Any], bool], str]
REQUIRED: dict[str, _Check] = {
    "variant": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "task": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "category": (lambda v: v in CATEGORIES, f"one of {CATEGORIES}"),
    "metric": (lambda v: isinstance(v, str), "a string"),
    "length": (lambda v: v is None or _is_int(v), "an integer or null"),
    "seed": (_is_int, "an integer"),
    "index": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "tokens": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "score": (lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "msr": (_is_number, "a number"),
    "esr": (_is_number, "a number"),
    "prefill_seconds": (_finite_nonneg, "a finite non-negative number"),
}
OPTIONAL: dict[str, _Check] = {
    "esr_last_layer": (lambda v: v is None or _is_number(v), "a number or null"),
    "decisions": (lambda v: v is None or isinstance(v, list), "a list (layers × KV heads of 0/1) or null"),
    "routed_layers": (lambda v: v is None or isinstance(v, list), "a list of layer indices or null"),
    # K >= 3 modes: each head's mode, the share of heads per mode, the routing's expected cost
    "modes": (lambda v: v is None or isinstance(v, list), "a list (layers × KV heads of mode indices) or null"),
    "shares": (lambda v: v is None or (isinstance(v, list) and all(_finite_nonneg(x) for x in v)),
               "a list of finite non-negative numbers (one share per mode) or null"),
    "cost": (lambda v: v is None or _finite_nonneg(v), "a finite non-negative number or null"),
}
FAILURE_REQUIRED: dict[str, _Check] = {
    "variant": (lambda v: isinstance(v, str), "a string"),
    "error": (lambda v: isinstance(v, str), "a string"),
}


@dataclass(frozen=True)
class TaskInfo:
    """A task of the sweep: its ``label`` (what rows call it), the registered ``task`` it runs,
    its ``category`` (``sensitive``/``robust``) and ``metric``."""

    label: str
    task: str
    category: str
    metric: str


@dataclass
class Run:
    """A loaded sweep run folder."""

    path: Path
    meta: dict[str, Any]
    rows: list[dict[str, Any]]
    failures: list[dict[str, Any]]
    torn: list[str] = field(default_factory=list)
    duplicates: int = 0

    @property
    def reference(self) -> str | None:
        """Label of the variant speed-ups are measured against (None: no speed-ups)."""
        ref = self.meta.get("reference")
        return ref if isinstance(ref, str) else None

    @property
    def variants(self) -> list[str]:
        """Declared variant labels, then any other label the rows have."""
        declared = [v["label"] for v in self.meta.get("variants", [])]
        return list(dict.fromkeys([*declared, *(r["variant"] for r in self.rows)]))

    @property
    def tasks(self) -> list[TaskInfo]:
        """Declared tasks, then any other the rows have; sensitive first, else in that order."""
        found = {t.label: t for t in _declared_tasks(self.meta)}
        for r in self.rows:
            found.setdefault(r["task"], TaskInfo(r["task"], r["task"], r["category"], r["metric"]))
        return sorted(found.values(), key=lambda t: CATEGORIES.index(t.category))

    @property
    def lengths(self) -> list[int | None]:
        """Declared context lengths, then any other the rows have."""
        return list(dict.fromkeys([*self.meta.get("lengths", []), *(r["length"] for r in self.rows)]))


def sample_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies one sample across variants: (task, length, seed, index)."""
    return (row["task"], row["length"], row["seed"], row["index"])


def _declared_tasks(meta: dict[str, Any]) -> list[TaskInfo]:
    return [
        TaskInfo(
            t["label"],
            t["task"] if isinstance(t.get("task"), str) else t["label"],
            t["category"],
            t["metric"] if isinstance(t.get("metric"), str) else "",
        )
        for t in meta.get("tasks", [])
    ]


def read_jsonl(path: Path) -> tuple[list[tuple[int, Any]], bool]:
    """:func:`elasticfw.jsonl.read_jsonl`, raising :class:`ReportError`."""
    return _read_jsonl(path, error=ReportError)


def _check_fields(
    where: str, value: Any, required: dict[str, _Check], optional: dict[str, _Check]
) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ReportError(f"{where}: expected a JSON object, got {type(value).__name__}")
    for name, (check, expected) in required.items():
        if name not in value:
            raise ReportError(f"{where}: missing required field {name!r} (fields present: {sorted(value)})")
        if not check(value[name]):
            raise ReportError(f"{where}: field {name!r} must be {expected}, got {value[name]!r}")
    for name, (check, expected) in optional.items():
        if name in value and not check(value[name]):
            raise ReportError(f"{where}: field {name!r} must be {expected}, got {value[name]!r}")
    return value


def _load_meta(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ReportError(f"{path.parent} is not a sweep run folder: there is no {SWEEP} in it")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ReportError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from err
    if not isinstance(meta, dict):
        raise ReportError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    variants = meta.setdefault("variants", [])
    if not isinstance(variants, list) or not all(
        isinstance(v, dict) and isinstance(v.get("label"), str) for v in variants
    ):
        raise ReportError(
            f"{path}: 'variants' must be a list of objects with a string 'label', got {variants!r}"
        )
    labels = [v["label"] for v in variants]
    if len(set(labels)) != len(labels):
        raise ReportError(f"{path}: variant labels must be unique, got {labels}")
    tasks = meta.setdefault("tasks", [])
    if not isinstance(tasks, list) or not all(
        isinstance(t, dict) and isinstance(t.get("label"), str) and t.get("category") in CATEGORIES
        for t in tasks
    ):
        raise ReportError(
            f"{path}: 'tasks' must be a list of objects with a string 'label' and a 'category' in "
            f"{CATEGORIES}, got {tasks!r}"
        )
    lengths = meta.setdefault("lengths", [])
    if not isinstance(lengths, list) or not all(x is None or _is_int(x) for x in lengths):
        raise ReportError(f"{path}: 'lengths' must be a list of integers (or [null]), got {lengths!r}")
    reference = meta.setdefault("reference", None)
    if reference is not None and not isinstance(reference, str):
        raise ReportError(f"{path}: 'reference' must be a variant label or null, got {reference!r}")
    return meta


def load_run(run_dir: Path | str) -> Run:
    """Load and check a sweep run folder (``rows.jsonl`` and ``failures.jsonl`` may be absent)."""
    run_dir = Path(run_dir)
    meta = _load_meta(run_dir / SWEEP)
    tasks = {t.label: (t.category, t.metric, f"{SWEEP}") for t in _declared_tasks(meta)}
    torn: list[str] = []
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    duplicates = 0
    path = run_dir / ROWS
    if path.is_file():
        parsed, cut = read_jsonl(path)
        if cut:
            torn.append(ROWS)
        for lineno, value in parsed:
            where = f"{path}:{lineno}"
            row = _check_fields(where, value, REQUIRED, OPTIONAL)
            category, metric, seen_at = tasks.setdefault(row["task"], (row["category"], row["metric"], where))
            if row["category"] != category or (metric and row["metric"] != metric):
                raise ReportError(
                    f"{where}: task {row['task']!r} has category {row['category']!r} and metric "
                    f"{row['metric']!r} here, but {category!r} and {metric!r} in {seen_at}"
                )
            key = (row["variant"], *sample_key(row))
            duplicates += key in rows
            rows.pop(key, None)  # the last occurrence wins, in its own position
            rows[key] = row
    failures: list[dict[str, Any]] = []
    path = run_dir / FAILURES
    if path.is_file():
        parsed, cut = read_jsonl(path)
        if cut:
            torn.append(FAILURES)
        failures = [_check_fields(f"{path}:{n}", v, FAILURE_REQUIRED, {}) for n, v in parsed]
    return Run(run_dir, meta, list(rows.values()), failures, torn, duplicates)
