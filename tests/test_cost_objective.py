"""The Lagrangian on the expected cost (``train.constraint: cost``): training among K >= 3 modes.

Independent definitions: the expected cost counted by hand for a fixed routing (mode shares times
costs, the streaming cost of tests/test_mode_cost.py), the Gumbel-softmax formula written out (its
gradient is what the cost term must pass back), the MSR objective itself (two modes of cost 1 and 0
make the cost 1 - MSR, so a cost-constrained run must retrace an MSR run with complementary
targets), and the trajectory the two-mode trainer produced before the cost objective existed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from training_helpers import (
    THREE_MODES,
    TINY_ELASTIC,
    ByteTokenizer,
    route_items,
    three_mode_train_recipe,
    tiny_train_recipe,
    tiny_training_setup,
    training_registry,
)

from elasticfw.errors import CheckpointError, RecipeError, UnsupportedInputError
from elasticfw.model.elastic import ElasticModel
from elasticfw.recipe import validate_recipe_data
from elasticfw.routing.gumbel import sample_noise
from elasticfw.testing.models import padded_batch, tiny_model
from elasticfw.training.evaluate import format_summary
from elasticfw.training.inspect import format_inspection, inspect_adapter
from elasticfw.training.logs import read_metrics
from elasticfw.training.objective import Lagrangian
from elasticfw.training.run import build_mixture, run_training
from elasticfw.training.trainer import train_router

COSTS = torch.tensor([1.0, 0.5, 0.2])


@pytest.fixture(scope="module")
def registry():
    return training_registry()


def _three_mode_data(tmp_path, cost_targets=None, router=None, context_tokens=48, **train):
    return three_mode_train_recipe(tmp_path, cost_targets or {"sensitive": 0.6, "robust": 0.4}, router,
                                   context_tokens, **train)


def _train(registry, data, tmp_path, model=None):
    recipe, mixture, elastic = tiny_training_setup(registry, data, model)
    train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    return recipe, mixture, elastic


# -- the cost term ---------------------------------------------------------------------------------
def test_expected_cost_of_a_fixed_routing_by_hand():
    """Two layers x two KV heads: layer 0 sends head 0 to moba and head 1 to streaming, layer 1 head 1
    to streaming, the rest stays full: shares (1/4, 1/4, 1/2). Streaming (sink 2, window 3, token
    granularity) costs 30/36 at 8 tokens and 1 at 5 (tests/test_mode_cost.py), moba 0.5 by the recipe:
    0.25 + 0.125 + 0.5 * 30/36 = 0.791667 and 0.25 + 0.125 + 0.5 = 0.875."""
    modes = [{"name": "full", "block_size": 16}, {**THREE_MODES[1]},
             {"name": "streaming", "sink_tokens": 2, "local_tokens": 3, "granularity": "token", "block_size": 16}]
    router = {"name": "fixed", "assign": "mode_heads", "head_modes": [[0, 0, 1], [0, 1, 2], [1, 1, 2]]}
    section = validate_recipe_data({"elastic": {"modes": modes, "router": router}}).elastic
    elastic = ElasticModel(tiny_model("llama", num_hidden_layers=2), section)
    ids, mask = padded_batch([8, 5], side="left", seed=1)
    with torch.no_grad():
        elastic(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    assert elastic.costs.table([8, 5]).tolist() == [[1.0, 0.5, 30 / 36], [1.0, 0.5, 1.0]]
    assert elastic.mode_shares().tolist() == [[0.25, 0.25, 0.5]] * 2
    assert elastic.routing.mode_shares().tolist() == [[0.25, 0.25, 0.5]] * 2
    cost = elastic.expected_cost([8, 5])
    assert cost.tolist() == pytest.approx([0.791667, 0.875], abs=1e-6)
    # the Lagrangian on it: target 0.6, lambda1 0.5, lambda2 2 -> d = 0.191667: 0.5 d + 2 d^2 = 0.169306;
    # target [0.8, 0.9] holds 0.875 (no penalty)
    lag = Lagrangian([0.6, (0.8, 0.9)])
    with torch.no_grad():
        lag.lambda1.fill_(0.5)
        lag.lambda2.fill_(2.0)
    assert lag.penalty(cost, torch.tensor([0, 1])).tolist() == pytest.approx([0.169306, 0.0], abs=1e-6)


def test_the_cost_term_passes_back_the_gumbel_softmax_gradient():
    """In training the cost's forward value is the sampled routing's cost and its gradient that of
    mean_(layer, head) sum_k softmax((z + g) / tau)_k cost_k, the same straight-through path as the MSR."""
    section = validate_recipe_data({"elastic": {"modes": THREE_MODES, "router": {"name": "static"}}}).elastic
    elastic = ElasticModel(tiny_model("llama", num_hidden_layers=2), section)
    with torch.no_grad():
        elastic.router.logits.copy_(torch.randn(elastic.router.logits.shape, generator=torch.Generator().manual_seed(0)))
    elastic.train()
    elastic.set_progress(0.4)
    noise = sample_noise([11, 12], 2, 2, modes=3)
    elastic.router.set_noise(noise)
    ids, mask = padded_batch([30, 22], side="left", seed=2)
    elastic(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    cost = elastic.expected_cost([30, 22])
    cost.sum().backward()
    z = elastic.router.logits.detach().clone().requires_grad_(True)  # (layers, KV heads, K)
    tau = elastic.router.schedule(elastic.router.progress)
    probs = torch.softmax((z[None] + noise) / tau, dim=-1)  # (B, L, H, K)
    picked = torch.nn.functional.one_hot(probs.argmax(-1), 3).double()
    assert cost.tolist() == pytest.approx((picked * COSTS.double()).sum(-1).mean((1, 2)).tolist(), abs=1e-6)
    (probs * COSTS).sum(-1).mean((1, 2)).sum().backward()
    assert torch.allclose(elastic.router.logits.grad, z.grad, atol=1e-6)
    assert float(z.grad.abs().sum()) > 0


@pytest.mark.parametrize("cost,direction", [(0.8, +1), (0.4, -1), (0.6, 0)])
def test_lambda_ascent_on_the_cost_pushes_it_toward_its_target(cost, direction):
    """Target 0.6: a dearer routing raises lambda1 and the penalty's slope in the cost turns positive
    (descent lowers the cost); a cheaper one the opposite; on target nothing moves."""
    lag = Lagrangian([0.6])
    opt = torch.optim.Adam(lag.parameters(), lr=0.1, maximize=True)
    c = torch.tensor([cost], requires_grad=True)
    lag.penalty(c, torch.tensor([0])).sum().backward()
    opt.step()
    assert (lag.lambda1.item() > 0) - (lag.lambda1.item() < 0) == direction
    c2 = torch.tensor([cost], requires_grad=True)
    lag.penalty(c2, torch.tensor([0])).sum().backward()
    assert (c2.grad.item() > 0) - (c2.grad.item() < 0) == direction


# -- two modes: unchanged under msr, the same objective under cost -----------------------------------
#: (step, LM loss, sparsity loss, MSR, lambda1, lambda2) of the recipe below, written by the trainer
#: before the cost objective existed (two modes, the MSR constraint)
BEFORE = [
    (1, 5.680208206176758, 0.0, {"recall": 0.5, "repeat": 0.3125},
     {"recall": -0.04999999329447746, "repeat": -0.04999999701976776},
     {"recall": 0.04999997839331627, "repeat": 0.04999999329447746}),
    (2, 5.455626964569092, 0.026046873070299625, {"recall": 0.5, "repeat": 0.5833333333333334},
     {"recall": -0.0966089740395546, "repeat": -0.09981941431760788},
     {"recall": 0.09411945939064026, "repeat": 0.09811270236968994}),
    (3, 5.713374137878418, 0.05273656267672777, {"recall": 0.625, "repeat": 0.5416666666666666},
     {"recall": -0.13742822408676147, "repeat": -0.1497764140367508},
     {"recall": 0.1297047734260559, "repeat": 0.14643019437789917}),
    (4, 5.5384438037872314, 0.08206711476668715, {"recall": 0.625, "repeat": 0.375},
     {"recall": -0.17830544710159302, "repeat": -0.1995958387851715},
     {"recall": 0.16147632896900177, "repeat": 0.19538366794586182}),
]
KEYS_BEFORE = {"gap", "grad_norm", "lambda1", "lambda2", "lm_loss", "loss", "lr", "margins", "msr", "p_sparse",
               "reg_loss", "samples", "step", "tau", "tokens_per_s", "seconds"}


def _rows(rows):
    return [(r["step"], r["lm_loss"], r["reg_loss"], r["msr"], r["lambda1"], r["lambda2"]) for r in rows]


@pytest.mark.slow
def test_two_modes_under_msr_train_as_before(registry, tmp_path):
    """The default (``constraint: msr``, the same settings) retraces the two-mode trainer's recorded run:
    same losses, MSR and multipliers at every step (to float noise across machines; bit-identical on
    the machine that recorded them), no cost keys in the log, the checkpoint and its dump as before."""
    data = tiny_train_recipe(tmp_path / "default", steps=4, lambda_lr=0.05, diagnostics_every=2)
    explicit = validate_recipe_data({**data, "train": {**data["train"], "constraint": "msr"}}, registry=registry)
    assert explicit == validate_recipe_data(data, registry=registry)
    assert "constraint" not in explicit.model_dump()["train"] and "cost_target" not in explicit.model_dump()["train"]["tasks"][0]
    _train(registry, data, tmp_path / "default")
    runs = [read_metrics(tmp_path / "default")]
    for got, want in zip(_rows(runs[0]), BEFORE):
        assert got[0] == want[0] and got[1:3] == pytest.approx(want[1:3], rel=1e-5, abs=1e-7)
        for g, w in zip(got[3:], want[3:]):
            assert g == pytest.approx(w, rel=1e-4, abs=1e-6)
    assert set(runs[0][0]) == KEYS_BEFORE and set(runs[0][1]) == KEYS_BEFORE | {"grad_norm_parts"}
    meta = json.loads((tmp_path / "default" / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert "constraint" not in meta and meta["targets"] == [[0.7, 0.7], [1.0, 1.0]]
    assert (tmp_path / "default" / "msr.png").is_file() and not (tmp_path / "default" / "cost.png").exists()


@pytest.mark.slow
def test_two_modes_of_cost_one_and_zero_retrace_the_msr_run(registry, tmp_path):
    """Full attention at cost 1 and streaming at cost 0 make the cost 1 - MSR; with the targets 1 - t
    the penalty, hence every step, is the MSR run's, and lambda1 the MSR run's with its sign flipped
    (d flips sign; lambda2 sees d^2). A cost term with the wrong sign, other decisions or other
    targets breaks the equality. Then --resume under the other constraint is refused."""
    msr_data = tiny_train_recipe(tmp_path / "msr", steps=3, lambda_lr=0.05)
    msr_data["train"]["targets"] = {"sensitive": 0.7, "robust": [0.8, 0.9]}
    _train(registry, msr_data, tmp_path / "msr")
    cost_data = tiny_train_recipe(tmp_path / "cost", steps=3, lambda_lr=0.05, constraint="cost",
                                  cost_targets={"sensitive": 0.3, "robust": [0.1, 0.2]})
    cost_data["elastic"] = {**TINY_ELASTIC, "retrieval_mode": {**TINY_ELASTIC["retrieval_mode"], "cost": 1.0},
                            "sparse_mode": {**TINY_ELASTIC["sparse_mode"], "cost": 0.0}}
    recipe, mixture, elastic = _train(registry, cost_data, tmp_path / "cost")
    by_msr, by_cost = read_metrics(tmp_path / "msr"), read_metrics(tmp_path / "cost")
    for m, c in zip(by_msr, by_cost):
        assert c["lm_loss"] == pytest.approx(m["lm_loss"], rel=1e-5)
        assert c["reg_loss"] == pytest.approx(m["reg_loss"], rel=1e-4, abs=1e-7)
        for task in ("recall", "repeat"):
            assert c["msr"][task] == pytest.approx(m["msr"][task], abs=1e-6)
            assert c["cost"][task] == pytest.approx(1 - m["msr"][task], abs=1e-6)
            assert c["gap"][task] == pytest.approx(-m["gap"][task], abs=1e-6)
            assert c["lambda1"][task] == pytest.approx(-m["lambda1"][task], rel=1e-4, abs=1e-7)
            assert c["lambda2"][task] == pytest.approx(m["lambda2"][task], rel=1e-4, abs=1e-7)
            assert sum(c["mode_share"][task].values()) == pytest.approx(1.0)
    assert (tmp_path / "cost" / "cost.png").is_file()
    again = validate_recipe_data(tiny_train_recipe(tmp_path / "cost", steps=3, lambda_lr=0.05), registry=registry)
    with pytest.raises(CheckpointError, match="train.constraint = 'cost'"):
        train_router(elastic, build_mixture(again, ByteTokenizer(), elastic.base, registry), again.train,
                     tmp_path / "cost", seed=0, pad_id=0, progress=False, resume=True)


# -- three modes -------------------------------------------------------------------------------------
def _noise_free_cost(elastic, mixture):
    """Per task, the expected cost over the Gumbel noise of the routing of 8 training prompts: with
    the arg max of z + g picking mode k with probability softmax(z)_k, the mean over (layer, head) of
    sum_k softmax(z)_k cost_k."""
    elastic.eval()
    out = {}
    for task in mixture:
        route_items(elastic, task.items[:8])
        probs = torch.stack([torch.softmax(elastic.runtime.decisions[layer].logits.detach().float(), -1)
                             for layer in elastic.heads.routed_layers], dim=1)
        out[task.label] = float((probs * COSTS).sum(-1).mean())
    return out


@pytest.mark.slow
def test_three_mode_training_moves_the_expected_cost_into_its_target(registry, tmp_path):
    """Static gates among full (1), moba (0.5) and streaming (0.2) start at P = (0.5, 0.25, 0.25), an
    expected cost of 0.675; trained 16 steps towards [0.35, 0.45], it ends within 0.05 of that band."""
    data = _three_mode_data(tmp_path, {"sensitive": [0.35, 0.45], "robust": [0.35, 0.45]}, steps=16,
                            batch_size=4, micro_batch_size=4, router_lr=0.2, lambda_lr=0.2, warmup_ratio=0.0,
                            diagnostics_every=0, checkpoint_every=1000)
    recipe, mixture, elastic = tiny_training_setup(registry, data)
    before = _noise_free_cost(elastic, mixture)
    assert before == pytest.approx({"recall": 0.675, "repeat": 0.675}, abs=1e-6)
    train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    after = _noise_free_cost(elastic, mixture)
    for task, cost in after.items():
        assert 0.35 - 0.05 <= cost <= 0.45 + 0.05, (task, before[task], cost)
    rows = read_metrics(tmp_path)
    last = rows[-1]
    assert set(last["mode_share"]["recall"]) == {"full", "moba", "streaming"}
    assert all(math.isfinite(r["cost"]["recall"]) and r["cost_std"]["recall"] >= 0 for r in rows
               if r["cost"]["recall"] is not None)
    assert last["lambda1"]["recall"] > 0  # the cost started above its band: the multiplier rose


def test_three_mode_run_reports_costs_and_shares(registry, tmp_path):
    """summary.json, its table and `elasticfw inspect` give per task the expected cost (mean, spread),
    its target and the share of heads per mode; per sample the cost and each head's mode."""
    data = _three_mode_data(tmp_path, steps=2, evaluate=True)
    data["train"]["tasks"][1]["cost_target"] = 0.3  # a task's own target overrides its category's
    recipe = validate_recipe_data(data, registry=registry)
    summary = run_training(recipe, progress=False, registry=registry)
    for task, target in (("recall", 0.6), ("repeat", 0.3)):
        row = summary["routers"]["static"]["tasks"][task]
        assert row["cost_target"] == [target, target]
        assert sum(row["mode_share"].values()) == pytest.approx(1.0, abs=1e-5)
        assert row["cost_min"] <= row["cost"] <= row["cost_max"] and row["cost_std"] >= 0
        assert 0.2 <= row["cost"] <= 1.0
        sample = summary["details"]["static"][task]["per_sample"][0]
        shares = torch.tensor(sample["shares"], dtype=torch.float64)
        assert sample["cost"] == pytest.approx(float((shares * COSTS.double()).sum()), abs=1e-9)
        assert len(sample["modes"]) == 4 and all(m in (0, 1, 2) for layer in sample["modes"] for m in layer)
        modes = torch.tensor(sample["modes"])
        assert shares.tolist() == pytest.approx([float((modes == k).double().mean()) for k in range(3)])
    assert "mean_cost" in summary["routers"]["static"]
    assert "cost" in format_summary(summary).splitlines()[0]
    result = inspect_adapter(recipe, tmp_path / "static" / "adapter", samples=3, registry=registry)
    row = result["tasks"]["recall"]
    assert {"cost", "cost_std", "cost_min", "cost_max", "mode_share"} <= set(row)
    assert sum(row["mode_share"].values()) == pytest.approx(1.0, abs=1e-5)
    assert "share per mode" in format_inspection(result)


# -- validation ----------------------------------------------------------------------------------
def _error(registry, data) -> str:
    with pytest.raises(RecipeError) as info:
        validate_recipe_data(data, registry=registry)
    return str(info.value)


def test_three_modes_under_the_msr_constraint_are_refused(registry, tmp_path):
    data = _three_mode_data(tmp_path)
    data["train"].pop("constraint")
    data["train"].pop("cost_targets")
    message = _error(registry, data)
    assert "train.constraint = 'msr'" in message and "3 modes" in message and "train.cost_targets" in message
    assert "expected train.constraint: cost" in message


@pytest.mark.parametrize("change,field", [
    (lambda d: d["train"].update(cost_targets={"sensitive": 0.1, "robust": 0.4}), "train.cost_targets.sensitive = 0.1"),
    (lambda d: d["train"].update(cost_targets={"sensitive": 0.6, "robust": [0.3, 1.2]}), "train.cost_targets.robust = [0.3, 1.2]"),
    (lambda d: d["train"]["tasks"][0].update(cost_target=0.15), "train.tasks.0.cost_target = 0.15"),
    (lambda d: d["train"].update(cost_targets={"sensitive": 0.6}), "train.cost_targets.robust is not set"),
    (lambda d: d["train"].update(cost_targets={"sensitive": -0.5, "robust": 0.4}),
     "train.cost_targets: sensitive = -0.5: a cost target is a relative cost in [0, 100]"),
    (lambda d: d["train"].update(cost_targets={"sensitive": [0.7, 0.6], "robust": 0.4}), "lo <= hi"),
    (lambda d: d["train"].update(constraint="msr"), "train.constraint = 'msr'"),
])
def test_cost_target_errors_name_the_field(registry, tmp_path, change, field):
    data = _three_mode_data(tmp_path)
    change(data)
    assert field in _error(registry, data)


def test_the_range_message_gives_the_modes_costs(registry, tmp_path):
    data = _three_mode_data(tmp_path, {"sensitive": 0.1, "robust": 0.4})
    message = _error(registry, data)
    assert "outside [0.2, 1]" in message and "(full, moba, streaming)" in message and "48 tokens" in message


def test_cost_targets_under_the_msr_constraint_are_refused(registry, tmp_path):
    data = tiny_train_recipe(tmp_path, cost_targets={"sensitive": 0.5, "robust": 0.5})
    assert "train.cost_targets is set but train.constraint = 'msr'" in _error(registry, data)
    data = tiny_train_recipe(tmp_path)
    data["train"]["tasks"][0]["cost_target"] = 0.5
    assert "train.tasks.0.cost_target is set" in _error(registry, data)


def test_the_trainer_checks_cost_targets_at_the_prompts_lengths(registry, tmp_path):
    """A task without context_tokens (fixed_prompt: 11 tokens) is checked when training starts: at 11
    tokens streaming (sink 16) reads every key and costs 1, so every mode costs at least 0.5."""
    data = _three_mode_data(tmp_path, {"sensitive": 0.3, "robust": 0.3})
    data["train"]["tasks"] = [{"task": {"name": "fixed_prompt", "num_samples": 4}, "eval_samples": 0}]
    data["elastic"]["modes"] = [THREE_MODES[0], THREE_MODES[1], {k: v for k, v in THREE_MODES[2].items() if k != "cost"}]
    with pytest.raises(UnsupportedInputError, match=r"train.tasks.0 \('fixed_prompt'\): cost target 0.3 .* "
                                                     r"outside \[0.5, 1\]"):
        _train(registry, data, tmp_path)
