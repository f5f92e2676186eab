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
    python scripts/mutation.py prepare --work /tmp/elasticfw-mutation          # ~10 min on 2 cores
    python scripts/mutation.py init    --work /tmp/elasticfw-mutation --sample 200 --seed 0
    python scripts/mutation.py run     --work /tmp/elasticfw-mutation          # ~20 s a mutant
    python scripts/mutation.py report  --work /tmp/elasticfw-mutation --out results/mutation \\
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


def annotation_spans(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions of every annotation in a module. Under ``from __future__ import
    annotations`` (every elasticfw module) annotations are strings never evaluated at run time, so
    a mutant inside one is equivalent by construction (mutmut does not make them at all)."""
    import ast

    tree = ast.parse(path.read_text())
    if not any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and
               any(a.name == "annotations" for a in n.names) for n in tree.body):
        return []
    spans = []
    for node in ast.walk(tree):
        notes = []
        if isinstance(node, ast.arg | ast.AnnAssign):
            notes.append(node.annotation)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            notes.append(node.returns)
        for note in notes:
            if note is not None and note.end_lineno is not None and note.end_col_offset is not None:
                spans.append(((note.lineno, note.col_offset), (note.end_lineno, note.end_col_offset)))
    return spans


def _in_annotation(mutation: object, spans: list) -> bool:
    start, end = tuple(mutation.start_pos), tuple(mutation.end_pos)  # type: ignore[attr-defined]
    return any(a <= start and end <= b for a, b in spans)


def _covering_tests(line_tests: dict, rel: str, start: int, end: int) -> tuple[list[str], str]:
    """Tests whose context executed a line of ``[start, end]``; for a line executed only at import
    (a ``def`` line with a mutated default, a module constant) every test reaching the file."""
    lines = line_tests.get(rel, {})
    hit = sorted({t for ln in range(start, end + 1) for t in lines.get(str(ln), ())})
    if hit:
        return hit, "line"
    whole = sorted({t for ids in lines.values() for t in ids})
    return whole, "file" if whole else "none"


def _durations(work: Path, line_tests: dict) -> dict[str, float]:
    """A cost per test id to run cheap tests first: seconds from ``durations.json`` when there is
    one, else the number of measured lines the test executes (model-level tests execute many)."""
    path = work / "durations.json"
    if path.exists():
        return json.loads(path.read_text())
    cost: dict[str, float] = {}
    for lines in line_tests.values():
        for ids in lines.values():
            for t in ids:
                cost[t] = cost.get(t, 0.0) + 1.0
    return cost


def run(args: argparse.Namespace) -> None:
    from cosmic_ray.mutating import mutate_and_test
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult
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
    durations = _durations(work, line_tests)
    spans: dict[str, list] = {}
    os.environ.update(_env(work, shard))
    os.chdir(tree)
    with use_db(str(work / "session.sqlite"), WorkDB.Mode.open) as db:
        pending = sorted(db.pending_work_items, key=lambda i: i.job_id)[shard::shards]
        for n, item in enumerate(pending[: args.limit or None]):
            (mutation,) = item.mutations
            rel = _relative(str(mutation.module_path), work) or str(mutation.module_path)
            if shard:
                item = attrs.evolve(item, mutations=(attrs.evolve(mutation, module_path=tree / rel),))
            if rel not in spans:
                spans[rel] = annotation_spans(tree / rel)
            if _in_annotation(mutation, spans[rel]):
                db.set_result(item.job_id, WorkResult(output="equivalent: inside an annotation, never evaluated",
                                                      worker_outcome=WorkerOutcome.SKIPPED))
                print(f"[{n + 1}/{len(pending)}] {rel}:{mutation.start_pos[0]} {mutation.operator_name} -> "
                      "equivalent (annotation)", flush=True)
                continue
            tests, how = _covering_tests(line_tests, rel, mutation.start_pos[0], mutation.end_pos[0])
            started = time.time()
            if not tests:
                # no test executes the line: the mutant survives; applied anyway for its diff
                result = mutate_and_test(item.mutations, f"{shlex.quote(sys.executable)} -c pass", 60)
            else:
                # fastest first: with -x a mutant dies at its first failing test
                tests = sorted(tests, key=lambda t: durations.get(t, 1.0))
                command = shlex.join([sys.executable, "-m", "pytest", *PYTEST.split(), *tests])
                result = mutate_and_test(item.mutations, command, args.timeout)
            db.set_result(item.job_id, result)
            outcome = result.test_outcome.value if result.test_outcome else result.worker_outcome.value
            print(f"[{n + 1}/{len(pending)}] {rel}:{mutation.start_pos[0]} {mutation.operator_name} "
                  f"-> {outcome} ({how}, {len(tests)} tests, {time.time() - started:.0f} s)", flush=True)


def recheck(args: argparse.Namespace) -> None:
    """Survivors of the session against a later commit's tests: each survivor's diff applied to a
    worktree of ``--commit`` and the test *files* that reached it (plus ``--also`` files) run with
    ``-x``; results in ``recheck.json`` (the session keeps the first run's outcomes)."""
    from cosmic_ray.work_db import WorkDB, use_db

    work = Path(args.work).resolve()
    shard, shards = (int(x) for x in args.shard.split("/"))
    tree = work / f"recheck-{args.name}-{shard}"  # one worktree and one result file per shard
    links = work / f"recheck-{args.name}-{shard}-links"
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.commit], check=True)
        links.mkdir(exist_ok=True)
        (links / "elasticfw_plugins").symlink_to(tree / "plugins")
    line_tests = json.loads((work / "line_tests.json").read_text())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(links)]), "PYTHONDONTWRITEBYTECODE": "1"}
    out_path = work / f"recheck-{args.name}-{shard}.json"
    done = json.loads(out_path.read_text()) if out_path.exists() else {}
    with use_db(str(work / "session.sqlite"), WorkDB.Mode.open) as db:
        survivors = [(item, result) for item, result in db.completed_work_items
                     if result.test_outcome is not None and result.test_outcome.value == "survived"]
    patches = json.loads(Path(args.patches).read_text()) if args.patches else {}
    skip = {job for path in args.skip for job in json.loads(Path(path).read_text())}
    for item, result in sorted(survivors, key=lambda ir: ir[0].job_id)[shard::shards]:
        if item.job_id in done or item.job_id in skip or (args.only and item.job_id not in args.only):
            continue
        (m,) = item.mutations
        rel = _relative(str(m.module_path), work) or str(m.module_path)
        diff = patches.get(item.job_id, result.diff or "")
        tests, _ = _covering_tests(line_tests, rel, m.start_pos[0], m.end_pos[0])
        files = sorted({t.split("::")[0] for t in tests} | set(args.also))
        applied = subprocess.run(["git", "-C", str(tree), "apply", "-p1", "--recount", "--unidiff-zero", "-"],
                                 input=_git_diff(diff, rel), text=True, capture_output=True)
        if applied.returncode != 0:
            done[item.job_id] = {"file": rel, "line": m.start_pos[0], "outcome": "does-not-apply",
                                 "error": applied.stderr[-500:]}
        else:
            started = time.time()
            try:
                proc = subprocess.run([sys.executable, "-m", "pytest", *PYTEST.split(), *files], cwd=tree, env=env,
                                      capture_output=True, text=True, timeout=args.timeout)
                outcome = "killed" if proc.returncode != 0 else "survived"
                tail = proc.stdout[-800:]
            except subprocess.TimeoutExpired:
                outcome, tail = "killed", "timeout"
            finally:
                subprocess.run(["git", "-C", str(tree), "checkout", "--", "."], check=True)
            done[item.job_id] = {"file": rel, "line": m.start_pos[0], "outcome": outcome, "files": files,
                                 "seconds": round(time.time() - started), "tail": tail}
        out_path.write_text(json.dumps(done, indent=1))
        print(f"{rel}:{m.start_pos[0]} {item.job_id} -> {done[item.job_id]['outcome']}", flush=True)


def _git_diff(diff: str, rel: str) -> str:
    """Cosmic Ray's unified diff (absolute paths in its headers) with ``a/rel`` / ``b/rel`` headers."""
    body = [ln for ln in diff.splitlines() if not ln.startswith(("--- ", "+++ "))]
    # a mutant on a file's last line: Cosmic Ray's diff ends with a blank context line past the end
    # of the file (its split of the final newline), which git apply refuses; a hunk's trailing blank
    # context lines are dropped (less context, the same change)
    while body and body[-1] in ("", " "):
        body.pop()
    return "\n".join([f"--- a/{rel}", f"+++ b/{rel}", *body]) + "\n"


def report(args: argparse.Namespace) -> None:
    """Score before (the session) and after (``recheck`` results, when present), equivalents with
    their reasons (``--equivalent`` JSON {job id: reason}), every survivor left with its reason
    (``--notes`` JSON {job id: reason}) and diff."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome

    work = Path(args.work).resolve()
    equivalent: dict[str, str] = json.loads(Path(args.equivalent).read_text()) if args.equivalent else {}
    notes: dict[str, str] = json.loads(Path(args.notes).read_text()) if args.notes else {}
    after: dict[str, dict] = {}
    for path in sorted(work.glob("recheck-*.json")):  # later names (after2-...) override earlier ones
        after.update(json.loads(path.read_text()))
    rows = []
    with use_db(str(work / "session.sqlite"), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            (m,) = item.mutations
            row = {"job_id": item.job_id, "file": _relative(str(m.module_path), work) or str(m.module_path),
                   "line": m.start_pos[0], "operator": m.operator_name, "diff": result.diff or ""}
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                if (result.output or "").startswith("equivalent"):  # judged at run time (annotations)
                    equivalent.setdefault(item.job_id, result.output)
                    rows.append({**row, "outcome": "equivalent-not-run"})
                continue
            outcome = result.test_outcome.value if result.test_outcome else result.worker_outcome.value
            rows.append({**row, "outcome": outcome, "after": after.get(item.job_id, {}).get("outcome")})
    run = [r for r in rows if r["outcome"] in ("killed", "survived", "incompetent")]
    counted = [r for r in run if r["job_id"] not in equivalent]
    killed_before = sum(r["outcome"] != "survived" for r in counted)
    killed_after = sum(r["outcome"] != "survived" or r["after"] == "killed" for r in counted)
    left = [r for r in counted if r["outcome"] == "survived" and r["after"] != "killed"]
    newly = [r for r in counted if r["outcome"] == "survived" and r["after"] == "killed"]
    eq_rows = [r for r in rows if r["job_id"] in equivalent]
    summary = {
        "session": json.loads((work / "session.json").read_text()),
        "run": len(run), "equivalent": len(eq_rows), "counted": len(counted),
        "killed_before": killed_before, "score_before": killed_before / len(counted) if counted else None,
        "killed_after": killed_after, "score_after": killed_after / len(counted) if counted and after else None,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({**summary, "equivalent_reasons": equivalent,
                                                 "survivor_reasons": notes, "rows": rows}, indent=1))
    pct = lambda x: f"{100 * x:.1f}%" if x is not None else "n/a"  # noqa: E731
    lines = [
        "# Mutation run", "",
        f"- sample: {summary['session']['sample']} of {summary['session']['mutants']} mutants (seed "
        f"{summary['session']['seed']}); {len(run)} run, {len(eq_rows)} equivalent (excluded), {len(counted)} counted",
        f"- **before** (the suite at the session's commit): {killed_before}/{len(counted)} killed ({pct(summary['score_before'])})",
        f"- **after** (survivors re-run against the new tests): {killed_after}/{len(counted)} killed "
        f"({pct(summary['score_after'])})", "",
        "## Equivalent mutants (excluded)", "",
        *[f"- `{r['file']}:{r['line']}` {r['operator']} ({r['job_id'][:8]}): {equivalent[r['job_id']]}" for r in eq_rows],
        "", "## Killed by the new tests", "",
        *[f"- `{r['file']}:{r['line']}` {r['operator']} ({r['job_id'][:8]})" for r in newly],
        "", "## Survivors left", "",
    ]
    for r in left:
        lines += [f"### `{r['file']}:{r['line']}` {r['operator']} ({r['job_id'][:8]})", "",
                  notes.get(r["job_id"], "(no reason given)"), "", "```diff", r["diff"].strip(), "```", ""]
    (out / "report.md").write_text("\n".join(lines))
    print("\n".join(lines[2:6]))


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
    p = sub.add_parser("recheck", help="the session's survivors against a later commit's tests")
    p.add_argument("--work", required=True)
    p.add_argument("--commit", default="HEAD")
    p.add_argument("--name", default="after")
    p.add_argument("--also", nargs="*", default=[], help="test files run for every survivor besides those reaching it")
    p.add_argument("--patches", help="JSON {job id: diff} for mutants whose code moved since the session's commit")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--shard", default="0/1")
    p.add_argument("--skip", nargs="*", default=[], help="JSON files whose keys are job ids not to recheck "
                   "(the equivalent and the explained survivors)")
    p.add_argument("--only", nargs="*", default=[], help="recheck only these job ids")
    p.set_defaults(fn=recheck)
    p = sub.add_parser("report", help="score and survivors (Markdown + JSON)")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--equivalent", help="JSON {job id: reason} of mutants judged equivalent (excluded from the score)")
    p.add_argument("--notes", help="JSON {job id: reason} for the survivors left")
    p.set_defaults(fn=report)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
