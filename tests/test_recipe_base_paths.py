"""Where `base:` files are found, so that a recipe copied elsewhere still loads, and
`elasticfw recipe resolve`, which writes a recipe with its bases merged in.

Bugs these catch (on the old loader, which looked only next to the naming file):

* a shipped recipe copied to another folder could not find its base, whatever the user did;
* the search order (next to the file, then ``ELASTICFW_RECIPE_PATH`` in order, then the recipes
  shipped in the package) and the ``elasticfw:NAME`` prefix did not exist;
* the not-found error named one place and no fix;
* there was no way to write a self-contained copy of a recipe.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from elasticfw.cli import demo_recipe_path, main
from elasticfw.errors import RecipeError
from elasticfw.recipe import load_recipe
from elasticfw.recipe.loader import RECIPE_PATH_ENV, load_recipe_dict, shipped_recipes_dir
from elasticfw.recipe.yaml_files import read_yaml

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "recipes").rglob("*.yaml")) + [demo_recipe_path()]


@pytest.fixture(autouse=True)
def _no_search_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RECIPE_PATH_ENV, raising=False)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def refused(path: Path | str) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe_dict(path)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def dumped(recipe: object) -> dict:
    return recipe.model_dump(mode="json")  # type: ignore[attr-defined]


# -- a copied recipe --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "folder"),
    [("train/smollm2-fa-xa.yaml", "train"), ("quickstart.yaml", ".")],
    ids=["base-of-a-base", "one-base"],
)
def test_a_copied_recipe_loads_with_the_folder_it_came_from_on_the_search_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, folder: str
) -> None:
    copy = tmp_path / "mine" / "my.yaml"
    copy.parent.mkdir()
    shutil.copy(ROOT / "recipes" / name, copy)
    msg = refused(copy)  # nothing tells the loader where the copy came from
    assert RECIPE_PATH_ENV in msg and "elasticfw recipe resolve" in msg
    monkeypatch.setenv(RECIPE_PATH_ENV, str(ROOT / "recipes" / folder))
    assert dumped(load_recipe(copy)) == dumped(load_recipe(ROOT / "recipes" / name))


# -- search order ---------------------------------------------------------------------------------


def test_next_to_the_file_then_the_search_path_in_order_then_the_shipped_recipes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = write(tmp_path / "a" / "r.yaml", "base: [b.yaml, demo.yaml]\n")
    here = write(tmp_path / "a" / "b.yaml", "seed: 1\n")
    first = write(tmp_path / "p1" / "b.yaml", "seed: 2\n")
    write(tmp_path / "p2" / "b.yaml", "seed: 3\ndescription: from p2\n")
    shadow = write(tmp_path / "p2" / "demo.yaml", "output_dir: from-p2\n")
    # empty entries are skipped, as in PATH
    monkeypatch.setenv(RECIPE_PATH_ENV, os.pathsep.join(["", str(tmp_path / "p1"), "", str(tmp_path / "p2")]))
    data = load_recipe_dict(recipe)
    assert data["seed"] == 1 and "description" not in data  # b.yaml next to the file
    assert data["output_dir"] == "from-p2"  # demo.yaml: the search path before the shipped recipes
    here.unlink()
    assert load_recipe_dict(recipe)["seed"] == 2  # the first folder of the search path
    first.unlink()
    assert load_recipe_dict(recipe)["seed"] == 3
    shadow.unlink()
    demo = read_yaml(demo_recipe_path())
    data = load_recipe_dict(recipe)  # the shipped demo
    assert "output_dir" not in data and data["description"] == demo["description"] and data["train"] == demo["train"]


def test_a_relative_search_path_entry_is_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "lib" / "b.yaml", "seed: 4\n")
    recipe = write(tmp_path / "elsewhere" / "r.yaml", "base: b.yaml\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(RECIPE_PATH_ENV, "lib")
    assert load_recipe_dict(recipe)["seed"] == 4


def test_the_shipped_prefix_names_only_a_shipped_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "demo.yaml", "seed: 99\n")  # next to the recipe, and on the search path
    monkeypatch.setenv(RECIPE_PATH_ENV, str(tmp_path))
    recipe = write(tmp_path / "r.yaml", "base: elasticfw:demo.yaml\ndescription: mine\n")
    data = load_recipe_dict(recipe)
    demo = read_yaml(demo_recipe_path())
    assert data["seed"] == demo["seed"] != 99 and data["train"] == demo["train"] and data["description"] == "mine"
    # a recipe path may name a shipped recipe too
    assert dumped(load_recipe("elasticfw:demo.yaml")) == dumped(load_recipe(demo_recipe_path()))


# -- errors -----------------------------------------------------------------------------------------


def test_a_missing_base_says_every_place_it_looked_and_how_to_fix_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = write(tmp_path / "r.yaml", "base: _base/nothere.yaml\n")
    msg = refused(recipe)
    shipped = os.path.abspath(shipped_recipes_dir() / "_base" / "nothere.yaml")
    assert f"recipe {str(recipe)!r}: `base` file '_base/nothere.yaml' does not exist" in msg
    assert f"looked for at {str(tmp_path / '_base' / 'nothere.yaml')!r}, then in {RECIPE_PATH_ENV} (not set)" in msg
    assert f"then among the recipes shipped with elasticfw at {shipped!r}" in msg
    assert f"add the folder that holds it to {RECIPE_PATH_ENV}" in msg
    assert "`elasticfw recipe resolve ORIGINAL.yaml -o COPY.yaml`" in msg
    monkeypatch.setenv(RECIPE_PATH_ENV, os.pathsep.join([str(tmp_path / "p1"), str(tmp_path / "p2")]))
    msg = refused(recipe)
    looked = ", ".join(repr(str(tmp_path / p / "_base" / "nothere.yaml")) for p in ("p1", "p2"))
    assert f"then in {RECIPE_PATH_ENV} at {looked}, then among the recipes shipped" in msg


def test_a_missing_absolute_base_is_not_searched_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "p" / "b.yaml", "seed: 1\n")
    monkeypatch.setenv(RECIPE_PATH_ENV, str(tmp_path / "p"))
    missing = tmp_path / "b.yaml"
    msg = refused(write(tmp_path / "r.yaml", f"base: {missing}\n"))
    assert f"`base` file {str(missing)!r} does not exist (an absolute path is not searched for elsewhere)" in msg


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        ("elasticfw:dmeo.yaml", "it names a recipe shipped with elasticfw, looked for at"),
        ("elasticfw:../pyproject.toml", "must name a recipe shipped with elasticfw by its path inside"),
        ("elasticfw:", "must name a recipe shipped with elasticfw by its path inside"),
    ],
)
def test_a_bad_shipped_name_lists_the_shipped_recipes(tmp_path: Path, base: str, expected: str) -> None:
    msg = refused(write(tmp_path / "r.yaml", f"base: '{base}'\n"))
    assert f"`base` file {base!r}" in msg and expected in msg and "demo.yaml" in msg
    if base == "elasticfw:dmeo.yaml":
        assert "did you mean 'demo.yaml'?" in msg


def test_cycles_through_the_search_path_are_still_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = write(tmp_path / "x" / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "lib" / "b.yaml", "base: a.yaml\n")  # a.yaml is not next to b.yaml: found through the path
    monkeypatch.setenv(RECIPE_PATH_ENV, os.pathsep.join([str(tmp_path / "lib"), str(tmp_path / "x")]))
    msg = refused(a)
    assert "recipe inheritance cycle through `base:`" in msg
    assert f"{a} -> {tmp_path / 'lib' / 'b.yaml'} -> {a}" in msg


# -- elasticfw recipe resolve -------------------------------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_resolve_writes_a_self_contained_recipe_that_validates_the_same(path: Path, tmp_path: Path) -> None:
    out = tmp_path / "alone" / "copy.yaml"
    out.parent.mkdir()
    assert main(["recipe", "resolve", str(path), "-o", str(out)]) == 0
    assert "base" not in read_yaml(out)
    assert dumped(load_recipe(out)) == dumped(load_recipe(path))
    first = path.read_text(encoding="utf-8").splitlines()[0]
    if first.startswith("#"):
        assert out.read_text(encoding="utf-8").splitlines()[0] == first  # the recipe's command is kept


def test_resolve_applies_overrides_and_keeps_interpolations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = write(
        tmp_path / "lib" / "base.yaml",
        "elastic:\n  sparse_mode: {sink_tokens: 128, block_size: 128}\neval:\n  task: {name: passkey}\n",
    )
    recipe = write(
        tmp_path / "r.yaml",
        f"# elasticfw recipe show r.yaml\nbase: {base}\n"
        'elastic:\n  retrieval_mode: {name: full, block_size: "${elastic.sparse_mode.block_size}"}\n',
    )
    assert main(["recipe", "resolve", str(recipe), "eval.task.num_samples=3"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# elasticfw recipe show r.yaml\n# Written by `elasticfw recipe resolve ")
    out = write(tmp_path / "elsewhere" / "copy.yaml", text)
    assert "${elastic.sparse_mode.block_size}" in text  # still an interpolation: an override moves both
    moved = ["elastic.sparse_mode.block_size=32", "elastic.sparse_mode.sink_tokens=32"]
    assert dumped(load_recipe(out, moved)) == dumped(load_recipe(recipe, ["eval.task.num_samples=3", *moved]))
    assert load_recipe(out).eval.task.num_samples == 3


def test_resolve_refuses_an_invalid_recipe_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = write(tmp_path / "r.yaml", "base: nothere.yaml\n")
    out = tmp_path / "out.yaml"
    assert main(["recipe", "resolve", str(recipe), "-o", str(out)]) == 2
    assert "`base` file 'nothere.yaml' does not exist" in capsys.readouterr().err and not out.exists()


def test_resolve_never_replaces_a_file_unless_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = write(tmp_path / "r.yaml", "seed: 3\n")
    out = write(tmp_path / "out.yaml", "mine: 1\n")
    assert main(["recipe", "resolve", str(recipe), "-o", str(out)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert out.read_text(encoding="utf-8") == "mine: 1\n"
    assert main(["recipe", "resolve", str(recipe), "-o", str(out), "--overwrite"]) == 0
    assert read_yaml(out) == {"seed": 3} and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
