"""``decode: full`` (the default of XAttention and MoBA): a call of one query row is full attention.

Upstream, both methods prune the prefill only: XAttention decodes with dense attention
(``flashinfer.single_decode_with_kv_cache``), MoBA's ``moba_layer`` runs FlashAttention whenever the
query is not the whole sequence. Independent definitions here: a plain softmax over every real key
of each sample (float64), and, for a whole model, the unmodified transformers model's decode step
over the very KV cache the elastic prefill wrote. Each test also runs ``decode: sparse`` on the same
inputs and checks that it differs, so the inputs exercise a real choice.
"""

from __future__ import annotations

import copy

import pytest
import torch

from elasticfw.attention.seq import SeqInfo
from elasticfw.model.elastic import ElasticModel
from elasticfw.recipe import validate_recipe_data
from elasticfw.testing.models import padded_batch, tiny_model
from elasticfw.testing.modes import make_inputs, make_mode, reference_executor

SPARSE = {
    "xattention": {"block_size": 16, "stride": 4, "threshold": 0.3},
    "moba": {"block_size": 16, "moba_block_size": 32, "top_k": 2},
}
#: the planning code each mode runs only when it selects (counted to show a dense decode skips it)
PLANNERS = {
    "xattention": ("elasticfw_plugins.modes.xattention", "iter_antidiagonal_mass"),
    "moba": ("elasticfw_plugins.modes.moba", "key_block_means"),
}


def _every_key(q, k, v, seq: SeqInfo, scale: float) -> torch.Tensor:
    """(B, Hq, 1, D): each sample's one query over its real keys ``j < kv_len``, in float64."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(seq.kv_len.tolist()):
        keys = k[b, :, :n].double().repeat_interleave(group, 0)
        values = v[b, :, :n].double().repeat_interleave(group, 0)
        probs = torch.softmax(q[b].double() @ keys.transpose(-1, -2) * scale, -1)
        out[b] = probs @ values
    return out


@pytest.mark.parametrize("name", list(SPARSE))
def test_a_decode_step_is_full_attention_and_skips_planning(name, monkeypatch):
    import importlib

    q, k, v, _ = make_inputs((2, 4, 2, 1, 150, 16), seed=4)
    seq = SeqInfo(torch.tensor([149, 96]), torch.tensor([150, 97]), 1, 150)  # padded decode step
    full, sparse = make_mode(name, SPARSE[name]), make_mode(name, {**SPARSE[name], "decode": "sparse"})
    assert full.config.decode == "full"  # the default
    module, attr = PLANNERS[name]
    planned = []
    real = getattr(importlib.import_module(module), attr)
    monkeypatch.setattr(importlib.import_module(module), attr, lambda *a, **kw: planned.append(1) or real(*a, **kw))
    with torch.no_grad():
        assert full.dense_at(seq) and not sparse.dense_at(seq)
        layout = full.build_layout(q, k, seq)
        assert layout.dense_causal and planned == []
        got = full.attend(q, k, v, seq, reference_executor(), scale=0.25).out
        other = sparse.attend(q, k, v, seq, reference_executor(), scale=0.25).out
    assert planned  # decode: sparse planned
    want = _every_key(q, k, v, seq, 0.25)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert (other.double() - want).abs().max() > 1e-2  # the sparse step really drops keys here


@pytest.mark.parametrize("name", list(SPARSE))
def test_the_policy_changes_one_row_calls_only(name):
    """Prefill and a chunk of several rows: the same layout under either policy, not dense."""
    full, sparse = make_mode(name, SPARSE[name]), make_mode(name, {**SPARSE[name], "decode": "sparse"})
    q, k, _, seq = make_inputs((2, 4, 2, 150, 150, 16), kv_lens=[150, 97], seed=5)
    chunk = SeqInfo(torch.tensor([110, 57]), torch.tensor([150, 97]), 40, 150)
    for query, s in ((q, seq), (q[:, :, 110:], chunk)):
        with torch.no_grad():
            a, b = full.build_layout(query, k, s), sparse.build_layout(query, k, s)
        assert not full.dense_at(s) and not a.dense_causal
        assert torch.equal(a.blocks, b.blocks)
        if a.row_selection is not None:
            assert torch.equal(a.row_selection.selected, b.row_selection.selected)


def _elastic(sparse_mode: dict) -> ElasticModel:
    section = {"retrieval_mode": {"name": "full", "block_size": 16}, "sparse_mode": sparse_mode,
               "router": {"name": "fixed", "assign": "all_sparse"}}
    return ElasticModel(tiny_model("llama"), validate_recipe_data({"elastic": section}).elastic)


@pytest.mark.parametrize("name", list(SPARSE))
def test_a_model_decode_step_is_the_plain_models_over_the_same_cache(name):
    """Every head sparse (XAttention or MoBA): after a left-padded elastic prefill, the elastic
    decode step's logits equal the unmodified model's decode step over a copy of the same cache;
    ``decode: sparse`` gives other logits."""
    ids, mask = padded_batch([70, 41], side="left", seed=7)
    token = torch.tensor([[17], [29]])
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    logits = {}
    for policy in ("full", "sparse"):
        elastic = _elastic({"name": name, **SPARSE[name], "decode": policy})
        with torch.no_grad():
            cache = elastic(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
            snapshot = copy.deepcopy(cache)
            logits[policy] = elastic(input_ids=token, attention_mask=mask2, cache=cache, use_cache=True).logits
            plain = tiny_model("llama")  # the same weights, transformers' own attention
            want = plain(input_ids=token, attention_mask=mask2, cache=snapshot, use_cache=True).logits
        logits[f"plain-{policy}"] = want
    torch.testing.assert_close(logits["full"], logits["plain-full"], rtol=1e-4, atol=1e-5)
    assert (logits["sparse"] - logits["plain-sparse"]).abs().max() > 1e-3
