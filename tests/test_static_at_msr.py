"""scripts/static_at_msr.py: which heads a threshold on trained static gates keeps full."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from file_modules import load_script
from safetensors.torch import save_file


def tool():
    return load_script("static_at_msr")


def adapter(tmp_path: Path, p_sparse: list[list[float]], router: str = "static", layers=(2, 5)) -> Path:
    prob = torch.tensor(p_sparse)
    logits = torch.stack([torch.zeros_like(prob), torch.log(prob / (1 - prob))], dim=-1)  # softmax[..., 1] = p
    save_file({"logits": logits}, str(tmp_path / "elastic_adapter.safetensors"))
    config = {"routed_layers": list(layers), "elastic": {"router": {"name": router}}}
    (tmp_path / "elastic_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_least_sparse_gates_stay_full(tmp_path):
    # layers 2 and 5 (routed), 3 KV heads; P(sparse) by hand
    path = adapter(tmp_path, [[0.9, 0.2, 0.6], [0.55, 0.95, 0.1]])
    heads, msr = tool().full_heads(path, 0.5)  # 3 of 6 full: P 0.1, 0.2, 0.55
    assert heads == [(2, 1), (5, 0), (5, 2)] and msr == pytest.approx(0.5)
    heads, msr = tool().full_heads(path, 0.7)  # round(0.3 * 6) = 2 full
    assert heads == [(2, 1), (5, 2)] and msr == pytest.approx(4 / 6)
    assert tool().full_heads(path, 1.0) == ([], 1.0)


def test_only_a_static_adapter(tmp_path):
    with pytest.raises(SystemExit, match="expected a static adapter"):
        tool().full_heads(adapter(tmp_path, [[0.5]], router="mlp", layers=(0,)), 0.5)
