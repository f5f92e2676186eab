"""CPU smoke run of the model-level prefill benchmark (the real run is on a GPU; see elasticfw/bench/prefill.py)."""

from __future__ import annotations

import json

import pytest
from bench_helpers import record_complete_flags

from elasticfw.bench import prefill
from elasticfw.cli import main as cli_main


def test_prefill_bench_runs_dense_and_elastic_variants_on_cpu(tmp_path, monkeypatch):
    out = tmp_path / "prefill.json"
    flags = record_complete_flags(monkeypatch, prefill)
    args = ["bench", "prefill", "--device", "cpu", "--dtype", "fp32", "--model", "tiny-llama", "--seq", "96",
            "--layers", "1", "--executors", "split", "sdpa", "--msr", "0.5", "--sink", "16", "--local", "32",
            "--block-size", "16", "--reps", "1", "--out", str(out)]
    assert cli_main(args) == 0
    # written after every row, and marked complete only by the last write
    assert len(flags) > 2 and flags == [False] * (len(flags) - 1) + [True]
    data = json.loads(out.read_text())
    for key in ("date", "git_commit", "torch", "transformers", "gpu"):
        assert key in data["environment"]
    assert data["models"]["tiny-llama"]["layers"] == 1 and data["models"]["tiny-llama"]["full_layers"] == 2
    rows = {r["variant"]: r for r in data["results"]}
    assert set(rows) == {"dense:sdpa", "elastic:split:msr=0", "elastic:split:fa-ssa:msr=0.5",
                         "elastic:sdpa:msr=0", "elastic:sdpa:fa-ssa:msr=0.5"}
    for r in rows.values():
        assert r["error"] is None and r["ms"] > 0 and r["layers"] == 1
        assert r["baseline_ms"] == rows["dense:sdpa"]["ms"]
        assert r["speedup"] == pytest.approx(r["baseline_ms"] / r["ms"])
    # fixed routing: MSR as asked, ESR from the routing report (streaming skips pairs at 96 tokens)
    assert rows["elastic:split:msr=0"]["esr"] == 0 and rows["elastic:split:fa-ssa:msr=0.5"]["msr"] == 0.5
    assert 0 < rows["elastic:split:fa-ssa:msr=0.5"]["esr"] < 0.5
    assert (tmp_path / "prefill.png").stat().st_size > 0
    assert cli_main(args) == 2  # an existing report is not replaced without --overwrite


def test_fixed_router_keeps_the_first_heads_full():
    assert prefill.fixed_router(0.0, 2, 8) == ({"name": "fixed", "assign": "all_retrieval"}, 0.0)
    router, msr = prefill.fixed_router(0.875, 2, 8)
    assert msr == 0.875 and router["assign"] == "retrieval_heads" and router["heads"] == [[0, 0], [1, 0]]
    assert prefill.fixed_router(1.0, 2, 8)[1] == 1.0


def test_full_size_configs_have_the_real_shapes():
    llama = prefill.build_config("llama-3.1-8b")
    assert (llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim,
            llama.hidden_size, llama.intermediate_size, llama.vocab_size) == (32, 32, 8, 128, 4096, 14336, 128256)
    assert llama.rope_parameters["rope_type"] == "llama3"
    qwen = prefill.build_config("qwen3-8b", layers=4)
    assert (qwen.num_hidden_layers, qwen.num_key_value_heads, qwen.intermediate_size) == (4, 8, 12288)
    with pytest.raises(SystemExit, match="layers"):
        prefill.build_config("qwen3-8b", layers=40)


def test_a_failing_variant_is_recorded_and_the_run_goes_on(tmp_path):
    out = tmp_path / "p.json"
    rc = prefill.main(["--device", "cpu", "--dtype", "fp32", "--model", "tiny-llama", "--seq", "64", "--layers", "1",
                       "--executors", "no_such_executor", "--msr", "--reps", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == 1 and data["failures"]
    rows = {r["variant"]: r for r in data["results"]}
    assert rows["dense:sdpa"]["error"] is None and "no_such_executor" in rows["elastic:no_such_executor:msr=0"]["error"]


def test_prefill_bench_times_the_papers_three_hybrids(tmp_path):
    """FA-SSA, FA-XA and XA-SSA each get their own modes: with every layer's first KV head the
    retrieval mode and the second the sparse one, FA-XA skips only what XAttention skips on one
    head (below FA-SSA's streaming head at 256 tokens), and XA-SSA skips FA-SSA's pairs plus
    XAttention's on the other head."""
    out = tmp_path / "p.json"
    rc = prefill.main(["--device", "cpu", "--dtype", "fp32", "--model", "tiny-llama", "--seq", "256", "200", "--layers", "1",
                       "--executors", "split", "--msr", "0.5", "--configs", "fa-ssa", "fa-xa", "xa-ssa",
                       "--sink", "16", "--local", "32", "--block-size", "16", "--reps", "1", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert all(r["error"] is None for r in data["results"]) and len(data["results"]) == 10  # both lengths
    rows = {r["variant"]: r for r in data["results"] if r["seq"] == 256}
    assert set(rows) == {"dense:sdpa", "elastic:split:msr=0", "elastic:split:fa-ssa:msr=0.5",
                         "elastic:split:fa-xa:msr=0.5", "elastic:split:xa-ssa:msr=0.5"}
    assert data["configs"]["xa-ssa"]["retrieval_mode"]["name"] == "xattention"
    assert data["configs"]["xa-ssa"]["sparse_mode"]["name"] == "streaming"
    assert data["configs"]["fa-xa"]["sparse_mode"]["name"] == "xattention"
    esr = {name.split(":")[2]: r["esr"] for name, r in rows.items() if name.count(":") == 3}
    # streaming on one of two heads at 256 tokens (sink 16 + local 32, blocks of 16): the
    # causal pairs outside sink and window, halved
    blocks = 256 // 16
    kept = sum(min(i + 1, 1 + 2) * 1.0 for i in range(blocks))  # sink block + 2 local blocks (diagonal counted)
    total = blocks * (blocks + 1) / 2
    assert esr["fa-ssa"] == pytest.approx(0.5 * (1 - kept / total), abs=0.02)
    assert 0 < esr["fa-xa"] < esr["fa-ssa"]
    assert esr["xa-ssa"] > esr["fa-ssa"]


def test_every_row_gets_as_many_forwards_and_each_elastic_forward_plans_afresh(tmp_path, monkeypatch):
    """Every variant runs warmup + reps forwards (the elastic row's statistics pass is its first, not
    an extra warm-up the dense rows lack), and each elastic forward builds its layouts as a new
    request does: streaming's layout is built once per forward, not once per run."""
    import functools

    from transformers import LlamaForCausalLM

    from elasticfw_plugins.modes.streaming import StreamingAttention

    forwards: list[str] = []
    real_forward = LlamaForCausalLM.forward

    @functools.wraps(real_forward)  # elasticfw reads the forward's signature
    def counting_forward(self, *a, **k):
        forwards.append(self.config._attn_implementation)
        return real_forward(self, *a, **k)

    builds = []
    real_build = StreamingAttention.build_layout

    def counting_build(self, *a, **k):
        builds.append(len(forwards))
        return real_build(self, *a, **k)

    monkeypatch.setattr(LlamaForCausalLM, "forward", counting_forward)
    monkeypatch.setattr(StreamingAttention, "build_layout", counting_build)
    out = tmp_path / "prefill.json"
    assert prefill.main(["--device", "cpu", "--dtype", "fp32", "--model", "tiny-llama", "--seq", "96", "--layers",
                         "2", "--executors", "split", "--configs", "fa-ssa", "--msr", "0.5", "--sink", "16",
                         "--local", "32", "--block-size", "16", "--warmup", "2", "--reps", "3", "--out",
                         str(out)]) == 0
    assert json.loads(out.read_text())["failures"] == []
    dense = [f for f in forwards if f != "elasticfw"]
    elastic = [f for f in forwards if f == "elasticfw"]
    assert len(dense) == 5  # dense:sdpa: 2 untimed + 3 timed
    assert len(elastic) == 2 * 5  # msr=0 and fa-ssa msr=0.5, 5 forwards each
    # the fa-ssa row's 5 forwards (the last five): one streaming layout in each (2 layers share it)
    last = len(forwards) - 5
    assert sorted(set(b for b in builds if b > last)) == list(range(last + 1, len(forwards) + 1))
    assert len([b for b in builds if b > last]) == 5
