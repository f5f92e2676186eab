"""Fuzzing the recipe loader and schema from the shipped recipes.

Each shipped recipe (``recipes/**/*.yaml`` and the packaged demo) is resolved to plain data and
mutated at random — a key deleted or renamed, a value replaced by one of another type (None,
10**30, -1, 0, NaN, inf, '', a long string, a list, a dict ...), a plugin ``name`` changed, a key
added — and validated with :func:`elasticfw.recipe.validate_recipe_data`; random ``key=value``
overrides go through :func:`elasticfw.recipe.load_recipe`. The property: every call either
succeeds or raises a :class:`~elasticfw.errors.RecipeError` whose message names a field path the
mutation touched (or quotes the override), never another exception type, and returns within
:data:`TIME_LIMIT_S`.

Reproducible: hypothesis runs derandomized without an example database. More examples for a
local hunt: ``ELASTICFW_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz_recipes.py -p no:xdist``.

A bug the fuzzer finds and that is not fixed yet goes into :data:`OPEN_BUGS` as a strict xfail
example (recognised by the fuzzer, so that it keeps looking for new ones); once fixed, it moves to
:data:`FOUND_BUGS`, whose minimal inputs stay as regression tests (five so far: empty, boolean and
null keys, and an override replacing an unresolvable interpolation).
"""

from __future__ import annotations

import copy
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from elasticfw.cli import demo_recipe_path
from elasticfw.errors import ElasticError, RecipeError
from elasticfw.recipe import load_recipe, recipe_defaults, validate_recipe_data
from elasticfw.recipe.loader import load_recipe_dict
from elasticfw.recipe.schema import PLUGIN_FIELDS
from elasticfw.registry import get_registry

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "recipes").rglob("*.yaml")) + [demo_recipe_path()]

#: hang guard for one load or validation (measured: ~10 ms; the schema is built in warm-up; generous
#: because CI runs it beside other tests on 2 cores)
TIME_LIMIT_S = 20.0

settings.register_profile(
    "elasticfw-fuzz-recipes",
    max_examples=int(os.environ.get("ELASTICFW_FUZZ_EXAMPLES", "150")),
    deadline=None,  # timing is asserted explicitly (TIME_LIMIT_S), not by hypothesis' flaky deadline
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.generate, Phase.shrink],  # no "explain" phase: it re-runs failures for minutes
)
FUZZ = settings.get_profile("elasticfw-fuzz-recipes")


def _rel(path: Path) -> str:
    return str(path.relative_to(path.parents[1]))


@cache
def seed_data(path: Path) -> dict[str, Any] | None:
    """The recipe resolved to plain data (bases merged), or ``None`` when it does not load here
    (e.g. it needs a file that is not present)."""
    try:
        load_recipe(path)  # also builds the schema, so that no timed call pays for it
        return load_recipe_dict(path)
    except RecipeError:
        return None


def seeds() -> list[Path]:
    return [p for p in SHIPPED if seed_data(p) is not None]


# ---------------------------------------------------------------------------------------------
# the property
# ---------------------------------------------------------------------------------------------


def path_text(path: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in path)


def omegaconf_path_text(path: tuple[Any, ...]) -> str:
    """OmegaConf's spelling of a path: list indices in brackets (``compare[0].label``)."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) and not isinstance(part, bool) else f".{part}"
    return text.lstrip(".")


def shorten(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def quotes(message: str, text: str) -> bool:
    """Whether ``message`` quotes ``text`` (as is, as its repr, or its first 40 characters if long)."""
    return text in message or repr(text) in message or (len(text) > 80 and repr(text)[:40] in message)


def names_a_field(message: str, paths: list[tuple[Any, ...]]) -> bool:
    """Whether ``message`` names one of ``paths`` or a section above it (``a.b.c``, ``a.b``, ``a``).

    A very long key may be shown cut short: its first 40 characters count. A key that is not a name
    is shown as YAML writes it (``''``, ``null``, ``true``), in a path or as "the key 'null'" of a file."""
    from elasticfw.recipe import _key_text

    for path in paths:
        if path and not (isinstance(path[-1], str) and path[-1]) and f"the key {_key_text(path[-1])!r}" in message:
            return True
        for n in range(len(path), 0, -1):
            yaml_text = ".".join(_key_text(p) if not isinstance(p, int) or isinstance(p, bool) else str(p)
                                 for p in path[:n])
            for text in {path_text(path[:n]), omegaconf_path_text(path[:n]), yaml_text}:
                if not text:
                    continue
                if len(text) > 80 and text[:40] in message:
                    return True
                if re.search(rf"(?<![\w.]){re.escape(text)}(?![\w])", message):
                    return True
    return False


@dataclass(frozen=True)
class KnownBug:
    """A bug outside this test's reach, pinned by a minimal input."""

    id: str
    reason: str
    call: Callable[[], Any]
    paths: tuple[tuple[Any, ...], ...]  # the field paths the error must name
    raises: type[BaseException]  # what the minimal input raises today
    recognise: Callable[[BaseException, list[tuple[Any, ...]], list[str]], bool]  # the fuzzer's filter
    #: the right outcome is success (else: a RecipeError naming ``paths``)
    expect_success: bool = False


def _top_level_empty_key(exc: BaseException, paths: list[tuple[Any, ...]], overrides: list[str]) -> bool:
    return isinstance(exc, RecipeError) and "<recipe>: unknown key" in str(exc) and ("",) in paths


def _bool_key(exc: BaseException, paths: list[tuple[Any, ...]], overrides: list[str]) -> bool:
    return (
        isinstance(exc, RecipeError)
        and "Keys should be strings" in str(exc)
        and any(isinstance(part, bool) for path in paths for part in path)
    )


def _override_of_interpolation(exc: BaseException, paths: list[tuple[Any, ...]], overrides: list[str]) -> bool:
    if not (isinstance(exc, RecipeError) and "cannot resolve: " in str(exc)):
        return False
    firsts = {}
    for text in overrides:
        key, _, value = text.partition("=")
        if key in firsts and "${" in firsts[key]:
            return True
        firsts.setdefault(key, value)
    return False


def _null_key(exc: BaseException, paths: list[tuple[Any, ...]], overrides: list[str]) -> bool:
    return (
        isinstance(exc, RecipeError)
        and "Incompatible key type 'NoneType'" in str(exc)
        and any(path and path[-1] is None for path in paths)
    )


def load_text(text: str) -> Any:
    """Load a recipe file with this YAML text."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "recipe.yaml"
        target.write_text(text, encoding="utf-8")
        return load_recipe(target)


#: bugs the fuzzers found, now fixed: each minimal input must succeed or name its field
FOUND_BUGS = [
    KnownBug(
        "empty-top-level-key",
        "format_validation_error (elasticfw/recipe/__init__.py) shows an empty top-level key as the path "
        "'<recipe>' ('<recipe>: unknown key; ...'), so the message does not say which key is wrong ('')",
        lambda: validate_recipe_data({"": 1}),
        (("",),),
        AssertionError,
        _top_level_empty_key,
    ),
    KnownBug(
        "bool-key",
        "a boolean key (YAML `true: 1`) is reported as '1 = 1: Keys should be strings': the path shows 1, not "
        "True/true (pydantic's location; elasticfw/recipe/__init__.py _walk)",
        lambda: validate_recipe_data({True: 1}),
        ((True,),),
        AssertionError,
        _bool_key,
    ),
    KnownBug(
        "null-top-level-key-in-file",
        "a recipe file with a null key at the top (`null: 1` or `~: 1`) fails in OmegaConf.create with \"recipe "
        "'...': cannot resolve: Incompatible key type 'NoneType'\" (elasticfw/recipe/loader.py): no key or line is "
        "named (nested, the section is: 'cannot resolve at model: ...')",
        lambda: load_text("null: 1\n"),
        ((None,),),
        AssertionError,
        _null_key,
    ),
    KnownBug(
        "null-key-in-list-item-in-file",
        "a null key in a mapping that is a list item (`compare: [{label: a, null: 1}]`) is reported \"at compare0\" "
        "(OmegaConf's full_key, used as is by elasticfw/recipe/loader.py): neither compare.0 nor compare[0]",
        lambda: load_text("compare:\n  - {label: a, null: 1}\n"),
        (("compare", 0, None),),
        AssertionError,
        _null_key,
    ),
    KnownBug(
        "override-of-an-interpolation",
        "apply_override (elasticfw/recipe/loader.py) reads the current value with node.get(), which resolves it: "
        "overriding a key that holds an unresolvable interpolation fails with 'cannot resolve: Interpolation key "
        "'oops' not found' (no field named) although the later override replaces it",
        lambda: load_recipe(ROOT / "recipes" / "quickstart.yaml", ["seed=${oops}", "seed=1"]),
        (("seed",),),
        RecipeError,
        _override_of_interpolation,
        expect_success=True,
    ),
]


#: bugs found and not fixed yet: the fuzzers skip inputs these recognise (pinned as strict xfails)
OPEN_BUGS: list[KnownBug] = []


def known_bug(exc: BaseException, paths: list[tuple[Any, ...]], overrides: list[str]) -> KnownBug | None:
    return next((bug for bug in OPEN_BUGS if bug.recognise(exc, paths, overrides)), None)


def check_outcome(call: Callable[[], Any], paths: list[tuple[Any, ...]], quoted: list[str] | tuple[str, ...] = ()) -> None:
    """Run ``call``: success, or a RecipeError naming one of ``paths`` (or quoting one of ``quoted``),
    within the time limit. Known bugs are counted as hypothesis events, not failures."""
    start = time.perf_counter()
    try:
        call()
    except ElasticError as exc:
        message = str(exc)
        named = names_a_field(message, paths) or any(quotes(message, q) for q in quoted)
        bug = known_bug(exc, paths, list(quoted))
        if bug is not None and not named:
            event(f"known bug {bug.id}")
            return
        assert isinstance(exc, RecipeError), f"{type(exc).__name__} is an ElasticError but not a RecipeError: {exc}"
        assert named, (
            f"the error names none of {[shorten(path_text(p)) for p in paths]} / {[shorten(q) for q in quoted]}:\n"
            f"{shorten(message, 2000)}"
        )
    except Exception as exc:  # the property: nothing but a RecipeError escapes (re-raised below)
        bug = known_bug(exc, paths, list(quoted))
        if bug is None:
            raise AssertionError(
                f"{type(exc).__name__} escaped instead of a RecipeError naming "
                f"{[shorten(path_text(p)) for p in paths]}: {shorten(str(exc), 2000)}"
            ) from exc
        event(f"known bug {bug.id}")
        return
    elapsed = time.perf_counter() - start
    assert elapsed < TIME_LIMIT_S, f"took {elapsed:.2f} s (limit {TIME_LIMIT_S} s)"


# ---------------------------------------------------------------------------------------------
# mutations of recipe data
# ---------------------------------------------------------------------------------------------

LONG = "x" * 5000
#: values of the "wrong" type or range for any field
ODD_VALUES: list[Any] = [
    None, 10**30, -(10**30), -1, 0, 1, math.nan, math.inf, -math.inf, -0.0, 1e308, 0.5, True, False,
    "", " ", LONG, "abc", "full", "0", "nan", "${model.name}", [], [1, "a"], [[[]]], {}, {"a": 1}, {"name": "full"},
    {5: 1}, {None: 1}, b"bytes",
]  # fmt: skip
ODD_KEYS: list[Any] = ["", "x", "name", "Name", "block_size", "base", "a.b", "0", "y" * 3000, 5, None, 1.5, True]


def values() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from(ODD_VALUES),
        st.integers(),
        st.floats(),
        st.text(max_size=20),
        st.lists(st.integers(), max_size=3),
        st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    )


def keys() -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(ODD_KEYS), st.text(max_size=12))


def walk(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a dict entry or list item below ``node``."""
    if isinstance(node, dict):
        items: Any = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return
    for key, value in items:
        yield (*prefix, key)
        yield from walk(value, (*prefix, key))


def at(node: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        node = node[part]
    return node


def plugin_sections(data: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Paths of the sections with a ``name:`` (plugin sections and ``model``)."""
    return [p for p in walk(data) if isinstance(at(data, p), dict) and "name" in at(data, p)]


def plugin_names() -> list[str]:
    registry = get_registry()
    return sorted({name for kind in set(PLUGIN_FIELDS.values()) for name in registry.names(kind)})


def mutate(data: dict[str, Any], draw: Callable[..., Any]) -> tuple[str, tuple[Any, ...]]:
    """Apply one random mutation to ``data`` in place; returns (operation, the path it touched)."""
    op = draw(st.sampled_from(["delete", "replace", "rename", "plugin_name", "add"]), label="operation")
    if op == "plugin_name":
        sections = plugin_sections(data)
        if sections:
            section = draw(st.sampled_from(sections), label="section")
            name = draw(
                st.one_of(st.sampled_from([*plugin_names(), "", "Full", LONG, None, 3]), st.text(max_size=30)),
                label="name",
            )
            at(data, section)["name"] = name
            return op, (*section, "name")
        op = "replace"
    paths = list(walk(data))
    if not paths:  # everything deleted: add a key
        new = draw(keys(), label="key")
        data[new] = draw(values(), label="value")
        return "add", (new,)
    path = draw(st.sampled_from(paths), label="path")
    parent, key = at(data, path[:-1]), path[-1]
    if op == "delete":
        del parent[key]
    elif op == "replace":
        parent[key] = copy.deepcopy(draw(values(), label="value"))
    elif op == "rename" and isinstance(parent, dict):
        new = draw(keys(), label="new key")
        parent[new] = parent.pop(key)
        return op, (*path[:-1], new)
    elif op == "add" and isinstance(at(data, path), dict):
        new = draw(keys(), label="new key")
        at(data, path)[new] = copy.deepcopy(draw(values(), label="value"))
        return op, (*path, new)
    else:  # rename in a list, add below a scalar: replace instead
        parent[key] = copy.deepcopy(draw(values(), label="value"))
        return "replace", path
    return op, path


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED, ids=_rel)
def test_seed_recipe_is_usable(path: Path) -> None:
    """The fuzzers start from every shipped recipe that loads here (others are skipped)."""
    if seed_data(path) is None:
        pytest.skip(f"{_rel(path)} does not load here (a file it needs is missing)")
    data = copy.deepcopy(seed_data(path))
    validate_recipe_data(data, source=_rel(path))  # the resolved data validates as it is


@FUZZ
@given(data=st.data())
def test_mutated_recipe_data(data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(seeds()), label="recipe")
    recipe = copy.deepcopy(seed_data(path))
    assert recipe is not None
    touched = [mutate(recipe, data.draw)[1] for _ in range(data.draw(st.integers(1, 3), label="mutations"))]
    event(f"{len(touched)} mutations")
    check_outcome(lambda: validate_recipe_data(recipe, source=_rel(path)), touched)


@FUZZ
@given(data=st.data())
def test_mutated_recipe_file(data: st.DataObject) -> None:
    """The same mutations written to a YAML file and loaded (YAML parsing and OmegaConf included)."""
    path = data.draw(st.sampled_from(seeds()), label="recipe")
    recipe = copy.deepcopy(seed_data(path))
    assert recipe is not None
    touched = [mutate(recipe, data.draw)[1] for _ in range(data.draw(st.integers(1, 3), label="mutations"))]
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "mutated.yaml"
        target.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
        check_outcome(lambda: load_recipe(target), touched)


OVERRIDE_VALUES = [
    "null", "~", "1000000000000000000000000000000", "-1", "0", ".nan", ".inf", "-.inf", "''", "", "[1, 2]", "[]",
    "{a: 1}", "{}", "abc", LONG, "${oops}", "${model.name}", "${elastic}", "${}", "{", "[", ":", "- a", "true",
    "1e999", "0x10", '"unterminated', "{name: bogus}", "a: b: c", "&a [*a]", "*a", "!!python/object/apply:os.system [ls]",
    "!!binary aGVsbG8=", "2024-01-01", "\t", "nan", "1_000", "1.5",
]  # fmt: skip
OVERRIDE_KEYS = [
    "a", "a..b", ".a", "a.", "base", "seed.x", "model.name.x", "elastic.0", "elastic.sparse_mode.0", "compare",
    "compare.0", "compare.99.label", "compare.-1.label", "compare.0.elastic.router.name", "train.tasks.10",
    "sweep.lengths.0", "elastic.router.name", "elastic.executor.name", "eval.task.name", "1", "_", "a-b", "y" * 3000,
]  # fmt: skip


@cache
def override_keys(path: Path) -> list[str]:
    """Every dotted key of the recipe with the schema's defaults underneath."""
    return [path_text(p) for p in walk(load_recipe_dict(path, defaults=recipe_defaults()))]


@FUZZ
@given(data=st.data())
def test_random_overrides(data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(seeds()), label="recipe")
    known = override_keys(path)
    overrides: list[str] = []
    for _ in range(data.draw(st.integers(1, 3), label="overrides")):
        key = data.draw(st.one_of(st.sampled_from(known), st.sampled_from(OVERRIDE_KEYS), st.text(max_size=10)))
        value = data.draw(st.one_of(st.sampled_from(OVERRIDE_VALUES), st.text(max_size=20)))
        form = data.draw(st.sampled_from(["{k}={v}"] * 8 + ["{k}", "={v}", "{k}=={v}"]), label="form")
        overrides.append(form.format(k=key, v=value))
    keys_given = [tuple(text.split("=", 1)[0].split(".")) for text in overrides]
    check_outcome(lambda: load_recipe(path, overrides), keys_given, quoted=overrides)


#: inputs of bugs the fuzzers found that are fixed now (kept as plain regression tests)
FIXED = [
    pytest.param(
        lambda: validate_recipe_data({"model": {"name": "x" * 300}}), (("model", "name"),),
        id="model-name-too-long",  # was OSError(ENAMETOOLONG) from Path.exists() in ModelSection._name
    ),
    pytest.param(
        lambda: load_recipe(ROOT / "recipes" / "quickstart.yaml", ["model.name=" + "x" * 300]), (("model", "name"),),
        id="model-name-too-long-override",
    ),
    pytest.param(
        lambda: load_recipe(ROOT / "recipes" / "quickstart.yaml", ["a=&a [*a]"]), (("a",),),
        id="self-referencing-yaml-alias-override",  # was RecursionError in OmegaConf
    ),
    pytest.param(lambda: load_text("a: &a [*a]\n"), (("a",),), id="self-referencing-yaml-alias-file"),
    pytest.param(  # was "the key '5' reads as the number 5" at line 2, naming no section
        lambda: load_text("model:\n  5: 1\n"), (("model", 5),), id="number-key-in-a-section-file",
    ),
    pytest.param(lambda: load_text("compare:\n  - {label: a, 5: 1}\n"), (("compare", 0, 5),),
                 id="number-key-in-a-list-item-file"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "paths"), FIXED)
def test_fixed_bug(call: Callable[[], Any], paths: tuple[tuple[Any, ...], ...]) -> None:
    with pytest.raises(RecipeError) as info:
        call()
    assert names_a_field(str(info.value), list(paths)) or "line 1" in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "bug",
    [
        *(pytest.param(bug, id=bug.id) for bug in FOUND_BUGS),
        *(pytest.param(bug, id=bug.id, marks=pytest.mark.xfail(strict=True, raises=bug.raises, reason=bug.reason))
          for bug in OPEN_BUGS),
    ],
)
def test_known_bug(bug: KnownBug) -> None:
    """Minimal inputs the fuzzers found: each must succeed or give a RecipeError naming its field."""
    if bug.expect_success:
        bug.call()
        return
    try:
        bug.call()
    except RecipeError as exc:
        assert names_a_field(str(exc), list(bug.paths)), f"the error does not name {bug.paths}:\n{exc}"
    else:
        pytest.fail("no error at all")
