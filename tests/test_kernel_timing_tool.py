"""Timing tools that sessions run: ``scripts/sparse_kernel_timing.py`` (on a GPU, where a crash costs
device time) on the CPU under Triton's interpreter, its CUDA timing and inputs replaced: every row
and note it promises is written, the Triton and torch work lists agree, and the compact lists are
smaller; ``scripts/cpu_layer_timing.py`` at a tiny size: a row per phase and mode with the layout's ESR."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from elasticfw.kernels import triton_unavailable

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
pytestmark = pytest.mark.skipif(triton_unavailable(torch.device("cpu")) is not None, reason="needs Triton's interpreter")


def test_sparse_kernel_timing_writes_every_row(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import sparse_kernel_timing as tool

    from elasticfw.attention.seq import SeqInfo
    from elasticfw.bench.inputs import structured_qkv
    from elasticfw.kernels import work_lists as wl

    def layer(args):
        q, k, v = structured_qkv(1, args.query_heads, args.kv_heads, args.tokens, args.head_dim, seed=0)
        return q, k, v, SeqInfo.dense(1, args.tokens, args.tokens)

    calls = []
    monkeypatch.setattr(wl, "TRITON_WORK_LISTS", True)  # restored after the test whatever the tool does
    monkeypatch.setattr(tool, "structured_layer", layer)
    monkeypatch.setattr(tool, "dense_layer", lambda q, k, v: lambda: None)
    monkeypatch.setattr(tool, "timed", lambda fn, repeats: (fn(), calls.append(1), 2.0)[-1])
    monkeypatch.setattr(tool, "environment", lambda device: {"device": str(device)})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    out = tmp_path / "timing.json"
    monkeypatch.setattr(sys, "argv", [
        "sparse_kernel_timing.py", "--tokens", "256", "--query-heads", "2", "--kv-heads", "1", "--head-dim", "16",
        "--modes", "streaming", "xattention", "--triton-work-lists", "--compact-lists", "--tiles", "32,32,4,2",
        "--json", str(out)])
    tool.main()
    report = json.loads(out.read_text())
    rows = {"plan", "kernel", "call", "plan, triton lists", "call, triton lists", "plan, compact",
            "kernel, compact", "call, tiles 32,32,4,2"}
    assert set(report["ms"]) == {"dense cuDNN SDPA layer"} | {f"{m}: {r}" for m in ("streaming", "xattention")
                                                              for r in rows}
    assert len(calls) == len(report["ms"]) and report["ratio_vs_dense"]["streaming: plan"] == 1.0
    for mode in ("streaming", "xattention"):
        notes = report["notes"]
        assert notes[f"{mode}: triton work lists equal torch's"] == 1.0
        assert 0 < notes[f"{mode}: compact lists, MB"] < notes[f"{mode}: dense lists, MB"]
    assert wl.TRITON_WORK_LISTS is True  # the tool puts the module's default back


def test_cpu_layer_timing_writes_a_row_per_phase_and_mode(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import cpu_layer_timing as tool

    out = tmp_path / "layers.json"
    args = ["--batch", "1", "--tokens", "200", "--repeats", "1", "--modes", "full", "streaming", "nsa",
            "--sdpa-masks", "--json", str(out)]
    assert tool.main(args) == 0
    report = json.loads(out.read_text())
    assert set(report["ms"]) == {f"{p} {m}" for p in ("prefill", "decode") for m in ("full", "streaming", "nsa")}
    assert report["ms"]["prefill full"]["esr"] == 0 and report["ms"]["prefill nsa"]["esr"] == 0  # 4 blocks
    assert report["ms"]["prefill streaming"]["esr"] == 0  # 200 tokens: inside sink + window
    assert all(row["plan"] > 0 and row["attend"] > 0 for row in report["ms"].values())
    assert len(report["sdpa_masks_ms"]) == 3
    with pytest.raises(SystemExit):
        tool.main(["--tokens", "1"])


def test_cpu_routed_decode_timing_checks_both_forms_and_restores_the_bound(tmp_path, monkeypatch):
    """``scripts/cpu_routed_decode_timing.py`` at a tiny size: a row per (batch, keys) with the four
    timings and the pairs the masked call adds (batch x 6 sparse heads x the keys outside sink and
    window), and the executor's bound put back."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import cpu_routed_decode_timing as tool

    from elasticfw_plugins.executors import gathered

    bound = gathered.MASKED_DECODE_PAIRS
    out = tmp_path / "routed.json"
    assert tool.main(["--batch", "2", "--keys", "700", "--calls", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["us_per_call"]
    assert all(row[k] > 0 for k in ("dense", "two_calls", "masked", "auto"))
    # block 10 of 64 holds positions 640-699: blocks 0 and 7-10, the last one's 60 keys only
    kept = 64 + 3 * 64 + 60
    assert row["pairs"] == 2 * 6 * (700 - kept)
    assert gathered.MASKED_DECODE_PAIRS == bound
