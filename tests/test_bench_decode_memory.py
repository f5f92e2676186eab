"""The decode-memory benchmark runs end to end on a CPU at a tiny shape (smoke test), and its
compact-cache rows hold the kept-token counts written out by hand."""

from __future__ import annotations

import json

from elasticfw.bench.decode_memory import main

TINY = ["--device", "cpu", "--dtype", "fp32", "--contexts", "100", "--layers", "2", "--hidden", "64", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "16", "--intermediate", "128", "--vocab", "256", "--sink", "16",
        "--local", "32", "--block", "16", "--steps", "2", "--warmup", "1", "--msr", "0.5", "1.0"]


def test_bench_smoke(tmp_path):
    out = tmp_path / "decode_memory.json"
    assert main([*TINY, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["failures"] == []
    assert data["environment"]["torch"] and "commit" in json.dumps(data["environment"])
    rows = {(r["variant"], r["msr"]): r for r in data["rows"]}
    assert set(rows) == {("dense", 0.0), ("full_cache", 0.5), ("compact_cache", 0.5), ("full_cache", 1.0),
                         ("compact_cache", 1.0)}
    n = 100 + 1 + 2  # context + warmup + timed steps
    kept = 16 + 32  # sink + window
    assert rows["compact_cache", 1.0]["kept_tokens"] == 2 * 2 * kept  # layers x KV heads
    assert rows["compact_cache", 0.5]["kept_tokens"] == 2 * (n + kept)  # one full, one streaming head per layer
    dense = 2 * 2 * 2 * 100 * 16 * 4  # K and V, layers, KV heads, tokens, head dim, fp32
    assert rows["dense", 0.0]["cache_bytes_after_prefill"] == dense
    assert rows["full_cache", 1.0]["cache_bytes_after_prefill"] == dense
    assert rows["compact_cache", 1.0]["cache_bytes_after_prefill"] == 2 * 2 * kept * (2 * 16 * 4 + 4)
    assert abs(rows["compact_cache", 1.0]["expected_kv_ratio"] - kept / 100) < 1e-9
    assert all(r["decode_step_ms_median"] > 0 for r in data["rows"])
    for r in data["rows"]:  # each row's step over the dense row's of its context
        assert r["step_over_dense"] == r["decode_step_ms_median"] / rows["dense", 0.0]["decode_step_ms_median"]


def test_rows_carry_the_realised_msr_and_counts_before_the_profiled_steps(tmp_path):
    """With 2 KV heads, MSR 0.875 rounds to no full head: the row says MSR 1.0 (target 0.875) and its
    expected ratio is all-streaming's, kept/100. ``--profile`` runs three more steps after the timed
    ones; the kept tokens are those after the timed steps (hand count: one full head per layer at MSR
    0.5 keeps context + warmup + steps tokens)."""
    out = tmp_path / "decode_memory.json"
    args = [a if a != "1.0" else "0.875" for a in TINY]
    assert main([*args, "--profile", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["failures"] == []
    rows = {(r["variant"], r["target_msr"]): r for r in data["rows"]}
    sparse = rows["compact_cache", 0.875]
    assert sparse["msr"] == 1.0
    assert abs(sparse["expected_kv_ratio"] - (16 + 32) / 100) < 1e-9
    assert sparse["kept_tokens"] == 2 * 2 * (16 + 32)
    half = rows["compact_cache", 0.5]
    assert half["msr"] == 0.5 and half["kept_tokens"] == 2 * ((100 + 1 + 2) + (16 + 32))
    assert half["kept_tokens_ratio"] == half["kept_tokens"] / (2 * 2 * (100 + 1 + 2))
    assert "profile" in half
