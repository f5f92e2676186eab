"""Host time of one routed layer's decode attention, piece by piece (a decode step is host-bound).

    python scripts/decode_host_timing.py --json results/bench/NAME/decode_host.json        # on a GPU, 32K
    python scripts/decode_host_timing.py --cprofile 200                               # and where it goes

At the Llama-3.1-8B attention shape (Hq 32 / Hkv 8, d 128, bf16, one query row over ``--tokens``
keys, FA-SSA with sink 128 / window 2,048 at MSR 0.875: the first KV head full), each piece runs
``--calls`` times back to back without synchronising, after a warm-up: ``host_us`` is the wall time
per call until the last one is enqueued, ``with_gpu_us`` until the GPU has finished too (with
``--blocks N``, of the median of N such blocks, and ``host_us_min`` of the fastest). When
``host_us`` is above the GPU time a decode step of such layers is bound by the host:

* ``dense sdpa`` — one dense decode SDPA call over every key (GQA), what a layer of the dense
  model dispatches;
* ``decode_attention`` — the Triton decode kernel of both modes' heads
  (:func:`elasticfw.kernels.decode_attention.decode_attention`, its two launches and their host code),
  called as the split executor calls it (``checked=True``: the executor has run the input checks);
* ``split attend_routed`` — the split executor's whole routed call (its checks, then the kernel);
* ``torch.empty x5`` — five small allocations, a yardstick of the host's speed;
* ``decode_attention splits=N`` (with ``--splits N ...``) — the kernel with ``N`` key ranges per
  (sample, KV head) instead of :func:`~elasticfw.kernels.decode_attention.num_splits`' choice (at
  MSR 0.875 one KV head in eight reads every key, so its programs may set the GPU time, unmeasured:
  ``--tokens 131072 --splits 32 64 128 256`` on a GPU compares ``with_gpu_us``).

``--cprofile N`` also profiles ``N`` calls of ``decode_attention`` with cProfile (top functions by
own time). On a CPU without a GPU the kernels run under ``TRITON_INTERPRET=1`` (slow: for a smoke
run only, ``--tokens 256 --calls 2``). ``--no-launch`` replaces the decode kernel's two launches by
no-ops, so that ``decode_attention`` and ``split attend_routed`` time the host code around the
launches alone (on a CPU with ``TRITON_INTERPRET=1``: the kernel's host code asks for Triton on
the device; ``dense sdpa`` still computes).
``--json FILE`` writes the figures with the environment.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from elasticfw.atomic import atomic_write_text
from elasticfw.attention.seq import SeqInfo
from elasticfw.kernels import triton_unavailable
from elasticfw.kernels.block_sparse_attention import layout_selection
from elasticfw.provenance import environment
from elasticfw.registry import get_registry

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def _timed(fn: Callable[[], object], calls: int, warmup: int, device: torch.device, blocks: int = 1) -> dict[str, float]:
    """Per call, over ``blocks`` blocks of ``calls`` calls: the median block's host and host + GPU
    times, and the fastest block's host time (``host_us_min``, the least disturbed by other work)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    sync()
    hosts, totals = [], []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        hosts.append(time.perf_counter() - start)
        sync()
        totals.append(time.perf_counter() - start)
    median = sorted(range(blocks), key=lambda i: hosts[i])[blocks // 2]
    return {"host_us": 1e6 * hosts[median] / calls, "with_gpu_us": 1e6 * totals[median] / calls,
            "host_us_min": 1e6 * min(hosts) / calls}


class _NoLaunch:
    """Stands for a Triton kernel whose launch (``kernel[grid](...)``) does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *a, **kw: None


def run(args: argparse.Namespace) -> dict[str, Any]:
    from elasticfw.kernels import decode_attention as decode_module

    if not args.no_launch:
        return _run(args, decode_module)
    # the kernels' launches do nothing while the pieces run: what remains is the host code around them
    kernels = decode_module._decode_split_kernel, decode_module._merge_kernel
    decode_module._decode_split_kernel = decode_module._merge_kernel = _NoLaunch()  # type: ignore[assignment]
    try:
        return _run(args, decode_module)
    finally:
        decode_module._decode_split_kernel, decode_module._merge_kernel = kernels


def _run(args: argparse.Namespace, decode_module: Any) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, HEADS, 1, HEAD_DIM, generator=g).to(device, dtype)
    k = torch.randn(1, KV_HEADS, args.tokens, HEAD_DIM, generator=g).to(device, dtype)
    v = torch.randn(1, KV_HEADS, args.tokens, HEAD_DIM, generator=g).to(device, dtype)
    seq = SeqInfo.dense(1, 1, args.tokens, device)
    registry = get_registry()

    def mode(name: str, **cfg: Any) -> Any:
        return registry.make("sparse_mode", registry.entry("sparse_mode", name).config_class(**cfg))

    lay_r = mode("full", block_size=64).build_layout(q, k, seq)
    lay_s = mode("streaming", sink_tokens=128, local_tokens=2048, block_size=64).build_layout(q, k, seq)
    # as the runtime hands them to the executor: one object per step, shared by every layer
    lay_r, lay_s = replace(lay_r, reusable=True), replace(lay_s, reusable=True)
    hard = torch.zeros(1, HEADS, dtype=torch.bool, device=device)
    hard[:, HEADS // KV_HEADS :] = True  # MSR 0.875: the first KV head's query heads full
    sel_r, sel_s = layout_selection(lay_r), layout_selection(lay_s)
    assert sel_r is not None and sel_s is not None
    split = registry.make("executor", registry.entry("executor", "split").config_class(decode_sparse="kernel"))
    scale = HEAD_DIM**-0.5

    def kernel() -> object:
        return decode_module.decode_attention(q, k, v, sel_r, seq, scale=scale, second=sel_s, second_heads=hard,
                                              checked=True)

    pieces: dict[str, Callable[[], object]] = {
        "dense sdpa": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True),
        "decode_attention": kernel,
        "split attend_routed": lambda: split.attend_routed(
            q, k, v, seq, hard=hard, layouts=(lay_r, lay_s), scale=scale, need_lse=False
        ),
        "torch.empty x5": lambda: [torch.empty(8, 128, device=device) for _ in range(5)],
    }
    for n in args.splits:
        pieces[f"decode_attention splits={n}"] = lambda n=n: decode_module.decode_attention(
            q, k, v, sel_r, seq, scale=scale, second=sel_s, second_heads=hard, splits=n, checked=True)
    report: dict[str, Any] = {
        "benchmark": "decode_host_timing", "environment": environment(device), "tokens": args.tokens,
        "calls": args.calls, "no_launch": args.no_launch, "us": {},
    }
    for name, fn in pieces.items():
        report["us"][name] = _timed(fn, args.calls, args.warmup, device, args.blocks)
        row = report["us"][name]
        print(f"{name:24s} host {row['host_us']:9.1f} us (fastest block {row['host_us_min']:9.1f})   "
              f"with the GPU {row['with_gpu_us']:9.1f} us", flush=True)
    if args.cprofile:
        report["cprofile"] = cprofile_text(kernel, args.cprofile)
        print(report["cprofile"])
    return report


def cprofile_text(fn: Callable[[], object], calls: int, top: int = 20) -> str:
    """cProfile's table of ``calls`` calls of ``fn``: the ``top`` functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=32768, help="keys in the cache (default 32768)")
    p.add_argument("--calls", type=int, default=300, help="timed calls per piece")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--blocks", type=int, default=1, help="blocks of --calls calls per piece (median and fastest)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="also cProfile N decode_attention calls")
    p.add_argument("--no-launch", action="store_true",
                   help="replace the decode kernel's two launches by no-ops: the host code alone (on a CPU: with "
                        "TRITON_INTERPRET=1)")
    p.add_argument("--json", type=Path, default=None, help="write the figures with the environment")
    p.add_argument("--splits", type=int, nargs="*", default=[], metavar="N",
                   help="also time the decode kernel with N key ranges per (sample, KV head), for each N")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.calls < 1 or args.blocks < 1 or args.warmup < 0:
        p.error("--tokens, --calls and --blocks must be >= 1, --warmup >= 0")
    if any(n < 1 for n in args.splits):
        p.error(f"--splits values are key ranges per (sample, KV head), >= 1; got {args.splits}")
    reason = triton_unavailable(torch.device(args.device))
    if reason is not None:
        p.error(f"the decode kernel cannot run on --device {args.device}: {reason}")
    report = run(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
