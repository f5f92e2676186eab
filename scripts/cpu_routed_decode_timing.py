"""One routed layer's decode step through the split executor on the CPU: one masked SDPA call
against two calls (the dense heads, then the streaming heads over their own keys), and dense SDPA.

    python scripts/cpu_routed_decode_timing.py --json results/bench/routed-decode-masked-call/cpu_routed_decode.json

At the default model's attention shape (SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64,
float32), one query per sample at the last of S keys (``SeqInfo.dense``: no padding), KV head 0
full and KV heads 1-2 streaming (sink 64, window 256, 64-token blocks; 6 sparse query heads), for
each ``--batch`` and ``--keys``: the fastest of 7 blocks of ``--calls`` calls (microseconds per
call) of dense SDPA over every head (``dense``), ``SplitExecutor.attend_routed`` with the one-call
masked form forced (``masked``: ``gathered.MASKED_DECODE_PAIRS`` raised past the step), with the
two calls forced (``two_calls``: the bound 0), and as configured (``auto``), with the pairs the
masked call adds (``pairs``: batch x sparse heads x dropped keys), which is what the bound
compares. Every routed output is checked against the two-call one first. This is how
``MASKED_DECODE_PAIRS`` was chosen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from decode_host_timing import _timed  # the script's folder is sys.path[0]

from elasticfw.attention.seq import SeqInfo
from elasticfw.provenance import environment
from elasticfw.registry import get_registry
from elasticfw.testing.modes import make_mode
from elasticfw_plugins.executors import gathered

HQ, HKV, DIM, SINK, LOCAL, BLOCK = 9, 3, 64, 64, 256, 64


def _fastest_us(fn: Callable[[], object], calls: int) -> float:
    """Microseconds per call of the fastest of 7 blocks of ``calls`` calls, after 10 warm-up calls."""
    return _timed(fn, calls, 10, torch.device("cpu"), blocks=7)["host_us_min"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--keys", type=int, nargs="+", default=[1441, 4097, 8193, 16385])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    split = get_registry().get("executor", "split")()
    full = make_mode("full", {"block_size": BLOCK})
    stream = make_mode("streaming", {"block_size": BLOCK, "sink_tokens": SINK, "local_tokens": LOCAL})
    rows: list[dict[str, Any]] = []
    configured = gathered.MASKED_DECODE_PAIRS
    g = torch.Generator().manual_seed(0)
    for batch in args.batch:
        for keys in args.keys:
            q = torch.randn(batch, HQ, 1, DIM, generator=g)
            k, v = (torch.randn(batch, HKV, keys, DIM, generator=g) for _ in range(2))
            seq = SeqInfo.dense(batch, 1, keys)
            # as the runtime hands them to every layer of a step: one reusable object per mode
            layouts = tuple(dataclasses.replace(m.build_layout(q, k, seq), reusable=True) for m in (full, stream))
            hard = torch.tensor([[False] * (HQ // HKV) + [True] * (HQ - HQ // HKV)]).expand(batch, HQ)
            row: dict[str, Any] = {"batch": batch, "keys": keys}

            def routed(q=q, k=k, v=v, seq=seq, layouts=layouts, hard=hard) -> torch.Tensor:
                return split.attend_routed(q, k, v, seq, hard=hard, layouts=layouts, scale=DIM**-0.5,
                                           need_lse=False, hard_host=hard).out

            with torch.no_grad():
                row["dense"] = _fastest_us(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                    q, k, v, scale=DIM**-0.5, enable_gqa=True), args.calls)
                outputs = {}
                try:
                    for label, bound in (("two_calls", 0), ("masked", 2**62), ("auto", configured)):
                        gathered.MASKED_DECODE_PAIRS = bound
                        outputs[label] = routed()
                        row[label] = _fastest_us(routed, args.calls)
                finally:
                    gathered.MASKED_DECODE_PAIRS = configured
            for label in ("masked", "auto"):
                torch.testing.assert_close(outputs[label], outputs["two_calls"], rtol=1e-5, atol=1e-5)
            dropped = gathered.decode_dropped_keys(layouts[1], keys)  # the streaming heads' row
            row["pairs"] = batch * (HQ - HQ // HKV) * (dropped or 0)
            rows.append(row)
            print(f"B={batch} S={keys:6d} dense {row['dense']:8.1f} us  two calls {row['two_calls']:8.1f}  "
                  f"masked {row['masked']:8.1f}  auto {row['auto']:8.1f}  pairs {row['pairs']}", flush=True)
    if args.json:
        report = {"benchmark": "cpu_routed_decode_timing", "environment": environment(torch.device("cpu")),
                  "threads": torch.get_num_threads(), "masked_decode_pairs": configured, "us_per_call": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
