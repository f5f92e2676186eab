"""Where the ``mlp`` router's inference time goes: the host's code, Triton's launch, the GPU kernel.

    python scripts/router_timing.py --json results/bench/NAME/router_timing.json      # on a GPU
    python scripts/router_timing.py --device cpu --no-launch --layers 4           # host code only, any machine

At the Llama-3.1-8B shape (``--layers`` routed layers, 8 KV heads, head dim 128, B 1, bf16 keys of
``--tokens`` tokens; the router's default configuration, ``kernel: auto``), each piece runs one
pass over every layer, ``--blocks`` times after a warm-up. Per layer: ``host_us`` is the wall time
until the last launch is enqueued, ``with_gpu_us`` until the GPU has finished too (median block),
``host_us_min`` the fastest block's host time:

* ``router.decide`` — what ``elasticfw.bench.router`` times (its ``router_per_layer_ms``);
* ``fused_decide`` — the fused kernel's public function with the layer's weights in hand (no
  router code around it);
* ``kernel launch`` — ``mlp_router_kernel[grid](...)`` with every argument prepared: Triton's own
  launch cost;
* ``torch.empty x2`` — the two output allocations, a yardstick of the host's speed.

``gpu_us_per_layer`` is the GPU's own time: the pass over every layer captured in a CUDA graph
and replayed (no host work between kernels). When ``host_us`` of ``router.decide`` is above it,
the router is bound by the host. ``--cprofile N`` profiles ``N`` passes of ``router.decide``
(top functions by own time). ``--no-launch`` replaces the kernel's launch by a no-op, so the
pieces time the host code alone on any machine (under ``TRITON_INTERPRET=1`` on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from decode_host_timing import _NoLaunch, _timed, cprofile_text  # the script's folder is sys.path[0]

from elasticfw.atomic import atomic_write_text
from elasticfw.attention.seq import SeqInfo
from elasticfw.provenance import environment
from elasticfw.registry import get_registry
from elasticfw.routing.base import HeadLayout

KV_HEADS, Q_HEADS, HEAD_DIM = 8, 32, 128


def _graph_us(fn: Callable[[], object], layers: int, device: torch.device) -> float | str:
    """GPU microseconds per layer of ``fn`` replayed from a CUDA graph, or why it could not be captured."""
    if device.type != "cuda":
        return "not a CUDA device"
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:  # a capture the kernel or the allocator refuses: say so in the report
        return f"capture failed: {exc}"
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 50
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return 1e3 * start.elapsed_time(end) / (replays * layers)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.no_launch or args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused path needs Triton to be usable on a CPU
    from elasticfw_plugins.routers import mlp_fused

    kernel = mlp_fused.mlp_router_kernel
    if args.no_launch:
        mlp_fused.mlp_router_kernel = _NoLaunch()  # type: ignore[assignment]
    try:
        return _run(args, mlp_fused)
    finally:
        mlp_fused.mlp_router_kernel = kernel


def _run(args: argparse.Namespace, mlp_fused: Any) -> dict[str, Any]:
    device = torch.device(args.device)
    layers = args.layers
    entry = get_registry().entry("router", "mlp")
    heads = HeadLayout(tuple(range(layers)), KV_HEADS, Q_HEADS, HEAD_DIM)
    kernel = "auto" if device.type == "cuda" else "triton"  # auto keeps a CPU on the eager path
    router = entry.cls(entry.config_class(kernel=kernel), heads).to(device).eval()  # type: ignore[call-arg, misc]
    keys = torch.randn(1, KV_HEADS, args.tokens, HEAD_DIM, device=device, dtype=torch.bfloat16)
    seq = SeqInfo.dense(1, args.tokens, args.tokens, device)
    params = [layer.kernel_params() for layer in router.layers]  # type: ignore[operator]
    pool = router.config.pool_tokens
    hard = torch.empty(2, 1, KV_HEADS, device=device)
    logits = torch.empty(1, KV_HEADS, 2, device=device)
    s = keys.stride()
    launch_args = [(keys, keys.shape[2], *s, KV_HEADS, *p, hard[0], hard[1], logits) for p in params]
    weight = params[0][0]
    meta = mlp_fused._meta(HEAD_DIM, weight.shape[0], pool, True, weight.dtype)  # the router's own launch constants

    @torch.no_grad()
    def decide() -> None:
        for layer in range(layers):
            router.decide(layer, keys, seq)

    def fused() -> None:
        for p in params:
            mlp_fused.fused_decide(p, keys, pool)

    def launch() -> None:
        for a in launch_args:
            mlp_fused.mlp_router_kernel[(KV_HEADS,)](*a, **meta)

    def empty() -> None:
        for _ in range(layers):
            torch.empty((2, 1, KV_HEADS), device=device)
            torch.empty((1, KV_HEADS, 2), device=device, dtype=torch.bfloat16)

    pieces = {"router.decide": decide, "fused_decide": fused, "kernel launch": launch, "torch.empty x2": empty}
    report: dict[str, Any] = {
        "benchmark": "router_timing", "environment": environment(device), "tokens": args.tokens, "layers": layers,
        "no_launch": args.no_launch, "router_kernel": kernel, "us": {},
    }
    for name, fn in pieces.items():  # one call of each piece is a pass over every layer
        per_pass = _timed(fn, 1, args.warmup, device, args.blocks)
        row = report["us"][name] = {key: us / layers for key, us in per_pass.items()}
        print(f"{name:16s} host {row['host_us']:8.1f} us/layer (fastest block {row['host_us_min']:8.1f})   "
              f"with the GPU {row['with_gpu_us']:8.1f}", flush=True)
    if not args.no_launch:
        report["gpu_us_per_layer"] = _graph_us(decide, layers, device)
        print(f"CUDA graph replay: {report['gpu_us_per_layer']} us/layer on the GPU", flush=True)
    if args.cprofile:
        report["cprofile"] = cprofile_text(decide, args.cprofile)
        print(report["cprofile"])
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-launch", action="store_true", help="time the host code alone (the launch is a no-op)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="also profile N passes of router.decide")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    report = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.json, json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
