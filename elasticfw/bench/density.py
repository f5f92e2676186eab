"""How the block-sparse kernel's time scales with the blocks it computes (the kernel's speed criteria).

    python -m elasticfw.bench.density --out results/bench/NAME/density.json               # one GPU
    python -m elasticfw.bench.density --seq 32768 --tiles 128,64,4,3 128,128,8,2 --out ...
    python -m elasticfw.bench.density --device cpu --seq 512 --q-heads 4 --kv-heads 2 --head-dim 16 --out /tmp/d.json

Per sequence length (B = 1, Llama-3.1-8B attention shape by default, bf16, Gaussian q/k/v): the
``sdpa_cudnn`` baseline and ``flex@<density>``, the registered ``flex`` executor on a random block
layout keeping that share of the causal blocks (never ``dense_causal``, so density 1 still runs
the block-sparse path); ``--tiles`` and ``--triton`` repeat it per FlexAttention tile
configuration or through the Triton block-sparse kernel. Layouts are converted before the timed
calls. Each row: median time, ``ratio_vs_full``, ``ratio_vs_cudnn`` and throughput; ``criteria``
(density 0.5 within 0.6 of density 1, density 1 within 1.25 of cuDNN) and a PNG plot. The executor
comes from the registry, as a third party's would. Details: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from elasticfw.atomic import atomic_write_text
from elasticfw.attention.layout import BlockLayout, block_grid
from elasticfw.attention.seq import SeqInfo
from elasticfw.bench.timing import DTYPES, Recorder, causal_flops, make_executor, time_ms
from elasticfw.provenance import environment

#: the kernel's speed criteria: (figure, density, row field, limit): the row's ratio at ``density`` <= limit
CRITERIA = (
    ("density 0.5 / own density 1", 0.5, "ratio_vs_full", 0.6),
    ("density 1 / dense cuDNN", 1.0, "ratio_vs_cudnn", 1.25),
)


def random_block_layout(seq: SeqInfo, heads: int, block_size: int, density: float, *, seed: int = 0) -> BlockLayout:
    """(1, heads, NQB, NKB) layout keeping ``round(density * (t + 1))`` (at least 1) of the causal
    blocks of each row ``t``: the diagonal, then others at random without replacement."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    q_blocks, k_blocks = block_grid(seq, block_size)  # (B, NQB, 1), (1, 1, NKB)
    causal = (k_blocks <= q_blocks)[:1]  # (1, NQB, NKB)
    nqb, nkb = causal.shape[1], causal.shape[2]
    g = torch.Generator(device="cpu").manual_seed(seed)
    score = torch.rand(heads, nqb, nkb, generator=g).to(causal.device)
    diag = k_blocks[0] == q_blocks[0]  # (NQB, NKB)
    score = torch.where(diag, 2.0, score)  # the diagonal first
    score = torch.where(causal, score, -1.0)  # never a future block
    count = causal[0].sum(-1)  # (NQB,)
    keep = torch.clamp(torch.round(density * count.double()).long(), min=1)
    rank = score.argsort(-1, descending=True).argsort(-1)  # 0 = best
    blocks = (rank < keep[None, :, None]) & causal
    return BlockLayout(blocks[None], block_size)


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, row: dict[str, Any]) -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.CUDNN_ATTENTION] if q.is_cuda else [SDPBackend.MATH]

    def call(k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        with sdpa_kernel(backends):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=gqa
            )

    try:
        with torch.no_grad():
            call(k, v, True)
        return lambda: call(k, v, True)
    except RuntimeError as exc:  # no GQA in this backend: repeat K/V outside the timed region
        row["gqa_note"] = f"enable_gqa unsupported ({str(exc).splitlines()[0][:120]}); K/V repeated"
        group = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: call(kr, vr, False)


def _configs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = [("flex", {"sparse_kernel": "flex"})]  # FlexAttention itself
    for spec in args.tiles or []:
        try:
            bm, bn, warps, stages = (int(x) for x in spec.split(","))
        except ValueError:
            raise SystemExit(f"--tiles {spec!r}: expected BM,BN,WARPS,STAGES, e.g. 128,64,4,3") from None
        options = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        out.append((f"flex[{spec}]", {"sparse_kernel": "flex", "kernel_options": options}))  # never the kernel
    for spec in args.triton or []:
        try:
            tiles = [int(x) for x in spec.split(",")]
        except ValueError:
            raise SystemExit(f"--triton {spec!r}: expected BM,BN,WARPS,STAGES, e.g. 128,64,8,3") from None
        if len(tiles) != 4:
            raise SystemExit(f"--triton {spec!r}: expected BM,BN,WARPS,STAGES, e.g. 128,64,8,3")
        out.append((f"triton[{spec}]", {"sparse_kernel": "triton", "sparse_kernel_tiles": tiles}))
    return out


def bench_seq(S: int, args: argparse.Namespace, rec: Recorder, device: torch.device) -> None:
    dtype = DTYPES[args.dtype]
    hq, hkv, dim = args.q_heads, args.kv_heads, args.head_dim
    g = torch.Generator(device="cpu").manual_seed(S)
    q = torch.randn(1, hq, S, dim, generator=g).to(device, dtype)
    k = torch.randn(1, hkv, S, dim, generator=g).to(device, dtype)
    v = torch.randn(1, hkv, S, dim, generator=g).to(device, dtype)
    seq = SeqInfo.dense(1, S, S, device=device)
    scale = dim**-0.5
    flops = causal_flops(1, hq, S, dim)
    base: dict[str, float] = {}

    def cudnn_body(row: dict[str, Any]) -> None:
        row["ms"] = time_ms(_cudnn(q, k, v, scale, row), device, args)
        row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
        base["cudnn"] = row["ms"]

    rec.run({"seq": S, "name": "sdpa_cudnn" if device.type == "cuda" else "sdpa_math", "kind": "fwd"}, cudnn_body)
    # reusable: each executor converts a layout (BlockMask or work lists) once, outside the timed
    # calls, so the ratios are the kernel's alone, as cuDNN's baseline is
    layouts = {d: replace(random_block_layout(seq, hq, args.block_size, d, seed=S), reusable=True)
               for d in sorted(args.densities, reverse=True)}
    causal_blocks = int(layouts[max(layouts)].blocks.shape[2] * (layouts[max(layouts)].blocks.shape[2] + 1) // 2)
    for label, extra in _configs(args):
        executor = make_executor("flex", implementation=args.implementation, kernel_block_size=args.block_size, **extra)
        own: dict[str, float] = {}
        for density, layout in layouts.items():

            def body(row: dict[str, Any], layout: BlockLayout = layout, executor: Any = executor,
                     own: dict[str, float] = own) -> None:
                kept = int(layout.blocks.sum()) / layout.blocks.shape[1]
                row["realised_density"] = kept / causal_blocks

                def fn() -> None:
                    with torch.no_grad():
                        executor.attend(q, k, v, layout, seq, scale=scale, need_lse=False)

                fn()  # compiles, and converts the layout once (kept by the executor: reusable)
                row["ms"] = time_ms(fn, device, args)
                row["block_tflops"] = flops * row["realised_density"] / (row["ms"] * 1e-3) / 1e12
                if row["density"] == 1.0:
                    own["density_1"] = row["ms"]
                row["ratio_vs_full"] = row["ms"] / own["density_1"] if "density_1" in own else None
                row["ratio_vs_cudnn"] = row["ms"] / base["cudnn"] if "cudnn" in base else None

            rec.run({"seq": S, "name": f"{label}@{density:g}", "config": label, "density": density, "kind": "fwd"}, body)


def criteria(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per sequence length: the kernel's two speed criteria for the configuration fastest at density 1."""
    out = []
    for S in sorted({r["seq"] for r in rows}):
        timed = [r for r in rows if r["seq"] == S and r.get("ms") is not None and "config" in r]
        full = [r for r in timed if r["density"] == 1.0]
        if not full:
            continue
        best = min(full, key=lambda r: r["ms"])["config"]
        for figure, density, field, limit in CRITERIA:
            row = next((r for r in timed if r["config"] == best and r["density"] == density), None)
            value = None if row is None else row[field]
            out.append({"seq": S, "figure": figure, "config": best, "value": value, "limit": limit,
                        "met": value is not None and value <= limit})
    return out


def plot(data: dict[str, Any], path: Path) -> Path | None:
    """Time / dense cuDNN time against the computed share of the causal blocks, one line per
    configuration and length, with the ideal proportional line of the fastest full-density one (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in data["results"] if r.get("ms") is not None and "config" in r and r.get("ratio_vs_cudnn")]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for key in dict.fromkeys((r["config"], r["seq"]) for r in rows):
        pts = sorted((r["realised_density"], r["ratio_vs_cudnn"]) for r in rows if (r["config"], r["seq"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} S={key[1]}")
    best = min((r for r in rows if r["density"] == 1.0), key=lambda r: r["ratio_vs_cudnn"])
    ax.plot([0, 1], [0, best["ratio_vs_cudnn"]], color="grey", lw=0.8, ls=":", label="proportional to blocks")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("computed share of the causal blocks")
    ax.set_ylabel("time / dense cuDNN SDPA")
    ax.set_title(f"block-sparse flex attention, {data['environment'].get('gpu') or 'cpu'}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m elasticfw.bench.density", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file to write (refused if it exists)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.75, 0.5, 0.25, 0.125])
    p.add_argument("--block-size", type=int, default=128, help="layout and FlexAttention tile size")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--implementation", default="auto", help="flex executor implementation")
    p.add_argument("--tiles", nargs="*", default=[], metavar="BM,BN,WARPS,STAGES",
                   help="also time these FlexAttention kernel_options")
    p.add_argument("--triton", nargs="*", default=[], metavar="BM,BN,WARPS,STAGES",
                   help="also time the flex executor's Triton block-sparse kernel (sparse_kernel: triton) with "
                   "these launch configurations (sparse_kernel_tiles), named triton[BM,BN,WARPS,STAGES]")
    p.add_argument("--warmup-ms", type=int, default=50)
    p.add_argument("--rep-ms", type=int, default=300)
    p.add_argument("--cpu-warmup", type=int, default=0)
    p.add_argument("--cpu-iters", type=int, default=1)
    args = p.parse_args(argv)
    if 1.0 not in args.densities:
        p.error("--densities must include 1 (the reference of ratio_vs_full)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.out.exists() and not args.overwrite:
        print(f"[density] {args.out} exists; pass --overwrite to replace it", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("[density] CUDA requested but not available", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "benchmark": "elasticfw.bench.density",
        "environment": environment(device),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "shape": {"batch": 1, "q_heads": args.q_heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                  "dtype": args.dtype, "causal": True, "inputs": "gaussian"},
        # false in every write until the last: a run killed midway leaves a file that says so
        "complete": False,
    }

    def write(rec: Recorder) -> None:
        data = dict(report, results=rec.rows, criteria=criteria(rec.rows), failures=rec.failures)
        atomic_write_text(args.out, json.dumps(data, indent=2, default=str) + "\n")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    rec = Recorder(on_row=write)
    for S in args.seq:
        bench_seq(S, args, rec, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["complete"] = True
    write(rec)
    png = plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
    for c in criteria(rec.rows):
        value = "missing" if c["value"] is None else f"{c['value']:.3f}"
        print(f"[density] S={c['seq']} {c['figure']} ({c['config']}): {value} (limit {c['limit']}): "
              f"{'met' if c['met'] else 'NOT met'}")
    print(f"[density] wrote {args.out}" + (f" and {png}" if png else "") + f"; {len(rec.failures)} failure(s)")
    return 1 if rec.failures else 0


if __name__ == "__main__":
    sys.exit(main())
