"""Router overhead at inference: boundary pooling + task MLP + router MLP for every layer.

    python -m elasticfw.bench.router --out results/bench/NAME/router.json
    python -m elasticfw.bench.router --device cpu --seq 1024 --layers 2 --out /tmp/router.json  # smoke

Times ``router.decide`` of every layer (Llama-3.1-8B shape by default), each followed by the host
read of its decision that the runtime makes (``decide_only_per_layer_ms`` leaves it out), against
one layer of dense causal cuDNN SDPA in the same run. For a router with a ``kernel`` field the
eager and the fused path are timed and compared (``fused_*`` fields; ``null``, with
``fused_unavailable``, where Triton cannot run). Details and the paper's figure:
``docs/explanation/design-notes.md``.
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
from elasticfw.kernels import triton_unavailable
from elasticfw.provenance import environment
from elasticfw.registry import get_registry
from elasticfw.routing.base import HeadLayout, Router

#: what the per-layer figures time: a router's cost inside a model at inference, where the runtime
#: reads each layer's decision to the host (one synchronisation per layer; none for a router that
#: returns its decision's host copy) before its attention runs
TIMED = "decide and the runtime's host read of each decision"


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
    # the same weights on the eager path and on the fused kernel, for a router that has both
    variants: dict[str, Router] = {}
    fused_unavailable: str | None = "the router has no kernel field"
    config_class = entry.config_class
    if config_class is not None and "kernel" in config_class.model_fields:
        fused_unavailable = triton_unavailable(device)
        for name, kernel in (("eager", "eager"), ("fused", "triton")):
            if name == "fused" and fused_unavailable is not None:
                continue
            config = config_class(kernel=kernel)  # type: ignore[call-arg]
            variant = entry.cls(config, heads).to(device).eval()  # type: ignore[misc]
            variant.load_state_dict(router.state_dict())
            variants[name] = variant
    rows = []
    for s in args.seq:
        keys = torch.randn(1, args.kv_heads, s, args.head_dim, device=device, dtype=dtype)
        seq = SeqInfo.dense(1, s, s, device)

        def all_layers_of(r: Router, keys: torch.Tensor = keys, seq: SeqInfo = seq,
                          host_read: bool = True) -> Callable[[], None]:
            @torch.no_grad()
            def all_layers() -> None:
                for layer in range(args.layers):
                    decision = r.decide(layer, keys, seq)
                    if host_read and decision.host is None:  # what the runtime reads at inference
                        decision.sparse.cpu()

            return all_layers

        ms = _time(all_layers_of(router), device, args.reps)
        decide_ms = _time(all_layers_of(router, host_read=False), device, args.reps)
        row: dict = {"seq": s, "router_all_layers_ms": ms, "router_per_layer_ms": ms / args.layers,
                     "decide_only_per_layer_ms": decide_ms / args.layers}
        if "eager" in variants:
            row["eager_per_layer_ms"] = _time(all_layers_of(variants["eager"]), device, args.reps) / args.layers
            row["fused_per_layer_ms"] = None
            row["fused_unavailable"] = fused_unavailable
        if "fused" in variants:
            row["fused_per_layer_ms"] = _time(all_layers_of(variants["fused"]), device, args.reps) / args.layers
            with torch.no_grad():
                eager = [variants["eager"].decide(layer, keys, seq) for layer in range(args.layers)]
                fused = [variants["fused"].decide(layer, keys, seq) for layer in range(args.layers)]
            row["fused_max_abs_logit_diff"] = max(
                (f.logits.float() - e.logits.float()).abs().max().item()  # type: ignore[union-attr]
                for f, e in zip(fused, eager)
            )
            row["fused_decisions_equal"] = all(torch.equal(f.sparse, e.sparse) for f, e in zip(fused, eager))
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
        #: what each per-layer figure times (``decide_only_per_layer_ms``: without the host read)
        "timed": TIMED,
        "router_kernel": getattr(router.config, "kernel", None),  # the default configuration's
        "fused_unavailable": fused_unavailable,  # why the fused kernel was not timed (null: it was)
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
