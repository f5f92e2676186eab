"""The attention benchmark's checks: the flex executor (and other executors, routed) against the
reference executor before anything is timed, and the peak memory of building each mode's layout
(``--layout-memory``). Each check is one :class:`~elasticfw.bench.timing.Recorder` row; a failure
is recorded and the run goes on."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from elasticfw.attention.flex_mask import to_block_mask
from elasticfw.attention.layout import causal_layout, esr
from elasticfw.attention.seq import SeqInfo
from elasticfw.bench.attention_setup import bench_modes, flex_config, hybrid_heads, inner_flex
from elasticfw.bench.timing import DTYPES, Recorder, make_executor, sync

__all__ = ["check_lengths", "correctness", "layout_memory", "routed_correctness"]


def check_lengths(N: int, args: argparse.Namespace, device: torch.device, *, longest: int = 4,
                  rec: Recorder | None = None) -> dict[str, int]:
    """Per benchmarked mode, the length its checks run at: ``N``, doubled while the mode's layout of
    a dense prefill is dense causal there, up to ``longest * N``. A mode that computes every pair at
    ``N`` (MoBA and NSA at their defaults up to 8,192 tokens) would check the dense path only, not
    the sparse kernels its timed rows use. With ``rec``, a mode whose layout fails is recorded as a
    failed ``check`` row and left out (without it, the error propagates)."""
    hq, hkv, D = args.q_heads, args.kv_heads, args.head_dim
    g = torch.Generator(device="cpu").manual_seed(3)
    out = {}
    for mode in bench_modes(args):

        def body(row: dict[str, Any], mode: Any = mode) -> None:
            n = N
            while True:
                q = torch.randn(1, hq, n, D, generator=g).to(device, DTYPES[args.dtype])
                k = torch.randn(1, hkv, n, D, generator=g).to(device, DTYPES[args.dtype])
                with torch.no_grad():
                    dense = mode.build_layout(q, k, SeqInfo.dense(1, n, n, device=device)).dense_causal
                if not dense or n * 2 > longest * N:
                    break
                n *= 2
            out[mode.name] = n

        if rec is None:
            body({})
        else:
            failed = rec.run({"seq": N, "name": f"check_length:{mode.name}", "kind": "check"}, body)["error"]
            if failed is None:
                rec.rows.pop()  # only a failure is worth a row
    return out


def correctness(N: int, args: argparse.Namespace, rec: Recorder, device: torch.device,
                modes: list[str] | None = None) -> None:
    """The flex executor (as configured) against the reference executor on this device, for every
    registered mode (or those named in ``modes``): outputs, lse and q/k/v gradients on a dense
    prefill, a chunked prefill with unaligned per-sample query starts, and a decode step."""
    from elasticfw.testing.modes import LSE_TOLERANCE, TOLERANCE, rel_rms

    dtype = DTYPES[args.dtype]
    hq, hkv, D = args.q_heads, args.kv_heads, args.head_dim
    tol = TOLERANCE[dtype]
    lse_tol = LSE_TOLERANCE[dtype]
    executor = make_executor("flex", **flex_config(args))
    reference = make_executor("reference")
    cases = {
        "prefill": SeqInfo.dense(1, N, N, device=device),
        # a second, shorter sample (still with keys at the smoke test's tiny N)
        "chunk_unaligned": SeqInfo.from_lengths(torch.tensor([N, max(N - 200, N // 2 + 3)], device=device),
                                                N // 2 - 37, N),
        "decode": SeqInfo.from_lengths(torch.tensor([N - 3, N // 2 + 5], device=device), 1, N),
    }
    g = torch.Generator(device="cpu").manual_seed(1)
    for case, seq in cases.items():
        B = seq.batch
        q0 = torch.randn(B, hq, seq.q_len, D, generator=g).to(device, dtype)
        k0 = torch.randn(B, hkv, N, D, generator=g).to(device, dtype)
        v0 = torch.randn(B, hkv, N, D, generator=g).to(device, dtype)
        dout = torch.randn(B, hq, seq.q_len, D, generator=g).to(device, dtype)
        dout = dout * seq.query_valid()[:, None, :, None]  # padding rows' outputs are meaningless
        for mode in [m for m in bench_modes(args) if modes is None or m.name in modes]:

            def body(row, mode=mode, seq=seq, q0=q0, k0=k0, v0=v0, dout=dout, case=case):
                with torch.no_grad():
                    layout = mode.build_layout(q0, k0, seq)
                row["config"] = mode.config.model_dump()
                row["esr_mean"] = float(esr(layout, seq, hq).mean())  # a dense layout checks little
                results = []
                backward = not args.no_backward  # --no-backward: the forward only (inference kernels)
                for ex, cast in ((executor, dtype), (reference, torch.float32)):
                    q, k, v = (t.detach().to(cast).requires_grad_(backward) for t in (q0, k0, v0))
                    with torch.set_grad_enabled(backward):
                        res = ex.attend(q, k, v, layout, seq, scale=D**-0.5)
                    if backward:
                        res.out.backward(dout.to(cast))
                    grads = [t.grad.float() for t in (q, k, v)] if backward else []
                    results.append((res.out.detach().float(), res.lse.detach(), grads))
                (out, lse, grads), (rout, rlse, rgrads) = results
                rows = seq.query_valid()[:, None, :]
                orows = rows[..., None].expand_as(out)
                row["out_rel_rms"] = rel_rms(out[orows], rout[orows])
                a, b = lse[rows.expand_as(lse)], rlse[rows.expand_as(rlse)]
                row["lse_inf_mismatch"] = int((torch.isinf(a) != torch.isinf(b)).sum())
                fin = torch.isfinite(a) & torch.isfinite(b)
                row["lse_max_abs"] = float((a[fin] - b[fin]).abs().max()) if bool(fin.any()) else 0.0
                row["grad_rel_rms"] = {n: rel_rms(x, y) for n, x, y in zip("qkv", grads, rgrads)}  # {}: forward only
                row["tolerance"] = {"out": tol, "grad": 3 * tol, "lse": lse_tol}
                bad = []
                if not row["out_rel_rms"] < tol:
                    bad.append(f"out rel RMS {row['out_rel_rms']:.2e}")
                if row["lse_inf_mismatch"]:
                    bad.append(f"{row['lse_inf_mismatch']} lse -inf mismatches")
                if not row["lse_max_abs"] < lse_tol:
                    bad.append(f"lse max abs {row['lse_max_abs']:.2e} >= {lse_tol}")
                if bool(torch.isnan(a).any()):  # NaN is neither inf nor finite: counted by neither check above
                    bad.append(f"{int(torch.isnan(a).sum())} NaN lse")
                bad += [f"d{n} rel RMS {e:.2e}" for n, e in row["grad_rel_rms"].items() if not e < 3 * tol]
                if bad:
                    raise AssertionError(f"flex vs reference ({case}): " + ", ".join(bad))

            rec.run({"seq": N, "name": f"check:{mode.name}:{case}", "kind": "check"}, body)


def routed_correctness(name: str, N: int, args: argparse.Namespace, rec: Recorder, device: torch.device,
                       modes: list[str] | None = None) -> None:
    """Executor ``name`` against the reference executor on a dense prefill of N tokens, the way the
    runtime calls it (``need_lse=False``): every mode's layout alone (``attend``) and routed with
    full attention (``attend_routed``: the first KV heads full, and every other KV head full);
    outputs and q/k/v gradients."""
    from elasticfw.testing.modes import TOLERANCE, rel_rms

    dtype = DTYPES[args.dtype]
    hq, hkv, D = args.q_heads, args.kv_heads, args.head_dim
    tol = TOLERANCE[dtype]
    executor, reference = make_executor(name, **inner_flex(name, args)), make_executor("reference")
    seq = SeqInfo.dense(1, N, N, device=device)
    g = torch.Generator(device="cpu").manual_seed(2)
    q0, k0, v0, dout = (torch.randn(1, h, N, D, generator=g).to(device, dtype) for h in (hq, hkv, hkv, hq))
    group = hq // hkv
    scattered = (torch.arange(hq, device=device) // group % 2 == 1)[None, :]
    for mode in [m for m in bench_modes(args) if modes is None or m.name in modes]:
        with torch.no_grad():
            layout = mode.build_layout(q0, k0, seq)
        full = causal_layout(seq, layout.block_size)
        calls: dict[str, Callable[..., Any]] = {
            "alone": lambda ex, q, k, v, layout=layout: ex.attend(q, k, v, layout, seq, scale=D**-0.5, need_lse=False)
        }
        if not layout.dense_causal:
            for label, hard in (("routed_first_full", hybrid_heads(seq, hq, hkv, args.msr)), ("routed_scattered", scattered)):
                calls[label] = lambda ex, q, k, v, layout=layout, full=full, hard=hard: ex.attend_routed(
                    q, k, v, seq, hard=hard, layouts=(full, layout), scale=D**-0.5, need_lse=False)
        for label, call in calls.items():

            def body(row, call=call):
                results = []
                backward = not args.no_backward  # --no-backward: the forward only (inference kernels)
                for ex, cast in ((executor, dtype), (reference, torch.float32)):
                    q, k, v = (t.detach().to(cast).requires_grad_(backward) for t in (q0, k0, v0))
                    with torch.set_grad_enabled(backward):
                        out = call(ex, q, k, v).out
                    if backward:
                        out.backward(dout.to(cast))
                    results.append((out.detach().float(), [t.grad.float() for t in (q, k, v)] if backward else []))
                (out, grads), (rout, rgrads) = results
                row["out_rel_rms"] = rel_rms(out, rout)
                row["grad_rel_rms"] = {n: rel_rms(x, y) for n, x, y in zip("qkv", grads, rgrads)}
                row["tolerance"] = {"out": tol, "grad": 3 * tol}
                bad = [] if row["out_rel_rms"] < tol else [f"out rel RMS {row['out_rel_rms']:.2e}"]
                bad += [f"d{n} rel RMS {e:.2e}" for n, e in row["grad_rel_rms"].items() if not e < 3 * tol]
                if bad:
                    raise AssertionError(f"{name} vs reference: " + ", ".join(bad))

            rec.run({"seq": N, "name": f"check:{name}:{mode.name}:{label}", "kind": "check"}, body)


def layout_memory(
    N: int, args: argparse.Namespace, rec: Recorder, device: torch.device
) -> list[dict[str, Any]]:
    """Peak memory of building each mode's layout (and its BlockMask) at ``N`` tokens."""

    dtype = DTYPES[args.dtype]
    B, hq, hkv, D = args.batch, args.q_heads, args.kv_heads, args.head_dim
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(B, hq, N, D, generator=g).to(device, dtype)
    k = torch.randn(B, hkv, N, D, generator=g).to(device, dtype)
    seq = SeqInfo.dense(B, N, N, device=device)
    executor = make_executor("flex", **flex_config(args))
    impl = executor.implementation(device)
    rows = []
    quadratic = N * N  # bytes of one dense bool mask
    for mode in bench_modes(args):

        def body(row, mode=mode):
            cuda = device.type == "cuda"
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            with torch.no_grad():
                layout = mode.build_layout(q, k, seq)
            sync(device)
            row["layout_s"] = time.perf_counter() - start
            row["layout_tensor_mib"] = layout.blocks.numel() / 2**20
            if cuda:
                peak = torch.cuda.max_memory_allocated(device) - before
                row["layout_peak_mib"] = peak / 2**20
                row["layout_peak_over_N2_bytes"] = peak / quadratic
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            kb = executor.kernel_block_size(layout.block_size, impl, device)
            fm = to_block_mask(layout, seq, hq, kernel_block_size=kb, compute_q_blocks=True)
            sync(device)
            row["block_mask_s"] = time.perf_counter() - start
            row["kernel_block_size"] = kb
            if cuda:
                peak_bm = torch.cuda.max_memory_allocated(device) - before
                row["block_mask_peak_mib"] = peak_bm / 2**20
                row["block_mask_peak_over_N2_bytes"] = peak_bm / quadratic
                worst = max(peak, peak_bm)
                if worst >= quadratic:
                    raise RuntimeError(
                        f"peak memory {worst / 2**20:.0f} MiB >= N^2 bytes ({quadratic / 2**20:.0f} MiB): O(N^2)"
                    )
            else:
                row["note"] = "peak memory is measured on CUDA only"
            del fm, layout

        rows.append(rec.run({"seq": N, "name": f"layout_memory:{mode.name}", "kind": "memory"}, body))
    return rows
