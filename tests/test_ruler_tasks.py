"""RULER-style task plugins: niah_single, niah_multikey, niah_multivalue, niah_multiquery,
variable_tracking and kv_retrieval.

Prompts are checked from the decoded text alone: the parsers below read the question and the
needles with regular expressions written from the prompt format (not from the generator), and
derive the answers by themselves. The tokenizer is a byte-level BPE trained here on a few hundred
sentences, with a chat template, so offsets and decoding are those of a real fast tokenizer; one
slow test uses the default model's tokenizer and model.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from elasticfw.errors import RecipeError, UnsupportedInputError
from elasticfw.eval.corpus import Corpus
from elasticfw.eval.task import Sample, Task
from elasticfw.registry import get_registry

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking", "kv_retrieval")
CORPUS_TASKS = TASKS[:-1]
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(Corpus().all_paragraphs()) + [
        "One of the special magic numbers for brave-otter is: 1234567.", "VAR ABCDE = VAR FGHIJ.",
        '"3f9a-c21e": "7b0d-e4a9",',
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = CHAT
    return fast


def config_class(name: str) -> Any:
    cls = get_registry().entry("task", name).config_class
    assert cls is not None
    return cls


def make(name: str, **fields: Any) -> Task:
    return get_registry().make("task", config_class(name)(**fields))


def decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids)


# -- independent parsers of the prompt text ------------------------------------------------------------

NIAH_NEEDLE = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d+)\.")
VT_STATEMENT = re.compile(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.")
KV_PAIR = re.compile(r'"([0-9a-f-]+)": "([0-9a-f-]+)"')


def question_of(text: str) -> str:
    """The last user-turn line (the question), before the assistant turn."""
    user = text.split("<|im_start|>assistant")[0]
    return user.replace("<|im_end|>", "").rstrip().rsplit("\n", 1)[-1]


def expected_answers(name: str, text: str) -> set[str]:
    """The answers, derived from the decoded prompt alone."""
    question = question_of(text)
    if name.startswith("niah"):
        keys = re.findall(r"[a-z]+-[a-z]+", question.split(" for ", 1)[1])
        needles = NIAH_NEEDLE.findall(text)
        return {value for key, value in needles if key in keys}
    if name == "variable_tracking":
        value = re.search(r"assigned the value (\d+)", question).group(1)  # type: ignore[union-attr]
        assigned: dict[str, str] = {}
        for var, rhs in VT_STATEMENT.findall(text):
            assigned[var] = assigned[rhs[4:]] if rhs.startswith("VAR ") else rhs  # follows the text's order
        return {var for var, v in assigned.items() if v == value}
    key = re.search(r'Key: "([0-9a-f-]+)"', text).group(1)  # type: ignore[union-attr]
    return {v for k, v in KV_PAIR.findall(text) if k == key}


def needles_in(name: str, text: str) -> list[str]:
    """Every needle-like statement of the prompt (answers and distractors)."""
    pattern = {"variable_tracking": VT_STATEMENT, "kv_retrieval": KV_PAIR}.get(name, NIAH_NEEDLE)
    return [m.group(0) for m in pattern.finditer(text)]


def haystack_lines(name: str, text: str) -> set[str]:
    """Lines of the prompt that are neither needles nor the task's instructions/question."""
    lines = set()
    for line in text.split("\n"):
        line = line.strip()
        if len(line) > 40 and not needles_in(name, line) and "special magic" not in line and "VAR" not in line \
                and "variable assignment" not in line and "<|im_" not in line:
            lines.add(line)
    return lines


# -- registry and configs ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TASKS)
def test_registered_with_category_and_metric(name: str) -> None:
    task = make(name)
    assert task.name == name and type(task).name == name
    assert task.category == "sensitive" and task.metric == "string_match_all"
    assert task.max_new_tokens >= 8
    assert make(name, max_new_tokens=5).max_new_tokens == 5


@pytest.mark.parametrize("name", TASKS)
@pytest.mark.parametrize(
    "fields, message",
    [
        ({"depth_min": 1.5}, "less than or equal to 1"),
        ({"depth_max": -0.1}, "greater than or equal to 0"),
        ({"depth_min": float("nan")}, "finite number"),
        ({"depth_min": 0.8, "depth_max": 0.2}, "depth_min=0.8 is larger than depth_max=0.2"),
        ({"context_tokens": 64}, "greater than or equal to 128"),
        ({"answer_prefix": "The answer for {nope} is"}, r"unknown fields \['nope'\]"),
        ({"answer_prefix": "broken {"}, "not a valid template"),
        ({"num_samples": 0}, "greater than or equal to 1"),
    ],
)
def test_bad_configs_fail_validation(name: str, fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        config_class(name)(**fields)


@pytest.mark.parametrize("name", [n for n in TASKS if n != "variable_tracking"])
@pytest.mark.parametrize("depths", [[0.5, 1.2], [float("nan")], [-0.5], []])
def test_bad_depth_lists_fail_validation(name: str, depths: list[float]) -> None:
    with pytest.raises(ValidationError, match="depths"):
        config_class(name)(depths=depths)


@pytest.mark.parametrize(
    "name, fields",
    [
        ("niah_single", {"context_tokens": 128, "value_digits": 12}),
        ("niah_multikey", {"context_tokens": 500, "num_keys": 64}),
        ("niah_multivalue", {"context_tokens": 400, "num_values": 16}),
        ("niah_multiquery", {"context_tokens": 400, "num_queries": 16}),
        ("variable_tracking", {"context_tokens": 500, "num_chains": 4, "num_hops": 10}),
        ("kv_retrieval", {"context_tokens": 128, "key_chars": 32, "value_chars": 32}),
    ],
)
def test_context_too_small_for_the_needles_fails_validation(name: str, fields: dict) -> None:
    with pytest.raises(ValidationError, match=r"context_tokens=\d+ is too small .* raise context_tokens to at least"):
        config_class(name)(**fields)
    # the same needles fit a larger context
    config_class(name)(**{**fields, "context_tokens": 8 * fields["context_tokens"]})


def test_missing_corpus_path_fails_validation(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="do not exist"):
        config_class("niah_single")(corpus=[str(tmp_path / "nope.txt")])


def test_recipe_error_names_the_field() -> None:
    from elasticfw.recipe import load_recipe

    root = Path(__file__).resolve().parents[1]
    recipe = load_recipe(root / "recipes" / "quickstart.yaml", ["eval.task.name=niah_multikey", "eval.task.num_keys=3"])
    assert recipe.eval.task.name == "niah_multikey" and recipe.eval.task.num_keys == 3
    with pytest.raises(RecipeError, match=r"eval\.task"):
        load_recipe(root / "recipes" / "quickstart.yaml", ["eval.task.name=niah_single", "eval.task.depths=[0.5,2.0]"])


# -- samples ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TASKS)
def test_deterministic_and_seed_dependent(tokenizer: Any, name: str) -> None:
    task = make(name, num_samples=3, context_tokens=600)
    first = task.samples(tokenizer, seed=11, split="eval")
    again = make(name, num_samples=3, context_tokens=600).samples(tokenizer, seed=11, split="eval")
    other = task.samples(tokenizer, seed=12, split="eval")
    assert len(first) == 3
    assert first == again
    assert all(a.input_ids != b.input_ids and a.answers != b.answers for a, b in zip(first, other))
    assert len({s.answers for s in first}) == 3  # the samples of one call differ too


@pytest.mark.parametrize("name", TASKS)
def test_answer_is_checkable_from_the_prompt(tokenizer: Any, name: str) -> None:
    task = make(name, num_samples=4, context_tokens=500)
    for split in ("train", "eval"):
        for sample in task.samples(tokenizer, seed=3, split=split):
            text = decode(tokenizer, sample.input_ids)
            assert expected_answers(name, text) == set(sample.answers)
            assert sample.answer == sample.answers[0]
            assert sample.target is not None and task.score(sample, sample.target) == 1.0
            assert task.score(sample, task.target(sample)) == 1.0
            assert task.score(sample, " 0000000 zzzz.") == 0.0


@pytest.mark.parametrize("name", TASKS)
def test_needle_spans_decode_to_the_needles(tokenizer: Any, name: str) -> None:
    task = make(name, num_samples=3, context_tokens=500)
    for sample in task.samples(tokenizer, seed=5):
        text = decode(tokenizer, sample.input_ids)
        assert sample.needle_span == sample.needle_spans[0]
        decoded = [decode(tokenizer, sample.input_ids[a:b]) for a, b in sample.needle_spans]
        found = [needles_in(name, d) for d in decoded]
        assert all(len(f) == 1 for f in found), decoded  # each span holds exactly one whole needle
        for d, (needle,) in zip(decoded, found):
            assert len(d.strip(' ,.\n')) <= len(needle) + 2  # and little else
        # the spanned needles are those whose content is the answer
        spanned = [f[0] for f in found]
        if name.startswith("niah"):
            values = {NIAH_NEEDLE.fullmatch(n).group(2) for n in spanned}  # type: ignore[union-attr]
            assert values == set(sample.answers)
        elif name == "kv_retrieval":
            assert [KV_PAIR.fullmatch(n).group(2) for n in spanned] == list(sample.answers)  # type: ignore[union-attr]
        else:
            assert {VT_STATEMENT.fullmatch(n).group(1) for n in spanned} == set(sample.answers)  # type: ignore[union-attr]
        # and the other needles of the prompt are the recorded distractors
        distractors = [needles_in(name, decode(tokenizer, sample.input_ids[a:b]))[0]
                       for a, b in sample.meta["distractor_spans"]]
        if name != "kv_retrieval":
            assert sorted(distractors + spanned) == sorted(needles_in(name, text))


def test_multikey_meta_names_the_asked_key_and_only_the_others_as_distractors(tokenizer: Any) -> None:
    # the keys read from the prompt: the question's one, and the other needles' (the distractors)
    for sample in make("niah_multikey", num_samples=3, context_tokens=600, num_keys=4).samples(tokenizer, seed=0):
        text = decode(tokenizer, sample.input_ids)
        asked = re.findall(r"[a-z]+-[a-z]+", question_of(text).split(" for ", 1)[1])
        needle_keys = [key for key, _ in NIAH_NEEDLE.findall(text)]
        assert [sample.meta["key"]] == asked and len(needle_keys) == 4
        assert sorted(sample.meta["distractor_keys"]) == sorted(k for k in needle_keys if k != asked[0])


@pytest.mark.parametrize("name", CORPUS_TASKS)
def test_haystack_length_is_corrected_to_two_percent(tokenizer: Any, name: str) -> None:
    # the haystack is re-drawn until the prompt is within 2% of context_tokens (the +-10% contract is
    # the bound beyond which a sample is an error)
    context_tokens = 1200
    for sample in make(name, num_samples=4, context_tokens=context_tokens).samples(tokenizer, seed=5):
        assert abs(len(sample.input_ids) - context_tokens) <= 0.02 * context_tokens


def test_multivalue_needs_two_values() -> None:
    # several needles share the key: one value is refused, two are the fewest
    with pytest.raises(ValidationError, match="greater than or equal to 2"):
        config_class("niah_multivalue")(num_values=1)
    assert config_class("niah_multivalue")(num_values=2).num_values == 2


@pytest.mark.parametrize("name", TASKS)
@pytest.mark.parametrize("context_tokens", [300, 1200])
def test_prompt_length_within_ten_percent(tokenizer: Any, name: str, context_tokens: int) -> None:
    if name == "niah_multiquery" and context_tokens == 300:
        context_tokens = 600  # four needles do not fit 300 tokens of this small-vocabulary tokenizer
    task = make(name, num_samples=3, context_tokens=context_tokens)
    for split in ("train", "eval"):
        for sample in task.samples(tokenizer, seed=2, split=split):
            assert abs(len(sample.input_ids) - context_tokens) <= 0.1 * context_tokens
            assert sample.meta["tokens"] == len(sample.input_ids)


@pytest.mark.parametrize("name", TASKS)
def test_splits_share_no_haystack_and_no_needle(tokenizer: Any, name: str) -> None:
    task = make(name, num_samples=6, context_tokens=600)
    texts = {split: [decode(tokenizer, s.input_ids) for s in task.samples(tokenizer, seed=0, split=split)]
             for split in ("train", "eval")}
    needles = {split: {n for t in ts for n in needles_in(name, t)} for split, ts in texts.items()}
    assert needles["train"] and needles["eval"]
    assert not needles["train"] & needles["eval"]
    # no key, value or variable name of one split appears in a needle of the other
    parts = {split: {p for n in ns for p in re.findall(r"[a-z]+-[a-z]+|\d{4,}|[A-Z]{5}|[0-9a-f]{4}-[0-9a-f]{4}", n)}
             for split, ns in needles.items()}
    assert not parts["train"] & parts["eval"] - {"VAR"}
    if name in CORPUS_TASKS:
        lines = {split: set().union(*(haystack_lines(name, t) for t in ts)) for split, ts in texts.items()}
        assert len(lines["train"]) > 10 and len(lines["eval"]) > 10
        assert not lines["train"] & lines["eval"]


@pytest.mark.parametrize("name, fields, pattern", [
    ("niah_multikey", {"num_keys": 8}, r"for ([a-z]+-[a-z]+) is"),  # 64 x 64 keys: overlaps if not partitioned
    ("variable_tracking", {"num_chains": 4, "value_digits": 4}, r"= (\d+)\."),  # 9000 values
])
def test_needle_material_is_partitioned(name: str, fields: dict, pattern: str) -> None:
    """Many drafts (no tokenizer needed) per split: with spaces this small, independent draws for the
    two splits would share keys or values; partitioned draws share none."""
    import random

    task = make(name, context_tokens=4000, **fields)
    drawn: dict[str, set[str]] = {}
    for split in ("train", "eval"):
        rng = random.Random(0)
        texts = [text for _ in range(300) for _, text in task.draft(rng, split, 0.5).inserts]  # type: ignore[attr-defined]
        drawn[split] = {m for text in texts for m in re.findall(pattern, text)}
    assert len(drawn["train"]) > 500 and len(drawn["eval"]) > 500
    assert not drawn["train"] & drawn["eval"]


def test_user_corpus_is_the_haystack(tokenizer: Any, tmp_path: Path) -> None:
    sentences = [f"Sentence {word} of the user corpus tells a short story about a {word} garden in spring."
                 for word in ("red", "green", "blue", "gold", "grey", "pink", "teal", "navy")]
    (tmp_path / "story.txt").write_text("\n\n".join(sentences), encoding="utf-8")
    (tmp_path / "more.txt").write_text("\n\n".join(s.replace("spring", "autumn") for s in sentences), encoding="utf-8")
    task = make("niah_single", num_samples=2, context_tokens=250, corpus=[str(tmp_path)])
    for split in ("train", "eval"):
        own = set(Corpus((str(tmp_path),)).paragraphs(split))
        for sample in task.samples(tokenizer, seed=0, split=split):
            lines = haystack_lines("niah_single", decode(tokenizer, sample.input_ids))
            assert lines and all(line in own or any(p.startswith(line) for p in own) for line in lines)


def test_eval_depth_grid_places_the_needle(tokenizer: Any) -> None:
    task = make("niah_single", num_samples=5, context_tokens=800)
    samples = task.samples(tokenizer, seed=0, split="eval")
    assert [round(s.meta["depth"], 6) for s in samples] == [0.1, 0.3, 0.5, 0.7, 0.9]
    starts = [s.needle_span[0] / len(s.input_ids) for s in samples]  # type: ignore[index]
    assert starts == sorted(starts) and starts[-1] - starts[0] > 0.5
    # depth 0: the needle comes right after the instructions, depth 1: right before the question
    edge = make("niah_single", num_samples=2, context_tokens=800, depths=[0.0, 1.0]).samples(tokenizer, seed=0)
    first, last = (decode(tokenizer, s.input_ids).split("\n") for s in edge)
    intro = next(i for i, line in enumerate(first) if "Make sure to memorize" in line)
    question = next(i for i, line in enumerate(last) if line.startswith("What is the special magic number"))
    assert NIAH_NEEDLE.fullmatch(first[intro + 1]) and not NIAH_NEEDLE.search("\n".join(first[intro + 2:]))
    assert NIAH_NEEDLE.fullmatch(last[question - 1]) and not NIAH_NEEDLE.search("\n".join(last[:question - 1]))
    # train: random depths, not the grid
    train = [s.meta["depth"] for s in task.samples(tokenizer, seed=0, split="train")]
    assert all(0.1 <= d <= 0.9 for d in train) and [round(d, 6) for d in train] != [0.1, 0.3, 0.5, 0.7, 0.9]


def test_variable_tracking_distractor_chains(tokenizer: Any) -> None:
    task = make("variable_tracking", num_samples=3, context_tokens=900, num_chains=3, num_hops=3)
    for sample in task.samples(tokenizer, seed=4):
        text = decode(tokenizer, sample.input_ids)
        statements = VT_STATEMENT.findall(text)
        assert len(statements) == 12 and sum(rhs.isdigit() for _, rhs in statements) == 3
        assert len(sample.answers) == 4 and expected_answers("variable_tracking", text) == set(sample.answers)
        assert sample.target == " " + ", ".join(sample.answers) + "."


def test_chat_template_and_answer_prefix(tokenizer: Any) -> None:
    chat = make("niah_multiquery", num_samples=1, context_tokens=500).samples(tokenizer, seed=0)[0]
    text = decode(tokenizer, chat.input_ids)
    keys = re.findall(r"[a-z]+-[a-z]+", question_of(text).split(" for ", 1)[1])
    assert text.startswith("<|im_start|>user\nSome special magic numbers")
    assert text.endswith(f"<|im_start|>assistant\nThe special magic numbers for {keys[0]}, {keys[1]}, {keys[2]} "
                         f"and {keys[3]} mentioned in the provided text are")
    plain = make("kv_retrieval", num_samples=1, context_tokens=500, chat_template=False,
                 answer_prefix="Value of {key}:").samples(tokenizer, seed=0)[0]
    text = decode(tokenizer, plain.input_ids)
    key = re.search(r'Key: "([0-9a-f-]+)"', text).group(1)  # type: ignore[union-attr]
    assert "<|im_start|>" not in text and text.endswith(f"\nValue of {key}:")


def test_too_many_tokens_with_the_real_tokenizer_is_an_error() -> None:
    """A config that passes the tokenizer-free estimate but not the real count fails when sampling."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # one token per byte: many more tokens than the estimate assumes
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bytes_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    task = make("niah_multikey", num_samples=1, context_tokens=400, num_keys=4)
    with pytest.raises(UnsupportedInputError, match="context_tokens=400"):
        task.samples(bytes_tokenizer, seed=0)


def test_bad_split_is_an_error(tokenizer: Any) -> None:
    with pytest.raises(UnsupportedInputError, match="split"):
        make("niah_single", num_samples=1).samples(tokenizer, seed=0, split="test")  # type: ignore[arg-type]


# -- the metric --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answers, completion, expected",
    [
        (("1234567", "2345678", "3456789"), " 3456789 and 1234567, and I forgot one.", 2 / 3),
        (("1234567", "2345678", "3456789"), "1234567 2345678 3456789", 1.0),
        (("1234567", "2345678", "3456789"), "none of them", 0.0),
        (("1234567",), "The number is 1234567.", 1.0),
        (("1234567",), "The number is 1234566.", 0.0),
        (("ABCDE", "FGHIJ"), "they are: abcde, fghij", 1.0),  # case-insensitive
        (("3f9a-c21e",), '"3F9A-C21E"', 1.0),
        (("ABCDE", "FGHIJ", "KLMNO", "PQRST"), "ABCDE", 0.25),
    ],
)
@pytest.mark.parametrize("name", ["niah_multivalue", "variable_tracking", "kv_retrieval"])
def test_string_match_all_by_hand(name: str, answers: tuple[str, ...], completion: str, expected: float) -> None:
    sample = Sample([1, 2, 3], answers[0], answers=answers)
    assert math.isclose(make(name).score(sample, completion), expected)


# -- the default model --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_retrieves_the_needle_at_short_context() -> None:
    """SmolLM2-135M-Instruct, full attention: the prompt format is one it can answer; the real
    tokenizer keeps prompts within ±10% and targets within max_new_tokens."""
    import torch

    from elasticfw.model.loading import load_model
    from elasticfw.recipe.schema import ModelSection

    model, tok = load_model(ModelSection(name="smollm2-135m", device="cpu"))
    for name in TASKS:
        task = make(name, num_samples=2, context_tokens=1000)
        for sample in task.samples(tok, seed=0, split="train"):
            assert abs(len(sample.input_ids) - 1000) <= 100
            assert len(tok(sample.target, add_special_tokens=False)["input_ids"]) <= task.max_new_tokens
            text = tok.decode(sample.input_ids)
            assert expected_answers(name, text) == set(sample.answers)
    task = make("niah_single", num_samples=3, context_tokens=400, max_new_tokens=10)
    scores = []
    for sample in task.samples(tok, seed=0):
        with torch.no_grad():
            out = model.generate(torch.tensor([sample.input_ids]), max_new_tokens=task.max_new_tokens, do_sample=False)
        scores.append(task.score(sample, tok.decode(out[0, len(sample.input_ids):], skip_special_tokens=True)))
    assert sum(scores) >= 2, scores  # it answers 6 of 6 at 600 tokens
