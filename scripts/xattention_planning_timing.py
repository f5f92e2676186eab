"""Time XAttention planning (``build_layout``) with the torch and the Triton planning backends
against one dense causal cuDNN SDPA layer at the same shape, on a CUDA device.

    python scripts/xattention_planning_timing.py                  # 128K, B=1, Hq 32, Hkv 8, d 128, bf16
    python scripts/xattention_planning_timing.py --tokens 32768 --repeats 10

Prints the median of ``--repeats`` CUDA-event-timed calls (after a warm-up call, which compiles
the Triton kernels) for: the dense SDPA layer (K/V repeated to Hq outside the timed region if
cuDNN has no GQA), ``build_layout`` with ``estimator: torch`` and ``estimator: triton``, and the
Triton estimate and selection alone; then the ratios to the dense layer and how many blocks the
two layouts differ in (near-ties of float32 rounding only).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from elasticfw.attention.seq import SeqInfo
from elasticfw.testing.modes import make_mode


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def structured_layer(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SeqInfo]:
    """q, k, v (bf16 on CUDA) of the attention benchmark's structured inputs at ``args``' shape
    (:func:`add_shape_arguments`), and their dense SeqInfo; exits without a CUDA device."""
    from elasticfw.bench.inputs import structured_qkv

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    n, hq, hkv, d = args.tokens, args.query_heads, args.kv_heads, args.head_dim
    q, k, v = (t.to("cuda", torch.bfloat16) for t in structured_qkv(1, hq, hkv, n, d, seed=0))
    return q, k, v, SeqInfo.dense(1, n, n, device="cuda")


def dense_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One dense causal cuDNN SDPA layer over ``q`` and ``k`` / ``v`` repeated to the query heads
    (outside the timed call)."""
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def dense() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True)

    return dense


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The layer shape and repeats both planning-timing tools take (defaults: Llama-3.1-8B, 128K)."""
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--query-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(p)
    p.add_argument("--skip-torch", action="store_true", help="skip the (slow) torch planning backend")
    p.add_argument(
        "--tiles", nargs="*", default=[], metavar="BM,BN,WARPS,STAGES",
        help="also time the Triton estimate alone with these tile configurations (tuning)",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    n, hq, hkv, d = args.tokens, args.query_heads, args.kv_heads, args.head_dim
    torch.manual_seed(0)
    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    seq = SeqInfo.dense(1, n, n, "cuda")
    print(f"{torch.cuda.get_device_name()}: B=1, {n} tokens, Hq={hq}, Hkv={hkv}, d={d}, bf16")

    def dense_gqa() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    try:
        with torch.no_grad():
            dense_gqa()
        dense = dense_gqa
        note = ""
    except RuntimeError:
        kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)

        def dense() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True)

        note = " (K/V repeated: no GQA in cuDNN here)"
    results: dict[str, float] = {}
    with torch.no_grad():
        results["dense cuDNN SDPA layer" + note] = timed(dense, args.repeats)
        modes = {name: make_mode("xattention", {"estimator": name}) for name in ("torch", "triton")}
        assert modes["triton"].planning_backend(q) == "triton"
        if not args.skip_torch:
            results["build_layout, estimator torch"] = timed(lambda: modes["torch"].build_layout(q, k, seq), args.repeats)
        results["build_layout, estimator triton"] = timed(lambda: modes["triton"].build_layout(q, k, seq), args.repeats)

        from elasticfw.kernels.xattention_estimate import iter_antidiagonal_mass_triton
        from elasticfw.kernels.xattention_select import select_blocks_triton

        def estimate_only() -> None:
            for _ in iter_antidiagonal_mass_triton(q, k, seq, block_size=64, stride=16, chunk_size=16384):
                pass

        results["  triton estimate only"] = timed(estimate_only, args.repeats)

        def two_pass_only() -> None:
            for _ in iter_antidiagonal_mass_triton(q, k, seq, block_size=64, stride=16, chunk_size=16384, passes=2):
                pass

        results["  triton estimate only, two passes"] = timed(two_pass_only, args.repeats)
        from elasticfw.kernels import xattention_estimate as xe

        for spec in args.tiles:
            bm, bn, warps, stages = (int(x) for x in spec.split(","))
            saved = (xe.NUM_WARPS, xe.NUM_STAGES)
            xe.NUM_WARPS, xe.NUM_STAGES = warps, stages
            try:
                def tiled(bm: int = bm, bn: int = bn) -> None:
                    for _ in iter_antidiagonal_mass_triton(q, k, seq, block_size=64, stride=16, chunk_size=16384,
                                                           block_m=bm, block_n=bn):
                        pass

                results[f"  triton estimate, tiles {spec}"] = timed(tiled, args.repeats)
            except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is reported
                print(f"tiles {spec}: {type(exc).__name__}: {str(exc)[:200]}")
            finally:
                xe.NUM_WARPS, xe.NUM_STAGES = saved
        masses = list(iter_antidiagonal_mass_triton(q, k, seq, block_size=64, stride=16, chunk_size=16384))
        first = int(seq.q_block_start(64).max())

        def select_only() -> None:
            for t0, t1, mass in masses:
                rows = torch.arange(t0, t1, device="cuda")[None, :] + first
                select_blocks_triton(mass, rows, 0.9, max_row_block=first + t1 - 1)

        results["  triton selection only"] = timed(select_only, args.repeats)

        with torch.no_grad():
            one = torch.cat(list(m for _, _, m in iter_antidiagonal_mass_triton(
                q, k, seq, block_size=64, stride=16, chunk_size=16384)), dim=2)
            two = torch.cat(list(m for _, _, m in iter_antidiagonal_mass_triton(
                q, k, seq, block_size=64, stride=16, chunk_size=16384, passes=2)), dim=2)
        rel = ((one - two).abs().max() / two.abs().max()).item()
        print(f"one pass vs two passes: max |difference| / max mass = {rel:.2e}")
    base = next(iter(results.values()))
    for name, ms in results.items():
        print(f"{name:48s} {ms:9.2f} ms  {ms / base:6.3f}x dense")
    if not args.skip_torch:
        with torch.no_grad():
            a = modes["torch"].build_layout(q, k, seq).blocks
            b = modes["triton"].build_layout(q, k, seq).blocks
        print(f"layouts differ in {(a != b).sum().item()} of {a.sum().item()} kept (torch) blocks")


if __name__ == "__main__":
    main()
