"""End-to-end generation benchmark: time to first token, decode rate, end-to-end time and peak memory.

    elasticfw bench generate --out results/bench/NAME/generate.json       # GPU: 32K and 128K, batch 1 and 8
    elasticfw bench generate --device cpu --dtype fp32 --model tiny-llama --seq 96 --batch 1 2 --layers 1 \\
        --new-tokens 4 --msr 0.5 --sink 16 --local 32 --block-size 16 --out /tmp/g.json   # smoke run

A model of a real size (:data:`elasticfw.bench.prefill.SHAPES`, default ``llama-3.1-8b``) with random
weights and its first ``--layers`` decoder layers (recorded; every layer has the same shape, so the
ratios carry over to the whole model); per ``--seq`` and ``--batch``, a prompt of random tokens and
greedy decoding of exactly ``--new-tokens`` tokens (no end-of-sequence stop: every variant generates
as many). Variants: ``dense:sdpa`` (on CUDA also ``dense:sdpa_cudnn_first``: the prefill with cuDNN
first), ``dense:flash_attention_2`` (skipped, with the reason, where ``flash_attn`` does not import)
and the elastic model under FA-SSA at ``--msr`` with a ``fixed`` router, with the full KV cache and
with the compact one. Per variant: TTFT, the median decode step, decode tokens/s, end-to-end time,
the peak of ``torch.cuda.max_memory_allocated`` and the KV cache's bytes, and ``ttft_over_dense``,
``decode_step_over_dense`` and ``e2e_over_dense`` over the same run's dense SDPA baseline (per
figure, the faster dense SDPA row). A failing variant records its error (exit status 1); the JSON
carries the environment and a PNG plot is written beside it. Details:
``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from elasticfw.atomic import atomic_write_text
from elasticfw.bench import prefill, timing
from elasticfw.bench.decode_memory import SDPA_BACKENDS, cache_nbytes, decode_backends
from elasticfw.bench.timing import DTYPES, DeviceClock, allocated_bytes, free_memory, peak_bytes, sync
from elasticfw.model.elastic import cache_argument
from elasticfw.provenance import environment

#: new tokens of each warm-up generation (the prompt is the timed one's): enough decode steps to
#: compile every specialisation of the decode kernels (Triton specialises lengths divisible by 16)
WARMUP_TOKENS = 32
#: the row of static decoding with every head full (the baseline of ``*_over_static_full``)
STATIC_FULL_HEADS = "full-heads:static:compact_cache"
#: the ratios of each row, over the same (model, seq, batch)'s dense SDPA baseline
RATIOS = {"ttft_over_dense": "ttft_ms", "decode_step_over_dense": "decode_step_ms", "e2e_over_dense": "e2e_ms"}


def prefill_chunk(args: argparse.Namespace, batch: int, seq: int) -> int | None:
    """Prompt tokens per sample of each prefill forward: ``None`` (the whole prompt in one forward)
    unless ``batch * seq`` exceeds ``--max-prefill-tokens``, else ``--prefill-chunk``."""
    if args.max_prefill_tokens and batch * seq > args.max_prefill_tokens and args.prefill_chunk < seq:
        return int(args.prefill_chunk)
    return None


def _prefill(model: Any, ids: torch.Tensor, cache: Any, device: torch.device, chunk: int | None,
             prefill_context: Callable[[], Any]) -> tuple[torch.Tensor, DeviceClock]:
    """The prompt ``ids`` (B, S) into ``cache`` (``chunk`` tokens per forward, or all) and its next
    token (B, 1), with a clock marked before and after (the argmax included)."""
    clock = DeviceClock(device)
    step = chunk or ids.shape[1]
    sync(device)
    clock.mark()
    with prefill_context():
        for start in range(0, ids.shape[1], step):
            out = model(input_ids=ids[:, start:start + step], use_cache=True, logits_to_keep=1,
                        **{cache_argument(getattr(model, "base", model)): cache})
    token = out.logits[:, -1:].argmax(-1)
    del out
    clock.mark()
    return token, clock


@torch.no_grad()
def greedy_generate(model: Any, ids: torch.Tensor, new_tokens: int, cache: Any, device: torch.device, *,
                    chunk: int | None = None, prefill_context: Callable[[], Any] = contextlib.nullcontext,
                    decode_context: Callable[[], Any] = contextlib.nullcontext) -> tuple[torch.Tensor, list[float]]:
    """Greedy generation of ``new_tokens`` tokens after ``ids`` (B, S) into ``cache``: the prefill
    (``chunk`` prompt tokens per forward, or the whole prompt), its first token, then
    ``new_tokens - 1`` decode steps of one token each. Returns the tokens (B, new_tokens) and the
    milliseconds of the prefill (its first token's argmax included) and of each decode step, on
    the device's timeline (:class:`~elasticfw.bench.timing.DeviceClock`)."""
    with_cache = {cache_argument(getattr(model, "base", model)): cache}
    token, clock = _prefill(model, ids, cache, device, chunk, prefill_context)
    tokens = [token]
    with decode_context():
        for _ in range(new_tokens - 1):
            out = model(input_ids=token, **with_cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            del out
            tokens.append(token)
            clock.mark()
    return torch.cat(tokens, dim=1), clock.intervals_ms()


@torch.no_grad()
def static_generate(model: Any, ids: torch.Tensor, new_tokens: int, cache: Any, device: torch.device, *,
                    chunk: int | None = None, prefill_context: Callable[[], Any] = contextlib.nullcontext,
                    decode_context: Callable[[], Any] = contextlib.nullcontext) -> tuple[torch.Tensor, list[float]]:
    """:func:`greedy_generate` with the decode steps of a
    :class:`~elasticfw.model.static_decode.StaticDecoder` (on CUDA: eager warm-up steps, then one
    captured CUDA graph replayed per step). The decoder's set-up (its stores grown for every step)
    counts in the first decode step, the capture in the step it precedes."""
    from elasticfw.model.static_decode import StaticDecoder

    token, clock = _prefill(model, ids, cache, device, chunk, prefill_context)
    if new_tokens == 1:
        return token, clock.intervals_ms()
    with decode_context(), StaticDecoder(model, cache, token, max_new_tokens=new_tokens - 1) as decoder:
        for _ in range(new_tokens - 1):
            decoder.step()
            clock.mark()
        tokens = torch.cat([token, decoder.tokens], dim=1)
    return tokens, clock.intervals_ms()


def time_variant(model: Any, ids: torch.Tensor, args: argparse.Namespace, device: torch.device, *,
                 make_cache: Callable[[], Any], chunk: int | None, prefill_context: Callable[[], Any],
                 first: Callable[[], None] | None = None, after_first: Callable[[], None] | None = None,
                 before: Callable[[], None] | None = None, static: bool = False) -> dict[str, Any]:
    """``--warmup`` generations of :data:`WARMUP_TOKENS` tokens (the first timed apart as
    ``first_call_s``; ``first`` runs before it and ``after_first`` after it), then ``--reps`` timed
    generations of ``--new-tokens``, each into a fresh ``make_cache()`` (``before`` runs, untimed,
    before each generation after the first) with the peak memory counted from its start.
    ``static``: decode with :func:`static_generate` instead of :func:`greedy_generate`."""
    def generate(tokens: int) -> tuple[torch.Tensor, list[float], Any]:
        cache = make_cache()
        out, ms = (static_generate if static else greedy_generate)(
            model, ids, tokens, cache, device, chunk=chunk, prefill_context=prefill_context,
            decode_context=lambda: decode_backends(args.decode_sdpa, device))
        return out, ms, cache

    warm = min(args.new_tokens, WARMUP_TOKENS)
    if first is not None:
        first()
    sync(device)
    start = time.perf_counter()
    generate(warm)
    sync(device)
    first_s = time.perf_counter() - start
    if after_first is not None:
        after_first()
    for _ in range(args.warmup - 1):
        if before is not None:
            before()
        generate(warm)
    free_memory(device)
    ttft: list[float] = []
    e2e: list[float] = []
    rates: list[float] = []  # tokens/s of each generation's decode steps (the whole batch)
    steps: list[float] = []
    peaks: list[int] = []
    before_bytes = allocated_bytes(device)
    batch = ids.shape[0]
    for _ in range(args.reps):
        if before is not None:
            before()
        free_memory(device)
        timing.reset_peak(device)
        tokens, ms, cache = generate(args.new_tokens)
        peak = peak_bytes(device)
        if peak is not None:
            peaks.append(peak)
        ttft.append(ms[0])
        e2e.append(sum(ms))
        steps += ms[1:]
        if len(ms) > 1:
            rates.append(batch * len(ms[1:]) / (sum(ms[1:]) / 1e3))
        cache_bytes = cache_nbytes(cache)
        del cache
    return {
        "first_call_s": first_s,
        "ttft_ms": statistics.median(ttft),
        "ttft_samples_ms": ttft,
        "decode_step_ms": statistics.median(steps) if steps else None,
        "decode_step_ms_mean": statistics.fmean(steps) if steps else None,
        "decode_tokens_per_s": statistics.median(rates) if rates else None,
        "e2e_ms": statistics.median(e2e),
        "e2e_samples_ms": e2e,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "allocated_before_bytes": before_bytes,
        "kv_cache_bytes": cache_bytes,
        "tokens": tokens.tolist(),
    }


def flash_attn_unavailable(device: torch.device) -> str | None:
    """Why the ``flash_attention_2`` row cannot run here (``flash_attn`` does not import, or no
    CUDA), else ``None``."""
    try:
        importlib.import_module("flash_attn")
    except ImportError:
        return "flash_attn not installed"
    if device.type != "cuda":
        return "flash_attention_2 needs CUDA"
    return None


def finish(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The baseline of these rows (one model, length and batch): per figure, the fastest dense SDPA
    row's; each row's ratios over it."""
    dense = [r for r in rows if r.get("kind") == "dense" and r["variant"].startswith("dense:sdpa")
             and r.get("error") is None and r.get("skipped") is None]
    if not dense:
        return None
    base: dict[str, Any] = {}
    for key in RATIOS.values():
        values = [(r[key], r["variant"]) for r in dense if r.get(key) is not None]
        if values:
            base[key], base[f"{key}_variant"] = min(values)
    for r in rows:
        for ratio, key in RATIOS.items():
            if r.get(key) is not None and base.get(key):
                r[ratio] = r[key] / base[key]
    return base


def bench_model(shape: str, args: argparse.Namespace, device: torch.device, report: dict[str, Any],
                write: Callable[[], None]) -> None:
    from elasticfw.model.elastic import ElasticModel

    config = prefill.build_config(shape, args.layers)
    model = prefill.build_model(config, device, DTYPES[args.dtype])
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    report["models"][shape] = {
        "layers": layers, "full_layers": prefill.SHAPES[shape][1]["num_hidden_layers"], "kv_heads": kv_heads,
        "q_heads": config.num_attention_heads, "head_dim": config.head_dim, "hidden_size": config.hidden_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
    router, realised = prefill.fixed_router(args.msr, layers, kv_heads)
    hybrid = f"fa-ssa:msr={realised:g}"

    def dynamic_cache() -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=config)

    for S in args.seq:
        for B in args.batch:
            ids = torch.randint(3, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(S)).to(device)
            chunk = prefill_chunk(args, B, S)
            rows: list[dict[str, Any]] = []
            group = {"model": shape, "seq": S, "batch": B, "new_tokens": args.new_tokens, "layers": layers,
                     "prefill_chunk": chunk, "prefill_forwards": -(-S // chunk) if chunk else 1}

            def run(row: dict[str, Any], body: Callable[[dict[str, Any]], None], rows: list = rows,
                    group: dict = group) -> None:
                row = {**group, **row, "error": None, "skipped": None}
                try:
                    body(row)
                except Exception as exc:  # noqa: BLE001 - a variant's failure is recorded, the run goes on
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    row["traceback"] = traceback.format_exc(limit=8)
                    report["failures"].append(f"{shape} S={group['seq']} B={group['batch']} {row['variant']}: "
                                              f"{row['error']}")
                free_memory(device)  # nothing of this variant lives into the next one's figures
                rows.append(row)
                report["results"].append(row)
                report["baselines"][f"{shape}/{group['seq']}/{group['batch']}"] = finish(rows)
                write()
                shown = row["skipped"] or row["error"] or (
                    f"TTFT {row['ttft_ms']:.1f} ms, step {row['decode_step_ms'] or 0:.2f} ms, e2e {row['e2e_ms']:.0f} ms")
                print(f"[generate] {shape} S={group['seq']} B={group['batch']} {row['variant']}: {shown}", flush=True)

            def dense_body(row: dict[str, Any], context: Callable[[], Any] = contextlib.nullcontext,
                           ids: torch.Tensor = ids, chunk: int | None = chunk) -> None:
                row.update(time_variant(model, ids, args, device, make_cache=dynamic_cache, chunk=chunk,
                                        prefill_context=context), msr=0.0, esr=0.0)

            def flash_body(row: dict[str, Any]) -> None:
                reason = flash_attn_unavailable(device)
                if reason is not None:
                    row["skipped"] = reason
                    return
                model.set_attn_implementation("flash_attention_2")
                try:
                    dense_body(row)
                finally:
                    model.set_attn_implementation("sdpa")

            run({"variant": "dense:sdpa", "kind": "dense", "cache": "dynamic"}, dense_body)
            if device.type == "cuda":
                run({"variant": "dense:sdpa_cudnn_first", "kind": "dense", "cache": "dynamic"},
                    lambda row: dense_body(row, prefill.cudnn_first))
            run({"variant": "dense:flash_attention_2", "kind": "dense", "cache": "dynamic"}, flash_body)

            # (label, router, its MSR, KV cache, static decode): the elastic model with the full and the
            # compact cache, then static decoding (a CUDA graph per step on CUDA) of the compact cache,
            # beside the same static path with every head full (its baseline: dense attention decoded
            # without the host's per-step work)
            full_router, _ = prefill.fixed_router(0.0, layers, kv_heads)
            eager_compact = f"elastic:{args.executor}:{hybrid}:compact_cache"
            static_compact, static_full_heads = f"elastic:static:{hybrid}:compact_cache", STATIC_FULL_HEADS
            elastic_variants = [
                (f"elastic:{args.executor}:{hybrid}:full_cache", router, realised, "full", False),
                (eager_compact, router, realised, "compact", False),
            ]
            if not args.no_static:
                elastic_variants += [
                    (static_compact, router, realised, "compact", True),
                    (static_full_heads, full_router, 0.0, "compact", True),
                ]
            for label, routing, msr, kv_cache, static in elastic_variants:
                def elastic_body(row: dict[str, Any], kv_cache: str = kv_cache, ids: torch.Tensor = ids,
                                 chunk: int | None = chunk, routing: dict = routing, msr: float = msr,
                                 static: bool = static) -> None:
                    section = prefill.elastic_section(args, args.executor, routing, "fa-ssa").model_copy(
                        update={"kv_cache": kv_cache})
                    elastic = ElasticModel(model, section)
                    runtime = elastic.runtime

                    def stats_on() -> None:  # the first generation collects the routing statistics
                        runtime.collect_stats = True

                    def stats_off() -> None:  # ESR of a chunked prefill would be its first chunk's: none
                        report_ = elastic.routing
                        row.update(msr=float(report_.msr.mean()), esr=None if chunk else float(report_.esr.mean()))
                        runtime.collect_stats = False

                    try:
                        row.update(time_variant(
                            elastic, ids, args, device, chunk=chunk, prefill_context=contextlib.nullcontext,
                            make_cache=elastic.make_kv_cache if kv_cache == "compact" else dynamic_cache,
                            first=stats_on, after_first=stats_off, static=static,
                            before=runtime.layout_cache.clear))  # each generation plans afresh, as a request does
                    finally:
                        elastic.unwrap()
                    if abs(row["msr"] - msr) > 1e-6:
                        raise AssertionError(f"routing gave MSR {row['msr']} instead of {msr}")

                run({"variant": label, "kind": "static" if static else "elastic", "executor": args.executor,
                     "config": "fa-ssa", "cache": kv_cache, "target_msr": msr, "decode": "static" if static else "eager"},
                    elastic_body)
            by_label = {r["variant"]: r for r in rows if r.get("error") is None and r.get("skipped") is None}
            static_full, eager_row, static_row = (by_label.get(k) for k in (static_full_heads, eager_compact,
                                                                            static_compact))
            if static_row is not None and eager_row is not None:  # the same routing and cache, decoded both ways
                same = torch.tensor(static_row["tokens"]) == torch.tensor(eager_row["tokens"])
                static_row["tokens_equal_eager_compact"] = float(same.float().mean())
            for r in rows:
                if static_full is not None and r.get("decode_step_ms") is not None:
                    r["decode_step_over_static_full"] = r["decode_step_ms"] / static_full["decode_step_ms"]
                    r["e2e_over_static_full"] = r["e2e_ms"] / static_full["e2e_ms"]
            write()


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """TTFT and decode tokens/s vs prompt length, one line per variant and batch (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in report["results"] if r.get("ttft_ms") is not None]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in ((axes[0], "ttft_ms", "time to first token (ms)"),
                           (axes[1], "decode_tokens_per_s", "decode tokens/s (whole batch)")):
        for name in dict.fromkeys((r["model"], r["variant"], r["batch"]) for r in rows):
            pts = sorted((r["seq"], r[key]) for r in rows if (r["model"], r["variant"], r["batch"]) == name
                         and r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{name[1]} B={name[2]}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.legend(fontsize=6)
    layers = ", ".join(f"{m} ({v['layers']} layers)" for m, v in report["models"].items())
    fig.suptitle(f"{layers}, +{report['new_tokens']} tokens, {report['environment'].get('gpu') or 'cpu'}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="JSON file to write (refused if it exists)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--model", nargs="+", default=["llama-3.1-8b"], help=f"shapes: {sorted(prefill.SHAPES)}")
    p.add_argument("--seq", type=int, nargs="+", default=[32768, 131072], help="prompt tokens")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="prompts per generation")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated (greedy, no end-of-sequence stop)")
    p.add_argument("--layers", type=int, default=4, help="keep the first N decoder layers")
    p.add_argument("--executor", default="split", help="registered executor of the elastic variants")
    p.add_argument("--msr", type=float, default=0.875, help="FA-SSA's model sparsity ratio (whole KV heads)")
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--local", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=1, help=f"untimed generations of {WARMUP_TOKENS} tokens per variant")
    p.add_argument("--reps", type=int, default=2, help="timed generations per variant")
    p.add_argument("--decode-sdpa", default="flash,efficient,math",
                   help="SDPA backends of every variant's decode steps on CUDA ('auto': torch's choice; cuDNN "
                   "re-plans for every new key length)")
    p.add_argument("--max-prefill-tokens", type=int, default=262144,
                   help="a prefill of more than batch x length tokens runs in chunks of --prefill-chunk (0: never)")
    p.add_argument("--prefill-chunk", type=int, default=4096, help="prompt tokens per sample of each prefill chunk")
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out with .png)")
    p.add_argument("--no-static", action="store_true",
                   help="skip the static-decoding rows (elasticfw.model.static_decode: a CUDA graph per step on CUDA)")


def check_arguments(args: argparse.Namespace) -> str | None:
    """The first argument whose value cannot run, as a message, or ``None``."""
    for name in ("warmup", "reps", "new_tokens", "prefill_chunk"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1"
    for name in ("seq", "batch"):
        bad = [v for v in getattr(args, name) if v < 1]
        if bad:
            return f"--{name} {bad[0]}: must be at least 1"
    if not 0 <= args.msr <= 1:
        return f"--msr {args.msr}: must lie in [0, 1]"
    names = [n.strip() for n in args.decode_sdpa.split(",") if n.strip()]
    if args.decode_sdpa != "auto" and (not names or any(n not in SDPA_BACKENDS for n in names)):
        return f"--decode-sdpa {args.decode_sdpa!r}: expected 'auto' or a list of {sorted(SDPA_BACKENDS)}"
    if args.max_prefill_tokens < 0:
        return f"--max-prefill-tokens {args.max_prefill_tokens}: must be at least 0"
    return None


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    if args is None:
        parser = argparse.ArgumentParser(prog="elasticfw bench generate", description=__doc__.splitlines()[0])
        add_arguments(parser)
        args = parser.parse_args(argv)
    device = torch.device(args.device)
    problem = check_arguments(args)
    if problem is None and args.out.exists() and not args.overwrite:
        problem = f"--out {args.out}: exists; pass --overwrite to replace it"
    if problem is None and device.type == "cuda" and not torch.cuda.is_available():
        problem = f"--device {args.device}: CUDA is not available"
    if problem is not None:
        print(f"[generate] {problem}", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "benchmark": "elasticfw.bench.generate",
        "environment": environment(device),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "dtype": args.dtype,
        "new_tokens": args.new_tokens,
        "decoding": "greedy, a fixed number of new tokens (no end-of-sequence stop)",
        "streaming": {"sink_tokens": args.sink, "local_tokens": args.local, "block_size": args.block_size},
        "models": {},
        "baselines": {},
        "results": [],
        "failures": [],
        "complete": False,  # true only in the last write: a run killed midway leaves a file that says so
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        atomic_write_text(args.out, json.dumps(report, indent=2, default=str) + "\n")

    for shape in args.model:
        bench_model(shape, args, device, report, write)
        free_memory(device)  # the model of this shape is gone
    return timing.finish_report(report, args, write, plot, "generate")


if __name__ == "__main__":
    sys.exit(main())
