"""Configuration of the trainable routers (static, mlp), checked by hand.

The Gumbel temperature fields keep their documented ranges:
``tau(p) = max(tau_min, tau_init * exp(-tau_rate * p))`` with a decay rate ``tau_rate >= 0`` (a
negative rate would make the temperature grow during training), positive ``tau_init``,
``tau_min`` and ``tau_units``. A recipe outside them is refused at validation, naming the field;
the boundary values are accepted, and a rate of 0 keeps the temperature at ``tau_init``. With two
modes, ``init_sparse_prob`` p starts the static router's gates at the logits (0, log(p / (1 - p))),
so that its first inference decisions have P(sparse) = p."""

from __future__ import annotations

import math

import pytest
import torch

from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import RecipeError
from elasticfw.recipe import validate_recipe_data
from elasticfw.routing.base import HeadLayout
from elasticfw_plugins.routers.mlp import MLPRouter, MLPRouterConfig
from elasticfw_plugins.routers.static import StaticConfig, StaticRouter

ROUTERS = ["static", "mlp"]
HEADS = HeadLayout(routed_layers=(0, 1), num_kv_heads=2, num_q_heads=4, head_dim=8)


def router_recipe(name: str, **fields: float) -> dict:
    return {"elastic": {"router": {"name": name, **fields}}}


@pytest.mark.parametrize("name", ROUTERS)
@pytest.mark.parametrize(("field", "value"), [("tau_rate", -0.1), ("tau_init", 0.0), ("tau_min", 0.0),
                                              ("tau_units", 0.0)])
def test_a_temperature_field_outside_its_range_is_refused(name: str, field: str, value: float) -> None:
    with pytest.raises(RecipeError) as info:
        validate_recipe_data(router_recipe(name, **{field: value}))
    assert "elastic.router" in str(info.value) and field in str(info.value)


@pytest.mark.parametrize("name", ROUTERS)
def test_the_boundary_values_are_accepted(name: str) -> None:
    recipe = validate_recipe_data(router_recipe(name, tau_rate=0.0, tau_init=0.01, tau_min=0.01, tau_units=0.01))
    router = recipe.elastic.router
    assert (router.tau_rate, router.tau_init, router.tau_min, router.tau_units) == (0.0, 0.01, 0.01, 0.01)


@pytest.mark.parametrize(("cls", "config"), [(StaticRouter, StaticConfig(tau_rate=0.0, tau_init=0.8)),
                                             (MLPRouter, MLPRouterConfig(tau_rate=0.0, tau_init=0.8))])
def test_a_zero_decay_rate_keeps_the_initial_temperature(cls, config) -> None:
    # max(0.3, 0.8 * exp(-0 * p)) = 0.8 at every progress
    router = cls(config, HEADS)
    assert [router.schedule(progress) for progress in (0.0, 0.5, 1.0)] == [0.8, 0.8, 0.8]


def test_static_gates_start_at_the_initial_sparse_probability() -> None:
    router = StaticRouter(StaticConfig(init_sparse_prob=0.3), HEADS).eval()
    assert router.logits.shape == (2, 2, 2)
    assert router.logits[..., 0].eq(0).all()
    assert torch.allclose(router.logits[..., 1], torch.full((2, 2), math.log(0.3 / 0.7)))
    keys = torch.zeros(3, 2, 10, 8)
    decision = router.decide(1, keys, SeqInfo.dense(3, 10, 10))
    assert torch.allclose(decision.prob_sparse, torch.full((3, 2), 0.3))
    assert not decision.sparse.any()  # P(sparse) 0.3 < 0.5: retrieval everywhere
