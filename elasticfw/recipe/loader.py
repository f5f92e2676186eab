"""Load a recipe: YAML (data only) → inheritance through ``base:`` → ``key=value`` overrides →
interpolation, with OmegaConf. Validation is :mod:`elasticfw.recipe.schema`'s job.

A relative ``base:`` path (one file, or a list merged left to right) is looked for next to the
file that names it, then in each folder of ``ELASTICFW_RECIPE_PATH``, then among the recipes
shipped in the package; ``elasticfw:NAME`` names a shipped recipe only. A plugin section that
names a different plugin replaces the base's (:mod:`elasticfw.recipe.sections`). YAML is data only:
no tags, no key given twice. Bad input of any kind is refused with one
:class:`~elasticfw.errors.RecipeError` line, never a raw exception, a hang or unbounded memory:
file sizes, nesting, values (aliases counted), ``base:`` chains and resolved interpolations are
bounded by the limits of :mod:`elasticfw.recipe.yaml_files`. The rules in full:
``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from elasticfw.errors import RecipeError, suggest
from elasticfw.recipe.sections import PLUGIN_FIELDS, merge_sections  # both also importable from here
from elasticfw.recipe.yaml_files import (
    MAX_BASE_CHAIN,
    MAX_BASE_FILES,
    MAX_DEPTH,
    MAX_INTERPOLATION_CHAIN,
    MAX_OVERRIDE_CHARS,
    MAX_RESOLVED_CHARS,
    MAX_VALUES,
    SHOWN_CHARS,
    _decode,
    _read_bytes,
    _size,
    parse_yaml,
    shorten,
    shown,
)

BASE_KEY = "base"
#: a base path is shown whole in errors up to this length (PATH_MAX); longer values are cut
PATH_CHARS = 4096
RECIPE_PATH_ENV = "ELASTICFW_RECIPE_PATH"
"""Environment variable: folders searched for ``base:`` files not found next to the recipe."""
SHIPPED_PREFIX = "elasticfw:"
"""Prefix of a recipe path that names a recipe shipped inside the installed package."""
_OVERRIDE = re.compile(r"^(?P<key>[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z0-9_\-]+)*)=(?P<value>.*)$", re.S)


def shipped_recipes_dir() -> Path:
    """The folder of the recipes shipped inside the installed elasticfw package (``elasticfw/recipes``)."""
    return Path(str(resources.files("elasticfw") / "recipes"))


def recipe_search_path() -> list[Path]:
    """The folders of ``ELASTICFW_RECIPE_PATH``, in order (empty entries skipped; a relative entry
    is relative to the working directory, as in ``PATH``)."""
    value = os.environ.get(RECIPE_PATH_ENV, "")
    return [Path(entry) for entry in value.split(os.pathsep) if entry]


def _shipped_names() -> list[str]:
    root = shipped_recipes_dir()
    try:
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.yaml"))
    except OSError:
        return []


def _shipped(name: str, where: str) -> Path:
    """``elasticfw:NAME`` → the shipped file's path (which may not exist); ``where`` starts errors."""
    rest = name[len(SHIPPED_PREFIX):]
    if not rest or Path(rest).is_absolute() or ".." in Path(rest).parts:
        raise RecipeError(
            f"{where} {shown(name)} must name a recipe shipped with elasticfw by its path inside the "
            f"package's recipes folder, such as 'elasticfw:demo.yaml' (shipped: {', '.join(_shipped_names()) or 'none'})"
        )
    return shipped_recipes_dir() / rest


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; True for a path that cannot be checked, so that reading it reports why."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return True


def _find_base(base: str, naming: Path) -> Path:
    """The file a ``base:`` entry names, from the recipe ``naming`` (resolved) that names it:
    next to it, then in ``ELASTICFW_RECIPE_PATH``, then among the shipped recipes (see the module
    docstring). Raises a RecipeError that lists every place looked at and how to fix it."""
    where = f"recipe {str(naming)!r}: `base`"
    fixes = (
        f"fix the path; or copy the base next to the recipe; or add the folder that holds it to {RECIPE_PATH_ENV} "
        f"(folders separated by {os.pathsep!r}; for a recipe copied out of a folder of recipes, that folder); "
        "or, where the original recipe's bases are found, write it self-contained with its bases merged in: "
        "`elasticfw recipe resolve ORIGINAL.yaml -o COPY.yaml`"
    )
    if base.startswith(SHIPPED_PREFIX):
        path = _shipped(base, f"{where} file")
        if _exists(path):
            return path
        raise RecipeError(
            f"{where} file {shown(base, PATH_CHARS)} does not exist: it names a recipe shipped with elasticfw, looked for at "
            f"{os.path.abspath(path)!r}; {suggest(base[len(SHIPPED_PREFIX):], _shipped_names())}"
            f"shipped recipes: {', '.join(_shipped_names()) or 'none'}"
        )
    if Path(base).is_absolute():
        if _exists(Path(base)):
            return Path(base)
        raise RecipeError(
            f"{where} file {shown(base, PATH_CHARS)} does not exist (an absolute path is not searched for elsewhere); {fixes}"
        )
    here = naming.parent / base
    if _exists(here):
        return here
    search = [folder / base for folder in recipe_search_path()]
    shipped = shipped_recipes_dir() / base
    for candidate in (*search, shipped):
        if _exists(candidate):
            return candidate
    env = (
        f"then in {RECIPE_PATH_ENV} at " + ", ".join(repr(os.path.abspath(p)) for p in search)
        if search
        else f"then in {RECIPE_PATH_ENV} (not set)"
    )
    raise RecipeError(
        f"{where} file {shown(base, PATH_CHARS)} does not exist; base paths are relative to the folder of the file that names "
        f"them, so it was looked for at {os.path.abspath(here)!r}, {env}, then among the recipes shipped with "
        f"elasticfw at {os.path.abspath(shipped)!r}. To fix it: {fixes}"
    )


def recipe_path(path: str | Path) -> Path:
    """A recipe path as given (``elasticfw:NAME`` for a shipped recipe)."""
    text = str(path)
    return _shipped(text, "recipe path") if text.startswith(SHIPPED_PREFIX) else Path(path)


class _Bases:
    """What one recipe's ``base:`` chain has read: each file once (a base named twice, in a
    diamond, is not read again), and how many files."""

    def __init__(self) -> None:
        self.loaded: dict[Path, dict[str, Any]] = {}
        self.read = 0


def _load_with_bases(
    path: Path, chain: tuple[Path, ...], what: str, missing: str | None, bases_seen: _Bases
) -> dict[str, Any]:
    """``path`` with its bases merged under it. ``what`` names it in errors, ``missing`` is the
    message for a file that does not exist (None: the default of :func:`read_yaml`)."""
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop or a NUL, which reading the file reports
        resolved = Path(os.path.abspath(path))
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise RecipeError(f"recipe inheritance cycle through `base:`: {cycle}")
    if resolved in bases_seen.loaded:
        return bases_seen.loaded[resolved]
    bases_seen.read += 1
    if bases_seen.read > MAX_BASE_FILES:
        raise RecipeError(
            f"{what}: the recipe and its `base:` files are more than {MAX_BASE_FILES} files; "
            "a recipe needs a base or two"
        )
    missing = missing or f"recipe file {str(path)!r} does not exist (looked at {os.path.abspath(path)!r})"
    raw = _read_bytes(path, what, missing)
    data = parse_yaml(_decode(raw, what), what)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            f"{what} must be a mapping of sections (model:, elastic:, ...), found a {type(data).__name__}"
        )
    bases = data.pop(BASE_KEY, None)
    if bases is None:
        bases_seen.loaded[resolved] = data
        return data
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise RecipeError(
            f"recipe {str(resolved)!r}: `base` = {shown(bases)} must be a path or a list of paths to recipe files"
        )
    if len(chain) + 1 >= MAX_BASE_CHAIN:
        names = " -> ".join(str(p) for p in (*chain, resolved))
        raise RecipeError(
            f"recipe {str(resolved)!r}: the chain of `base:` files is deeper than {MAX_BASE_CHAIN} files "
            f"({shorten(names, 400)}); a recipe needs a base or two"
        )
    merged: dict[str, Any] = {}
    for base in bases:
        base_path = _find_base(base, resolved)
        base_missing = f"recipe {str(resolved)!r}: `base` file {shown(base, PATH_CHARS)} was found at {str(base_path)!r} but is gone"
        base_what = f"base file {str(base_path)!r} (named by `base:` in {str(resolved)!r})"
        loaded = _load_with_bases(base_path, (*chain, resolved), base_what, base_missing, bases_seen)
        merged = merge_sections(merged, loaded)
    merged = merge_sections(merged, data)
    bases_seen.loaded[resolved] = merged
    return merged


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b.c=value`` → (``a.b.c``, parsed YAML value)."""
    if len(text) > MAX_OVERRIDE_CHARS:
        raise RecipeError(
            f"override {text[:SHOWN_CHARS]!r}… is {len(text):,} characters long, more than the {MAX_OVERRIDE_CHARS:,} an "
            "override may have; put a long value in the recipe file"
        )
    match = _OVERRIDE.match(text)
    if match is None:
        raise RecipeError(
            f"override {shown(text)} is not of the form dotted.key=value (for example "
            "elastic.sparse_mode.sink_tokens=64 or compare.0.label=dense)"
        )
    key, raw = match.group("key"), match.group("value")
    parts = key.count(".") + 1
    if parts > MAX_DEPTH:
        raise RecipeError(
            f"override {shown(text)}: the key has {parts} parts, more than the {MAX_DEPTH} levels a recipe may "
            "nest; a recipe needs only a few"
        )
    value = parse_yaml(raw, f"the value of override {shown(text)}") if raw.strip() else ""
    height = _height(value)
    if parts + height > MAX_DEPTH:
        raise RecipeError(
            f"override {shown(text)}: its key ({parts} levels) and value ({height} levels of lists and mappings) "
            f"nest deeper than the {MAX_DEPTH} levels a recipe may; a recipe needs only a few"
        )
    return key, value


def _height(value: Any) -> int:
    """Levels of lists and mappings in parsed YAML (bounded by :data:`MAX_DEPTH` when parsed)."""
    if isinstance(value, dict):
        return 1 + max((_height(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_height(v) for v in value), default=0)
    return 0


# -- interpolations -------------------------------------------------------------------------------

_REFERENCE = re.compile(r"\.*[A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]+|\[\d+\])*")


def _references(text: str) -> list[str]:
    """Every key path that may be referred to inside the ``${...}`` of ``text`` (resolver names,
    arguments and nested interpolations included: counting too much is safe, too little not)."""
    found: list[str] = []
    start = text.find("${")
    while start != -1:
        depth, i, end = 0, start, len(text)
        while i < len(text):
            if text.startswith("${", i):
                depth += 1
                i += 2
                continue
            if text[i] == "}":
                depth -= 1
                if depth == 0:
                    end = i
                    break
            i += 1
        found.extend(_REFERENCE.findall(text, start + 2, end))
        start = text.find("${", end)
    return found


def _lookup(root: Any, path: tuple[Any, ...], reference: str) -> tuple[Any, ...] | None:
    """The path of the node ``reference`` names from the node at ``path`` (None: no such node)."""
    dots = len(reference) - len(reference.lstrip("."))
    if dots > len(path):
        return None
    target: tuple[Any, ...] = path[: len(path) - dots] if dots else ()
    node = root
    for part in target:
        node = node[part]
    for part in re.split(r"[.\[\]]+", reference[dots:]):
        if not part:
            continue
        if isinstance(node, dict) and part in node:
            key: Any = part
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            key = int(part)
        else:
            return None
        node = node[key]
        target = (*target, key)
    return target


def _check_interpolations(root: dict[Any, Any], source: str) -> None:
    """Refuse a recipe (plain data, interpolations not resolved) that would resolve into too many
    values or characters, too deep a nesting or too long a chain of interpolations — before
    OmegaConf expands anything. Linear in the recipe: each node is counted once, an interpolation
    counts the node it refers to as often as it refers to it. Also bounds in-memory recipe data
    (``load_recipe_dict(data=...)``), which no YAML reader has checked: a list that contains
    itself is refused as too deep."""
    # path -> (values, characters, height, chain of interpolations, whether an interpolation counts)
    done: dict[tuple[Any, ...], tuple[int, int, int, int, bool]] = {}
    edges: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
    stack: list[tuple[tuple[Any, ...], Any, bool]] = [((), root, False)]
    while stack:
        path, node, ready = stack.pop()
        if path in done:
            continue
        where = f"the value at {shorten('.'.join(str(p) for p in path))!r}" if path else "the recipe"
        if not ready:
            if path in edges:  # on the current path: a cycle of interpolations, which OmegaConf reports
                continue
            if isinstance(node, (dict, list)) and len(path) >= MAX_DEPTH:
                raise RecipeError(
                    f"recipe {source!r}: {where} is nested deeper than {MAX_DEPTH} levels of lists and mappings; "
                    "a recipe needs only a few"
                )
            if isinstance(node, dict):
                targets = [(*path, k) for k in node]
                children = list(node.values())
            elif isinstance(node, list):
                targets = [(*path, i) for i in range(len(node))]
                children = list(node)
            elif isinstance(node, str) and "${" in node:
                found = (_lookup(root, path, ref) for ref in _references(node))
                targets = [t for t in found if t is not None]
                children = [_value_at(root, t) for t in targets]
            else:
                targets, children = [], []
            edges[path] = targets
            stack.append((path, node, True))
            stack.extend((t, child, False) for t, child in zip(targets, children) if t not in done)
            continue
        counted = [done[t] for t in edges[path] if t in done]  # a target not done is a cycle: skipped
        interpolated = any(c[4] for c in counted)
        if isinstance(node, (dict, list)):
            values = 1 + sum(c[0] for c in counted)
            chars = sum(c[1] for c in counted)
            height = 1 + max((c[2] for c in counted), default=0)
            chain = max((c[3] for c in counted), default=0)
        elif isinstance(node, str) and edges[path]:
            values = 1 + sum(c[0] for c in counted)
            chars = len(node) + sum(c[1] for c in counted)
            height = max((c[2] for c in counted), default=0)
            chain = 1 + max((c[3] for c in counted), default=0)
            interpolated = True
        else:
            values, chars, height, chain = 1, len(node) if isinstance(node, str) else 0, 0, 0
        resolved = " once its interpolations ${...} are resolved" if interpolated else ""
        if values > MAX_VALUES:
            raise RecipeError(
                f"recipe {source!r}: {where} holds more than {MAX_VALUES:,} values{resolved}; a recipe holds at "
                "most a few hundred"
            )
        if chars > MAX_RESOLVED_CHARS:
            raise RecipeError(
                f"recipe {source!r}: {where} holds more than {_size(MAX_RESOLVED_CHARS)} of text{resolved}; "
                "a recipe is short"
            )
        if height > MAX_DEPTH:
            raise RecipeError(
                f"recipe {source!r}: {where} nests lists and mappings deeper than {MAX_DEPTH} levels{resolved}; "
                "a recipe needs only a few"
            )
        if chain > MAX_INTERPOLATION_CHAIN:
            raise RecipeError(
                f"recipe {source!r}: {where} refers through more than {MAX_INTERPOLATION_CHAIN} interpolations "
                "in a row (${a} refers to a value that is ${b}, which is ${c} ...); refer to the value itself"
            )
        done[path] = (values, chars, height, chain, interpolated)


def _value_at(root: Any, path: tuple[Any, ...]) -> Any:
    node = root
    for part in path:
        node = node[part]
    return node


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
    # the value as written, unresolved: an interpolation there may be what this override replaces
    child = node._get_node(last) if last in node else None
    current = OmegaConf.to_container(child, resolve=False) if isinstance(child, (DictConfig, ListConfig)) else (
        child._value() if child is not None else None)
    if last == "name" and len(parts) > 1 and parts[-2] in PLUGIN_FIELDS and current is not None and current != value:
        # naming a different plugin replaces its section, as in a file that overrides a base
        for other in list(node.keys()):
            del node[other]
    if isinstance(child, DictConfig) and isinstance(value, dict):
        merged = merge_sections(current, value, last)
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
    that does not name its model). ``path`` may be ``elasticfw:NAME``, a recipe shipped with
    elasticfw.
    """
    return _merge(path, overrides, data=data, defaults=defaults, interpolate=True)


def resolve_recipe_bases(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """A recipe file with its ``base:`` files merged in and ``overrides`` applied, as plain data: a
    self-contained recipe that loads to the same validated recipe wherever it is copied.

    Nothing else changes: ``${...}`` interpolations stay as written (they resolve when the result
    is loaded) and the schema's defaults are not filled in. ``elasticfw recipe resolve`` writes it."""
    return _merge(path, overrides, data=None, defaults=None, interpolate=False)


def _merge(
    path: str | Path | None,
    overrides: list[str] | tuple[str, ...],
    *,
    data: dict | None,
    defaults: dict[str, Any] | None,
    interpolate: bool,
) -> dict[str, Any]:
    if (path is None) == (data is None):
        raise RecipeError("give exactly one of a recipe path or recipe data")
    source = str(path) if path is not None else "<data>"
    try:
        if path is not None:
            raw = _load_with_bases(recipe_path(path), (), f"recipe {source!r}", None, _Bases())
        else:
            raw = dict(data or {})
        # bounds the merged files (or in-memory data, which no YAML reader checked) before OmegaConf
        # recurses into them; checked again with the defaults and overrides below
        _check_interpolations(raw, source)
        cfg = OmegaConf.create(merge_sections(defaults, raw) if defaults else raw)
        for text in overrides:
            key, value = parse_override(text)
            apply_override(cfg, key, value)
        unresolved = OmegaConf.to_container(cfg, resolve=False)
        assert isinstance(unresolved, dict)
        _check_interpolations(unresolved, source)
        if not interpolate:
            return unresolved  # type: ignore[return-value]
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        bad_key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        where = f" at {shorten(str(bad_key))}" if bad_key else ""
        first = shorten(str(exc).splitlines()[0], 400)
        raise RecipeError(f"recipe {source!r}: cannot resolve{where}: {first}") from None
    assert isinstance(resolved, dict)
    return resolved  # type: ignore[return-value]
