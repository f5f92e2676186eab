"""build_targets on hand-written benchmark JSONs: each figure's value, target, verdict and source."""

from __future__ import annotations

import json

import pytest
from file_modules import load_script

from elasticfw.bench.targets import FIGURES, build_targets, write_targets

L = 131072


def _att(name, kind, ms, seq=L, **extra):
    return {"seq": seq, "name": name, "kind": kind, "ms": ms, "error": None, **extra}


#: the setup of the table's figures (the Llama-3.1-8B attention shape in bf16, structured inputs)
SETUP = {
    "shape": {"batch": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16", "causal": True},
    "inputs": {"kind": "structured"},
    "modes": {"streaming": {"sink_tokens": 128, "local_tokens": 2048, "block_size": 64, "granularity": "block"},
              "full": None},
    "environment": {"gpu": "NVIDIA H200", "git_commit": "abc123", "device": "cuda"},
}
ATTENTION = {
    "benchmark": "elasticfw.bench.attention",
    **SETUP,
    "results": [
        _att("check:streaming:prefill", "check", None, seq=4096),
        _att("sdpa_cudnn", "fwd", 250.0),
        _att("sdpa_cudnn", "fwd", 15.0, seq=32768),  # another length: ignored
        _att("flex:full", "fwd", 345.0),
        _att("split:full", "fwd", 252.5),
        _att("flex:hybrid(full+streaming,msr=0.875)", "fwd", 62.5),
        _att("split:hybrid(full+streaming,msr=0.875)", "fwd", 40.0),
        _att("layout:xattention", "layout", 20.0, esr_mean=0.5),
        _att("flex:xattention", "fwd", 150.0),
        _att("split:xattention", "fwd", 140.0),
        _att("layout:moba", "layout", 50.0, esr_mean=0.6),
        {**_att("flex:moba", "fwd", 100.0), "error": "OutOfMemoryError: ..."},  # errored rows are not read
        _att("split:moba", "fwd", 130.0),
        _att("layout:nsa", "layout", 30.0, esr_mean=0.8),
        _att("flex:nsa", "fwd", 60.0),
        _att("mode:nsa", "fwd", 70.0),
    ],
}
PREFILL = {
    "benchmark": "elasticfw.bench.prefill",
    "environment": SETUP["environment"],
    "dtype": "bf16",
    "streaming": {"sink_tokens": 128, "local_tokens": 2048, "block_size": 64},
    "models": {"llama-3.1-8b": {}, "qwen3-8b": {}},
    "results": [
        {"model": "qwen3-8b", "seq": L, "variant": "elastic:split:msr=0", "speedup": 5.0, "error": None},
        {"model": "llama-3.1-8b", "seq": L, "variant": "elastic:split:msr=0", "speedup": 0.98, "error": None},
        {"model": "llama-3.1-8b", "seq": L, "variant": "elastic:flex:msr=0", "speedup": 0.79, "error": None},
        {"model": "llama-3.1-8b", "seq": L, "variant": "elastic:split:fa-ssa:msr=0.875", "speedup": 2.1, "error": None},
        {"model": "llama-3.1-8b", "seq": 32768, "variant": "elastic:split:fa-ssa:msr=0.875", "speedup": 1.5,
         "error": None},
    ],
}
ROUTER = {"benchmark": "router_overhead", "timed": "decide and the runtime's host read of each decision",
          "router": "mlp", "shape": {"layers": 32, **SETUP["shape"]}, "environment": SETUP["environment"],
          "rows": [{"seq": 8192, "router_per_layer_ms": 0.05}, {"seq": L, "router_per_layer_ms": 0.12}]}
DEMO = {"threads": 2, "rows": [{"label": "full", "seconds": 80.0}, {"label": "all-streaming", "seconds": 60.0}]}  # demo-cpu.json form
DENSITY = {"benchmark": "elasticfw.bench.density", "environment": SETUP["environment"], "shape": {**SETUP["shape"], "inputs": "gaussian"}, "criteria": [
    {"seq": 32768, "figure": "density 0.5 / own density 1", "value": 0.1},  # another length: ignored
    {"seq": L, "figure": "density 0.5 / own density 1", "value": 0.55},
    {"seq": L, "figure": "density 1 / dense cuDNN", "value": 1.38},
]}


def _by_figure(targets):
    return {t["figure"]: t for t in targets}


def test_every_figure_from_hand_written_jsons():
    got = _by_figure(build_targets({"a.json": ATTENTION, "p.json": PREFILL, "r.json": ROUTER, "d.json": DEMO,
                                    "k.json": DENSITY, "other.json": {"unrelated": 1}}))
    assert len(got) == len(FIGURES) + 3
    for t in got.values():
        assert set(t) == {"figure", "value", "target", "met", "source", "gpu", "git_commit"}
    assert got["NSA planning @128K / dense"]["gpu"] == "NVIDIA H200"
    assert got["NSA planning @128K / dense"]["git_commit"] == "abc123"

    def check(figure, value, target, met, source):
        t = got[figure]
        assert t["value"] == pytest.approx(value) and t["target"] == pytest.approx(target)
        assert t["met"] is met and t["source"] == source

    check("layer, FA-SSA (sink 128, local 2048) MSR 0.875 @128K / dense cuDNN", 40 / 250, 0.15, False, "a.json")
    check("layer, all heads full (MSR 0) @128K / dense cuDNN", 252.5 / 250, 1.05, True, "a.json")
    check("model prefill @128K, MSR 0 / dense", 0.98, 0.97, True, "p.json")  # llama, split (not qwen, not flex)
    check("model prefill @128K, FA-SSA MSR 0.875 / dense", 2.1, 2.3, False, "p.json")
    check("model prefill @32K, FA-SSA MSR 0.875 / dense", 1.5, 1.4, True, "p.json")
    check("XAttention planning @128K / dense", 0.08, 0.10, True, "a.json")
    check("NSA planning @128K / dense", 0.12, 0.15, True, "a.json")
    check("MoBA planning @128K / dense", 0.2, 0.05, False, "a.json")
    # plan + the faster executor row; target 1.15 (1 - ESR) + planning target
    check("xattention / moba / nsa layer @128K (plan + kernel) / dense [xattention]", 160 / 250,
          1.15 * 0.5 + 0.10, True, "a.json")
    check("xattention / moba / nsa layer @128K (plan + kernel) / dense [moba]", 180 / 250,
          1.15 * 0.4 + 0.05, False, "a.json")
    # NSA: its mode: row (side branch included), not the faster flex row of the layout alone
    check("xattention / moba / nsa layer @128K (plan + kernel) / dense [nsa]", 100 / 250,
          1.15 * 0.2 + 0.15, False, "a.json")
    check("router, all layers, per layer", 0.12, 0.1, False, "r.json")  # at the longest sequence
    check("CPU (2 cores), demo at 1.4K tokens: all-streaming time / full time", 0.75, 1.0, True, "d.json")
    check("block-sparse kernel @128K: 50% block density / its own 100% time", 0.55, 0.6, True, "k.json")
    check("block-sparse kernel @128K: 100% block density / dense cuDNN", 1.38, 1.25, False, "k.json")


def test_flex_rows_stand_in_when_split_is_absent_and_missing_figures_are_not_met():
    only_flex = {**ATTENTION, "results": [r for r in ATTENTION["results"] if not r["name"].startswith("split:")]}
    got = _by_figure(build_targets({"a.json": only_flex}))
    assert got["layer, FA-SSA (sink 128, local 2048) MSR 0.875 @128K / dense cuDNN"]["value"] == pytest.approx(0.25)
    missing = got["model prefill @128K, MSR 0 / dense"]
    assert missing["value"] is None and missing["met"] is False and missing["source"] == ""


def test_write_targets_reads_a_folder(tmp_path):
    (tmp_path / "attention_128k.json").write_text(json.dumps(ATTENTION))
    (tmp_path / "demo_cpu.json").write_text(json.dumps({"benchmark": "demo_cpu", **DEMO}))
    (tmp_path / "broken.json").write_text("{")
    path, targets = write_targets(tmp_path)
    assert path == tmp_path / "targets.json"
    assert json.loads(path.read_text()) == targets
    demo = _by_figure(targets)["CPU (2 cores), demo at 1.4K tokens: all-streaming time / full time"]
    assert demo["source"] == "demo_cpu.json" and demo["met"]


def test_cli_bench_router_and_targets(tmp_path, capsys):
    from elasticfw.cli import main

    assert main(["bench", "router", "--device", "cpu", "--seq", "128", "--layers", "2", "--reps", "1",
                 "--out", str(tmp_path / "router.json")]) == 0
    assert main(["bench", "targets", str(tmp_path)]) == 0
    router = _by_figure(json.loads((tmp_path / "targets.json").read_text()))["router, all layers, per layer"]
    # read, and refused: a CPU run of 2 layers at 128 tokens is not the table's figure
    assert router["source"] == "router.json" and router["value"] is None and "not a GPU" in router["note"]
    assert "router, all layers, per layer" in capsys.readouterr().out


def test_a_prefill_run_of_another_model_answers_no_figure():
    """The issue's model figures are Llama-3.1-8B's: a Qwen3-8B run in the folder (sorted after the
    Llama one) must not replace them."""
    llama = {"benchmark": "elasticfw.bench.prefill", "environment": SETUP["environment"], "dtype": "bf16", "models": {"llama-3.1-8b": {}}, "results": [
        {"model": "llama-3.1-8b", "seq": 131072, "variant": "elastic:split:msr=0", "speedup": 0.99, "error": None}]}
    qwen = {"benchmark": "elasticfw.bench.prefill", "environment": SETUP["environment"], "dtype": "bf16", "models": {"qwen3-8b": {}}, "results": [
        {"model": "qwen3-8b", "seq": 131072, "variant": "elastic:split:msr=0", "speedup": 0.5, "error": None}]}
    (entry,) = [t for t in build_targets({"a.json": llama, "b.json": qwen}) if t["figure"].startswith(
        "model prefill @128K, MSR 0")]
    assert (entry["value"], entry["source"], entry["met"]) == (0.99, "a.json", True)


def _figure(targets, start):
    (entry,) = [t for t in targets if t["figure"].startswith(start)]
    return entry


FA_SSA = "layer, FA-SSA (sink 128, local 2048)"
FA_SSA_FULL_NAME = FIGURES[0][0]


def test_a_run_without_its_128k_rows_answers_no_128k_figure():
    """The figures are at 128K: a run whose 128K baseline errored must not report its 32K rows
    (it did: 0.1, met, from a 32K row under the figure's "@128K")."""
    rows = [{**_att("sdpa_cudnn", "fwd", None), "error": "OutOfMemoryError"}, _att("sdpa_cudnn", "fwd", 15.0, seq=32768),
            _att("split:hybrid(full+streaming,msr=0.875)", "fwd", 1.5, seq=32768),
            _att("split:hybrid(full+streaming,msr=0.875)", "fwd", 40.0)]
    entry = _figure(build_targets({"a.json": {**ATTENTION, "results": rows}}), FA_SSA)
    assert entry["value"] is None and entry["met"] is False


def test_a_mode_layer_takes_its_limit_from_its_own_runs_esr():
    """The NSA layer's limit is 1.15 (1 - ESR) + 0.15 with the ESR of the JSON its value comes from:
    not another JSON's (b.json's 0.9 gave a limit of 0.265), and no ESR (an esr_error) means no limit
    and not met (it counted as ESR 0: a limit of 1.3, met at 0.92)."""
    nsa = "xattention / moba / nsa layer @128K (plan + kernel) / dense [nsa]"
    check = ATTENTION["results"][0]
    a = {**ATTENTION, "results": [check, _att("sdpa_cudnn", "fwd", 250.0), _att("layout:nsa", "layout", 30.0, esr_mean=0.2),
                                  _att("mode:nsa", "fwd", 170.0)]}
    b = {**ATTENTION, "results": [check, _att("sdpa_cudnn", "fwd", 250.0),
                                  _att("layout:nsa", "layout", 30.0, esr_mean=0.9)]}
    entry = _by_figure(build_targets({"a.json": a, "b.json": b}))[nsa]
    assert entry["source"] == "a.json" and entry["value"] == pytest.approx(0.8)
    assert entry["target"] == pytest.approx(1.15 * 0.8 + 0.15) and entry["met"] is True
    no_esr = {**a, "results": [check, _att("sdpa_cudnn", "fwd", 250.0),
                               _att("layout:nsa", "layout", 30.0, esr_error="x"),
                               _att("mode:nsa", "fwd", 200.0)]}
    entry = _by_figure(build_targets({"a.json": no_esr}))[nsa]
    assert entry["value"] == pytest.approx(0.92) and entry["target"] is None and entry["met"] is False
    assert "no ESR" in entry["note"]


def test_figures_of_a_run_whose_checks_failed_are_not_met():
    rows = [{**_att("check:split:streaming:routed_first_full", "check", None, seq=4096), "error": "out rel RMS 0.41"},
            _att("sdpa_cudnn", "fwd", 250.0), _att("split:hybrid(full+streaming,msr=0.875)", "fwd", 30.0)]
    entry = _figure(build_targets({"a.json": {**ATTENTION, "results": rows}}), FA_SSA)
    assert entry["value"] == pytest.approx(0.12) and entry["met"] is False
    assert "check:split:streaming:routed_first_full" in entry["note"]


@pytest.mark.parametrize("change, reason", [
    ({"shape": {**SETUP["shape"], "q_heads": 4}}, "attention shape"),
    ({"shape": {**SETUP["shape"], "dtype": "fp32"}}, "attention shape"),
    ({"inputs": {"kind": "random"}}, "structured"),
    ({"modes": {"streaming": {**SETUP["modes"]["streaming"], "sink_tokens": 4, "local_tokens": 256}}}, "streaming"),
    ({"modes": {"streaming": {**SETUP["modes"]["streaming"], "granularity": "token"}}}, "granularity"),
    ({"args": {"flex_set": ["sparse_kernel=flex"]}}, "options changed"),
    ({"args": {"set": ["moba.top_k=2"]}}, "options changed"),
    ({"results": [r for r in ATTENTION["results"] if r["kind"] != "check"]}, "without correctness checks"),
])
def test_a_run_of_another_setup_answers_no_figure(change, reason):
    """The figures name their setup (the Llama-3.1-8B attention shape, bf16, structured inputs,
    sink 128 / local 2048): a run of another gives no value, with the reason."""
    entry = _figure(build_targets({"a.json": {**ATTENTION, **change}}), FA_SSA)
    assert entry["value"] is None and entry["met"] is False and reason in entry["note"]
    prefill = _figure(build_targets({"p.json": {**PREFILL, "dtype": "fp32"}}), "model prefill @128K, MSR 0")
    assert prefill["value"] is None and "prefill dtype" in prefill["note"]
    # beside a run of the table's setup, sorted before it, another setup's run does not replace it
    entry = _figure(build_targets({"a.json": ATTENTION, "b.json": {**ATTENTION, **change}}), FA_SSA)
    assert entry["source"] == "a.json" and entry["value"] == pytest.approx(40 / 250) and "note" not in entry


def test_a_router_run_of_decide_alone_gives_no_router_figure():
    """A router JSON from before the benchmark timed each decision's host read understates the cost
    inside a model (one synchronisation per layer): it gives no value, and says why."""
    old = {k: v for k, v in ROUTER.items() if k != "timed"}
    got = _by_figure(build_targets({"r.json": old}))["router, all layers, per layer"]
    assert got["value"] is None and got["met"] is False and "host read" in got["note"]
    got = _by_figure(build_targets({"r.json": ROUTER}))["router, all layers, per layer"]
    assert got["value"] == 0.12 and "note" not in got


def _bench_targets_tool():

    return load_script("bench_targets", "bench_targets_tool")


def test_the_tools_targets_step_prints_a_run_without_attention_rows(tmp_path, capsys):
    """``scripts/bench_targets.py gpu --steps prefill`` ends with ``targets`` over a folder without the
    attention JSON: a mode's layer then has no target (it raised formatting None)."""
    tool = _bench_targets_tool()
    (tmp_path / "prefill.json").write_text(json.dumps(PREFILL))
    assert tool.main(["targets", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[targets] NOT  xattention / moba / nsa layer @128K (plan + kernel) / dense [moba]: missing (target none" in out
    assert "[targets] met  model prefill @128K, MSR 0 / dense: 0.98 (target 0.97; prefill.json)" in out


def test_a_failed_side_branch_row_leaves_the_modes_layer_without_a_value():
    """NSA's layer is its layout plus its mode: row (the side branch included); when that row failed,
    the kernel rows alone (no side branch) must not stand in for it: they could meet the limit."""
    rows = [r if r["name"] != "mode:nsa" else {**r, "error": "RuntimeError: ..."} for r in ATTENTION["results"]]
    got = _by_figure(build_targets({"a.json": {**ATTENTION, "results": rows}}))
    nsa = got["xattention / moba / nsa layer @128K (plan + kernel) / dense [nsa]"]
    assert nsa["value"] is None and nsa["met"] is False
    ok = _by_figure(build_targets({"a.json": ATTENTION}))["xattention / moba / nsa layer @128K (plan + kernel) / dense [nsa]"]
    assert ok["value"] == pytest.approx((30 + 70) / 250)


def test_the_baseline_is_the_mean_of_its_first_and_last_times():
    rows = [*ATTENTION["results"], _att("sdpa_cudnn@end", "fwd", 270.0)]
    got = _by_figure(build_targets({"a.json": {**ATTENTION, "results": rows}}))
    fa = got[FA_SSA_FULL_NAME]
    assert fa["value"] == pytest.approx(40 / 260) and fa["baseline_spread"] == pytest.approx(20 / 260)
    # split:full at 252.5 meets 1.05 against either; the planning ratio moves with the mean
    assert got["MoBA planning @128K / dense"]["value"] == pytest.approx(50 / 260)


def test_a_modes_layer_takes_the_split_row_as_the_other_layer_figures_do():
    """Not the faster of split and flex: every layer figure reads the same executor (split, else flex)."""
    rows = [r if r["name"] != "flex:xattention" else {**r, "ms": 10.0} for r in ATTENTION["results"]]
    got = _by_figure(build_targets({"a.json": {**ATTENTION, "results": rows}}))
    xa = got["xattention / moba / nsa layer @128K (plan + kernel) / dense [xattention]"]
    assert xa["value"] == pytest.approx((20 + 140) / 250)
    only_flex = [r for r in rows if r["name"] != "split:xattention"]
    got = _by_figure(build_targets({"a.json": {**ATTENTION, "results": only_flex}}))
    assert got["xattention / moba / nsa layer @128K (plan + kernel) / dense [xattention]"]["value"] == pytest.approx(
        (20 + 10) / 250)


def test_the_later_run_wins_by_date_not_by_file_name():
    """s9 sorts after s19c by name; the run dated later is the one that counts, and the entry names
    the one it replaced."""
    old = {**ATTENTION, "environment": {**SETUP["environment"], "git_commit": "old", "date": "2026-12-01T10:00:00+00:00"}}
    new_rows = [r if r["name"] != "split:hybrid(full+streaming,msr=0.875)" else {**r, "ms": 35.0}
                for r in ATTENTION["results"]]
    new = {**ATTENTION, "results": new_rows,
           "environment": {**SETUP["environment"], "git_commit": "new", "date": "2026-12-06T10:00:00+00:00"}}
    fa = _by_figure(build_targets({"s9_attention.json": old, "s19c_attention.json": new}))[FA_SSA_FULL_NAME]
    assert fa["source"] == "s19c_attention.json" and fa["value"] == pytest.approx(35 / 250)
    assert fa["git_commit"] == "new" and fa["superseded"] == ["s9_attention.json"]


@pytest.mark.parametrize("name, data, figure, reason", [
    ("r.json", {**ROUTER, "router": "linear"}, "router, all layers, per layer", "not the paper's 'mlp'"),
    ("r.json", {**ROUTER, "router": "mlp", "shape": {"layers": 4, **SETUP["shape"]}}, "router, all layers, per layer",
     "shape"),
    ("k.json", {**DENSITY, "shape": {**SETUP["shape"], "dtype": "fp16"}},
     "block-sparse kernel @128K: 100% block density / dense cuDNN", "shape"),
    ("k.json", {**DENSITY, "shape": SETUP["shape"], "environment": {"device": "cpu"}},
     "block-sparse kernel @128K: 100% block density / dense cuDNN", "not a GPU"),
    ("p.json", {**PREFILL, "streaming": {**PREFILL["streaming"], "block_size": 128}},
     "model prefill @128K, MSR 0 / dense", "block_size 128"),
    ("d.json", {"benchmark": "demo_cpu", **DEMO, "threads": 16},
     "CPU (2 cores), demo at 1.4K tokens: all-streaming time / full time", "16 threads"),
])
def test_router_density_prefill_and_demo_runs_of_another_setup_answer_no_figure(name, data, figure, reason):
    entry = _by_figure(build_targets({name: data}))[figure]
    assert entry["value"] is None and entry["met"] is False and reason in entry["note"]


def test_a_non_finite_value_is_no_value_and_the_targets_file_is_still_written(tmp_path):
    (tmp_path / "k.json").write_text(json.dumps({**DENSITY, "criteria": [
        {"seq": L, "figure": "density 1 / dense cuDNN", "value": float("inf")}]}))
    path, targets = write_targets(tmp_path)
    entry = _by_figure(targets)["block-sparse kernel @128K: 100% block density / dense cuDNN"]
    assert entry["value"] is None and entry["met"] is False and "non-finite" in entry["note"]
    assert json.loads(path.read_text()) == targets


def test_a_failed_split_row_is_no_value_not_the_flex_rows():
    """The flex row stands in only where the run has no split row: a split row that failed (out of
    memory, say) leaves the figure without a value, not with flex's possibly faster time."""
    rows = [r if r["name"] != "split:xattention" else {**r, "ms": None, "error": "OutOfMemoryError: ..."}
            for r in ATTENTION["results"]]
    rows = [r if r["name"] != "flex:xattention" else {**r, "ms": 10.0} for r in rows]
    got = _by_figure(build_targets({"a.json": {**ATTENTION, "results": rows}}))
    xa = got["xattention / moba / nsa layer @128K (plan + kernel) / dense [xattention]"]
    assert xa["value"] is None and xa["met"] is False


def test_non_finite_limits_and_baselines_still_write_the_targets_file(tmp_path):
    rows = [r if r["name"] != "layout:moba" else {**r, "esr_mean": float("nan")} for r in ATTENTION["results"]]
    rows.append(_att("sdpa_cudnn@end", "fwd", float("inf")))
    (tmp_path / "a.json").write_text(json.dumps({**ATTENTION, "results": rows}))
    path, targets = write_targets(tmp_path)
    got = _by_figure(json.loads(path.read_text()))
    moba = got["xattention / moba / nsa layer @128K (plan + kernel) / dense [moba]"]
    assert moba["target"] is None and moba["met"] is False
    fa = got[FA_SSA_FULL_NAME]  # an infinite second baseline time is no time: the first one divides
    assert fa["value"] == pytest.approx(40 / 250) and "baseline_spread" not in fa


def test_an_environment_that_is_not_an_object_is_no_environment():
    got = _by_figure(build_targets({"a.json": {**ATTENTION, "environment": "cuda"},
                                    "d.json": {"benchmark": "demo_cpu", **DEMO, "environment": "cpu"}}))
    assert got[FA_SSA_FULL_NAME]["value"] is None and "not a GPU" in got[FA_SSA_FULL_NAME]["note"]
    assert got["CPU (2 cores), demo at 1.4K tokens: all-streaming time / full time"]["met"] is True  # threads: 2


def test_dates_are_compared_as_moments_not_strings():
    """10:30 at +02:00 is 08:30 UTC, before 09:00 UTC: the 09:00 run is the later one."""
    early = {**ATTENTION, "environment": {**SETUP["environment"], "date": "2026-12-06T10:30:00+02:00"}}
    late_rows = [r if r["name"] != "split:hybrid(full+streaming,msr=0.875)" else {**r, "ms": 35.0}
                 for r in ATTENTION["results"]]
    late = {**ATTENTION, "results": late_rows, "environment": {**SETUP["environment"], "date": "2026-12-06T09:00:00Z"}}
    fa = _by_figure(build_targets({"b.json": early, "a.json": late}))[FA_SSA_FULL_NAME]
    assert fa["source"] == "a.json" and fa["superseded"] == ["b.json"]


def test_an_earlier_runs_jsons_are_read_where_they_lie(tmp_path, capsys):
    """``--also`` adds JSON files of another folder as sources named by their path (not copied);
    a missing one is refused with its name, and targets.json is not written."""
    from elasticfw.cli import main

    run, old = tmp_path / "run", tmp_path / "old"
    run.mkdir(), old.mkdir()
    (run / "demo_cpu.json").write_text(json.dumps({"benchmark": "demo_cpu", **DEMO}))
    (old / "attention_128k.json").write_text(json.dumps(ATTENTION))
    assert main(["bench", "targets", str(run), "--also", str(old / "attention_128k.json")]) == 0
    got = _by_figure(json.loads((run / "targets.json").read_text()))
    assert got[FA_SSA_FULL_NAME]["source"] == str(old / "attention_128k.json")
    assert got[FA_SSA_FULL_NAME]["value"] == pytest.approx(40 / 250)
    assert got["CPU (2 cores), demo at 1.4K tokens: all-streaming time / full time"]["source"] == "demo_cpu.json"
    (run / "targets.json").unlink()
    # targets.json written elsewhere: the folder's own files are named by their path too
    assert main(["bench", "targets", str(run), "--also", str(old / "attention_128k.json"),
                 "--out", str(tmp_path / "targets.json")]) == 0
    got = _by_figure(json.loads((tmp_path / "targets.json").read_text()))
    demo = got["CPU (2 cores), demo at 1.4K tokens: all-streaming time / full time"]
    assert demo["source"] == str(run / "demo_cpu.json") and demo["value"] == pytest.approx(60 / 80)
    assert got[FA_SSA_FULL_NAME]["source"] == str(old / "attention_128k.json")
    assert main(["bench", "targets", str(run), "--also", str(old / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err and not (run / "targets.json").exists()


def test_an_unfinished_run_gives_no_figure_and_does_not_replace_a_finished_one():
    """A benchmark killed midway (``complete`` false: here a density run cut before the Triton
    kernel's rows, whose criteria were read from FlexAttention's) gives no value, with a note,
    even when it is the later run; a finished earlier run keeps its figures; files without the key
    predate it and are read."""
    half, full = FIGURES[-2][0], FIGURES[-1][0]

    def dated(data, day, **kw):
        return {**data, **kw, "environment": {**SETUP["environment"], "date": f"2026-12-0{day}T10:00:00+00:00"}}

    killed = dated(DENSITY, 7, complete=False, criteria=[
        {"seq": L, "figure": "density 0.5 / own density 1", "value": 0.52},
        {"seq": L, "figure": "density 1 / dense cuDNN", "value": 1.37},
    ])
    got = _by_figure(build_targets({"s23_density.json": killed}))
    for figure in (half, full):
        assert got[figure]["value"] is None and got[figure]["met"] is False
        assert "did not finish" in got[figure]["note"] and got[figure]["source"] == "s23_density.json"
    got = _by_figure(build_targets({"s19_density.json": dated(DENSITY, 5, complete=True), "s23_density.json": killed}))
    assert (got[half]["value"], got[half]["source"], got[half]["met"]) == (0.55, "s19_density.json", True)
    assert (got[full]["value"], got[full]["source"], got[full]["met"]) == (1.38, "s19_density.json", False)
    assert "note" not in got[half] and "superseded" not in got[half]
    assert _by_figure(build_targets({"d.json": DENSITY}))[half]["value"] == 0.55  # no key: an older file


def test_a_gpu_call_writes_targets_only_after_a_step_that_gives_figures(tmp_path, monkeypatch, capsys):
    """``gpu --steps gpu-tests`` alone (the GPU tests in their own call) wrote a ``targets.json`` of
    fifteen missing figures beside the tests' XML; a figure step (here ``router``) still ends with
    ``targets`` over the folder. The steps' commands are recorded, not run."""
    tool = _bench_targets_tool()
    ran: list[list[str]] = []

    def fake_run(cmd: list[str], log: list[dict]) -> int:
        ran.append(cmd)
        log.append({"command": cmd, "returncode": 0, "seconds": 0.0})
        return 0

    monkeypatch.setattr(tool, "_run", fake_run)
    tests_only = tmp_path / "tests_only"
    assert tool.main(["gpu", "--steps", "gpu-tests", "--out", str(tests_only)]) == 0
    assert "pytest" in ran[0] and not (tests_only / "targets.json").exists()
    assert "targets.json not written" in capsys.readouterr().out

    with_router = tmp_path / "with_router"
    with_router.mkdir()
    (with_router / "router.json").write_text(json.dumps(ROUTER))
    assert tool.main(["gpu", "--steps", "gpu-tests", "router", "--out", str(with_router)]) == 0
    written = json.loads((with_router / "targets.json").read_text())
    router = next(t for t in written if t["figure"] == "router, all layers, per layer")
    assert router["value"] == 0.12 and router["met"] is False
