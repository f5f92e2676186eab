"""Routers against the paper's formulas and hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import UnsupportedInputError
from elasticfw.eval.task import Sample
from elasticfw.model.elastic import ElasticModel
from elasticfw.recipe import validate_recipe_data
from elasticfw.routing.base import HeadLayout
from elasticfw.routing.gumbel import TemperatureSchedule, gumbel_softmax_sparse_prob, straight_through
from elasticfw.testing.models import tiny_model
from elasticfw_plugins.routers.fixed import FixedConfig, FixedRouter
from elasticfw_plugins.routers.mlp import MLPRouter, MLPRouterConfig, boundary_pool
from elasticfw_plugins.routers.retrieval_score import RetrievalScoreConfig, RetrievalScoreRouter

HEADS = HeadLayout(routed_layers=(0, 1, 2), num_kv_heads=2, num_q_heads=6, head_dim=8)


def test_temperature_schedule_is_the_papers_formula():
    s = TemperatureSchedule(tau_init=1.0, tau_min=0.3, rate=0.6, total_units=10)
    for progress in (0.0, 0.05, 0.1, 0.2, 0.5, 1.0):
        p = progress * 10
        assert s(progress) == pytest.approx(max(0.3, math.exp(-0.6 * p)))
    assert s(1.0) == 0.3


def test_straight_through_is_hard_forward_soft_backward():
    prob = torch.tensor([0.2, 0.7, 0.51], requires_grad=True)
    hard = straight_through(prob)
    assert hard.tolist() == [0.0, 1.0, 1.0]
    hard.sum().backward()
    assert prob.grad.tolist() == [1.0, 1.0, 1.0]


def test_gumbel_softmax_matches_formula_with_fixed_noise():
    logits = torch.tensor([[0.3, -0.2], [1.0, 2.0]])
    g = torch.Generator().manual_seed(0)
    got = gumbel_softmax_sparse_prob(logits, 0.5, noise=True, generator=g)
    g = torch.Generator().manual_seed(0)
    u = torch.rand(logits.shape, generator=g)
    noise = -torch.log(-torch.log(u + 1e-10) + 1e-10)
    expected = torch.softmax((logits + noise) / 0.5, -1)[:, 1]
    assert torch.allclose(got, expected)
    assert torch.allclose(gumbel_softmax_sparse_prob(logits, 0.5, noise=False), torch.softmax(logits, -1)[:, 1])


def test_boundary_pooling_hand_case_excludes_padding():
    keys = torch.arange(10, dtype=torch.float32).view(1, 1, 10, 1).repeat(2, 1, 1, 1)  # key j has value j
    seq = SeqInfo.from_lengths(torch.tensor([10, 7]), 10, 10)
    pooled = boundary_pool(keys, seq, pool_tokens=2)
    # sample 0: first {0,1} and last {8,9}; sample 1 (7 real keys): {0,1} and {5,6}
    assert pooled[0, 0, 0].item() == pytest.approx((0 + 1 + 8 + 9) / 4)
    assert pooled[1, 0, 0].item() == pytest.approx((0 + 1 + 5 + 6) / 4)
    # short sequence: first and last windows overlap -> their union, each token once
    seq3 = SeqInfo.from_lengths(torch.tensor([3, 3]), 10, 10)
    assert boundary_pool(keys, seq3, pool_tokens=2)[0, 0, 0].item() == pytest.approx(1.0)


def test_mlp_router_shapes_parameters_and_inference_determinism():
    router = MLPRouter(MLPRouterConfig(), HeadLayout((0,), 8, 32, 128))
    params = sum(p.numel() for p in router.layers[0].parameters())
    assert 0.25e6 < params < 0.29e6  # paper: about 0.27M per layer at d' = 128
    router = MLPRouter(MLPRouterConfig(pool_tokens=4), HEADS).eval()
    keys = torch.randn(3, 2, 20, 8)
    seq = SeqInfo.dense(3, 20, 20)
    a, b = router.decide(1, keys, seq), router.decide(1, keys, seq)
    assert torch.equal(a.sparse, b.sparse) and set(a.sparse.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(a.sparse, (torch.softmax(a.logits, -1)[..., 1] > 0.5).float())
    router.train()
    c = router.decide(1, keys, seq)
    assert c.sparse.requires_grad and set(c.sparse.detach().unique().tolist()) <= {0.0, 1.0}


def test_mlp_router_ignores_the_middle_of_long_inputs():
    router = MLPRouter(MLPRouterConfig(pool_tokens=4), HEADS).eval()
    keys = torch.randn(1, 2, 50, 8)
    seq = SeqInfo.dense(1, 50, 50)
    base = router.decide(0, keys, seq).logits
    keys2 = keys.clone()
    keys2[:, :, 4:46] = torch.randn(1, 2, 42, 8) * 10
    assert torch.allclose(router.decide(0, keys2, seq).logits, base)


def test_fixed_router_head_list_and_errors():
    router = FixedRouter(FixedConfig(assign="sparse_heads", heads=[(0, 1), (2, 0)]), HEADS)
    d = router.decide(2, torch.zeros(2, 2, 5, 8), SeqInfo.dense(2, 5, 5))
    assert d.sparse.tolist() == [[1.0, 0.0], [1.0, 0.0]]
    inverse = FixedRouter(FixedConfig(assign="retrieval_heads", heads=[(0, 1), (2, 0)]), HEADS)
    assert inverse.decide(0, torch.zeros(1, 2, 5, 8), SeqInfo.dense(1, 5, 5)).sparse.tolist() == [[1.0, 0.0]]
    with pytest.raises(UnsupportedInputError, match=r"heads\[0\] = \(5, 0\)"):
        FixedRouter(FixedConfig(assign="sparse_heads", heads=[(5, 0)]), HEADS)


def test_retrieval_score_ranking_keeps_top_heads():
    router = RetrievalScoreRouter(RetrievalScoreConfig(target_msr=0.5), HEADS)
    scores = torch.tensor([[0.9, 0.1], [0.5, 0.7], [0.0, 0.2]])  # per KV head
    router.set_scores(scores.repeat_interleave(3, dim=1))
    # 6 heads, MSR 0.5 -> keep floor(0.5 * 6) = 3 highest: (0,0) .9, (1,1) .7, (1,0) .5
    assert router.table.tolist() == [[0.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    state = router.extra_state()
    again = RetrievalScoreRouter(RetrievalScoreConfig(target_msr=0.5), HEADS)
    again.load_extra_state(state)
    assert torch.equal(again.table, router.table)


def test_retrieval_score_measure_equals_eager_attention_mass():
    """Eq. 9 against transformers' own eager attention weights of the unmodified model."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    probes = [Sample(torch.randint(3, 250, (n,), generator=g).tolist(), "", span) for n, span in ((60, (20, 25)), (45, (5, 9)))]
    expected = torch.zeros(4, 6)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for s in probes:
            att = model(input_ids=torch.tensor([s.input_ids]), output_attentions=True).attentions
            for layer, a in enumerate(att):
                expected[layer] += a[0, :, -1, s.needle_span[0] : s.needle_span[1]].sum(-1) / len(probes)
    model.set_attn_implementation("sdpa")
    section = validate_recipe_data({"elastic": {"router": {"name": "retrieval_score", "target_msr": 0.25}}}).elastic
    elastic = ElasticModel(model, section)
    measured = elastic.router.measure(elastic, probes)
    assert torch.allclose(measured, expected, atol=1e-5)
    elastic.router.set_scores(measured)
    assert elastic.router.table.sum().item() == 8 - math.floor(0.75 * 8)


def test_boundary_pooling_fast_path_equals_definition():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 50, 4, generator=g)
    fast = boundary_pool(keys, SeqInfo.dense(2, 50, 50), pool_tokens=8)  # no padding: slice path
    expected = torch.cat([keys[:, :, :8], keys[:, :, -8:]], dim=2).mean(2)
    assert torch.allclose(fast, expected, atol=1e-6)
    # the same sequences seen through the padded (gather) path
    padded = torch.cat([keys, torch.full((2, 3, 7, 4), 1e4)], dim=2)
    slow = boundary_pool(padded, SeqInfo.from_lengths(torch.tensor([50, 50]), 57, 57), pool_tokens=8)
    assert torch.allclose(slow, expected, atol=1e-5)


def test_mlp_router_tie_goes_to_the_retrieval_mode_and_bf16_keys_pool_in_float32():
    router = MLPRouter(MLPRouterConfig(pool_tokens=4), HEADS).eval()
    last = router.layers[1].router_mlp[-1]
    with torch.no_grad():  # equal logits for every input: P(sparse) = 0.5 exactly
        last.weight.zero_()
        last.bias.zero_()
    keys = torch.randn(2, 2, 20, 8)
    d = router.decide(1, keys, SeqInfo.dense(2, 20, 20))
    assert torch.equal(d.prob_sparse, torch.full((2, 2), 0.5)) and torch.equal(d.sparse, torch.zeros(2, 2))
    # bf16 keys: pooled sums accumulate in float32 (the definition, computed from float32 keys)
    k16 = (torch.randn(1, 2, 4000, 8) * 3 + 1).to(torch.bfloat16)
    got = boundary_pool(k16, SeqInfo.dense(1, 4000, 4000), pool_tokens=100)
    want = torch.cat([k16[:, :, :100], k16[:, :, -100:]], dim=2).float().mean(2)
    assert torch.allclose(got, want, atol=1e-5)


def test_seqinfo_keys_unpadded_reads_the_lengths_or_trusts_the_caller():
    assert SeqInfo.from_lengths(torch.tensor([5, 5]), 5, 5).keys_unpadded()
    assert not SeqInfo.from_lengths(torch.tensor([5, 4]), 4, 5).keys_unpadded()
    assert not SeqInfo.from_lengths(torch.tensor([5, 5]), 5, 6).keys_unpadded()  # capacity beyond every sample
    assert SeqInfo.dense(2, 3, 7).keys_unpadded()
    # a caller that knows says so, and is believed without a device read (meta tensors cannot be read)
    meta = torch.zeros(1, dtype=torch.long, device="meta")
    assert SeqInfo.trusted(meta, meta, 3, 7, keys_unpadded=True).keys_unpadded()
    with pytest.raises(RuntimeError):
        SeqInfo.trusted(meta, meta, 3, 7).keys_unpadded()


def test_boundary_pooling_fast_path_reads_strided_keys():
    """Keys as transformers often hand them over: a (B, S, H, D) tensor seen as (B, H, S, D), and an
    offset slice of a larger buffer. The fast path's strided view must follow their strides."""
    g = torch.Generator().manual_seed(1)
    buf = torch.randn(2, 70, 3, 4, generator=g)
    for keys in (buf.transpose(1, 2), buf.transpose(1, 2)[:, 1:, 5:55]):
        sk = keys.shape[2]
        got = boundary_pool(keys, SeqInfo.dense(2, sk, sk), pool_tokens=8)
        want = torch.cat([keys[:, :, :8], keys[:, :, -8:]], dim=2).mean(2)
        assert torch.allclose(got, want, atol=1e-6)


def test_mlp_router_refuses_keys_and_layers_it_was_not_built_for():
    """A head dim other than the backbone's (the fused kernel's error advised kernel: auto, whose
    eager path then raised torch's matmul error), keys not 4-D, and a layer position outside the
    routed layers (-1 used to be the last one) are named errors."""
    for kernel in ("auto", "eager"):
        router = MLPRouter(MLPRouterConfig(pool_tokens=4, kernel=kernel), HeadLayout((0, 1), 2, 4, 16)).eval()
        seq = SeqInfo.dense(1, 8, 8)
        with torch.no_grad():
            assert router.decide(1, torch.randn(1, 2, 8, 16), seq).sparse.shape == (1, 2)
            with pytest.raises(UnsupportedInputError, match="head dim 16"):
                router.decide(0, torch.randn(1, 2, 8, 32), seq)
            with pytest.raises(UnsupportedInputError, match=r"shape \(2, 8, 16\)"):
                router.decide(0, torch.randn(2, 8, 16), seq)
            for layer in (-1, 2):
                with pytest.raises(UnsupportedInputError, match=f"layer {layer} is not"):
                    router.decide(layer, torch.randn(1, 2, 8, 16), seq)
