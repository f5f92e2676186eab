"""Two GPUs against one: the same training run and the same sweep under ``torchrun``.

Shows on two GPUs of one host that data-parallel training at the same global batch follows one
process's losses, and that a sweep sharded over two processes gives the same rows and table as one.
Run on the lent two-GPU machine after ``scripts/device-session.sh`` has assembled the default model::

    python scripts/ddp_check.py train --out $OUT/train                 # 1 process, then 2, then compare
    python scripts/ddp_check.py sweep --procs 1 --out $OUT/sweep1      # one folder per run
    python scripts/ddp_check.py sweep --procs 2 --out $OUT/sweep2
    python scripts/ddp_check.py compare-sweeps OUT/sweep1 OUT/sweep2 --out results/compare/ddp-h200x2/check.json

Each run's command, wall time and exit status go into ``<out>/run.json``; ``train`` also writes
``check.json`` (per-step differences and the speed-up), ``compare-sweeps`` compares the rows
sample by sample (score, completion, MSR, routing decisions) and the prefill throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

from elasticfw.atomic import atomic_write_text
from elasticfw.eval.rows import read_rows, row_key
from elasticfw.provenance import environment
from elasticfw.training.logs import read_metrics

TRAIN_RECIPE = "recipes/train/smollm2-fa-ssa.yaml"
#: a short run of the real recipe: the MLP router only, no evaluation afterwards
TRAIN_OVERRIDES = ["train.evaluate=false", "train.baselines=[]", "train.checkpoint_every=1000"]
SWEEP_RECIPE = "recipes/compare/smollm2-ddp-check.yaml"
#: run folders (checkpoints, adapters) live here; only small files are copied into --out
SCRATCH = Path(os.environ.get("DDP_CHECK_SCRATCH", "/tmp/elasticfw-ddp-check"))


def _launch(procs: int, args: list[str]) -> list[str]:
    if procs == 1:
        return [sys.executable, "-m", "elasticfw.cli", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
            "-m", "elasticfw.cli", *args]


def _run(cmd: list[str], out: Path, procs: int) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if procs == 1:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    t0 = time.perf_counter()
    with (out / "log.txt").open("w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    info = {"command": " ".join(cmd), "processes": procs, "wall_seconds": time.perf_counter() - t0, "returncode": rc}
    atomic_write_text(out / "run.json", json.dumps(info, indent=2))
    print(f"[ddp_check] {procs} process(es): rc {rc}, {info['wall_seconds']:.1f} s", flush=True)
    if rc != 0:
        print((out / "log.txt").read_text()[-3000:], file=sys.stderr)
    return info


def _max_diff(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Largest absolute and relative difference of ``key`` (a number or a per-task dict) per step."""
    worst_abs = worst_rel = 0.0
    for ra, rb in zip(a, b, strict=True):
        va, vb = ra[key], rb[key]
        pairs = [(va[t], vb[t]) for t in va if va[t] is not None] if isinstance(va, dict) else [(va, vb)]
        for x, y in pairs:
            d = abs(x - y)
            worst_abs = max(worst_abs, d)
            worst_rel = max(worst_rel, d / max(abs(x), 1e-12))
    return {"max_abs": worst_abs, "max_rel": worst_rel}


def train(out: Path, steps: int, procs: int, extra: list[str]) -> int:
    runs = {}
    for n in (1, procs):
        folder, run_dir = out / f"procs{n}", SCRATCH / f"train-procs{n}"
        args = ["train", TRAIN_RECIPE, *TRAIN_OVERRIDES, f"train.steps={steps}", *extra, "--output", str(run_dir),
                "--overwrite"]
        runs[n] = _run(_launch(n, args), folder, n)
        if runs[n]["returncode"] != 0:
            return 1
        shutil.copy(run_dir / "mlp" / "metrics.jsonl", folder / "metrics.jsonl")
    one, many = read_metrics(out / "procs1"), read_metrics(out / f"procs{procs}")
    # steady-state step time: the median over steps after the first (which warms kernels up)
    step_1 = median(r["seconds"] for r in one[1:])
    step_n = median(r["seconds"] for r in many[1:])
    check = {
        "recipe": TRAIN_RECIPE,
        "overrides": [*TRAIN_OVERRIDES, f"train.steps={steps}", *extra],
        "processes": procs,
        "steps": len(one),
        "per_step": [
            {"step": a["step"], "lm_loss": [a["lm_loss"], b["lm_loss"]], "reg_loss": [a["reg_loss"], b["reg_loss"]],
             "msr": [a["msr"], b["msr"]]}
            for a, b in zip(one, many, strict=True)
        ],
        "differences": {k: _max_diff(one, many, k) for k in ("lm_loss", "reg_loss", "msr", "lambda1", "grad_norm")},
        "median_step_seconds": {"1": step_1, str(procs): step_n},
        "median_tokens_per_s": {"1": median(r["tokens_per_s"] for r in one[1:]),
                                str(procs): median(r["tokens_per_s"] for r in many[1:])},
        "step_speedup": step_1 / step_n,
        "wall_seconds": {str(n): runs[n]["wall_seconds"] for n in runs},
        "environment": environment(_device()),
    }
    atomic_write_text(out / "check.json", json.dumps(check, indent=2))
    print(json.dumps({k: check[k] for k in ("differences", "median_step_seconds", "step_speedup", "wall_seconds")},
                     indent=2))
    return 0


def sweep(out: Path, procs: int, extra: list[str]) -> int:
    run_dir = SCRATCH / f"sweep-procs{procs}"
    args = ["compare", SWEEP_RECIPE, *extra, "--output", str(run_dir), "--overwrite", "--no-report"]
    info = _run(_launch(procs, args), out, procs)
    for name in ("rows.jsonl", "sweep.json", "failures.jsonl"):
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, out / name)
    return 0 if info["returncode"] == 0 else 1


def compare_sweeps(a: Path, b: Path, out: Path) -> int:
    rows_a, _ = read_rows(a / "rows.jsonl")
    rows_b, _ = read_rows(b / "rows.jsonl")
    by_a, by_b = {row_key(r): r for r in rows_a}, {row_key(r): r for r in rows_b}
    fields = ("score", "completion", "decisions")
    differ = {f: sorted(str(k) for k in by_a.keys() & by_b.keys() if by_a[k][f] != by_b[k][f]) for f in fields}
    msr_diff = max((abs(by_a[k]["msr"] - by_b[k]["msr"]) for k in by_a.keys() & by_b.keys()), default=0.0)
    runs = {d.name: json.loads((d / "run.json").read_text()) for d in (a, b)}

    def tokens_per_s(rows: list[dict[str, Any]]) -> float:
        return sum(r["tokens"] for r in rows) / sum(r["prefill_seconds"] for r in rows)

    report = {
        "rows": {a.name: len(rows_a), b.name: len(rows_b)},
        "only_in": {a.name: len(by_a.keys() - by_b.keys()), b.name: len(by_b.keys() - by_a.keys())},
        "differing_rows": {f: len(v) for f, v in differ.items()},
        "differing_examples": {f: v[:10] for f, v in differ.items()},
        "max_msr_difference": msr_diff,
        "prefill_tokens_per_s_per_process": {a.name: tokens_per_s(rows_a), b.name: tokens_per_s(rows_b)},
        "wall_seconds": {name: r["wall_seconds"] for name, r in runs.items()},
        "commands": {name: r["command"] for name, r in runs.items()},
        "wall_speedup": runs[a.name]["wall_seconds"] / runs[b.name]["wall_seconds"],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


def _device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="the short training run with 1 process, then N; compare")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--steps", type=int, default=30)
    t.add_argument("--procs", type=int, default=2)
    t.add_argument("overrides", nargs="*", help="more recipe overrides (dotted.key=value)")
    s = sub.add_parser("sweep", help="the check sweep with N processes")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--procs", type=int, default=1)
    s.add_argument("overrides", nargs="*")
    c = sub.add_parser("compare-sweeps", help="compare two sweep folders row by row")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.cmd == "train":
        return train(args.out, args.steps, args.procs, args.overrides)
    if args.cmd == "sweep":
        return sweep(args.out, args.procs, args.overrides)
    return compare_sweeps(args.a, args.b, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
