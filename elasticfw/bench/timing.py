"""Timing and result recording shared by the benchmarks (:mod:`elasticfw.bench.attention`,
:mod:`elasticfw.bench.density`, :mod:`elasticfw.bench.decode_memory`, :mod:`elasticfw.bench.generate`):
a median time per call (Triton's ``do_bench`` on CUDA, a synchronised wall-clock loop elsewhere), a
first call's time, time points on the device's timeline (:class:`DeviceClock`), CUDA memory
figures, a recorder that keeps a failing entry's error as a row, and executors reached through the
registry."""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from elasticfw.registry import get_registry

__all__ = ["DTYPES", "DeviceClock", "Recorder", "allocated_bytes", "causal_flops", "first_call_s", "free_memory",
           "make_executor", "peak_bytes", "reset_peak", "sync", "time_ms"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated_bytes(device: torch.device) -> int | None:
    """``torch.cuda.memory_allocated`` on CUDA, ``None`` elsewhere."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    """Restart ``torch.cuda.max_memory_allocated``'s count (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    """``torch.cuda.max_memory_allocated`` since the last :func:`reset_peak` on CUDA, ``None`` elsewhere."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def free_memory(device: torch.device) -> None:
    """Collect garbage and hand the caching allocator's free blocks back (on CUDA), so that the next
    measurement starts from what is still referenced."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class DeviceClock:
    """Time points on ``device``'s timeline, read once at the end: on CUDA an event recorded in the
    current stream at each :meth:`mark` (no synchronisation between marks, so the host may run
    ahead of the GPU as it does when serving; an interval is the GPU timeline's between two points,
    which is the host's time where the host is the bottleneck), elsewhere ``time.perf_counter``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.points: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append(event)
        else:
            self.points.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        """Milliseconds between consecutive marks (waits for the last mark on CUDA)."""
        if self.cuda:
            if self.points:
                self.points[-1].synchronize()
            return [float(a.elapsed_time(b)) for a, b in zip(self.points, self.points[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.points, self.points[1:])]


#: the fewest timed samples behind a median on CUDA: do_bench runs ``rep / estimate`` of them, one
#: for a 255 ms dense layer at 128K under a 300 ms budget (the denominator of every layer figure)
MIN_SAMPLES = 5


def time_ms(fn: Callable[[], Any], device: torch.device, args: argparse.Namespace, grads=None) -> float:
    """Median milliseconds of ``fn``: triton's do_bench on CUDA (L2 flushed between runs, warmup
    and repetition budgets in ms, the repetition budget raised to :data:`MIN_SAMPLES` calls of
    ``fn`` as one timed call estimates it), a synchronised wall-clock loop elsewhere."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            estimate_ms = first_call_s(fn, device) * 1e3
            rep = max(float(args.rep_ms), MIN_SAMPLES * estimate_ms * 1.1)
            return float(do_bench(fn, warmup=args.warmup_ms, rep=rep, grad_to_none=grads, return_mode="median"))
    for _ in range(args.cpu_warmup):
        fn()
    times = []
    for _ in range(args.cpu_iters):
        if grads:
            for t in grads:
                t.grad = None
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def first_call_s(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call of ``fn`` (the first: compilation included), synchronised."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


#: the suffix of a baseline row timed again after a length's other entries (its ratios divide by the
#: mean of both times; see elasticfw.bench.attention.rebase)
BASELINE_AGAIN = "@end"


class Recorder:
    """Collects result rows; a failing entry becomes a row with its error. ``on_row`` runs after
    every row (the JSON is rewritten each time, so a run cut short still leaves its results)."""

    def __init__(self, on_row: Callable[[Recorder], None] | None = None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.on_row = on_row

    def run(self, row: dict[str, Any], body: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        row = dict(row, error=None)
        try:
            body(row)
        except Exception as exc:  # noqa: BLE001 - a benchmark entry's failure is recorded, the run goes on
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc(limit=8)
            self.failures.append(f"{row.get('name')} [{row.get('kind')}] S={row.get('seq')}: {row['error']}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # after an out-of-memory error, let the next entry start clean
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(self)
        status = f"{row['ms']:.3f} ms" if row.get("ms") is not None else (row["error"] or "ok")
        print(f"[bench] S={row.get('seq')} {row.get('kind'):8s} {row.get('name')}: {status}", flush=True)
        return row


def causal_flops(batch: int, heads: int, seq: int, dim: int) -> float:
    """Forward FLOPs of causal attention (two matmuls over the causal half)."""
    return 4.0 * batch * heads * dim * seq * (seq + 1) / 2


def make_executor(name: str, **config: Any) -> Any:
    """A registered executor with ``config``: the bench reaches executors through the registry, as
    third-party code does (the core never imports the built-in plugins)."""
    registry = get_registry()
    return registry.make("executor", registry.entry("executor", name).config_class(**config))  # type: ignore[misc]


def finish_report(
    report: dict[str, Any], args: argparse.Namespace, write: Callable[[], None], plot: Callable[..., Any], tag: str
) -> int:
    """The end of a model-level benchmark run (:mod:`elasticfw.bench.prefill`, :mod:`~elasticfw.bench.generate`):
    its plot beside ``--out`` (or at ``--plot``), ``complete`` set and the JSON written a last time by
    ``write``, a summary line; the exit status, 1 when some variant failed."""
    png = plot(report, args.plot or args.out.with_suffix(".png"))
    report["plot"] = str(png) if png else None
    report["complete"] = True
    write()
    print(f"[{tag}] wrote {args.out}" + (f" and {png}" if png else "") + f"; {len(report['failures'])} failure(s)")
    for line in report["failures"]:
        print(f"[{tag}] FAILED {line}", file=sys.stderr)
    return 1 if report["failures"] else 0
