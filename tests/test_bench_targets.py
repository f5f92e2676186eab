"""build_targets on hand-written benchmark JSONs: each figure's value, target, verdict and source."""

from __future__ import annotations

import json

import pytest

from elasticfw.bench.targets import FIGURES, build_targets, write_targets

L = 131072


def _att(name, kind, ms, seq=L, **extra):
    return {"seq": seq, "name": name, "kind": kind, "ms": ms, "error": None, **extra}


ATTENTION = {
    "benchmark": "elasticfw.bench.attention",
    "results": [
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
ROUTER = {"benchmark": "router_overhead", "rows": [{"seq": 8192, "router_per_layer_ms": 0.05},
                                                    {"seq": L, "router_per_layer_ms": 0.12}]}
DEMO = {"rows": [{"label": "full", "seconds": 80.0}, {"label": "all-streaming", "seconds": 60.0}]}  # demo-cpu.json form
DENSITY = {"benchmark": "elasticfw.bench.density", "criteria": [
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
        assert set(t) == {"figure", "value", "target", "met", "source"}

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
    assert router["source"] == "router.json" and router["value"] > 0
    assert "router, all layers, per layer" in capsys.readouterr().out


def test_a_prefill_run_of_another_model_answers_no_figure():
    """The issue's model figures are Llama-3.1-8B's: a Qwen3-8B run in the folder (sorted after the
    Llama one) must not replace them."""
    llama = {"benchmark": "elasticfw.bench.prefill", "models": {"llama-3.1-8b": {}}, "results": [
        {"model": "llama-3.1-8b", "seq": 131072, "variant": "elastic:split:msr=0", "speedup": 0.99, "error": None}]}
    qwen = {"benchmark": "elasticfw.bench.prefill", "models": {"qwen3-8b": {}}, "results": [
        {"model": "qwen3-8b", "seq": 131072, "variant": "elastic:split:msr=0", "speedup": 0.5, "error": None}]}
    (entry,) = [t for t in build_targets({"a.json": llama, "b.json": qwen}) if t["figure"].startswith(
        "model prefill @128K, MSR 0")]
    assert (entry["value"], entry["source"], entry["met"]) == (0.99, "a.json", True)
