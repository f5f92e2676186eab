"""Time the NSA and MoBA planners (``build_layout``) with their torch and Triton backends against
one dense causal cuDNN SDPA layer at the same shape, on a CUDA device.

    python scripts/planner_timing.py                       # 128K, B=1, Hq 32, Hkv 8, d 128, bf16
    python scripts/planner_timing.py --tokens 32768 --skip-torch --nsa-tiles 256,64 128,64 256,128

Inputs are the attention benchmark's structured q/k (``elasticfw.bench.inputs.structured_qkv``).
Prints the median of ``--repeats`` CUDA-event-timed calls (after a warm-up call, which compiles
the kernels) and the ratio to the dense layer for: NSA (paper defaults, ``query_granularity:
block``) with ``scorer`` torch and triton, the Triton importance alone with ``split`` 1, 2 and 3
(16-bit terms of the compressed keys) and with ``--nsa-tiles`` overrides (``BM,BN`` or
``BM,BN,STAGES``); MoBA (paper defaults,
``query_granularity: token``) with ``planner`` torch and triton. Then how far the backends'
results are apart: NSA importances (max relative difference) and layouts (blocks that differ),
MoBA layouts. ``--json FILE`` also writes the figures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from xattention_planning_timing import (  # the script's folder is sys.path[0]
    add_shape_arguments,
    dense_layer,
    structured_layer,
    timed,
)

from elasticfw.provenance import environment
from elasticfw.testing.modes import make_mode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(p)
    p.add_argument("--skip-torch", action="store_true", help="skip the (slow) torch backends")
    p.add_argument("--nsa-tiles", nargs="*", default=[], metavar="BM,BN[,STAGES]",
                   help="NSA importance tile overrides (and pipeline stages; default: the module's)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--profile", action="store_true", help="also print a torch.profiler table of each Triton planner")
    args = p.parse_args()
    q, k, v, seq = structured_layer(args)
    n, hq, hkv, d = args.tokens, args.query_heads, args.kv_heads, args.head_dim
    dense = dense_layer(q, k, v)
    results: dict[str, float] = {}
    notes: dict[str, float | int] = {}
    with torch.no_grad():
        results["dense cuDNN SDPA layer"] = timed(dense, args.repeats)
        nsa = {b: make_mode("nsa", {"scorer": b}) for b in ("torch", "triton")}
        if not args.skip_torch:
            results["nsa build_layout, scorer torch"] = timed(lambda: nsa["torch"].build_layout(q, k, seq), args.repeats)
        results["nsa build_layout, scorer triton"] = timed(lambda: nsa["triton"].build_layout(q, k, seq), args.repeats)
        from elasticfw.kernels.nsa_importance import nsa_block_importance_triton

        cfg = nsa["triton"].config
        geo = dict(block_size=cfg.block_size, kernel=cfg.compress_kernel, stride=cfg.compress_stride)
        imp = {}
        for split in (1, 2, 3):
            results[f"  nsa importance only, split {split}"] = timed(
                lambda split=split: nsa_block_importance_triton(q, k, seq, split=split, **geo), args.repeats)
            imp[split] = nsa_block_importance_triton(q, k, seq, split=split, **geo)
        from elasticfw.kernels import nsa_importance as ni

        for spec in args.nsa_tiles:
            bm, bn, *rest = (int(x) for x in spec.split(","))
            saved = ni.NUM_STAGES
            ni.NUM_STAGES = rest[0] if rest else saved
            try:
                results[f"  nsa importance only, tiles {spec}"] = timed(
                    lambda bm=bm, bn=bn: nsa_block_importance_triton(q, k, seq, block_m=bm, block_n=bn, **geo),
                    args.repeats)
            except Exception as exc:  # noqa: BLE001 - a tile configuration that does not compile is reported
                print(f"nsa tiles {spec}: {type(exc).__name__}: {str(exc)[:200]}")
            finally:
                ni.NUM_STAGES = saved
        if not args.skip_torch:
            ref = nsa["torch"].block_importance(q, k, seq)
            for split in (1, 2, 3):
                notes[f"nsa importance split {split}: max |diff| / max"] = float(
                    ((imp[split] - ref).abs().max() / ref.abs().max()).item())
            a, b = nsa["torch"].build_layout(q, k, seq).blocks, nsa["triton"].build_layout(q, k, seq).blocks
            notes["nsa layout blocks differing (triton vs torch)"] = int((a != b).sum().item())
            notes["nsa layout blocks kept (torch)"] = int(a.sum().item())
        del imp

        moba = {b: make_mode("moba", {"planner": b}) for b in ("torch", "triton")}
        if not args.skip_torch:
            results["moba build_layout, planner torch"] = timed(lambda: moba["torch"].build_layout(q, k, seq),
                                                                args.repeats)
        results["moba build_layout, planner triton"] = timed(lambda: moba["triton"].build_layout(q, k, seq),
                                                             args.repeats)
        if not args.skip_torch:
            a, b = moba["torch"].build_layout(q, k, seq), moba["triton"].build_layout(q, k, seq)
            notes["moba layout blocks differing (triton vs torch)"] = int((a.blocks != b.blocks).sum().item())
            notes["moba layout blocks kept (torch)"] = int(a.blocks.sum().item())
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for label, fn in (("nsa triton", lambda: nsa["triton"].build_layout(q, k, seq)),
                              ("moba triton", lambda: moba["triton"].build_layout(q, k, seq))):
                fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    fn()
                    torch.cuda.synchronize()
                print(f"-- profile: {label} build_layout")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    base = results["dense cuDNN SDPA layer"]
    print(f"{torch.cuda.get_device_name()}: B=1, {n} tokens, Hq={hq}, Hkv={hkv}, d={d}, bf16, structured inputs")
    for name, ms in results.items():
        print(f"{name:48s} {ms:9.2f} ms  {ms / base:6.3f}x dense")
    for name, value in notes.items():
        print(f"{name}: {value:.3g}" if isinstance(value, float) else f"{name}: {value}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"benchmark": "planner_timing", "environment": environment(q.device), "tokens": n,
                  "ms": results, "ratio_vs_dense": {k_: ms / base for k_, ms in results.items()}, "notes": notes}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
