"""``scripts/router_timing.py``: the mlp router's time per layer split into its host code, Triton's
launch and the kernel (run on a GPU by a session; here on the CPU under Triton's interpreter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from file_modules import load_script

from elasticfw.kernels import triton_unavailable

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

pytestmark = pytest.mark.skipif(
    triton_unavailable(torch.device("cpu")) is not None, reason="needs Triton's interpreter"
)


def _tool(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # as when run as a script: it imports decode_host_timing
    tool = load_script("router_timing")
    return tool


def test_router_timing_runs_every_piece_through_the_kernel(tmp_path, monkeypatch):
    """Every piece runs (the kernel under the interpreter), one row of per-layer microseconds each;
    without CUDA the graph replay says why it has no figure."""
    tool = _tool(monkeypatch)
    out = tmp_path / "router.json"
    args = ["--device", "cpu", "--layers", "2", "--tokens", "256", "--blocks", "1", "--warmup", "0"]
    assert tool.main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["us"]) == {"router.decide", "fused_decide", "kernel launch", "torch.empty x2"}
    for row in report["us"].values():
        assert 0 < row["host_us_min"] <= row["host_us"] <= row["with_gpu_us"]
    assert report["layers"] == 2 and report["tokens"] == 256 and report["no_launch"] is False
    assert report["gpu_us_per_layer"] == "not a CUDA device"
    assert report["environment"]["device"] == "cpu"


def test_router_timing_no_launch_reaches_no_kernel_and_restores_it(tmp_path, monkeypatch):
    """``--no-launch`` times the host code with the launch a no-op (no Triton run at all), and the real
    kernel is back afterwards, also when a piece raises."""
    from elasticfw_plugins.routers import mlp_fused

    tool = _tool(monkeypatch)
    real = mlp_fused.mlp_router_kernel
    launched = []
    monkeypatch.setattr(type(real), "run", lambda self, *a, **kw: launched.append(self))
    args = ["--device", "cpu", "--layers", "3", "--tokens", "512", "--blocks", "3", "--warmup", "1", "--no-launch"]
    out = tmp_path / "router.json"
    assert tool.main([*args, "--cprofile", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["no_launch"] is True and launched == [] and "gpu_us_per_layer" not in report
    assert "decide" in report["cprofile"]
    assert mlp_fused.mlp_router_kernel is real
    monkeypatch.setattr(tool, "_run", lambda *a: (_ for _ in ()).throw(RuntimeError("piece failed")))
    with pytest.raises(RuntimeError, match="piece failed"):
        tool.main(args)
    assert mlp_fused.mlp_router_kernel is real
