"""The ``elasticfw`` command line.

    elasticfw plugins [--kind KIND] [--json] [-v]
    elasticfw recipe validate FILE [key=value ...]
    elasticfw recipe show FILE [key=value ...]
    elasticfw recipe resolve FILE [key=value ...] [-o OUT]   # the recipe with its bases merged in
    elasticfw recipe schema
    elasticfw eval FILE [key=value ...] [--adapter DIR] [--output DIR] [--resume | --overwrite]
                                               # the recipe's elastic section (or an adapter) on its tasks
    elasticfw compare FILE [key=value ...] [--output DIR] [--resume | --overwrite] [--no-report]
                                               # sweep the `compare:` variants x tasks x lengths x seeds
    elasticfw report RUN                       # rebuild a sweep's tables, figures and HTML from its rows
    elasticfw train FILE [key=value ...] [--output DIR] [--resume | --overwrite]
                                               # train the router (Lagrangian objective), then evaluate
    elasticfw demo [key=value ...]             # the paper in miniature on the default model
    elasticfw lm-eval --recipe R [--adapter A] <lm-eval args>   # lm-evaluation-harness on an elastic model
    elasticfw bench prefill --out F [...]      # model-level time to first token, dense vs elastic
    elasticfw bench generate --out F [...]     # end-to-end generation: TTFT, decode tokens/s, memory, dense vs elastic
    elasticfw bench attention --out F [...]    # attention kernels per mode (python -m elasticfw.bench.attention)
    elasticfw bench router --out F [...]       # router overhead (python -m elasticfw.bench.router)
    elasticfw bench targets DIR [--also F ...] # DIR/targets.json: the speed targets' figures from the JSONs in DIR (and F)

Errors elasticfw raises on purpose print as one paragraph and exit with status 2; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from elasticfw.atomic import atomic_write_text
from elasticfw.errors import ElasticError

_OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z0-9_\-]+)*=")


def _cmd_plugins(args: argparse.Namespace) -> int:
    from elasticfw.registry import KINDS, get_registry

    registry = get_registry()
    rows: list[dict[str, Any]] = []
    for entry in registry.entries(args.kind):
        fields = {}
        descriptions = {}
        if entry.config_class is not None:
            for fname, info in entry.config_class.model_fields.items():
                if fname != "name":
                    fields[fname] = None if info.is_required() else info.get_default(call_default_factory=True)
                    descriptions[fname] = info.description or ""
        extra = {}
        if entry.kind == "backbone":
            extra["model_types"] = list(getattr(entry.cls, "model_types", ()))
        rows.append(
            {
                "kind": entry.kind,
                "name": entry.name,
                "origin": entry.origin,
                "entry_point": entry.entry_point,
                "summary": entry.summary,
                "config": fields,
                "descriptions": descriptions,
                **extra,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    for kind in KINDS if args.kind is None else [args.kind]:
        kind_rows = [r for r in rows if r["kind"] == kind]
        print(f"{kind} ({KINDS[kind].summary}):")
        if not kind_rows:
            print("  (none)")
        for r in kind_rows:
            print(f"  {r['name']:<18} from {r['origin']:<20} {r['summary']}")
            if r["config"] and args.verbose:
                for k, v in r["config"].items():
                    print(f"      {k} = {v!r}" + (f"  — {r['descriptions'][k]}" if r["descriptions"][k] else ""))
            elif r["config"]:
                print("      " + ", ".join(f"{k}={v!r}" for k, v in r["config"].items()))
            if r.get("model_types"):
                print("      model_types: " + ", ".join(r["model_types"]))
    return 0


def _load(args: argparse.Namespace) -> Any:
    from elasticfw.recipe import load_recipe

    return load_recipe(args.file, args.overrides)


def _cmd_validate(args: argparse.Namespace) -> int:
    _load(args)
    print(f"ok: {args.file} is a valid recipe")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    recipe = _load(args)
    print(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _cmd_resolve(args: argparse.Namespace) -> int:
    from elasticfw.recipe import load_recipe
    from elasticfw.recipe.loader import recipe_path, resolve_recipe_bases

    load_recipe(args.file, args.overrides)  # refuse to write a recipe that does not validate
    data = resolve_recipe_bases(args.file, args.overrides)
    header = []  # the recipe's opening comments (its command, what it is), then where this came from
    for line in recipe_path(args.file).read_text(encoding="utf-8-sig").splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    command = " ".join(["elasticfw recipe resolve", str(args.file), *args.overrides])
    header += [f"# Written by `{command}`:", "# the recipe with its `base:` files merged in, self-contained."]
    text = "\n".join(header) + "\n" + yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    if args.output is None:
        print(text, end="")
        return 0
    out = Path(args.output)
    if out.exists() and not args.overwrite:
        raise ElasticError(f"recipe resolve: {str(out)!r} exists; pass --overwrite to replace it")
    atomic_write_text(out, text)  # a reader never sees half a recipe
    print(f"wrote {args.output}: {args.file} with its bases merged in")
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    from elasticfw.recipe import recipe_model

    print(json.dumps(recipe_model().model_json_schema(), indent=2))
    return 0


def demo_recipe_path() -> Path:
    return Path(str(resources.files("elasticfw") / "recipes" / "demo.yaml"))


def _cmd_compare(args: argparse.Namespace) -> int:
    from elasticfw.eval.sweep import run_sweep

    run_sweep(_load(args), output=args.output, resume=args.resume, overwrite=args.overwrite,
              report=not args.no_report)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from elasticfw.report import build_report

    written = build_report(Path(args.run))
    for kind, paths in written.items():
        for path in paths:
            print(f"{kind:<8} {path}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from elasticfw.eval.run_eval import run_evaluation

    run_evaluation(_load(args), output=args.output, adapter=args.adapter, resume=args.resume,
                   overwrite=args.overwrite, report=not args.no_report)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from elasticfw.training.run import run_training

    run_training(_load(args), output=args.output, resume=args.resume, overwrite=args.overwrite)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from elasticfw.training.inspect import format_inspection, inspect_adapter

    result = inspect_adapter(_load(args), args.adapter, samples=args.samples, out=args.out, batch_size=args.batch_size)
    print(format_inspection(result))
    if args.out:
        print(f"written: {args.out}/routing.json, {args.out}/routing.png")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from datetime import datetime

    from elasticfw.training.run import run_training

    args.file = str(demo_recipe_path())
    output = args.output or f"runs/demo-{datetime.now():%Y%m%d-%H%M%S}"
    print(f"elasticfw demo: recipe {args.file}, run folder {output}", flush=True)
    run_training(_load(args), output=output)
    return 0


def _cmd_bench_prefill(args: argparse.Namespace) -> int:
    from elasticfw.bench import prefill

    return prefill.main(args=args)


def _cmd_bench_generate(args: argparse.Namespace) -> int:
    from elasticfw.bench import generate

    return generate.main(args=args)


def _cmd_bench_passthrough(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"elasticfw.bench.{args.bench_command}")
    return int(module.main(args.args) or 0)


def _cmd_bench_targets(args: argparse.Namespace) -> int:
    from elasticfw.bench.targets import describe, write_targets

    try:
        path, targets = write_targets(Path(args.folder), out=Path(args.out) if args.out else None,
                                      also=tuple(Path(a) for a in args.also))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    for t in targets:
        print(describe(t))
    print(f"wrote {path}")
    return 0


def _add_bench(sub: Any) -> None:
    from elasticfw.bench import generate, prefill

    bench = sub.add_parser("bench", help="benchmarks: prefill, generate, attention, router; targets from their JSONs")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("prefill", help="model-level time to first token: dense SDPA vs elastic (random weights)")
    prefill.add_arguments(p)
    p.set_defaults(func=_cmd_bench_prefill)
    p = bsub.add_parser("generate", help="end-to-end generation: time to first token, decode tokens/s, end-to-end "
                        "time and peak memory, dense vs elastic (random weights)")
    generate.add_arguments(p)
    p.set_defaults(func=_cmd_bench_generate)
    for name, text in (("attention", "attention kernels per mode against dense SDPA"),
                       ("router", "router overhead for all layers")):
        p = bsub.add_parser(name, help=f"{text} (arguments: python -m elasticfw.bench.{name} --help)", add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER)
        p.set_defaults(func=_cmd_bench_passthrough)
    p = bsub.add_parser("targets", help="targets.json (the speed targets' figures) from the benchmark JSONs of a folder")
    p.add_argument("folder", help="folder holding the benchmark JSONs (attention, prefill, router, demo)")
    p.add_argument("--out", help="where to write (default: FOLDER/targets.json)")
    p.add_argument("--also", nargs="+", default=[], metavar="JSON",
                   help="benchmark JSONs of an earlier run to read where they lie (each its own source)")
    p.set_defaults(func=_cmd_bench_targets)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elasticfw", description="Test-time adaptive sparse attention.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list registered plugins, their origin and config fields")
    p.add_argument("--kind", choices=None, help="only this kind (sparse_mode, executor, router, ...)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per config field, with its description")
    p.set_defaults(func=_cmd_plugins)

    recipe = sub.add_parser("recipe", help="validate, show or describe recipes")
    rsub = recipe.add_subparsers(dest="recipe_command", required=True)
    for name, func, text in (
        ("validate", _cmd_validate, "validate a recipe without running it"),
        ("show", _cmd_show, "print the resolved, validated recipe"),
    ):
        rp = rsub.add_parser(name, help=text)
        rp.add_argument("file")
        rp.add_argument("overrides", nargs="*", help="dotted.key=value")
        rp.set_defaults(func=func)
    rp = rsub.add_parser(
        "resolve", help="write the recipe with its `base:` files merged in, to copy it anywhere (validated first)"
    )
    rp.add_argument("file", help="the recipe (a path, or elasticfw:NAME for a recipe shipped with elasticfw)")
    rp.add_argument("overrides", nargs="*", help="dotted.key=value, written into the result")
    rp.add_argument("-o", "--output", help="the file to write (default: standard output)")
    rp.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    rp.set_defaults(func=_cmd_resolve)
    rp = rsub.add_parser("schema", help="JSON schema of recipes (with the installed plugins)")
    rp.set_defaults(func=_cmd_schema)

    p = sub.add_parser("compare", help="sweep the recipe's compare: variants over its tasks, lengths and seeds")
    p.add_argument("file")
    p.add_argument("overrides", nargs="*", help="dotted.key=value")
    p.add_argument("--output", help="the sweep's run folder (default: the recipe's sweep.output_dir)")
    p.add_argument("--resume", action="store_true", help="continue the sweep in the folder, skipping finished samples")
    p.add_argument("--overwrite", action="store_true", help="replace a sweep already in the folder")
    p.add_argument("--no-report", action="store_true", help="only the rows; build the report later with `elasticfw report`")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("report", help="rebuild a sweep's tables, figures and HTML report from its rows")
    p.add_argument("run", help="the sweep's run folder (it holds sweep.json and rows.jsonl)")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("eval", help="run the recipe's elastic section (or a trained adapter) on its eval task")
    p.add_argument("file")
    p.add_argument("overrides", nargs="*", help="dotted.key=value")
    p.add_argument("--output", help="the run folder (default: <recipe output_dir or runs>/eval)")
    p.add_argument("--resume", action="store_true", help="continue the run in the folder, skipping finished samples")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in the folder")
    p.add_argument("--no-report", action="store_true", help="only the rows; build the report later with `elasticfw report`")
    p.add_argument("--adapter", help="a trained adapter folder (e.g. RUN/mlp/adapter) instead of the recipe's elastic section")
    p.set_defaults(func=_cmd_eval)

    from elasticfw.eval.lm_eval_backend import add_cli as add_lm_eval_cli

    add_lm_eval_cli(sub)

    p = sub.add_parser("train", help="train the recipe's router (and baselines), then evaluate on held-back samples")
    p.add_argument("file")
    p.add_argument("overrides", nargs="*", help="dotted.key=value")
    p.add_argument("--output", help="the run folder (default: the recipe's train.output_dir)")
    p.add_argument("--resume", action="store_true", help="continue the run in the folder from its last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace a run already in the folder")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("inspect", help="how a trained adapter routes held-back prompts of the recipe's training tasks")
    p.add_argument("adapter", help="an adapter folder (e.g. RUN/mlp/adapter)")
    p.add_argument("file", help="the recipe it was trained with (its train.tasks give the prompts)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value")
    p.add_argument("--samples", type=int, default=16, help="eval-split prompts per task (default 16)")
    p.add_argument("--batch-size", type=int, default=4, help="prompts per prefill (default 4)")
    p.add_argument("--out", help="a folder for routing.json and routing.png")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("demo", help="the paper in miniature: train the router and a static baseline, compare with full")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.steps=4")
    p.add_argument("--output", help="the run folder (default: runs/demo-<date>-<time>)")
    p.set_defaults(func=_cmd_demo)

    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:  # lm-eval's own arguments may be mixed with ours: its parser takes them
        from elasticfw.eval.lm_eval_backend import main as lm_eval_main

        try:
            return int(lm_eval_main(argv[1:]) or 0)
        except ElasticError as exc:
            print(f"elasticfw: error: {exc}", file=sys.stderr)
            return 2
    if argv[:1] == ["bench"] and argv[1:2] in (["attention"], ["router"]):  # their own parsers take the rest
        return _cmd_bench_passthrough(argparse.Namespace(bench_command=argv[1], args=argv[2:]))
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `train FILE --resume k=v`: overrides may also follow an option
    stray = [x for x in extra if not (hasattr(args, "overrides") and _OVERRIDE.match(x))]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if getattr(args, "kind", None) is not None:
        from elasticfw.registry import KINDS

        if args.kind not in KINDS:
            from elasticfw.registry import unknown_name_message

            print(f"elasticfw: error: {unknown_name_message('plugin kind', args.kind, KINDS)}", file=sys.stderr)
            return 2
    try:
        return int(args.func(args) or 0)
    except ElasticError as exc:
        print(f"elasticfw: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
