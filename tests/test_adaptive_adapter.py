"""The committed FA-SSA adapter on the real default model routes by each prompt's own content.

``results/train/smollm2-fa-ssa/mlp/adapter`` was trained on passkey / niah_single (sensitive) and
code_completion / fewshot (robust). Its routing must differ between the tasks, and a prompt that
keeps a passkey haystack but ends with a code-completion prompt (the router's last pooling window)
must be routed sparser than the passkey prompt it came from: the router reads the question, not
a label it never sees, nor the haystack alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticfw.eval.dataset import samples_from_dataset, task_dataset
from elasticfw.eval.task import Sample
from elasticfw.model.checkpoint import load_adapter
from elasticfw.model.loading import load_model
from elasticfw.recipe import load_recipe
from elasticfw.registry import get_registry
from elasticfw.training.inspect import route_samples

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = ROOT / "results/train/smollm2-fa-ssa/mlp/adapter"
SWAP = 120  # tokens of the other prompt's ending: more than the router's 100-token pooling window


def test_committed_adapter_routes_by_the_prompts_own_question():
    recipe = load_recipe(ROOT / "recipes/train/smollm2-fa-ssa.yaml", ["model.device=cpu"])
    registry = get_registry()
    model, tok = load_model(recipe.model, registry=registry)
    prompts = {}
    for entry in recipe.train.tasks[:3:2]:  # passkey, code_completion
        plugin = registry.make("task", entry.task.model_copy(update={"num_samples": 3}))
        prompts[plugin.name] = samples_from_dataset(task_dataset(plugin, tok, seed=recipe.seed, split="eval"))
    elastic = load_adapter(model, ADAPTER, registry=registry, base_model=recipe.model.name)
    elastic.eval()
    try:
        passkey = [r["msr"] for r in route_samples(elastic, tok, prompts["passkey"], 3)]
        code = [r["msr"] for r in route_samples(elastic, tok, prompts["code_completion"], 3)]
        swapped = [Sample(list(a.input_ids[:-SWAP]) + list(b.input_ids[-SWAP:]), "")
                   for a, b in zip(prompts["passkey"], prompts["code_completion"])]
        mixed = [r["msr"] for r in route_samples(elastic, tok, swapped, 3)]
    finally:
        elastic.unwrap()
    assert min(code) - max(passkey) >= 0.1, (passkey, code)
    assert all(m > p for m, p in zip(mixed, passkey)), (passkey, mixed)
    assert sum(mixed) / 3 >= sum(passkey) / 3 + 0.03, (passkey, mixed)
