"""The trainer must produce a router that adapts to its input, on a problem built so that a static
assignment cannot satisfy it.

Two kinds of input share their filler text and differ only in a few tokens at the start and the
end (``recall``: ``K:filler?``, ``repeat``: ``fillerK=``); ``recall`` is given the target MSR 0
(every head full) and ``repeat`` the target 1 (every head sparse). A router that routes every input
alike ends with one MSR for both; one that reads its input separates them.

As in real LLMs, whose pooled keys differ far more between heads than between inputs (cosine
0.97-0.99 between task means on the default model), the tiny model's keys carry a large
input-independent offset per head (a k_proj bias). With it, the paper's router collapses to a
static assignment (the negative control below: every sample gets the same MSR), and
``input_norm: standardize`` is what lets the same trainer separate the two kinds.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from training_helpers import TINY_ELASTIC, ByteTokenizer, route_items, tiny_train_recipe, training_registry

from elasticfw.model.loading import make_elastic
from elasticfw.recipe import validate_recipe_data
from elasticfw.testing.models import tiny_model
from elasticfw.training.run import build_mixture
from elasticfw.training.trainer import train_router

pytestmark = pytest.mark.slow

#: the per-head key offset (k_proj bias scale): large next to the input-dependent part of the keys
OFFSET = 8.0
STEPS = 80


def _offset_model():
    model = tiny_model("llama", attention_bias=True)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
                if "k_proj" in name:
                    p.copy_(OFFSET * torch.randn(p.shape, generator=gen))
    return model


def _train_and_route(tmp_path: Path, router: dict) -> dict[str, list[float]]:
    """Train ``router`` on the two-kind problem; the per-sample MSR of each kind's first 16 training
    prompts, routed in inference mode (no noise, arg max)."""
    registry = training_registry()
    data = tiny_train_recipe(
        tmp_path, steps=STEPS, batch_size=8, micro_batch_size=8, router_lr=3e-3, lambda_lr=5e-2,
        warmup_ratio=0.1, diagnostics_every=0, checkpoint_every=1000,
    )
    data["train"]["tasks"] = [
        {"task": {"name": "recall", "num_samples": 32}, "eval_samples": 0, "target": 0.0},
        {"task": {"name": "repeat", "num_samples": 32}, "eval_samples": 0, "target": 1.0},
    ]
    data["elastic"] = {**TINY_ELASTIC, "router": router}
    recipe = validate_recipe_data(data, registry=registry)
    model, tok = _offset_model(), ByteTokenizer()
    mixture = build_mixture(recipe, tok, model, registry)
    elastic = make_elastic(model, tok, recipe.elastic, registry=registry)
    train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    elastic.eval()
    out = {}
    for task in mixture:
        route_items(elastic, task.items[:16])
        out[task.label] = elastic.routing.msr.tolist()
    return out


def _separation(msr: dict[str, list[float]]) -> tuple[float, float]:
    """(mean MSR of ``repeat`` minus that of ``recall``, the share of (recall, repeat) sample pairs
    in which the repeat sample is routed sparser)."""
    recall, repeat = msr["recall"], msr["repeat"]
    gap = sum(repeat) / len(repeat) - sum(recall) / len(recall)
    pairs = list(itertools.product(recall, repeat))
    return gap, sum(b > a for a, b in pairs) / len(pairs)


@pytest.mark.parametrize("pool_keys", ["rotated", "unrotated"])
def test_standardised_router_routes_the_two_kinds_apart(tmp_path, pool_keys):
    router = {"name": "mlp", "pool_tokens": 8, "input_norm": "standardize", "pool_keys": pool_keys}
    msr = _train_and_route(tmp_path, router)
    gap, ordered = _separation(msr)
    assert gap >= 0.25, msr
    assert ordered >= 0.75, msr


def test_the_papers_router_collapses_on_the_same_problem(tmp_path):
    """The negative control: the check above fails for the paper's router (no input_norm), which
    routes every input alike here, as it does on the default model."""
    msr = _train_and_route(tmp_path, {"name": "mlp", "pool_tokens": 8})
    gap, _ = _separation(msr)
    assert abs(gap) < 0.1, msr
    assert len(set(msr["recall"] + msr["repeat"])) == 1, msr
