"""Routers of different mode sets side by side at their expected cost, paired sample by sample.

Reads training summaries (``elasticfw train``'s ``summary.json``, or any JSON with its
``details[router][task]["per_sample"]`` records: ``score``, ``msr``, ``esr``, ``tokens`` and, for
K >= 3 modes, ``shares``) of runs evaluated on the same held-back samples, and gives per task and run:

* ``cost``: the expected cost of the routing each sample got under one cost model, the modes of
  ``--recipe`` (``elastic.modes``: each mode's recipe ``cost`` where set, else its exact or
  estimated density at the sample's length), mode shares weighted by cost, averaged over samples.
  A two-mode run's shares are ``(1 - MSR, MSR)`` of its retrieval and sparse mode (the summary's
  ``modes``, ``"full-streaming"``); its modes are looked up by name among the recipe's.
* ``density``: ``1 - ESR``, the fraction of causal (query, key) pairs the routing computed,
  measured on the sample (independent of any cost model: XAttention's real selection included).
* the score with its 95 % interval, and the paired difference ``reference - run`` with its interval
  (:func:`elasticfw.training.evaluate.score_intervals`), where the two runs scored the same samples:
  the same count and the same prompt lengths in the same order; otherwise no difference is given.

    python scripts/cost_compare.py recipes/train/smollm2-fa-xa-ssa.yaml \\
        --run "FA-XA-SSA=results/train/smollm2-fa-xa-ssa/summary.json" \\
        --run "FA-SSA=results/train/smollm2-fa-ssa/summary.json" --reference FA-XA-SSA \\
        --out results/compare/smollm2-three-modes/costs.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from elasticfw.atomic import atomic_write_text
from elasticfw.attention.mode import ModeCosts
from elasticfw.recipe import load_recipe
from elasticfw.registry import get_registry
from elasticfw.training.evaluate import score_intervals


def run_shares(summary: dict[str, Any], sample: dict[str, Any], mode_names: list[str]) -> dict[str, float]:
    """Mode name -> share of the routed heads for one per-sample record."""
    names = summary["modes"].split("-")
    if len(set(names)) != len(names):
        raise ValueError(f"run of modes {summary['modes']!r}: a mode named twice cannot be told apart by name")
    if "shares" in sample:
        return dict(zip(names, sample["shares"], strict=True))
    if len(names) != 2:
        raise ValueError(f"a run of modes {summary['modes']!r} has per-sample records without 'shares'")
    unknown = [n for n in names if n not in mode_names]
    if unknown:
        raise ValueError(f"modes {unknown} of run {summary['modes']!r} are not among the cost recipe's {mode_names}")
    return {names[0]: 1.0 - sample["msr"], names[1]: sample["msr"]}


def sample_cost(shares: dict[str, float], costs: ModeCosts, length: int) -> float:
    """``sum_k share_k cost_k`` with the recipe modes' costs at ``length`` tokens."""
    row = dict(zip((m.name for m in costs.modes), costs.at(length), strict=True))
    missing = sorted(set(shares) - set(row))
    if missing:
        raise ValueError(f"modes {missing} have no cost in the cost recipe (its modes: {sorted(row)})")
    return sum(share * row[name] for name, share in shares.items())


def compare(runs: dict[str, dict[str, Any]], costs: ModeCosts, reference: str, router: str = "mlp") -> dict[str, Any]:
    """Per task, per run: cost, density, score and interval, paired difference to ``reference``."""
    if reference not in runs:
        raise ValueError(f"--reference {reference!r} is not among the runs {sorted(runs)}")
    names = [m.name for m in costs.modes]
    ref = runs[reference]["details"][router]
    out: dict[str, Any] = {}
    for task in ref:
        rows: dict[str, Any] = {}
        ref_samples = ref[task]["per_sample"]
        for label, summary in runs.items():
            details = summary["details"][router].get(task)
            if details is None:
                continue
            samples = details["per_sample"]
            scores = [s["score"] for s in samples]
            row: dict[str, Any] = {
                "modes": summary["modes"],
                "cost": sum(sample_cost(run_shares(summary, s, names), costs, s["tokens"]) for s in samples) / len(samples),
                "density": 1.0 - sum(s["esr"] for s in samples) / len(samples),
                "msr": sum(s["msr"] for s in samples) / len(samples),
                "score": sum(scores) / len(scores),
                "ci": score_intervals(scores, [])["ci"],
                "samples": len(samples),
            }
            same = [s["tokens"] for s in samples] == [s["tokens"] for s in ref_samples]
            if label != reference and same:
                paired = score_intervals([s["score"] for s in ref_samples], scores)
                row["reference_minus_this"] = {"diff": paired["diff_to_full"], "diff_ci": paired["diff_ci"]}
            rows[label] = row
        out[task] = rows
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", help="the recipe whose elastic.modes give the cost model")
    ap.add_argument("--run", action="append", required=True, metavar="LABEL=SUMMARY", help="a run (repeatable)")
    ap.add_argument("--reference", required=True, help="the label whose paired differences are taken")
    ap.add_argument("--router", default="mlp", help="the router of each summary's details (default mlp)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    paths: dict[str, str] = {}
    for spec in args.run:
        label, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"--run {spec!r}: expected LABEL=SUMMARY")
        paths[label] = path
    runs = {label: json.loads(Path(path).read_text()) for label, path in paths.items()}
    recipe, registry = load_recipe(args.recipe), get_registry()
    costs = ModeCosts([registry.make("sparse_mode", config) for config in recipe.elastic.mode_configs()])
    table = compare(runs, costs, args.reference, args.router)
    for task, rows in table.items():
        for label, row in rows.items():
            diff = row.get("reference_minus_this")
            extra = f"  {args.reference} - this {diff['diff']:+.3f} [{diff['diff_ci'][0]:+.3f}, {diff['diff_ci'][1]:+.3f}]" if diff else ""
            print(f"{task:16s} {label:12s} cost {row['cost']:.3f} density {row['density']:.3f} score {row['score']:.3f}{extra}")
    out = {"recipe": args.recipe, "runs": paths,
           "reference": args.reference, "mode_costs_at_1000": dict(zip((m.name for m in costs.modes), costs.at(1000))),
           "tasks": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
