"""Data parallelism: 2 processes (torchrun, Gloo on the CPU) train like 1 process at the same global
batch, and like 1 process with gradient accumulation."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from elasticfw.training.logs import read_metrics

WORKER = Path(__file__).parent / "ddp_train_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(out: Path, procs: int, micro: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}",
           str(WORKER), str(out), str(micro)] if procs > 1 else [sys.executable, str(WORKER), str(out), str(micro)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_metrics(out / "mlp")


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    one = _run(tmp_path / "one", 1, 4)  # one process, one micro-batch of 4
    acc = _run(tmp_path / "acc", 1, 1)  # one process, 4 accumulated micro-batches of 1
    two = _run(tmp_path / "two", 2, 2)  # two processes, 2 samples each
    assert len(one) == len(two) == len(acc) == 3
    for a, b, c in zip(one, two, acc):
        for key in ("lm_loss", "reg_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6)
            assert c[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6)
        assert b["msr"] == pytest.approx(a["msr"], abs=1e-6) and c["msr"] == pytest.approx(a["msr"], abs=1e-6)
        assert b["lambda1"] == pytest.approx(a["lambda1"], rel=1e-4, abs=1e-7)
        # routing statistics are summed over processes (every diagnostic on, the gradient split too)
        for task, grid in a["p_sparse"].items():
            for want, got in ((grid, b["p_sparse"][task]), (grid, c["p_sparse"][task])):
                assert (want is None) == (got is None)
                if want is not None:
                    assert [x for row in got for x in row] == pytest.approx([x for row in want for x in row], abs=1e-4)
        assert b["margins"]["saturated"] == pytest.approx(a["margins"]["saturated"])
        for group in ("task_mlp", "router_mlp"):
            for part in ("total", "lm", "penalty"):
                assert b["grad_norm_parts"][group][part] == pytest.approx(
                    a["grad_norm_parts"][group][part], rel=1e-3, abs=1e-9), (group, part)
    # only rank 0 wrote the run folder's files
    assert (tmp_path / "two" / "mlp" / "adapter").is_dir()
