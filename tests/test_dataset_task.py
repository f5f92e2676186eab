"""The `dataset` task (your data, LongBench fields) and task samples as a cached datasets.Dataset.

Prompts are checked against text rendered by hand, metrics against hand-computed values of
LongBench's formulas, the hash partition against its documented rule (sha256 of the record id),
and the cache by counting calls to ``samples()``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from elasticfw.errors import RecipeError, UnsupportedInputError
from elasticfw.eval.dataset import dataset_fingerprint, samples_from_dataset, samples_to_dataset, task_dataset
from elasticfw.eval.task import Sample
from elasticfw.recipe import validate_recipe_data
from elasticfw.registry import get_registry
from elasticfw_plugins.tasks.dataset import (
    DEFAULT_TEMPLATE,
    DatasetTask,
    DatasetTaskConfig,
    classification,
    code_sim,
    contains,
    exact_match,
    qa_f1,
    rouge,
)

CORPUS = [
    "Read the following text and answer briefly. Question: what is the capital of France? Answer: Paris.",
    "The quick brown fox jumps over the lazy dog while the cat sat on the mat.",
    "def add(x, y):\n    return x + y\n# a comment",
] * 20
CHAT = "{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"


def make_tokenizer(chat: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE (any text round-trips) trained on a few sentences: no network."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    if chat:
        fast.chat_template = CHAT
    return fast


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return make_tokenizer()


def record(i: int, words: int = 20, **extra: Any) -> dict[str, Any]:
    return {
        "_id": f"rec-{i}", "context": " ".join(f"w{i}x{j}" for j in range(words)), "input": f"What is item {i}?",
        "answers": [f"item {i}", f"number {i}"], "length": words, "all_classes": None, **extra,
    }


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def bucket(key: str) -> float:  # the documented partition rule, written out independently
    return int(hashlib.sha256(key.encode()).hexdigest()[:16], 16) / 2**64


# -- prompts --------------------------------------------------------------------------------------


def test_prompt_target_and_meta_match_the_template(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    rows = [record(i) for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    task = DatasetTask(DatasetTaskConfig(path=str(path), num_samples=6, context_tokens=400))
    samples = task.samples(tok, seed=3)
    assert len(samples) == 6
    by_id = {r["_id"]: r for r in rows}
    for s in samples:
        r = by_id[s.meta["id"]]
        text = DEFAULT_TEMPLATE.replace("{context}", r["context"]).replace("{input}", r["input"])
        assert s.input_ids == ids(tok, text)  # no chat template on this tokenizer: the body as is
        assert s.answer == r["answers"][0] and s.answers == tuple(r["answers"])
        assert s.target == " " + r["answers"][0]  # the prompt ends with "Answer:"
        assert s.meta["truncated"] is False and s.meta["length"] == 20 and s.meta["tokens"] == len(s.input_ids)
        assert s.needle_span is None and s.needle_spans == ()
    assert task.samples(tok, seed=3) == samples  # deterministic
    assert [s.meta["id"] for s in task.samples(tok, seed=4)] != [s.meta["id"] for s in samples]
    unshuffled = DatasetTask(DatasetTaskConfig(path=str(path), num_samples=3, shuffle=False, eval_fraction=0.9))
    eval_ids = [r["_id"] for r in rows if bucket(r["_id"]) < 0.9]
    assert [s.meta["id"] for s in unshuffled.samples(tok, seed=0)] == eval_ids[:3]  # file order


def test_chat_template_answer_prefix_and_remapped_fields(tmp_path: Path) -> None:
    tok = make_tokenizer(chat=True)
    rows = [{"key": f"k{i}", "passage": f"Alpha {i} beta.", "q": f"Which {i}?", "gold": f"beta {i}"} for i in range(8)]
    path = write_jsonl(tmp_path / "custom.jsonl", rows)
    cfg = DatasetTaskConfig(
        path=str(path), num_samples=2, template="Doc: {context}\nQ: {input}", answer_prefix="A:",
        context_field="passage", input_field="q", answers_field="gold", id_field="key", eval_fraction=0.5,
    )
    task = DatasetTask(cfg)
    for s in task.samples(tok, seed=0, split="train"):
        r = next(r for r in rows if r["key"] == s.meta["id"])
        expected = f"<|user|>Doc: {r['passage']}\nQ: {r['q']}\n<|assistant|>\nA:"
        assert s.input_ids == ids(tok, expected)
        assert s.answers == (r["gold"],)  # one string is one answer
        assert s.target == " " + r["gold"] and bucket(r["key"]) >= 0.5
    no_chat = DatasetTask(cfg.model_copy(update={"chat_template": False, "target_prefix": ""}))
    s = no_chat.samples(tok, seed=0)[0]
    r = next(r for r in rows if r["key"] == s.meta["id"])
    assert s.input_ids == ids(tok, f"Doc: {r['passage']}\nQ: {r['q']}A:") and s.target == r["gold"]


def test_long_contexts_are_cut_in_the_middle(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    words = [f"w{j}" for j in range(2000)]
    path = write_jsonl(tmp_path / "long.jsonl", [{"_id": "a", "context": " ".join(words), "input": "Q?", "answers": ["x"]}])
    for limit in (200, 600):
        task = DatasetTask(DatasetTaskConfig(path=str(path), num_samples=1, context_tokens=limit, eval_fraction=0.99))
        (s,) = task.samples(tok, seed=0)
        assert 0.9 * limit <= len(s.input_ids) <= limit and s.meta["truncated"] is True
        text = str(tok.decode(s.input_ids))
        assert text.startswith("Read the following text and answer briefly.\n\nw0 w1 w2 ")
        assert text.endswith(" w1998 w1999\n\nNow, answer the following question based on the above text, only give me "
                             "the answer and do not output any other words.\n\nQuestion: Q?\nAnswer:")
        kept = text.split("\n\n")[1].split()
        assert f"w{len(words) // 2}" not in kept  # the middle goes
        gap = next(j for j, w in enumerate(kept) if w != f"w{j}")  # head and tail halves of the context, in tokens
        head, tail = ids(tok, " ".join(kept[:gap])), ids(tok, " " + " ".join(kept[gap:]))
        assert abs(len(head) - len(tail)) <= 0.1 * (len(head) + len(tail)) + 1, (len(head), len(tail))
    tiny = DatasetTask(DatasetTaskConfig(path=str(path), num_samples=1, context_tokens=64, eval_fraction=0.99))
    with pytest.raises(UnsupportedInputError, match="context_tokens = 64 leaves no room for the context"):
        tiny.samples(tok, seed=0)


def test_needle_spans_point_at_the_evidence(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    rows = [{**record(i, words=30), "evidence": [f"w{i}x7 w{i}x8", f"w{i}x20"]} for i in range(6)]
    path = write_jsonl(tmp_path / "n.jsonl", rows)
    task = DatasetTask(DatasetTaskConfig(path=str(path), num_samples=2, needles_field="evidence"))
    for s in task.samples(tok, seed=0):
        i = s.meta["index"]
        assert len(s.needle_spans) == 2 and s.needle_span == s.needle_spans[0]
        for (a, b), needle in zip(s.needle_spans, rows[i]["evidence"]):
            assert str(tok.decode(s.input_ids[a:b])).strip() == needle


# -- sources and splits ---------------------------------------------------------------------------


def test_hash_partition_follows_the_documented_rule(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    rows = [record(i, words=3) for i in range(60)] + [{k: v for k, v in record(60 + i, words=3).items() if k != "_id"}
                                                       for i in range(20)]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    keys = [r.get("_id", f"row-{i}") for i, r in enumerate(rows)]  # row index when a record has no id
    expected_eval = {k for k in keys if bucket(k) < 0.3}
    n_eval = len(expected_eval)
    cfg = DatasetTaskConfig(path=str(path), eval_fraction=0.3, num_samples=n_eval)
    for seed in (0, 1):  # the seed orders a split, it never moves a record between splits
        assert {s.meta["id"] for s in DatasetTask(cfg).samples(tok, seed=seed)} == expected_eval
    train = DatasetTask(cfg.model_copy(update={"num_samples": len(keys) - n_eval})).samples(tok, seed=0, split="train")
    assert {s.meta["id"] for s in train} == set(keys) - expected_eval
    with pytest.raises(UnsupportedInputError, match=rf"num_samples = {n_eval + 1} but the eval part \(30%\)"):
        DatasetTask(cfg.model_copy(update={"num_samples": n_eval + 1})).samples(tok, seed=0)
    with pytest.raises(UnsupportedInputError, match="split must be one of train, eval"):
        DatasetTask(cfg).samples(tok, seed=0, split="test")  # type: ignore[arg-type]


def test_own_splits_from_files_and_from_a_dataset_folder(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    train_rows, eval_rows = [record(i) for i in range(5)], [record(100 + i) for i in range(4)]
    data = tmp_path / "data"
    data.mkdir()
    train_file, eval_file = write_jsonl(data / "train.jsonl", train_rows), write_jsonl(data / "test.jsonl", eval_rows)
    files = DatasetTask(DatasetTaskConfig(path=str(eval_file), train_path=str(train_file), num_samples=4))
    assert {s.meta["id"] for s in files.samples(tok, seed=0)} == {r["_id"] for r in eval_rows}
    assert {s.meta["id"] for s in files.samples(tok, seed=0, split="train")} < {r["_id"] for r in train_rows}
    # a dataset folder through datasets.load_dataset: its own train / test splits
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    folder = DatasetTask(DatasetTaskConfig(path=str(data), split="test", train_split="train", num_samples=4))
    assert folder.samples(tok, seed=0) == files.samples(tok, seed=0)
    with pytest.raises(UnsupportedInputError, match="Unknown split"):
        DatasetTask(DatasetTaskConfig(path=str(data), split="validation", num_samples=1)).samples(tok, seed=0)
    # the two sources may not share records (and an edited file changes the folder's fingerprint)
    before = folder.data_fingerprint()
    write_jsonl(train_file, train_rows + [eval_rows[0]])
    assert folder.data_fingerprint()["train"] != before["train"]
    with pytest.raises(UnsupportedInputError, match=r"1 record id\(s\) \(_id\) are in both .*'rec-100'"):
        files.samples(tok, seed=0)
    with pytest.raises(UnsupportedInputError, match="the train records would be the eval records"):
        DatasetTask(DatasetTaskConfig(path=str(eval_file), train_path=str(eval_file))).samples(tok, seed=0)


def test_json_and_parquet_give_the_jsonl_samples(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [record(i) for i in range(12)]
    (tmp_path / "d.json").write_text(json.dumps(rows), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    write_jsonl(tmp_path / "d.jsonl", rows)
    write_jsonl(tmp_path / "lines.json", rows)  # JSON Lines under a .json name
    write_jsonl(tmp_path / "d.txt", rows)
    want = DatasetTask(DatasetTaskConfig(path=str(tmp_path / "d.jsonl"), num_samples=4)).samples(tok, seed=1)
    for name, fmt in (("d.json", "auto"), ("d.parquet", "auto"), ("lines.json", "auto"), ("d.txt", "jsonl")):
        task = DatasetTask(DatasetTaskConfig(path=str(tmp_path / name), num_samples=4, format=fmt))  # type: ignore[arg-type]
        assert task.samples(tok, seed=1) == want, name


def test_length_range_keeps_a_bucket(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    rows = [record(i, words=5 * (i + 1)) for i in range(30)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    task = DatasetTask(DatasetTaskConfig(path=str(path), num_samples=3, length_range=[40, 100], eval_fraction=0.7))
    lengths = [s.meta["length"] for s in task.samples(tok, seed=0)]
    assert len(lengths) == 3 and all(40 <= n < 100 for n in lengths)
    with pytest.raises(RecipeError, match=r"eval\.task\.length_range: expected \[min, max\]"):
        validate_recipe_data({"eval": {"task": {"name": "dataset", "length_range": [5, 5]}}})


def test_length_range_is_half_open(tmp_path: Path, tok: PreTrainedTokenizerFast) -> None:
    # [40, 100): a record of length 40 is in, one of 100 is out (as are 39 and 101)
    rows = [record(i, words=w) for i, w in enumerate([39, 40, 99, 100, 101])]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    task = DatasetTask(DatasetTaskConfig(path=str(path), num_samples=2, length_range=[40, 100], eval_fraction=0.99))
    assert sorted(s.meta["length"] for s in task.samples(tok, seed=0)) == [40, 99]
    with pytest.raises(UnsupportedInputError, match="within length_range"):
        DatasetTask(DatasetTaskConfig(path=str(path), num_samples=3, length_range=[40, 100],
                                      eval_fraction=0.99)).samples(tok, seed=0)


def test_a_split_name_may_be_one_character_but_not_empty() -> None:
    assert DatasetTaskConfig(path="x.jsonl", split="a").split == "a"
    with pytest.raises(RecipeError, match="eval.task.split"):
        validate_recipe_data({"eval": {"task": {"name": "dataset", "path": "x.jsonl", "split": ""}}})


@pytest.mark.parametrize(
    ("content", "config", "error"),
    [
        (None, {}, r"eval\.task\.path = '.*missing\.jsonl': no such file \(looked at"),
        ('{"_id": "a", "input": "q", "answers": ["x"], "extra": 1}\n', {},
         r"record 0 \(a\) has no field 'context' \(eval\.task\.context_field\); its fields: _id, answers, extra, input"),
        ('{"_id": "a", "passage": "c", "answers": ["x"]}\n', {"context_field": "passage"},
         r"has no field 'input' \(eval\.task\.input_field\); its fields: _id, answers, passage"),
        (b'{"_id": "a", "context": "caf\xe9", "input": "q", "answers": ["x"]}\n', {},
         r"not UTF-8 text \(byte 28, line 1"),
        ('{"_id": "a", "context": "c", "input": "q", "answers": []}\n', {},
         r"record 0 \(a\): field 'answers' .* expected a non-empty list of answers"),
        ('{"_id": "a"}\n{"_id": \n', {}, r"line 2: not valid JSON"),
        ('{"_id": "a", "context": "c", "input": "q", "answers": ["x"]}\n', {"metric": "classification"},
         r"has no field 'all_classes' \(eval\.task\.all_classes_field\)"),
    ],
)
def test_clear_errors(tmp_path: Path, tok: PreTrainedTokenizerFast, content: str | bytes | None,
                      config: dict[str, Any], error: str) -> None:
    path = tmp_path / "missing.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    task = DatasetTask(DatasetTaskConfig(path=str(path), num_samples=1, eval_fraction=0.99, **config))
    with pytest.raises(UnsupportedInputError, match=error):
        task.samples(tok, seed=0)


def test_recipe_section_and_registration() -> None:
    assert get_registry().get("task", "dataset") is DatasetTask
    with pytest.raises(UnsupportedInputError, match=r"eval\.task\.path: required"):
        DatasetTask().samples(make_tokenizer(), seed=0)
    with pytest.raises(RecipeError, match=r"eval\.task\.template.*must contain \{context\}"):
        validate_recipe_data({"eval": {"task": {"name": "dataset", "template": "no context"}}})
    recipe = validate_recipe_data({"eval": {"task": {"name": "dataset", "path": "x.jsonl", "metric": "rouge",
                                                     "category": "robust", "max_new_tokens": 64}}})
    task = get_registry().make("task", recipe.eval.task)
    assert (task.category, task.metric, task.max_new_tokens) == ("robust", "rouge", 64)
    assert (DatasetTask().category, DatasetTask().metric, DatasetTask().max_new_tokens) == ("sensitive", "qa_f1", 32)


# -- metrics: LongBench's formulas on hand-computed cases -----------------------------------------


def test_metrics_on_hand_computed_cases() -> None:
    # qa_f1: normalised tokens [eiffel, tower] vs [eiffel, tower, in, paris]: P = 1, R = 1/2
    assert qa_f1("The Eiffel tower!", "eiffel tower in Paris") == pytest.approx(2 / 3)
    assert qa_f1("a an the", "the") == 0.0
    # ROUGE-L: LCS("the cat sat on the mat", "the cat on the mat") = 5: P = 5/6, R = 1
    assert rouge("the cat sat on the mat", "the cat on the mat") == pytest.approx(10 / 11)
    assert rouge("", "the cat") == 0.0
    classes = ["Entity", "Human", "Human being", "Location"]
    assert classification("Human being", "Human being", classes) == 1.0  # 'Human' is part of the reference
    assert classification("Entity or Human being", "Human being", classes) == 0.5
    assert classification("Location", "Human being", classes) == 0.0
    assert classification("nothing named", "Human being", classes) == 0.0
    # code: the first line that is no comment; Indel similarity 2 * 10 / (12 + 10)
    assert code_sim("\n# add one\nreturn x + 1\nfoo", "return x+1") == pytest.approx(20 / 22)
    assert code_sim("// only comments", "x = 1") == 0.0
    assert exact_match("  The Paris. ", "paris") == 1.0 and exact_match("Paris France", "paris") == 0.0
    assert contains("It is Paris, France.", "paris") == 1.0 and contains("Parisian", "paris") == 0.0


def test_score_is_the_max_over_answers_and_first_line_only(tmp_path: Path) -> None:
    sample = Sample([1], "item 3", answers=("item 3", "the number three"), meta={"all_classes": None})
    task = DatasetTask(DatasetTaskConfig(path="x.jsonl"))
    assert task.score(sample, "number three") == pytest.approx(max(qa_f1("number three", "item 3"),
                                                                    qa_f1("number three", "the number three")))
    assert task.score(sample, "number three") == 1.0
    first = DatasetTask(DatasetTaskConfig(path="x.jsonl", first_line_only=True, metric="exact_match"))
    assert first.score(sample, "\nitem 3\nand more") == 1.0 and task.score(sample, "\nitem 3\nand more") < 1.0
    cls = DatasetTask(DatasetTaskConfig(path="x.jsonl", metric="classification"))
    labelled = Sample([1], "Human", answers=("Human",), meta={"all_classes": ["Human", "Entity"]})
    assert cls.score(labelled, "Entity, Human") == 0.5


# -- task samples as a cached datasets.Dataset ----------------------------------------------------


def test_samples_round_trip_exactly_through_a_dataset() -> None:
    samples = [
        Sample([5, 6, 7], "a", (1, 2), {"depth": 0.123456789, "id": "x", "n": None, "l": [1, [2.5]]}, target=" a.",
               answers=("a", "b"), needle_spans=((1, 2), (0, 3))),
        Sample([2**40, 0], "", None, {}, target=None, answers=(), needle_spans=()),
    ]
    assert samples_from_dataset(samples_to_dataset(samples)) == samples
    with pytest.raises(UnsupportedInputError, match="meta does not survive JSON unchanged"):
        samples_to_dataset([Sample([1], "a", meta={"span": (1, 2)})])


class CountingTask(DatasetTask):
    calls = 0

    def samples(self, tokenizer: Any, *, seed: int, split: Any = "eval") -> list[Sample]:
        type(self).calls += 1
        return super().samples(tokenizer, seed=seed, split=split)


def test_task_dataset_is_built_once_and_keyed_by_its_inputs(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICFW_CACHE", str(tmp_path / "cache"))
    data = write_jsonl(tmp_path / "d.jsonl", [record(i) for i in range(20)])
    task = CountingTask(DatasetTaskConfig(path=str(data), num_samples=4))
    first = task_dataset(task, tok, seed=0, split="eval")
    assert CountingTask.calls == 1 and len(first) == 4
    assert samples_from_dataset(first) == DatasetTask(task.config).samples(tok, seed=0)
    again = task_dataset(task, tok, seed=0, split="eval")
    assert CountingTask.calls == 1  # loaded from the cache, not regenerated
    assert samples_from_dataset(again) == samples_from_dataset(first)
    assert (tmp_path / "cache" / "datasets").is_dir()
    base = dataset_fingerprint(task, tok, seed=0, split="eval")
    changed = {
        "config": dataset_fingerprint(CountingTask(task.config.model_copy(update={"context_tokens": 999})), tok, seed=0,
                                      split="eval"),
        "seed": dataset_fingerprint(task, tok, seed=1, split="eval"),
        "split": dataset_fingerprint(task, tok, seed=0, split="train"),
        "tokenizer": dataset_fingerprint(task, make_tokenizer(chat=True), seed=0, split="eval"),
    }
    assert base not in changed.values() and len(set(changed.values())) == len(changed)
    task_dataset(task, tok, seed=1, split="eval")
    assert CountingTask.calls == 2
    # an edited data file changes the fingerprint: never a stale cache
    write_jsonl(data, [record(i, words=9) for i in range(20)])
    assert dataset_fingerprint(task, tok, seed=0, split="eval") != base
    fresh = task_dataset(task, tok, seed=0, split="eval")
    assert CountingTask.calls == 3 and samples_from_dataset(fresh)[0].meta["length"] == 9
    task_dataset(task, tok, seed=0, split="eval", refresh=True)
    assert CountingTask.calls == 4


def test_the_how_to_recipes_validate(tmp_path: Path) -> None:
    import re
    import shutil

    from elasticfw.recipe import load_recipe

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "how-to" / "use-your-data.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```yaml\n(.*?)^```", page, flags=re.S | re.M)
    assert len(blocks) >= 3
    shutil.copytree(root / "recipes" / "_base", tmp_path / "_base")
    for i, block in enumerate(blocks):
        path = tmp_path / f"howto-{i}.yaml"
        path.write_text(block, encoding="utf-8")
        recipe = load_recipe(path)
        assert recipe.eval.task.name == "dataset", block
