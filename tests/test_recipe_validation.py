"""Recipes that used to validate and then fail (or misbehave) after the model was loaded are now
refused by `recipe validate`, with the field's path and what is expected."""

from __future__ import annotations

import math
import typing

import pytest
from pydantic import BaseModel

from elasticfw.errors import RecipeError
from elasticfw.recipe import validate_recipe_data
from elasticfw.registry import INT_LIMIT, get_registry


def _refused(data: dict, *fragments: str) -> str:
    with pytest.raises(RecipeError) as info:
        validate_recipe_data(data)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def _plugin_sections() -> list[tuple[str, str, type[BaseModel]]]:
    registry = get_registry()
    out = []
    for kind in ("sparse_mode", "router", "executor", "task"):
        for name in registry.names(kind):
            cls = registry.entry(kind, name).config_class
            assert cls is not None
            out.append((kind, name, cls))
    return out


def _numeric_fields(cls: type[BaseModel]) -> list[tuple[str, type]]:
    out = []
    for field, info in cls.model_fields.items():
        args = typing.get_args(info.annotation) or (info.annotation,)
        for t in (int, float):
            if t in args and not (t is int and bool in args):
                out.append((field, t))
                break
    return out


def _where(kind: str) -> tuple[str, dict]:
    """Recipe path of a plugin kind's section, and how to place a section there."""
    return {
        "sparse_mode": ("elastic.sparse_mode", lambda s: {"elastic": {"sparse_mode": s}}),
        "router": ("elastic.router", lambda s: {"elastic": {"router": s}}),
        "executor": ("elastic.executor", lambda s: {"elastic": {"executor": s}}),
        "task": ("eval.task", lambda s: {"eval": {"task": s}}),
    }[kind]


CASES = [
    (kind, name, field, t) for kind, name, cls in _plugin_sections() for field, t in _numeric_fields(cls)
]


@pytest.mark.parametrize(("kind", "name", "field", "t"), CASES, ids=[f"{c[1]}.{c[2]}" for c in CASES])
def test_every_numeric_plugin_field_refuses_overflow_and_non_finite_values(kind, name, field, t):
    """The whole class: an integer beyond 32 bits or an infinite / NaN float in any plugin's section
    fails at validation naming the section and the field (it used to overflow or silently zero a
    gradient later)."""
    path, place = _where(kind)
    bad_values = [10**30, -(10**30)] if t is int else [math.inf, -math.inf, math.nan]
    for value in bad_values:
        message = _refused(place({"name": name, field: value}), path, field)
        assert "Traceback" not in message


def test_int_limit_is_the_boundary():
    ok = {"elastic": {"sparse_mode": {"name": "streaming", "local_tokens": INT_LIMIT, "granularity": "token"}}}
    assert validate_recipe_data(ok).elastic.sparse_mode.local_tokens == INT_LIMIT
    _refused({"elastic": {"sparse_mode": {"name": "streaming", "local_tokens": INT_LIMIT + 1, "granularity": "token"}}},
             "elastic.sparse_mode", "local_tokens = 2147483648: out of range")


@pytest.mark.parametrize("depths", [[1.5], [-0.1], [math.nan], [0.2, math.inf], []])
def test_passkey_depths_must_lie_in_the_unit_interval(depths):
    _refused({"eval": {"task": {"name": "passkey", "depths": depths}}}, "eval.task.depths")


def test_model_name_seed_and_flex_block_size():
    _refused({"model": {"name": ""}}, "model.name = ''", "a model is required")
    _refused({"model": {"name": "   "}}, "model.name", "a model is required")
    _refused({"seed": 2**32}, "seed = 4294967296", "less than or equal to 4294967295")
    _refused({"seed": -1}, "seed = -1")
    _refused({"elastic": {"executor": {"name": "flex", "kernel_block_size": 48}}},
             "executor.kernel_block_size = 48 must divide or be a multiple of the modes' block_size (64)")
    # compatible sizes pass: 128 is a multiple of 64, 32 divides it
    for kb in (128, 32):
        validate_recipe_data({"elastic": {"executor": {"name": "flex", "kernel_block_size": kb}}})


@pytest.mark.parametrize(
    ("probe", "fragments"),
    [
        ({}, ["elastic.router.probe_task", "name = None: a task plugin's name is required", "passkey"]),
        ({"name": ["passkey"]}, ["name = ['passkey']: a task plugin's name is required"]),
        ({"name": "paskey"}, ["name = 'paskey'", "did you mean 'passkey'?"]),
        ({"name": "passkey", "digits": 99}, ["not a valid 'passkey' task: digits: Input should be less than or equal to 12"]),
        ({"name": "passkey", "colour": 1}, ["colour: Extra inputs are not permitted"]),
    ],
)
def test_probe_task_errors_name_the_field(probe, fragments):
    _refused({"elastic": {"router": {"name": "retrieval_score", "probe_task": probe}}}, *fragments)


def test_a_variant_naming_its_plugin_does_not_inherit_the_recipes_keys_for_it():
    data = {
        "elastic": {"router": {"name": "fixed", "assign": "sparse_heads", "heads": [[0, 0]]}},
        "compare": [
            {"label": "all", "elastic": {"router": {"name": "fixed", "assign": "all_retrieval"}}},
            {"label": "edit", "elastic": {"router": {"heads": [[0, 1]]}}},  # no name: changes the recipe's keys
        ],
    }
    recipe = validate_recipe_data(data)
    a, b = recipe.compare
    assert (a.elastic.router.assign, a.elastic.router.heads) == ("all_retrieval", [])
    assert (b.elastic.router.assign, b.elastic.router.heads) == ("sparse_heads", [(0, 1)])


def test_a_local_model_path_that_is_not_a_model_folder_fails_before_transformers(tmp_path):
    from elasticfw.errors import BackendUnavailableError
    from elasticfw.model.loading import load_model

    empty = tmp_path / "empty"
    empty.mkdir()
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    (tmp_path / "file.bin").write_bytes(b"x")
    for path, fragment in ((empty, "folder without config.json"), (config_only, "no weights"),
                           (tmp_path / "file.bin", "is a file")):
        section = validate_recipe_data({"model": {"name": str(path), "device": "cpu"}}).model
        with pytest.raises(BackendUnavailableError, match=fragment):
            load_model(section)


def test_a_null_or_non_string_plugin_name_is_reported_as_written():
    message = _refused({"elastic": {"sparse_mode": {"name": None}}},
                       "elastic.sparse_mode.name = null: a sparse_mode plugin's name (a string) is required")
    assert "'None'" not in message
    _refused({"elastic": {"router": {"name": ["mlp"]}}}, "elastic.router.name = ['mlp']")


def test_a_problem_of_the_recipes_section_is_reported_once_not_per_variant():
    data = {
        "elastic": {"retrieval_mode": {"name": "full", "block_size": 64},
                    "sparse_mode": {"name": "streaming", "block_size": 48, "sink_tokens": 48, "local_tokens": 96}},
        "compare": [{"label": "a", "elastic": {}}, {"label": "b", "elastic": {"router": {"name": "fixed"}}},
                    {"label": "c", "elastic": {"sparse_mode": {"block_size": 32, "sink_tokens": 32, "local_tokens": 64}}}],
    }
    message = _refused(data, "(1 problem)", "elastic: retrieval_mode.block_size=64 and sparse_mode.block_size=48")
    assert "compare." not in message


def test_a_hub_id_that_cannot_be_loaded_is_one_error_naming_the_field(monkeypatch):
    from elasticfw.errors import BackendUnavailableError
    from elasticfw.model.loading import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here either way: nothing to download from
    section = validate_recipe_data({"model": {"name": "no-such-org/no-such-model", "device": "cpu"}}).model
    with pytest.raises(BackendUnavailableError, match=r"model.name = 'no-such-org/no-such-model': transformers could "
                                                      r"not load it .*network access or the model in its Hugging Face cache"):
        load_model(section)
