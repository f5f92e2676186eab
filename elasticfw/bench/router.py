"""Router overhead at inference: boundary pooling + task MLP + router MLP for every layer.

    python -m elasticfw.bench.router --out results/router_overhead.json
    python -m elasticfw.bench.router --device cpu --seq 1024 --layers 2 --out /tmp/router.json  # smoke

Default shape: Llama-3.1-8B (32 layers, 8 KV heads, 32 query heads, head dim 128), B=1, bf16 key
states, S in {512, 8192, 32768, 131072}. Times ``router.decide`` for all layers (eval mode, no
autograd), the router the paper uses (``mlp``, about 0.27M parameters per layer), against one
layer of dense causal cuDNN SDPA at the same S measured in the same run. The paper reports an
average router latency of 0.196 ms, constant from 512 to 1M tokens (Fig. 10).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from elasticfw.atomic import atomic_write_text
from elasticfw.attention.seq import SeqInfo
from elasticfw.provenance import environment
from elasticfw.registry import get_registry
from elasticfw.routing.base import HeadLayout


def _time(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 5) -> float:
    """Median milliseconds of ``fn``."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    registry = get_registry()
    entry = registry.entry("router", args.router)
    heads = HeadLayout(tuple(range(args.layers)), args.kv_heads, args.q_heads, args.head_dim)
    router = entry.cls(entry.config_class(), heads).to(device).eval()  # type: ignore[misc]
    params_per_layer = sum(p.numel() for p in router.parameters()) / args.layers
    rows = []
    for s in args.seq:
        keys = torch.randn(1, args.kv_heads, s, args.head_dim, device=device, dtype=dtype)
        seq = SeqInfo.dense(1, s, s, device)

        @torch.no_grad()
        def all_layers(keys: torch.Tensor = keys, seq: SeqInfo = seq) -> None:
            for layer in range(args.layers):
                router.decide(layer, keys, seq)

        ms = _time(all_layers, device, args.reps)
        row = {"seq": s, "router_all_layers_ms": ms, "router_per_layer_ms": ms / args.layers}
        if device.type == "cuda" and s <= args.max_sdpa_seq:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            q = torch.randn(1, args.q_heads, s, args.head_dim, device=device, dtype=dtype)
            v = torch.randn_like(keys)

            @torch.no_grad()
            def sdpa(q: torch.Tensor = q, k: torch.Tensor = keys, v: torch.Tensor = v) -> None:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            row["sdpa_cudnn_one_layer_ms"] = _time(sdpa, device, max(3, args.reps // 4))
            row["router_vs_all_layers_attention"] = ms / (row["sdpa_cudnn_one_layer_ms"] * args.layers)
            del q, v
        rows.append(row)
        print(json.dumps(row), flush=True)
        del keys
    return {
        "benchmark": "router_overhead",
        "router": args.router,
        "shape": {"layers": args.layers, "kv_heads": args.kv_heads, "q_heads": args.q_heads,
                  "head_dim": args.head_dim, "dtype": args.dtype, "batch": 1},
        "router_params_per_layer": params_per_layer,
        "paper_reference_ms": 0.196,
        "rows": rows,
        "environment": environment(device),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--router", default="mlp")
    p.add_argument("--seq", type=int, nargs="+", default=[512, 8192, 32768, 131072])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--max-sdpa-seq", type=int, default=32768)
    args = p.parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
