"""Every YAML recipe the project ships validates, and each runnable one starts with its command."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticfw.cli import demo_recipe_path
from elasticfw.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "recipes").rglob("*.yaml")) + [demo_recipe_path()]


def test_recipes_are_shipped():
    assert len(SHIPPED) >= 5


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    if "_base" not in path.parts:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# elasticfw "), f"{path.name} must start with the command that runs it"
        for variant in recipe.compare or []:
            assert variant.label
