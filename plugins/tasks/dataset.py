"""Your own data as a task: a Hugging Face dataset (``datasets.load_dataset``) or local JSON
Lines / JSON / Parquet files whose records carry LongBench's fields (Bai et al., 2024,
arXiv 2308.14508): ``context``, ``input``, ``answers`` (a list), ``all_classes`` (optional),
``length`` and ``_id``. Field names are remappable, so any QA-, summarisation-,
classification- or code-completion-style data fits.

The prompt is a template with ``{context}`` and ``{input}`` (modelled on LongBench's
per-dataset prompts), optionally wrapped in the tokenizer's chat template; a context that
would make the prompt longer than ``context_tokens`` is cut *in the middle* (LongBench's rule:
keep its first and last halves). The metric is chosen in the config; a completion scores the
maximum over the record's reference answers, as LongBench does.

Train / eval split: the data's own splits (``train_split`` / ``train_path``), or else a stable
hash partition of the records of ``path`` by their ``_id`` (row index when a record has none):
record ``k`` belongs to the eval split when ``sha256(k)`` mapped to [0, 1) is below
``eval_fraction``. The partition does not depend on the seed, so no seed ever moves a record
between splits; the seed only picks and orders the ``num_samples`` records of a split.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from elasticfw.errors import UnsupportedInputError
from elasticfw.eval.metrics import code_edit_similarity, rouge_l
from elasticfw.eval.task import Sample, Split, Task, TaskConfig, check_split

#: a generic QA prompt in LongBench's style (its multifieldqa_en prompt)
DEFAULT_TEMPLATE = (
    "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
    "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
PLACEHOLDER = re.compile(r"\{(context|input)\}")
LOCAL_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}
PUNCTUATION = frozenset(string.punctuation)
MetricName = Literal["qa_f1", "rouge", "classification", "code_sim", "exact_match", "contains"]


class DatasetTaskConfig(TaskConfig):
    name: Literal["dataset"] = "dataset"
    path: str | None = Field(
        None,
        description="The eval records: a local .jsonl / .json / .parquet file, or a dataset name or folder for "
        "datasets.load_dataset (e.g. THUDM/LongBench). Required.",
    )
    subset: str | None = Field(None, description="Configuration name for datasets.load_dataset (LongBench: hotpotqa, ...).")
    revision: str | None = Field(None, description="Dataset revision for datasets.load_dataset.")
    split: str = Field("test", min_length=1, description="Split of a load_dataset source that holds the eval records (a local file has one).")
    train_path: str | None = Field(
        None, description="Train records from another source (same forms as path). Default: the source of path."
    )
    train_split: str | None = Field(
        None,
        description="Split of the train source holding the train records (the data's own split). With neither "
        "train_path nor train_split, the records of path are hash-partitioned between train and eval by _id.",
    )
    eval_fraction: float = Field(
        0.5, gt=0.0, lt=1.0, description="Hash partition: share of the records that belong to the eval split."
    )
    format: Literal["auto", "jsonl", "json", "parquet"] = Field(
        "auto", description="Format of local files; auto: by suffix (.jsonl/.ndjson, .json, .parquet/.pq)."
    )
    context_field: str = Field("context", min_length=1, description="Record field holding the long context.")
    input_field: str = Field("input", min_length=1, description="Record field holding the question / instruction.")
    answers_field: str = Field("answers", min_length=1, description="Record field holding the reference answers (a list or one string).")
    all_classes_field: str = Field("all_classes", min_length=1, description="Record field listing the classes (classification metric).")
    length_field: str = Field("length", min_length=1, description="Record field holding the context length (for length_range).")
    id_field: str = Field("_id", min_length=1, description="Record field holding a stable record id (hash partition).")
    needles_field: str | None = Field(
        None, description="Optional record field: evidence string(s) inside the context; their token spans become needle spans."
    )
    template: str = Field(DEFAULT_TEMPLATE, description="Prompt with {context} and (optionally) {input}.")
    chat_template: bool = Field(True, description="Wrap the prompt in the tokenizer's chat template if it has one.")
    answer_prefix: str = Field("", description="Assistant text placed after the (chat-wrapped) prompt, before generation.")
    target_prefix: str | None = Field(
        None,
        description="Text before the first answer in the training target; default: a space when the prompt ends "
        "in a non-space character, else nothing.",
    )
    context_tokens: int = Field(
        3000, ge=64, le=1_000_000,
        description="Maximum prompt length in tokens: longer contexts are cut in the middle; shorter records stay as they are.",
    )
    metric: MetricName = Field("qa_f1", description="How a completion is scored against each reference answer.")
    first_line_only: bool = Field(
        False, description="Score only the first line of the completion (LongBench does for trec, triviaqa, samsum, lsht)."
    )
    category: Literal["sensitive", "robust"] = Field("sensitive", description="Sparsity category of this data (paper §4).")
    length_range: list[int] | None = Field(
        None, description="Keep records whose length field lies in [min, max) (LongBench-E buckets: [0, 4000], ...)."
    )
    shuffle: bool = Field(True, description="Pick the split's records in a seeded random order (else in file order).")

    @field_validator("template")
    @classmethod
    def _template(cls, value: str) -> str:
        if "{context}" not in value:
            raise ValueError("the template must contain {context} (where the record's context goes)")
        return value

    @field_validator("length_range")
    @classmethod
    def _length_range(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (len(value) != 2 or not 0 <= value[0] < value[1]):
            raise ValueError(f"expected [min, max] with 0 <= min < max, got {value}")
        return value


# -- metrics (LongBench's definitions; score = max over the reference answers) -------------------


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles (a, an, the), single spaces (SQuAD / LongBench)."""
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def qa_f1(prediction: str, reference: str, all_classes: Sequence[str] | None = None) -> float:
    """Token F1 between the normalised prediction and reference (LongBench's qa_f1_score)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def rouge(prediction: str, reference: str, all_classes: Sequence[str] | None = None) -> float:
    """ROUGE-L F-measure: :func:`elasticfw.eval.metrics.rouge_l` (rouge-score, no stemming)."""
    return rouge_l(prediction, reference)


def classification(prediction: str, reference: str, all_classes: Sequence[str] | None = None) -> float:
    """LongBench's classification score: the classes named in the prediction (substring match),
    less those that are a proper substring of the reference; 1/len(them) if the reference is
    among them, else 0. (LongBench's similarity fallback for "no class named" is unreachable in
    its code, which scores 0 then; so does this.)"""
    if not all_classes:
        raise UnsupportedInputError("the classification metric needs the record's all_classes (none given)")
    named = [c for c in all_classes if c in prediction]
    named = [c for c in named if not (c in reference and c != reference)]
    return 1.0 / len(named) if reference in named else 0.0


def code_sim(prediction: str, reference: str, all_classes: Sequence[str] | None = None) -> float:
    """LongBench's code_sim_score: :func:`elasticfw.eval.metrics.code_edit_similarity` (the first
    line of the prediction without `` ` ``, ``#`` or ``//``, edit similarity to the reference)."""
    return code_edit_similarity(prediction, reference)


def exact_match(prediction: str, reference: str, all_classes: Sequence[str] | None = None) -> float:
    """1 if prediction and reference are equal after :func:`normalize_answer`."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


def contains(prediction: str, reference: str, all_classes: Sequence[str] | None = None) -> float:
    """1 if the normalised reference occurs as whole words in the normalised prediction."""
    ref = normalize_answer(reference)
    return float(bool(ref) and f" {ref} " in f" {normalize_answer(prediction)} ")


METRICS: dict[str, Callable[[str, str, Sequence[str] | None], float]] = {
    "qa_f1": qa_f1,
    "rouge": rouge,
    "classification": classification,
    "code_sim": code_sim,
    "exact_match": exact_match,
    "contains": contains,
}


# -- reading records -----------------------------------------------------------------------------


def hash_bucket(key: str) -> float:
    """A stable position in [0, 1) for a record key (sha256; no seed, no Python hash)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0**64


def _decode(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UnsupportedInputError(
            f"{path}: not UTF-8 text (byte {exc.start}, line {line}: {raw[exc.start:exc.start + 4]!r}); "
            "convert the file to UTF-8"
        ) from None


def _jsonl(text: str, path: Path) -> list[Any]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise UnsupportedInputError(f"{path}, line {number}: not valid JSON ({exc.msg}, column {exc.colno})") from None
    return rows


def read_local(path: Path, fmt: str) -> list[dict[str, Any]]:
    """Records of a local JSON Lines, JSON (an array of records, or JSON Lines) or Parquet file."""
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows: list[Any] = pq.read_table(path).to_pylist()
        except (pa.ArrowInvalid, OSError) as exc:
            raise UnsupportedInputError(f"{path}: not a readable Parquet file ({exc})") from None
    else:
        text = _decode(path.read_bytes(), path)
        if fmt == "jsonl":
            rows = _jsonl(text, path)
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                if exc.msg != "Extra data":
                    raise UnsupportedInputError(
                        f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
                    ) from None
                data = _jsonl(text, path)  # several JSON values: JSON Lines under a .json name
            if not isinstance(data, list):
                raise UnsupportedInputError(
                    f"{path}: expected a JSON array of records (or JSON Lines), found a {type(data).__name__}"
                )
            rows = data
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise UnsupportedInputError(f"{path}: record {i} is a {type(row).__name__}, expected an object of fields")
    return rows


class DatasetTask(Task):
    """Your data: a Hugging Face dataset or local JSONL / JSON / Parquet files, LongBench fields."""

    name = "dataset"
    config_class = DatasetTaskConfig
    config: DatasetTaskConfig
    default_max_new_tokens = 32

    def __init__(self, config: DatasetTaskConfig | None = None) -> None:
        super().__init__(config)
        # the config chooses what the class attributes declare for fixed tasks
        self.category = self.config.category  # type: ignore[misc]
        self.metric = self.config.metric  # type: ignore[misc]

    # -- sources -----------------------------------------------------------------------------
    def _sources(self) -> dict[str, tuple[str, str, str]]:
        """split -> (recipe key naming the source, source, split name); both splits read the same
        source when it is hash-partitioned."""
        cfg = self.config
        if not cfg.path:
            raise UnsupportedInputError(
                "eval.task.path: required — a local .jsonl/.json/.parquet file or a dataset name for "
                "datasets.load_dataset"
            )
        if cfg.train_path is None and cfg.train_split is None:
            return {"eval": ("eval.task.path", cfg.path, cfg.split), "train": ("eval.task.path", cfg.path, cfg.split)}
        train = (cfg.train_path or cfg.path, cfg.train_split or cfg.split)
        if self._local(train[0]) is not None and self._local(cfg.path) is not None:
            same = Path(train[0]).expanduser().resolve() == Path(cfg.path).expanduser().resolve()
        else:
            same = train == (cfg.path, cfg.split)
        if same:
            raise UnsupportedInputError(
                f"eval.task.train_path / train_split: the train records would be the eval records "
                f"({train[0]!r}, split {train[1]!r}); name another source or split, or set neither to "
                "hash-partition path"
            )
        key = "eval.task.train_path" if cfg.train_path else "eval.task.path"
        return {"eval": ("eval.task.path", cfg.path, cfg.split), "train": (key, train[0], train[1])}

    @property
    def partitioned(self) -> bool:
        return self.config.train_path is None and self.config.train_split is None

    def _local(self, source: str) -> str | None:
        """The format of ``source`` if it names a local data file (existing or not), else None."""
        if self.config.format != "auto":
            return self.config.format
        return LOCAL_SUFFIXES.get(Path(source).suffix.lower())

    def _load(self, key: str, source: str, split: str) -> list[dict[str, Any]]:
        fmt = self._local(source)
        if fmt is not None:
            path = Path(source).expanduser()
            if not path.is_file():
                raise UnsupportedInputError(f"{key} = {source!r}: no such file (looked at {str(path.resolve())!r})")
            return read_local(path, fmt)
        import datasets

        try:
            ds = datasets.load_dataset(source, name=self.config.subset, split=split, revision=self.config.revision)
        except (FileNotFoundError, ValueError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as exc:
            raise UnsupportedInputError(
                f"{key} = {source!r} (subset {self.config.subset!r}, split {split!r}): datasets.load_dataset "
                f"failed: {exc}"
            ) from exc
        return [dict(row) for row in ds]

    def data_fingerprint(self) -> dict[str, Any]:
        """What identifies the data read (content hash of local files; name, subset, revision and
        split of load_dataset sources). :func:`elasticfw.eval.dataset.task_dataset` keys its
        cache on it, so an edited file is never served from a stale cache."""
        out: dict[str, Any] = {}
        for split, (_, source, name) in self._sources().items():
            path = Path(source).expanduser()
            entry: dict[str, Any] = {"source": source, "subset": self.config.subset, "revision": self.config.revision,
                                     "split": name}
            files: list[Path] = []
            if path.is_file():
                files = [path]
            elif path.is_dir():  # a dataset folder for load_dataset
                files = sorted(p for p in path.rglob("*") if p.is_file())
            if files:  # local data: its content decides, not its name
                digest = hashlib.sha256()
                for file in files:
                    digest.update(str(file.relative_to(path) if file != path else file.name).encode("utf-8"))
                    with file.open("rb") as f:
                        for chunk in iter(lambda: f.read(1 << 22), b""):
                            digest.update(chunk)
                entry = {"local": str(path.resolve()), "sha256": digest.hexdigest(), "split": name}
            out[split] = entry
        return out

    def _records(self, split: Split) -> list[tuple[int, str, dict[str, Any]]]:
        """(row index, record key, record) of ``split``, before sampling."""
        cfg = self.config
        sources = self._sources()
        key, source, name = sources[split]
        rows = self._load(key, source, name)
        keyed = [(i, self._key(row, i), row) for i, row in enumerate(rows)]
        if self.partitioned:
            keyed = [r for r in keyed if (hash_bucket(r[1]) < cfg.eval_fraction) == (split == "eval")]
        else:
            other = "train" if split == "eval" else "eval"
            okey, osource, oname = sources[other]
            other_ids = {str(r[cfg.id_field]) for r in self._load(okey, osource, oname) if r.get(cfg.id_field) not in (None, "")}
            shared = sorted({k for _, k, r in keyed if r.get(cfg.id_field) not in (None, "")} & other_ids)
            if shared:
                raise UnsupportedInputError(
                    f"eval.task: {len(shared)} record id(s) ({cfg.id_field}) are in both the train and the eval "
                    f"records, e.g. {shared[:3]}; the splits must not share samples"
                )
        if cfg.length_range is not None:
            low, high = cfg.length_range
            keyed = [r for r in keyed if low <= self._length(r) < high]
        return keyed

    def _key(self, row: dict[str, Any], index: int) -> str:
        value = row.get(self.config.id_field)
        return f"row-{index}" if value is None or value == "" else str(value)

    def _length(self, item: tuple[int, str, dict[str, Any]]) -> int:
        index, _, row = item
        value = self._field(row, index, "length_field", required=True)
        if not isinstance(value, int) or isinstance(value, bool):
            raise UnsupportedInputError(
                f"record {index}: field {self.config.length_field!r} (eval.task.length_field) is {value!r}, expected an integer"
            )
        return value

    def _field(self, row: dict[str, Any], index: int, key: str, *, required: bool) -> Any:
        field = getattr(self.config, key)
        if field not in row or (required and row[field] is None):
            if not required:
                return None
            present = ", ".join(sorted(map(str, row))) or "(none)"
            problem = f"has no field {field!r}" if field not in row else f"has null in field {field!r}"
            raise UnsupportedInputError(
                f"record {index} ({self._key(row, index)}) {problem} (eval.task.{key}); "
                f"its fields: {present}. Rename the field with eval.task.{key}=<name>"
            )
        return row[field]

    # -- prompts -----------------------------------------------------------------------------
    def _render(self, tokenizer: Any, context: str, question: str) -> str:
        cfg = self.config
        body = PLACEHOLDER.sub(lambda m: context if m.group(1) == "context" else question, cfg.template)
        if cfg.chat_template and getattr(tokenizer, "chat_template", None):
            body = tokenizer.apply_chat_template(
                [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
            )
        return body + cfg.answer_prefix

    @staticmethod
    def _encode(tokenizer: Any, text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def _fit(self, tokenizer: Any, context: str, question: str, where: str) -> tuple[str, bool]:
        """The context, cut in the middle so the prompt takes at most ``context_tokens`` tokens."""
        limit = self.config.context_tokens
        if len(self._encode(tokenizer, self._render(tokenizer, context, question))) <= limit:
            return context, False
        overhead = len(self._encode(tokenizer, self._render(tokenizer, "", question)))
        ctx = self._encode(tokenizer, context)
        budget = min(limit - overhead, len(ctx) - 1)
        while budget > 0:
            head = budget // 2
            cut = tokenizer.decode(ctx[:head], skip_special_tokens=True, clean_up_tokenization_spaces=False)
            cut += tokenizer.decode(ctx[len(ctx) - (budget - head):], skip_special_tokens=True,
                                    clean_up_tokenization_spaces=False)
            need = len(self._encode(tokenizer, self._render(tokenizer, cut, question)))
            if need <= limit:
                return cut, True
            budget -= need - limit  # tokens can merge differently across the cut: shrink and retry
        raise UnsupportedInputError(
            f"{where}: eval.task.context_tokens = {limit} leaves no room for the context: the template, question "
            f"and chat template alone take {overhead} tokens; raise context_tokens"
        )

    def _needle_spans(self, tokenizer: Any, text: str, context: str, needles: list[str]) -> list[tuple[int, int]]:
        if not getattr(tokenizer, "is_fast", False):
            raise UnsupportedInputError(
                f"eval.task.needles_field needs a fast tokenizer (character offsets); {type(tokenizer).__name__} is not"
            )
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        start = text.find(context)
        spans = []
        for needle in needles:
            at = text.find(needle, max(start, 0))
            if not needle or at < 0:
                continue  # cut away by the truncation
            toks = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < at + len(needle) and b > at]
            if toks:
                spans.append((toks[0], toks[-1] + 1))
        return spans

    def _sample(self, tokenizer: Any, index: int, key: str, row: dict[str, Any]) -> Sample:
        cfg = self.config
        where = f"record {index} ({key})"
        context = self._field(row, index, "context_field", required=True)
        if not isinstance(context, str):
            raise UnsupportedInputError(f"{where}: field {cfg.context_field!r} is a {type(context).__name__}, expected text")
        question = self._field(row, index, "input_field", required="{input}" in cfg.template)
        question = "" if question is None else str(question)
        answers = self._answers(self._field(row, index, "answers_field", required=True), where)
        classes = self._field(row, index, "all_classes_field", required=cfg.metric == "classification")
        if classes is not None and not (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)):
            raise UnsupportedInputError(
                f"{where}: field {cfg.all_classes_field!r} (eval.task.all_classes_field) is {classes!r}, "
                "expected a non-empty list of class names"
            )
        context, truncated = self._fit(tokenizer, context, question, where)
        text = self._render(tokenizer, context, question)
        ids = self._encode(tokenizer, text)
        spans: list[tuple[int, int]] = []
        if cfg.needles_field is not None:
            needles = self._field(row, index, "needles_field", required=True)
            needles = [needles] if isinstance(needles, str) else [str(n) for n in needles]
            spans = self._needle_spans(tokenizer, text, context, needles)
        prefix = cfg.target_prefix if cfg.target_prefix is not None else ("" if not text or text[-1].isspace() else " ")
        length = row.get(cfg.length_field)
        meta = {
            "id": key, "index": index, "tokens": len(ids), "truncated": truncated,
            "length": length if isinstance(length, int) else None, "all_classes": classes,
        }
        return Sample(
            ids, answers[0], spans[0] if spans else None, meta,
            target=prefix + answers[0], answers=tuple(answers), needle_spans=tuple(spans),
        )

    def _answers(self, value: Any, where: str) -> list[str]:
        items = [value] if isinstance(value, (str, int, float)) and not isinstance(value, bool) else value
        if not isinstance(items, list) or not items or not all(
            isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in items
        ):
            raise UnsupportedInputError(
                f"{where}: field {self.config.answers_field!r} (eval.task.answers_field) is {value!r}, expected a "
                "non-empty list of answers (or one answer)"
            )
        answers = [str(a) for a in items]
        if not all(a.strip() for a in answers):
            raise UnsupportedInputError(f"{where}: an answer in {self.config.answers_field!r} is empty: {answers!r}")
        return answers

    # -- the Task contract ---------------------------------------------------------------------
    def samples(self, tokenizer: Any, *, seed: int, split: Split = "eval") -> list[Sample]:
        check_split(split)
        cfg = self.config
        records = self._records(split)
        if len(records) < cfg.num_samples:
            how = (f"the {split} part ({cfg.eval_fraction if split == 'eval' else 1 - cfg.eval_fraction:.0%}) of the "
                   "hash partition" if self.partitioned else f"the {split} records")
            raise UnsupportedInputError(
                f"eval.task.num_samples = {cfg.num_samples} but {how} of {self._sources()[split][1]!r} has "
                f"{len(records)} record(s)" + (f" within length_range {cfg.length_range}" if cfg.length_range else "")
                + "; lower num_samples"
            )
        if cfg.shuffle:
            random.Random(f"dataset-{split}-{seed}").shuffle(records)
        return [self._sample(tokenizer, i, k, row) for i, k, row in records[: cfg.num_samples]]

    def score(self, sample: Sample, completion: str) -> float:
        prediction = completion.lstrip("\n").split("\n")[0] if self.config.first_line_only else completion
        metric = METRICS[self.config.metric]
        classes = sample.meta.get("all_classes")
        return max(metric(prediction, reference, classes) for reference in (sample.answers or (sample.answer,)))
