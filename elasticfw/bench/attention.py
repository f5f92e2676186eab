"""Attention kernel benchmark: dense SDPA baselines vs the `flex` executor on every registered mode.

    python -m elasticfw.bench.attention --out results/bench/NAME/attention_bench.json
    python -m elasticfw.bench.attention --out results/bench/layout-memory/layout_memory_128k.json --seq --layout-memory 131072
    python -m elasticfw.bench.attention --device cpu --seq 256 --q-heads 4 --kv-heads 2 --head-dim 16 \\
        --out /tmp/bench.json                                   # smoke run on CPU

Default shape: Llama-3.1-8B attention (B=1, 32 query / 8 KV heads, head dim 128, causal, bf16),
S in {8192, 32768}, structured inputs (:func:`elasticfw.bench.inputs.structured_qkv`). Rows: the
dense SDPA baselines (``sdpa_cudnn`` is every ``ratio``'s), FlexAttention on a prebuilt causal
mask, and per mode ``flex:``, ``layout:``, ``convert:`` and ``mode:``, plus the Elastic Attention
case ``flex:hybrid(full+<mode>)`` (``--mix``: a K-way layer, :mod:`elasticfw.bench.attention_mix`);
forward, and forward+backward where differentiable, with each layout's ESR beside its time. ``--layout-memory N`` measures each mode's layout memory at N tokens.
A failing entry records its error and the run goes on (exit status 1); the JSON records the
environment and commit. What each row times: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from elasticfw.atomic import atomic_write_text
from elasticfw.attention.flex_mask import to_block_mask
from elasticfw.attention.layout import BlockLayout, causal_layout, esr
from elasticfw.attention.mode import AttentionMode
from elasticfw.attention.seq import SeqInfo
from elasticfw.bench.attention_checks import check_lengths, correctness, layout_memory, routed_correctness
from elasticfw.bench.attention_mix import mix_rows
from elasticfw.bench.attention_setup import bench_modes, flex_config, hybrid, hybrid_heads, inner_flex
from elasticfw.bench.inputs import InputStructure, describe, random_qkv, structured_qkv
from elasticfw.bench.timing import (
    BASELINE_AGAIN,
    DTYPES,
    Recorder,
    causal_flops,
    first_call_s,
    make_executor,
    time_ms,
)
from elasticfw.provenance import environment

_RAW_FLEX: list[Any] = []


def _raw_flex() -> Any:
    """torch's compiled ``flex_attention`` itself (the kernel alone, no elasticfw around it)."""
    if not _RAW_FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _RAW_FLEX.append(torch.compile(flex_attention, dynamic=False, fullgraph=True))
    return _RAW_FLEX[0]


def bench_seq(S: int, args: argparse.Namespace, rec: Recorder, device: torch.device) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel


    dtype = DTYPES[args.dtype]
    B, hq, hkv, D = args.batch, args.q_heads, args.kv_heads, args.head_dim
    scale = D**-0.5
    first_row = len(rec.rows)  # this length's rows start here (--seq may name a length twice)
    g = torch.Generator(device="cpu").manual_seed(0)
    if args.inputs == "structured":  # sinks, locality and recurring topics (elasticfw.bench.inputs)
        q0, k0, v0 = (t.to(device, dtype) for t in structured_qkv(B, hq, hkv, S, D, seed=0))
    else:
        q0, k0, v0 = (t.to(device, dtype) for t in random_qkv(B, hq, hkv, S, D, generator=g))
    dout = torch.randn(B, hq, S, D, generator=g).to(device, dtype)
    seq = SeqInfo.dense(B, S, S, device=device)
    flops = causal_flops(B, hq, S, D)
    base: dict[str, float] = {}

    def leaves():
        return [t.detach().clone().requires_grad_(True) for t in (q0, k0, v0)]

    def finish(row: dict[str, Any], ms: float, dense: bool) -> None:
        row["ms"] = ms
        if dense:
            mult = 1.0 if row["kind"] == "fwd" else 3.5  # backward = 2.5x forward FLOPs
            row["tflops"] = flops * mult / (ms * 1e-3) / 1e12
        if row["name"] == args.baseline_name:
            base[row["kind"]] = ms
        row["ratio_vs_" + args.baseline_name] = ms / base[row["kind"]] if row["kind"] in base else None

    # -- dense SDPA baselines ------------------------------------------------------------
    backends = (
        [("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)]
        if device.type == "cuda"
        else [("sdpa_math", SDPBackend.MATH)]
    )
    def sdpa_rows(name: str, backend: Any, repeat: bool = False) -> None:
        for kind in ("fwd", "fwd_bwd"):
            if kind == "fwd_bwd" and args.no_backward:
                continue

            def sdpa_body(row, backend=backend, kind=kind):
                def sdpa(q, k, v, gqa):
                    with sdpa_kernel(backend):
                        if gqa:
                            return torch.nn.functional.scaled_dot_product_attention(
                                q, k, v, is_causal=True, scale=scale, enable_gqa=True
                            )
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, is_causal=True, scale=scale
                        )

                q, k, v = leaves() if kind == "fwd_bwd" else (q0, k0, v0)
                gqa = True
                try:
                    with torch.no_grad():
                        sdpa(q0, k0, v0, True)
                except RuntimeError as exc:  # this backend has no GQA: repeat K/V outside the timed region
                    row["gqa_note"] = (
                        f"enable_gqa unsupported ({str(exc).splitlines()[0][:120]}); K/V repeated"
                    )
                    gqa = False
                    k = k0.repeat_interleave(hq // hkv, 1).requires_grad_(kind == "fwd_bwd")
                    v = v0.repeat_interleave(hq // hkv, 1).requires_grad_(kind == "fwd_bwd")
                if kind == "fwd":

                    def fn():
                        with torch.no_grad():
                            sdpa(q, k, v, gqa)

                    finish(row, time_ms(fn, device, args), dense=True)
                else:

                    def fn():
                        sdpa(q, k, v, gqa).backward(dout)

                    finish(row, time_ms(fn, device, args, grads=[q, k, v]), dense=True)

            rec.run({"seq": S, "name": name + (BASELINE_AGAIN if repeat else ""), "kind": kind}, sdpa_body)

    for name, backend in backends:
        sdpa_rows(name, backend)

    # -- the raw FlexAttention kernel on a prebuilt causal mask --------------------------
    executor = make_executor("flex", **flex_config(args))
    impl = executor.implementation(device)
    for kind in ("fwd", "fwd_bwd"):
        if kind == "fwd_bwd" and (args.no_backward or impl == "eager"):
            continue

        def raw_body(row, kind=kind):
            row["implementation"] = impl
            if impl != "compiled":
                row["skipped"] = f"the raw kernel entry needs the compiled implementation (here: {impl})"
                return
            layout = causal_layout(seq, 128)
            fm = to_block_mask(layout, seq, hq, kernel_block_size=128, compute_q_blocks=kind == "fwd_bwd")
            fn_c = _raw_flex()
            q, k, v = leaves() if kind == "fwd_bwd" else (q0, k0, v0)
            if kind == "fwd":

                def fn():
                    with torch.no_grad():
                        fn_c(q, k, v, block_mask=fm.block_mask, scale=scale, enable_gqa=True)

            else:

                def fn():
                    fn_c(q, k, v, block_mask=fm.block_mask, scale=scale, enable_gqa=True).backward(dout)

            # the same recompile policy as the executor: a raised limit, and loud failure past it
            limit = max(int(torch._dynamo.config.recompile_limit), executor.config.recompile_limit)
            with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
                row["first_call_s"] = first_call_s(fn, device)
                grads = [q, k, v] if kind == "fwd_bwd" else None
                finish(row, time_ms(fn, device, args, grads=grads), dense=True)

        rec.run({"seq": S, "name": "flex_dense_raw", "kind": kind}, raw_body)

    # -- every registered mode through the executor -------------------------------------
    layouts: dict[str, tuple[AttentionMode, BlockLayout]] = {}
    for mode in bench_modes(args):

        def layout_body(row, mode=mode):
            with torch.no_grad():
                row["first_call_s"] = first_call_s(lambda: mode.build_layout(q0, k0, seq), device)
                layout = mode.build_layout(q0, k0, seq)
            if not mode.layout_depends_on_inputs:
                # as the runtime hands one such layout to every layer of a forward: executors convert it
                # once (BlockMask), so a layer's time below holds no conversion, a model's one per forward
                layout = replace(layout, reusable=True)
            layouts[mode.name] = (mode, layout)
            row["block_size"] = layout.block_size
            row["layout_heads"] = layout.num_heads
            row["config"] = mode.config.model_dump()

            def fn():
                with torch.no_grad():
                    mode.build_layout(q0, k0, seq)

            row["ms"] = time_ms(fn, device, args)
            try:
                row["esr_mean"] = float(esr(layout, seq, hq).mean())
            except Exception as exc:  # noqa: BLE001 - sparsity is informative only
                row["esr_error"] = f"{type(exc).__name__}: {exc}"

        rec.run({"seq": S, "name": f"layout:{mode.name}", "kind": "layout"}, layout_body)

    # layout factories, called with no argument (the lambdas bind their layout through a default)
    entries: list[tuple[str, AttentionMode | None, Callable[..., BlockLayout]]] = []
    for name, (mode, layout) in layouts.items():
        entries.append((name, mode, lambda layout=layout: layout))
    if not args.no_hybrid:
        for name, (_mode, layout) in layouts.items():
            if layout.dense_causal:
                continue
            entries.append(
                (
                    f"hybrid(full+{name},msr={args.msr})",
                    None,
                    lambda layout=layout: hybrid(layout, seq, hq, hkv, args.msr),
                )
            )

    for name, side_mode, make_layout in entries:

        def convert_body(row, make_layout=make_layout):
            layout = make_layout()
            kb = executor.kernel_block_size(layout.block_size, impl, device)
            row["kernel_block_size"] = kb

            def fn():
                to_block_mask(layout, seq, hq, kernel_block_size=kb, compute_q_blocks=False)

            row["ms"] = time_ms(fn, device, args)

        rec.run({"seq": S, "name": f"convert:{name}", "kind": "convert"}, convert_body)

        for kind in ("fwd", "fwd_bwd"):
            if kind == "fwd_bwd" and (args.no_backward or impl == "eager"):
                continue

            def flex_body(row, make_layout=make_layout, kind=kind):
                layout = make_layout()
                row["implementation"] = impl
                q, k, v = leaves() if kind == "fwd_bwd" else (q0, k0, v0)
                if kind == "fwd":

                    def fn():
                        with torch.no_grad():
                            executor.attend(q, k, v, layout, seq, scale=scale)

                else:

                    def fn():
                        executor.attend(q, k, v, layout, seq, scale=scale).out.backward(dout)

                row["first_call_s"] = first_call_s(fn, device)
                finish(
                    row,
                    time_ms(fn, device, args, grads=[q, k, v] if kind == "fwd_bwd" else None),
                    dense=False,
                )

            rec.run({"seq": S, "name": f"flex:{name}", "kind": kind}, flex_body)

        if side_mode is not None and type(side_mode).side_branch is not AttentionMode.side_branch:

            def side_body(row, mode=side_mode, make_layout=make_layout):
                layout = make_layout()

                def fn():
                    with torch.no_grad():
                        mode.attend(q0, k0, v0, seq, executor, scale=scale, layout=layout)

                finish(row, time_ms(fn, device, args), dense=False)

            rec.run({"seq": S, "name": f"mode:{name}", "kind": "fwd"}, side_body)

    # -- other executors (e.g. split): every mode alone, and the hybrid through attend_routed ------
    for ex_name in [n for n in args.executors if n != "flex"]:
        other = make_executor(ex_name, **inner_flex(ex_name, args))
        for name, (_mode, layout) in layouts.items():
            def alone(layout: BlockLayout = layout, other: Any = other) -> Any:
                return other.attend(q0, k0, v0, layout, seq, scale=scale, need_lse=False)

            runs: list[tuple[str, Callable[[], Any]]] = [(f"{ex_name}:{name}", alone)]
            if not args.no_hybrid and not layout.dense_causal:

                def routed(layout: BlockLayout = layout, other: Any = other) -> Any:
                    full = causal_layout(seq, layout.block_size)
                    hard = hybrid_heads(seq, hq, hkv, args.msr)
                    return other.attend_routed(q0, k0, v0, seq, hard=hard, layouts=(full, layout), scale=scale,
                                               need_lse=False)

                runs.append((f"{ex_name}:hybrid(full+{name},msr={args.msr})", routed))
            for entry, call in runs:

                def other_body(row, call=call):
                    def fn():
                        with torch.no_grad():
                            call()

                    row["first_call_s"] = first_call_s(fn, device)
                    finish(row, time_ms(fn, device, args), dense=False)

                rec.run({"seq": S, "name": entry, "kind": "fwd"}, other_body)

    if args.mix:  # the K-way layer: heads split among modes, against the sum of its parts
        mix_rows(S, args, rec, device, (q0, k0, v0), seq, layouts, finish)

    # -- the baseline once more, last: a GPU's clock drifts over a run, so every ratio of this length
    # divides by the mean of the baseline's first and last times (both kept, and their spread)
    for name, backend in backends:
        if name == args.baseline_name:
            sdpa_rows(name, backend, repeat=True)
    rebase(rec.rows[first_row:], S, args.baseline_name)


def rebase(rows: list[dict[str, Any]], seq: int, baseline: str) -> None:
    """Divide every ``ratio_vs_<baseline>`` of length ``seq`` in ``rows`` (one length's rows) by the
    mean of the baseline's first and last (``<baseline>@end``) times of its kind, and record both and
    their relative spread on the first baseline row. A kind with one of the two times divides by
    that one (as :mod:`elasticfw.bench.targets` does); with neither, its ratios stay ``None``."""
    key = "ratio_vs_" + baseline
    for kind in ("fwd", "fwd_bwd"):
        pair = [next((r for r in rows if r.get("seq") == seq and r.get("kind") == kind and r.get("name") == n
                      and r.get("ms") is not None), None) for n in (baseline, baseline + BASELINE_AGAIN)]
        times = [r["ms"] for r in pair if r is not None]
        if not times:
            continue
        mean = sum(times) / len(times)
        first, last = pair
        if first is not None and last is not None:
            first["baseline_ms_first_last"] = [first["ms"], last["ms"]]
            first["baseline_spread"] = abs(first["ms"] - last["ms"]) / mean
            first["baseline_ms_mean"] = mean
        for r in rows:
            if r.get("seq") == seq and r.get("kind") == kind and r.get("ms") is not None:
                r[key] = r["ms"] / mean


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m elasticfw.bench.attention", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", type=Path, required=True, help="JSON file to write (refused if it exists)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument(
        "--seq", type=int, nargs="*", default=[8192, 32768], help="sequence lengths (none: skip timing)"
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--modes", nargs="*", default=None, help="registered mode names (default: all)")
    p.add_argument(
        "--set",
        action="append",
        metavar="MODE.FIELD=VALUE",
        help="override a mode's paper-default config, e.g. --set moba.query_granularity=block (repeatable)",
    )
    p.add_argument(
        "--implementation", default="auto", help="flex executor implementation (auto/compiled/...)"
    )
    p.add_argument(
        "--flex-set",
        action="append",
        metavar="FIELD=VALUE",
        help="a flex executor config field for the convert:/flex: entries (and the flex options of executors "
        "that nest them, e.g. split's sparse path), VALUE as YAML, e.g. --flex-set kernel_block_size=64 "
        "--flex-set 'kernel_options={BLOCK_M: 64, BLOCK_N: 64}' --flex-set sparse_kernel=triton (repeatable)",
    )
    p.add_argument(
        "--executors",
        nargs="+",
        default=["flex"],
        help="executors timed: flex (the flex:* entries) and others by name (<name>:<mode>, <name>:hybrid(...) "
        "through attend_routed, need_lse=False; a routed correctness check against the reference first)",
    )
    p.add_argument(
        "--inputs",
        choices=["structured", "random"],
        default="structured",
        help="timed q/k/v: `structured` (sinks, locality, recurring topics: elasticfw.bench.inputs, so that "
        "data-dependent modes skip what they would on a real model) or `random` (standard Gaussian)",
    )
    p.add_argument("--msr", type=float, default=0.875, help="sparse share of KV heads in the hybrid entries")
    p.add_argument("--no-hybrid", action="store_true")
    p.add_argument(
        "--mix", nargs="+", default=None, metavar="MODE=KV_HEADS",
        help="a K-way layer: KV heads per mode in routing order, summing to --kv-heads, e.g. full=1 xattention=3 "
        "streaming=4; timed through each non-flex executor against the sum of its groups alone "
        "(elasticfw.bench.attention_mix)",
    )
    p.add_argument(
        "--no-backward", action="store_true",
        help="time forwards only, and check the forward only (outputs and lse, no gradients)",
    )
    p.add_argument(
        "--layout-memory", type=int, default=None, metavar="N", help="also measure layout memory at N tokens"
    )
    p.add_argument(
        "--check-seq",
        type=int,
        default=2048,
        help="correctness check vs the reference at this length, or for a mode whose layout is dense there "
        "at the first doubling (up to 4x) where it is sparse (0: skip)",
    )
    p.add_argument("--warmup-ms", type=int, default=100, help="CUDA: do_bench warmup budget (ms)")
    p.add_argument("--rep-ms", type=int, default=500, help="CUDA: do_bench repetition budget (ms)")
    p.add_argument("--cpu-warmup", type=int, default=1)
    p.add_argument("--cpu-iters", type=int, default=3)
    args = p.parse_args(argv)
    args.baseline_name = "sdpa_cudnn" if torch.device(args.device).type == "cuda" else "sdpa_math"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.out.exists() and not args.overwrite:
        print(f"[bench] {args.out} exists; pass --overwrite to replace it, or choose another --out", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("[bench] CUDA requested but not available", file=sys.stderr)
        return 2
    rec = Recorder(on_row=lambda r: _write(args.out, report, r))
    report: dict[str, Any] = {
        "benchmark": "elasticfw.bench.attention",
        "environment": environment(device),
        "shape": {
            "batch": args.batch,
            "q_heads": args.q_heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "dtype": args.dtype,
            "causal": True,
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "baseline": args.baseline_name,
        # false in every write until the last: a run killed midway leaves a file that says so
        "complete": False,
        "inputs": describe(InputStructure() if args.inputs == "structured" else None),
        "modes": {m.name: (m.config.model_dump() if hasattr(m, "config") else None) for m in bench_modes(args)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _write(args.out, report, rec)  # the header at once: a run that fails early leaves no stale file
    if args.check_seq:
        # each mode at a length where its layout is sparse (from --check-seq, doubled up to 4x); a mode
        # whose layout fails there is a failed check row, and the run goes on with the others
        lengths = check_lengths(args.check_seq, args, device, rec=rec)
        for n in sorted(set(lengths.values())):
            names = [m for m, length in lengths.items() if length == n]
            correctness(n, args, rec, device, modes=names)
            for ex_name in [e for e in args.executors if e != "flex"]:
                routed_correctness(ex_name, n, args, rec, device, modes=names)
        _write(args.out, report, rec)
    for S in args.seq:
        bench_seq(S, args, rec, device)
        _write(args.out, report, rec)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.layout_memory:
        report["layout_memory_tokens"] = args.layout_memory
        layout_memory(args.layout_memory, args, rec, device)
    report["complete"] = True
    _write(args.out, report, rec)
    print(f"[bench] wrote {args.out}; {len(rec.failures)} failure(s)", flush=True)
    for line in rec.failures:
        print(f"[bench] FAILED {line}", file=sys.stderr)
    return 1 if rec.failures else 0


def summarize(rows: list[dict[str, Any]], baseline: str) -> dict[str, dict[str, dict[str, float | None]]]:
    """{"S=8192": {"flex:streaming fwd": {"ms": ..., "ratio": ...}, ...}, ...} over timed rows."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for row in rows:
        if row.get("ms") is None or row["kind"] not in ("fwd", "fwd_bwd"):
            continue
        out.setdefault(f"S={row['seq']}", {})[f"{row['name']} {row['kind']}"] = {
            "ms": round(row["ms"], 4),
            "ratio": None
            if row.get(f"ratio_vs_{baseline}") is None
            else round(row[f"ratio_vs_{baseline}"], 4),
        }
    return out


def _write(path: Path, report: dict[str, Any], rec: Recorder) -> None:
    data = dict(
        report, summary=summarize(rec.rows, report["baseline"]), results=rec.rows, failures=rec.failures
    )
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
