"""Run by tests/test_sweep.py under torchrun: the tiny sweep, rows only."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from sweep_helpers import tiny_sweep_recipe
from training_helpers import training_registry

from elasticfw.eval.sweep import run_sweep
from elasticfw.recipe import validate_recipe_data
from elasticfw.registry import set_registry

if __name__ == "__main__":
    registry = training_registry()
    set_registry(registry)
    recipe = validate_recipe_data(tiny_sweep_recipe(sys.argv[1]), registry=registry)
    run_sweep(recipe, registry=registry, progress=False, report=False)
