"""The haystack corpus (elasticfw.eval.corpus): paragraphs, splits, filling and needle placement.

Token counts are checked with a whitespace tokenizer written here (one token per word, with
character offsets), so every expected count is a word count computed by hand or by ``split()``.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from elasticfw.errors import UnsupportedInputError
from elasticfw.eval.corpus import (
    MAX_WORDS,
    STDLIB_MODULES,
    Corpus,
    Haystack,
    draw_for_split,
    fill,
    prose_paragraphs,
    split_of,
    stdlib_paragraphs,
)

WORD = re.compile(r"\S+")


class WordTokenizer:
    """One token per whitespace-separated word; ids are positions in a growing vocabulary."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def _one(self, text: str, offsets: bool) -> dict:
        words = list(WORD.finditer(text))
        out: dict = {"input_ids": [self.vocab.setdefault(m.group(), len(self.vocab)) for m in words]}
        if offsets:
            out["offset_mapping"] = [(m.start(), m.end()) for m in words]
        return out

    def __call__(self, text, add_special_tokens: bool = False, return_offsets_mapping: bool = False) -> dict:
        if isinstance(text, str):
            return self._one(text, return_offsets_mapping)
        parts = [self._one(t, return_offsets_mapping) for t in text]
        return {key: [p[key] for p in parts] for key in parts[0]} if parts else {"input_ids": []}


def words(text: str) -> int:
    return len(text.split())


SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank."  # 14 words


# -- the standard-library corpus --------------------------------------------------------------------


def test_module_list_is_fixed_sorted_and_present() -> None:
    assert list(STDLIB_MODULES) == sorted(set(STDLIB_MODULES))
    root = Path(sysconfig.get_paths()["stdlib"])
    for module in STDLIB_MODULES:
        base = root.joinpath(*module.split("."))
        assert base.with_suffix(".py").is_file() or (base / "__init__.py").is_file(), module


def test_stdlib_splits_partition_the_corpus() -> None:
    corpus = Corpus()
    everything = corpus.all_paragraphs()
    train, evaluation = corpus.paragraphs("train"), corpus.paragraphs("eval")
    assert len(everything) == len(set(everything)) > 1000  # deduplicated, and large enough for ~30K-token prompts
    assert not set(train) & set(evaluation)
    assert sorted(train + evaluation) == sorted(everything)
    assert 0.4 < len(train) / len(everything) < 0.6
    for paragraph in everything:
        assert len(paragraph.split()) >= 12
        assert not re.search(r"\d{4}", paragraph), paragraph
        assert "  " not in paragraph and "\n" not in paragraph and "`" not in paragraph
        assert ">>>" not in paragraph


def test_stdlib_paragraphs_come_from_docstrings_not_code() -> None:
    paragraphs = set(stdlib_paragraphs())
    # the second paragraph of textwrap.fill's docstring (prose since Python 3.0), whitespace collapsed
    import inspect
    import textwrap

    second = " ".join(inspect.cleandoc(textwrap.fill.__doc__ or "").split("\n\n")[1].split())
    assert second.startswith("Reformat the single paragraph") and second in paragraphs
    assert not any(p.startswith(("def ", "import ", "class ")) for p in paragraphs)


def test_split_of_is_stable_across_processes() -> None:
    texts = [f"paragraph number {i} about nothing" for i in range(64)]
    here = [split_of(t) for t in texts]
    assert set(here) == {"train", "eval"}
    code = (
        "from elasticfw.eval.corpus import split_of\n"
        f"print(','.join(split_of(t) for t in {texts!r}))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().split(",") == here  # not Python's salted hash()


# -- normalisation ------------------------------------------------------------------------------------


def test_prose_paragraphs_normalise_and_filter() -> None:
    text = (
        "Return the :class:`Thing` for ``name``   when it\nexists in the registry of known things, else None.\n"
        "\n"
        "Example::\n"
        "\n"
        "    >>> thing('a')\n"
        "    <Thing a>\n"
        "\n"
        "Too short to keep.\n"
        "\n"
        "The port 8080 is the default one used here for the test server in this module.\n"
        "\n"
        "Arguments are:\n"
        "    name -- the name of the thing to look for, as a plain string\n"
        "        with details\n"
        "\n"
        "lowercase start is not how a sentence of prose in this corpus begins at all here.\n"
    )
    assert prose_paragraphs(text) == [
        "Return the Thing for name when it exists in the registry of known things, else None."
    ]


def test_long_blocks_are_cut_at_sentence_ends() -> None:
    block = " ".join([SENTENCE] * 30)  # 420 words
    pieces = prose_paragraphs(block)
    assert MAX_WORDS == 60 and len(pieces) == 8  # 4 sentences (56 words) fit under 60 words, 30 = 7 * 4 + 2
    assert all(words(p) <= MAX_WORDS and p.endswith(".") for p in pieces)
    assert " ".join(pieces) == block


# -- user corpora -------------------------------------------------------------------------------------


def test_user_corpus_files_and_directories(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text(f"{SENTENCE}\n\nSecond {SENTENCE.lower()}\n", encoding="utf-8")
    (tmp_path / "docs" / "a.md").write_text(f"First {SENTENCE.lower()}\n", encoding="utf-8")
    (tmp_path / "docs" / ".hidden").write_text(f"Hidden {SENTENCE.lower()}\n", encoding="utf-8")
    single = tmp_path / "single.txt"
    single.write_text(f"Single {SENTENCE.lower()}\n", encoding="utf-8")
    corpus = Corpus((str(single), str(tmp_path / "docs")))
    assert corpus.all_paragraphs() == (
        f"Single {SENTENCE.lower()}", f"First {SENTENCE.lower()}", SENTENCE, f"Second {SENTENCE.lower()}"
    )
    assert sorted(corpus.paragraphs("train") + corpus.paragraphs("eval")) == sorted(corpus.all_paragraphs())
    # an edited file is read again (the cache is keyed by size and modification time)
    single.write_text(f"Changed {SENTENCE.lower()} Again.\n", encoding="utf-8")
    assert corpus.all_paragraphs()[0] == f"Changed {SENTENCE.lower()} Again."


def test_user_corpus_errors(tmp_path: Path) -> None:
    binary = tmp_path / "latin1.txt"
    binary.write_bytes(("Caf\xe9 " + SENTENCE).encode("latin-1"))
    with pytest.raises(UnsupportedInputError, match=r"latin1\.txt.*not UTF-8"):
        Corpus((str(binary),)).all_paragraphs()
    with pytest.raises(UnsupportedInputError, match="neither a file nor a directory"):
        Corpus((str(tmp_path / "missing.txt"),)).all_paragraphs()
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedInputError, match="holds no"):
        Corpus((str(tmp_path / "empty"),)).all_paragraphs()
    short = tmp_path / "short.txt"
    short.write_text("Too short.\n\nAlso short.\n", encoding="utf-8")
    with pytest.raises(UnsupportedInputError, match="no prose paragraph"):
        Corpus((str(short),)).all_paragraphs()
    with pytest.raises(UnsupportedInputError, match="split"):
        Corpus().paragraphs("test")  # type: ignore[arg-type]


# -- filling ------------------------------------------------------------------------------------------


def test_fill_is_deterministic_and_counts_tokens() -> None:
    paragraphs = [f"Paragraph {i} says: " + " ".join(["word"] * (10 + i % 7)) + "." for i in range(200)]
    tok = WordTokenizer()
    first = fill(paragraphs, tok, 300, random.Random(7))
    again = fill(paragraphs, tok, 300, random.Random(7))
    other = fill(paragraphs, tok, 300, random.Random(8))
    assert first == again and first != other
    assert list(first.tokens) == [words(p) for p in first.paragraphs]
    assert 300 - 16 < first.total <= 300  # only the cut of the last paragraph is lost (< one paragraph)
    # whole paragraphs, except a cut prefix of one at the end
    assert all(p in paragraphs for p in first.paragraphs[:-1])
    last = first.paragraphs[-1]
    assert last in paragraphs or any(p.startswith(last + " ") for p in paragraphs)
    assert fill(paragraphs, tok, 0, random.Random(7)).paragraphs == ()


def test_fill_reports_an_exhausted_corpus() -> None:
    paragraphs = [SENTENCE] * 3  # 42 words
    with pytest.raises(UnsupportedInputError, match="holds 42 tokens.*100 haystack tokens"):
        fill(paragraphs, WordTokenizer(), 100, random.Random(0), what="my corpus")
    assert fill(paragraphs, WordTokenizer(), 42, random.Random(0)).total == 42


def test_corpus_fill_uses_only_its_split() -> None:
    corpus = Corpus()
    tok = WordTokenizer()
    for split in ("train", "eval"):
        own = set(corpus.paragraphs(split))
        hay = corpus.fill(tok, 2000, random.Random(1), split)
        assert all(p in own for p in hay.paragraphs[:-1])
        assert 1900 < hay.total <= 2000


def test_haystack_boundaries_by_hand() -> None:
    hay = Haystack(("a", "b", "c"), (10, 20, 30))  # boundaries at token positions 0, 10, 30, 60
    assert [hay.boundary(d) for d in (0.0, 0.25, 0.5, 0.9, 1.0)] == [0, 1, 2, 3, 3]
    assert hay.boundary(5 / 60) == 0  # equally far from 0 and 10: the earlier
    assert hay.with_inserts([(1.0, "Z"), (0.0, "X"), (0.0, "Y"), (0.5, "M")]) == ["X", "Y", "a", "b", "M", "c", "Z"]
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(UnsupportedInputError, match="depth"):
            hay.boundary(bad)


def test_draw_for_split() -> None:
    rng = random.Random(3)
    used: set[str] = set()
    drawn = [draw_for_split(rng, lambda r: str(r.randrange(100, 1000)), "eval", used) for _ in range(50)]
    assert len(set(drawn)) == 50 and used == set(drawn)
    assert all(split_of(v) == "eval" for v in drawn)
    with pytest.raises(UnsupportedInputError, match="could not draw"):
        draw_for_split(rng, lambda r: "same", split_of("same"), {"same"}, attempts=20)
