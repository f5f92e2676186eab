"""The comparison sweep and its report for variants that route among K >= 3 modes: the rows carry
each sample's mode shares and expected cost, the report gives them per task and length, and
two-mode sweeps report exactly as before.

Independent definitions: a fixed routing whose shares are counted by hand (8 routed heads of the
tiny Llama, 4 layers x 2 KV heads), and each mode's cost given in the recipe as a plain constant,
so the expected cost is a sum written out here."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from sweep_helpers import tiny_sweep_recipe
from training_helpers import training_registry

from elasticfw.eval.rows import read_rows
from elasticfw.eval.sweep import run_sweep
from elasticfw.recipe import validate_recipe_data
from elasticfw.report import build_report, report_tables

MOBA_COST, STREAMING_COST = 0.5, 0.2
THREE_MODES = [
    {"name": "full", "block_size": 16},
    {"name": "moba", "moba_block_size": 16, "top_k": 2, "block_size": 16, "cost": MOBA_COST},
    {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16, "cost": STREAMING_COST},
]
# (layer, KV head, mode): 2 heads on moba, 4 on streaming, the other 2 on full (the default mode)
HEAD_MODES = [[0, 0, 1], [2, 1, 1], [0, 1, 2], [1, 0, 2], [1, 1, 2], [3, 0, 2]]
GRID = [[1, 2], [2, 2], [0, 1], [2, 0]]  # each routed layer's KV heads' modes, as HEAD_MODES says
SHARES = [2 / 8, 2 / 8, 4 / 8]
COST = SHARES[0] * 1.0 + SHARES[1] * MOBA_COST + SHARES[2] * STREAMING_COST  # full attention costs 1
# a second list, two configurations of one mode: every head on the second streaming
TWIN_MODES = [THREE_MODES[0], THREE_MODES[2], {**THREE_MODES[2], "local_tokens": 16, "cost": 0.1}]
TWO_MODE_KEYS = {"variant", "task", "category", "metric", "length", "seed", "index", "tokens", "score", "msr", "esr",
                 "esr_last_layer", "decisions", "routed_layers", "prefill_seconds", "batch_prefill_seconds",
                 "batch_size", "batch_tokens", "generate_seconds", "completion", "answer", "attempt"}
#: rows of a committed two-mode sweep and the report written for them before the K-mode tables existed
BEFORE = Path(__file__).parent / "two_mode_report"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    registry = training_registry()
    out = tmp_path_factory.mktemp("k-mode") / "run"
    data = tiny_sweep_recipe(out, tasks=[{"task": {"name": "recall", "num_samples": 2}},
                                         {"task": {"name": "repeat", "num_samples": 2}, "label": "rep"}])
    data["compare"] = [
        {"label": "full", "elastic": {"router": {"name": "fixed", "assign": "all_retrieval"}}},
        {"label": "three", "elastic": {"modes": THREE_MODES, "router": {
            "name": "fixed", "assign": "mode_heads", "head_modes": HEAD_MODES}}},
        {"label": "twins", "elastic": {"modes": TWIN_MODES, "router": {
            "name": "fixed", "assign": "mode_heads", "default_mode": 2}}},
    ]
    recipe = validate_recipe_data(data, registry=registry)
    return run_sweep(recipe, registry=registry, progress=False, report=True)


def test_k_mode_rows_carry_the_shares_and_the_expected_cost(run):
    rows, _ = read_rows(run / "rows.jsonl")
    assert len(rows) == 3 * 2 * 2 * 2  # variants x tasks x lengths x samples
    for r in rows:
        if r["variant"] == "full":  # two modes: the keys it always had, and no others
            assert set(r) == TWO_MODE_KEYS
            continue
        assert set(r) == TWO_MODE_KEYS | {"modes", "shares", "cost"}
        if r["variant"] == "three":
            assert r["modes"] == GRID
            assert r["shares"] == pytest.approx(SHARES)
            assert r["cost"] == pytest.approx(COST)  # 0.25 + 0.125 + 0.1
            assert r["msr"] == pytest.approx(1 - SHARES[0])  # MSR: not in the first mode
        else:
            assert r["modes"] == [[2, 2]] * 4
            assert r["shares"] == [0.0, 0.0, 1.0] and r["cost"] == pytest.approx(0.1)
    variants = {v["label"]: v for v in json.loads((run / "sweep.json").read_text())["variants"]}
    assert variants["three"]["modes"] == "full-moba-streaming"
    assert variants["three"]["mode_labels"] == ["full", "moba", "streaming"]
    assert variants["twins"]["mode_labels"] == ["full", "streaming.1", "streaming.2"]
    assert "modes" not in variants["full"] and "mode_labels" not in variants["full"]


def test_the_report_gives_mode_shares_and_cost_per_task_and_length(run):
    lines = list(csv.DictReader(io.StringIO((run / "modes.csv").read_text())))
    assert [(x["variant"], x["task"], x["length"]) for x in lines] == [
        (v, t, n) for v in ("three", "twins") for t in ("recall", "rep") for n in ("40", "72")]
    for x in lines:
        assert x["n"] == "2"
        if x["variant"] == "three":
            assert x["modes"] == "full-moba-streaming"
            assert [float(x[f"share:{m}"]) for m in ("full", "moba", "streaming")] == pytest.approx(SHARES)
            assert x["share:streaming.1"] == x["share:streaming.2"] == ""  # modes it does not have
            assert float(x["cost"]) == pytest.approx(COST)
        else:
            assert x["modes"] == "full-streaming-streaming" and x["share:moba"] == ""
            assert float(x["share:streaming.2"]) == 1.0 and float(x["cost"]) == pytest.approx(0.1)
        assert float(x["cost_std"]) == pytest.approx(0.0, abs=1e-12)  # a fixed routing: no spread
        assert float(x["cost_min"]) == pytest.approx(float(x["cost_max"]))
    table = (run / "table.md").read_text()
    section = table[table.index("## Mode shares and expected cost"):table.index("## Routing")]
    assert ("| variant | modes | task | length | share full | share moba | share streaming | share streaming.1 "
            "| share streaming.2 | cost | n |") in section
    assert "| three | full-moba-streaming | recall | 40 | 0.250 | 0.250 | 0.500 | — | — | 0.475 ±0.000 [0.475, " \
           "0.475] | 2 |" in section
    assert "| twins | full-streaming-streaming | rep | 72 | 0.000 | — | — | 0.000 | 1.000 | 0.100 ±0.000 [0.100, " \
           "0.100] | 2 |" in section
    assert "| full |" not in section  # a two-mode variant has no line there
    page = (run / "report.html").read_text()
    assert "Mode shares and expected cost" in page and "<td>full-moba-streaming</td>" in page
    assert "<th>modes</th>" in page and "<th>retrieval_mode</th>" not in page  # variants named by the whole list
    assert "<td>full-streaming</td>" in page  # the two-mode variant too, in that table
    assert (run / "figures" / "mode_shares.png").is_file()


def test_a_two_mode_sweep_reports_as_before(run, tmp_path):
    """The report of the two-mode variant alone has none of it, and the report of committed rows of
    a two-mode sweep is byte for byte the one written before the K-mode tables existed."""
    alone = tmp_path / "alone"
    alone.mkdir()
    meta = json.loads((run / "sweep.json").read_text())
    meta["variants"] = [v for v in meta["variants"] if v["label"] == "full"]
    (alone / "sweep.json").write_text(json.dumps(meta))
    rows = [line for line in (run / "rows.jsonl").read_text().splitlines() if json.loads(line)["variant"] == "full"]
    (alone / "rows.jsonl").write_text("\n".join(rows) + "\n")
    assert sorted(report_tables(alone)) == ["cells.csv", "table.csv", "table.md"]
    assert "Mode shares" not in report_tables(alone)["table.md"]

    copy = tmp_path / "two-mode-sweep"  # the folder name is the title of table.md
    copy.mkdir()
    for name in ("sweep.json", "rows.jsonl"):
        shutil.copy(BEFORE / name, copy / name)
    written = build_report(copy)
    assert [p.name for p in written["tables"]] == ["table.md", "table.csv", "cells.csv"]
    for name in ("table.md", "table.csv", "cells.csv"):
        assert (copy / name).read_text(encoding="utf-8") == (BEFORE / name).read_text(encoding="utf-8"), name
    page = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]*", "data:image/png;base64,",
                  (copy / "report.html").read_text(encoding="utf-8")).replace(str(copy), "RUN")
    assert page == (BEFORE / "report.html").read_text(encoding="utf-8")
    assert not (copy / "modes.csv").exists() and not (copy / "figures" / "mode_shares.png").exists()
