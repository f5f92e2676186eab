"""Recipes: inheritance, overrides, interpolation, and one clear error per malformed recipe."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest

from elasticfw.errors import ElasticError, RecipeError
from elasticfw.eval.task import Sample, Task, TaskConfig
from elasticfw.recipe import load_recipe, validate_recipe_data
from elasticfw.recipe.loader import load_recipe_dict, parse_override
from elasticfw.registry import load_registry

Write = Callable[..., Path]

TASK = "eval:\n  task: {name: passkey}\n"


@pytest.fixture
def write(tmp_path: Path) -> Write:
    """``write(name, text)`` → a recipe file under tmp_path (directories created)."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path

    return _write


# -- malformed recipes: (files, overrides, path named, key phrase) --------------------------------
# The first file is the one loaded. Every case must raise RecipeError whose message names the
# path and holds the phrase, in one paragraph.

MALFORMED: list[Any] = [
    pytest.param({"r.yaml": "modle: {name: smollm2-135m}\n"}, [], "modle: unknown key", "did you mean 'model'?",
                 id="unknown-top-level-key"),
    pytest.param({"r.yaml": "elastic:\n  sparse_mode: {name: streaming, sink_token: 64}\n"}, [],
                 "elastic.sparse_mode.sink_token", "did you mean 'sink_tokens'?", id="unknown-key-in-plugin"),
    pytest.param({"r.yaml": "eval:\n  task: {name: passkey, num_sample: 3}\n"}, [],
                 "eval.task.num_sample", "did you mean 'num_samples'?", id="unknown-key-in-task"),
    pytest.param({"r.yaml": "elastic:\n  routr: {name: fixed}\n"}, [], "elastic.routr", "did you mean 'router'?",
                 id="unknown-key-in-section"),
    pytest.param({"r.yaml": "seed: abc\n"}, [], "seed = 'abc'", "valid integer", id="wrong-type"),
    pytest.param({"r.yaml": "model: 3\n"}, [], "model = 3", "expected a section", id="scalar-for-section"),
    pytest.param({"r.yaml": "elastic:\n  sparse_mode: streaming\n"}, [], "elastic.sparse_mode = 'streaming'",
                 "sparse_mode: {name: streaming}", id="plugin-section-as-string"),
    pytest.param({"r.yaml": "elastic:\n  sparse_mode: {name: streamin}\n"}, [], "elastic.sparse_mode.name",
                 "did you mean 'streaming'?", id="unknown-plugin-near-miss"),
    pytest.param({"r.yaml": "eval:\n  task: {name: paskey}\n"}, [], "eval.task.name",
                 "did you mean 'passkey'?", id="unknown-plugin-single-of-kind"),
    pytest.param({"r.yaml": "eval: {batch_size: 2}\n"}, [], "eval.task", "required field is missing",
                 id="missing-required-field"),
    pytest.param({"r.yaml": "compare:\n  - elastic: {}\n"}, [], "compare.0.label", "required field is missing",
                 id="compare-without-label"),
    pytest.param({"r.yaml": TASK}, ["elastic.sparse_mode.sink_tokens"], "elastic.sparse_mode.sink_tokens",
                 "not of the form dotted.key=value", id="override-without-equals"),
    pytest.param({"r.yaml": TASK}, ["=64"], "'=64'", "not of the form dotted.key=value", id="override-without-key"),
    pytest.param({"r.yaml": "compare:\n  - {label: a, elastic: {}}\n"}, ["compare.3.label=x"], "compare.3",
                 "not an index of a list of 1 items", id="override-index-out-of-range"),
    pytest.param({"r.yaml": "seed: 3\n"}, ["seed.x=1"], "seed.x", "holds a value, not a section",
                 id="override-into-scalar"),
    pytest.param({"r.yaml": TASK}, ["seed=[1,"], "seed=[1,", "not valid YAML", id="override-value-bad-yaml"),
    pytest.param({"r.yaml": TASK}, ["elastic.sparse_mod.sink_tokens=64"], "elastic.sparse_mod",
                 "did you mean 'sparse_mode'?", id="override-misspelled-key"),
    pytest.param({"r.yaml": "elastic:\n  sparse_mode: {name: streaming, sink_tokens: -64}\n"}, [],
                 "elastic.sparse_mode.sink_tokens = -64", "greater than or equal to 0", id="negative-sink-tokens"),
    pytest.param({"r.yaml": TASK + "  batch_size: 0\n"}, [], "eval.batch_size = 0", "greater than or equal to 1",
                 id="batch-size-zero"),
    pytest.param({"r.yaml": TASK + "  padding_side: middle\n"}, [], "eval.padding_side = 'middle'",
                 "'left' or 'right'", id="bad-literal"),
    pytest.param({"r.yaml": "model:\n  name: [a, b\nseed: 1\n"}, [], "line 3, column 5", "not valid YAML",
                 id="yaml-syntax-error"),
    pytest.param({"r.yaml": "model:\n\tname: x\n"}, [], "line 2, column 1", "not valid YAML", id="yaml-tab"),
    pytest.param({"r.yaml": "seed: 1\ndescription: x\nseed: 2\n"}, [], "line 3", "key 'seed' is given twice",
                 id="duplicate-key"),
    pytest.param({"r.yaml": "base: nothere.yaml\n"}, [], "`base` file 'nothere.yaml'", "does not exist",
                 id="missing-base-file"),
    pytest.param({"r.yaml": "base: 3\n"}, [], "`base` = 3", "must be a path", id="base-not-a-path"),
    pytest.param({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, [], "a.yaml -> ",
                 "inheritance cycle", id="base-cycle"),
    pytest.param({"r.yaml": "- model\n- elastic\n"}, [], "r.yaml", "must be a mapping of sections",
                 id="yaml-list-not-mapping"),
    pytest.param({"r.yaml": "description: run ${model.nme}\n"}, [], "at description", "model.nme",
                 id="interpolation-missing-key"),
    pytest.param({"r.yaml": "description: run ${model.name\n"}, [], "at description", "cannot resolve",
                 id="interpolation-syntax"),
    pytest.param({"r.yaml": "output_dir: ???\n"}, [], "at output_dir", "Missing mandatory value",
                 id="missing-mandatory-value"),
    pytest.param({"r.yaml": "model: {device: gpu}\n"}, [], "model.device = 'gpu'", "cuda:N", id="bad-device"),
    pytest.param({"r.yaml": "model: {name: smolm2-135m}\n"}, [], "model.name = 'smolm2-135m'",
                 "did you mean 'smollm2-135m'?", id="unknown-model-near-miss"),
    pytest.param({"r.yaml": "elastic:\n  retrieval_mode: {name: full, block_size: 48}\n"
                            "  sparse_mode: {name: streaming, block_size: 64}\n"}, [],
                 "elastic: retrieval_mode.block_size=48", "sparse_mode.block_size=64 must divide",
                 id="block-size-incompatible"),
    pytest.param({"r.yaml": "elastic:\n  sparse_mode: {name: streaming, sink_tokens: 100}\n"}, [],
                 "elastic.sparse_mode: sink_tokens=100", "multiple of block_size=64", id="sink-not-block-multiple"),
    pytest.param({"r.yaml": "elastic:\n  router: {name: fixed, assign: all_sparse, heads: [[0, 1]]}\n"}, [],
                 "elastic.router", "heads is only used with assign", id="fixed-heads-with-all-sparse"),
    pytest.param({"r.yaml": "compare:\n  - label: a\n    elastic: {router: {name: mpl}}\n"}, [],
                 "compare.0.elastic.router.name = 'mpl'", "did you mean 'mlp'?", id="compare-unknown-router"),
    pytest.param({"r.yaml": "compare:\n  - label: a\n    elastic: {sparse_mode: {sink_tokns: 64}}\n"}, [],
                 "compare.0.elastic.sparse_mode.sink_tokns", "did you mean 'sink_tokens'?",
                 id="compare-unknown-key-in-plugin"),
    pytest.param({"r.yaml": "compare: {label: a}\n"}, [], "compare", "valid list", id="compare-not-a-list"),
    pytest.param({"r.yaml": "seed: !!python/object/apply:os.system ['echo hi']\n"}, [], "line 1",
                 "is not allowed: recipes are plain data", id="python-tag"),
]


@pytest.mark.parametrize(("files", "overrides", "path", "phrase"), MALFORMED)
def test_malformed_recipe(write: Write, files: dict[str, str], overrides: list[str], path: str, phrase: str) -> None:
    paths = [write(name, text) for name, text in files.items()]
    with pytest.raises(RecipeError) as info:
        load_recipe(paths[0], overrides)
    msg = str(info.value)
    assert path in msg, msg
    assert phrase in msg, msg
    assert "\n\n" not in msg and "Traceback" not in msg, msg  # one paragraph
    assert "errors.pydantic.dev" not in msg and "For further information" not in msg, msg
    assert info.value.__suppress_context__ or info.value.__cause__ is None  # no chained raw traceback


def test_enough_distinct_malformed_cases() -> None:
    assert len({p.id for p in MALFORMED}) == len(MALFORMED) >= 15


def test_missing_recipe_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"recipe file '.*nope\.yaml' does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_several_problems_are_counted_once_each(write: Write) -> None:
    path = write(
        "r.yaml",
        "seed: x\nelastic:\n  sparse_mode: {name: streaming, foo: 1}\n"
        "compare:\n  - {label: a, elastic: {router: {name: fixed}}}\n",
    )
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    msg = str(info.value)
    assert "(2 problems)" in msg
    assert "  - seed = 'x'" in msg and "  - elastic.sparse_mode.foo: unknown key" in msg
    # the variant inherits the broken section; it is not reported a second time
    assert "compare.0.elastic.sparse_mode.foo" not in msg


class EchoConfig(TaskConfig):
    name: Literal["echo"] = "echo"


class EchoTask(Task):
    """A second task, so that tasks form a discriminated union."""

    name = "echo"
    config_class = EchoConfig

    def samples(self, tokenizer: Any, *, seed: int, split: str = "eval") -> list[Sample]:
        return []

    def score(self, sample: Sample, completion: str) -> float:
        return 0.0


def test_plugin_section_without_name_and_without_default() -> None:
    registry = load_registry()
    registry.register("task", EchoTask)
    with pytest.raises(RecipeError) as info:
        validate_recipe_data({"eval": {"task": {"num_samples": 3}}}, registry=registry)
    expected = ", ".join(sorted([*load_registry().names("task"), "echo"]))
    assert f"eval.task.name: required — which task plugin; registered: {expected}" in str(info.value)
    with pytest.raises(RecipeError, match=r"eval\.task\.name = 'ecko': unknown task 'ecko'; did you mean 'echo'"):
        validate_recipe_data({"eval": {"task": {"name": "ecko"}}}, registry=registry)
    recipe = validate_recipe_data({"eval": {"task": {"name": "echo"}}}, registry=registry)
    assert isinstance(recipe.eval.task, EchoConfig)


def test_recipe_errors_are_elastic_errors() -> None:
    assert issubclass(RecipeError, ElasticError)
    with pytest.raises(RecipeError):
        validate_recipe_data({"seed": "x"})


# -- YAML is data ---------------------------------------------------------------------------------


def test_python_tag_is_refused_and_never_executed(write: Write, tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    command = f"touch {marker}"
    path = write("r.yaml", f"description: !!python/object/apply:os.system [{command!r}]\n")
    with pytest.raises(RecipeError, match="not allowed"):
        load_recipe(path)
    with pytest.raises(RecipeError, match="not allowed"):
        load_recipe(write("ok.yaml", "{}\n"), [f"description=!!python/object/apply:os.system [{command!r}]"])
    assert not marker.exists()


# -- positive: defaults, inheritance, overrides, interpolation -----------------------------------


def test_empty_recipe_gets_defaults(write: Write) -> None:
    recipe = load_recipe(write("r.yaml", ""))
    assert recipe.model.name == "smollm2-135m"
    assert recipe.elastic.retrieval_mode.name == "full"
    assert recipe.elastic.sparse_mode.name == "streaming"
    assert recipe.elastic.executor.name == "reference"
    assert recipe.eval is None and recipe.compare is None


def test_base_is_relative_to_the_file_not_the_cwd(write: Write, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write("recipes/_base/model.yaml", "model: {name: smollm2-135m, dtype: bfloat16}\nseed: 1\n")
    write("recipes/_base/common.yaml", "base: model.yaml\n" + TASK + "  batch_size: 2\n")
    path = write("recipes/run.yaml", "base: _base/common.yaml\nseed: 7\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    recipe = load_recipe(Path("..") / "recipes" / "run.yaml")
    assert recipe.model.dtype == "bfloat16"  # from the base of the base
    assert recipe.eval.batch_size == 2 and recipe.eval.task.name == "passkey"
    assert recipe.seed == 7  # the file wins over its bases
    assert load_recipe(path).seed == 7


def test_list_of_bases_merges_left_to_right(write: Write) -> None:
    write("a.yaml", "seed: 1\ndescription: from a\nmodel: {dtype: bfloat16}\n")
    write("b.yaml", "seed: 2\nmodel: {device: cpu}\n")
    recipe = load_recipe(write("r.yaml", "base: [a.yaml, b.yaml]\ndescription: mine\n"))
    assert recipe.seed == 2
    assert recipe.description == "mine"
    assert (recipe.model.dtype, recipe.model.device) == ("bfloat16", "cpu")


def test_plugin_section_is_replaced_when_the_plugin_changes(write: Write) -> None:
    write("base.yaml", "elastic:\n  sparse_mode: {name: streaming, sink_tokens: 64, local_tokens: 256}\n")
    swapped = load_recipe(write("full.yaml", "base: base.yaml\nelastic:\n  sparse_mode: {name: full}\n"))
    assert swapped.elastic.sparse_mode.name == "full"  # no sink_tokens leaked into full's section
    same = load_recipe(write("same.yaml", "base: base.yaml\nelastic:\n  sparse_mode: {name: streaming, sink_tokens: 128}\n"))
    assert (same.elastic.sparse_mode.sink_tokens, same.elastic.sparse_mode.local_tokens) == (128, 256)


def test_plugin_section_without_name_tunes_the_default_plugin(write: Write) -> None:
    recipe = load_recipe(
        write("r.yaml", "elastic:\n  sparse_mode: {sink_tokens: 64}\ncompare:\n  - {label: a, elastic: {}}\n"
                        "  - {label: b, elastic: {sparse_mode: {local_tokens: 128}}}\n")
    )
    assert recipe.elastic.sparse_mode.name == "streaming" and recipe.elastic.sparse_mode.sink_tokens == 64
    a, b = recipe.compare
    assert a.elastic.sparse_mode == recipe.elastic.sparse_mode
    assert (b.elastic.sparse_mode.sink_tokens, b.elastic.sparse_mode.local_tokens) == (64, 128)


def test_model_section_merges_even_when_its_name_changes(write: Write) -> None:
    write("base.yaml", "model: {name: org/base-model, dtype: bfloat16, device: cpu}\n")
    path = write("r.yaml", "base: base.yaml\nmodel: {name: org/other-model}\n")
    recipe = load_recipe(path)
    assert (recipe.model.name, recipe.model.dtype, recipe.model.device) == ("org/other-model", "bfloat16", "cpu")
    overridden = load_recipe(path, ["model.name=org/third"])
    assert (overridden.model.name, overridden.model.dtype) == ("org/third", "bfloat16")


def test_overrides(write: Write) -> None:
    path = write(
        "r.yaml",
        TASK + "compare:\n  - {label: a, elastic: {}}\n  - {label: b, elastic: {router: {name: fixed}}}\n",
    )
    recipe = load_recipe(
        path,
        [
            "elastic.sparse_mode.sink_tokens=64",  # nested
            "compare.0.label=dense",  # list index
            "compare.1.elastic.router.assign=all_sparse",  # inside a list item
            "elastic.executor={name: reference, query_chunk: 256}",  # a mapping value
            "eval.task.depths=[0.25, 0.75]",  # a list value
            "output_dir=results/x",  # a new key
            "description=a=b",  # only the first '=' splits
        ],
    )
    assert recipe.elastic.sparse_mode.sink_tokens == 64
    assert [v.label for v in recipe.compare] == ["dense", "b"]
    assert recipe.compare[1].elastic.router.assign == "all_sparse"
    assert recipe.elastic.executor.query_chunk == 256
    assert recipe.eval.task.depths == [0.25, 0.75]
    assert recipe.output_dir == "results/x"
    assert recipe.description == "a=b"


def test_override_naming_another_plugin_replaces_its_section(write: Write) -> None:
    path = write("r.yaml", "elastic:\n  router: {name: mlp, pool_tokens: 50}\n  sparse_mode: {name: streaming, sink_tokens: 64}\n")
    recipe = load_recipe(
        path,
        ["elastic.router={name: fixed, assign: all_sparse}", "elastic.sparse_mode.name=full",
         "elastic.sparse_mode.block_size=32"],
    )
    assert recipe.elastic.router.name == "fixed" and recipe.elastic.router.assign == "all_sparse"
    assert recipe.elastic.sparse_mode.name == "full" and recipe.elastic.sparse_mode.block_size == 32
    kept = load_recipe(path, ["elastic.sparse_mode.name=streaming"])  # same plugin: parameters kept
    assert kept.elastic.sparse_mode.sink_tokens == 64


def test_parse_override_values() -> None:
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a=true") == ("a", True)
    assert parse_override("a=null") == ("a", None)
    assert parse_override("a=") == ("a", "")
    assert parse_override("a={x: 1}") == ("a", {"x": 1})
    assert parse_override("compare.0.label=x") == ("compare.0.label", "x")


def test_interpolation(write: Write) -> None:
    write("base.yaml", "output_dir: results/${model.name}/seed${seed}\n")
    path = write("r.yaml", "base: base.yaml\nseed: 3\ndescription: passkey on ${model.name}\n")
    recipe = load_recipe(path)
    assert recipe.description == "passkey on smollm2-135m"
    assert recipe.output_dir == "results/smollm2-135m/seed3"  # the base refers to the child's value
    overridden = load_recipe(path, ["seed=5", "description=${output_dir}"])  # resolved after overrides
    assert overridden.output_dir == "results/smollm2-135m/seed5"
    assert overridden.description == "results/smollm2-135m/seed5"


def test_compare_variants_merge_onto_elastic(write: Write) -> None:
    path = write(
        "r.yaml",
        "elastic:\n  sparse_mode: {name: streaming, sink_tokens: 64}\n  router: {name: mlp}\n"
        "compare:\n  - {label: same, elastic: {}}\n"
        "  - {label: fixed, elastic: {router: {name: fixed, assign: all_sparse}}}\n"
        "  - {label: full, elastic: {sparse_mode: {name: full}}}\n",
    )
    same, fixed, full = load_recipe(path).compare
    assert same.elastic.sparse_mode.sink_tokens == 64 and same.elastic.router.name == "mlp"
    assert fixed.elastic.router.name == "fixed" and fixed.elastic.sparse_mode.sink_tokens == 64
    assert full.elastic.sparse_mode.name == "full"


def test_load_recipe_dict_from_data() -> None:
    data = load_recipe_dict(None, ["seed=2"], data={"seed": 1, "description": "${seed}"})
    assert data == {"seed": 2, "description": 2}
    with pytest.raises(RecipeError, match="exactly one"):
        load_recipe_dict(None)


def test_validated_recipe_is_frozen(write: Write) -> None:
    recipe = load_recipe(write("r.yaml", TASK))
    with pytest.raises(ValueError, match="frozen"):
        recipe.seed = 3
