"""CPU smoke run of the attention benchmark (the real run is on a GPU; see elasticfw/bench/attention.py)."""

from __future__ import annotations

import json

import pydantic
import pytest
import torch
from bench_helpers import record_complete_flags

from elasticfw.attention.layout import causal_layout
from elasticfw.bench import attention as bench
from elasticfw.bench import attention_checks, attention_setup, timing
from elasticfw.registry import get_registry
from elasticfw.testing.modes import make_mode

TINY = ["--device", "cpu", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "fp32"]
FAST = ["--cpu-warmup", "0", "--cpu-iters", "1"]


def test_bench_runs_every_registered_mode_on_cpu(tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    flags = record_complete_flags(monkeypatch, bench)
    # streaming sparse at 128 tokens (its defaults cover every key there: a dense layout, no hybrid row)
    sparse_stream = ["--set", "streaming.sink_tokens=16", "--set", "streaming.local_tokens=32",
                     "--set", "streaming.block_size=16"]
    args = [*TINY, *FAST, *sparse_stream, "--seq", "128", "--check-seq", "160", "--layout-memory", "256",
            "--out", str(out)]
    rc = bench.main(args)
    data = json.loads(out.read_text())
    assert rc == 0, data["failures"]
    # written after every row, and marked complete only by the last write
    assert len(flags) > 2 and flags == [False] * (len(flags) - 1) + [True]
    env = data["environment"]
    for key in ("date", "git_commit", "torch", "triton", "transformers", "gpu"):
        assert key in env
    names = {(r["name"], r["kind"]) for r in data["results"]}
    assert ("sdpa_math", "fwd") in names and ("sdpa_math", "fwd_bwd") in names
    for mode in get_registry().names("sparse_mode"):
        for entry in (
            (f"layout:{mode}", "layout"),
            (f"convert:{mode}", "convert"),
            (f"flex:{mode}", "fwd"),
            (f"flex:{mode}", "fwd_bwd"),
            (f"check:{mode}:decode", "check"),
            (f"layout_memory:{mode}", "memory"),
        ):
            assert entry in names, entry
    timed = [r for r in data["results"] if r["kind"] == "fwd" and r["name"].startswith("flex:")]
    assert all(r["ms"] > 0 and r["ratio_vs_sdpa_math"] > 0 for r in timed)
    # the baseline is timed first and again last; every ratio divides by the mean of the two
    rows = {(r["name"], r["kind"]): r for r in data["results"]}
    first, last = rows[("sdpa_math", "fwd")]["ms"], rows[("sdpa_math@end", "fwd")]["ms"]
    assert rows[("sdpa_math", "fwd")]["baseline_ms_first_last"] == [first, last]
    for r in timed:
        assert r["ratio_vs_sdpa_math"] == pytest.approx(r["ms"] / ((first + last) / 2), rel=1e-12)
    # a second run does not replace the report unless asked
    before = out.read_bytes()
    assert bench.main(args) == 2 and out.read_bytes() == before
    assert any(r["name"].startswith("flex:hybrid(") for r in timed)


class Broken:
    """A mode whose layout always fails."""

    name = "broken"

    def build_layout(self, q, k, seq):
        raise RuntimeError("boom")


def test_a_failing_mode_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    streaming = make_mode("streaming", {"block_size": 16, "sink_tokens": 16, "local_tokens": 32})
    monkeypatch.setattr(bench, "bench_modes", lambda args: [Broken(), streaming])
    out = tmp_path / "bench.json"
    rc = bench.main([*TINY, *FAST, "--seq", "64", "--check-seq", "0", "--no-backward", "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == 1
    rows = {(r["name"], r["kind"]): r for r in data["results"]}
    assert rows[("layout:broken", "layout")]["error"] == "RuntimeError: boom"
    assert rows[("flex:streaming", "fwd")]["error"] is None and rows[("flex:streaming", "fwd")]["ms"] > 0
    assert any("boom" in line for line in data["failures"])


def test_a_mode_failing_where_its_check_length_is_sought_fails_that_check_only(tmp_path, monkeypatch):
    """Finding each mode's check length builds its layout: a mode that fails there is a failed check
    row, and the other modes are still checked and timed (it used to end the run, leaving no JSON)."""
    streaming = make_mode("streaming", {"block_size": 16, "sink_tokens": 16, "local_tokens": 32})
    monkeypatch.setattr(bench, "bench_modes", lambda args: [Broken(), streaming])
    monkeypatch.setattr(attention_checks, "bench_modes", lambda args: [Broken(), streaming])
    out = tmp_path / "bench.json"
    rc = bench.main([*TINY, *FAST, "--seq", "64", "--check-seq", "96", "--no-backward", "--no-hybrid",
                     "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == 1
    rows = {(r["name"], r["kind"]): r for r in data["results"]}
    assert rows[("check_length:broken", "check")]["error"] == "RuntimeError: boom"
    assert ("check_length:streaming", "check") not in rows  # a length found is no row
    assert rows[("check:streaming:prefill", "check")]["error"] is None
    assert rows[("flex:streaming", "fwd")]["ms"] > 0


def test_rebase_divides_by_the_mean_of_the_baselines_first_and_last_times():
    rows = [{"seq": 8, "name": "b", "kind": "fwd", "ms": 100.0, "ratio_vs_b": 1.0},
            {"seq": 8, "name": "x", "kind": "fwd", "ms": 52.5, "ratio_vs_b": 0.525},
            {"seq": 8, "name": "x", "kind": "fwd_bwd", "ms": 7.0, "ratio_vs_b": 0.5},  # no second time: kept
            {"seq": 16, "name": "x", "kind": "fwd", "ms": 9.0, "ratio_vs_b": 0.25},  # another length: kept
            {"seq": 8, "name": "b@end", "kind": "fwd", "ms": 110.0, "ratio_vs_b": 1.1}]
    bench.rebase(rows, 8, "b")
    assert rows[1]["ratio_vs_b"] == pytest.approx(0.5) and rows[0]["ratio_vs_b"] == pytest.approx(100 / 105)
    assert rows[0]["baseline_spread"] == pytest.approx(10 / 105) and rows[0]["baseline_ms_first_last"] == [100, 110]
    assert rows[2]["ratio_vs_b"] == 0.5 and rows[3]["ratio_vs_b"] == 0.25
    # the first baseline time failed: the last one divides (as targets does), no spread
    rows = [{"seq": 8, "name": "b", "kind": "fwd", "ms": None, "error": "RuntimeError"},
            {"seq": 8, "name": "x", "kind": "fwd", "ms": 55.0, "ratio_vs_b": None},
            {"seq": 8, "name": "b@end", "kind": "fwd", "ms": 110.0}]
    bench.rebase(rows, 8, "b")
    assert rows[1]["ratio_vs_b"] == pytest.approx(0.5) and "baseline_spread" not in rows[0]


def test_hybrid_layout_keeps_the_first_kv_heads_full():
    from elasticfw.attention.seq import SeqInfo

    seq = SeqInfo.dense(1, 64, 64)
    streaming = make_mode("streaming", {"block_size": 16, "sink_tokens": 16, "local_tokens": 16})
    sparse = streaming.build_layout(torch.empty(0), torch.empty(0), seq)
    hybrid = attention_setup.hybrid(sparse, seq, hq=8, hkv=4, msr=0.75)
    causal = causal_layout(seq, 16).blocks[0, 0]
    assert torch.equal(hybrid.blocks[0, 0], causal) and torch.equal(hybrid.blocks[0, 1], causal)
    assert not torch.equal(hybrid.blocks[0, 2], causal)


def test_flex_set_reaches_the_flex_executor(tmp_path):
    """``--flex-set`` configures the executor of the convert:/flex: entries (the tile size is
    recorded per entry); a field the executor does not have is refused by its config."""
    out = tmp_path / "bench.json"
    rc = bench.main([*TINY, *FAST, "--seq", "128", "--check-seq", "0", "--no-backward", "--no-hybrid",
                     "--modes", "streaming", "--set", "streaming.block_size=16", "--flex-set", "kernel_block_size=32",
                     "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0, data["failures"]
    rows = {(r["name"], r["kind"]): r for r in data["results"]}
    assert rows[("convert:streaming", "convert")]["kernel_block_size"] == 32
    assert attention_setup.flex_config(bench.parse_args(["--out", "x", "--flex-set", "kernel_options={BLOCK_M: 64}"])) == {
        "implementation": "auto", "kernel_options": {"BLOCK_M": 64}}
    with pytest.raises(pydantic.ValidationError, match="no_such_field"):
        timing.make_executor("flex", **attention_setup.flex_config(bench.parse_args(["--out", "x", "--flex-set",
                                                                                    "no_such_field=1"])))


@pytest.mark.skipif(not __import__("elasticfw.kernels", fromlist=["interpreting"]).interpreting(),
                    reason="needs Triton's interpreter")
def test_forward_only_checks_and_flex_set_under_split(tmp_path, monkeypatch):
    """``--no-backward`` checks outputs without gradients, so an inference-only kernel can be
    checked (the flex checks run the Triton kernel here, under the interpreter); ``--flex-set``
    also reaches split's nested flex options (its sparse path on a GPU)."""
    import elasticfw.kernels.block_sparse_attention as bsa

    calls = []
    real = bsa.block_layout_attention
    monkeypatch.setattr(bsa, "block_layout_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    made = {}
    real_executor = timing.make_executor

    def executor(name, **config):
        made[name] = real_executor(name, **config)
        return made[name]

    for module in (bench, attention_checks):  # the timed entries and the checks
        monkeypatch.setattr(module, "make_executor", executor)
    out = tmp_path / "bench.json"
    rc = bench.main([*TINY, *FAST, "--seq", "64", "--check-seq", "96", "--no-backward", "--no-hybrid",
                     "--executors", "flex", "split", "--modes", "streaming",
                     "--set", "streaming.block_size=16", "--set", "streaming.sink_tokens=16",
                     "--set", "streaming.local_tokens=32", "--flex-set", "sparse_kernel=triton", "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0, data["failures"]
    checks = [r for r in data["results"] if r["kind"] == "check"]
    assert {r["name"] for r in checks} >= {"check:streaming:prefill", "check:split:streaming:routed_scattered"}
    assert all(r["error"] is None and r["grad_rel_rms"] == {} and r["out_rel_rms"] < 1e-5 for r in checks)
    assert calls  # the flex checks and timings ran the kernel
    assert made["split"].config.flex_config().sparse_kernel == "triton"


def test_checks_run_each_mode_where_its_layout_is_sparse(tmp_path):
    """MoBA (64-token blocks, top 2) is dense at 96 tokens (2 blocks): its checks run at 192, where it
    selects (a dense layout would check the dense path only, not its sparse kernels); streaming
    (sink 16 / local 16) is sparse at 96 and checks there."""
    out = tmp_path / "bench.json"
    args = [*TINY, *FAST, "--modes", "moba", "streaming", "--set", "moba.moba_block_size=64", "--set",
            "moba.top_k=2", "--set", "moba.block_size=16", "--set", "streaming.sink_tokens=16", "--set",
            "streaming.local_tokens=16", "--set", "streaming.block_size=16", "--seq", "--check-seq", "96",
            "--no-backward", "--executors", "flex", "split", "--out", str(out)]
    assert bench.main(args) == 0
    rows = [r for r in json.loads(out.read_text())["results"] if r["kind"] == "check"]
    seqs = {r["name"]: r["seq"] for r in rows}
    assert seqs["check:moba:prefill"] == 192 and seqs["check:streaming:prefill"] == 96
    assert seqs["check:split:moba:routed_first_full"] == 192  # routed checks too: only for a sparse layout
    assert all(r["error"] is None for r in rows)
    assert next(r for r in rows if r["name"] == "check:moba:prefill")["esr_mean"] > 0
