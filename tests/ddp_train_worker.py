"""Run by tests/test_training_ddp.py under torchrun: train the tiny recipe and write the metrics."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from training_helpers import tiny_train_recipe, training_registry

from elasticfw.recipe import validate_recipe_data
from elasticfw.training.run import run_training

if __name__ == "__main__":
    out, micro = sys.argv[1], int(sys.argv[2])
    registry = training_registry()
    recipe = validate_recipe_data(tiny_train_recipe(out, steps=3, batch_size=4, micro_batch_size=micro, diagnostics_every=1), registry=registry)
    run_training(recipe, registry=registry, progress=False)
