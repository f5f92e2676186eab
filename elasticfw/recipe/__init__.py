"""Recipes: load (OmegaConf) → validate (pydantic) → a frozen ``Recipe`` object.

>>> from elasticfw.recipe import load_recipe
>>> recipe = load_recipe("recipes/quickstart.yaml", ["elastic.sparse_mode.sink_tokens=64"])
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from elasticfw.errors import RecipeError, suggest
from elasticfw.recipe.loader import load_recipe_dict, merge_sections
from elasticfw.recipe.schema import PLUGIN_FIELDS, merge_variants, recipe_defaults, recipe_model
from elasticfw.recipe.sections import LIST_PLUGIN_FIELDS
from elasticfw.registry import Registry, get_registry, unknown_name_message

__all__ = ["load_recipe", "validate_recipe_data", "recipe_model", "recipe_defaults", "format_validation_error"]

_MISSING = object()
_VARIANT_PREFIX = re.compile(r"^compare\.\d+\.(?=elastic[.:])")


def load_recipe(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), *, registry: Registry | None = None
) -> Any:
    """Load, merge, override, resolve and validate a recipe file."""
    registry = registry or get_registry()
    data = load_recipe_dict(path, overrides, defaults=recipe_defaults(registry))
    return validate_recipe_data(data, source=str(path), registry=registry)


def validate_recipe_data(data: dict[str, Any], *, source: str = "<data>", registry: Registry | None = None) -> Any:
    """Validate resolved recipe data; sections it leaves out (or plugin sections that leave out
    ``name:``) take the schema's defaults, so a compare variant may tune a default plugin."""
    registry = registry or get_registry()
    model = recipe_model(registry)
    if isinstance(data, dict):
        data = merge_sections(recipe_defaults(registry), data)
    try:
        return model.model_validate(data, context={"registry": registry})
    except ValidationError as exc:
        # Locations inside compare variants refer to the variants merged onto `elastic`.
        shown = merge_variants(data)
        raise RecipeError(format_validation_error(exc, shown, source, model, registry)) from None


def _key_text(key: Any) -> str:
    """A recipe key as it appears in a path: itself, or as YAML writes a key that is not a name
    (``''``, ``true``, ``null``, ``5``)."""
    if isinstance(key, str):
        return key if key and key.strip() == key and "." not in key else repr(key)
    if key is None or isinstance(key, bool):
        return {None: "null", True: "true", False: "false"}[key]
    return repr(key)


def _walk(data: Any, loc: tuple[Any, ...]) -> tuple[list[str], Any, list[Any]]:
    """Follow a pydantic error location through the input, dropping discriminator tags.

    Returns the user-facing path parts, the value found there, and the data nodes visited.
    """
    parts: list[str] = []
    nodes: list[Any] = [data]
    cur: Any = data
    for item in loc:
        if isinstance(cur, dict):
            if item in cur:
                key = next(k for k in cur if k == item)  # True == 1: show the key as the user wrote it
                parts.append(_key_text(key))
                cur = cur[key]
            elif cur.get("name") == item:  # tag pydantic inserts for a discriminated union
                continue
            elif isinstance(item, str) and item.startswith(("function-", "[")):
                continue
            else:
                parts.append(str(item))
                cur = _MISSING
        elif isinstance(cur, list) and isinstance(item, int):
            parts.append(str(item))
            cur = cur[item] if item < len(cur) else _MISSING
        else:
            if isinstance(item, str) and item.startswith(("function-", "[")):
                continue
            parts.append(str(item))
            cur = _MISSING
        nodes.append(cur)
    return parts, cur, nodes


def _section_class(model: type[BaseModel], parts: list[str], data: Any, registry: Registry) -> Any:
    """The pydantic class of the section at ``parts`` (resolving plugin unions by name)."""
    cls: Any = model
    cur = data
    for part in parts:
        if isinstance(cur, list):
            cur = cur[int(part)] if part.isdigit() and int(part) < len(cur) else None
            continue
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            return None
        field = cls.model_fields[part]
        cur = cur.get(part) if isinstance(cur, dict) else None
        if part in PLUGIN_FIELDS:
            name: Any = cur.get("name") if isinstance(cur, dict) else None  # raw data, not validated yet
            kind = PLUGIN_FIELDS[part]
            cls = registry.entry(kind, name).config_class if (kind, name) in registry else None
            continue
        cls = _unwrap(field.annotation)
    return cls


def _unwrap(annotation: Any) -> Any:
    from typing import get_args

    for arg in (annotation, *get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        for inner in get_args(arg):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


_SHOWN_CHARS = 80  # longest value (its repr) or key shown in a validation message
_SHOWN_MESSAGE_CHARS = 1000  # longest message of a validator shown


def _cut(text: str, limit: int = _SHOWN_CHARS) -> str:
    """``text``, or its first ``limit`` characters, an ellipsis and its length."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters in all)"


def _shown(value: Any) -> str:
    """``repr(value)`` for a message, bounded: a megabyte-long value does not flood the terminal."""
    text = repr(value)
    if len(text) <= _SHOWN_CHARS:
        return text
    if isinstance(value, str):
        return f"{value[:_SHOWN_CHARS]!r}… ({len(value):,} characters)"
    return _cut(text)


def format_validation_error(
    exc: ValidationError, data: Any, source: str, model: type[BaseModel], registry: Registry
) -> str:
    """One paragraph for a pydantic error of recipe data: a line per problem, at its key path,
    with the value given (cut to 80 characters) and what was expected."""
    lines = []
    for err in exc.errors(include_url=False):
        parts, value, _ = _walk(data, tuple(err["loc"]))
        path = ".".join(_cut(part) for part in parts) or "<recipe>"
        kind = err["type"]
        if kind == "extra_forbidden":
            section = _section_class(model, parts[:-1], data, registry)
            allowed = sorted(section.model_fields) if section is not None else []
            hint = suggest(parts[-1], allowed) if allowed and len(parts[-1]) <= _SHOWN_CHARS else ""
            lines.append(f"{path}: unknown key; {hint}allowed keys here: {', '.join(allowed) or '(none)'}")
        elif kind in ("union_tag_invalid", "union_tag_not_found"):
            field = parts[-1] if parts else ""
            if len(parts) >= 2 and parts[-2] in LIST_PLUGIN_FIELDS and field.isdigit():  # modes.1
                field = parts[-2]
            plugin_kind = PLUGIN_FIELDS.get(field) or LIST_PLUGIN_FIELDS.get(field, "plugin")
            tag = (err.get("ctx") or {}).get("tag")
            raw = value.get("name", _MISSING) if isinstance(value, dict) else _MISSING
            if raw is not _MISSING and not isinstance(raw, str):  # pydantic shows `name: null` as 'None'
                lines.append(
                    f"{path}.name = {'null' if raw is None else _shown(raw)}: a {plugin_kind} plugin's name (a string) "
                    f"is required; registered: {', '.join(registry.names(plugin_kind)) if plugin_kind != 'plugin' else '?'}"
                )
            elif kind == "union_tag_not_found" or tag is None:
                lines.append(
                    f"{path}.name: required — which {plugin_kind} plugin; registered: "
                    f"{', '.join(registry.names(plugin_kind)) if plugin_kind != 'plugin' else '?'}"
                )
            else:
                lines.append(f"{path}.name = {_shown(tag)}: " + _unknown_name(plugin_kind, tag, registry))
        elif kind == "literal_error" and len(parts) >= 2 and parts[-1] == "name" and parts[-2] in PLUGIN_FIELDS:
            # a kind with a single registered plugin has no union, so no union_tag_invalid
            plugin_kind = PLUGIN_FIELDS[parts[-2]]
            lines.append(f"{path} = {_shown(value)}: " + _unknown_name(plugin_kind, value, registry))
        elif kind == "missing":
            lines.append(f"{path}: required field is missing")
        elif kind == "invalid_key":
            key = err.get("input")
            what = "null" if key is None else "a boolean" if isinstance(key, bool) else f"a {type(key).__name__}"
            lines.append(f"{path}: recipe keys are names (text); this one is {what} "
                         f"(in YAML, quote it: '{_key_text(key)}':)")
        elif kind in ("model_type", "dict_type", "model_attributes_type") and not isinstance(value, dict):
            hint = ""
            if parts and parts[-1] in PLUGIN_FIELDS and isinstance(value, str):
                hint = f"; a plugin section names its plugin, e.g. {parts[-1]}: {{name: {_cut(value)}}}"
            lines.append(f"{path} = {_shown(value)}: expected a section (a mapping of keys to values){hint}")
        else:
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
            msg = _cut(msg, _SHOWN_MESSAGE_CHARS)  # a validator may quote the value it refuses
            shown = "" if value is _MISSING or isinstance(value, (dict, list)) else f" = {_shown(value)}"
            # a check across sections (a model validator of the whole recipe) names its own fields
            lines.append(msg if not parts else f"{path}{shown}: {msg}")
    # a problem of the recipe's `elastic` section reappears in every compare variant merged onto it
    reported = set(lines)
    lines = [line for line in lines if _VARIANT_PREFIX.sub("", line) not in reported - {line}]
    count = len(lines)
    head = f"invalid recipe {source!r} ({count} problem{'s' if count != 1 else ''}):"
    return head + "".join(f"\n  - {line}" for line in lines)


def _unknown_name(plugin_kind: str, name: Any, registry: Registry) -> str:
    """:func:`unknown_name_message` for a name given in a recipe, cut when it is long (no "did you
    mean" for a name far longer than any plugin's)."""
    text = str(name)
    if len(text) <= _SHOWN_CHARS:
        return unknown_name_message(plugin_kind, text, registry.names(plugin_kind))
    listed = ", ".join(sorted(registry.names(plugin_kind))) or "(none registered)"
    return f"unknown {plugin_kind} {_shown(text)}; registered {plugin_kind} names: {listed}"
