"""Decode memory and step time: the compact KV cache vs the full one vs dense attention.

    python -m elasticfw.bench.decode_memory --out results/bench/decode-memory/decode_memory_h200.json
    python -m elasticfw.bench.decode_memory --device cpu --contexts 256 --layers 2 --hidden 64 \\
        --heads 4 --kv-heads 2 --head-dim 16 --intermediate 128 --vocab 256 --sink 16 --local 32 \\
        --block 16 --steps 3 --warmup 1 --out /tmp/decode_memory.json      # smoke run on CPU

A Llama with random weights at Llama-3.1-8B's shape but only ``--layers`` decoder layers (per-layer
figures carry over to 32), batch 1, contexts ``--contexts``. Variants per context: ``dense`` (the
plain model) and the elastic model under FA-SSA with a ``fixed`` router at each ``--msr``, with the
full (``full_cache``) or the compact (``compact_cache``) KV cache. Per variant: the cache's bytes
after the prefill and after the decode, the peak CUDA memory of each phase, the prefill time and
the median decode step (``step_over_dense``: over the same run's dense step; compare ratios within
one run), ``kv_ratio`` beside ``expected_kv_ratio``. A failing variant records its error (exit
status 1); the JSON records the environment. Field by field: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from elasticfw.atomic import atomic_write_text
from elasticfw.bench.prefill import fixed_router
from elasticfw.bench.timing import DTYPES
from elasticfw.bench.timing import allocated_bytes as _allocated
from elasticfw.bench.timing import peak_bytes as _peak
from elasticfw.bench.timing import reset_peak as _reset_peak
from elasticfw.bench.timing import sync as _sync
from elasticfw.model.elastic import cache_argument
from elasticfw.provenance import environment


def cache_nbytes(cache: Any) -> int:
    """Bytes of every tensor a transformers cache (dynamic or compact) holds."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += int(t.nbytes)
    return total


def build_model(args: argparse.Namespace, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(args.contexts) + args.warmup + args.steps + 8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[args.dtype], attn_implementation="sdpa")
    return model.eval()


def elastic_section(args: argparse.Namespace, msr: float, kv_cache: str, executor: str) -> Any:
    from elasticfw.recipe import validate_recipe_data

    router, _ = fixed_router(msr, args.layers, args.kv_heads)
    data = {
        "retrieval_mode": {"name": "full", "block_size": args.block},
        "sparse_mode": {"name": "streaming", "sink_tokens": args.sink, "local_tokens": args.local,
                        "block_size": args.block},
        "router": router,
        "executor": {"name": executor},
        "kv_cache": kv_cache,
    }
    return validate_recipe_data({"elastic": data}).elastic


#: SDPA backends for the decode steps (``--decode-sdpa``). Measured on an H200 (torch 2.11, cuDNN
#: 9.19): cuDNN's attention builds an execution plan for every new key length, about 9 ms of host
#: time per call, so a decode step through it costs ~40-60 ms whatever the context; the others do not
#: (``results/bench/decode-memory/README.md``). Every variant, dense included, decodes with the same list.
SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}


def decode_backends(names: str, device: torch.device) -> Any:
    """``sdpa_kernel`` over the comma-separated ``names`` on CUDA (``auto``: torch's own choice)."""
    import contextlib

    if device.type != "cuda" or names == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in SDPA_BACKENDS]
    if unknown or not chosen:
        raise SystemExit(f"--decode-sdpa {names!r}: expected 'auto' or a list of {sorted(SDPA_BACKENDS)}")
    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[n]) for n in chosen])


def _profile_steps(model: Any, token: torch.Tensor, with_cache: dict[str, Any], device: torch.device,
                   steps: int = 3) -> str:
    """torch.profiler's table of ``steps`` more decode steps (the ops with the most self time, CUDA
    time first on a GPU): where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        for _ in range(steps):
            out = model(input_ids=token, **with_cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=12)
    cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
    return f"{table}\n{cpu_table}"


def run_variant(
    model: Any, ids: torch.Tensor, args: argparse.Namespace, device: torch.device, *, make_cache: Any,
    swap_executor: Any = None,
) -> dict[str, Any]:
    """Prefill ``ids`` into a fresh cache, then ``warmup + steps`` greedy decode steps."""
    from transformers import DynamicCache

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    before = _allocated(device)
    _reset_peak(device)
    cache = make_cache() if make_cache is not None else DynamicCache(config=getattr(model, "base", model).config)
    with_cache = {cache_argument(getattr(model, "base", model)): cache}  # its name differs across transformers 5.x
    with torch.no_grad():
        _sync(device)
        start = time.perf_counter()
        out = model(input_ids=ids, **with_cache, use_cache=True, logits_to_keep=1)
        _sync(device)
        prefill_s = time.perf_counter() - start
        peak_prefill = _peak(device)
        cache_prefill = cache_nbytes(cache)
        if swap_executor is not None:
            swap_executor()
        token = out.logits[:, -1:].argmax(-1)
        del out
        _reset_peak(device)
        times = []
        with decode_backends(args.decode_sdpa, device):
            for i in range(args.warmup + args.steps):
                _sync(device)
                start = time.perf_counter()
                out = model(input_ids=token, **with_cache, use_cache=True)
                _sync(device)
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
                token = out.logits[:, -1:].argmax(-1)
                del out
            peak_decode = _peak(device)
            # the cache as the timed steps left it (the profiled steps below add tokens)
            cache_decode = cache_nbytes(cache)
            kept = _kept_tokens(cache)
            profile = _profile_steps(model, token, with_cache, device) if args.profile else None
    row: dict[str, Any] = {
        "prefill_s": prefill_s,
        "decode_step_ms_median": 1e3 * statistics.median(times),
        "decode_step_ms_min": 1e3 * min(times),
        "cache_bytes_after_prefill": cache_prefill,
        "cache_bytes_after_decode": cache_decode,
        "allocated_before_bytes": before,
        "peak_prefill_bytes_above_before": None if peak_prefill is None or before is None else peak_prefill - before,
        "peak_decode_bytes_above_before": None if peak_decode is None or before is None else peak_decode - before,
        "peak_decode_bytes": peak_decode,
    }
    if profile is not None:
        row["profile"] = profile
    if kept is not None:
        row["kept_tokens"] = kept
    del cache
    return row


def _kept_tokens(cache: Any) -> int | None:
    """A compact cache's (sample, KV head, token) entries kept, over every layer (``None``: another cache)."""
    if not hasattr(cache, "elastic_layers"):
        return None
    return int(sum(int(layer.kept_tokens().sum()) for layer in cache.elastic_layers().values()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from elasticfw.model.elastic import ElasticModel
    from elasticfw.registry import get_registry

    device = torch.device(args.device)
    model = build_model(args, device)
    registry = get_registry()
    decode_cfg = registry.entry("executor", args.decode_executor).config_class
    try:
        decode_settings = decode_cfg(**json.loads(args.decode_options))  # type: ignore[misc]
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise SystemExit(f"--decode-options {args.decode_options!r}: not options of executor "
                         f"{args.decode_executor!r} ({exc})") from exc
    result: dict[str, Any] = {
        "environment": environment(device),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "note": f"random weights; {args.layers} decoder layers of the Llama-3.1-8B shape (the KV cache and the "
        "attention scale per layer); batch 1; FA-SSA with a fixed router (first (1 - msr) * Hkv KV heads of each "
        "layer on full attention)",
        "rows": [],
        "failures": [],
    }
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    result["weights_bytes"] = weights
    for context in args.contexts:
        ids = torch.randint(0, args.vocab, (1, context), generator=torch.Generator().manual_seed(context)).to(device)
        dense_bytes = 2 * args.layers * args.kv_heads * context * args.head_dim * DTYPES[args.dtype].itemsize
        variants: list[tuple[str, float, str | None]] = [("dense", 0.0, None)]
        variants += [(kind, msr, kind) for msr in args.msr for kind in ("full_cache", "compact_cache")]
        for name, msr, kind in variants:
            label = f"{name}@{context}" + (f"/msr{msr}" if kind else "")
            print(f"[decode_memory] {label}", file=sys.stderr, flush=True)
            elastic = None
            try:
                if kind is None:
                    row = run_variant(model, ids, args, device, make_cache=None)
                else:
                    section = elastic_section(args, msr, "compact" if kind == "compact_cache" else "full",
                                              args.prefill_executor)
                    elastic = ElasticModel(model, section)
                    decode_executor = registry.make("executor", decode_settings)
                    runtime = elastic.runtime

                    def swap(runtime: Any = runtime, executor: Any = decode_executor) -> None:
                        runtime.executor = executor

                    row = run_variant(
                        elastic, ids, args, device,
                        make_cache=elastic.make_kv_cache if kind == "compact_cache" else None, swap_executor=swap,
                    )
                realised = fixed_router(msr, args.layers, args.kv_heads)[1] if kind else 0.0  # whole heads
                row.update(context=context, variant=name, msr=realised, target_msr=msr if kind else 0.0,
                           dense_cache_bytes=dense_bytes)
                row["kv_ratio"] = row["cache_bytes_after_prefill"] / dense_bytes
                dense_step = next((r["decode_step_ms_median"] for r in [*result["rows"], row]
                                   if r["variant"] == "dense" and r["context"] == context), None)
                if dense_step is not None:  # the same run's dense step: a decode step's time is the host's
                    row["step_over_dense"] = row["decode_step_ms_median"] / dense_step
                if kind == "compact_cache":
                    row["expected_kv_ratio"] = (1 - realised) + realised * (args.sink + args.local) / context
                    seen = context + args.warmup + args.steps  # tokens in the cache after the decode
                    row["kept_tokens_ratio"] = row["kept_tokens"] / (args.layers * args.kv_heads * seen)
                result["rows"].append(row)
            except Exception as exc:  # noqa: BLE001 - a failing variant is recorded, the run goes on
                result["failures"].append({"variant": label, "error": f"{type(exc).__name__}: {exc}",
                                           "traceback": traceback.format_exc()})
            finally:
                if elastic is not None:
                    elastic.unwrap()
                # nothing of this variant (its runtime, executors, caches) lives into the next one's
                # allocated_before_bytes and peaks
                elastic = runtime = swap = decode_executor = None  # type: ignore[assignment]
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--msr", type=float, nargs="+", default=[0.5, 0.875])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--local", type=int, default=2048)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=4, help="decode steps before timing")
    p.add_argument("--prefill-executor", default=None, help="default: flex on CUDA, sdpa elsewhere")
    p.add_argument("--decode-executor", default="sdpa")
    p.add_argument("--decode-options", default="{}",
                   help='the decode executor\'s options as JSON, e.g. \'{"decode_sparse": "gathered"}\' for split')
    p.add_argument("--decode-sdpa", default="flash,efficient,math",
                   help="SDPA backends of the decode steps on CUDA, in order ('auto': torch's choice, cuDNN first "
                   "on Hopper, which re-plans for every new key length)")
    p.add_argument("--profile", action="store_true",
                   help="also profile 3 decode steps per variant (torch.profiler table in each row)")
    args = p.parse_args(argv)
    if args.prefill_executor is None:
        args.prefill_executor = "flex" if str(args.device).startswith("cuda") else "sdpa"
    for msr in args.msr:
        if not 0 <= msr <= 1:
            p.error(f"--msr values lie in [0, 1], got {msr}")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    for row in result["rows"]:
        print(
            f"{row['context']:>7} {row['variant']:<14} msr={row['msr']:<6} kv={row['cache_bytes_after_prefill'] / 2**20:9.1f} MiB "
            f"ratio={row['kv_ratio']:.4f} (expected {row.get('expected_kv_ratio', float('nan')):.4f}) "
            f"step={row['decode_step_ms_median']:.2f} ms ({row.get('step_over_dense', float('nan')):.2f}x dense)"
        )
    for failure in result["failures"]:
        print(f"FAILED {failure['variant']}: {failure['error']}", file=sys.stderr)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
