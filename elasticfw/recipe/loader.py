"""Load a recipe: YAML (data only) → inheritance through ``base:`` → ``key=value`` overrides →
interpolation, with OmegaConf. Validation is :mod:`elasticfw.recipe.schema`'s job.

A recipe file may name one or more base files (paths relative to the file)::

    base: _base/passkey.yaml        # or a list, merged left to right
    elastic:
      sparse_mode: {name: streaming, sink_tokens: 64}

A plugin section (``elastic.sparse_mode``, ``elastic.router``, ``eval.task`` ...) is *replaced*,
not merged, when the overriding file names a different plugin: parameters of one plugin never
leak into another's. (``model:`` also has a ``name:`` but is an ordinary section: it merges.)
The same holds for an override ``elastic.sparse_mode.name=full`` (parameter overrides of the
new plugin go after it).

YAML is read as data only: no tags (``!!python/...`` is refused, never constructed), and a key
given twice in one mapping is an error rather than a silent last-one-wins.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from elasticfw.errors import RecipeError
from elasticfw.recipe.schema import PLUGIN_FIELDS

BASE_KEY = "base"
_OVERRIDE = re.compile(r"^(?P<key>[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z0-9_\-]+)*)=(?P<value>.*)$", re.S)
_SCALAR_KEYS = (str, int, float, bool, type(None))


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys."""


def _construct_mapping(loader: _RecipeLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, _SCALAR_KEYS) and key in first_line:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (first at line {first_line[key]})", key_node.start_mark
            )
        if isinstance(key, _SCALAR_KEYS):
            first_line[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_RecipeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def parse_yaml(text: str, what: str) -> Any:
    """Parse YAML as plain data (``what`` names the text in errors)."""
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # a SafeLoader subclass: data only
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        tag = re.match(r"could not determine a constructor for the tag '?([^']*)'?", problem)
        if tag is not None:
            problem = (
                f"the tag {tag.group(1)!r} is not allowed: recipes are plain data (mappings, lists, "
                "strings, numbers, booleans, null), never code"
            )
        raise RecipeError(f"{what} is not valid YAML{where}: {problem}") from None


def read_yaml(path: Path) -> dict[str, Any]:
    """Parse one YAML file safely (no tags, no code) into a dict."""
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} does not exist (looked at {str(path.resolve())!r})")
    data = parse_yaml(path.read_text(encoding="utf-8"), f"recipe {str(path)!r}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(
            f"recipe {str(path)!r} must be a mapping of sections (model:, elastic:, ...), "
            f"found a {type(data).__name__}"
        )
    return data


def merge_sections(base: Any, override: Any, key: str | None = None) -> Any:
    """Deep merge where a plugin section (``key`` in :data:`PLUGIN_FIELDS`) naming a different
    plugin replaces the base section. Other sections with a ``name`` (``model:``) merge."""
    if isinstance(base, dict) and isinstance(override, dict):
        if key in PLUGIN_FIELDS and "name" in override and "name" in base and override["name"] != base["name"]:
            return dict(override)
        merged = dict(base)
        for k, value in override.items():
            merged[k] = merge_sections(base[k], value, k) if k in base else value
        return merged
    return override


def _load_with_bases(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise RecipeError(f"recipe inheritance cycle through `base:`: {cycle}")
    data = read_yaml(path)
    bases = data.pop(BASE_KEY, None)
    if bases is None:
        return data
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise RecipeError(
            f"recipe {str(path)!r}: `base` = {bases!r} must be a path or a list of paths to recipe files"
        )
    merged: dict[str, Any] = {}
    for base in bases:
        base_path = (path.parent / base)
        if not base_path.is_file():
            raise RecipeError(
                f"recipe {str(path)!r}: `base` file {base!r} does not exist (resolved to {str(base_path.resolve())!r})"
            )
        merged = merge_sections(merged, _load_with_bases(base_path, (*chain, path)))
    return merge_sections(merged, data)


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b.c=value`` → (``a.b.c``, parsed YAML value)."""
    match = _OVERRIDE.match(text)
    if match is None:
        raise RecipeError(
            f"override {text!r} is not of the form dotted.key=value (for example "
            "elastic.sparse_mode.sink_tokens=64 or compare.0.label=dense)"
        )
    raw = match.group("value")
    value = parse_yaml(raw, f"the value of override {text!r}") if raw.strip() else ""
    return match.group("key"), value


def apply_override(cfg: DictConfig, key: str, value: Any) -> None:
    parts = key.split(".")
    node: Any = cfg
    for i, part in enumerate(parts[:-1]):
        where = ".".join(parts[: i + 1])
        if isinstance(node, ListConfig):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(f"override {key}=...: {where!r} is not an index of a list of {len(node)} items")
            node = node[int(part)]
        elif isinstance(node, DictConfig):
            if part not in node or node[part] is None:
                node[part] = {}
            node = node[part]
        else:
            raise RecipeError(f"override {key}=...: {where!r} holds a value, not a section")
    last = parts[-1]
    if isinstance(node, ListConfig):
        if not last.isdigit() or int(last) >= len(node):
            raise RecipeError(f"override {key}=...: {last!r} is not an index of a list of {len(node)} items")
        node[int(last)] = value
        return
    if not isinstance(node, DictConfig):
        raise RecipeError(f"override {key}=...: the parent of {last!r} holds a value, not a section")
    current = node.get(last) if last in node else None
    if last == "name" and len(parts) > 1 and parts[-2] in PLUGIN_FIELDS and current is not None and current != value:
        # naming a different plugin replaces its section, as in a file that overrides a base
        for other in list(node.keys()):
            del node[other]
    if isinstance(current, DictConfig) and isinstance(value, dict):
        merged = merge_sections(OmegaConf.to_container(current, resolve=False), value, last)
        node[last] = merged
    else:
        node[last] = value


def load_recipe_dict(
    path: str | Path | None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    data: dict | None = None,
    defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Resolve a recipe file (or an in-memory ``data`` dict) with its overrides into plain data.

    ``defaults`` (the schema's default recipe) lie underneath the file, as if they were its first
    base: overrides and ``${...}`` interpolations see them (``${model.name}`` works in a recipe
    that does not name its model).
    """
    if (path is None) == (data is None):
        raise RecipeError("give exactly one of a recipe path or recipe data")
    try:
        raw = _load_with_bases(Path(path), ()) if path is not None else dict(data or {})
        cfg = OmegaConf.create(merge_sections(defaults, raw) if defaults else raw)
        for text in overrides:
            key, value = parse_override(text)
            apply_override(cfg, key, value)
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        bad_key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        where = f" at {bad_key}" if bad_key else ""
        first = str(exc).splitlines()[0]
        raise RecipeError(f"recipe {str(path or '<data>')!r}: cannot resolve{where}: {first}") from None
    assert isinstance(resolved, dict)
    return resolved  # type: ignore[return-value]
