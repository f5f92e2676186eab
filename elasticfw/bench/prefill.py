"""Model-level prefill benchmark: time to first token of a full-size shape with random weights.

    elasticfw bench prefill --out results/bench/NAME/prefill.json                      # GPU, all shapes
    elasticfw bench prefill --model llama-3.1-8b --seq 32768 131072 --layers 4 --out ...
    elasticfw bench prefill --device cpu --model tiny-llama --seq 256 --out /tmp/p.json   # smoke run

A model of the real sizes (``llama-3.1-8b``, ``qwen3-8b``) with random weights, optionally only
its first ``--layers`` decoder layers; one prompt of S random tokens, batch 1, the first token's
logits only. Rows: ``dense:sdpa`` (on CUDA also ``dense:sdpa_cudnn_first``; the faster is
``baseline_ms``), ``elastic:<executor>:msr=0`` and ``elastic:<executor>:<config>:msr=<m>`` for the
paper's configurations (:data:`CONFIGS`) under a ``fixed`` router. Each row: the median of
``--reps`` forwards after ``--warmup``, ``first_call_s``, ``esr``, ``ratio`` and ``speedup``; each
elastic forward builds its layouts afresh, as a request does. A failing variant records its error
(exit status 1); the JSON carries the environment and a PNG plot is written beside it. Details:
``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from elasticfw.atomic import atomic_write_text
from elasticfw.bench.timing import finish_report
from elasticfw.provenance import environment

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: shape name -> (transformers model_type, config fields)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.1-8b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-8b": (
        "qwen3",
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        ),
    ),
    # CPU smoke test: the Llama architecture at a tiny size (GQA group 2)
    "tiny-llama": (
        "llama",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
    ),
}


def build_config(shape: str, layers: int | None = None) -> Any:
    """The transformers config of ``shape`` (see :data:`SHAPES`), with its first ``layers`` layers."""
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise SystemExit(f"unknown --model {shape!r}; choose from {sorted(SHAPES)}")
    model_type, fields = SHAPES[shape]
    fields = dict(fields)
    if layers is not None:
        if not 1 <= layers <= fields["num_hidden_layers"]:
            raise SystemExit(f"--layers {layers}: {shape} has {fields['num_hidden_layers']} layers")
        fields["num_hidden_layers"] = layers
    return AutoConfig.for_model(model_type, **fields)


def build_model(config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def fixed_router(msr: float, layers: int, kv_heads: int) -> tuple[dict[str, Any], float]:
    """The ``fixed`` router section keeping the first ``round((1 - msr) * kv_heads)`` KV heads of
    every layer full, and the MSR that realises."""
    n_full = int(round((1.0 - msr) * kv_heads))
    if n_full >= kv_heads:
        return {"name": "fixed", "assign": "all_retrieval"}, 0.0
    if n_full <= 0:
        return {"name": "fixed", "assign": "all_sparse"}, 1.0
    heads = [[layer, h] for layer in range(layers) for h in range(n_full)]
    return {"name": "fixed", "assign": "retrieval_heads", "heads": heads}, 1.0 - n_full / kv_heads


def _full(args: argparse.Namespace) -> dict[str, Any]:
    return {"name": "full", "block_size": args.block_size}


def _streaming(args: argparse.Namespace) -> dict[str, Any]:
    return {"name": "streaming", "sink_tokens": args.sink, "local_tokens": args.local, "block_size": args.block_size}


def _xattention(args: argparse.Namespace) -> dict[str, Any]:
    return {"name": "xattention", "stride": 16, "threshold": 0.9, "block_size": args.block_size}


#: hybrid configuration (the paper's "{retrieval}-{sparse}" names) -> recipe sections of its two modes
CONFIGS: dict[str, tuple[Callable[[argparse.Namespace], dict[str, Any]], Callable[[argparse.Namespace], dict[str, Any]]]] = {
    "fa-ssa": (_full, _streaming),
    "fa-xa": (_full, _xattention),
    "xa-ssa": (_xattention, _streaming),
}


def elastic_section(args: argparse.Namespace, executor: str, router: dict[str, Any], config: str = "fa-ssa") -> Any:
    """The validated ``elastic`` recipe section of hybrid ``config`` (:data:`CONFIGS`) with ``router``."""
    from elasticfw.recipe import validate_recipe_data

    retrieval, sparse = CONFIGS[config]
    return validate_recipe_data({"elastic": {
        "retrieval_mode": retrieval(args),
        "sparse_mode": sparse(args),
        "executor": {"name": executor},
        "router": router,
    }}).elastic


@contextlib.contextmanager
def cudnn_first() -> Iterator[None]:
    """SDPA with cuDNN first in the backend priority (CUDA)."""
    import inspect

    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if "set_priority" in inspect.signature(sdpa_kernel).parameters:
        with sdpa_kernel(order, set_priority=True):
            yield
    else:
        with sdpa_kernel(order):
            yield


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int, *,
                 first: Callable[[], Any] | None = None, before: Callable[[], Any] | None = None) -> dict[str, Any]:
    """The first call (``first``, else ``fn``; seconds, compilation included), ``warmup - 1`` more
    untimed calls, then the median of ``reps`` timed ones. ``before`` runs, untimed, before each
    call after the first (the elastic rows drop the layouts kept from the previous forward there)."""
    _sync(device)
    start = time.perf_counter()
    (first or fn)()
    _sync(device)
    first_s = time.perf_counter() - start
    for _ in range(max(0, warmup - 1)):
        if before is not None:
            before()
        fn()
    samples = []
    for _ in range(reps):
        if before is not None:
            before()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return {"first_call_s": first_s, "ms": statistics.median(samples), "samples_ms": samples}


def bench_model(shape: str, args: argparse.Namespace, device: torch.device, report: dict[str, Any],
                write: Callable[[], None]) -> None:
    from elasticfw.model.elastic import ElasticModel

    dtype = DTYPES[args.dtype]
    config = build_config(shape, args.layers)
    model = build_model(config, device, dtype)
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    report["models"][shape] = {
        "layers": layers,
        "full_layers": SHAPES[shape][1]["num_hidden_layers"],
        "q_heads": config.num_attention_heads,
        "kv_heads": kv_heads,
        "head_dim": config.head_dim,
        "hidden_size": config.hidden_size,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    for S in args.seq:
        ids = torch.randint(3, config.vocab_size, (1, S), generator=torch.Generator().manual_seed(S)).to(device)

        def forward(m: Any = model, ids: torch.Tensor = ids) -> None:
            with torch.no_grad():
                m(input_ids=ids, use_cache=False, logits_to_keep=1)

        rows: list[dict[str, Any]] = []

        def run(row: dict[str, Any], body: Callable[[dict[str, Any]], None], S: int = S,
                rows: list[dict[str, Any]] = rows) -> None:
            row = {"model": shape, "seq": S, "layers": layers, **row, "error": None}
            try:
                body(row)
            except Exception as exc:  # noqa: BLE001 - a variant's failure is recorded, the run goes on
                row["error"] = f"{type(exc).__name__}: {exc}"
                row["traceback"] = traceback.format_exc(limit=8)
                report["failures"].append(f"{shape} S={S} {row['variant']}: {row['error']}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            report["results"].append(row)
            _finish(rows)
            write()
            shown = f"{row['ms']:.1f} ms" if row.get("ms") is not None else row["error"]
            print(f"[prefill] {shape} S={S} {row['variant']}: {shown}", flush=True)

        def dense_body(row: dict[str, Any], ctx: Callable[[], Any] = contextlib.nullcontext) -> None:
            def fn() -> None:
                with ctx():
                    forward()

            row.update(time_forward(fn, device, args.warmup, args.reps), esr=0.0, msr=0.0)

        run({"variant": "dense:sdpa", "kind": "dense"}, dense_body)
        if device.type == "cuda":
            run({"variant": "dense:sdpa_cudnn_first", "kind": "dense"},
                lambda row: dense_body(row, cudnn_first))

        for executor in args.executors:
            variants = [("fa-ssa", 0.0)] + [(hybrid, msr) for hybrid in args.configs for msr in args.msr]
            for i, (hybrid, msr) in enumerate(variants):
                router, realised = fixed_router(msr, layers, kv_heads)
                if realised == 0 and i > 0:
                    continue  # a hybrid that rounds to no sparse head is the MSR-0 row (all heads full)
                name = f"elastic:{executor}:msr=0" if realised == 0 else f"elastic:{executor}:{hybrid}:msr={realised:g}"

                def elastic_body(row: dict[str, Any], executor: str = executor, router: dict = router,
                                 realised: float = realised, hybrid: str = hybrid) -> None:
                    elastic = ElasticModel(model, elastic_section(args, executor, router, hybrid))
                    runtime = elastic.runtime

                    def stats_pass() -> None:  # the first call: routing statistics on, then off
                        runtime.collect_stats = True
                        forward(elastic)
                        runtime.collect_stats = False

                    try:
                        # as many untimed forwards as the dense rows; before each later one the
                        # layouts kept from the previous forward (and the executor's conversions of
                        # them, keyed on the layout objects) are dropped, so every timed forward plans
                        # its attention as a new request does
                        row.update(time_forward(lambda: forward(elastic), device, args.warmup, args.reps,
                                                first=stats_pass, before=runtime.layout_cache.clear))
                        report_ = elastic.routing
                        row["esr"] = float(report_.esr.mean())
                        row["msr"] = float(report_.msr.mean())
                    finally:
                        elastic.unwrap()
                    if abs(row["msr"] - realised) > 1e-6:
                        raise AssertionError(f"routing gave MSR {row['msr']} instead of {realised}")

                run({"variant": name, "kind": "elastic", "executor": executor, "config": None if realised == 0 else hybrid,
                     "target_msr": msr}, elastic_body)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _finish(rows: list[dict[str, Any]]) -> None:
    """Baseline = the fastest dense variant of these rows; ratio and speed-up of each row against it."""
    dense = [r["ms"] for r in rows if r.get("kind") == "dense" and r.get("ms") is not None]
    if not dense:
        return
    base = min(dense)
    for r in rows:
        r["baseline_ms"] = base
        if r.get("ms") is not None:
            r["ratio"] = r["ms"] / base
            r["speedup"] = base / r["ms"]


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Speed-up over the best dense baseline vs sequence length, one panel per model (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    models = list(report["models"])
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], models):
        rows = [r for r in report["results"] if r["model"] == shape and r.get("speedup") is not None]
        for variant in dict.fromkeys(r["variant"] for r in rows):
            pts = sorted((r["seq"], r["speedup"]) for r in rows if r["variant"] == variant)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("prefill speed-up vs best dense SDPA")
        layers = report["models"][shape]["layers"]
        ax.set_title(f"{shape} ({layers} layers), {report['environment'].get('gpu') or 'cpu'}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="elasticfw bench prefill", description=__doc__.splitlines()[0])
    add_arguments(p)
    return p.parse_args(argv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="JSON file to write (refused if it exists)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--model", nargs="+", default=["llama-3.1-8b", "qwen3-8b"], help=f"shapes: {sorted(SHAPES)}")
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all)")
    p.add_argument("--executors", nargs="+", default=["split", "flex"], help="registered executor names")
    p.add_argument("--msr", type=float, nargs="*", default=[0.5, 0.875], help="hybrid MSRs besides 0")
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["fa-ssa"],
                   help="hybrid configurations timed at each --msr (retrieval-sparse mode pairs)")
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--local", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=1, help="untimed forwards (the first is timed apart)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out with .png)")


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    args = args if args is not None else parse_args(argv)
    device = torch.device(args.device)
    if args.out.exists() and not args.overwrite:
        print(f"[prefill] {args.out} exists; pass --overwrite to replace it", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("[prefill] CUDA requested but not available", file=sys.stderr)
        return 2
    if args.warmup < 1 or args.reps < 1:
        print("[prefill] --warmup and --reps must be at least 1", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "benchmark": "elasticfw.bench.prefill",
        "environment": environment(device),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "batch": 1,
        "dtype": args.dtype,
        "use_cache": False,
        "logits_to_keep": 1,
        "streaming": {"sink_tokens": args.sink, "local_tokens": args.local, "block_size": args.block_size},
        "configs": {c: {"retrieval_mode": CONFIGS[c][0](args), "sparse_mode": CONFIGS[c][1](args)} for c in args.configs},
        "models": {},
        "results": [],
        "failures": [],
        # false in every write until the last: a run killed midway leaves a file that says so
        "complete": False,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        atomic_write_text(args.out, json.dumps(report, indent=2, default=str) + "\n")

    for shape in args.model:
        bench_model(shape, args, device, report, write)
    return finish_report(report, args, write, plot, "prefill")


if __name__ == "__main__":
    sys.exit(main())
