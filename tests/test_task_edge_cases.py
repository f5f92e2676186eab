"""Edge cases of the task plugins that the per-task tests do not reach: boundaries of the
documented rules (line-start snapping of a code window, needle depths 0 and 1, the minimum
docstring body of the summary task), the bytes quoted in the not-UTF-8 error of local data files,
and the dataset task's middle cut when the tokenizer merges across the template / context border.

Every expectation is worked out by hand in the test (character offsets, token counts of a BPE
whose vocabulary and merges are written out here), never by another path of the tested code.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import elasticfw_plugins.tasks.code_completion as code_completion
from elasticfw.errors import UnsupportedInputError
from elasticfw_plugins.tasks.code_completion import TokenizedFile
from elasticfw_plugins.tasks.dataset import DatasetTask, DatasetTaskConfig, read_local
from elasticfw_plugins.tasks.passkey import PasskeyConfig, PasskeyTask
from elasticfw_plugins.tasks.ruler import number
from elasticfw_plugins.tasks.summary import documented_functions

# -- code_completion: TokenizedFile.window_start ---------------------------------------------------


def char_tokens(text: str) -> TokenizedFile:
    """One token per character: token i starts at character i (so token counts are character counts)."""
    starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n" and i + 1 < len(text)]
    return TokenizedFile(text, list(range(len(text))), starts)


def test_window_start_moves_to_the_nearer_line_start_within_five_percent() -> None:
    # lines of 3 characters ("ab\n"): line starts at 0, 3, 6, ..., 57
    tf = char_tokens("ab\n" * 20)
    # 41 tokens before character 60 start at token/character 19; the line starts around it are
    # 18 (1 token away) and 21 (2 tokens away), both within max(1, 41 // 20) = 2: the nearer, 18
    assert tf.window_start(60, 41) == 18
    # 40 tokens: start 20; line starts 18 (2 away) and 21 (1 away): 21
    assert tf.window_start(60, 40) == 21


def test_window_start_stays_at_the_token_when_no_line_start_is_within_five_percent() -> None:
    # lines of 10 characters: line starts at 0, 10, 20, ..., 50
    tf = char_tokens("abcdefghi\n" * 6)
    # 45 tokens before character 60 start at 15; the line starts 10 and 20 are 5 tokens away,
    # more than max(1, 45 // 20) = 2: the window starts at the token itself
    assert tf.window_start(60, 45) == 15
    # 61 tokens do not exist before character 60
    assert tf.window_start(60, 61) is None


def test_window_start_never_snaps_to_a_line_start_at_the_window_end() -> None:
    # "abc\nd": line starts 0 and 4. One token before character 4 starts at 3 (the newline); the
    # line start 0 is 3 tokens away, beyond max(1, 1 // 20) = 1, and the line start 4 is 1 token
    # away but is the window's end: a window starting there would hold no token. It stays at 3.
    tf = char_tokens("abc\nd")
    assert tf.window_start(4, 1) == 3


# -- dataset: reading local files -------------------------------------------------------------------


def test_not_utf8_error_quotes_the_offending_bytes(tmp_path: Path) -> None:
    # byte 5 (0-based) on line 2 is 0xE9 (Latin-1 "é"), not UTF-8; the message quotes the 4 bytes
    # from there, not the rest of the file
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'ab\ncd\xe9fg\nhijklmnopqrstuvwxyz\n')
    with pytest.raises(UnsupportedInputError) as info:
        read_local(path, "jsonl")
    assert "not UTF-8 text (byte 5, line 2: b'\\xe9fg\\n'); convert the file to UTF-8" in str(info.value)


def test_unreadable_parquet_files_are_named(tmp_path: Path) -> None:
    # a file cut short (pyarrow: ArrowInvalid) and one whose footer metadata is zeroed with the
    # magic bytes and the footer length intact (pyarrow cannot deserialise it: OSError)
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"x": [1, 2, 3]}), path)
    data = path.read_bytes()
    footer = int.from_bytes(data[-8:-4], "little")
    for broken in (data[: len(data) // 2], data[: -8 - footer] + bytes(footer) + data[-8:]):
        path.write_bytes(broken)
        with pytest.raises(UnsupportedInputError, match="d.parquet: not a readable Parquet file"):
            read_local(path, "parquet")


# -- dataset: the middle cut when tokens merge across the template / context border ---------------


def merging_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with a hand-written vocabulary and merge order. Alone, ``abcdefghyz`` is
    2 tokens (``abcdefgh`` ``yz``); after an ``x`` the merge ``x a`` comes first and breaks
    ``abcdefgh``: ``xabcdefghyz`` is 5 tokens (``xa b cd efgh yz``), 2 more than ``x`` and the
    context apart. A run of dots is one token per dot."""
    merges = [("x", "a"), ("h", "a"), ("a", "b"), ("c", "d"), ("e", "f"), ("g", "h"), ("y", "z"),
              ("ab", "cd"), ("ef", "gh"), ("abcd", "efgh")]
    vocab: dict[str, int] = {}
    for token in [".", *"abcdefghxyz", *(a + b for a, b in merges), "<pad>"]:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>")


def test_middle_cut_keeps_the_tail_when_the_border_merge_lengthens_the_prompt(tmp_path: Path) -> None:
    tok = merging_tokenizer()
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    question = "." * 60
    # the tokenizer behaves as its docstring says (counts by hand from the merge order)
    assert [tok.decode([i]) for i in enc("abcdefghyz")] == ["abcdefgh", "yz"]
    assert [tok.decode([i]) for i in enc(question + "xabcdefghyz")][60:] == ["xa", "b", "cd", "efgh", "yz"]
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"_id": "a", "context": "abcdefghyz", "input": question, "answers": ["z"]}) + "\n")
    config = DatasetTaskConfig(path=str(path), num_samples=1, context_tokens=64, eval_fraction=0.99,
                               template="{input}x{context}", chat_template=False)
    # the whole prompt is 60 + 5 = 65 tokens > 64; the template and question alone are 61, so
    # the cut context may hold at most 64 - 61 = 3 tokens, but it must drop at least one of the
    # context's 2 tokens: 1 token, none from the first half and the last token ("yz") from the
    # second; the prompt "...xyz" is 60 + 2 tokens ("x", "yz")
    (sample,) = DatasetTask(config).samples(tok, seed=0)
    assert tok.decode(sample.input_ids) == question + "xyz"
    assert len(sample.input_ids) == 62 and sample.meta["truncated"] is True


# -- passkey: needle depths at the ends of [0, 1] ---------------------------------------------------

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def filler_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([FILLER * 4, "The pass key is 12345. Remember it. What is the pass key?"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>")


def test_passkey_depth_zero_puts_the_needle_first_and_depth_one_last() -> None:
    tok = filler_tokenizer()
    task = PasskeyTask(PasskeyConfig(num_samples=2, context_tokens=256, depths=[0.0, 1.0], chat_template=False))
    first, last = task.samples(tok, seed=0)
    assert (first.meta["depth"], last.meta["depth"]) == (0.0, 1.0)
    intro = ("There is an important piece of information hidden inside a lot of irrelevant text. "
             "Find it and memorize it. I will quiz you about it.\n")
    needle = "The pass key is {key}. Remember it. {key} is the pass key. "
    question = "\nWhat is the pass key?\nThe pass key is"
    text = tok.decode(first.input_ids)
    assert text.startswith(intro + needle.format(key=first.answer) + FILLER)  # right after the introduction
    assert text.endswith(FILLER + question)
    text = tok.decode(last.input_ids)
    assert text.startswith(intro + FILLER)
    assert text.endswith(FILLER + needle.format(key=last.answer) + question)  # right before the question


def test_passkey_default_depths_spread_evenly_from_a_tenth_to_nine_tenths() -> None:
    # no depths given: num_samples needles evenly spaced over [0.1, 0.9] (5 samples: 0.1, 0.3, 0.5,
    # 0.7, 0.9); each needle has round(depth * fillers) of the prompt's filler sentences before it
    tok = filler_tokenizer()
    needle = "The pass key is {key}. Remember it. {key} is the pass key. "
    samples = PasskeyTask(PasskeyConfig(num_samples=5, context_tokens=512, chat_template=False)).samples(tok, seed=0)
    expected = [0.1, 0.3, 0.5, 0.7, 0.9]
    assert [s.meta["depth"] for s in samples] == pytest.approx(expected)
    for sample, depth in zip(samples, expected, strict=True):
        before, after = tok.decode(sample.input_ids).split(needle.format(key=sample.answer))
        fillers = before.count(FILLER) + after.count(FILLER)
        assert fillers >= 10 and before.count(FILLER) == round(depth * fillers)
    # one sample: the first depth of the spread
    (one,) = PasskeyTask(PasskeyConfig(num_samples=1, context_tokens=256, chat_template=False)).samples(tok, seed=0)
    assert one.meta["depth"] == pytest.approx(0.1)


def test_passkey_keys_spread_over_every_number_of_the_asked_digits() -> None:
    # 5 digits: keys uniform over 10000..99999; 200 keys reach both ends of the range (each 5%
    # stretch is missed by all 200 draws with probability 0.95 ** 200, about 4e-5)
    tok = filler_tokenizer()
    task = PasskeyTask(PasskeyConfig(num_samples=200, context_tokens=128, digits=5, chat_template=False))
    keys = [int(s.answer) for s in task.samples(tok, seed=0)]
    assert all(10000 <= k <= 99999 for k in keys)
    assert min(keys) < 10000 + 4500 and max(keys) > 99999 - 4500


def test_passkey_score_is_one_only_for_the_key_itself() -> None:
    # the first number of the completion must be the key: a smaller or larger number, a number
    # before the key, or none at all scores 0
    tok = filler_tokenizer()
    (sample,) = PasskeyTask(PasskeyConfig(num_samples=1, context_tokens=256, chat_template=False)).samples(tok, seed=0)
    task, key = PasskeyTask(PasskeyConfig()), int(sample.answer)
    assert task.score(sample, f" {key}.") == 1.0
    for wrong in (f" {key - 1}.", f" {key + 1}.", f" 7, then {key}", " I do not know."):
        assert task.score(sample, wrong) == 0.0, wrong


# -- ruler: numbers of exactly the asked digits --------------------------------------------------


@pytest.mark.parametrize("digits", [1, 2, 3, 7])
def test_ruler_numbers_have_exactly_the_asked_digits(digits: int) -> None:
    # 1,000 draws: every one a decimal of `digits` digits without a leading zero (1-9 for one
    # digit, 10-99 for two, ...), and both halves of the range drawn
    rng = random.Random(0)
    draws = [number(digits)(rng) for _ in range(1000)]
    assert all(len(d) == digits and d.isdigit() and (d[0] != "0") for d in draws)
    values = [int(d) for d in draws]
    middle = (10 ** (digits - 1) + 10**digits) // 2
    assert min(values) < middle <= max(values)


# -- summary: the docstring body kept after removing the summary ------------------------------------


def docstring_function(name: str, body_words: int) -> str:
    body = " ".join(f"w{i}" for i in range(body_words))
    return f'def {name}():\n    """Return the sum of two numbers.\n\n    {body}\n    """\n    return 1\n\n\n'


def test_summary_keeps_functions_with_at_least_min_body_words(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rel = "_elasticfw_edge_case_summary_module.py"  # a name no standard library has (the readers cache by name)
    source = (docstring_function("nineteen", 19) + docstring_function("twenty", 20)
              + docstring_function("twenty_five", 25))
    (tmp_path / rel).write_text(source, encoding="utf-8")
    monkeypatch.setattr(code_completion, "stdlib_root", lambda: tmp_path)
    found = documented_functions(rel, 4, 30, 20)
    assert [(d.qualname, d.body_words, d.summary) for d in found] == [
        ("twenty", 20, "Return the sum of two numbers."),
        ("twenty_five", 25, "Return the sum of two numbers."),
    ]


def test_may_hold_counts_a_token_per_byte_at_most() -> None:
    # a token covers at least one UTF-8 byte: 3 bytes may hold 3 tokens, not 4; "é" is 2 bytes
    assert code_completion.may_hold("abc", 3) and not code_completion.may_hold("abc", 4)
    assert code_completion.may_hold("é", 2) and not code_completion.may_hold("é", 3)


def test_corpus_files_leave_out_excluded_directories_at_any_depth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # test suites, config-* folders and the other excluded directories are left out wherever they
    # sit (ctypes/test, idlelib/idle_test), as are the removed top-level modules; a module named
    # like an excluded directory (pkg/test.py) is kept
    for rel in ["os.py", "json/__init__.py", "json/decoder.py", "pkg/test.py", "test/test_os.py",
                "ctypes/test/test_loading.py", "idlelib/idle_test/test_run.py", "config-3.11-x86_64/makesetup.py",
                "pkg/config-x/conf.py", "pkg/site-packages/mod.py", "asyncore.py", "_sysconfigdata_x.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    monkeypatch.setattr(code_completion, "stdlib_root", lambda: tmp_path)
    assert code_completion.stdlib_files() == ("json/__init__.py", "json/decoder.py", "os.py", "pkg/test.py")


def test_a_line_holding_two_statements_is_never_an_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `a = ...; b = ...` is not a line-completion target (its second statement starts mid-line);
    # the one-statement lines are. Indices are 0-based lines of the file.
    name = "elasticfw_semicolon_probe_module.py"  # not a stdlib name (the readers cache by name)
    (tmp_path / name).write_text(
        "def f(compute):\n"
        "    first_value = compute(1); second_value = compute(2)\n"
        "    third_value = compute(3)\n"
        "    return first_value + second_value + third_value\n"
    )
    monkeypatch.setattr(code_completion, "stdlib_root", lambda: tmp_path)
    assert code_completion.candidate_lines(name, 16, 80) == (2, 3)
