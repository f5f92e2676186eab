"""Reading recipe files safely: bytes → UTF-8 text → YAML data, with the limits that keep a bad
file from costing more than a clear error (see :mod:`elasticfw.recipe.loader` for the list).

YAML is read as data only: no tags (``!!python/...`` is refused, never constructed), a key given
twice in one mapping is an error rather than a silent last-one-wins, keys must be names, and
depth and size (aliases included) are counted while the text is read.
"""

from __future__ import annotations

import codecs
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from elasticfw.errors import RecipeError

_SCALAR_KEYS = (str, int, float, bool, type(None))
MAX_RECIPE_BYTES = 1 << 20
"""Largest recipe or ``base:`` file read (1 MiB); a larger one is refused before it is parsed."""
MAX_OVERRIDE_CHARS = 1 << 16
"""Longest ``key=value`` override (65,536 characters)."""
MAX_DEPTH = 32
"""Deepest nesting of lists and mappings (the recipe's top mapping is level 1)."""
MAX_VALUES = 10_000
"""Most values (scalars, lists, mappings) in one YAML text with its aliases repeated, and in the
recipe with its interpolations resolved."""
MAX_RESOLVED_CHARS = 4 << 20
"""Most characters of text in the recipe once its interpolations are resolved (4 MiB)."""
MAX_INTERPOLATION_CHAIN = 16
"""Most interpolations one ``${...}`` may refer through in a row (``a: ${b}``, ``b: ${c}``, ...)."""
MAX_BASE_CHAIN = 16
"""Deepest chain of ``base:`` files (a base of a base of ...)."""
MAX_BASE_FILES = 64
"""Most files read for one recipe, the recipe and all its bases."""
SHOWN_CHARS = 80
"""Longest value (its ``repr``) shown in a message before it is cut."""


def shorten(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` if it is at most ``limit`` characters, else its start, an ellipsis and its length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} characters in all)"


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for a message, cut to about ``limit`` characters: a long string shows its
    start and its length, another value the start of its ``repr`` and that ``repr``'s length."""
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, str):
        return f"{value[:limit]!r}… ({len(value):,} characters)"
    return shorten(text, limit)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


# -- reading a file --------------------------------------------------------------------------------

_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"%PDF-", "a PDF document"),
    (b"PK\x03\x04", "a zip archive (a PyTorch checkpoint is one)"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"GGUF", "a GGUF model file"),
    (b"\x7fELF", "an executable"),
)


def _binary_kind(head: bytes) -> str | None:
    """What a file that starts with ``head`` looks like, if it is a well-known binary format."""
    for signature, kind in _SIGNATURES:
        if head.startswith(signature):
            return kind
    # safetensors: an 8-byte little-endian header length, then the JSON header
    if len(head) >= 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < 1 << 32:
        return "a safetensors file"
    return None


def _line_column(data: bytes, offset: int) -> str:
    line_start = data.rfind(b"\n", 0, offset) + 1
    column = len(data[line_start:offset].decode("utf-8", "replace")) + 1
    line = data.count(b"\n", 0, offset) + 1
    return f"line {line}, column {column}"


def _decode(data: bytes, what: str) -> str:
    """UTF-8 text of a recipe file, or a RecipeError saying why it is not."""
    expected = "a recipe is YAML text saved as UTF-8"
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise RecipeError(
            f"{what} is not UTF-8 text: it starts with a UTF-16 byte-order mark; {expected} (re-save it as UTF-8)"
        )
    kind = _binary_kind(data[:16])
    if kind is not None:
        raise RecipeError(f"{what} is not UTF-8 text: it looks like {kind}, not a recipe; {expected}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if b"\x00" in data:
            raise RecipeError(
                f"{what} is not UTF-8 text: it looks like a binary file (it holds NUL bytes and bytes that "
                f"are not UTF-8); {expected}"
            ) from None
        raise RecipeError(
            f"{what} is not UTF-8 text: byte 0x{data[exc.start]:02X} at {_line_column(data, exc.start)} is not "
            f"valid UTF-8 (was it saved as Latin-1, Windows-1252 or another legacy encoding?); {expected}"
        ) from None
    nul = data.find(b"\x00")
    if nul != -1:
        raise RecipeError(
            f"{what} is not UTF-8 text: it holds a NUL byte at {_line_column(data, nul)}, as UTF-16 text and "
            f"binary files do; {expected}"
        )
    return text


def _read_bytes(path: Path, what: str, missing: str) -> bytes:
    """The bytes of a recipe file, refusing what is not a readable regular file of a recipe's size.
    ``missing`` is the whole message for a file that does not exist."""
    try:
        info = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise RecipeError(missing) from None
    except PermissionError:
        raise RecipeError(
            f"{what} cannot be read: permission denied on it or on a folder above it (looked at "
            f"{os.path.abspath(path)!r})"
        ) from None
    except OSError as exc:
        raise RecipeError(f"{what} cannot be read: {exc.strerror or exc}") from None
    except ValueError:  # a NUL character in the path
        raise RecipeError(f"{what} is not a usable path: it holds a NUL character") from None
    if stat.S_ISDIR(info.st_mode):
        raise RecipeError(f"{what} is a folder, not a recipe file (give the path of a .yaml file)")
    if not stat.S_ISREG(info.st_mode):
        raise RecipeError(f"{what} is not a regular file (it is a device, a pipe or a socket), not a recipe file")
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_RECIPE_BYTES + 1)
    except PermissionError:
        raise RecipeError(
            f"{what} cannot be read: permission denied (the file's permissions do not let you read it)"
        ) from None
    except OSError as exc:
        raise RecipeError(f"{what} cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_RECIPE_BYTES or info.st_size > MAX_RECIPE_BYTES:
        size = max(info.st_size, len(data))
        kind = _binary_kind(data[:16])
        looks = f"it looks like {kind}, not a recipe" if kind else "is this the right file?"
        raise RecipeError(
            f"{what} is {_size(size)} ({size:,} bytes), more than the {_size(MAX_RECIPE_BYTES)} a recipe file "
            f"may have: a recipe is a short YAML text file; {looks}"
        )
    return data


# -- parsing YAML ---------------------------------------------------------------------------------


class _LimitError(Exception):
    """Well-formed YAML beyond a limit of :mod:`elasticfw.recipe.loader` (or an endless alias)."""

    def __init__(self, problem: str, mark: Any = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.mark = mark


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys, deep nesting, too many values (aliases
    repeated) and an alias used inside its own anchor."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0  # lists and mappings open around the node being composed
        self._composed = 0
        self._aliases = 0
        self._open_anchors: list[str] = []

    def construct_document(self, node: Any) -> Any:
        # where each mapping sits (its keys' path from the top), for the messages about its keys
        self._paths: dict[int, str] = {}
        stack: list[tuple[Any, str]] = [(node, "")]
        while stack:
            current, path = stack.pop()
            if id(current) in self._paths:  # an alias: its first place names it
                continue
            if isinstance(current, yaml.MappingNode):
                self._paths[id(current)] = path
                for key, value in current.value:
                    name = key.value if isinstance(key, yaml.ScalarNode) else "?"
                    stack.append((value, f"{path}.{name}" if path else str(name)))
            elif isinstance(current, yaml.SequenceNode):
                self._paths[id(current)] = path
                stack.extend((item, f"{path}.{i}" if path else str(i)) for i, item in enumerate(current.value))
        return super().construct_document(node)

    def mapping_path(self, node: Any) -> str:
        """The dotted path of mapping ``node`` in the document ('' at the top)."""
        return getattr(self, "_paths", {}).get(id(node), "")

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open_anchors:
                raise _LimitError(
                    f"the alias *{shorten(event.anchor)} is used inside its own anchor &{shorten(event.anchor)}, "
                    "which would make an endless structure",
                    event.start_mark,
                )
            self._aliases += 1
            return super().compose_node(parent, index)
        self._composed += 1
        if self._composed > MAX_VALUES:
            raise _LimitError(
                f"holds more than {MAX_VALUES:,} keys and values; a recipe holds at most a few hundred", event.start_mark
            )
        collection = isinstance(event, yaml.CollectionStartEvent)
        if collection and self._depth >= MAX_DEPTH:
            raise _LimitError(
                f"lists and mappings are nested deeper than {MAX_DEPTH} levels; a recipe needs only a few",
                event.start_mark,
            )
        anchor = event.anchor
        self._depth += collection
        if anchor is not None:
            self._open_anchors.append(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= collection
            if anchor is not None:
                self._open_anchors.pop()

    def compose_document(self) -> Any:
        node = super().compose_document()
        if self._aliases:
            _check_aliases(node)
        return node


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_aliases(root: Any) -> None:
    """Refuse a node graph (aliases shared) whose tree, the aliases repeated, is too big or deep.
    Linear in the graph: each node's expanded count and height is computed once. What a merge key
    (``<<: *name``, ``<<: [*a, *b]``) brings lands in the mapping that holds it, not a level below."""
    done: dict[int, tuple[int, int]] = {}  # id(node) -> (values, height)
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, ready = stack.pop()
        if id(node) in done:
            continue
        children: list[tuple[Any, int]] = []  # (child, levels it sits below this node)
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                merged = key.tag == _MERGE_TAG
                children += [(key, 1), (value, 0 if merged and isinstance(value, yaml.MappingNode) else
                                        -1 if merged and isinstance(value, yaml.SequenceNode) else 1)]
        elif isinstance(node, yaml.SequenceNode):
            children = [(child, 1) for child in node.value]
        if not ready:  # the composer refused cycles, so a node is never its own descendant
            stack.append((node, True))
            stack.extend((child, False) for child, _ in children if id(child) not in done)
            continue
        values = 1 + sum(done[id(child)][0] for child, _ in children)
        height = 0 if isinstance(node, yaml.ScalarNode) else max(
            [1, *(done[id(child)][1] + below for child, below in children)]
        )
        if values > MAX_VALUES:
            raise _LimitError(
                f"holds more than {MAX_VALUES:,} keys and values once its aliases (*name) are repeated; a recipe holds "
                "at most a few hundred",
                node.start_mark,
            )
        if height > MAX_DEPTH:
            raise _LimitError(
                f"lists and mappings are nested deeper than {MAX_DEPTH} levels once its aliases (*name) are "
                "repeated; a recipe needs only a few",
                node.start_mark,
            )
        done[id(node)] = (values, height)


def _yaml_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    return f"a {type(value).__name__}"


def _construct_mapping(loader: _RecipeLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    first_line: dict[Any, int] = {}
    path = loader.mapping_path(node)
    inside = f" of {path}" if path else ""
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:
            continue
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key_node, yaml.ScalarNode) and not isinstance(key, str):
            raise yaml.constructor.ConstructorError(
                None, None, f"the key {key_node.value!r}{inside} reads as {_yaml_kind(key)}, but recipe keys are "
                f"names; quote it ('{key_node.value}':) if you meant the text", key_node.start_mark
            )
        if isinstance(key, _SCALAR_KEYS) and key in first_line:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {shown(key)}{inside} is given twice (first at line {first_line[key]})",
                key_node.start_mark,
            )
        if isinstance(key, _SCALAR_KEYS):
            first_line[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_RecipeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _where(mark: Any) -> str:
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def parse_yaml(text: str, what: str) -> Any:
    """Parse YAML as plain data (``what`` names the text in errors), within this module's limits."""
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # a SafeLoader subclass: data only
    except _LimitError as exc:
        raise RecipeError(f"{what}{_where(exc.mark)}: {exc.problem}") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (control characters)
        position = min(max(exc.position, 0), len(text))
        line = text.count("\n", 0, position) + 1
        column = position - (text.rfind("\n", 0, position) + 1) + 1
        char = exc.character if isinstance(exc.character, int) else ord(exc.character[:1] or "\0")
        raise RecipeError(
            f"{what} is not valid YAML at line {line}, column {column}: the character U+{char:04X} is not "
            "allowed (control characters other than tab and line breaks cannot appear in YAML text)"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        tag = re.match(r"could not determine a constructor for the tag '?([^']*)'?", problem)
        if tag is not None:
            problem = (
                f"the tag {shown(tag.group(1))} is not allowed: recipes are plain data (mappings, lists, "
                "strings, numbers, booleans, null), never code"
            )
        context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and context_mark is not None and mark is not None and context_mark.line != mark.line:
            problem = f"{problem} ({context}{_where(context_mark)})"
        raise RecipeError(f"{what} is not valid YAML{_where(mark)}: {shorten(problem, 400)}") from None


def read_yaml(path: Path, what: str | None = None) -> dict[str, Any]:
    """Parse one YAML file safely (no tags, no code, within this module's limits) into a dict.
    ``what`` names the file in errors (default ``recipe 'PATH'``)."""
    what = what or f"recipe {str(path)!r}"
    data = _read_bytes(
        path, what, f"recipe file {str(path)!r} does not exist (looked at {os.path.abspath(path)!r})"
    )
    data = parse_yaml(_decode(data, what), what)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(
            f"{what} must be a mapping of sections (model:, elastic:, ...), found a {type(data).__name__}"
        )
    return data


