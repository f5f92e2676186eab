"""The speed targets' figures in one command: the GPU benchmarks, the CPU demo timing, then targets.json.

    python scripts/bench_targets.py gpu --out results/bench/speed-targets       # on one H200, about 8-10 min
    python scripts/bench_targets.py gpu --steps attention --out ...          # or one step per call
    python scripts/bench_targets.py demo-cpu --out results/bench/speed-targets  # on a 2-core CPU, about 7 min
    python scripts/bench_targets.py targets --out results/bench/speed-targets   # targets.json from the JSONs there

``gpu`` runs, each in its own process (one crash does not lose the others) and each writing its
JSON under ``--out`` as it goes:

1. ``attention_128k.json`` — ``python -m elasticfw.bench.attention --seq 131072 --executors flex
   split --no-backward --check-seq 4096``: dense cuDNN / FlashAttention SDPA, every mode's
   planning (layout) time and kernel through ``flex`` and ``split``, the FA-SSA hybrid (MSR
   0.875) through both (``split`` through ``attend_routed``), after a correctness check of both
   executors against the reference at 4,096 tokens (where sink 128 + local 2,048 is sparse).
2. ``router.json`` — ``python -m elasticfw.bench.router --seq 8192 131072`` (32 layers).
3. ``prefill.json`` — ``elasticfw bench prefill --model llama-3.1-8b --seq 8192 32768 131072
   --layers 4 --executors split --msr 0.5 0.875 --configs fa-ssa fa-xa xa-ssa --reps 5`` (five timed
   forwards: the 128K FA-SSA samples of the nineteenth session spread 1%, about its margin over
   the target): the model figures are *ratios* (best dense SDPA time /
   elastic time) measured on the first 4 of the 32 layers of the Llama-3.1-8B shape. Every layer
   has the same shape and cost, so the ratio of 4 layers differs from the ratio of 32 only by the
   embedding and the one-token LM head (below 1% of a 32K prefill); ``--layers 32`` measures the
   whole model (about 4x longer). ``--with-qwen`` adds the Qwen3-8B shape.

   It times FA-SSA, FA-XA and XA-SSA at MSR 0.5 and 0.875 (``--configs``) at 8K, 32K and 128K.
4. ``decode.json`` (only with ``--steps decode``) — ``python -m elasticfw.bench.decode_memory
   --prefill-executor split --decode-executor split --profile``: decode step time and KV-cache memory
   at 32K and 128K context, dense vs FA-SSA with the full and the compact cache (4 layers), and a
   ``torch.profiler`` table of three more steps per variant (where a step's GPU time goes; the
   steps are host-bound, ``results/bench/speed-targets-2026-12-06/README.md``).

   ``generate.json`` (only with ``--steps generate``, a call of its own: about 5 min on an H100) —
   ``elasticfw bench generate --reps 1``: 32K and 128K prompts + 256 new tokens at batch 1 and 8,
   dense vs FA-SSA MSR 0.875 with the full and the compact cache (4 layers), whose compact-cache
   decode step and end-to-end time over dense are figures of ``targets.json``.

5. ``density.json`` — ``python -m elasticfw.bench.density --seq 131072 --tiles 128,128,8,2
   --triton 128,128,8,3 128,64,8,3``: FlexAttention and the Triton block-sparse kernel on random
   block layouts of 100% down to 12.5% of the causal blocks, against dense cuDNN (the block-sparse
   kernel's criteria).
Before them ``--steps gpu-tests`` runs the GPU tests of the kernels (``pytest -m gpu``,
``gpu_tests.xml``): the kernels' correctness at long lengths, checked on the same machine.

6. ``variants/`` (only with ``--steps variants``; ``targets`` does not read it): the 128K layer of
   MoBA with ``query_granularity: block`` and NSA with ``token``, and MoBA's and NSA's 64-token
   layouts (their defaults) on 64 x 64 FlexAttention tiles (``--flex-set``) instead of coarsened
   to 128, each through FlexAttention (``sparse_kernel=flex``); per-token MoBA through the
   Triton block-sparse kernel with 64-row tiles (``sparse_kernel_tiles``); and NSA with
   ``score_keys: float32`` (the float32 compressed keys as two 16-bit terms; the default, ``input``,
   is one term) through ``split``, its planning beside the default's; and per-token MoBA gathered
   with ``gather_merge: entries`` (one launch over every entry, then one merge; checked against the
   reference at 4K first) beside the default's per-rank passes.

7. ``variants/kernel_timing.json`` (only with ``--steps kernels``): ``scripts/sparse_kernel_timing.py
   --profile --triton-work-lists``, per mode the Triton kernels' work lists (torch, and the
   one-launch Triton builder), kernel and whole call, the gather path, and profiler tables (where
   the per-token MoBA time goes).

8. ``variants/decode_host.json`` (only with ``--steps decode-host``): ``scripts/decode_host_timing.py
   --cprofile 200``, the host time of one routed layer's decode attention piece by piece (dense SDPA,
   the Triton decode kernel, the split executor's routed call) and where the kernel's call spends it.

9. ``variants/router_timing.json`` (only with ``--steps router-host``): ``scripts/router_timing.py
   --cprofile 100``, where the router's time per layer goes: its Python, Triton's launch, and the
   kernel's own GPU time (a CUDA graph replay), which says whether the router figure is bound by
   the host or by the kernel.

then ``targets`` when one of the steps that give its figures ran (``attention``, ``router``,
``prefill``, ``generate``, ``density``; a call of ``--steps gpu-tests`` alone writes no ``targets.json`` of
missing figures). ``demo-cpu`` times the old CPU demo (``results/bench/demo-executors/demo-cpu.json``: ``elasticfw
compare`` on the embedded SmolLM2-135M, passkey at 1,440 tokens, 20 samples, batch 4, 8 new tokens;
full attention vs every head streaming with sink 64 / local 256), ``--executor`` (default
``split``, the old file used ``sdpa``), into ``demo_cpu.json``: after one untimed sample through
every variant, ``--rounds`` (default 4) runs of each variant, the first variant alternating between rounds, seconds summed over the rounds (each
round's in ``round_seconds``: on the 2-core machine single rounds of unchanged code gave ratios
from 0.75 to 1.08, and two-round runs 0.81 to 0.95; the first four-round run's rounds gave 0.90 to
0.93, ``results/bench/speed-targets-h100-2026-12-07/``); ``--modes xattention moba
nsa`` adds every head in each of those modes (``over_full``: each variant's seconds over full's).
``targets`` reads every JSON under
``--out`` (:func:`elasticfw.bench.targets.build_targets`) and writes ``targets.json``: copy a
``demo_cpu.json`` measured on the CPU machine into the folder first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: the old demo recipe (elasticfw/recipes/demo.yaml before the router-training demo, d6381a6^)
DEMO = {
    "description": "Embedded demo: full vs all-streaming (passkey, ~1.5K tokens), timing",
    "seed": 0,
    "model": {"name": "smollm2-135m", "dtype": "float32", "device": "cpu"},
    "elastic": {
        "retrieval_mode": {"name": "full", "block_size": 64},
        "sparse_mode": {"name": "streaming", "sink_tokens": 64, "local_tokens": 256, "block_size": 64},
        "executor": {"name": "split"},
    },
    "eval": {"task": {"name": "passkey", "context_tokens": 1500, "num_samples": 20}, "batch_size": 4,
             "max_new_tokens": 8},
}
VARIANTS = {"full": {"name": "fixed", "assign": "all_retrieval"}, "all-streaming": {"name": "fixed", "assign": "all_sparse"}}


#: the ``gpu`` steps whose JSON ``targets`` reads a figure from
FIGURE_STEPS = frozenset({"attention", "router", "prefill", "generate", "density"})


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _run(cmd: list[str], log: list[dict[str, Any]]) -> int:
    print("[bench-targets] $ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    rc = subprocess.call(cmd)
    log.append({"command": cmd, "returncode": rc, "seconds": time.perf_counter() - start})
    print(f"[bench-targets] exit {rc} after {log[-1]['seconds']:.0f} s", flush=True)
    return rc


def gpu(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    log: list[dict[str, Any]] = []
    layers = str(args.layers)
    models = ["llama-3.1-8b", "qwen3-8b"] if args.with_qwen else ["llama-3.1-8b"]
    steps: dict[str, list[str]] = {
        "attention": [py, "-m", "elasticfw.bench.attention", "--seq", "131072", "--executors", "flex", "split", "--no-backward",
         "--check-seq", "4096", "--warmup-ms", "50", "--rep-ms", "300", "--overwrite",
         "--out", str(out / "attention_128k.json")],
        "router": [py, "-m", "elasticfw.bench.router", "--seq", "8192", "131072", "--reps", "20", "--out", str(out / "router.json")],
        "prefill": [py, "-m", "elasticfw.cli", "bench", "prefill", "--model", *models, "--seq", "8192", "32768", "131072",
         "--layers", layers, "--executors", "split", "--msr", "0.5", "0.875", "--configs", "fa-ssa", "fa-xa", "xa-ssa",
         "--reps", "5", "--overwrite", "--out", str(out / "prefill.json")],
        "generate": [py, "-m", "elasticfw.cli", "bench", "generate", "--layers", layers, "--reps", "1", "--overwrite",
                     "--out", str(out / "generate.json")],
        "decode": [py, "-m", "elasticfw.bench.decode_memory", "--prefill-executor", "split", "--decode-executor", "split",
         "--profile", "--out", str(out / "decode.json")],
        "gpu-tests": [py, "-m", "pytest", "tests/test_gpu.py", "tests/test_router_fused.py", "tests/test_xattention_triton.py",
         "tests/test_moba_triton.py", "tests/test_nsa_triton.py", "tests/test_block_sparse_gpu.py",
         "tests/test_work_lists_triton.py", "-m", "gpu", "-q",
         "-p", "no:cacheprovider", "--junitxml", str(out / "gpu_tests.xml")],
        "kernels": [py, str(Path(__file__).with_name("sparse_kernel_timing.py")), "--profile", "--triton-work-lists",
                    "--compact-lists",
                    "--json", str(out / "variants" / "kernel_timing.json")],
        "decode-host": [py, str(Path(__file__).with_name("decode_host_timing.py")), "--cprofile", "200", "--json",
                        str(out / "variants" / "decode_host.json")],
        "router-host": [py, str(Path(__file__).with_name("router_timing.py")), "--cprofile", "100", "--json",
                        str(out / "variants" / "router_timing.json")],
        "density": [py, "-m", "elasticfw.bench.density", "--seq", "131072", "--tiles", "128,128,8,2", "--triton",
         "128,128,8,3", "128,64,8,3", "--overwrite", "--out", str(out / "density.json")],
    }
    # beside the figures (in variants/, which targets does not read): MoBA with one selection per
    # query tile (NSA with one per token), and both 64-token layouts on 64 x 64 FlexAttention tiles
    base = [py, "-m", "elasticfw.bench.attention", "--seq", "131072", "--executors", "flex", "split", "--no-backward",
            "--no-hybrid", "--warmup-ms", "50", "--rep-ms", "300", "--overwrite"]
    variant = [*base, "--check-seq", "0"]
    flex = ["--flex-set", "sparse_kernel=flex"]
    variants = [
        [*variant, *flex, "--modes", "moba", "nsa", "--set", "moba.query_granularity=block", "--set",
         "nsa.query_granularity=token", "--out", str(out / "variants" / "granularity_128k.json")],
        [*variant, *flex, "--modes", "moba", "nsa", "--flex-set", "kernel_block_size=64", "--flex-set",
         "kernel_options={BLOCK_M: 64, BLOCK_N: 64}", "--out", str(out / "variants" / "tiles64_128k.json")],
        [*variant, "--executors", "flex", "--modes", "moba", "--flex-set", "sparse_kernel_tiles=[64,128,4,3]",
         "--out", str(out / "variants" / "moba_triton_tiles64_128k.json")],
        [*base, "--check-seq", "4096", "--executors", "flex", "--modes", "moba", "--flex-set", "gather_merge=entries",
         "--out", str(out / "variants" / "moba_gather_entries_128k.json")],
        [*base, "--check-seq", "4096", "--executors", "split", "--modes", "nsa", "--set", "nsa.score_keys=float32",
         "--out", str(out / "variants" / "nsa_score_keys_float32_128k.json")],
    ]
    codes = []
    for name in args.steps:
        commands = variants if name == "variants" else [steps[name]]
        codes += [_run(cmd, log) for cmd in commands]
    log_path = out / "commands.log.json"
    previous = json.loads(log_path.read_text()) if log_path.exists() else []
    log_path.write_text(json.dumps(previous + log, indent=2) + "\n")
    if FIGURE_STEPS.intersection(args.steps):
        targets(args)
    else:
        print(f"[bench-targets] no step of {sorted(FIGURE_STEPS)} ran: targets.json not written")
    return 0 if not any(codes) else 1


def demo_cpu(args: argparse.Namespace) -> int:
    import torch

    from elasticfw.eval.generate import evaluate
    from elasticfw.model.loading import load_model, make_elastic
    from elasticfw.provenance import environment
    from elasticfw.recipe import validate_recipe_data
    from elasticfw.registry import get_registry

    data = json.loads(json.dumps(DEMO))
    data["elastic"]["executor"] = {"name": args.executor}
    data["eval"]["task"]["num_samples"] = args.samples
    recipe = validate_recipe_data(data)
    registry = get_registry()
    # the variants: (router, sparse mode section); --modes adds every head in each other sparse mode
    variants: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
        label: (router, data["elastic"]["sparse_mode"]) for label, router in VARIANTS.items()
    }
    for mode in args.modes:
        section = {"name": mode, "block_size": data["elastic"]["sparse_mode"]["block_size"]}
        validate_recipe_data({**data, "elastic": {**data["elastic"], "sparse_mode": section}})  # a clear error first
        variants[f"all-{mode}"] = (VARIANTS["all-streaming"], section)
    model, tokenizer = load_model(recipe.model)
    task = registry.make("task", recipe.eval.task)
    samples = task.samples(tokenizer, seed=recipe.seed)
    rows: dict[str, dict[str, Any]] = {}
    # untimed: one sample through every variant first, so that the process's first-run costs (lazy
    # imports, allocator growth, first kernels) fall on no variant's time (they fell on "full", which
    # runs first in round 1)
    for router, sparse_mode in variants.values():
        section = validate_recipe_data({**data, "elastic": {**data["elastic"], "router": router,
                                                            "sparse_mode": sparse_mode}}).elastic
        elastic = make_elastic(model, tokenizer, section, seed=recipe.seed)
        try:
            evaluate(elastic, tokenizer, task, samples[:1], batch_size=1, max_new_tokens=recipe.eval.max_new_tokens,
                     padding_side="left")
        finally:
            elastic.unwrap()
    for round_ in range(args.rounds):
        # alternate which variant runs first, so that neither always takes a slow start or a slow end
        order = list(variants.items()) if round_ % 2 == 0 else list(reversed(variants.items()))
        for label, (router, sparse_mode) in order:
            elastic_data = {**data["elastic"], "router": router, "sparse_mode": sparse_mode}
            section = validate_recipe_data({**data, "elastic": elastic_data}).elastic
            elastic = make_elastic(model, tokenizer, section, seed=recipe.seed)
            try:
                result = evaluate(elastic, tokenizer, task, samples, batch_size=recipe.eval.batch_size,
                                  max_new_tokens=recipe.eval.max_new_tokens, padding_side="left")
            finally:
                elastic.unwrap()
            summary = result.summary()
            row = rows.setdefault(label, {"label": label, **summary, "seconds": 0.0, "round_seconds": [],
                                          "tokens": [r.tokens for r in result.results],
                                          "completions": [r.completion for r in result.results]})
            if summary["accuracy"] != row["accuracy"]:  # greedy decoding: every round answers the same
                raise RuntimeError(f"demo-cpu: {label} scored {summary['accuracy']} in round {round_ + 1}, "
                                   f"{row['accuracy']} before")
            row["round_seconds"].append(summary["seconds"])
            row["seconds"] = sum(row["round_seconds"])
            print(f"[demo-cpu] round {round_ + 1}, {label}: {summary['seconds']:.1f} s, accuracy "
                  f"{summary['accuracy']:.2f}, ESR {summary['esr']:.3f}", flush=True)
    secs = {label: r["seconds"] for label, r in rows.items()}
    full_rounds = rows["full"]["round_seconds"]
    report = {
        "benchmark": "demo_cpu",
        "executor": args.executor,
        "recipe": data,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "environment": environment(torch.device("cpu")),
        "rows": list(rows.values()),
        "all_streaming_over_full": secs["all-streaming"] / secs["full"],
        "over_full": {label: secs[label] / secs["full"] for label in variants if label != "full"},
        "round_ratios_over_full": {label: [s / f for s, f in zip(rows[label]["round_seconds"], full_rounds)]
                                   for label in variants if label != "full"},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / args.name
    path.write_text(json.dumps(report, indent=2) + "\n")
    for label, ratio in report["over_full"].items():
        print(f"[demo-cpu] {label} / full = {ratio:.3f}")
    print(f"[demo-cpu] wrote {path}")
    return 0


def targets(args: argparse.Namespace) -> int:
    from elasticfw.bench.targets import describe, write_targets

    path, figures = write_targets(args.out)
    for t in figures:  # a mode's layer without an ESR in the run has no target
        print(f"[targets] {describe(t)}")
    print(f"[targets] wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gpu", help="the GPU benchmarks, then targets.json")
    g.add_argument("--out", type=Path, default=Path("results/bench/speed-targets"))
    g.add_argument("--layers", type=int, default=4, help="decoder layers of the model prefill (of 32)")
    g.add_argument("--with-qwen", action="store_true", help="also the Qwen3-8B shape in the prefill benchmark")
    g.add_argument("--steps", nargs="+", choices=["gpu-tests", "attention", "router", "prefill", "generate", "decode", "density", "variants", "kernels",
                            "decode-host", "router-host"],
                   default=["attention", "router", "prefill", "density"],
                   help="which benchmarks to run (one call each when a command has a time limit)")
    g.set_defaults(func=gpu)
    d = sub.add_parser("demo-cpu", help="the CPU demo timing (full vs all-streaming) into demo_cpu.json")
    d.add_argument("--out", type=Path, default=Path("results/bench/speed-targets"))
    d.add_argument("--name", default="demo_cpu.json")
    d.add_argument("--executor", default="split")
    d.add_argument("--samples", type=int, default=20)
    d.add_argument("--rounds", type=_positive, default=4,
                   help="runs of each variant, alternating which goes first; seconds are summed over them")
    d.add_argument("--modes", nargs="*", default=[],
                   help="also every head in each of these sparse modes (their defaults, 64-token blocks): all-<mode>")
    d.set_defaults(func=demo_cpu)
    t = sub.add_parser("targets", help="targets.json from the JSONs under --out")
    t.add_argument("--out", type=Path, default=Path("results/bench/speed-targets"))
    t.set_defaults(func=targets)
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
