"""Reading recipe files refuses bad input with one clear line (a RecipeError), never a raw
exception, a hang or unbounded memory — for whole classes of bad input: text that is not UTF-8,
oversized files, deep nesting, alias and interpolation bombs, paths that are not readable files,
broken `base:` chains, huge values in messages, broken YAML, and the same through overrides.
The shipped recipes still load exactly as before.
"""

from __future__ import annotations

import codecs
import gzip
import os
import random
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from elasticfw.errors import RecipeError
from elasticfw.recipe import load_recipe, recipe_defaults, validate_recipe_data
from elasticfw.recipe.loader import load_recipe_dict, merge_sections, parse_override
from elasticfw.recipe.yaml_files import (
    MAX_BASE_CHAIN,
    MAX_BASE_FILES,
    MAX_DEPTH,
    MAX_INTERPOLATION_CHAIN,
    MAX_OVERRIDE_CHARS,
    MAX_RECIPE_BYTES,
    MAX_VALUES,
)
from elasticfw.registry import get_registry

ROOT = Path(__file__).resolve().parents[1]
TASK = "eval:\n  task: {name: passkey}\n"
Write = Callable[[str, "str | bytes"], Path]


@pytest.fixture
def write(tmp_path: Path) -> Write:
    """``write(name, text_or_bytes)`` → a file under tmp_path (folders created)."""

    def _write(name: str, content: str | bytes) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        return path

    return _write


def refused(path: Path | None, overrides: list[str] | tuple[str, ...] = (), *, data: dict | None = None) -> str:
    """The message of the RecipeError (exactly that class) loading raises; one line, no chained
    traceback."""
    with pytest.raises(RecipeError) as info:
        load_recipe_dict(path, overrides, data=data)
    assert type(info.value) is RecipeError
    assert info.value.__cause__ is None and (info.value.__context__ is None or info.value.__suppress_context__)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert len(msg) < 1200, msg[:2000]
    return msg


#: hang guards, not speed claims: CI runs these beside other tests on 2 cores (an alias or
#: interpolation bomb that were expanded would take minutes and gigabytes; the memory peaks below
#: are the tight check that input is refused before it is built)
QUICK_S = 10.0
HANG_S = 30


@pytest.fixture
def bounded() -> Iterator[Callable[[], tuple[float, int]]]:
    """Measures the time and the peak Python memory of what runs inside the test from here on:
    call it to read (seconds, peak bytes)."""
    tracemalloc.start()
    start = time.perf_counter()
    yield lambda: (time.perf_counter() - start, tracemalloc.get_traced_memory()[1])
    tracemalloc.stop()


# -- 1. text that is not UTF-8 ----------------------------------------------------------------------

SAFETENSORS = (25).to_bytes(8, "little") + b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}' + bytes(8)
NOT_UTF8: list[Any] = [
    pytest.param("description: café\n".encode("latin-1"), "byte 0xE9 at line 1, column 17", id="latin-1"),
    pytest.param("seed: 1\ndescription: “quoted” €\n".encode("cp1252"), "at line 2", id="windows-1252"),
    pytest.param("seed: 1\n".encode("utf-16"), "UTF-16 byte-order mark", id="utf-16-bom"),
    pytest.param("seed: 1\n".encode("utf-16-be"), "NUL byte at line 1, column 1", id="utf-16-be-no-bom"),
    pytest.param("seed: 1\n".encode("utf-16-le"), "NUL byte at line 1, column 2", id="utf-16-le-no-bom"),
    pytest.param("seed: 1\n".encode("utf-32"), "UTF-16 byte-order mark", id="utf-32-bom"),
    pytest.param(b"\x89PNG\r\n\x1a\n" + bytes(range(256)), "looks like a PNG image", id="png"),
    pytest.param(b"\xff\xd8\xff\xe0" + bytes(range(256)), "looks like a JPEG image", id="jpeg"),
    pytest.param(SAFETENSORS, "looks like a safetensors file", id="safetensors"),
    pytest.param(b"PK\x03\x04" + bytes(range(256)), "looks like a zip archive", id="zip-torch-checkpoint"),
    pytest.param(gzip.compress(b"seed: 1\n" * 50), "looks like a gzip archive", id="gzip"),
    pytest.param(b"GGUF\x03\x00\x00\x00" + bytes(64), "looks like a GGUF model file", id="gguf"),
    pytest.param(b"\x7fELF\x02\x01\x01" + bytes(64), "looks like an executable", id="elf"),
    pytest.param(random.Random(0).randbytes(4096), "looks like a binary file", id="random-bytes"),
    pytest.param(b"seed: 1\n" + bytes(16), "NUL byte at line 2, column 1", id="nul-bytes-in-text"),
    pytest.param(b"seed: 1\ndescription: \xc3\x28\n", "byte 0xC3 at line 2", id="invalid-utf8-sequence"),
]


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize(("content", "phrase"), NOT_UTF8)
def test_a_recipe_that_is_not_utf8_text_is_refused(write: Write, content: bytes, phrase: str) -> None:
    path = write("bad.yaml", content)
    msg = refused(path)
    assert f"recipe {str(path)!r} is not UTF-8 text" in msg
    assert phrase in msg
    assert "saved as UTF-8" in msg  # what is expected


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize(("content", "phrase"), NOT_UTF8)
def test_a_base_that_is_not_utf8_text_is_refused(write: Write, content: bytes, phrase: str) -> None:
    base = write("_base/bad.yaml", content)
    path = write("r.yaml", "base: _base/bad.yaml\n" + TASK)
    msg = refused(path)
    assert f"base file {str(base)!r} (named by `base:` in {str(path)!r}) is not UTF-8 text" in msg
    assert phrase in msg


def test_utf8_with_a_byte_order_mark_and_any_script_loads(write: Write) -> None:
    path = write("r.yaml", codecs.BOM_UTF8 + "description: \"héllo — 日本語 🚀\"\nseed: 3\n".encode())
    assert load_recipe_dict(path) == {"description": "héllo — 日本語 🚀", "seed": 3}


# -- 2. oversized files -----------------------------------------------------------------------------


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize(
    ("size", "head"),
    [
        pytest.param(MAX_RECIPE_BYTES + 1, b"seed: 1\n", id="one-byte-over"),
        pytest.param(5 << 30, b"seed: 1\n", id="5-GiB-sparse"),
        pytest.param(3 << 30, SAFETENSORS, id="checkpoint-by-mistake"),
    ],
)
def test_an_oversized_recipe_is_refused_before_it_is_read(tmp_path: Path, size: int, head: bytes) -> None:
    path = tmp_path / "big.yaml"
    with path.open("wb") as handle:  # sparse: the size costs no disk and must cost no reading
        handle.write(head)
        handle.truncate(size)
    msg = refused(path)
    assert f"recipe {str(path)!r} is " in msg and f"({size:,} bytes), more than the 1.0 MiB" in msg
    if head == SAFETENSORS:
        assert "looks like a safetensors file" in msg


def test_an_oversized_base_is_refused(write: Write) -> None:
    base = write("b.yaml", "seed: 1\n" + "#" * MAX_RECIPE_BYTES)
    msg = refused(write("r.yaml", "base: b.yaml\n"))
    assert f"base file {str(base)!r}" in msg and "more than the 1.0 MiB a recipe file may have" in msg


@pytest.mark.timeout(2 * HANG_S)
def test_a_recipe_of_exactly_the_limit_loads(write: Write) -> None:
    text = "seed: 1\ndescription: " + "x" * (MAX_RECIPE_BYTES - 40) + "\n"
    text += "#" * (MAX_RECIPE_BYTES - len(text) - 1) + "\n"
    path = write("r.yaml", text)
    assert path.stat().st_size == MAX_RECIPE_BYTES
    assert load_recipe_dict(path)["seed"] == 1


# -- 3. deep nesting --------------------------------------------------------------------------------


def _flow_lists(n: int) -> str:
    return "a: " + "[" * n + "]" * n + "\n"


def _flow_maps(n: int) -> str:
    return "a: " + "{a: " * n + "1" + "}" * n + "\n"


def _block_lists(n: int) -> str:
    return "a:\n" + "- " * n + "x\n"


def _block_maps(n: int) -> str:
    return "".join("  " * i + "a:\n" for i in range(n)) + "  " * n + "b: 1\n"


def _mixed(n: int) -> str:
    return "a: " + "[{a: " * (n // 2) + "1" + "}]" * (n // 2) + "\n"


SHAPES = [_flow_lists, _flow_maps, _block_lists, _block_maps, _mixed]


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("levels", [MAX_DEPTH + 1, 10_000])
def test_deep_nesting_is_refused(write: Write, shape: Callable[[int], str], levels: int) -> None:
    if shape is _block_maps and levels > 1000:
        levels = 1000  # block maps grow quadratically with their indentation; 1000 is 1 MiB
    msg = refused(write("deep.yaml", shape(levels)))
    assert "deep.yaml' at line" in msg
    assert f"lists and mappings are nested deeper than {MAX_DEPTH} levels" in msg


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize("opener", ["[", "{", "- ", "[{a: "])
def test_a_file_of_only_openers_is_refused_quickly(write: Write, opener: str) -> None:
    path = write("deep.yaml", (opener * (MAX_RECIPE_BYTES // len(opener)))[:MAX_RECIPE_BYTES])
    start = time.perf_counter()
    assert f"nested deeper than {MAX_DEPTH} levels" in refused(path)
    assert time.perf_counter() - start < QUICK_S


@pytest.mark.parametrize("shape", SHAPES, ids=lambda f: f.__name__.strip("_"))
def test_nesting_up_to_the_limit_loads(write: Write, shape: Callable[[int], str]) -> None:
    data = load_recipe_dict(write("deep.yaml", shape(MAX_DEPTH - 1)))  # + the top mapping = MAX_DEPTH
    depth, node = 0, data
    while isinstance(node, (dict, list)) and node:
        node = next(iter(node.values())) if isinstance(node, dict) else node[0]
        depth += 1
    assert depth >= MAX_DEPTH - 1


def test_deep_in_memory_data_is_refused() -> None:
    deep: Any = 1
    for _ in range(10_000):
        deep = {"a": deep}
    assert f"nested deeper than {MAX_DEPTH} levels" in refused(None, data={"a": deep})
    loop: list[Any] = []
    loop.append(loop)  # a list that contains itself
    assert f"nested deeper than {MAX_DEPTH} levels" in refused(None, data={"a": loop})


# -- 4. alias bombs ---------------------------------------------------------------------------------


def _laughs(levels: int, fanout: int, mapping: bool = False) -> str:
    """The "billion laughs": each anchor repeats the previous one ``fanout`` times."""
    lines = ["l0: &l0 lol"]
    for i in range(1, levels + 1):
        refs = [f"*l{i - 1}" for _ in range(fanout)]
        body = "{" + ", ".join(f"k{j}: {r}" for j, r in enumerate(refs)) + "}" if mapping else "[" + ", ".join(refs) + "]"
        lines.append(f"l{i}: &l{i} {body}")
    return "\n".join(lines) + "\n"


BOMBS: list[Any] = [
    pytest.param(_laughs(9, 9), "keys and values once its aliases (*name) are repeated", id="billion-laughs"),
    pytest.param(_laughs(30, 2), "keys and values once its aliases (*name) are repeated", id="binary-30-levels"),
    pytest.param(_laughs(9, 9, mapping=True), "keys and values once its aliases", id="laughs-in-mappings"),
    pytest.param(
        "a: &a {x: 1, y: 2}\n" + "".join(f"b{i}: &b{i} {{<<: *{'a' if i == 0 else f'b{i - 1}'}, z{i}: [*a, *a, *a]}}\n"
                                        for i in range(40)) + "c: [" + ", ".join(["*b39"] * 400) + "]\n",
        "keys and values once its aliases", id="merge-keys",
    ),
    pytest.param("a: &a [1, *a]\n", "the alias *a is used inside its own anchor &a", id="list-in-itself"),
    pytest.param("a: &a {b: {c: *a}}\n", "the alias *a is used inside its own anchor &a", id="mapping-in-itself"),
    pytest.param("a: &a {<<: *a}\n", "the alias *a is used inside its own anchor &a", id="merge-itself"),
    pytest.param(
        "l0: &l0 [1]\n" + "".join(f"l{i}: &l{i} [[[[*l{i - 1}]]]]\n" for i in range(1, 12)),
        f"nested deeper than {MAX_DEPTH} levels once its aliases (*name) are repeated", id="deep-through-aliases",
    ),
]


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize(("text", "phrase"), BOMBS)
def test_alias_bombs_are_refused_quickly_in_small_memory(
    write: Write, bounded: Callable[[], tuple[float, int]], text: str, phrase: str
) -> None:
    path = write("bomb.yaml", text)
    msg = refused(path)
    seconds, peak = bounded()
    assert "bomb.yaml'" in msg and phrase in msg
    assert seconds < QUICK_S, seconds
    assert peak < 32 << 20, peak


@pytest.mark.timeout(HANG_S)
def test_a_flat_file_of_many_values_is_refused_early(write: Write, bounded: Callable[[], tuple[float, int]]) -> None:
    path = write("many.yaml", "a: [" + "1, " * (MAX_RECIPE_BYTES // 3 - 2) + "1]\n")
    msg = refused(path)
    assert f"holds more than {MAX_VALUES:,} keys and values" in msg
    assert bounded()[0] < QUICK_S


def test_modest_aliases_and_merge_keys_still_work(write: Write) -> None:
    path = write(
        "r.yaml",
        "x-streaming: &streaming {name: streaming, sink_tokens: 64}\n"
        "elastic: {sparse_mode: {<<: *streaming, local_tokens: 128}}\n"
        "compare:\n  - {label: a, elastic: {sparse_mode: *streaming}}\n  - {label: b, elastic: {sparse_mode: *streaming}}\n",
    )
    data = load_recipe_dict(path)
    assert data["elastic"]["sparse_mode"] == {"name": "streaming", "sink_tokens": 64, "local_tokens": 128}
    assert data["compare"][1]["elastic"]["sparse_mode"] == {"name": "streaming", "sink_tokens": 64}


# -- 5. paths that are not readable recipe files -----------------------------------------------------


def test_a_folder_is_not_a_recipe_file(tmp_path: Path) -> None:
    (tmp_path / "recipes").mkdir()
    msg = refused(tmp_path / "recipes")
    assert f"recipe {str(tmp_path / 'recipes')!r} is a folder, not a recipe file" in msg
    assert "does not exist" not in msg


@pytest.mark.parametrize(
    "name", ["nope.yaml", "missing-folder/nope.yaml", "file.yaml/inside.yaml", "dangling.yaml"]
)
def test_a_missing_file_does_not_exist(tmp_path: Path, name: str) -> None:
    (tmp_path / "file.yaml").write_text("seed: 1\n")
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "gone.yaml")
    path = tmp_path / name
    msg = refused(path)
    assert f"recipe file {str(path)!r} does not exist (looked at {str(path)!r})" in msg


def test_a_relative_missing_path_says_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    msg = refused(Path("recipes/nope.yaml"))
    assert "recipe file 'recipes/nope.yaml' does not exist" in msg and str(tmp_path / "recipes/nope.yaml") in msg


def test_an_unreadable_file_is_refused(write: Write, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write("r.yaml", "seed: 1\n")

    def denied(self: Path, *args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", denied)
    msg = refused(path)
    assert f"recipe {str(path)!r} cannot be read: permission denied" in msg


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_by_its_mode_is_refused(write: Write) -> None:
    path = write("r.yaml", "seed: 1\n")
    path.chmod(0)
    try:
        assert "cannot be read: permission denied" in refused(path)
    finally:
        path.chmod(0o644)


@pytest.mark.timeout(HANG_S)
def test_special_files_are_not_recipe_files(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)  # reading it would block forever
    assert f"recipe {str(fifo)!r} is not a regular file" in refused(fifo)
    if Path("/dev/zero").exists():  # reading it would never end
        assert "is not a regular file" in refused(Path("/dev/zero"))


def test_odd_paths_are_refused(tmp_path: Path) -> None:
    assert "is not a usable path: it holds a NUL character" in refused(Path(str(tmp_path / "a\x00b.yaml")))
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    assert f"recipe {str(loop)!r} cannot be read: " in refused(loop)
    assert "cannot be read: " in refused(tmp_path / ("x" * 300 + ".yaml"))  # name too long


# -- 6. base: problems ------------------------------------------------------------------------------


@pytest.mark.parametrize("base", ["nothere.yaml", "_base/nothere.yaml", "../elsewhere/b.yaml"])
def test_a_missing_base_says_where_it_looked(write: Write, tmp_path: Path, base: str) -> None:
    path = write("recipes/r.yaml", f"base: {base}\n")
    msg = refused(path)
    assert f"recipe {str(path)!r}: `base` file {base!r} does not exist" in msg
    assert "relative to the folder of the file that names them" in msg
    assert f"looked for at {os.path.abspath(tmp_path / 'recipes' / base)!r}" in msg


def test_a_base_that_is_a_folder(write: Write, tmp_path: Path) -> None:
    (tmp_path / "_base").mkdir()
    msg = refused(write("r.yaml", "base: _base\n"))
    assert f"base file {str(tmp_path / '_base')!r}" in msg and "is a folder, not a recipe file" in msg


@pytest.mark.parametrize(
    "files",
    [
        pytest.param({"a.yaml": "base: a.yaml\n"}, id="itself"),
        pytest.param({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, id="two"),
        pytest.param({"a.yaml": "base: [x.yaml, b.yaml]\n", "x.yaml": "seed: 1\n", "b.yaml": "base: sub/c.yaml\n",
                      "sub/c.yaml": "base: ../a.yaml\n"}, id="three-through-folders"),
    ],
)
def test_base_cycles_are_refused(write: Write, files: dict[str, str]) -> None:
    paths = [write(name, text) for name, text in files.items()]
    msg = refused(paths[0])
    assert "recipe inheritance cycle through `base:`" in msg and str(paths[0]) in msg


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just text\n", "3\n", "[a, b]\n"])
def test_a_base_that_is_not_a_mapping(write: Write, text: str) -> None:
    base = write("b.yaml", text)
    path = write("r.yaml", "base: b.yaml\n")
    msg = refused(path)
    assert f"base file {str(base)!r} (named by `base:` in {str(path)!r}) must be a mapping of sections" in msg


@pytest.mark.parametrize("value", ["3", "[a.yaml, 3]", "{a: b.yaml}", "true"])
def test_a_base_value_that_is_not_paths(write: Write, value: str) -> None:
    assert "must be a path or a list of paths to recipe files" in refused(write("r.yaml", f"base: {value}\n"))


def test_a_too_long_base_chain_is_refused(write: Write) -> None:
    for i in range(MAX_BASE_CHAIN + 2):
        write(f"b{i}.yaml", f"base: b{i + 1}.yaml\n" if i <= MAX_BASE_CHAIN else "seed: 1\n")
    assert f"the chain of `base:` files is deeper than {MAX_BASE_CHAIN} files" in refused(write("r.yaml", "base: b0.yaml\n"))


def test_too_many_base_files_are_refused(write: Write) -> None:
    for i in range(MAX_BASE_FILES + 1):
        write(f"b{i}.yaml", f"s{i}: 1\n")
    names = ", ".join(f"b{i}.yaml" for i in range(MAX_BASE_FILES + 1))
    assert f"more than {MAX_BASE_FILES} files" in refused(write("r.yaml", f"base: [{names}]\n"))


@pytest.mark.timeout(HANG_S)
def test_a_diamond_of_bases_is_read_once_per_file(write: Write) -> None:
    levels = MAX_BASE_CHAIN - 2  # each level names the next twice: 2**levels merges if read naively
    for i in range(levels):
        write(f"b{i}.yaml", f"base: [b{i + 1}.yaml, b{i + 1}.yaml]\nk{i}: {i}\n")
    write(f"b{levels}.yaml", "seed: 5\n")
    data = load_recipe_dict(write("r.yaml", "base: [b0.yaml, b0.yaml]\n"))
    assert data["seed"] == 5 and data[f"k{levels - 1}"] == levels - 1


@pytest.mark.timeout(2 * HANG_S)
def test_bases_that_together_hold_too_many_values_are_refused(write: Write) -> None:
    for i in range(4):  # each file is within the limit, all four together are not
        write(f"b{i}.yaml", "".join(f"k{i}_{j}: {j}\n" for j in range(MAX_VALUES // 3)))
    msg = refused(write("r.yaml", "base: [b0.yaml, b1.yaml, b2.yaml, b3.yaml]\n"))
    assert f"the recipe holds more than {MAX_VALUES:,} values" in msg


def test_bases_still_merge_relative_to_their_own_folder(write: Write) -> None:
    write("recipes/_base/model.yaml", "model: {name: smollm2-135m, dtype: bfloat16}\nseed: 1\n")
    write("recipes/_base/common.yaml", "base: model.yaml\n" + TASK)
    write("recipes/_base/other.yaml", "base: model.yaml\ndescription: other\n")  # the same base, twice
    data = load_recipe_dict(write("recipes/run.yaml", "base: [_base/common.yaml, _base/other.yaml]\nseed: 7\n"))
    assert data == {"model": {"name": "smollm2-135m", "dtype": "bfloat16"}, "seed": 7, "description": "other",
                    "eval": {"task": {"name": "passkey"}}}


# -- 7. huge values in validation messages ----------------------------------------------------------

BIG = "x" * (1 << 20)


@pytest.mark.parametrize(
    ("data", "path"),
    [
        pytest.param({"seed": BIG}, "seed = 'xxx", id="wrong-type"),
        pytest.param({"eval": {"task": {"name": "passkey"}, "padding_side": BIG}}, "eval.padding_side = 'xxx", id="literal"),
        pytest.param({"elastic": {"sparse_mode": {"name": BIG}}}, "elastic.sparse_mode.name = 'xxx", id="plugin-name"),
        pytest.param({"eval": {"task": {"name": BIG}}}, "eval.task.name = 'xxx", id="single-plugin-name"),
        pytest.param({"elastic": {"sparse_mode": BIG}}, "elastic.sparse_mode = 'xxx", id="section-as-string"),
        pytest.param({"model": [BIG] * 3}, "model = ['xxx", id="list-for-section"),
        pytest.param({BIG: 1}, "xxxxxxxx", id="unknown-huge-key"),
        pytest.param({"model": {"dtype": BIG}}, "model.dtype = 'xxx", id="dtype"),
    ],
)
def test_validation_messages_cut_huge_values(data: dict[str, Any], path: str) -> None:
    with pytest.raises(RecipeError) as info:
        validate_recipe_data(data, source="big.yaml")
    msg = str(info.value)
    assert msg.startswith("invalid recipe 'big.yaml' (1 problem):")
    assert path in msg
    assert "characters" in msg and f"{len(BIG):,}" in msg or f"{len(repr([BIG] * 3)):,}" in msg
    assert len(msg) < 1500, len(msg)


def test_short_values_are_shown_whole() -> None:
    with pytest.raises(RecipeError) as info:
        validate_recipe_data({"seed": "abc", "elastic": {"sparse_mode": {"name": "streamng"}}})
    msg = str(info.value)
    assert "seed = 'abc': " in msg and "elastic.sparse_mode.name = 'streamng'" in msg
    assert "did you mean 'streaming'?" in msg and "characters" not in msg


def test_a_huge_value_in_a_file_is_cut_in_the_message(write: Write) -> None:
    path = write("r.yaml", f"seed: {'9' * 500_000}x\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert "(500,001 characters)" in str(info.value) and len(str(info.value)) < 1000


# -- 8. broken YAML -----------------------------------------------------------------------------------

BROKEN: list[Any] = [
    pytest.param("model:\n  name: 'abc\nseed: 1\n", "line 4, column 1", "while scanning a quoted scalar", id="open-quote"),
    pytest.param("model:\n  name: [a, b\nseed: 1\n", "line 3, column 5", "while parsing a flow sequence", id="open-bracket"),
    pytest.param("model: {name: a\n", "line 2, column 1", "expected ',' or '}'", id="open-brace"),
    pytest.param("model:\n\tname: x\n", "line 2, column 1", "cannot start any token", id="tab-indent"),
    pytest.param("model:\n    name: a\n  dtype: b\n", "line 3, column 3", "expected <block end>", id="bad-indent"),
    pytest.param("seed: 1\nseed: 2\n", "line 2, column 1", "key 'seed' is given twice", id="duplicate-key"),
    pytest.param("seed: 1\n---\nseed: 2\n", "line 2, column 1", "expected a single document", id="two-documents"),
    pytest.param("seed: *nowhere\n", "line 1, column 7", "found undefined alias", id="undefined-alias"),
    pytest.param("a: &x 1\nb: &x 2\n", "line 2, column 4", "found duplicate anchor", id="duplicate-anchor"),
    pytest.param("seed: 1\ndescription: a\x07b\n", "line 2, column 15", "U+0007 is not allowed", id="control-char"),
    pytest.param("seed: !!python/object/apply:os.system ['true']\n", "line 1, column 7", "is not allowed: recipes are plain data",
                 id="python-tag"),
    pytest.param("seed: !custom 1\n", "line 1, column 7", "the tag '!custom' is not allowed", id="unknown-tag"),
    pytest.param("a: b: c\n", "line 1, column 5", "mapping values are not allowed here", id="colon-in-plain"),
    pytest.param("? [a, b]\n: 1\n", "line 1, column 3", "unhashable key", id="list-as-key"),
    pytest.param("%YAML 9.9\n---\nseed: 1\n", "line 1, column 1", "found incompatible YAML document", id="yaml-version"),
]


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize(("text", "where", "phrase"), BROKEN)
def test_broken_yaml_is_one_line_with_file_line_and_column(write: Write, text: str, where: str, phrase: str) -> None:
    path = write("broken.yaml", text)
    msg = refused(path)
    assert msg.startswith(f"recipe {str(path)!r} is not valid YAML at {where}: "), msg
    assert phrase in msg, msg


# -- 9. overrides --------------------------------------------------------------------------------------

OVERRIDES: list[Any] = [
    pytest.param("description=" + "x" * MAX_OVERRIDE_CHARS, f"characters long, more than the {MAX_OVERRIDE_CHARS:,}",
                 id="huge"),
    pytest.param("a=" + "[" * 10_000 + "]" * 10_000, f"nested deeper than {MAX_DEPTH} levels", id="deep-lists"),
    pytest.param("a=" + "{a: " * 10_000 + "1" + "}" * 10_000, f"nested deeper than {MAX_DEPTH} levels", id="deep-maps"),
    pytest.param("a=" + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"nested deeper than {MAX_DEPTH}",
                 id="one-level-too-deep"),
    pytest.param(".".join(["a"] * (MAX_DEPTH + 1)) + "=1", f"the key has {MAX_DEPTH + 1} parts", id="long-key"),
    pytest.param(".".join(["a"] * 20) + "=" + "[" * 15 + "]" * 15, "its key (20 levels) and value (15 levels",
                 id="key-and-value"),
    pytest.param("a=" + _laughs(9, 9).replace("\n", ", ").join("{}"), "keys and values once its aliases", id="alias-bomb"),
    pytest.param("a=&a [*a]", "the alias *a is used inside its own anchor", id="alias-in-itself"),
    pytest.param("a=[1,", "is not valid YAML at line 1, column 4", id="broken-yaml"),
    pytest.param("a=x\x00y", "U+0000 is not allowed", id="nul-in-value"),
    pytest.param("=1" + "x" * 10_000, "is not of the form dotted.key=value", id="no-key-long"),
]


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize(("override", "phrase"), OVERRIDES)
def test_bad_overrides_are_refused(write: Write, bounded: Callable[[], tuple[float, int]], override: str,
                                   phrase: str) -> None:
    msg = refused(write("r.yaml", "seed: 1\n"), [override])
    assert "override '" in msg and phrase in msg
    assert override not in msg or len(override) < 100  # a long override is cut, not echoed
    seconds, peak = bounded()
    assert seconds < QUICK_S and peak < 64 << 20, (seconds, peak)


def test_overrides_up_to_the_limits_apply(write: Write) -> None:
    path = write("r.yaml", "seed: 1\n")
    long = "description=" + "y" * (MAX_OVERRIDE_CHARS - len("description="))
    deep_key = ".".join(["a"] * (MAX_DEPTH - 1)) + "=[1]"
    data = load_recipe_dict(path, [long, deep_key])
    assert len(data["description"]) == MAX_OVERRIDE_CHARS - len("description=")
    assert parse_override("a=" + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1))[0] == "a"


# -- 10. interpolation bombs (OmegaConf would expand them exponentially) ------------------------------

INTERPOLATIONS: list[Any] = [
    pytest.param("l0: lol\n" + "".join(f"l{i}: ['${{l{i - 1}}}', '${{l{i - 1}}}', '${{l{i - 1}}}', '${{l{i - 1}}}']\n"
                                       for i in range(1, 30)),
                 f"holds more than {MAX_VALUES:,} values once its interpolations", id="list-bomb"),
    pytest.param("l0: x\n" + "".join(f"l{i}: '${{l{i - 1}}}${{l{i - 1}}}'\n" for i in range(1, 64)),
                 f"holds more than {MAX_VALUES:,} values once its interpolations", id="string-bomb"),
    pytest.param("l0: '" + "x" * 200_000 + "'\n" + "".join(f"l{i}: '${{l{i - 1}}} ${{l{i - 1}}}'\n" for i in range(1, 8)),
                 "of text once its interpolations", id="long-string-bomb"),
    pytest.param("l0: 1\n" + "".join(f"l{i}: ${{l{i - 1}}}\n" for i in range(1, 400)),
                 f"refers through more than {MAX_INTERPOLATION_CHAIN} interpolations in a row", id="long-chain"),
    pytest.param("l0: [1]\n" + "".join(f"l{i}: [[[['${{l{i - 1}}}']]]]\n" for i in range(1, 12)),
                 f"deeper than {MAX_DEPTH} levels once its interpolations", id="deep-through-interpolations"),
    pytest.param("l0: x\n" + "".join(f"l{i}: '${{oc.select:l{i - 1}}}${{oc.select:l{i - 1},d}}'\n" for i in range(1, 64)),
                 "once its interpolations", id="through-a-resolver"),
]


@pytest.mark.timeout(HANG_S)
@pytest.mark.parametrize(("text", "phrase"), INTERPOLATIONS)
def test_interpolation_bombs_are_refused_before_resolving(
    write: Write, bounded: Callable[[], tuple[float, int]], text: str, phrase: str
) -> None:
    msg = refused(write("bomb.yaml", text))
    seconds, peak = bounded()
    assert "bomb.yaml'" in msg and phrase in msg
    assert seconds < QUICK_S and peak < 64 << 20, (seconds, peak)


def test_ordinary_interpolations_still_resolve(write: Write) -> None:
    write("base.yaml", "output_dir: results/${model.name}/seed${seed}\nblock: 64\n")
    path = write(
        "r.yaml",
        "base: base.yaml\nseed: 3\nmodel: {name: m}\nsizes: {a: '${block}', b: '${.a}'}\n"
        "chain: ['${sizes.b}', 'x${sizes.a}']\nsection: ${sizes}\n",
    )
    data = load_recipe_dict(path, ["model.name=n"])
    assert data["output_dir"] == "results/n/seed3"
    assert data["sizes"] == {"a": 64, "b": 64} and data["section"] == {"a": 64, "b": 64}
    assert data["chain"] == [64, "x64"]


def test_interpolation_cycles_are_reported_by_omegaconf(write: Write) -> None:
    assert "Recursive interpolation detected" in refused(write("r.yaml", "a: ${b}\nb: ${a}\n"))
    assert "cannot resolve at a" in refused(write("s.yaml", "a: {b: '${a}'}\n"))


def test_nesting_and_chains_up_to_the_limits_resolve_within_the_stack() -> None:
    """The deepest recipe and the longest chain allowed, together, under extra stack: OmegaConf
    must not hit Python's recursion limit (the limits leave it room)."""
    leaf_path = ".".join(["k"] * (MAX_DEPTH - 1))
    data: dict[str, Any] = {}
    for i in range(MAX_INTERPOLATION_CHAIN + 1):
        node: Any = f"${{c{i + 1}.{leaf_path}}}" if i < MAX_INTERPOLATION_CHAIN else 1
        for _ in range(MAX_DEPTH - 1):
            node = {"k": node}
        data[f"c{i}"] = node

    def nested(frames: int) -> dict[str, Any]:
        return nested(frames - 1) if frames else load_recipe_dict(None, data=data)

    resolved = nested(min(200, sys.getrecursionlimit() // 5))
    leaf: Any = resolved["c0"]
    for _ in range(MAX_DEPTH - 1):
        leaf = leaf["k"]
    assert leaf == 1


# -- the shipped recipes load as before ---------------------------------------------------------------

SHIPPED = sorted([*(ROOT / "recipes").rglob("*.yaml"), *(ROOT / "elasticfw" / "recipes").glob("*.yaml")])


def _plain_load(path: Path) -> dict[str, Any]:
    """The loader without its guards: yaml.safe_load and the same `base:` merge (trusted files)."""
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    bases = data.pop("base", None)
    if bases is None:
        return data
    merged: dict[str, Any] = {}
    for base in [bases] if isinstance(bases, str) else bases:
        merged = merge_sections(merged, _plain_load(path.parent / base))
    return merge_sections(merged, data)


def test_there_are_shipped_recipes() -> None:
    assert len(SHIPPED) >= 5


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_recipes_load_identically(path: Path) -> None:
    defaults = recipe_defaults(get_registry())
    for under in (None, defaults):
        expected = OmegaConf.to_container(
            OmegaConf.create(merge_sections(under, _plain_load(path)) if under else _plain_load(path)), resolve=True
        )
        assert load_recipe_dict(path, defaults=under) == expected
    load_recipe(path)  # and they still validate
