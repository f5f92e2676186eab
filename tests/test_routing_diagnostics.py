"""Router training diagnostics and the options that make the router adapt: the input
standardisation's statistics, the margin histogram, P(sparse) per task, the gradient split by loss
term, the logit (margin) term and per-part learning rates, each against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch
from training_helpers import TINY_ELASTIC, ByteTokenizer, tiny_train_recipe, training_registry

from elasticfw.errors import UnsupportedInputError
from elasticfw.model.checkpoint import load_adapter
from elasticfw.model.loading import make_elastic
from elasticfw.recipe import validate_recipe_data
from elasticfw.routing.base import RouterDecision
from elasticfw.testing.models import tiny_model
from elasticfw.training.diagnostics import (
    BINS,
    GradientSplit,
    StepRouting,
    decision_probabilities,
    logit_spread,
    margin_histogram,
    margin_summary,
)
from elasticfw.training.logs import read_metrics
from elasticfw.training.run import build_mixture
from elasticfw.training.trainer import train_router
from elasticfw_plugins.routers.mlp import InputStatistics


@pytest.fixture(scope="module")
def registry():
    return training_registry()


# -- input standardisation -------------------------------------------------------------------------
def test_input_statistics_follow_the_cumulative_then_moving_average():
    stats = InputStatistics(layers=2, heads=3, dim=4, momentum=0.25)  # cumulative for the first 4 samples
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 4, generator=gen) * 3 + 5
    probe = torch.randn(2, 3, 4, generator=gen)
    assert torch.allclose(stats(0, probe), probe, atol=1e-6)  # no update yet: the identity
    stats.update(0, x[:3])
    stats.update(0, x[3:4])  # 4 samples: the plain mean of all of them
    mean, sq = x[:4].mean(0), (x[:4] ** 2).mean(0)
    # then an EMA with weight 1 - 0.75^2 for a batch of two
    w = 1 - 0.75**2
    mean, sq = mean + w * (x[4:].mean(0) - mean), sq + w * ((x[4:] ** 2).mean(0) - sq)
    stats.update(0, x[4:])
    assert torch.allclose(stats.mean[0], mean, atol=1e-5) and torch.allclose(stats.sq[0], sq, atol=1e-4)
    scale = ((sq - mean**2).mean(-1, keepdim=True) + 1e-6).sqrt()  # (H, 1): one scale per head
    assert torch.allclose(stats(0, probe), (probe - mean) / scale, atol=1e-5)
    assert torch.equal(stats.count, torch.tensor([4.0, 0.0]))  # layer 1 untouched
    assert torch.allclose(stats(1, probe), probe, atol=1e-6)


def _tiny(registry, tmp_path, router, **train):
    data = tiny_train_recipe(tmp_path, **train)
    data["elastic"] = {**TINY_ELASTIC, "router": router}
    recipe = validate_recipe_data(data, registry=registry)
    model, tok = tiny_model("llama"), ByteTokenizer()
    mixture = build_mixture(recipe, tok, model, registry)
    return recipe, model, mixture, make_elastic(model, tok, recipe.elastic, registry=registry)


def test_standardised_router_trains_saves_and_reloads_its_statistics(registry, tmp_path):
    router = {"name": "mlp", "pool_tokens": 8, "input_norm": "standardize"}
    recipe, model, mixture, elastic = _tiny(registry, tmp_path, router, steps=2)
    train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    stats = elastic.router.input_stats
    assert float(stats.count.min()) > 0 and float(stats.mean.abs().sum()) > 0  # every layer updated
    ids = torch.tensor([mixture[0].items[0].prompt])
    with torch.no_grad():
        elastic(input_ids=ids)
        want = elastic.routing.prob_sparse.clone()
    kept = {k: v.clone() for k, v in elastic.router.state_dict().items()}
    with torch.no_grad():  # inference does not move the statistics
        elastic(input_ids=ids)
    assert all(torch.equal(v, kept[k]) for k, v in elastic.router.state_dict().items())
    elastic.unwrap()
    loaded = load_adapter(model, tmp_path / "adapter", registry=registry)
    assert torch.equal(loaded.router.input_stats.mean, stats.mean)
    with torch.no_grad():
        loaded(input_ids=ids)
    assert torch.equal(loaded.routing.prob_sparse, want)


def test_standardised_features_are_what_the_task_mlp_reads(registry, tmp_path):
    """The decision equals the MLPs applied by hand to (pooled - mean) / scale."""
    from elasticfw.attention.seq import SeqInfo
    from elasticfw_plugins.routers.mlp import boundary_pool

    router = {"name": "mlp", "pool_tokens": 8, "input_norm": "standardize"}
    _, _, _, elastic = _tiny(registry, tmp_path, router)
    r = elastic.router
    keys = torch.randn(2, r.heads.num_kv_heads, 40, r.heads.head_dim) + 3.0
    seq = SeqInfo.dense(2, 40, 40)
    r.train()
    r.input_stats.update(0, torch.randn(5, r.heads.num_kv_heads, r.heads.head_dim) * 2 + 1)
    r.eval()
    pooled = boundary_pool(keys, seq, 8)
    feats = (pooled - r.input_stats.mean[0]) / r.input_stats.scale(0)
    want = r.layers[0](feats)
    got = r.decide(0, keys, seq).logits
    assert torch.allclose(got, want, atol=1e-5)


# -- margins and P(sparse) per task ----------------------------------------------------------------
def test_margin_summary_hand_values():
    prob = torch.tensor([0.5, 0.52, 0.6, 0.995, 0.001, 0.0, 1.0, 0.3, 0.45, 0.9])
    hist = margin_histogram(prob)
    assert hist.shape == (BINS,) and float(hist.sum()) == 10
    s = margin_summary(hist)
    # margins: 0, .02, .1, .495, .499, .5, .5, .2, .05, .4 -> saturated (> .49): 4; near (< .05): 2
    assert s["saturated"] == pytest.approx(0.4) and s["near_boundary"] == pytest.approx(0.2)
    assert s["p50"] == pytest.approx(0.2, abs=0.006)  # 5th of 10 sorted margins: .2 (bin edge resolution)
    assert margin_summary(torch.zeros(BINS))["p50"] is None


def test_step_routing_means_per_task_and_head():
    acc = StepRouting(tasks=3, layers=2, heads=2, device=torch.device("cpu"))
    a = torch.tensor([[[0.1, 0.9], [0.5, 0.5]], [[0.3, 0.7], [0.0, 1.0]]])
    b = torch.tensor([[[1.0, 1.0], [1.0, 0.0]]])
    acc.add(a, torch.tensor([0, 0]))
    acc.add(b, torch.tensor([2]))
    row = acc.row(["x", "y", "z"])
    assert row["p_sparse"]["x"] == [[0.2, 0.8], [0.25, 0.75]]
    assert row["p_sparse"]["y"] is None and row["p_sparse"]["z"] == [[1.0, 1.0], [1.0, 0.0]]
    assert row["margins"]["saturated"] == pytest.approx(6 / 12)


def test_decision_probabilities_and_logit_spread_from_the_decisions(registry, tmp_path):
    _, _, mixture, elastic = _tiny(registry, tmp_path, {"name": "mlp", "pool_tokens": 8})
    elastic.eval()
    with torch.no_grad():
        elastic(input_ids=torch.tensor([mixture[0].items[0].prompt]))
    prob = decision_probabilities(elastic)
    assert torch.allclose(prob, elastic.routing.prob_sparse.float(), atol=1e-6)
    logits = [elastic.runtime.decisions[i].logits for i in elastic.heads.routed_layers]
    want = torch.stack([(z[..., 1] - z[..., 0]) ** 2 / 4 for z in logits], 1).mean((1, 2))
    assert torch.allclose(logit_spread(elastic), want, atol=1e-6)
    elastic.runtime.decisions[elastic.heads.routed_layers[0]] = RouterDecision(prob[:, 0], prob[:, 0])
    assert logit_spread(elastic) is None  # a router without logits has no such term


# -- the gradient split ----------------------------------------------------------------------------
def test_gradient_split_shares_add_up_and_match_each_term_alone():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    groups = {"a": list(a.parameters()), "b": list(b.parameters())}
    x = torch.randn(4, 3)

    def terms():
        h = a(x)
        return (b(h) ** 2).mean(), h.abs().mean()  # "lm", "penalty" (touches a only)

    split = GradientSplit(groups)
    lm, pen = terms()
    split.add("penalty", pen)
    (lm + pen).backward()
    row = split.row()
    alone = {}
    for name, idx in (("lm", 0), ("penalty", 1)):
        grads = torch.autograd.grad(terms()[idx], [p for ps in groups.values() for p in ps], allow_unused=True)
        flat = dict(zip([id(p) for ps in groups.values() for p in ps], grads))
        alone[name] = {g: math.sqrt(sum(float(flat[id(p)].pow(2).sum()) for p in ps if flat[id(p)] is not None))
                       for g, ps in groups.items()}
    for g in groups:
        assert row[g]["lm"] == pytest.approx(alone["lm"][g], rel=1e-5)
        assert row[g]["penalty"] == pytest.approx(alone["penalty"][g], rel=1e-5, abs=1e-9)
    assert row["b"]["penalty"] == 0.0


def test_training_logs_the_diagnostics_and_applies_lr_scale(registry, tmp_path):
    recipe, _, mixture, elastic = _tiny(
        registry, tmp_path, {"name": "mlp", "pool_tokens": 8}, steps=2, diagnostics_every=2, logit_penalty=0.5,
        lr_scale={"task_mlp": 3.0},
    )
    seen = []
    original = torch.optim.AdamW.step

    def spy(self, *args, **kwargs):
        seen.append({g["name"]: g["lr"] for g in self.param_groups})
        return original(self, *args, **kwargs)

    torch.optim.AdamW.step = spy
    try:
        train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    finally:
        torch.optim.AdamW.step = original
    assert all(lrs["task_mlp"] == pytest.approx(3 * lrs["router_mlp"]) for lrs in seen)
    first, second = read_metrics(tmp_path)
    assert "grad_norm_parts" not in first and set(second["grad_norm_parts"]) == {"task_mlp", "router_mlp"}
    parts = second["grad_norm_parts"]["router_mlp"]
    assert set(parts) == {"total", "lm", "penalty", "logit"} and parts["logit"] > 0
    assert set(second["p_sparse"]) == {"recall", "repeat"} and second["logit_spread"] > 0
    assert 0 <= second["margins"]["saturated"] <= 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    assert {"p_sparse/recall", "p_sparse/repeat"} <= set(board.Tags()["histograms"])
    assert {"margins/saturated", "grad_norm_parts/task_mlp/lm", "lambda1/recall"} <= set(board.Tags()["scalars"])


def test_lr_scale_names_must_be_the_routers_parts(registry, tmp_path):
    recipe, _, mixture, elastic = _tiny(registry, tmp_path, {"name": "mlp", "pool_tokens": 8}, steps=1,
                                        lr_scale={"task": 2.0})
    with pytest.raises(UnsupportedInputError, match=r"train.lr_scale names \['task'\].*\['router_mlp', 'task_mlp'\]"):
        train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    data = tiny_train_recipe(tmp_path, lr_scale={"task_mlp": -1.0})
    with pytest.raises(Exception, match=r"lr_scale.task_mlp must be a positive"):
        validate_recipe_data(data, registry=registry)


# -- elasticfw inspect ------------------------------------------------------------------------------
def test_inspect_reports_each_prompts_own_routing(registry, tmp_path):
    from elasticfw.eval.dataset import samples_from_dataset, task_dataset
    from elasticfw.training.inspect import format_inspection, inspect_adapter

    recipe, model, mixture, elastic = _tiny(registry, tmp_path, {"name": "mlp", "pool_tokens": 8}, steps=2)
    train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    elastic.unwrap()
    result = inspect_adapter(recipe, tmp_path / "adapter", samples=3, out=tmp_path / "inspect", registry=registry,
                             batch_size=2)
    assert (tmp_path / "inspect" / "routing.png").is_file() and (tmp_path / "inspect" / "routing.json").is_file()
    loaded = load_adapter(model, tmp_path / "adapter", registry=registry)
    for entry in recipe.train.tasks:
        plugin = registry.make("task", entry.task.model_copy(update={"num_samples": 3}))
        prompts = samples_from_dataset(task_dataset(plugin, ByteTokenizer(), seed=recipe.seed, split="eval"))
        alone = []
        for p in prompts:  # each prompt alone, unpadded: the MSR is the mean of its 0/1 decisions
            with torch.no_grad():
                loaded(input_ids=torch.tensor([p.input_ids]))
            alone.append(float(loaded.routing.decisions.float().mean()))
        got = [r["msr"] for r in result["per_sample"] if r["task"] == plugin.name]
        assert got == pytest.approx(alone)
        row = result["tasks"][plugin.name]
        assert row["msr"] == pytest.approx(sum(alone) / 3) and row["msr_max"] == pytest.approx(max(alone))
    assert "recall" in format_inspection(result) and "decision margin" in format_inspection(result)
