"""A/B of the split executor's decode host time: layouts checked once per call geometry vs at every call.

``new`` is the executor as it is (a step's reusable layouts checked once per call geometry); ``old``
is the same executor with ``_check_layouts`` replaced by a check of both layouts at every call, as it
used to run. Its runs are in ``results/bench/decode-host-layout-checks/``.

    TRITON_INTERPRET=1 python tools/decode_layout_checks_ab.py --blocks 60 --json FILE

From the repository root. The decode kernel's launches are replaced by no-ops (as
``tools/decode_host_timing.py --no-launch``), so both sides time the host code alone; blocks of
``--calls`` calls alternate between them (the order flips every block). The shape is the
Llama-3.1-8B decode shape (32 query / 8 KV heads, head dim 128, ``--tokens`` keys), FA-SSA at
MSR 0.875 (the first KV head's query heads full), one torch thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from elasticfw.atomic import atomic_write_text
from elasticfw.attention.inputs import check_layout
from elasticfw.attention.seq import SeqInfo
from elasticfw.kernels import decode_attention as decode_module
from elasticfw.kernels import triton_unavailable
from elasticfw.provenance import environment
from elasticfw.registry import get_registry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_host_timing import HEAD_DIM, HEADS, KV_HEADS, _NoLaunch


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, 1, HEAD_DIM, generator=g)
    k = torch.randn(1, KV_HEADS, args.tokens, HEAD_DIM, generator=g)
    v = torch.randn(1, KV_HEADS, args.tokens, HEAD_DIM, generator=g)
    seq = SeqInfo.dense(1, 1, args.tokens, cpu)
    registry = get_registry()

    def make(kind: str, name: str, **cfg: Any) -> Any:
        return registry.make(kind, registry.entry(kind, name).config_class(**cfg))

    layouts = tuple(replace(make("sparse_mode", name, **cfg).build_layout(q, k, seq), reusable=True) for name, cfg in
                    (("full", {"block_size": 64}),
                     ("streaming", {"sink_tokens": 128, "local_tokens": 2048, "block_size": 64})))
    hard = torch.zeros(1, HEADS, dtype=torch.bool)
    hard[:, HEADS // KV_HEADS:] = True
    new, old = (make("executor", "split", decode_sparse="kernel") for _ in range(2))

    def every_call(layouts: Any, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo) -> None:
        for layout in layouts:
            check_layout(layout, q, k, seq, context="executor 'split'")

    old._check_layouts = every_call
    sides = {name: (lambda ex=ex: ex.attend_routed(q, k, v, seq, hard=hard, layouts=layouts, scale=HEAD_DIM**-0.5,
                                                   need_lse=False))
             for name, ex in (("new", new), ("old", old))}
    for fn in sides.values():
        for _ in range(args.warmup):
            fn()
    blocks: dict[str, list[float]] = {name: [] for name in sides}
    for b in range(args.blocks):
        for name in (("new", "old") if b % 2 == 0 else ("old", "new")):
            start = time.perf_counter()
            for _ in range(args.calls):
                sides[name]()
            blocks[name].append(1e6 * (time.perf_counter() - start) / args.calls)
    summary = {name: {"median_us": statistics.median(x), "min_us": min(x), "blocks": len(x)} for name, x in blocks.items()}
    return {"benchmark": "ab_layout_checks", "what": __doc__, "environment": environment(cpu), "tokens": args.tokens,
            "calls": args.calls, "threads": 1, "blocks_of_calls_us": blocks, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=60, help="blocks of --calls calls per side")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--tokens", type=int, default=2048, help="keys in the cache")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    reason = triton_unavailable(torch.device("cpu"))
    if reason is not None:
        p.error(f"the decode kernel's host code needs Triton on the CPU (TRITON_INTERPRET=1): {reason}")
    launches = decode_module._decode_split_kernel, decode_module._merge_kernel
    decode_module._decode_split_kernel = decode_module._merge_kernel = _NoLaunch()  # type: ignore[assignment]
    try:
        report = run(args)
    finally:
        decode_module._decode_split_kernel, decode_module._merge_kernel = launches
    print(json.dumps(report["summary"], indent=1))
    if args.json is not None:
        atomic_write_text(args.json, json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
