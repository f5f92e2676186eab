"""Time the FA-SSA layer's streaming launch under a few FlexAttention tile configurations (one GPU).

    python scripts/flex_tuning.py --seq 131072 --out results/bench/flex-streaming-tiles/flex_tuning.json

The `split` executor runs a layer's streaming heads through FlexAttention over the streaming
layout (sink 128, local 2048, blocks of 64, coarsened to 128-token kernel tiles) with the dense
heads' rows emptied. This script times that launch (MSR 0.875: the first KV head's 4 query heads
dense, 28 streaming) for FlexAttention's default tiles and for each ``--options`` entry, against
dense causal cuDNN SDPA of the whole layer, and checks each configuration's output against the
default one. Which configuration to pin (``split.flex.kernel_options``) follows from the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from elasticfw.atomic import atomic_write_text
from elasticfw.attention.seq import SeqInfo
from elasticfw.provenance import environment
from elasticfw.registry import get_registry

DEFAULT_OPTIONS = [
    {},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--options", type=json.loads, nargs="*", default=None, help="JSON kernel_options dicts")
    args = p.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    dev = torch.device("cuda")
    registry = get_registry()
    S, hq, hkv, d = args.seq, 32, 8, 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, S, d, generator=g).to(dev, torch.bfloat16) for h in (hq, hkv, hkv))
    seq = SeqInfo.dense(1, S, S, dev)
    entry = registry.entry("sparse_mode", "streaming")
    mode = entry.cls(entry.config_class(sink_tokens=128, local_tokens=2048, block_size=64))
    layout = mode.build_layout(q, k, seq)
    keep = torch.ones(1, hq, dtype=torch.bool, device=dev)
    keep[0, :4] = False  # KV head 0's query heads run dense
    with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        dense_ms = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), warmup=50, rep=300)
    rows, ref = [], None
    flex_cls = registry.entry("executor", "flex")
    for options in args.options or DEFAULT_OPTIONS:
        row = {"kernel_options": options, "error": None}
        try:
            ex = flex_cls.cls(flex_cls.config_class(kernel_options=options or None))

            def launch(ex=ex):
                return ex.attend(q, k, v, layout, seq, scale=d**-0.5, need_lse=False, keep_heads=keep,
                                 keep_key=("tuning",)).out

            with torch.no_grad():
                out = launch()
                if ref is None:
                    ref = out
                row["max_abs_vs_default"] = float((out[:, 4:].float() - ref[:, 4:].float()).abs().max())
                row["ms"] = do_bench(launch, warmup=50, rep=300)
            row["ratio_vs_dense_cudnn"] = row["ms"] / dense_ms
        except Exception as exc:  # noqa: BLE001 - one configuration failing is recorded, the others run
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"benchmark": "flex_tuning", "seq": S, "dense_cudnn_ms": dense_ms, "rows": rows,
              "environment": environment(dev)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
