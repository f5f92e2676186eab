"""Mutation testing of elasticfw with Cosmic Ray, each mutant tested by the tests that reach its line.

Cosmic Ray (https://github.com/sixty-north/cosmic-ray, a maintained mutation tool) makes the
mutants and applies them; this script adds what a 2-core machine needs to afford a run:

* ``prepare``: a git worktree of the commit under test (mutants are written into files on disk, so
  never into the tree you work in), one run of the whole suite under coverage with per-test
  contexts, and the map "source line -> tests that executed it";
* ``init``: Cosmic Ray's session (every mutant of ``elasticfw/attention``, ``elasticfw/model``,
  ``elasticfw/routing`` and ``plugins/`` with its default operators), then a seeded random sample
  of ``--sample`` mutants kept pending and the others marked skipped;
* ``run``: each pending mutant applied by Cosmic Ray and tested by ``pytest -x`` over only the tests
  whose coverage context reached the mutated lines (a mutant on a line no test executes survives
  without running anything: that is a real gap, not a shortcut). Resumable: done mutants stay done;
* ``report``: score (killed / tested, equivalent mutants listed in ``--equivalent`` excluded) and every
  survivor with its diff, as Markdown and JSON.

    pip install -e ".[mutation]"
    python tools/mutation.py prepare --work /tmp/elasticfw-mutation          # ~10 min on 2 cores
    python tools/mutation.py init    --work /tmp/elasticfw-mutation --sample 200 --seed 0
    python tools/mutation.py run     --work /tmp/elasticfw-mutation          # ~20 s a mutant
    python tools/mutation.py report  --work /tmp/elasticfw-mutation --out results/mutation \\
        --equivalent results/mutation/equivalent.json

The worktree imports its own code: ``PYTHONPATH`` puts the worktree (package ``elasticfw``) and a
link named ``elasticfw_plugins`` to its ``plugins/`` ahead of the editable install, so the tests of
the worktree exercise the mutated files. ``PYTHONDONTWRITEBYTECODE`` keeps stale bytecode out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent
MUTATED = ("elasticfw/attention", "elasticfw/model", "elasticfw/routing", "plugins")
PYTEST = "-x -q -p no:cacheprovider --timeout 300"


def _trees(work: Path, shard: int) -> tuple[Path, Path]:
    """The worktree and the link folder of one shard (shard 0: ``tree`` and ``links``)."""
    suffix = str(shard) if shard else ""
    return work / f"tree{suffix}", work / f"links{suffix}"


def _env(work: Path, shard: int = 0) -> dict[str, str]:
    tree, links = _trees(work, shard)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(links)])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _relative(path: str, work: Path) -> str | None:
    """A source path as coverage recorded it -> ``elasticfw/...`` or ``plugins/...`` (else None)."""
    real = Path(os.path.realpath(path))
    try:
        rel = real.relative_to((work / "tree").resolve())
    except ValueError:
        return None
    return rel.as_posix()


def prepare(args: argparse.Namespace) -> None:
    work = Path(args.work).resolve()
    tree = work / "tree"
    if tree.exists():
        sys.exit(f"{tree} exists: pick another --work or remove it (git worktree remove {tree})")
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.commit], check=True)
    (work / "links").mkdir(exist_ok=True)
    (work / "links" / "elasticfw_plugins").symlink_to(tree / "plugins")
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(args.workers),
         *(f"--cov={tree / m}" for m in MUTATED), "--cov-context=test", "--cov-report=", "--timeout=900"],
        cwd=tree, env={**_env(work), "COVERAGE_FILE": str(work / "coverage.sqlite")}, check=False,
    )
    if proc.returncode != 0 and not args.exclude:
        sys.exit(f"the suite does not pass on the unmutated tree (exit {proc.returncode}): fix it first, or "
                 "name the tests that fail only under coverage (time bounds) with --exclude and run `map`")
    _write_line_map(work, set(args.exclude))
    print(f"prepared {work} in {time.time() - started:.0f} s")


def line_map(args: argparse.Namespace) -> None:
    _write_line_map(Path(args.work).resolve(), set(args.exclude))


def _write_line_map(work: Path, exclude: set[str]) -> None:
    """``line_tests.json``: file -> line -> the tests whose context executed it (``exclude``: tests
    that fail on the unmutated tree, which would otherwise "kill" every mutant they reach)."""
    from coverage import CoverageData

    data = CoverageData(basename=str(work / "coverage.sqlite"))
    data.read()
    lines: dict[str, dict[int, list[str]]] = {}
    for measured in data.measured_files():
        rel = _relative(measured, work)
        if rel is None:
            continue
        by_line = data.contexts_by_lineno(measured)
        tests: dict[int, list[str]] = {}
        for line, contexts in by_line.items():
            ids = sorted({c.rsplit("|", 1)[0] for c in contexts if c} - exclude)
            if ids:
                tests[line] = ids
        lines[rel] = tests
    (work / "line_tests.json").write_text(json.dumps(lines))


def init(args: argparse.Namespace) -> None:
    from cosmic_ray.commands.init import init as cr_init
    from cosmic_ray.modules import find_modules
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    work = Path(args.work).resolve()
    tree = work / "tree"
    modules = sorted(
        p for m in MUTATED for p in find_modules([tree / m]) if p.name != "__init__.py" or p.stat().st_size > 200
    )
    session = work / "session.sqlite"
    if session.exists():
        sys.exit(f"{session} exists: `run` continues it; remove it to start a new session")
    with use_db(str(session), WorkDB.Mode.create) as db:
        cr_init(modules, db, {})
        items = sorted(db.pending_work_items, key=lambda i: i.job_id)
        rng = random.Random(args.seed)
        keep = set(i.job_id for i in rng.sample(items, min(args.sample, len(items)))) if args.sample else None
        skipped = [i.job_id for i in items if keep is not None and i.job_id not in keep]
        if skipped:
            db.set_multiple_results(skipped, WorkResult(output="not in the sample", worker_outcome=WorkerOutcome.SKIPPED))
    meta = {"mutants": len(items), "sample": args.sample, "seed": args.seed, "modules": [str(m) for m in modules]}
    (work / "session.json").write_text(json.dumps(meta, indent=1))
    print(f"{len(items)} mutants in {len(modules)} modules; {len(items) - len(skipped)} pending")


def _covering_tests(line_tests: dict, rel: str, start: int, end: int) -> tuple[list[str], str]:
    """Tests whose context executed a line of ``[start, end]``; for a line executed only at import
    (a ``def`` line with a mutated default, a module constant) every test reaching the file."""
    lines = line_tests.get(rel, {})
    hit = sorted({t for ln in range(start, end + 1) for t in lines.get(str(ln), ())})
    if hit:
        return hit, "line"
    whole = sorted({t for ids in lines.values() for t in ids})
    return whole, "file" if whole else "none"


def run(args: argparse.Namespace) -> None:
    from cosmic_ray.mutating import mutate_and_test
    from cosmic_ray.work_db import WorkDB, use_db
    work = Path(args.work).resolve()
    shard, shards = (int(x) for x in args.shard.split("/"))
    tree, links = _trees(work, shard)
    if not tree.exists():  # another checkout of the same commit, so shards mutate different files on disk
        commit = subprocess.run(["git", "-C", str(work / "tree"), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True)
        links.mkdir(exist_ok=True)
        (links / "elasticfw_plugins").symlink_to(tree / "plugins")
    line_tests = json.loads((work / "line_tests.json").read_text())
    os.environ.update(_env(work, shard))
    os.chdir(tree)
    with use_db(str(work / "session.sqlite"), WorkDB.Mode.open) as db:
        pending = sorted(db.pending_work_items, key=lambda i: i.job_id)[shard::shards]
        for n, item in enumerate(pending[: args.limit or None]):
            (mutation,) = item.mutations
            rel = _relative(str(mutation.module_path), work) or str(mutation.module_path)
            if shard:
                item = attrs.evolve(item, mutations=(attrs.evolve(mutation, module_path=tree / rel),))
            tests, how = _covering_tests(line_tests, rel, mutation.start_pos[0], mutation.end_pos[0])
            started = time.time()
            if not tests:
                # no test executes the line: the mutant survives; applied anyway for its diff
                result = mutate_and_test(item.mutations, f"{shlex.quote(sys.executable)} -c pass", 60)
            else:
                command = shlex.join([sys.executable, "-m", "pytest", *PYTEST.split(), *tests])
                result = mutate_and_test(item.mutations, command, args.timeout)
            db.set_result(item.job_id, result)
            outcome = result.test_outcome.value if result.test_outcome else result.worker_outcome.value
            print(f"[{n + 1}/{len(pending)}] {rel}:{mutation.start_pos[0]} {mutation.operator_name} "
                  f"-> {outcome} ({how}, {len(tests)} tests, {time.time() - started:.0f} s)", flush=True)


def report(args: argparse.Namespace) -> None:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    work = Path(args.work).resolve()
    equivalent = set(json.loads(Path(args.equivalent).read_text())) if args.equivalent else set()
    rows = []
    with use_db(str(work / "session.sqlite"), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            (m,) = item.mutations
            rows.append({
                "job_id": item.job_id, "file": _relative(str(m.module_path), work) or str(m.module_path),
                "line": m.start_pos[0], "operator": m.operator_name, "occurrence": m.occurrence,
                "outcome": (result.test_outcome.value if result.test_outcome else result.worker_outcome.value),
                "killed": bool(result.is_killed), "diff": result.diff or "",
            })
    tested = [r for r in rows if r["outcome"] != "no-test"]
    counted = [r for r in tested if r["job_id"] not in equivalent]
    killed = sum(r["killed"] for r in counted)
    survivors = [r for r in counted if not r["killed"]]
    summary = {
        "session": json.loads((work / "session.json").read_text()),
        "tested": len(tested), "equivalent_excluded": sorted(equivalent & {r["job_id"] for r in tested}),
        "counted": len(counted), "killed": killed,
        "score": killed / len(counted) if counted else None,
        "survivors": survivors, "incompetent": [r for r in counted if r["outcome"] == TestOutcome.INCOMPETENT.value],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({**summary, "rows": rows}, indent=1))
    lines = [f"# Mutation run: {killed}/{len(counted)} killed ({100 * (summary['score'] or 0):.1f}%)", "",
             f"{len(tested)} mutants tested, {len(summary['equivalent_excluded'])} equivalent excluded.", "",
             "## Survivors", ""]
    for r in survivors:
        lines += [f"### {r['file']}:{r['line']} `{r['operator']}` ({r['job_id']})", "", "```diff", r["diff"].strip(), "```", ""]
    (out / "report.md").write_text("\n".join(lines))
    print(lines[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="worktree + per-test coverage of the whole suite")
    p.add_argument("--work", required=True)
    p.add_argument("--commit", default="HEAD")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--exclude", nargs="*", default=[], help="test ids failing on the unmutated tree (left out)")
    p.set_defaults(fn=prepare)
    p = sub.add_parser("map", help="(re)build the line -> tests map from the coverage data")
    p.add_argument("--work", required=True)
    p.add_argument("--exclude", nargs="*", default=[], help="test ids failing on the unmutated tree (left out)")
    p.set_defaults(fn=line_map)
    p = sub.add_parser("init", help="Cosmic Ray session + seeded random sample")
    p.add_argument("--work", required=True)
    p.add_argument("--sample", type=int, default=200, help="mutants kept pending (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=init)
    p = sub.add_parser("run", help="test every pending mutant with the tests that reach it")
    p.add_argument("--work", required=True)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--limit", type=int, default=0, help="stop after this many (0: all)")
    p.add_argument("--shard", default="0/1", help="K/N: this process takes every N-th pending mutant from the K-th, "
                   "in its own worktree (run N processes at once on N cores)")
    p.set_defaults(fn=run)
    p = sub.add_parser("report", help="score and survivors (Markdown + JSON)")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--equivalent", help="JSON list of job ids judged equivalent (excluded from the score)")
    p.set_defaults(fn=report)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
