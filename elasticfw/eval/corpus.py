"""Offline prose for haystacks: paragraphs split between ``"train"`` and ``"eval"``.

Long-context retrieval tasks hide facts (needles) inside irrelevant text (the haystack). Real
prose makes a harder and more natural haystack than a repeated filler sentence, but elasticfw
runs without network, so the default corpus is text every Python installation carries: the
docstrings of a fixed list of standard-library modules (:data:`STDLIB_MODULES`), read from
their source files with :mod:`ast` (nothing is imported). A recipe may name its own text
files or directories instead (read as UTF-8).

Paragraphs are normalised (whitespace collapsed, reST roles and backticks removed, code and
doctest blocks dropped, long blocks cut at sentence ends) and filtered (at least
:data:`MIN_WORDS` words, mostly letters, no run of four or more digits, so that the numbers a
task hides stay the only long numbers in its prompt). Each distinct paragraph belongs to one
split, chosen by a stable hash of its text (:func:`split_of`), so a train prompt and an eval
prompt never share haystack text. The default corpus is fixed for a given Python version;
docstrings differ a little between versions.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import math
import random
import re
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticfw.errors import UnsupportedInputError
from elasticfw.eval.task import SPLITS, Split, check_split

#: standard-library modules whose docstrings form the default corpus (present, as Python
#: sources, on CPython 3.10 to 3.13; a name maps to ``name/as/path.py`` or ``.../__init__.py``)
STDLIB_MODULES: tuple[str, ...] = tuple(sorted((
    "_collections_abc", "_pydecimal", "_pyio", "_strptime", "abc", "argparse", "ast", "asyncio.events",
    "asyncio.locks", "asyncio.queues", "asyncio.streams", "asyncio.tasks", "base64", "bdb", "bisect",
    "calendar", "cmd", "code", "codecs", "collections", "colorsys", "concurrent.futures._base",
    "configparser", "contextlib", "copy", "csv", "ctypes", "dataclasses", "datetime", "difflib", "dis",
    "doctest", "email.charset", "email.feedparser", "email.generator", "email.header",
    "email.headerregistry", "email.message", "email.policy", "email.utils", "enum", "filecmp",
    "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob",
    "graphlib", "gzip", "hashlib", "heapq", "hmac", "html.parser", "http.client", "http.cookiejar",
    "http.cookies", "http.server", "imaplib", "importlib.util", "inspect", "ipaddress", "json",
    "json.decoder", "json.encoder", "keyword", "linecache", "locale", "logging", "logging.config",
    "logging.handlers", "lzma", "mailbox", "mimetypes", "modulefinder", "multiprocessing.managers",
    "multiprocessing.pool", "netrc", "numbers", "operator", "optparse", "os", "pdb", "pickle",
    "pickletools", "pkgutil", "platform", "plistlib", "poplib", "pprint", "profile", "pstats",
    "py_compile", "pyclbr", "pydoc", "queue", "quopri", "random", "reprlib", "rlcompleter", "sched",
    "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver", "ssl",
    "stat", "statistics", "string", "struct", "subprocess", "symtable", "tabnanny", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace", "traceback", "tracemalloc",
    "types", "typing", "unittest.case", "unittest.mock", "urllib.parse", "urllib.request", "uuid",
    "warnings", "wave", "weakref", "webbrowser", "xml.dom.minidom", "xml.etree.ElementTree",
    "xml.sax.handler", "zipapp", "zipimport", "xmlrpc.client", "xmlrpc.server", "xml.sax.xmlreader",
    "asyncio.base_events", "asyncio.futures", "asyncio.protocols", "asyncio.transports", "bz2",
    "email._header_value_parser", "email._policybase", "importlib.abc", "pathlib", "re",
    "unittest.loader", "wsgiref.handlers", "zipfile",
)))
#: a paragraph shorter than this is dropped
MIN_WORDS = 12
#: blocks longer than this are cut at sentence ends into paragraphs of at most about this many words
MAX_WORDS = 60

_ROLE = re.compile(r":[A-Za-z_][\w.+-]*:(?=`)")
_LONG_NUMBER = re.compile(r"\d{4,}")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.|\$ |[{}\[\]()]\s*$)")


# -- splits ------------------------------------------------------------------------------------------


def split_of(text: str) -> Split:
    """The split ``text`` belongs to: a stable 50/50 partition by hash (same on every machine)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, person=b"elasticfw-split").digest()
    return "eval" if digest[0] & 1 else "train"


def draw_for_split(rng: random.Random, make: Callable[[random.Random], str], split: Split,
                   used: set[str] | None = None, *, attempts: int = 10_000) -> str:
    """Draw ``make(rng)`` until the result belongs to ``split`` (:func:`split_of`) and is not in
    ``used``; add it to ``used``. Needles drawn this way are never shared between the splits."""
    check_split(split)
    for _ in range(attempts):
        value = make(rng)
        if split_of(value) == split and (used is None or value not in used):
            if used is not None:
                used.add(value)
            return value
    raise UnsupportedInputError(
        f"could not draw a new value of split {split!r} in {attempts} attempts ({len(used or ())} already used): "
        "the space of values is too small for the sample; use longer values or fewer of them"
    )


# -- normalisation -----------------------------------------------------------------------------------


def _is_prose(paragraph: str) -> bool:
    words = paragraph.split()
    if len(words) < MIN_WORDS or _LONG_NUMBER.search(paragraph):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in paragraph)
    return letters >= 0.85 * len(paragraph) and paragraph[0].isupper()


def _cut(block: str) -> list[str]:
    """Split a long block at sentence ends into pieces of at most about MAX_WORDS words."""
    if len(block.split()) <= MAX_WORDS:
        return [block]
    pieces: list[str] = []
    current: list[str] = []
    count = 0
    for sentence in _SENTENCE_END.split(block):
        n = len(sentence.split())
        if current and count + n > MAX_WORDS:
            pieces.append(" ".join(current))
            current, count = [], 0
        current.append(sentence)
        count += n
    if current:
        pieces.append(" ".join(current))
    return pieces


def prose_paragraphs(text: str) -> list[str]:
    """Normalised prose paragraphs of ``text``: blocks separated by blank lines, code-like and
    indented blocks dropped, whitespace collapsed, reST roles and backticks removed, long blocks
    cut at sentence ends, then filtered (:data:`MIN_WORDS`, mostly letters, no long numbers)."""
    out: list[str] = []
    for block in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n").replace("\r", "\n")):
        lines = [line for line in block.split("\n") if line.strip()]
        if not lines or any(_CODE_LINE.match(line) for line in lines):
            continue
        indent = min(len(line) - len(line.lstrip()) for line in lines)
        if any(len(line) - len(line.lstrip()) > indent + 2 for line in lines[1:]):
            continue  # a nested list, a table or a code sample
        if lines[0].rstrip().endswith("::"):
            continue
        joined = " ".join(" ".join(lines).split())
        joined = _ROLE.sub("", joined).replace("`", "").replace("*", "")
        joined = " ".join(joined.split())
        out.extend(p for p in _cut(joined) if _is_prose(p))
    return out


# -- sources -----------------------------------------------------------------------------------------


def _stdlib_file(module: str) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise UnsupportedInputError(
        f"the default haystack corpus reads docstrings from the standard library's sources, but "
        f"{module!r} has no source file under {root} (this Python ships without .py sources?); "
        "give the task a `corpus` of local text files instead"
    )


_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _docstrings(source: str) -> Iterable[str]:
    """Docstrings of the module, its classes and functions, in source order (statements only are
    visited: a docstring never hides inside an expression)."""
    stack: list[ast.AST] = [ast.parse(source)]
    while stack:
        node = stack.pop()
        if isinstance(node, _DOCUMENTED):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc
        children: list[ast.AST] = []
        for name in ("body", "orelse", "handlers", "finalbody", "cases"):
            value = getattr(node, name, None)
            if isinstance(value, list):
                children.extend(child for child in value if isinstance(child, ast.AST))
        stack.extend(reversed(children))


@functools.lru_cache(maxsize=1)
def stdlib_paragraphs() -> tuple[str, ...]:
    """Prose paragraphs of the docstrings of :data:`STDLIB_MODULES`, in module order, deduplicated."""
    seen: dict[str, None] = {}
    for module in STDLIB_MODULES:
        source = _stdlib_file(module).read_text(encoding="utf-8")
        for doc in _docstrings(source):
            for paragraph in prose_paragraphs(inspect.cleandoc(doc)):
                seen.setdefault(paragraph, None)
    return tuple(seen)


def _user_files(sources: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for source in sources:
        path = Path(source).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(
                p for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not found:
                raise UnsupportedInputError(f"corpus directory {source!r} holds no (non-hidden) files")
            files.extend(found)
        else:
            raise UnsupportedInputError(f"corpus path {source!r} is neither a file nor a directory")
    return files


@functools.lru_cache(maxsize=8)
def _user_paragraphs(key: tuple[tuple[str, int, int], ...]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for name, _, _ in key:
        try:
            text = Path(name).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise UnsupportedInputError(
                f"corpus file {name!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                "haystack corpora must be UTF-8 text files"
            ) from None
        for paragraph in prose_paragraphs(text):
            seen.setdefault(paragraph, None)
    return tuple(seen)


# -- the corpus --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """Haystack text. ``sources``: local text files or directories (every non-hidden file below
    them, in sorted order); empty: the standard-library docstrings."""

    sources: tuple[str, ...] = ()

    def all_paragraphs(self) -> tuple[str, ...]:
        if not self.sources:
            return stdlib_paragraphs()
        files = _user_files(self.sources)
        # the cache key carries size and modification time, so an edited file is read again
        key = tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
        paragraphs = _user_paragraphs(key)
        if not paragraphs:
            raise UnsupportedInputError(
                f"corpus {list(self.sources)} has no prose paragraph (blank-line separated blocks of at least "
                f"{MIN_WORDS} words, mostly letters, without runs of 4+ digits)"
            )
        return paragraphs

    def paragraphs(self, split: Split) -> list[str]:
        """The paragraphs of ``split``; the two splits are disjoint and together make the corpus."""
        check_split(split)
        return list(_by_split(self.all_paragraphs())[SPLITS.index(split)])

    def fill(self, tokenizer: Any, n_tokens: int, rng: random.Random, split: Split) -> Haystack:
        """About ``n_tokens`` tokens of haystack from ``split``: paragraphs in an order drawn from
        ``rng`` (deterministic given its state), the last one cut at a word boundary so the total
        (counted paragraph by paragraph) does not exceed ``n_tokens``."""
        return fill(self.paragraphs(split), tokenizer, n_tokens, rng, what=f"corpus split {split!r}")


@functools.lru_cache(maxsize=8)
def _by_split(paragraphs: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    split = [split_of(p) for p in paragraphs]
    return tuple(p for p, s in zip(paragraphs, split) if s == SPLITS[0]), tuple(
        p for p, s in zip(paragraphs, split) if s == SPLITS[1]
    )


@dataclass(frozen=True)
class Haystack:
    """Paragraphs with their token counts (as counted alone)."""

    paragraphs: tuple[str, ...]
    tokens: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.tokens)

    def boundary(self, depth: float) -> int:
        """Index of the paragraph boundary (0 = before the first paragraph, ``len`` = after the last)
        whose token position is closest to ``depth`` × total; ties go to the earlier one."""
        if not 0.0 <= depth <= 1.0:
            raise UnsupportedInputError(f"needle depth must lie in [0, 1], got {depth!r}")
        target = depth * self.total
        positions = [0]
        for n in self.tokens:
            positions.append(positions[-1] + n)
        return min(range(len(positions)), key=lambda i: (abs(positions[i] - target), i))

    def with_inserts(self, inserts: Sequence[tuple[float, str]]) -> list[str]:
        """The paragraphs with each ``(depth, text)`` inserted at :meth:`boundary` ``(depth)``; texts
        at the same boundary keep the order of ``inserts``."""
        slots: dict[int, list[str]] = {}
        for depth, text in inserts:
            slots.setdefault(self.boundary(depth), []).append(text)
        out: list[str] = []
        for i in range(len(self.paragraphs) + 1):
            out.extend(slots.get(i, ()))
            if i < len(self.paragraphs):
                out.append(self.paragraphs[i])
        return out


def fill(paragraphs: Sequence[str], tokenizer: Any, n_tokens: int, rng: random.Random,
         *, what: str = "corpus") -> Haystack:
    """About ``n_tokens`` tokens of ``paragraphs``, in an order drawn from ``rng``; the last paragraph
    is cut at a word boundary so the per-paragraph token counts sum to at most ``n_tokens``."""
    if n_tokens < 0:
        raise UnsupportedInputError(f"haystack length must be >= 0 tokens, got {n_tokens}")
    order = list(range(len(paragraphs)))
    rng.shuffle(order)
    chosen: list[str] = []
    counts: list[int] = []
    total = 0
    done = n_tokens == 0
    chunk = max(8, min(64, math.ceil(n_tokens / 40)))
    for start in range(0, len(order), chunk):
        if done:
            break
        batch = [paragraphs[i] for i in order[start:start + chunk]]
        encoded = tokenizer(batch, add_special_tokens=False, return_offsets_mapping=True)
        for text, ids, offsets in zip(batch, encoded["input_ids"], encoded["offset_mapping"]):
            room = n_tokens - total
            if len(ids) <= room:
                chosen.append(text)
                counts.append(len(ids))
                total += len(ids)
                done = total == n_tokens
            else:  # the last paragraph: keep the sentences (else the words) whose tokens fit
                end = offsets[room - 1][1] if room > 0 else 0
                cut = max((m.start() for m in _SENTENCE_END.finditer(text, 0, end + 1)), default=-1)
                if cut < 0.8 * end:  # no sentence end close enough: cut between words
                    cut = text.rfind(" ", 0, end + 1)
                if cut > 0:
                    head = text[:cut]
                    chosen.append(head)
                    counts.append(len(tokenizer(head, add_special_tokens=False)["input_ids"]))
                done = True
            if done:
                break
    if not done:
        raise UnsupportedInputError(
            f"{what} holds {total} tokens of text, fewer than the {n_tokens} haystack tokens asked; "
            "lower context_tokens or give the task a larger corpus"
        )
    return Haystack(tuple(chosen), tuple(counts))
