"""Model-level paths checked against answers built without elasticfw's own code.

The other model-level tests compare elasticfw with itself (full routing vs the unmodified model,
batched vs one by one, cached vs uncached), so a bug that every path shares survives them. Here:

* every attention layer of every tiny backbone family, under a fixed *mixed* routing (some KV
  heads streaming, some full, layers with both, one layer all streaming and one all full), must
  output exactly plain SDPA with a hand-built boolean mask (causal, padding, the backbone's
  sliding window, and for the query heads of streaming KV heads the sink + local window at the
  mode's block or token granularity, in each sample's own token positions), on the ``reference``,
  ``sdpa``, (emulated) ``flex`` and ``split`` executors; negative controls show that swapping the sparse and
  full heads, or mapping query heads to the wrong GQA group, fails that comparison;
* the training mix ``O = r O_sparse + (1 - r) O_retrieval`` and its gradient ``dO/dr =
  O_sparse - O_retrieval``, per family, through the whole model with padding;
* boundary pooling (the MLP router's input) with asymmetric random keys on sequences shorter
  than twice the pool, by hand and through the model's canonicalisation;
* the conformance suite on the built-in variants the registry-driven run does not cover:
  streaming at its default (block) granularity and NSA with its compression branch on.

q, k and v are recorded where transformers hands them to elasticfw's attention function
(before elasticfw rolls padded samples into its canonical coordinates); the layer output is
recorded at the input of ``o_proj``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from mode_definitions.nsa import DEFINITION as NSA_DEFINITION

import elasticfw.attention.layout as layout_module
from elasticfw.attention.seq import SeqInfo
from elasticfw.model.elastic import ElasticModel
from elasticfw.recipe import validate_recipe_data
from elasticfw.routing.base import RouterDecision
from elasticfw.testing import models
from elasticfw.testing.models import FAMILIES, tiny_model
from elasticfw.testing.modes import ModeConformance
from elasticfw_plugins.routers.mlp import boundary_pool

TOL = 1e-5  # float32, absolute; layer outputs are O(0.1)

#: (layer, KV head) pairs on the streaming mode: layers 0 and 1 mixed (different heads), layer 2
#: all streaming, layer 3 all full -- the one-launch path and both single-mode paths
HEADS = [(0, 1), (1, 0), (2, 0), (2, 1)]

#: streaming configs that really mask at ~40-70 tokens
STREAMING = {
    "block": {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16, "granularity": "block"},
    "token": {"name": "streaming", "sink_tokens": 5, "local_tokens": 11, "block_size": 16, "granularity": "token"},
}
EXECUTORS = {
    "reference": {"name": "reference"},
    "sdpa": {"name": "sdpa"},
    "flex": {"name": "flex", "implementation": "emulated"},
    "split": {"name": "split"},  # on a CPU: dense SDPA for full heads, gathered SDPA for the others
}

#: id -> (family, config overrides, route sliding-window layers, streaming heads)
CASES: dict[str, tuple[str, dict[str, Any], bool, list[tuple[int, int]]]] = {
    "llama": ("llama", {}, False, HEADS),
    "qwen2": ("qwen2", {}, False, HEADS),
    "qwen3": ("qwen3", {}, False, HEADS),
    "mistral": ("mistral", {}, False, HEADS),
    # gemma3: sliding layers 0 and 2 routed (window AND streaming); a non-default attention scale
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 37}, True, HEADS),
    # gemma3 with its sliding layers native (not routed): only layers 1 and 3 are routed
    "gemma3-native": ("gemma3", {"query_pre_attn_scalar": 37}, False, [(1, 0)]),
    # mistral with a model-wide sliding window, every layer routed
    "mistral-window": ("mistral", {"sliding_window": 40}, True, HEADS),
}
assert {family for family, *_ in CASES.values()} == set(FAMILIES), "a tiny family has no case here"


# -- building the model and recording its layers --------------------------------------------------


def make_elastic(case: str, granularity: str, executor: str, router: dict | None = None) -> ElasticModel:
    family, overrides, route_sliding, heads = CASES[case]
    elastic = validate_recipe_data({"elastic": {
        "retrieval_mode": {"name": "full", "block_size": 16},
        "sparse_mode": STREAMING[granularity],
        "executor": EXECUTORS[executor],
        "router": router or {"name": "fixed", "assign": "sparse_heads", "heads": [list(h) for h in heads]},
        "route_sliding_window_layers": route_sliding,
    }}).elastic
    return ElasticModel(tiny_model(family, **overrides), elastic)


def padded_batch(lengths: list[int], side: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return models.padded_batch(lengths, side=side, seed=seed)

def record(elastic: ElasticModel, ids: torch.Tensor, mask: torch.Tensor) -> dict[int, dict[str, Any]]:
    """Forward, recording per layer the q/k/v/scale transformers passes to elasticfw and the
    attention output arriving at ``o_proj`` (B, S, Hq*D)."""
    seen: dict[int, dict[str, Any]] = {}
    runtime = elastic.runtime
    real_attend = runtime.attend

    def attend(layer_idx, q, k, v, info, *, scale, sliding_window):
        seen.setdefault(layer_idx, {}).update(q=q, k=k, v=v, scale=scale)
        return real_attend(layer_idx, q, k, v, info, scale=scale, sliding_window=sliding_window)

    runtime.attend = attend  # type: ignore[method-assign]
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(lambda m, args, i=i: seen[i].__setitem__("out", args[0]))
        for i, layer in enumerate(elastic.base.model.layers)
    ]
    try:
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        elastic(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        del runtime.attend
    assert sorted(seen) == list(range(len(elastic.base.model.layers)))
    return seen


# -- the independent answer ------------------------------------------------------------------------


def layer_window(config: Any, layer: int) -> int | None:
    """The backbone's sliding window of ``layer``, read from the config (not from elasticfw)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return config.sliding_window if types[layer] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


def expected_scale(config: Any) -> float:
    if config.model_type == "gemma3_text":
        return config.query_pre_attn_scalar**-0.5
    return config.head_dim**-0.5


def hand_masks(mask: torch.Tensor, window: int | None, stream: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, S) bool masks (full, streaming) over transformers' padded indices, from the 2-D
    padding mask alone. Positions are each sample's own token positions (rank among its real
    tokens), so left padding moves no block boundary."""
    real = mask.bool()
    pos = real.long().cumsum(-1) - 1  # position of every real token
    i, j = pos[:, :, None], pos[:, None, :]
    visible = real[:, :, None] & real[:, None, :] & (j <= i)
    if window is not None:
        visible &= (i - j) < window
    sink, local, bs = stream["sink_tokens"], stream["local_tokens"], stream["block_size"]
    if stream["granularity"] == "block":  # whole blocks: sink blocks and the last local/bs blocks
        keep = (j // bs < sink // bs) | (j // bs > i // bs - local // bs)
    else:  # DuoAttention's token window
        keep = (j < sink) | (j > i - local)
    # padding rows see nothing; give them their own key so SDPA stays finite (never compared)
    eye = torch.eye(mask.shape[1], dtype=torch.bool)[None] & ~real[:, :, None]
    return visible | eye, (visible & keep) | eye


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, Hq, S, D) attention with a (B, Hq or 1, S, S) bool mask; K/V repeated per GQA group as
    transformers' ``repeat_kv`` does (query head h reads KV head h // group)."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q.double(), kk.double(), vv.double(), attn_mask=mask, scale=scale)


def layer_errors(elastic: ElasticModel, case: str, stream: dict, seen: dict, mask: torch.Tensor) -> dict[int, float]:
    """Max |elasticfw - independent| over real rows, per layer."""
    _, _, _, heads = CASES[case]
    config = elastic.base.config
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    group = hq // hkv
    errors = {}
    for layer, rec in seen.items():
        scale = expected_scale(config)
        assert rec["scale"] == pytest.approx(scale, rel=1e-6), (layer, rec["scale"], scale)
        full, streaming = hand_masks(mask, layer_window(config, layer), stream)
        sparse_kv = {h for (lay, h) in heads if lay == layer}
        sparse_q = torch.tensor([h // group in sparse_kv for h in range(hq)])
        attn_mask = torch.where(sparse_q[None, :, None, None], streaming[:, None], full[:, None])
        want = sdpa(rec["q"], rec["k"], rec["v"], attn_mask, scale)  # (B, Hq, S, D)
        b, s, _ = rec["out"].shape
        got = rec["out"].detach().view(b, s, hq, -1).transpose(1, 2).double()
        rows = mask.bool()[:, None, :, None].expand_as(got)
        errors[layer] = float((got - want)[rows].abs().max())
    return errors


# -- 1. layer outputs against plain SDPA with hand-built masks ---------------------------------------


#: left padding on every executor, right padding on one (both are canonicalised the same way)
LAYER_RUNS = [(c, e, g, "left") for c in CASES for e in EXECUTORS for g in STREAMING] + [
    (c, "sdpa", g, "right") for c in CASES for g in STREAMING
]


@pytest.mark.parametrize(("case", "executor", "granularity", "side"), LAYER_RUNS, ids=["-".join(run) for run in LAYER_RUNS])
def test_every_layer_equals_sdpa_with_hand_built_masks(case, executor, granularity, side):
    elastic = make_elastic(case, granularity, executor)
    ids, mask = padded_batch([70, 45], side)
    with torch.no_grad():
        seen = record(elastic, ids, mask)
    errors = layer_errors(elastic, case, STREAMING[granularity], seen, mask)
    assert max(errors.values()) < TOL, errors
    # the routing the test asked for is the one reported
    routed = elastic.routing.routed_layers
    heads = CASES[case][3]
    want = torch.tensor([[(layer, h) in heads for h in range(2)] for layer in routed])
    assert torch.equal(elastic.routing.decisions, want[None].expand(2, -1, -1))


@pytest.mark.parametrize("executor", ["split", "sdpa"])
def test_a_model_built_and_run_under_inference_mode_equals_sdpa(executor):
    """Tensors made under ``torch.inference_mode()`` have no version counter (the split executor's
    head-split memo and the routers' host copies once read it and raised): a model built and run
    there, unpadded so that the split executor splits its heads, meets the hand-built masks."""
    ids, mask = padded_batch([70, 70], "left")
    with torch.inference_mode():
        elastic = make_elastic("llama", "block", executor)
        seen = record(elastic, ids, mask)
    errors = layer_errors(elastic, "llama", STREAMING["block"], seen, mask)
    assert max(errors.values()) < TOL, errors


def _control() -> dict[int, float]:
    """Layer errors of llama on sdpa, block granularity, left padding (patched or not)."""
    elastic = make_elastic("llama", "block", "sdpa")
    ids, mask = padded_batch([70, 45], "left")
    with torch.no_grad():
        seen = record(elastic, ids, mask)
    return layer_errors(elastic, "llama", STREAMING["block"], seen, mask)


def test_negative_control_swapped_sparse_and_full_heads_fail(monkeypatch):
    real = layout_module.select_heads  # the one-launch path (attend_routed) combines the layouts there
    monkeypatch.setattr(layout_module, "select_heads", lambda use_first, a, b: real(~use_first, a, b))
    errors = _control()
    # the mixed layers (0 and 1) now run streaming on the full heads and vice versa
    assert errors[0] > 1e-3 and errors[1] > 1e-3, errors
    assert errors[2] < TOL and errors[3] < TOL, errors  # single-mode layers take another path


def test_negative_control_wrong_gqa_group_fails(monkeypatch):
    real = layout_module.select_heads

    def tiled(use_first, a, b):  # query head h -> KV head h % Hkv (repeat) instead of h // group
        batch, hq = use_first.shape
        hkv = 2
        return real(use_first.view(batch, hkv, hq // hkv).transpose(1, 2).reshape(batch, hq), a, b)

    monkeypatch.setattr(layout_module, "select_heads", tiled)
    errors = _control()
    assert errors[0] > 1e-3 and errors[1] > 1e-3, errors


def test_control_without_a_bug_passes():
    assert max(_control().values()) < TOL


# -- 2. the training mix and its gradient, per family -------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_training_mix_and_its_gradient_per_family(case):
    """O = r O_sparse + (1 - r) O_retrieval per KV-head group and dO/dr = O_sparse - O_retrieval,
    both modes built by hand (SDPA + masks), for fractional and hard r, with left padding."""
    elastic = make_elastic(case, "block", "reference", router={"name": "static"}).train()
    assert elastic.runtime.mixing
    routed = elastic.heads.routed_layers
    g = torch.Generator().manual_seed(4)
    rs = [torch.rand(2, 2, generator=g).requires_grad_(True) for _ in routed]
    with torch.no_grad():
        rs[0][0] = torch.tensor([1.0, 0.0])  # a hard decision too
    elastic.router.decide = lambda layer, keys, seq: RouterDecision(rs[layer], rs[layer].detach())  # type: ignore[method-assign]
    ids, mask = padded_batch([66, 41], "left", seed=2)
    seen = record(elastic, ids, mask)
    config = elastic.base.config
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    group = hq // hkv
    rows = mask.bool()[:, None, :, None]
    for n, layer in enumerate(routed):
        rec = seen[layer]
        q, k, v = (rec[x].detach() for x in "qkv")
        full, streaming = hand_masks(mask, layer_window(config, layer), STREAMING["block"])
        o_full = sdpa(q, k, v, full[:, None], expected_scale(config))
        o_stream = sdpa(q, k, v, streaming[:, None], expected_scale(config))
        b, s, _ = rec["out"].shape
        out = rec["out"].view(b, s, hq, -1).transpose(1, 2)  # (B, Hq, S, D), differentiable
        r = rs[n].detach().double().repeat_interleave(group, 1)[:, :, None, None]
        mixed = r * o_stream + (1 - r) * o_full
        assert float((out.detach().double() - mixed).masked_select(rows).abs().max()) < TOL, layer
        grad_out = torch.randn(out.shape, generator=g) * rows
        (got,) = torch.autograd.grad(out, rs[n], grad_out, retain_graph=True)
        per_q_head = (grad_out.double() * (o_stream - o_full)).sum((-1, -2))  # (B, Hq)
        want = per_q_head.view(b, hkv, group).sum(-1)
        assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5), (layer, got, want)


# -- 3. boundary pooling --------------------------------------------------------------------------------


def hand_pool(keys: torch.Tensor, real_idx: list[int], pool: int) -> torch.Tensor:
    """(H, D) mean of the keys at the first ``pool`` and last ``pool`` real indices, each token once."""
    chosen = sorted(set(real_idx[:pool]) | set(real_idx[-pool:]))
    return keys[:, chosen].double().mean(1)


def test_boundary_pool_on_short_sequences_counts_each_token_once():
    g = torch.Generator().manual_seed(0)
    pool, capacity = 8, 21
    lengths = [3, 8, 9, 11, 15, 16, 21]  # < pool, = pool, overlapping windows, exactly 2*pool, none padded
    keys = torch.randn(len(lengths), 2, capacity, 5, generator=g) + torch.linspace(-3, 5, capacity)[:, None]
    for b, n in enumerate(lengths):
        keys[b, :, n:] = 1e4  # padding never enters
    got = boundary_pool(keys, SeqInfo.from_lengths(torch.tensor(lengths), capacity, capacity), pool)
    for b, n in enumerate(lengths):
        assert torch.allclose(got[b].double(), hand_pool(keys[b], list(range(n)), pool), atol=1e-5), (b, n)
    # the no-padding fast path, shorter than twice the pool: the general path is taken
    dense = boundary_pool(keys[:1, :, :11], SeqInfo.dense(1, 11, 11), pool)
    assert torch.allclose(dense[0].double(), hand_pool(keys[0, :, :11], list(range(11)), pool), atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mlp_router_pools_each_samples_real_keys(family, side):
    """The MLP router's logits are its MLPs applied to a hand pooling of the raw keys
    transformers passes in, located through the 2-D padding mask (13 real tokens < 2 x 8)."""
    torch.manual_seed(0)
    pool = 8
    elastic = make_elastic(family, "block", "reference", router={"name": "mlp", "pool_tokens": pool})
    ids, mask = padded_batch([13, 40], side, seed=5)
    with torch.no_grad():
        seen = record(elastic, ids, mask)
        for n, layer in enumerate(elastic.heads.routed_layers):
            k = seen[layer]["k"]
            pooled = torch.stack([
                hand_pool(k[b], mask[b].nonzero().flatten().tolist(), pool) for b in range(k.shape[0])
            ]).float()
            want = elastic.router.layers[n](pooled)
            got = elastic.runtime.decisions[layer].logits
            assert torch.allclose(got, want, atol=1e-5), (layer, got, want)


# -- 4. conformance on the built-in variants the registry-driven run leaves out ------------------------


def streaming_block_reference(q, k, seq, config):
    """Block granularity (the default): query block i sees key blocks [0, sink/bs) and
    (i - local/bs, i], causality inside the diagonal block; positions, not rows."""
    assert config.granularity == "block"
    bs = config.block_size
    p = seq.query_positions()[:, None, :, None]
    j = torch.arange(seq.kv_capacity)[None, None, None, :]
    keep = (j // bs < config.sink_tokens // bs) | (j // bs > p // bs - config.local_tokens // bs)
    return ((j <= p) & keep).expand(q.shape[0], q.shape[1], seq.q_len, seq.kv_capacity)


class TestStreamingBlockGranularity(ModeConformance):
    mode_name = "streaming"
    small_config = {"block_size": 16, "sink_tokens": 32, "local_tokens": 48}  # granularity left at its default
    dense_config = {"block_size": 16, "sink_tokens": 0, "local_tokens": 100000}
    token_causal = True
    token_reference = staticmethod(streaming_block_reference)

    def test_default_granularity_is_block(self):
        assert self.mode().config.granularity == "block"


def nsa_compressed_reference(q, k, v, seq, config):
    """NSA's compression branch by hand: compressed key/value m is the mean of
    ``[m*stride, m*stride + kernel)``; the query at position p sees it iff the window ends at
    or before p and inside the sample (``m*stride + kernel <= min(p + 1, kv_len)``)."""
    kernel, stride = config.compress_kernel, config.compress_stride
    count = (seq.kv_capacity - kernel) // stride + 1 if seq.kv_capacity >= kernel else 0
    ck = torch.stack([k[:, :, m * stride : m * stride + kernel].mean(2) for m in range(count)], 2)
    cv = torch.stack([v[:, :, m * stride : m * stride + kernel].mean(2) for m in range(count)], 2)
    ends = torch.arange(count) * stride + kernel
    p = seq.query_positions()[:, None, :, None]
    visible = (ends[None, None, None, :] <= p + 1) & (ends[None, None, None, :] <= seq.kv_len[:, None, None, None])
    return ck, cv, visible.expand(q.shape[0], q.shape[1], seq.q_len, count)


class TestNSACompressionBranch(ModeConformance):
    mode_name = "nsa"
    small_config = {**NSA_DEFINITION["small_config"], "compression_branch": True}
    dense_config = NSA_DEFINITION["dense_config"]
    token_causal = NSA_DEFINITION["token_causal"]
    token_reference = staticmethod(NSA_DEFINITION["token_reference"])
    side_reference = staticmethod(nsa_compressed_reference)

    def test_compression_branch_is_on(self):
        mode = self.mode()
        q = torch.randn(1, 2, 40, 16)
        assert mode.side_branch(q, q[:, :1], q[:, :1], SeqInfo.dense(1, 40, 40), scale=0.25) is not None


def test_hand_masks_are_not_vacuous():
    """The streaming windows above really drop pairs at these lengths (and differ by granularity)."""
    _, mask = padded_batch([70, 45], "left")
    full, block = hand_masks(mask, None, STREAMING["block"])
    _, token = hand_masks(mask, None, STREAMING["token"])
    assert int((full & ~block).sum()) > 300 and int((full & ~token).sum()) > 1000
    assert not torch.equal(block, token)
    assert math.isclose(expected_scale(tiny_model("gemma3", query_pre_attn_scalar=37).config), 37**-0.5)
