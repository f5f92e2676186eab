"""Routers among K >= 3 modes (``elastic.modes``): decisions, straight-through gradients, refusals.

Independent definitions: the Gumbel-softmax formula written out (its gradient is what the
straight-through one-hot must pass back), hand-computed initial probabilities, and the two-mode
decision (``sparse``) that a K = 2 one-hot must equal.
"""

from __future__ import annotations

import math

import pytest
import torch

from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError, UnsupportedInputError
from elasticfw.routing.base import HeadLayout, RouterDecision
from elasticfw.routing.gumbel import sample_noise, straight_through_one_hot
from elasticfw_plugins.routers.fixed import FixedConfig, FixedRouter
from elasticfw_plugins.routers.mlp import MLPRouter, MLPRouterConfig
from elasticfw_plugins.routers.retrieval_score import RetrievalScoreConfig, RetrievalScoreRouter
from elasticfw_plugins.routers.static import StaticConfig, StaticRouter

HEADS3 = HeadLayout(routed_layers=(0, 2), num_kv_heads=2, num_q_heads=4, head_dim=8, num_modes=3)


def keys_and_seq(batch: int = 3, length: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, 2, length, 8, generator=g)
    return keys, SeqInfo.from_lengths(torch.tensor([length, length - 5, 9][:batch]), length, length)


def test_straight_through_one_hot_is_the_arg_max_forward_and_the_soft_gradient_backward():
    probs = torch.tensor([[0.2, 0.5, 0.3], [0.4, 0.4, 0.2]], requires_grad=True)
    hard = straight_through_one_hot(probs)
    assert hard.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]  # a tie goes to the lower mode
    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    (hard * w).sum().backward()
    assert torch.equal(probs.grad, w)


@pytest.mark.parametrize("router_cls,config", [(MLPRouter, MLPRouterConfig(pool_tokens=4)),
                                               (StaticRouter, StaticConfig())])
def test_every_modes_logit_gets_the_gumbel_softmax_gradient(router_cls, config):
    """The straight-through one-hot passes back the gradient of softmax((z + g) / tau), so every
    mode's logit (and, for the mlp router, every output row of its last layer) gets a gradient."""
    torch.manual_seed(0)
    router = router_cls(config, HEADS3).train()
    router.set_progress(0.3)
    keys, seq = keys_and_seq()
    noise = sample_noise([5, 6, 7], 2, 2, modes=3)
    router.set_noise(noise)
    decision = router.decide(1, keys, seq)
    assert decision.num_modes == 3 and decision.modes.shape == (3, 2, 3)
    assert torch.equal(decision.modes.sum(-1), torch.ones(3, 2))  # exact one-hot rows
    assert set(decision.modes.unique().tolist()) <= {0.0, 1.0}
    w = torch.randn(3, 2, 3, generator=torch.Generator().manual_seed(1))
    logits = decision.logits
    logits.retain_grad()
    (decision.modes * w).sum().backward()
    # independent: the relaxed probabilities written out, differentiated by autograd
    z = logits.detach().clone().requires_grad_(True)
    tau = router.schedule(0.3)
    (torch.softmax((z + noise[:, 1]) / tau, -1) * w).sum().backward()
    assert torch.allclose(logits.grad, z.grad, atol=1e-6, rtol=1e-5)
    assert (z.grad.abs().sum((0, 1)) > 1e-6).all()  # each mode's logit
    if router_cls is MLPRouter:
        last = router.layers[1].router_mlp[-1]
        assert (last.bias.grad.abs() > 1e-6).all() and (last.weight.grad.abs().sum(1) > 1e-6).all()
        assert router.layers[0].router_mlp[-1].bias.grad is None  # another layer's router: untouched
    else:
        assert (router.logits.grad[1].abs().sum(0) > 1e-6).all() and router.logits.grad[0].abs().sum() == 0


@pytest.mark.parametrize("router_cls,config", [(MLPRouter, MLPRouterConfig(pool_tokens=4, init_sparse_prob=0.4)),
                                               (StaticRouter, StaticConfig(init_sparse_prob=0.4))])
def test_initial_probabilities_give_mode_0_one_minus_p_and_share_p(router_cls, config):
    torch.manual_seed(0)
    router = router_cls(config, HEADS3).eval()
    if router_cls is MLPRouter:
        for layer in router.layers:
            torch.nn.init.zeros_(layer.router_mlp[-1].weight)  # the bias alone
    keys, seq = keys_and_seq()
    probs = router.decide(0, keys, seq).probs
    assert torch.allclose(probs, torch.tensor([0.6, 0.2, 0.2]).expand(3, 2, 3), atol=1e-6)


def test_inference_is_the_arg_max_without_noise_and_sparse_is_not_mode_0():
    router = StaticRouter(StaticConfig(), HEADS3).eval()
    with torch.no_grad():
        router.logits[0] = torch.tensor([[0.0, 1.0, 0.5], [2.0, 1.0, 0.0]])
        router.logits[1] = torch.tensor([[0.0, 0.0, 3.0], [1.0, 1.0, 0.0]])  # a tie: the lower mode
    keys, seq = keys_and_seq()
    for layer, want in ((0, [1, 0]), (1, [2, 0])):
        d = router.decide(layer, keys, seq)
        assert d.index().tolist() == [want] * 3
        assert d.sparse.tolist() == [[float(i != 0) for i in want]] * 3
        probs = torch.softmax(router.logits[layer].detach(), -1)
        assert torch.allclose(d.prob_sparse, (1 - probs[:, 0]).expand(3, 2))


def test_a_two_mode_decision_reads_as_a_two_column_one_hot():
    sparse = torch.tensor([[1.0, 0.0], [0.0, 0.0]], requires_grad=True)
    d = RouterDecision(sparse, sparse.detach())
    assert d.num_modes == 2 and d.modes is None
    assert d.one_hot().tolist() == [[[0.0, 1.0], [1.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]]]
    assert d.index().tolist() == [[1, 0], [0, 0]]
    d.one_hot()[..., 1].sum().backward()  # the one-hot carries the decision's gradient
    assert sparse.grad.tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_two_mode_routers_are_unchanged():
    """K = 2 keeps the paper's parameterisation: two logits, bias [0, log(p / (1 - p))], no one-hot."""
    heads = HeadLayout((0,), 2, 4, 8)
    router = MLPRouter(MLPRouterConfig(pool_tokens=4, init_sparse_prob=0.3), heads).eval()
    last = router.layers[0].router_mlp[-1]
    assert last.out_features == 2 and last.bias.tolist() == pytest.approx([0.0, math.log(0.3 / 0.7)])
    keys, seq = keys_and_seq()
    assert router.decide(0, keys, seq).modes is None
    assert StaticRouter(StaticConfig(), heads).logits.shape == (1, 2, 2)


def test_fixed_router_mode_heads():
    config = FixedConfig(assign="mode_heads", head_modes=[(0, 1, 2), (2, 0, 1)], default_mode=0)
    router = FixedRouter(config, HEADS3)
    keys, seq = keys_and_seq()
    d0, d1 = router.decide(0, keys, seq), router.decide(1, keys, seq)
    assert d0.index().tolist() == [[0, 2]] * 3 and d1.index().tolist() == [[1, 0]] * 3
    assert d0.index_host.tolist() == [[0, 2]] * 3 and d0.index_host.device.type == "cpu"
    assert torch.equal(d0.host, d0.sparse)
    # two modes: mode_heads is a head list of mode 1
    two = FixedRouter(FixedConfig(assign="mode_heads", head_modes=[(2, 1, 1)]), HeadLayout((0, 2), 2, 4, 8))
    assert two.decide(1, keys, seq).sparse.tolist() == [[0.0, 1.0]] * 3 and two.decide(1, keys, seq).modes is None
    everything = FixedRouter(FixedConfig(assign="mode_heads", default_mode=2), HEADS3)
    assert everything.decide(1, keys, seq).index().tolist() == [[2, 2]] * 3


@pytest.mark.parametrize("config,needle", [
    (FixedConfig(assign="mode_heads", head_modes=[(0, 1, 3)]), r"head_modes\[0\] = \(0, 1, 3\).*a mode in \[0, 3\)"),
    (FixedConfig(assign="mode_heads", head_modes=[(1, 0, 1)]), r"head_modes\[0\].*a routed layer in \[0, 2\]"),
    (FixedConfig(assign="mode_heads", default_mode=3), r"default_mode = 3: expected a mode index in \[0, 3\)"),
    (FixedConfig(assign="all_sparse"), "assign = 'all_sparse' names the two-mode split.*mode_heads"),
    (FixedConfig(assign="sparse_heads", heads=[(0, 1)]), "assign = 'sparse_heads' names the two-mode split"),
])
def test_fixed_router_refusals_name_the_field(config, needle):
    with pytest.raises(UnsupportedInputError, match=needle):
        FixedRouter(config, HEADS3)


def test_fixed_config_fields_belong_to_their_assign():
    with pytest.raises(ValueError, match="head_modes and default_mode are only used with assign mode_heads"):
        FixedConfig(assign="all_retrieval", default_mode=1)
    with pytest.raises(ValueError, match="heads is not used with assign mode_heads"):
        FixedConfig(assign="mode_heads", heads=[(0, 1)])


def test_retrieval_score_refuses_more_than_two_modes():
    with pytest.raises(UnsupportedInputError, match="router 'retrieval_score' decides between two modes only.*3"):
        RetrievalScoreRouter(RetrievalScoreConfig(), HEADS3)


def test_the_fused_mlp_kernel_is_refused_for_k_modes_and_auto_runs_eager():
    keys, seq = keys_and_seq()
    with pytest.raises(BackendUnavailableError, match="decides between two modes and elastic.modes has 3"):
        MLPRouter(MLPRouterConfig(pool_tokens=4, kernel="triton"), HEADS3).eval().decide(0, keys, seq)
    assert MLPRouter(MLPRouterConfig(pool_tokens=4), HEADS3).eval().decide(0, keys, seq).num_modes == 3


def test_preset_noise_must_have_k_columns():
    router = StaticRouter(StaticConfig(), HEADS3)
    with pytest.raises(Exception, match=r"router noise must be \(batch, 2, 2, 3\)"):
        router.set_noise(sample_noise([1], 2, 2))
