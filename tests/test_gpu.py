"""GPU-only checks (skipped without CUDA): the compiled FlexAttention and split executors inside
elastic models, against the reference executor and the unmodified model; the compact KV cache."""

from __future__ import annotations

import pytest
import torch

from elasticfw.model.elastic import ElasticModel
from elasticfw.recipe import validate_recipe_data
from elasticfw.testing.models import FAMILIES, padded_batch, tiny_model
from elasticfw.testing.modes import rel_rms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODES = {
    "retrieval_mode": {"name": "full", "block_size": 64},
    "sparse_mode": {"name": "streaming", "sink_tokens": 64, "local_tokens": 128, "block_size": 64},
}
MIXED = {"name": "fixed", "assign": "sparse_heads", "heads": [[1, 0], [3, 1], [3, 0]]}


def section(router, executor, sparse=None):
    modes = dict(MODES)
    if sparse is not None:
        modes["sparse_mode"] = sparse
    return validate_recipe_data({"elastic": {**modes, "router": router, "executor": executor}}).elastic


def left_padded(lengths, device):
    return padded_batch(lengths, side="left", seed=0, device=device)

@pytest.mark.parametrize("family", FAMILIES)
def test_flex_full_routing_matches_unmodified_model(family):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(family).cuda()
    ids, mask = left_padded([700, 450], "cuda")
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        elastic = ElasticModel(model, section({"name": "fixed", "assign": "all_retrieval"}, {"name": "flex"}))
        got = elastic(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    real = mask.bool()
    assert rel_rms(got[real], expected[real]) < 1e-4


@pytest.mark.parametrize(
    "sparse",
    [
        None,
        # decode: sparse, so that a cached step selects as the uncached prefill's last row does (their
        # default, decode: full, attends every key in a step, as upstream; tests/test_dense_decode.py)
        {"name": "xattention", "block_size": 64, "stride": 16, "threshold": 0.9, "decode": "sparse"},
        {"name": "moba", "block_size": 64, "moba_block_size": 128, "top_k": 2, "decode": "sparse"},
        {"name": "nsa", "block_size": 64, "top_n": 3, "window": 128, "compression_branch": True},
    ],
    ids=["streaming", "xattention", "moba", "nsa"],
)
def test_flex_mixed_routing_matches_reference_and_generates(sparse):
    outs = {}
    for executor in ("reference", "flex", "split"):
        model = tiny_model("qwen3").cuda()
        elastic = ElasticModel(model, section(MIXED, {"name": executor}, sparse))
        ids, mask = left_padded([640, 333], "cuda")
        with torch.no_grad():
            outs[executor] = elastic(input_ids=ids, attention_mask=mask).logits[mask.bool()]
            kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
            cached = elastic.generate(use_cache=True, **kwargs)
            uncached = elastic.generate(use_cache=False, **kwargs)
        assert torch.equal(cached, uncached), executor
    assert rel_rms(outs["flex"], outs["reference"]) < 1e-4
    assert rel_rms(outs["split"], outs["reference"]) < 1e-4


@pytest.mark.parametrize("router", [{"name": "fixed", "assign": "all_sparse"}, MIXED], ids=["all_streaming", "mixed"])
def test_compact_kv_cache_generates_what_the_full_cache_does(router):
    """Greedy tokens with the compact KV cache (streaming heads keep sink + window) equal those
    of transformers' full dynamic cache on the GPU, left-padded prompts longer than sink + window."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ids, mask = left_padded([700, 300], "cuda")
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    outs = {}
    for kv_cache in ("full", "compact"):
        data = {**MODES, "router": router, "executor": {"name": "sdpa"}, "kv_cache": kv_cache}
        elastic = ElasticModel(tiny_model("llama").cuda(), validate_recipe_data({"elastic": data}).elastic)
        with torch.no_grad():
            outs[kv_cache] = elastic.generate(**kwargs)
    assert torch.equal(outs["full"], outs["compact"])


def test_flex_training_step_bf16():
    model = tiny_model("llama", dtype=torch.bfloat16).cuda()
    elastic = ElasticModel(model, section({"name": "mlp", "pool_tokens": 16}, {"name": "flex"})).train()
    elastic.router.to(torch.float32)
    ids, mask = left_padded([512, 300], "cuda")
    out = elastic(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    (out.loss + elastic.msr().mean()).backward()
    grads = [p.grad for p in elastic.trainable_parameters()]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_split_reuses_one_blockmask_per_forward_and_decodes_without_tile_padding(monkeypatch):
    """Unpadded prompt: the streaming layout is converted once for all layers (compiled flex path),
    the logits equal the reference executor's, and greedy decoding through the split executor's
    decode path (dense heads unmasked, streaming heads gathered) generates what the reference does."""
    import elasticfw_plugins.executors.flex as flex_module

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model("llama").cuda()
    ids = torch.randint(3, 250, (1, 900), generator=torch.Generator().manual_seed(0)).cuda()
    calls = []
    real = flex_module.to_block_mask
    monkeypatch.setattr(flex_module, "to_block_mask", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    outs = {}
    for name in ("reference", "split"):
        elastic = ElasticModel(model, section(MIXED, {"name": name}))
        with torch.no_grad():
            logits = elastic(input_ids=ids).logits
            gen = elastic.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
        elastic.unwrap()
        outs[name] = (logits, gen)
    assert rel_rms(outs["split"][0], outs["reference"][0]) < 1e-3
    assert torch.equal(outs["split"][1], outs["reference"][1])
    assert len(calls) <= 2  # the forward and generate's prefill: one conversion for all routed layers


def test_the_decode_kernel_compiles_a_few_variants_as_its_cache_grows():
    """A decode step's cache and selection tables grow with every step; Triton specialises an integer
    argument on being 1 or a multiple of 16, so without ``do_not_specialize`` on the growing ones the
    kernel compiled again every few hundred keys (7 split-kernel variants over this loop, 2 now:
    Triton's specialisation keys computed on the CPU by a review). The cache's capacity grows with its
    length here, as a growing KV store's does (at a fixed capacity only the group count changes,
    and the old code compiled 2 variants: no failure). The outputs are checked against dense SDPA
    over the same keys (a full selection)."""
    from elasticfw.attention.layout import RowSelection
    from elasticfw.attention.seq import SeqInfo
    from elasticfw.kernels import decode_attention as dec

    def variants(fn):
        return sum(len(cache[0]) for cache in fn.device_caches.values())

    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, dim, cap = 32, 8, 128, 40_960
    k = torch.randn(1, hkv, cap, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, hkv, cap, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    before = variants(dec._decode_split_kernel), variants(dec._merge_kernel)
    for n in range(2048, 40_000, 1_013):
        q = torch.randn(1, hq, 1, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        groups = -(-n // 64)
        sel = RowSelection(torch.ones(1, 1, 1, groups, dtype=torch.bool, device="cuda"), 64, row_block=1)
        capacity = n + 100  # a cache with room for the next steps
        seq = SeqInfo(q_start=torch.tensor([n - 1], device="cuda"), q_len=1,
                      kv_len=torch.tensor([n], device="cuda"), kv_capacity=capacity)
        out, _ = dec.decode_attention(q, k[:, :, :capacity], v[:, :, :capacity], sel, seq, scale=dim**-0.5)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k[:, :, :n].float(), v[:, :, :n].float(), scale=dim**-0.5, enable_gqa=True)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    after = variants(dec._decode_split_kernel), variants(dec._merge_kernel)
    assert after[0] - before[0] <= 2 and after[1] - before[1] <= 2, (before, after)
