"""The sweep report (elasticfw.report): intervals against hand-computed values, aggregation and
speed-ups against a hand-made set of rows, the run-folder reader's tolerance of a torn last line,
and a full build of the tables, figures and HTML page of synthetic run folders."""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from elasticfw.errors import ElasticError
from elasticfw.report import build_report, cells, load_run, mean_interval, table_rows, wilson_interval
from elasticfw.report.aggregate import ALL_LENGTHS, TaskInfo
from elasticfw.report.errors import ReportError
from elasticfw.report.plots import pareto_front, pareto_skip_reason, safe_name, write_figures
from elasticfw.report.stats import average_interval, standard_error

Z95 = 1.959963984540054  # Φ⁻¹(0.975)


# -- intervals ---------------------------------------------------------------------------------------


def test_wilson_against_hand_computed_values():
    # k=8, n=10, z²=3.841459: centre = (0.8 + z²/20)/(1 + z²/10) = 0.716740,
    # half = z·√(0.8·0.2/10 + z²/400)/(1 + z²/10) = 0.226578
    assert wilson_interval(8, 10) == pytest.approx((0.490162, 0.943318), abs=1e-6)
    # k=0, n=5: lo = 0, hi = (z²/5)/(1 + z²/5) = 0.768292/1.768292
    assert wilson_interval(0, 5) == pytest.approx((0.0, 0.434482), abs=1e-6)
    assert wilson_interval(0, 5)[0] == 0.0
    # k=n=5 mirrors k=0
    assert wilson_interval(5, 5) == pytest.approx((0.565518, 1.0), abs=1e-6)
    assert wilson_interval(5, 5)[1] == 1.0
    # a wider confidence gives a wider interval
    lo90, hi90 = wilson_interval(8, 10, confidence=0.90)
    assert 0.490162 < lo90 and hi90 < 0.943318


@pytest.mark.parametrize("k,n", [(0, 0), (3, 2), (-1, 4)])
def test_wilson_rejects_impossible_counts(k, n):
    with pytest.raises(ValueError, match="wilson_interval"):
        wilson_interval(k, n)


def test_mean_interval_methods():
    # continuous: mean 0.4, s = 0.2, t_{0.975,2} = 4.302652729 -> half = 4.302652729·0.2/√3 = 0.496828
    iv = mean_interval([0.2, 0.4, 0.6])
    assert iv.method == "t" and iv.n == 3
    assert iv.mean == pytest.approx(0.4, abs=1e-12)
    assert iv.half_width == pytest.approx(0.496828, abs=1e-6)
    assert (iv.lo, iv.hi) == pytest.approx((0.4 - 0.496828, 0.4 + 0.496828), abs=1e-6)
    # all 0/1: Wilson of the number of ones
    iv = mean_interval([1, 1, 0, 1, 1, 1, 1, 0, 1, 1])
    assert iv.method == "wilson" and iv.mean == pytest.approx(0.8)
    assert (iv.lo, iv.hi) == pytest.approx((0.490162, 0.943318), abs=1e-6)
    assert mean_interval([1.0]).method == "wilson"
    # one continuous score: the whole score range
    assert tuple(mean_interval([0.3])) == (0.3, 0.0, 1.0, "range", 1)
    # identical continuous scores: a zero-width t interval
    assert mean_interval([0.5, 0.5]).half_width == 0.0
    with pytest.raises(ReportError):
        mean_interval([])


def test_average_interval_formula():
    # binary task p=0.8, n=10: the Wilson half-width over z, (0.943318 - 0.490162) / 2 / 1.959964 = 0.115603;
    # continuous [0.2, 0.4, 0.6]: se = 0.2/√3 = 0.115470
    se_a, se_b = standard_error([1] * 8 + [0] * 2), standard_error([0.2, 0.4, 0.6])
    assert (se_a, se_b) == pytest.approx((0.115603, 0.115470), abs=1e-6)
    assert standard_error([0.3]) == 0.5
    # all four samples right: not 0 (√(p(1-p)/n) would be), the Wilson (0.510, 1] half-width over z
    lo, hi = wilson_interval(4, 4)
    assert standard_error([1, 1, 1, 1]) == pytest.approx((hi - lo) / 2 / Z95, abs=1e-12) and lo > 0.5
    mean, half = average_interval([0.8, 0.4], [se_a, se_b])
    # 1.959964 · √(0.115603² + 0.115470²) / 2
    assert mean == pytest.approx(0.6) and half == pytest.approx(0.160123, abs=1e-6)
    with pytest.raises(ReportError):
        average_interval([0.5], [0.1, 0.2])


def test_pareto_front():
    pts = [(1.0, 0.9), (2.0, 0.8), (1.5, 0.7), (3.0, 0.5), (0.5, 0.95), (2.0, 0.8)]
    # (1.5, 0.7) is beaten by (2.0, 0.8); the two equal points dominate neither each other
    assert [pts[i] for i in pareto_front(pts)] == [
        (0.5, 0.95),
        (1.0, 0.9),
        (2.0, 0.8),
        (2.0, 0.8),
        (3.0, 0.5),
    ]


def test_pareto_skip_reasons():
    assert "no reference" in pareto_skip_reason(None, cells(HAND_ROWS))
    assert "'gone' has no rows" in pareto_skip_reason("gone", cells(HAND_ROWS, "gone"))
    assert pareto_skip_reason("dense", cells(HAND_ROWS, "dense")) is None


def test_ragged_decisions_are_refused(tmp_path):
    rows = [_row("elastic", "A", 1000, i, 1, 1.0, decisions=[[0, 1]] * (2 + i)) for i in range(2)]
    run_dir = _write_run(tmp_path / "run", rows, HAND_META)
    with pytest.raises(ReportError, match="variant 'elastic': routing decisions must be layers × KV heads"):
        write_figures(load_run(run_dir), tmp_path / "figures")


def test_safe_name():
    assert safe_name("elastic <v2> & co") == "elastic_v2_co"
    assert safe_name("../../etc") == "etc"
    assert safe_name("<>") == "variant"


# -- aggregation on hand-made rows --------------------------------------------------------------------


def _row(variant, task, length, index, score, seconds, *, seed=0, msr=0.5, tokens=100, decisions=None):
    category, metric = ("sensitive", "accuracy") if task == "A" else ("robust", "rougeL")
    return {
        "variant": variant, "task": task, "category": category, "metric": metric, "length": length,
        "seed": seed, "index": index, "tokens": tokens, "score": score, "msr": msr, "esr": msr / 2,
        "esr_last_layer": msr, "decisions": decisions, "routed_layers": None if decisions is None else [0, 1],
        "prefill_seconds": seconds, "batch_prefill_seconds": seconds, "batch_size": 1, "batch_tokens": tokens,
        "generate_seconds": 0.1, "completion": "x", "answer": "x",
    }  # fmt: skip


HAND_ROWS = [
    # reference: A@1000 three samples, A@2000 one, B@1000 three, nothing at B@2000
    _row("dense", "A", 1000, 0, 1, 1.0, msr=0.0),
    _row("dense", "A", 1000, 1, 1, 1.0, msr=0.0),
    _row("dense", "A", 1000, 2, 0, 2.0, msr=0.0),
    _row("dense", "A", 2000, 0, 1, 4.0, msr=0.0),
    _row("dense", "B", 1000, 0, 0.2, 1.0, msr=0.0),
    _row("dense", "B", 1000, 1, 0.4, 1.0, msr=0.0),
    _row("dense", "B", 1000, 2, 0.6, 1.0, msr=0.0),
    # elastic: A@1000 shares indices 0 and 1 with the reference; index 3 and seed 1 are its own
    _row("elastic", "A", 1000, 0, 1, 0.5, msr=0.4),
    _row("elastic", "A", 1000, 1, 0, 0.5, msr=0.6),
    _row("elastic", "A", 1000, 3, 1, 9.0, msr=0.5),
    _row("elastic", "A", 1000, 0, 1, 1.0, seed=1, msr=0.5),
    _row("elastic", "A", 2000, 0, 1, 0.5, msr=0.7),
    _row("elastic", "B", 1000, 0, 0.5, 0.5, msr=0.2),
    _row("elastic", "B", 2000, 0, 0.3, 1.0, msr=0.9),
]


def test_cells_by_hand():
    got = {(c.variant, c.task, c.length): c for c in cells(HAND_ROWS, reference="dense")}
    assert len(got) == 7
    c = got["elastic", "A", 1000]  # seeds pooled: [1, 0, 1, 1]
    assert (c.n, c.seeds, c.score, c.method) == (4, 2, 0.75, "wilson")
    assert (c.lo, c.hi) == pytest.approx((0.300642, 0.954413), abs=1e-6)
    assert c.msr == pytest.approx(0.5) and c.esr == pytest.approx(0.25)
    assert c.prefill_seconds == pytest.approx(11.0) and c.tokens_per_second == pytest.approx(400 / 11.0)
    # shared samples: indices 0, 1 of seed 0 -> (1.0 + 1.0) / (0.5 + 0.5)
    assert (c.speedup, c.speedup_pairs) == (pytest.approx(2.0), 2)
    assert got["elastic", "A", 2000].speedup == pytest.approx(8.0)  # 4.0 / 0.5
    assert got["elastic", "B", 1000].speedup == pytest.approx(2.0)  # 1.0 / 0.5
    assert got["elastic", "B", 2000].speedup is None  # the reference has no B@2000
    assert got["elastic", "B", 2000].speedup_pairs == 0
    one = got["elastic", "B", 1000]  # a single continuous score
    assert (one.method, one.lo, one.hi, one.se) == ("range", 0.0, 1.0, 0.5)
    d = got["dense", "B", 1000]
    assert d.method == "t" and d.half_width == pytest.approx(0.496828, abs=1e-6)
    assert got["dense", "A", 1000].speedup == pytest.approx(1.0)
    assert got["dense", "A", 1000].score == pytest.approx(2 / 3)
    assert (got["dense", "A", 1000].lo, got["dense", "A", 1000].hi) == pytest.approx(
        (0.207660, 0.938508), abs=1e-6
    )
    # without a reference there are no speed-ups
    assert all(c.speedup is None for c in cells(HAND_ROWS))
    # every length pooled: elastic A shares (1000,0,0), (1000,0,1), (2000,0,0): (1+1+4)/(0.5+0.5+0.5)
    pooled = {(c.variant, c.task): c for c in cells(HAND_ROWS, "dense", pool_lengths=True)}
    assert pooled["elastic", "A"].speedup == pytest.approx(4.0) and pooled["elastic", "A"].n == 5
    assert pooled["elastic", "A"].length is None and pooled["elastic", "A"].pooled


def test_table_rows_by_hand():
    tasks = [TaskInfo("B", "b", "robust", "rougeL"), TaskInfo("A", "a", "sensitive", "accuracy")]
    rows = table_rows(
        HAND_ROWS, tasks=tasks, variants=["dense", "elastic", "idle"], lengths=[1000, 2000], reference="dense"
    )
    assert [(r.block, r.variant) for r in rows] == [
        ("1000", "dense"), ("1000", "elastic"), ("1000", "idle"),
        ("2000", "dense"), ("2000", "elastic"), ("2000", "idle"),
        (ALL_LENGTHS, "dense"), (ALL_LENGTHS, "elastic"), (ALL_LENGTHS, "idle"),
    ]  # fmt: skip
    by = {(r.block, r.variant): r for r in rows}
    e = by["1000", "elastic"]
    assert list(e.cells) == ["A", "B"]  # sensitive first
    # sensitive: A alone, 3 of 4: se = √(0.75·0.25/4 + z²/64) / (1 + z²/4) = 0.166781 -> half = z·se
    assert e.averages["sensitive"].mean == pytest.approx(0.75)
    assert e.averages["sensitive"].half == pytest.approx(0.326885, abs=1e-6)
    assert e.averages["robust"].half == pytest.approx(Z95 * 0.5, abs=1e-9)  # single continuous score: se 0.5
    # overall: (0.75 + 0.5)/2, half = 1.959964·√(0.166781² + 0.5²)/2
    assert e.averages["overall"].mean == pytest.approx(0.625)
    assert e.averages["overall"].half == pytest.approx(0.516531, abs=1e-6)
    assert e.averages["overall"].complete
    assert e.msr == pytest.approx((0.5 + 0.2) / 2) and e.speedup == pytest.approx(2.0) and e.n == 5
    assert by["2000", "elastic"].speedup == pytest.approx(8.0)  # B@2000 has none, so A's alone
    d = by["2000", "dense"]  # no B@2000: robust missing, overall over one of two tasks
    assert d.averages["robust"] is None
    assert d.averages["overall"].k == 1 and not d.averages["overall"].complete
    idle = by["1000", "idle"]
    assert idle.cells == {} and idle.n == 0 and idle.averages["overall"] is None and idle.speedup is None
    pooled = by[ALL_LENGTHS, "elastic"]
    assert pooled.cells["A"].score == pytest.approx(0.8) and pooled.speedup == pytest.approx((4.0 * 2.0) ** 0.5)
    # a single length gives no pooled block
    one = table_rows([r for r in HAND_ROWS if r["length"] == 1000])
    assert {r.block for r in one} == {"1000"}


# -- the run folder -----------------------------------------------------------------------------------


def _write_run(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any], failures=None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "sweep.json").write_text(json.dumps(meta))
    (path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if failures is not None:
        (path / "failures.jsonl").write_text("".join(json.dumps(f) + "\n" for f in failures))
    return path


def _meta(variants, tasks, lengths, reference):
    return {
        "recipe": {"name": "demo"},
        "environment": {"gpu": "none <cpu>", "torch": "2.x"},
        "variants": [
            {"label": v, "adapter": None, "router": "gumbel", "retrieval_mode": "full", "sparse_mode": "xattn",
             "executor": "flex"} for v in variants
        ],
        "tasks": [{"label": t, "task": t.lower(), "category": c, "metric": m} for t, c, m in tasks],
        "lengths": lengths,
        "seeds": [0, 1],
        "reference": reference,
        "started": "2026-01-01T00:00:00+00:00",
    }  # fmt: skip


HAND_META = _meta(
    ["dense", "elastic"], [("A", "sensitive", "accuracy"), ("B", "robust", "rougeL")], [1000, 2000], "dense"
)


def test_torn_last_line_is_skipped(tmp_path):
    run_dir = _write_run(tmp_path / "run", HAND_ROWS, HAND_META)
    with (run_dir / "rows.jsonl").open("a") as f:
        f.write('{"variant": "dense", "task": "A", "sco')
    run = load_run(run_dir)
    assert len(run.rows) == len(HAND_ROWS) and run.torn == ["rows.jsonl"]
    assert run.variants == ["dense", "elastic"] and [t.label for t in run.tasks] == ["A", "B"]


def test_bad_middle_line_raises(tmp_path):
    run_dir = _write_run(tmp_path / "run", HAND_ROWS, HAND_META)
    lines = (run_dir / "rows.jsonl").read_text().splitlines()
    lines[1] = lines[1][:20]
    (run_dir / "rows.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=r"rows\.jsonl:2: not valid JSON"):
        load_run(run_dir)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"score": 1.5}, r"rows\.jsonl:3: field 'score' must be a number in \[0, 1\]"),
        ({"category": "fuzzy"}, r"rows\.jsonl:3: field 'category'"),
        ({"index": None}, r"rows\.jsonl:3: field 'index'"),
        ({"metric": "f1"}, r"rows\.jsonl:3: task 'A' has category 'sensitive' and metric 'f1' here"),
    ],
)
def test_invalid_rows_name_file_and_line(tmp_path, change, message):
    rows = [dict(r) for r in HAND_ROWS]
    rows[2].update(change)
    with pytest.raises(ReportError, match=message):
        load_run(_write_run(tmp_path / "run", rows, HAND_META))


def test_missing_field_and_missing_folder(tmp_path):
    rows = [dict(r) for r in HAND_ROWS]
    del rows[0]["prefill_seconds"]
    with pytest.raises(ReportError, match=r"rows\.jsonl:1: missing required field 'prefill_seconds'"):
        load_run(_write_run(tmp_path / "run", rows, HAND_META))
    with pytest.raises(ElasticError, match="not a sweep run folder"):
        load_run(tmp_path / "nowhere")


def test_duplicate_samples_keep_the_last(tmp_path):
    again = dict(HAND_ROWS[0], score=0)
    run = load_run(_write_run(tmp_path / "run", [*HAND_ROWS, again], HAND_META))
    assert run.duplicates == 1 and len(run.rows) == len(HAND_ROWS)
    assert [
        r["score"] for r in run.rows if r["variant"] == "dense" and r["length"] == 1000 and r["task"] == "A"
    ] == [1, 0, 0]


def test_no_rows_yet(tmp_path):
    run_dir = _write_run(tmp_path / "run", [], HAND_META)
    with pytest.raises(ReportError, match="no rows yet"):
        build_report(run_dir)


# -- full builds ----------------------------------------------------------------------------------------

ODD = "elastic <v2> & co"


def _synthetic_rows(lengths, variants, *, skip=()):
    """Deterministic rows for every (variant, task, length, seed, index) except those in ``skip``."""
    rows = []
    tasks = [("niah", "sensitive"), ("vt", "sensitive"), ("qa", "robust")]
    for v_i, variant in enumerate(variants):
        for t_i, (task, category) in enumerate(tasks):
            for length in lengths:
                if (variant, task, length) in skip:
                    continue
                for seed in (0, 1):
                    for index in range(3):
                        h = (7 * v_i + 5 * t_i + 3 * seed + index) % 10
                        score = float(h % 2) if category == "sensitive" else h / 10
                        routed = variant != "dense"
                        decisions = [[(h + layer + head) % 2 for head in range(4)] for layer in range(3)]
                        rows.append({
                            "variant": variant, "task": task, "category": category,
                            "metric": "accuracy" if category == "sensitive" else "rougeL",
                            "length": length, "seed": seed, "index": index, "tokens": 50 + index,
                            "score": score, "msr": 0.3 * v_i, "esr": 0.2 * v_i, "esr_last_layer": 0.1,
                            "decisions": decisions if routed else None, "routed_layers": [2, 5, 9] if routed else None,
                            "prefill_seconds": 0.01 * (3 - v_i) * (1 + index), "batch_prefill_seconds": 0.1,
                            "batch_size": 3, "batch_tokens": 153, "generate_seconds": 0.02,
                            "completion": "c", "answer": "a",
                        })  # fmt: skip
    return rows


TASKS3 = [("niah", "sensitive", "accuracy"), ("vt", "sensitive", "accuracy"), ("qa", "robust", "rougeL")]


def test_build_report_full(tmp_path):
    variants = ["dense", ODD, "xattn"]
    # a partial run: xattn has not reached qa@2048 and failed vt@2048
    rows = _synthetic_rows([1024, 2048], variants, skip={("xattn", "qa", 2048), ("xattn", "vt", 2048)})
    failures = [{"variant": "xattn", "task": "vt", "length": 2048, "seed": 0, "error": "boom <script>",
                 "traceback": "Traceback: x < y"}]  # fmt: skip
    run_dir = _write_run(tmp_path / "run", rows, _meta(variants, TASKS3, [1024, 2048], "dense"), failures)
    written = build_report(run_dir)

    assert [p.name for p in written["tables"]] == ["table.md", "table.csv", "cells.csv"]
    assert written["html"] == [run_dir / "report.html"]
    stems = {p.stem for p in written["figures"]}
    heads = {s for s in stems if s.startswith("heads_")}
    assert stems == {"score_vs_length", "msr_per_task", "pareto", *heads}
    assert len(heads) == 2 and all(re.fullmatch(r"heads_[A-Za-z0-9._-]+", s) for s in heads)
    for stem in stems:
        for suffix in (".png", ".svg"):
            path = run_dir / "figures" / f"{stem}{suffix}"
            assert path in written["figures"] and path.stat().st_size > 1000
    assert (run_dir / "figures" / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(run_dir.rglob(".*tmp*"))  # no temporary files left behind

    md = (run_dir / "table.md").read_text()
    assert "## Context length 1024" in md and "## All lengths (pooled)" in md and "± = half-width" in md
    assert re.search(r"\| 0\.\d{3} ±0\.\d\d \(6\) \|", md)  # score ±half (n)

    table = list(csv.DictReader(io.StringIO((run_dir / "table.csv").read_text())))
    assert len(table) == 3 * 3  # 3 variants × (2 lengths + all lengths)
    x2048 = next(r for r in table if r["variant"] == "xattn" and r["length"] == "2048")
    assert x2048["qa:score"] == "" and x2048["vt:n"] == "" and x2048["niah:n"] == "6"
    assert x2048["avg_sensitive:tasks"] == "1" and x2048["avg_robust"] == ""
    long = list(csv.DictReader(io.StringIO((run_dir / "cells.csv").read_text())))
    assert len(long) == 3 * 3 * 2 - 2
    assert {r["speedup"] for r in long if r["variant"] == "dense"} == {"1.0"}
    odd = next(r for r in long if r["variant"] == ODD)
    assert float(odd["speedup"]) == pytest.approx(1.5)  # 0.03·(1+i) / 0.02·(1+i) on every shared sample

    page = (run_dir / "report.html").read_text()
    assert html.escape(ODD) in page and ODD not in page
    assert "boom &lt;script&gt;" in page and "<script>" not in page
    assert "none &lt;cpu&gt;" in page  # provenance is escaped too
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == len(stems)
    assert all(base64.b64decode(img)[:4] == b"\x89PNG" for img in images)
    assert "<table>" in page and "Failures (1)" in page
    assert not re.search(r'(src|href)="(?!data:)', page)  # self-contained: nothing fetched from elsewhere


def test_build_report_one_length_no_reference(tmp_path):
    rows = _synthetic_rows([None], ["dense", "elastic"])
    failure = {
        "variant": "broken",
        "task": None,
        "length": None,
        "seed": None,
        "error": "OSError: no adapter",
    }
    run_dir = _write_run(tmp_path / "run", rows, _meta(["dense", "elastic"], TASKS3, [None], None), [failure])
    written = build_report(run_dir)
    stems = {p.stem for p in written["figures"]}
    assert stems == {"score_vs_length", "msr_per_task", "heads_elastic"}
    assert not (run_dir / "figures" / "pareto.png").exists()
    page = (run_dir / "report.html").read_text()
    assert "no reference variant" in page and "no Pareto plot" in page
    assert "<b>broken</b>: OSError: no adapter" in page
    md = (run_dir / "table.md").read_text()
    assert "## Context length n/a" in md and "All lengths" not in md and "no speed-ups" in md


def test_routing_summary_by_hand():
    from elasticfw.report.routing import routing_markdown, routing_summaries

    def row(variant, category, decisions):
        return {"variant": variant, "category": category, "decisions": decisions, "routed_layers": [3, 5]}

    # 2 layers x 2 KV heads; 1 = sparse. "elastic": layer-3 head 0 full on sensitive inputs only
    rows = [
        row("elastic", "sensitive", [[0, 1], [1, 1]]),
        row("elastic", "sensitive", [[0, 1], [1, 1]]),
        row("elastic", "robust", [[1, 1], [1, 1]]),
        row("elastic", "robust", [[1, 1], [1, 0]]),
        row("static", "sensitive", [[0, 1], [1, 1]]),
        row("static", "robust", [[0, 1], [1, 1]]),
        {"variant": "plain", "category": "robust", "decisions": None},
    ]
    e, s = routing_summaries(rows, ["elastic", "static", "plain"])
    assert (e.variant, e.samples, e.heads) == ("elastic", 4, 4)
    # heads in the retrieval mode per sample: sensitive 1 and 1, robust 0 and 1
    assert e.retrieval_heads == {"sensitive": 1.0, "robust": 0.5}
    # majority per head: L3H0 sparse only in 2 of 4 -> not a majority (ties count as full), so the
    # majority assignment is [[0,1],[1,1]]: the two robust samples differ from it
    assert e.adaptive_samples == pytest.approx(0.5)
    # L3/H0: full on 2/2 sensitive vs 0/2 robust; L5/H1: 0/2 vs 1/2
    assert e.task_dependent_heads == [(3, 0, 1.0, 0.0), (5, 1, 0.0, 0.5)]
    assert s.adaptive_samples == 0.0 and s.task_dependent_heads == [] and s.retrieval_heads == {
        "sensitive": 1.0, "robust": 1.0}
    text = routing_markdown([e, s])
    assert "| elastic | 4 | 1.0 | 0.5 | 0.50 | L3/H0: 1.00 vs 0.00, L5/H1: 0.00 vs 0.50 |" in text
