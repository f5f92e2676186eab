"""The attention benchmark's K-way layer (``--mix``) on the CPU: its rows, its check against each
group's heads run alone, and its argument errors."""

from __future__ import annotations

import json

import pytest
import torch

from elasticfw.bench import attention as bench
from elasticfw.bench.attention_mix import mix_groups, mix_index

TINY = ["--device", "cpu", "--q-heads", "8", "--kv-heads", "4", "--head-dim", "16", "--dtype", "fp32",
        "--cpu-warmup", "0", "--cpu-iters", "1", "--check-seq", "0", "--no-hybrid"]
STREAM = ["--set", "streaming.sink_tokens=16", "--set", "streaming.local_tokens=32", "--set", "streaming.block_size=16",
          "--set", "xattention.block_size=16", "--set", "xattention.stride=4"]


def test_mix_index_assigns_kv_heads_in_order():
    groups = mix_groups(["full=1", "xattention=1", "streaming=2"], 4)
    assert groups == [("full", 1), ("xattention", 1), ("streaming", 2)]
    index = mix_index(groups, 2, 8, 4, torch.device("cpu"))
    # two query heads per KV head: KV heads 0 | 1 | 2, 3
    assert index.tolist() == [[0, 0, 1, 1, 2, 2, 2, 2]] * 2


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["full=1", "streaming=2"], "sum to 3 KV heads, --kv-heads is 4"),
        (["full=4"], "at least two modes"),
        (["full=2", "full=2"], "twice"),
        (["full=x", "streaming=3"], "MODE=KV_HEADS"),
        (["full=0", "streaming=4"], "positive count"),
    ],
)
def test_mix_groups_refuse_bad_counts(items, message):
    with pytest.raises(SystemExit, match=message):
        mix_groups(items, 4)


def test_three_way_layer_rows_on_cpu(tmp_path):
    out = tmp_path / "mix.json"
    rc = bench.main([*TINY, *STREAM, "--seq", "128", "--modes", "full", "xattention", "streaming",
                     "--executors", "flex", "split", "--mix", "full=1", "xattention=1", "streaming=2",
                     "--no-backward", "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0, data["failures"]
    rows = {r["name"]: r for r in data["results"]}
    label = "mix(full=1/4,xattention=1/4,streaming=2/4)"
    check = rows[f"check:split:{label}"]
    # every group's heads equal that mode run alone on them through the reference executor
    assert check["error"] is None and set(check["out_rel_rms"]) == {"full", "xattention", "streaming"}
    assert all(e < check["tolerance"] for e in check["out_rel_rms"].values())
    parts = [rows[f"split:mix-part:{m}"] for m in ("full", "xattention", "streaming")]
    assert [p["kv_heads"] for p in parts] == [1, 1, 2]
    mixed = rows[f"split:{label}"]
    assert mixed["parts_ms_sum"] == pytest.approx(sum(p["ms"] for p in parts))
    assert mixed["ratio_vs_parts"] == pytest.approx(mixed["ms"] / mixed["parts_ms_sum"])
    assert mixed["kv_heads"] == {"full": 1, "xattention": 1, "streaming": 2}


def test_mix_check_fails_when_a_group_is_computed_in_the_wrong_mode(tmp_path, monkeypatch):
    """The check compares with each group run alone: a mixed call that runs the streaming heads
    densely is caught (the row records the error and the run exits 1)."""
    from elasticfw.bench import attention_mix

    real = attention_mix.attend_modes

    def wrong(q, k, v, seq, executor, *, modes, index, layouts, scale, index_host=None):
        return real(q, k, v, seq, executor, modes=modes, index=torch.zeros_like(index), layouts=layouts,
                    scale=scale, index_host=torch.zeros_like(index_host))

    monkeypatch.setattr(attention_mix, "attend_modes", wrong)
    out = tmp_path / "mix.json"
    rc = bench.main([*TINY, *STREAM, "--seq", "128", "--modes", "full", "streaming", "--executors", "flex", "split",
                     "--mix", "full=2", "streaming=2", "--no-backward", "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == 1
    check = next(r for r in data["results"] if r["name"].startswith("check:split:mix("))
    assert "streaming heads rel RMS" in check["error"] and "full heads" not in check["error"]
