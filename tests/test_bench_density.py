"""The block-density benchmark: its random layouts, and a CPU smoke run (the real run is on a GPU)."""

from __future__ import annotations

import json

import pytest
import torch
from bench_helpers import record_complete_flags

from elasticfw.attention.seq import SeqInfo
from elasticfw.bench import density


@pytest.mark.parametrize("share", [1.0, 0.5, 0.3, 0.01])
def test_random_layout_keeps_the_asked_share_of_each_rows_causal_blocks(share):
    seq = SeqInfo.dense(1, 700, 700)  # 11 blocks of 64, the last one partial
    layout = density.random_block_layout(seq, 3, 64, share, seed=1)
    blocks = layout.blocks[0]  # (H, NQB, NKB)
    assert blocks.shape == (3, 11, 11) and layout.token_mask is None and not layout.dense_causal
    for t in range(11):
        row = blocks[:, t]
        assert not row[:, t + 1 :].any()  # never a future block
        assert row[:, t].all()  # the diagonal always
        assert (row.sum(-1) == max(1, round(share * (t + 1)))).all()
    if 0.1 < share < 1:  # drawn per head: the heads differ somewhere
        assert not torch.equal(blocks[0], blocks[1]) or not torch.equal(blocks[1], blocks[2])
    with pytest.raises(ValueError, match="density"):
        density.random_block_layout(seq, 1, 64, 0.0)


def test_density_bench_runs_on_cpu_and_reads_its_criteria(tmp_path, monkeypatch):
    out = tmp_path / "d.json"
    flags = record_complete_flags(monkeypatch, density)
    args = ["--device", "cpu", "--seq", "256", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16",
            "--dtype", "fp32", "--block-size", "32", "--densities", "1", "0.5", "--tiles", "32,32,4,1", "--triton", "32,32,4,1", "--out", str(out)]
    assert density.main(args) == 0
    # written after every row, and marked complete only by the last write
    assert len(flags) > 2 and flags == [False] * (len(flags) - 1) + [True]
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["results"]}
    configs = ("flex", "flex[32,32,4,1]", "triton[32,32,4,1]")
    assert set(rows) == {"sdpa_math", *(f"{c}@{d}" for c in configs for d in ("1", "0.5"))}
    assert all(r["error"] is None for r in rows.values())
    for label in configs:
        full, half = rows[f"{label}@1"], rows[f"{label}@0.5"]
        assert full["realised_density"] == 1.0 and 0.45 < half["realised_density"] < 0.6
        assert half["ratio_vs_full"] == pytest.approx(half["ms"] / full["ms"])
        assert full["ratio_vs_cudnn"] == pytest.approx(full["ms"] / rows["sdpa_math"]["ms"])
    best = min(configs, key=lambda c: rows[f"{c}@1"]["ms"])
    expected = [rows[f"{best}@0.5"]["ms"] / rows[f"{best}@1"]["ms"], rows[f"{best}@1"]["ms"] / rows["sdpa_math"]["ms"]]
    assert [c["config"] for c in data["criteria"]] == [best, best]
    assert [c["value"] for c in data["criteria"]] == pytest.approx(expected)
    assert [c["met"] for c in data["criteria"]] == [v <= lim for v, lim in zip(expected, (0.6, 1.25))]
    assert (tmp_path / "d.png").stat().st_size > 0
    assert density.main(args) == 2  # not replaced without --overwrite


def test_flex_rows_pin_flexattention_and_triton_rows_the_kernel():
    """Under ``sparse_kernel: auto`` a tile row without the pin would time the Triton kernel on a GPU
    under FlexAttention's name (it did in the first density run through the Triton kernel, on an H200 on
    2026-12-02 at commit 652f859)."""
    args = density.parse_args(["--out", "x", "--tiles", "128,128,8,2", "--triton", "128,128,8,3"])
    configs = dict(density._configs(args))
    assert configs["flex"]["sparse_kernel"] == configs["flex[128,128,8,2]"]["sparse_kernel"] == "flex"
    assert configs["flex[128,128,8,2]"]["kernel_options"]["num_stages"] == 2
    assert configs["triton[128,128,8,3]"] == {"sparse_kernel": "triton", "sparse_kernel_tiles": [128, 128, 8, 3]}


def test_density_one_is_required():
    with pytest.raises(SystemExit):
        density.parse_args(["--out", "x", "--densities", "0.5"])


def test_each_layout_is_converted_once_outside_the_timed_calls(tmp_path, monkeypatch):
    """The ratios are the kernel's (cuDNN's baseline has nothing to convert): FlexAttention's
    BlockMask of each layout is built once, not once per timed call."""
    import elasticfw_plugins.executors.flex as flex

    conversions = []
    real = flex.to_block_mask

    def counting(*a, **k):
        conversions.append(1)
        return real(*a, **k)

    monkeypatch.setattr(flex, "to_block_mask", counting)
    out = tmp_path / "d.json"
    assert density.main(["--device", "cpu", "--seq", "128", "--q-heads", "2", "--kv-heads", "1", "--head-dim", "16",
                         "--dtype", "fp32", "--block-size", "32", "--densities", "1", "0.5", "--cpu-warmup", "1",
                         "--cpu-iters", "3", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["failures"] == []
    assert len(conversions) == 2  # one per layout (densities 1 and 0.5) of the one configuration


def test_cpu_timing_is_the_median_of_its_samples(monkeypatch):
    from types import SimpleNamespace

    from elasticfw.bench import timing

    samples = iter([0.0, 1e-3, 0.0, 2e-3, 0.0, 3e-3, 0.0, 10e-3])  # perf_counter: start, end per call
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(samples))
    args = SimpleNamespace(cpu_warmup=0, cpu_iters=4)
    assert timing.time_ms(lambda: None, torch.device("cpu"), args) == pytest.approx(2.5)  # (2 + 3) / 2


def test_cuda_timing_asks_do_bench_for_at_least_min_samples(monkeypatch):
    """do_bench runs ``rep / estimate`` samples: a 255 ms call under a 300 ms budget was one sample.
    The budget is raised to MIN_SAMPLES calls of the estimate (one timed call)."""
    import sys
    import types

    from elasticfw.bench import timing

    asked = {}

    def do_bench(fn, warmup, rep, grad_to_none=None, return_mode="median"):
        asked.update(warmup=warmup, rep=rep)
        return 1.0

    monkeypatch.setitem(sys.modules, "triton.testing", types.SimpleNamespace(do_bench=do_bench))
    monkeypatch.setattr(timing, "sync", lambda device: None)
    clock = iter([0.0, 0.255, 0.0, 0.001])  # a 255 ms call, then a 1 ms one
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    from types import SimpleNamespace

    args = SimpleNamespace(warmup_ms=50, rep_ms=300)
    assert timing.time_ms(lambda: None, torch.device("cuda"), args) == 1.0
    assert asked["rep"] == pytest.approx(timing.MIN_SAMPLES * 255 * 1.1)
    assert timing.time_ms(lambda: None, torch.device("cuda"), args) == 1.0
    assert asked["rep"] == 300  # a fast call: the budget as asked
