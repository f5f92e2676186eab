"""One attention layer per sparse mode on the CPU: planning and the split executor's attention, at
prefill and at a decode step, against full attention (where the CPU demo's time goes).

    python scripts/cpu_layer_timing.py --json results/bench/NAME/cpu_layers.json

At the default model's attention shape (SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64) and
the CPU demo's batch (4 samples of 1,440 tokens, float32), on the attention benchmark's structured
q/k (:func:`elasticfw.bench.inputs.structured_qkv`), each mode with its defaults at 64-token blocks
(streaming: the demo's sink 64 / local 256): the median milliseconds of ``--repeats`` calls of
``build_layout`` (``plan``) and of ``SplitExecutor.attend`` over that layout (``attend``; a layout
that depends only on the lengths marked reusable, as the runtime hands it to every layer), for the
prefill and for one decode step (the last query over every key), with the layout's ESR.
``--sdpa-masks`` also times one dense SDPA layer with ``is_causal``, with a 4-D bool mask and with a
4-D float mask written into a reused buffer (what the gathered path's mask costs). ``--json FILE``
writes the figures with the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from elasticfw.attention.layout import esr
from elasticfw.attention.seq import SeqInfo
from elasticfw.bench.inputs import structured_qkv
from elasticfw.provenance import environment
from elasticfw.registry import get_registry
from elasticfw.testing.modes import make_mode

MODES: dict[str, dict[str, Any]] = {
    "full": {"block_size": 64},
    "streaming": {"block_size": 64, "sink_tokens": 64, "local_tokens": 256},
    "xattention": {"block_size": 64},
    "moba": {"block_size": 64},
    "nsa": {"block_size": 64},
}


def _timed(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _sdpa_masks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, repeats: int) -> dict[str, float]:
    batch, hq, n, _ = q.shape
    causal = torch.ones(n, n, dtype=torch.bool).tril().expand(batch, hq, n, n).contiguous()
    buffer = torch.empty(batch, hq, n, n)
    zero, ninf = torch.zeros(()), torch.full((), float("-inf"))

    def reused_float() -> torch.Tensor:
        torch.where(causal, zero, ninf, out=buffer)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=buffer, enable_gqa=True)

    return {
        "is_causal": _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), repeats),
        "bool 4-D mask": _timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True),
                                repeats),
        "float 4-D mask, reused buffer (conversion included)": _timed(reused_float, repeats),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1440)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--sdpa-masks", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.batch < 1 or args.tokens < 2 or args.repeats < 1:
        p.error("--batch and --repeats must be at least 1, --tokens at least 2")
    q, k, v = structured_qkv(args.batch, 9, 3, args.tokens, 64, seed=0)
    split = get_registry().get("executor", "split")()
    shapes = {
        "prefill": (q, SeqInfo.dense(args.batch, args.tokens, args.tokens)),
        "decode": (q[:, :, -1:], SeqInfo.dense(args.batch, 1, args.tokens)),
    }
    report: dict[str, Any] = {"benchmark": "cpu_layer_timing", "environment": environment(torch.device("cpu")),
                              "batch": args.batch, "tokens": args.tokens, "threads": torch.get_num_threads(),
                              "ms": {}}
    with torch.no_grad():
        for phase, (qq, seq) in shapes.items():
            for name in args.modes:
                mode = make_mode(name, MODES[name])
                layout = mode.build_layout(qq, k, seq)
                if not mode.layout_depends_on_inputs:  # as the runtime hands it to every layer of a forward
                    layout = dataclasses.replace(layout, reusable=True)
                row = {
                    "plan": _timed(lambda m=mode, a=qq, s=seq: m.build_layout(a, k, s), args.repeats),
                    "attend": _timed(lambda a=qq, s=seq, lay=layout: split.attend(a, k, v, lay, s, scale=0.125,
                                                                                  need_lse=False), args.repeats),
                    "esr": float(esr(layout, seq, qq.shape[1]).mean()),
                }
                report["ms"][f"{phase} {name}"] = row
                print(f"{phase:8s} {name:10s} plan {row['plan']:8.3f} ms  attend {row['attend']:8.3f} ms  "
                      f"ESR {row['esr']:.3f}", flush=True)
        if args.sdpa_masks:
            report["sdpa_masks_ms"] = _sdpa_masks(q, k, v, args.repeats)
            for label, ms in report["sdpa_masks_ms"].items():
                print(f"dense SDPA, {label}: {ms:.1f} ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
