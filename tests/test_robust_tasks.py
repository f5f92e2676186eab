"""The sparsity-robust tasks (code_completion, fewshot, summary) on the standard-library corpus.

Every answer is checked against the real source file, read and parsed here independently of
the tasks (``Path.read_text`` and :mod:`ast`); splits against the documented rule (SHA-256 of
the file's relative path); prompt lengths against ``context_tokens`` with a byte-level BPE
tokenizer trained here (no network) and, in one slow test, the default model's tokenizer.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from elasticfw.errors import RecipeError, UnsupportedInputError
from elasticfw.eval.task import Sample, Task
from elasticfw.recipe import validate_recipe_data
from elasticfw.registry import get_registry
from elasticfw_plugins.tasks.code_completion import CodeCompletionConfig, split_of, stdlib_files
from elasticfw_plugins.tasks.fewshot import DEFAULT_LABELS, FewshotConfig
from elasticfw_plugins.tasks.summary import SummaryConfig

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CHAT = "{% for m in messages %}<|user|>\n{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
ROBUST = ["code_completion", "fewshot", "summary"]


def make_tokenizer(chat: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE (lossless round trip) trained on three standard-library files."""
    text = [(STDLIB / name).read_text(encoding="utf-8") for name in ("textwrap.py", "bisect.py", "heapq.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<pad>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>")
    if chat:
        fast.chat_template = CHAT
    return fast


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="module")
def chat_tok() -> PreTrainedTokenizerFast:
    return make_tokenizer(chat=True)


def make(name: str, **fields: Any) -> Task:
    """Through the registry, as a recipe would."""
    registry = get_registry()
    config = registry.entry("task", name).config_class(**fields)  # type: ignore[misc]
    return registry.make("task", config)


def decode(tok: PreTrainedTokenizerFast, sample: Sample) -> str:
    return str(tok.decode(sample.input_ids))


def split_by_rule(rel: str) -> str:  # the documented rule, written out: sha256("elasticfw-stdlib-split/" + path) < 1/2
    digest = hashlib.sha256(("elasticfw-stdlib-split/" + rel).encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") < 2**63 else "train"


def definitions(tree: ast.AST, prefix: str = "") -> dict[str, ast.AST]:
    """Qualified name -> function/class node, written independently of the tasks."""
    out: dict[str, ast.AST] = {}
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.setdefault(prefix + node.name, node)
            out.update({k: v for k, v in definitions(node, prefix + node.name + ".").items() if k not in out})
        else:
            out.update({k: v for k, v in definitions(node, prefix).items() if k not in out})
    return out


def first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


SMALL = {"num_samples": 6, "context_tokens": 600}
#: fewshot's balanced block of near examples (2 per label by default) must fit short contexts
FIELDS = {"code_completion": {}, "fewshot": {"near_examples_per_label": 1}, "summary": {}}


# -- registry, contract ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ROBUST)
def test_registered_as_robust_tasks(name: str) -> None:
    task = make(name, **SMALL)
    assert type(task).name == name and task.category == "robust"
    assert task.metric == {"code_completion": "edit_sim", "fewshot": "accuracy", "summary": "rougeL"}[name]
    assert task.config.context_tokens == 600 and task.config.num_samples == 6  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ROBUST)
def test_deterministic_per_seed_and_different_across_seeds_and_splits(name: str, tok: PreTrainedTokenizerFast) -> None:
    task = make(name, **SMALL, **FIELDS[name])
    a = task.samples(tok, seed=3, split="eval")
    b = make(name, **SMALL, **FIELDS[name]).samples(tok, seed=3, split="eval")
    assert len(a) == 6
    assert [(s.input_ids, s.answer, s.target) for s in a] == [(s.input_ids, s.answer, s.target) for s in b]
    other = task.samples(tok, seed=4, split="eval")
    assert sum(x.input_ids != y.input_ids for x, y in zip(a, other)) >= 4
    train = task.samples(tok, seed=3, split="train")
    assert {tuple(s.input_ids) for s in train}.isdisjoint({tuple(s.input_ids) for s in a})
    with pytest.raises(UnsupportedInputError, match="split must be one of"):
        task.samples(tok, seed=3, split="test")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ROBUST)
@pytest.mark.parametrize("context_tokens", [600, 1500])
def test_prompt_length_within_ten_percent(name: str, context_tokens: int, tok: PreTrainedTokenizerFast,
                                          chat_tok: PreTrainedTokenizerFast) -> None:
    fields = {"num_samples": 5, "context_tokens": context_tokens, **FIELDS[name]}
    for tokenizer in (tok, chat_tok):
        for s in make(name, **fields).samples(tokenizer, seed=0):
            assert abs(len(s.input_ids) - context_tokens) <= 0.1 * context_tokens
            assert s.meta["tokens"] == len(s.input_ids)


def test_corpus_split_follows_the_path_hash_rule() -> None:
    files = stdlib_files()
    assert list(files) == sorted(files) and len(files) > 300
    assert all(split_of(f) == split_by_rule(f) for f in files)
    counts = Counter(split_of(f) for f in files)
    assert 0.4 < counts["eval"] / len(files) < 0.6
    assert not any(part in {"test", "tests", "idle_test", "site-packages"} for f in files for part in f.split("/"))
    # pinned: changing the rule (salt, hash, share) would silently move files between splits
    assert [split_of(f) for f in ("argparse.py", "asyncio/events.py", "json/decoder.py", "email/charset.py")] == [
        split_by_rule(f) for f in ("argparse.py", "asyncio/events.py", "json/decoder.py", "email/charset.py")
    ]


# -- code_completion -------------------------------------------------------------------------------


def test_code_completion_answer_is_the_next_line_of_the_real_file(tok: PreTrainedTokenizerFast) -> None:
    task = make("code_completion", num_samples=12, context_tokens=500)
    for split in ("eval", "train"):
        for s in task.samples(tok, seed=1, split=split):
            rel = s.meta["file"]
            assert split_of(rel) == split == split_by_rule(rel)
            text = (STDLIB / rel).read_text(encoding="utf-8")
            prompt = decode(tok, s)
            code = text[s.meta["code_start"] : s.meta["code_end"]]
            assert prompt == code  # plain prompt: exactly the code before the line, nothing else
            # it starts at a line start and ends at the end of a non-blank line, before its newline
            assert s.meta["code_start"] == 0 or text[s.meta["code_start"] - 1] == "\n"
            assert text[s.meta["code_end"]] == "\n" and code.split("\n")[-1].strip()
            following = [line for line in text[s.meta["code_end"] :].split("\n") if line.strip()]
            assert following[0].strip() == s.answer
            assert text.split("\n")[s.meta["line"] - 1].strip() == s.answer
            # a predictable line: code, not a comment or a string, of a reasonable length
            assert 16 <= len(s.answer) <= 80 and "#" not in s.answer and not s.answer.startswith(('"', "'"))
            # the training target is what follows the prompt in the file: newline(s), indentation, line
            assert text[s.meta["code_end"] :].startswith(s.target_text) and s.target_text.startswith("\n")
            assert s.target_text.strip() == s.answer


def test_code_completion_splits_share_no_file(tok: PreTrainedTokenizerFast) -> None:
    task = make("code_completion", num_samples=16, context_tokens=300)
    eval_files = {s.meta["file"] for s in task.samples(tok, seed=0, split="eval")}
    train_files = {s.meta["file"] for s in task.samples(tok, seed=0, split="train")}
    assert eval_files and train_files and eval_files.isdisjoint(train_files)


def test_code_completion_score(tok: PreTrainedTokenizerFast) -> None:
    task = make("code_completion", num_samples=2, context_tokens=300)
    s = task.samples(tok, seed=0)[0]
    assert task.score(s, s.target_text + "\n    more()\n") == 1.0
    assert task.score(s, "\n# the next line is\n" + s.answer) == 1.0
    assert task.score(s, "") == 0.0
    half = s.answer[: len(s.answer) // 2]  # a prefix of length h scores 1 - (n - h) / (n + h)
    n, h = len(s.answer), len(half)
    assert task.score(s, half) == pytest.approx(1 - (n - h) / (n + h))


def test_code_completion_longbench_framing_and_chat(tok: PreTrainedTokenizerFast, chat_tok: PreTrainedTokenizerFast) -> None:
    framed = make("code_completion", num_samples=2, context_tokens=400,
                  instruction="Please complete the code given below. \n", answer_prefix="Next line of code:\n")
    s = framed.samples(tok, seed=0)[0]
    prompt = decode(tok, s)
    assert prompt.startswith("Please complete the code given below. \n") and prompt.endswith("\nNext line of code:\n")
    assert not prompt.endswith("\n\nNext line of code:\n")  # one newline after the code, as in the file
    assert s.target_text == s.answer  # after "Next line of code:" the line comes without its indentation
    chat = make("code_completion", num_samples=2, context_tokens=400, chat_template=True)
    c = chat.samples(chat_tok, seed=0)[0]
    assert decode(chat_tok, c).startswith("<|user|>") and decode(chat_tok, c).endswith("<|assistant|>\n")
    # without a chat template in the tokenizer the flag changes nothing
    assert chat.samples(tok, seed=0)[0].input_ids == make("code_completion", num_samples=2,
                                                          context_tokens=400).samples(tok, seed=0)[0].input_ids


# -- fewshot ---------------------------------------------------------------------------------------


def test_fewshot_answer_is_the_package_of_the_query_docstring(tok: PreTrainedTokenizerFast) -> None:
    task = make("fewshot", num_samples=2 * len(DEFAULT_LABELS), context_tokens=900)
    samples = task.samples(tok, seed=2)
    # queries cycle through the labels: every label is asked twice in 2 x labels samples
    assert Counter(s.answer for s in samples) == Counter({label: 2 for label in DEFAULT_LABELS})
    for s in samples:
        rel = s.meta["query_file"]
        assert s.answer == rel.split("/")[0] and split_of(rel) == "eval"
        node = definitions(ast.parse((STDLIB / rel).read_text(encoding="utf-8")))[s.meta["query"]]
        doc = ast.get_docstring(node)  # type: ignore[arg-type]
        assert doc is not None and first_paragraph(doc) == s.meta["text"]
        prompt = decode(tok, s)
        query = f"Definition: {s.meta['query']}\nDocstring: {s.meta['text']}\n"
        assert prompt.endswith(query + "Package:") and prompt.count(f"Docstring: {s.meta['text']}\n") == 1
        assert s.target_text == " " + s.answer


def test_fewshot_every_label_is_in_the_examples_right_before_the_query(tok: PreTrainedTokenizerFast) -> None:
    near = 2
    task = make("fewshot", num_samples=7, context_tokens=1200, near_examples_per_label=near)
    for s in task.samples(tok, seed=5):
        labels = [line.removeprefix("Package: ") for line in decode(tok, s).split("\n") if line.startswith("Package: ")]
        assert set(labels) <= set(DEFAULT_LABELS) and len(labels) == s.meta["examples"]
        last_block = labels[-near * len(DEFAULT_LABELS) :]
        assert Counter(last_block) == Counter({label: near for label in DEFAULT_LABELS})
        assert len(labels) > len(last_block)  # far examples fill the rest of the context


def test_fewshot_with_its_own_label_set(tok: PreTrainedTokenizerFast) -> None:
    task = make("fewshot", num_samples=4, context_tokens=700, labels=["xml", "email", "asyncio"])
    for s in task.samples(tok, seed=0):
        labels = {line.removeprefix("Package: ") for line in decode(tok, s).split("\n") if line.startswith("Package: ")}
        assert labels == {"xml", "email", "asyncio"} and s.answer in labels


def test_fewshot_splits_share_no_source_file(tok: PreTrainedTokenizerFast) -> None:
    task = make("fewshot", num_samples=7, context_tokens=1200)
    files = {}
    for split in ("eval", "train"):
        used = set()
        for s in task.samples(tok, seed=0, split=split):
            used |= {s.meta["query_file"], *s.meta["example_files"]}
        assert all(split_by_rule(f) == split for f in used)
        files[split] = used
    assert files["eval"].isdisjoint(files["train"])


def test_fewshot_score(tok: PreTrainedTokenizerFast) -> None:
    task = make("fewshot", num_samples=2, context_tokens=1200)
    s = task.samples(tok, seed=0)[0]
    assert task.score(s, f" {s.answer.upper()}.\n\nDefinition: x") == 1.0
    wrong = next(label for label in DEFAULT_LABELS if label != s.answer)
    assert task.score(s, f" {wrong}") == 0.0 and task.score(s, f" {s.answer} or {wrong}") == 0.0


def test_fewshot_unknown_or_too_small_label_is_a_clear_error(tok: PreTrainedTokenizerFast) -> None:
    task = make("fewshot", num_samples=2, labels=["asyncio", "no_such_package"])
    with pytest.raises(UnsupportedInputError, match=r"fewshot task, field labels.*no_such_package"):
        task.samples(tok, seed=0)
    crowded = make("fewshot", num_samples=2, context_tokens=128, near_examples_per_label=10)
    with pytest.raises(UnsupportedInputError, match="context_tokens=128 is too short"):
        crowded.samples(tok, seed=0)


def test_fewshot_split_too_small_for_the_context_is_a_clear_error(tok: PreTrainedTokenizerFast) -> None:
    """Every example of two small packages together is far below a 1M-token context: the task says
    so instead of returning prompts at a fraction of the length asked for."""
    task = make("fewshot", num_samples=1, context_tokens=1_000_000, labels=["xml", "email"])
    with pytest.raises(UnsupportedInputError, match="too few to fill context_tokens=1000000"):
        task.samples(tok, seed=0)


# -- summary ---------------------------------------------------------------------------------------


def test_summary_answer_is_the_removed_docstring_summary(tok: PreTrainedTokenizerFast) -> None:
    task = make("summary", num_samples=10, context_tokens=700)
    for split in ("eval", "train"):
        for s in task.samples(tok, seed=1, split=split):
            rel, name = s.meta["file"], s.meta["function"]
            assert split_by_rule(rel) == split
            text = (STDLIB / rel).read_text(encoding="utf-8")
            node = definitions(ast.parse(text))[name]
            assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            doc = ast.get_docstring(node)
            assert doc is not None and first_paragraph(doc) == s.answer
            assert s.answer not in " ".join(decode(tok, s).split())  # the summary was removed
            # the code before the function is the file's own, up to the function's first line
            start = s.meta["context_start"]
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            end = sum(len(line) + 1 for line in text.split("\n")[: first - 1])
            full = decode(tok, s)
            assert end > start and text[start:end] in full
            after = full[full.index(text[start:end]) + end - start :]
            assert after.startswith(text.split("\n")[first - 1] + "\n")  # then the function itself,
            shown = after[: after.rindex("```")]  # up to the fence closing the code
            tree = ast.parse("if 1:\n" + shown if node.col_offset else shown)
            fn: Any = tree.body[0].body[0] if node.col_offset else tree.body[0]  # type: ignore[attr-defined]
            # ... whose docstring is the original's without its first paragraph, and whose code is unchanged
            assert ast.get_docstring(fn) == doc.strip().split("\n\n", 1)[1].strip()
            assert [ast.dump(x) for x in fn.body[1:]] == [ast.dump(x) for x in node.body[1:]]
            assert f"`{name}`" in decode(tok, s).split("```")[-1]  # the question names the function


def test_summary_splits_share_no_file(tok: PreTrainedTokenizerFast) -> None:
    task = make("summary", num_samples=12, context_tokens=400)
    eval_files = {s.meta["file"] for s in task.samples(tok, seed=0, split="eval")}
    train_files = {s.meta["file"] for s in task.samples(tok, seed=0, split="train")}
    assert eval_files and train_files and eval_files.isdisjoint(train_files)


def test_summary_score_is_rouge_l_of_the_first_line(tok: PreTrainedTokenizerFast) -> None:
    task = make("summary", num_samples=1, context_tokens=500)
    s = task.samples(tok, seed=0)[0]
    assert task.score(s, "\n" + s.answer + "\nAnd some more explanation.") == pytest.approx(1.0)
    assert task.score(s, "zzz qqq") == 0.0
    ref = s.answer.lower().replace(".", "").split()
    half = " ".join(ref[: len(ref) // 2])  # LCS = h words: P = 1, R = h / n, F = 2h / (n + h)
    n, h = len(ref), len(ref) // 2
    assert task.score(s, half) == pytest.approx(2 * h / (n + h))


# -- configuration errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "fields", "message"),
    [
        (CodeCompletionConfig, {"min_line_chars": 90, "max_line_chars": 20}, "min_line_chars (90) must not exceed"),
        (CodeCompletionConfig, {"context_tokens": 10}, "greater than or equal to 128"),
        (CodeCompletionConfig, {"num_samples": 0}, "greater than or equal to 1"),
        (FewshotConfig, {"labels": ["asyncio", "asyncio"]}, "labels must be distinct"),
        (FewshotConfig, {"labels": ["asyncio"]}, "at least 2 items"),
        (FewshotConfig, {"labels": ["asyncio", "not a package"]}, "Python identifiers"),
        (FewshotConfig, {"near_examples_per_label": 0}, "greater than or equal to 1"),
        (SummaryConfig, {"min_summary_words": 10, "max_summary_words": 5}, "min_summary_words (10) must not exceed"),
        (SummaryConfig, {"context_tokens": 100}, "greater than or equal to 256"),
        (SummaryConfig, {"summary_words": 5}, "Extra inputs are not permitted"),
    ],
)
def test_bad_config_fails_at_validation(config: Any, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        config(**fields)


def test_bad_recipe_section_names_the_field() -> None:
    with pytest.raises(RecipeError, match=r"eval.task.context_tokens = 10.*greater than or equal to 128"):
        validate_recipe_data({"eval": {"task": {"name": "code_completion", "context_tokens": 10}}})
    with pytest.raises(RecipeError, match=r"eval.task.*min_summary_words \(9\) must not exceed"):
        validate_recipe_data({"eval": {"task": {"name": "summary", "min_summary_words": 9, "max_summary_words": 3}}})
    recipe = validate_recipe_data({"eval": {"task": {"name": "fewshot", "labels": ["xml", "email"]}}})
    assert recipe.eval.task.labels == ["xml", "email"]


def test_too_long_context_for_the_corpus_is_a_clear_error(tok: PreTrainedTokenizerFast) -> None:
    task = make("code_completion", num_samples=2, context_tokens=400_000)
    with pytest.raises(UnsupportedInputError, match="lower context_tokens"):
        task.samples(tok, seed=0)


# -- the default model's tokenizer -------------------------------------------------------------------


@pytest.mark.slow
def test_with_the_default_model_tokenizer() -> None:
    from elasticfw.model.loading import load_model
    from elasticfw.recipe.schema import ModelSection

    _, tokenizer = load_model(ModelSection(name="smollm2-135m"))
    for name in ROBUST:
        task = make(name, num_samples=4, context_tokens=1500)
        for s in task.samples(tokenizer, seed=0):
            assert abs(len(s.input_ids) - 1500) <= 150
            prompt = tokenizer.decode(s.input_ids)
            assert prompt.startswith("<|im_start|>") == (name == "summary")  # chat template: summary only by default



def digest(tok: Any) -> str:
    """A fingerprint of a few samples of every robust task (ids, answers, targets, meta)."""
    out = {}
    for name in ROBUST:
        samples = make(name, num_samples=3, context_tokens=700, **FIELDS[name]).samples(tok, seed=11)
        out[name] = [[s.input_ids, s.answer, s.target, sorted(map(str, s.meta.items()))] for s in samples]
    return hashlib.sha256(json.dumps(out).encode()).hexdigest()


def test_samples_do_not_depend_on_the_process(tok: PreTrainedTokenizerFast) -> None:
    """Another process with another string-hash seed builds the same samples (no set-order leak)."""
    script = "import sys; sys.path.insert(0, 'tests'); import test_robust_tasks as t; print(t.digest(t.make_tokenizer()))"
    env = {**os.environ, "PYTHONHASHSEED": str(1 + hash("x") % 1000)}  # differs from this process's seed
    other = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[1])
    assert other.stdout.strip().splitlines()[-1] == digest(tok)
