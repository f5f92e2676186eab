"""CPU smoke run of the end-to-end generation benchmark (the real run is on a GPU; see
elasticfw/bench/generate.py): its JSON, its ratios, its tokens against an independent greedy
generation, a failing variant, and the speed targets read from its figures."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from bench_helpers import record_complete_flags
from transformers import GenerationConfig

from elasticfw.bench import generate
from elasticfw.bench.prefill import build_config, build_model, elastic_section, fixed_router
from elasticfw.bench.targets import build_targets
from elasticfw.cli import main as cli_main
from elasticfw.model.elastic import ElasticModel

SEQ, NEW = 96, 4
#: FA-SSA at MSR 0.5 (one of 2 KV heads streaming) with a window the 96-token prompt exceeds; batch 2
#: is above --max-prefill-tokens, so its prefill runs in two chunks (64 + 32 tokens)
SMOKE = ["bench", "generate", "--device", "cpu", "--dtype", "fp32", "--model", "tiny-llama", "--seq", str(SEQ),
         "--batch", "1", "2", "--layers", "1", "--new-tokens", str(NEW), "--msr", "0.5", "--sink", "16", "--local",
         "32", "--block-size", "16", "--warmup", "1", "--reps", "1", "--max-prefill-tokens", "100",
         "--prefill-chunk", "64"]
ELASTIC = ("elastic:split:fa-ssa:msr=0.5:full_cache", "elastic:split:fa-ssa:msr=0.5:compact_cache",
           "elastic:static:fa-ssa:msr=0.5:compact_cache")
#: static decoding with every head full: its MSR is 0 and its tokens are dense attention's
STATIC_FULL = generate.STATIC_FULL_HEADS


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("generate") / "generate.json"
    mp = pytest.MonkeyPatch()
    flags = record_complete_flags(mp, generate)
    try:
        rc = cli_main([*SMOKE, "--out", str(out)])
    finally:
        mp.undo()
    return rc, out, flags


def _rows(data, batch):
    return {r["variant"]: r for r in data["results"] if r["batch"] == batch}


def test_the_json_records_every_variant_its_ratios_and_the_environment(smoke):
    rc, out, flags = smoke
    assert rc == 0
    assert len(flags) > 2 and flags == [False] * (len(flags) - 1) + [True]  # written after every row
    data = json.loads(out.read_text())
    assert data["benchmark"] == "elasticfw.bench.generate" and data["complete"] and data["failures"] == []
    for key in ("date", "git_commit", "torch", "transformers", "gpu", "device"):
        assert key in data["environment"]
    assert data["models"]["tiny-llama"]["layers"] == 1 and data["new_tokens"] == NEW
    assert out.with_suffix(".png").stat().st_size > 0
    for batch, chunk, forwards in ((1, None, 1), (2, 64, 2)):
        rows = _rows(data, batch)
        assert set(rows) == {"dense:sdpa", "dense:flash_attention_2", *ELASTIC, STATIC_FULL}
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            assert rows["dense:flash_attention_2"]["skipped"] == "flash_attn not installed"
        else:
            assert rows["dense:flash_attention_2"]["skipped"] == "flash_attention_2 needs CUDA"
        dense = rows["dense:sdpa"]
        base = data["baselines"][f"tiny-llama/{SEQ}/{batch}"]
        assert base["decode_step_ms"] == dense["decode_step_ms"] and base["ttft_ms_variant"] == "dense:sdpa"
        for name in ("dense:sdpa", *ELASTIC, STATIC_FULL):
            r = rows[name]
            assert r["error"] is None and r["skipped"] is None and r["layers"] == 1 and r["new_tokens"] == NEW
            assert (r["prefill_chunk"], r["prefill_forwards"]) == (chunk, forwards)
            assert r["ttft_ms"] > 0 and r["decode_step_ms"] > 0 and r["e2e_ms"] > r["ttft_ms"]
            assert r["e2e_samples_ms"] == [r["e2e_ms"]] and r["ttft_samples_ms"] == [r["ttft_ms"]]
            # the ratios, recomputed from the row's own times and the dense row's
            assert r["ttft_over_dense"] == pytest.approx(r["ttft_ms"] / dense["ttft_ms"])
            assert r["decode_step_over_dense"] == pytest.approx(r["decode_step_ms"] / dense["decode_step_ms"])
            assert r["e2e_over_dense"] == pytest.approx(r["e2e_ms"] / dense["e2e_ms"])
            assert r["decode_tokens_per_s"] > 0 and r["kv_cache_bytes"] > 0
            assert r["peak_memory_bytes"] is None  # CUDA only
            assert len(r["tokens"]) == batch and all(len(t) == NEW for t in r["tokens"])
        for name in ELASTIC:
            assert rows[name]["msr"] == 0.5
            assert (rows[name]["esr"] is None) == (chunk is not None)  # a chunked prefill's ESR is not recorded
        assert rows[STATIC_FULL]["msr"] == 0.0
        # the static rows over the static full-heads row, recomputed; their tokens against the eager row's
        for name in ("dense:sdpa", *ELASTIC):
            r = rows[name]
            assert r["decode_step_over_static_full"] == pytest.approx(
                r["decode_step_ms"] / rows[STATIC_FULL]["decode_step_ms"])
        assert rows["elastic:static:fa-ssa:msr=0.5:compact_cache"]["tokens_equal_eager_compact"] == 1.0


def test_the_generated_tokens_equal_an_independent_greedy_generation(smoke):
    """The benchmark's own greedy loop against transformers' ``generate`` on the same weights: the
    dense row on the plain model (eager attention), the elastic rows on the elastic model through
    elasticfw's reference executor (full cache, the whole prompt in one forward)."""
    _, out, _ = smoke
    data = json.loads(out.read_text())
    torch.manual_seed(0)
    config = build_config("tiny-llama", 1)
    model = build_model(config, torch.device("cpu"), torch.float32)
    model.set_attn_implementation("eager")
    model.generation_config.eos_token_id = None  # the benchmark does not stop at the config's EOS (2) either
    greedy = GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    section_args = argparse.Namespace(block_size=16, sink=16, local=32)
    router, _ = fixed_router(0.5, 1, config.num_key_value_heads)
    for batch in (1, 2):
        ids = torch.randint(3, config.vocab_size, (batch, SEQ), generator=torch.Generator().manual_seed(SEQ))
        dense = model.generate(input_ids=ids, generation_config=greedy)[:, SEQ:].tolist()
        elastic = ElasticModel(model, elastic_section(section_args, "reference", router, "fa-ssa"))
        try:
            sparse = elastic.generate(input_ids=ids, generation_config=greedy)[:, SEQ:].tolist()
        finally:
            elastic.unwrap()
        rows = _rows(data, batch)
        assert rows["dense:sdpa"]["tokens"] == dense
        assert rows[STATIC_FULL]["tokens"] == dense  # every head full, decoded by the static path
        for name in ELASTIC:
            assert rows[name]["tokens"] == sparse, name
        assert sparse != dense  # the streaming head drops keys at 96 tokens: a different answer


def test_a_failing_variant_is_recorded_and_the_exit_status_is_1(tmp_path):
    out = tmp_path / "g.json"
    rc = generate.main(["--device", "cpu", "--dtype", "fp32", "--model", "tiny-llama", "--seq", "64", "--batch", "1",
                        "--layers", "1", "--new-tokens", "2", "--executor", "no_such_executor", "--reps", "1",
                        "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == 1 and len(data["failures"]) == 4 and data["complete"]
    rows = _rows(data, 1)
    assert rows["dense:sdpa"]["error"] is None and rows["dense:sdpa"]["ttft_ms"] > 0
    for name in ("elastic:no_such_executor:fa-ssa:msr=1:full_cache", "elastic:no_such_executor:fa-ssa:msr=1:compact_cache",
                 "elastic:static:fa-ssa:msr=1:compact_cache", STATIC_FULL):  # 0.875 of 2 KV heads: all streaming
        row = rows[name]
        assert "no_such_executor" in row["error"] and "ttft_ms" not in row
    assert generate.main(["--device", "cpu", "--reps", "0", "--out", str(tmp_path / "x.json")]) == 2


def test_an_argument_that_cannot_run_is_named(tmp_path, capsys):
    for bad, name in ((["--reps", "0"], "--reps 0"), (["--batch", "1", "0"], "--batch 0"),
                      (["--decode-sdpa", "fast"], "--decode-sdpa 'fast'"), (["--msr", "2"], "--msr 2.0")):
        assert generate.main(["--device", "cpu", *bad, "--out", str(tmp_path / "x.json")]) == 2
        assert name in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def _row(seq, batch, variant, step, e2e=None):
    return {"model": "llama-3.1-8b", "seq": seq, "batch": batch, "variant": variant, "error": None,
            "decode_step_over_dense": step, "e2e_over_dense": e2e}


GENERATE = {
    "benchmark": "elasticfw.bench.generate",
    "environment": {"gpu": "NVIDIA H100 80GB HBM3", "git_commit": "abc123", "device": "cuda"},
    "dtype": "bf16",
    "new_tokens": 256,
    "streaming": {"sink_tokens": 128, "local_tokens": 2048, "block_size": 64},
    "complete": True,
    "results": [
        _row(32768, 1, "elastic:split:fa-ssa:msr=0.875:compact_cache", 1.2),
        _row(32768, 1, "elastic:split:fa-ssa:msr=0.875:full_cache", 0.9),  # the full cache's row: not read
        _row(131072, 1, "elastic:split:fa-ssa:msr=0.875:compact_cache", 0.5, e2e=0.6),
        _row(32768, 8, "elastic:split:fa-ssa:msr=0.875:compact_cache", 0.8),
        {**_row(131072, 8, "elastic:split:fa-ssa:msr=0.875:compact_cache", 0.1),
         "error": "OutOfMemoryError: ..."},  # an errored row gives no value
        {**_row(131072, 1, "elastic:split:fa-ssa:msr=0.875:compact_cache", 0.01), "model": "qwen3-8b"},
        _row(131072, 1, "elastic:static:fa-ssa:msr=0.875:compact_cache", 0.4, e2e=0.5),  # static decoding
        _row(32768, 8, "elastic:static:fa-ssa:msr=0.875:compact_cache", 1.1),
    ],
}
STEP = "generate decode step @{}, batch {}, FA-SSA MSR 0.875 compact cache / dense"
E2E = "generate end to end @128K + 256 tokens, batch 1, FA-SSA MSR 0.875 compact cache / dense"
STATIC_STEP = "generate decode step @{}, batch {}, FA-SSA MSR 0.875 compact cache, static decode / dense"
STATIC_E2E = "generate end to end @128K + 256 tokens, batch 1, FA-SSA MSR 0.875 compact cache, static decode / dense"


def test_targets_read_the_generate_figures_from_a_hand_written_json():
    got = {t["figure"]: t for t in build_targets({"generate.json": GENERATE})}
    expected = {STEP.format("32K", 1): (1.2, 1.0, False), STEP.format("128K", 1): (0.5, 0.6, True),
                STEP.format("32K", 8): (0.8, 1.0, True), STEP.format("128K", 8): (None, 0.6, False),
                E2E: (0.6, 0.55, False),
                STATIC_STEP.format("32K", 1): (None, 1.0, False), STATIC_STEP.format("128K", 1): (0.4, 0.6, True),
                STATIC_STEP.format("32K", 8): (1.1, 1.0, False), STATIC_E2E: (0.5, 0.55, True)}
    for figure, (value, target, met) in expected.items():
        t = got[figure]
        assert (t["value"], t["target"], t["met"]) == (value, target, met), figure
        assert t["source"] == "generate.json" and t["gpu"] == "NVIDIA H100 80GB HBM3" and "note" not in t
    # a run of other new tokens (or on a CPU) answers none of them
    for change, reason in (({"new_tokens": 4}, "4 new tokens"), ({"environment": {"device": "cpu"}}, "not a GPU")):
        other = {t["figure"]: t for t in build_targets({"g.json": {**GENERATE, **change}})}
        assert other[E2E]["value"] is None and reason in other[E2E]["note"]
