"""The speed targets' figures (``results/bench/targets.json``), computed from benchmark JSONs.

    elasticfw bench targets results/bench/speed-targets --out results/bench/targets.json

:func:`build_targets` is a pure function: the loaded JSONs of one run (file name -> content) in,
one ``{"figure", "value", "target", "met", "source"}`` per speed target out, each JSON recognised
by its content (the attention, prefill, generate, router and density benchmarks, the CPU demo). A figure
whose JSON or row is missing or errored, whose run's setup is not the targets'
(:func:`setup_mismatch`), whose value is not finite or whose run failed its correctness checks is
not met, with the reason in ``note``; each entry carries its source's ``gpu`` and ``git_commit``.
Which row answers which figure: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elasticfw.atomic import atomic_write_text
from elasticfw.bench.router import TIMED as ROUTER_TIMED
from elasticfw.bench.timing import BASELINE_AGAIN

LONG = 131072
MID = 32768
PLANNING = {"xattention": ("XAttention", 0.10), "nsa": ("NSA", 0.15), "moba": ("MoBA", 0.05)}
MSR = 0.875
STREAMING_HYBRID = f"hybrid(full+streaming,msr={MSR})"

#: the generation benchmark's figures: (label, prompt tokens, target of the decode step's ratio) per
#: length, the batches, the new tokens and the variant (the elastic row read is ``GENERATE_ROW``)
GENERATE_LENGTHS = [("32K", MID, 1.0), ("128K", LONG, 0.6)]
GENERATE_BATCHES = (1, 8)
GENERATE_NEW_TOKENS = 256
GENERATE_VARIANT = f"FA-SSA MSR {MSR} compact cache"
GENERATE_ROW = f"elastic:split:fa-ssa:msr={MSR:g}:compact_cache"
#: the compact cache's two decode paths: (figure suffix, key prefix, row): eager steps, and
#: elasticfw.model.static_decode (a CUDA graph replayed per step)
GENERATE_DECODES = (("", "", GENERATE_ROW),
                    (", static decode", "static-", f"elastic:static:fa-ssa:msr={MSR:g}:compact_cache"))


def _generate_figures() -> list[tuple[str, str, float]]:
    """(figure, reader key, target) of the generate benchmark, per decode path."""
    out = []
    for suffix, prefix, _ in GENERATE_DECODES:
        variant = f"{GENERATE_VARIANT}{suffix}"
        out += [(f"generate decode step @{label}, batch {batch}, {variant} / dense", f"{prefix}step@{label}/b{batch}",
                 target) for batch in GENERATE_BATCHES for label, _, target in GENERATE_LENGTHS]
        out.append((f"generate end to end @128K + {GENERATE_NEW_TOKENS} tokens, batch 1, {variant} / dense",
                    f"{prefix}e2e@128K/b1", 0.55))
    return out


#: (figure, target, "<=" or ">=") in the targets table's order; the mode layers follow the planning rows
FIGURES: list[tuple[str, float, str]] = [
    ("layer, FA-SSA (sink 128, local 2048) MSR 0.875 @128K / dense cuDNN", 0.15, "<="),
    ("layer, all heads full (MSR 0) @128K / dense cuDNN", 1.05, "<="),
    ("model prefill @128K, MSR 0 / dense", 0.97, ">="),
    ("model prefill @128K, FA-SSA MSR 0.875 / dense", 2.3, ">="),
    ("model prefill @32K, FA-SSA MSR 0.875 / dense", 1.4, ">="),
    # end-to-end generation (elasticfw bench generate): FA-SSA MSR 0.875 with the compact KV cache,
    # decoded eagerly and statically
    *[(figure, target, "<=") for figure, _, target in _generate_figures()],
    *[(f"{label} planning @128K / dense", target, "<=") for label, target in PLANNING.values()],
    ("router, all layers, per layer", 0.1, "<="),
    ("CPU (2 cores), demo at 1.4K tokens: all-streaming time / full time", 1.0, "<="),
    # the block-sparse kernel's speed criteria
    ("block-sparse kernel @128K: 50% block density / its own 100% time", 0.6, "<="),
    ("block-sparse kernel @128K: 100% block density / dense cuDNN", 1.25, "<="),
]
MODE_LAYER = "xattention / moba / nsa layer @128K (plan + kernel) / dense [{mode}]"


def _kind(data: Any) -> str | None:
    if not isinstance(data, dict):
        return None
    bench = data.get("benchmark")
    if bench in ("elasticfw.bench.attention", "elasticfw.bench.prefill", "elasticfw.bench.generate",
                 "elasticfw.bench.density", "router_overhead", "demo_cpu"):
        return str(bench)
    labels = {r.get("label") for r in data.get("rows", []) if isinstance(r, dict)}
    if {"full", "all-streaming"} <= labels:
        return "demo_cpu"
    return None


def _ms(rows: list[dict[str, Any]], name: str, kind: str, seq: int) -> float | None:
    for r in rows:
        if r.get("name") == name and r.get("kind") == kind and r.get("seq") == seq and r.get("error") is None:
            ms = r.get("ms")
            return float(ms) if ms is not None else None
    return None


#: the setup the table's figures are of (Llama-3.1-8B attention, bf16, batch 1)
SHAPE = {"batch": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16"}
STREAMING = {"sink_tokens": 128, "local_tokens": 2048}


def _environment(data: Any) -> dict[str, Any]:
    """A JSON's ``environment`` (``{}`` where it has none, or one that is not an object)."""
    env = data.get("environment") if isinstance(data, dict) else None
    return env if isinstance(env, dict) else {}


def _timestamp(data: Any) -> float | None:
    """A JSON's ``environment.date`` as POSIX seconds (ISO 8601, a trailing ``Z`` or any offset;
    without an offset: UTC), or ``None`` where it has none or it does not parse."""
    date = _environment(data).get("date")
    if not isinstance(date, str):
        return None
    try:
        when = _dt.datetime.fromisoformat(date.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (when if when.tzinfo else when.replace(tzinfo=_dt.timezone.utc)).timestamp()


def setup_mismatch(kind: str, data: dict[str, Any]) -> str | None:
    """Why a benchmark JSON's setup is not the one the table's figures are of, or ``None``: the GPU
    benchmarks ran on CUDA; the attention benchmark's shape, inputs (structured), default mode and
    flex options (no ``--set`` / ``--flex-set``), correctness checks run, and streaming window (block
    64, block granularity); the prefill and generate benchmarks' dtype and streaming window (block
    64), and the generate benchmark's 256 new tokens; the
    router's kind (``mlp``) and shape (32 layers of the attention shape), and a run that timed
    ``decide`` alone; the density benchmark's shape; the demo on 2 CPU threads."""
    env = _environment(data)
    if kind == "demo_cpu":
        threads = data.get("threads", env.get("threads"))
        if threads != 2:
            return f"CPU demo on {threads} threads, not the table's 2 cores"
        return None
    if not str(env.get("device", "")).startswith("cuda"):
        return f"{kind} run on {env.get('device')!r}, not a GPU"
    if kind in ("router_overhead", "elasticfw.bench.density"):
        shape = data.get("shape") or {}
        want = dict(SHAPE, layers=32) if kind == "router_overhead" else SHAPE
        wrong = {k: shape.get(k) for k, v in want.items() if shape.get(k) != v}
        if wrong:
            return f"{kind} shape {wrong}, not the table's {want}"
    if kind == "elasticfw.bench.density":
        return None
    if kind == "elasticfw.bench.attention":
        shape = data.get("shape") or {}
        wrong = {k: shape.get(k) for k, v in SHAPE.items() if shape.get(k) != v}
        if wrong:
            return f"attention shape {wrong}, not the table's {SHAPE}"
        inputs = data.get("inputs")
        if not (isinstance(inputs, dict) and inputs.get("kind") == "structured"):
            return "attention inputs are not the structured generator's (data-dependent modes need them)"
        args = data.get("args") or {}
        changed = {k: args.get(k) for k in ("set", "flex_set") if args.get(k)}
        if changed:
            return f"attention run with options changed from the defaults ({changed})"
        if not any(r.get("kind") == "check" for r in data.get("results", [])):
            return "attention run without correctness checks (--check-seq 0)"
        streaming = (data.get("modes") or {}).get("streaming")
        if streaming is not None and (streaming.get("block_size"), streaming.get("granularity")) != (64, "block"):
            return (f"streaming block_size {streaming.get('block_size')} / granularity {streaming.get('granularity')!r}, "
                    "not the table's 64 / 'block'")
    elif kind in ("elasticfw.bench.prefill", "elasticfw.bench.generate"):
        name = kind.rsplit(".", 1)[1]
        if data.get("dtype") != SHAPE["dtype"]:
            return f"{name} dtype {data.get('dtype')!r}, not {SHAPE['dtype']!r}"
        if kind == "elasticfw.bench.generate" and data.get("new_tokens") != GENERATE_NEW_TOKENS:
            return f"generate run of {data.get('new_tokens')} new tokens, not the table's {GENERATE_NEW_TOKENS}"
        streaming = data.get("streaming")
        if streaming is not None and streaming.get("block_size") != 64:
            return f"{name} streaming block_size {streaming.get('block_size')}, not the table's 64"
    elif kind == "router_overhead":
        if data.get("router") != "mlp":
            return f"router {data.get('router')!r}, not the paper's 'mlp'"
        if data.get("timed") != ROUTER_TIMED:
            return ("router run timed decide() only, not the runtime's host read of each decision (a run "
                    "before the router benchmark timed both)")
        return None
    else:
        return None
    if streaming is not None and any(streaming.get(k) != v for k, v in STREAMING.items()):
        return f"streaming {({k: streaming.get(k) for k in STREAMING})}, not the table's {STREAMING}"
    return None


def _failed_checks(data: dict[str, Any]) -> list[str]:
    """The attention run's correctness checks that failed (rows of kind ``check`` with an error)."""
    return sorted(r.get("name", "?") for r in data.get("results", []) if r.get("kind") == "check" and r.get("error"))


def _attention(data: dict[str, Any]) -> dict[str, float | None]:
    rows = data.get("results", [])
    seq = LONG  # the table's figures are at 128K: a run without its 128K rows answers none of them
    # the baseline timed first and again last (a GPU's clock drifts over a run): their mean
    times = [m for m in (_ms(rows, n, "fwd", seq) for n in ("sdpa_cudnn", "sdpa_cudnn" + BASELINE_AGAIN))
             if m is not None and math.isfinite(m) and m > 0]
    base = sum(times) / len(times) if times else None
    out: dict[str, float | None] = {
        "baseline_spread": abs(times[0] - times[1]) / base if len(times) == 2 and base else None
    }

    def ratio(ms: float | None) -> float | None:
        return None if ms is None or base is None else ms / base

    def first(*names: str) -> float | None:
        """The time of the first of ``names`` with a row at ``seq`` (``None`` if that row failed: a
        failed split row is no value, not the flex row's)."""
        for name in names:
            if any(r.get("name") == name and r.get("kind") == "fwd" and r.get("seq") == seq for r in rows):
                return _ms(rows, name, "fwd", seq)
        return None

    out["fa_ssa_layer"] = ratio(first(f"split:{STREAMING_HYBRID}", f"flex:{STREAMING_HYBRID}"))
    out["full_layer"] = ratio(first("split:full", "flex:full"))
    for mode in PLANNING:
        plan = _ms(rows, f"layout:{mode}", "layout", seq)
        out[f"plan:{mode}"] = ratio(plan)
        # the mode's whole attention: its mode: row (side branch included) when it has one, else the
        # executor's row over its layout, by the rule of the other layer figures (split, else flex)
        whole = _ms(rows, f"mode:{mode}", "fwd", seq)
        # a mode with a side branch has a mode: row (failed or not): without its time the layer has none
        has_side = any(r.get("name") == f"mode:{mode}" and r.get("seq") == seq for r in rows)
        kernel = whole if has_side else first(f"split:{mode}", f"flex:{mode}")
        out[f"layer:{mode}"] = ratio(plan + kernel) if plan is not None and kernel is not None else None
        esr_row: dict[str, Any] = next(
            (r for r in rows if r.get("name") == f"layout:{mode}" and r.get("seq") == seq and r.get("error") is None), {}
        )
        esr = esr_row.get("esr_mean")
        ok = isinstance(esr, (int, float)) and math.isfinite(esr)
        # the limit of this run's layer: 1.15 x (1 - ESR) + the planning target, from this run's ESR
        out[f"limit:{mode}"] = 1.15 * (1.0 - float(esr)) + PLANNING[mode][1] if ok and esr is not None else None
    return out


def _prefill(data: dict[str, Any]) -> dict[str, float | None]:
    rows = [r for r in data.get("results", []) if r.get("error") is None and r.get("speedup") is not None]
    model = "llama-3.1-8b"  # the targets' figures are of this shape; another model's run answers none of them

    def speedup(variant: str, seq: int) -> float | None:
        for r in rows:
            if r.get("model") == model and r.get("seq") == seq and r.get("variant") == variant:
                return float(r["speedup"])
        return None

    return {
        "msr0@128K": speedup("elastic:split:msr=0", LONG),
        "fa_ssa@128K": speedup(f"elastic:split:fa-ssa:msr={MSR:g}", LONG),
        "fa_ssa@32K": speedup(f"elastic:split:fa-ssa:msr={MSR:g}", MID),
    }


def _generate(data: dict[str, Any]) -> dict[str, float | None]:
    """The compact-cache FA-SSA rows' decode step and end-to-end time over dense, per length and
    batch: eager decoding (keys ``step@...``, ``e2e@...``) and static decoding (``static-`` before them)."""
    out: dict[str, float | None] = {}
    for _, prefix, variant in GENERATE_DECODES:
        rows = [r for r in data.get("results", []) if isinstance(r, dict) and r.get("error") is None
                and r.get("model") == "llama-3.1-8b" and r.get("variant") == variant]

        def ratio(key: str, seq: int, batch: int, rows: list = rows) -> float | None:
            for r in rows:
                if r.get("seq") == seq and r.get("batch") == batch and r.get(key) is not None:
                    return float(r[key])
            return None

        for batch in GENERATE_BATCHES:
            for label, seq, _ in GENERATE_LENGTHS:
                out[f"{prefix}step@{label}/b{batch}"] = ratio("decode_step_over_dense", seq, batch)
        out[f"{prefix}e2e@128K/b1"] = ratio("e2e_over_dense", LONG, 1)
    return out


def _density(data: dict[str, Any]) -> dict[str, float | None]:
    """The density benchmark's criteria at 128K (its configuration fastest at density 1)."""
    out: dict[str, float | None] = {"density_half": None, "density_full": None}
    for c in data.get("criteria", []):
        if c.get("seq") == LONG and c.get("value") is not None:
            key = "density_half" if c.get("figure", "").startswith("density 0.5") else "density_full"
            out[key] = float(c["value"])
    return out


def _router(data: dict[str, Any]) -> dict[str, float | None]:
    rows = [r for r in data.get("rows", []) if r.get("router_per_layer_ms") is not None and r.get("seq") == LONG]
    return {"router": float(rows[0]["router_per_layer_ms"]) if rows else None}


def _demo(data: dict[str, Any]) -> dict[str, float | None]:
    secs = {r.get("label"): r.get("seconds") for r in data.get("rows", []) if isinstance(r, dict)}
    full, stream = secs.get("full"), secs.get("all-streaming")
    return {"demo": None if not full or stream is None else float(stream) / float(full)}


READERS: dict[str, Callable[[dict[str, Any]], dict[str, float | None]]] = {
    "elasticfw.bench.attention": _attention,
    "elasticfw.bench.prefill": _prefill,
    "elasticfw.bench.generate": _generate,
    "elasticfw.bench.density": _density,
    "router_overhead": _router,
    "demo_cpu": _demo,
}

#: figure -> (kind of JSON, key of its reader's result)
SOURCES: dict[str, tuple[str, str]] = {
    FIGURES[0][0]: ("elasticfw.bench.attention", "fa_ssa_layer"),
    FIGURES[1][0]: ("elasticfw.bench.attention", "full_layer"),
    FIGURES[2][0]: ("elasticfw.bench.prefill", "msr0@128K"),
    FIGURES[3][0]: ("elasticfw.bench.prefill", "fa_ssa@128K"),
    FIGURES[4][0]: ("elasticfw.bench.prefill", "fa_ssa@32K"),
    **{figure: ("elasticfw.bench.generate", key) for figure, key, _ in _generate_figures()},
    **{f"{label} planning @128K / dense": ("elasticfw.bench.attention", f"plan:{mode}")
       for mode, (label, _) in PLANNING.items()},
    "router, all layers, per layer": ("router_overhead", "router"),
    FIGURES[-3][0]: ("demo_cpu", "demo"),
    FIGURES[-2][0]: ("elasticfw.bench.density", "density_half"),
    FIGURES[-1][0]: ("elasticfw.bench.density", "density_full"),
}


def unfinished(data: dict[str, Any]) -> str | None:
    """Why a benchmark JSON's figures are not read because its run did not finish (``complete``
    false: the attention, density and prefill benchmarks write their file after every row and set
    it true only in the last write; a run killed midway, e.g. by a time limit, leaves some of its
    rows, and a criterion read from them would be another's, as a density figure of FlexAttention
    where the Triton kernel's rows are missing), else ``None``. Files without the key predate it."""
    if data.get("complete") is False:
        return "the run did not finish (complete: false): a killed run's rows are not read"
    return None


def build_targets(jsons: dict[str, Any]) -> list[dict[str, Any]]:
    """One ``{"figure", "value", "target", "met", "source", "gpu", "git_commit"}`` (and ``note`` where
    a figure is not met for a reason other than its value) per figure of the speed-target table, from
    ``jsons`` (source name -> loaded JSON). When two JSONs of one kind and of the table's setup hold
    a value, the later run wins (``environment.date``; undated JSONs count as earliest, by name), and
    the entry names the others in ``superseded``. A run that did not finish (:func:`unfinished`)
    gives no value, only a note where no other run fills the figure. An attention figure carries
    ``baseline_spread`` (the relative gap between the baseline's first and last time) where the run
    timed both."""
    values: dict[tuple[str, str], tuple[float | None, str]] = {}
    superseded: dict[tuple[str, str], list[str]] = {}
    read: dict[str, dict[str, float | None]] = {}
    # source -> why its setup is not the table's, or that its run did not finish: no figure from it
    mismatches: dict[str, str] = {}
    failures: dict[str, str] = {}  # source -> its failed correctness checks: its figures are not met

    def when(name: str) -> tuple[bool, float, str]:
        stamp = _timestamp(jsons[name])
        return (stamp is not None, stamp or 0.0, name)

    for name in sorted(jsons, key=when):
        kind = _kind(jsons[name])
        if kind is None:
            continue
        read[name] = READERS[kind](jsons[name])
        mismatch = unfinished(jsons[name]) or setup_mismatch(kind, jsons[name])
        failed = _failed_checks(jsons[name]) if kind == "elasticfw.bench.attention" else []
        if mismatch is not None:
            mismatches[name] = mismatch
        if failed:
            failures[name] = f"correctness checks failed in this run: {', '.join(failed)}"
        for key, value in read[name].items():
            # a run of another setup only fills a gap (its figure then says why it has no value)
            if (kind, key) not in values or (value is not None and mismatch is None):
                before, source = values.get((kind, key), (None, ""))
                if before is not None and source not in mismatches:
                    superseded.setdefault((kind, key), []).append(source)
                values[(kind, key)] = (value, name)

    def entry(figure: str, target: float | None, op: str, kind: str, key: str) -> dict[str, Any]:
        value, source = values.get((kind, key), (None, ""))
        env = _environment(jsons[source]) if source else {}
        note = mismatches.get(source) or failures.get(source)
        if source in mismatches:
            value = None  # a figure of another setup is not this figure
        if value is not None and not math.isfinite(value):
            note, value = note or f"non-finite value {value} in {source}", None  # JSON has no NaN/inf
        if target is not None and not math.isfinite(target):
            note, target = note or f"non-finite target {target} from {source}", None
        ok = (note is None and value is not None and target is not None
              and (value <= target if op == "<=" else value >= target))
        row = {"figure": figure, "value": value, "target": target, "met": bool(ok), "source": source,
               "gpu": env.get("gpu"), "git_commit": env.get("git_commit")}
        if note is not None:
            row["note"] = note
        if superseded.get((kind, key)):
            row["superseded"] = superseded[(kind, key)]
        spread = read.get(source, {}).get("baseline_spread") if kind == "elasticfw.bench.attention" else None
        if spread is not None and math.isfinite(spread):
            row["baseline_spread"] = spread
        return row

    out = []
    for figure, target, op in FIGURES:
        kind, key = SOURCES[figure]
        out.append(entry(figure, target, op, kind, key))
        if figure.startswith(list(PLANNING.values())[-1][0]):  # after the last planning row: each mode's layer
            for mode in PLANNING:
                attention = "elasticfw.bench.attention"
                _, source = values.get((attention, f"layer:{mode}"), (None, ""))
                limit = read[source].get(f"limit:{mode}") if source else None  # the same run's ESR
                row = entry(MODE_LAYER.format(mode=mode), limit, "<=", attention, f"layer:{mode}")
                if limit is None and row["value"] is not None:
                    row.setdefault("note", "no ESR for this mode's layout in the run: no limit")
                out.append(row)
    return out


def describe(t: dict[str, Any]) -> str:
    """One line of a ``targets.json`` entry: verdict, figure, value, target, source and note (a
    missing value or target reads ``missing`` / ``none``)."""
    value = "missing" if t["value"] is None else f"{t['value']:.4g}"
    target = "none" if t["target"] is None else f"{t['target']:.4g}"
    note = f"; {t['note']}" if t.get("note") else ""
    return f"{'met ' if t['met'] else 'NOT '} {t['figure']}: {value} (target {target}; {t['source'] or 'no source'}{note})"


def load_jsons(folder: Path) -> dict[str, Any]:
    """Every ``*.json`` of ``folder`` except ``targets.json``, by file name (unreadable ones skipped)."""
    out: dict[str, Any] = {}
    for path in sorted(folder.glob("*.json")):
        if path.name == "targets.json":
            continue
        try:
            out[path.name] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return out


def write_targets(folder: Path, out: Path | None = None, also: tuple[Path, ...] = ()) -> tuple[Path, list[dict[str, Any]]]:
    """``build_targets`` over ``folder``'s JSONs and the JSON files ``also`` (an earlier run's, read
    where they lie rather than copied; each is its own source, named by its path as given, and one
    that is missing or unreadable raises ``ValueError``), written to ``out`` (default
    ``folder/targets.json``). ``folder``'s files are sources named by their file name when
    ``targets.json`` lies beside them, and by their path as given (``folder/name``) when ``out`` is
    elsewhere, so that every source of e.g. ``results/bench/targets.json`` names where it lies."""
    path = out or folder / "targets.json"
    jsons = load_jsons(folder)
    if path.parent.resolve() != folder.resolve():
        jsons = {str(folder / name): data for name, data in jsons.items()}
    for extra in also:
        if str(extra) in jsons:
            raise ValueError(f"bench targets: {extra} is also a file of {folder}; name it by a path with its folder")
        try:
            jsons[str(extra)] = json.loads(extra.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"bench targets: --also {extra}: cannot read a JSON there ({exc})") from exc
    targets = build_targets(jsons)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(targets, indent=2, allow_nan=False) + "\n")
    return path, targets
