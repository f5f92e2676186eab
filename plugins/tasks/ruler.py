"""RULER-style retrieval tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", arXiv 2404.06654): needles in a haystack of real prose.

This module holds what the RULER tasks share (the recipe fields, prompt assembly to a target
length, needle token spans, RULER's ``string_match_all`` metric) and the four needle-in-a-haystack
variants: ``niah_single``, ``niah_multikey``, ``niah_multivalue`` and ``niah_multiquery``. The
other two RULER tasks live in :mod:`.variable_tracking` and :mod:`.kv_retrieval`.

A needle reads "One of the special magic numbers for <key> is: <value>." where the key is an
adjective-noun pair and the value a number of ``value_digits`` digits. The haystack is drawn from
:class:`elasticfw.eval.corpus.Corpus` (standard-library docstrings by default); keys, values and
haystack paragraphs are partitioned between the ``train`` and ``eval`` splits by a stable hash, so
the splits share neither needles nor haystack text. These tasks are sparsity-*sensitive*: the
answer sits in a few tokens anywhere in the prompt.
"""

from __future__ import annotations

import math
import random
import re
import string
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from elasticfw.errors import UnsupportedInputError
from elasticfw.eval.corpus import Corpus, draw_for_split
from elasticfw.eval.task import Sample, Split, Task, TaskConfig, check_split

#: at validation time the instructions and needles may take at most this share of context_tokens
#: (estimated with :func:`rough_tokens`); the rest is haystack
MAX_FIXED_SHARE = 0.5
#: with the real tokenizer, the haystack must get at least this share of context_tokens
MIN_HAYSTACK_SHARE = 0.25
#: the prompt length is adjusted until it is within this fraction of context_tokens ...
TARGET_TOLERANCE = 0.02
#: ... and a sample outside this one is an error (the contract promises ±10%)
MAX_TOLERANCE = 0.10

Depth = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
DEPTHS_DESCRIPTION = (
    "Depth in [0, 1] of the answer needle, cycled over samples; default: evenly spread over "
    "[depth_min, depth_max] for eval, uniform at random for train."
)

ADJECTIVES = (
    "amber", "ancient", "bold", "brave", "breezy", "bright", "calm", "clever", "cosy", "crimson",
    "curious", "dusty", "eager", "early", "elegant", "fancy", "fearless", "gentle", "gifted", "golden",
    "grumpy", "handsome", "happy", "hidden", "humble", "icy", "jolly", "kind", "lively", "lucky",
    "mellow", "merry", "misty", "modest", "noble", "odd", "patient", "plain", "polite", "proud",
    "quiet", "rapid", "rustic", "sandy", "shiny", "silent", "silver", "sleepy", "smooth", "snowy",
    "solid", "spicy", "steady", "stormy", "sunny", "swift", "tender", "tidy", "tiny", "velvet",
    "vivid", "wary", "witty", "zesty",
)
NOUNS = (
    "anchor", "apple", "badger", "banjo", "basket", "beacon", "beetle", "blanket", "bridge", "button",
    "cabin", "candle", "canyon", "castle", "cedar", "comet", "cookie", "crystal", "dolphin", "dragon",
    "falcon", "feather", "fiddle", "forest", "fountain", "garden", "glacier", "harbor", "helmet", "island",
    "jacket", "kettle", "lantern", "lemon", "lobster", "meadow", "mirror", "muffin", "needle", "orchid",
    "otter", "paddle", "parrot", "pebble", "pepper", "piano", "pillow", "pirate", "planet", "pocket",
    "puzzle", "rabbit", "ribbon", "rocket", "saddle", "salmon", "sparrow", "spider", "teapot", "tiger",
    "tulip", "violin", "walrus", "window",
)

NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards."
)
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION_ONE = "What is the special magic number for {key} mentioned in the provided text?"
NIAH_QUESTION_ALL = "What are all the special magic numbers for {key} mentioned in the provided text?"


# -- helpers ------------------------------------------------------------------------------------------


def string_match_all(completion: str, answers: Sequence[str]) -> float:
    """RULER's ``string_match_all``: the fraction of reference answers that occur in the completion,
    case-insensitively (1 or 0 when there is one answer)."""
    if not answers:
        raise UnsupportedInputError("string_match_all needs at least one reference answer")
    text = completion.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)


def rough_tokens(text: str) -> int:
    """A tokenizer-free estimate of a text's token count (every digit, every letter run and every
    other non-space character counts one), used to check configs before a tokenizer is known;
    subword tokenizers usually produce at least as many tokens."""
    return len(re.findall(r"\d|[^\W\d_]+|[^\w\s]|_", text))


def enumerate_words(words: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def number(digits: int) -> Callable[[random.Random], str]:
    """A drawer of numbers with exactly ``digits`` digits (for :func:`draw_for_split`)."""
    return lambda rng: str(rng.randrange(10 ** (digits - 1), 10**digits))


def word_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def depth_grid(depths: Sequence[float] | None, cfg: RulerConfig, rng: random.Random, split: Split) -> list[float]:
    """One depth per sample: ``depths`` cycled if given, else evenly spread over [depth_min, depth_max]
    (eval) or uniform at random in it (train: not the evaluation grid)."""
    n = cfg.num_samples
    if depths:
        return [depths[i % len(depths)] for i in range(n)]
    if split == "train":
        return [rng.uniform(cfg.depth_min, cfg.depth_max) for _ in range(n)]
    return [cfg.depth_min + (cfg.depth_max - cfg.depth_min) * (i / max(n - 1, 1)) for i in range(n)]


def token_spans(offsets: Sequence[tuple[int, int]], text: str, needles: Sequence[str]) -> list[tuple[int, int]]:
    """[start, end) token spans of each needle (which must occur exactly once in ``text``), from a
    tokenizer's offset mapping: the tokens whose characters overlap the needle's."""
    spans = []
    for needle in needles:
        if text.count(needle) != 1:
            raise UnsupportedInputError(f"needle {needle!r} occurs {text.count(needle)} times in the prompt, not once")
        start = text.index(needle)
        end = start + len(needle)
        hits = [i for i, (a, b) in enumerate(offsets) if a < end and b > start and b > a]
        if not hits:
            raise UnsupportedInputError(f"needle {needle!r} maps to no token (the tokenizer gives no offsets?)")
        spans.append((hits[0], hits[-1] + 1))
    return spans


# -- config ---------------------------------------------------------------------------------------------


class RulerConfig(TaskConfig):
    """Fields every RULER-style task has (subclasses add ``name`` and their own)."""

    #: names an answer_prefix may use, as {name}
    prefix_fields: ClassVar[frozenset[str]] = frozenset()

    context_tokens: int = Field(
        1500, ge=128, le=1_000_000,
        description="Prompt length in tokens of the model's tokenizer (samples stay within ±10%).",
    )
    depth_min: float = Field(
        0.1, ge=0.0, le=1.0, allow_inf_nan=False,
        description="Needles are placed at depths (0 = start of the haystack, 1 = end) in [depth_min, depth_max].",
    )
    depth_max: float = Field(0.9, ge=0.0, le=1.0, allow_inf_nan=False, description="See depth_min.")
    chat_template: bool = Field(True, description="Wrap the prompt in the tokenizer's chat template if it has one.")
    answer_prefix: str = Field(
        "", max_length=1000, description="Assistant text placed before generation ({fields} are filled in)."
    )
    @model_validator(mode="after")
    def _check(self) -> RulerConfig:
        if self.depth_min > self.depth_max:
            raise ValueError(f"depth_min={self.depth_min} is larger than depth_max={self.depth_max}")
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(self.answer_prefix) if f is not None}
        except ValueError as exc:
            raise ValueError(f"answer_prefix {self.answer_prefix!r} is not a valid template: {exc}") from None
        unknown = sorted(names - self.prefix_fields)
        if unknown:
            allowed = ", ".join("{" + f + "}" for f in sorted(self.prefix_fields)) or "none"
            raise ValueError(f"answer_prefix {self.answer_prefix!r} uses unknown fields {unknown}; allowed: {allowed}")
        fixed = rough_tokens("\n".join(self.fixed_texts()))
        if fixed > MAX_FIXED_SHARE * self.context_tokens:
            raise ValueError(
                f"context_tokens={self.context_tokens} is too small for {self.needles_phrase()}: the instructions "
                f"and needles alone take about {fixed} tokens and at least {1 - MAX_FIXED_SHARE:.0%} of the prompt "
                f"must be haystack; raise context_tokens to at least {math.ceil(fixed / MAX_FIXED_SHARE)} "
                "or use fewer/shorter needles"
            )
        return self

    def fixed_texts(self) -> list[str]:
        """The prompt's fixed parts with needles as long as the config allows (for the estimate)."""
        return []

    def needles_phrase(self) -> str:
        return "the needles"


class CorpusConfig(RulerConfig):
    """A RULER task whose haystack is prose from a :class:`~elasticfw.eval.corpus.Corpus`."""

    corpus: tuple[str, ...] = Field(
        (), max_length=10_000,
        description="Local UTF-8 text files or directories for the haystack; empty: Python standard-library docstrings.",
    )

    @field_validator("corpus")
    @classmethod
    def _corpus_exists(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        missing = [p for p in value if not Path(p).expanduser().exists()]
        if missing:
            raise ValueError(f"corpus paths {missing} do not exist (expected local text files or directories)")
        return value


class NiahConfig(CorpusConfig):
    """Fields of the needle-in-a-haystack tasks."""

    prefix_fields: ClassVar[frozenset[str]] = frozenset({"key"})

    value_digits: int = Field(
        7, ge=4, le=12, description="Digits of each magic number (haystack text never holds 4+ digit runs)."
    )
    depths: tuple[Depth, ...] | None = Field(
        None, min_length=1, max_length=10_000,
        description=DEPTHS_DESCRIPTION + " Other needles: uniform at random in [depth_min, depth_max].",
    )

    def needle_count(self) -> int:
        return 1

    def fixed_texts(self) -> list[str]:
        key, value = "curious-lobster", "9" * self.value_digits
        return [NIAH_INTRO, NIAH_QUESTION_ALL.format(key=key), self.answer_prefix.replace("{key}", key),
                *[NIAH_NEEDLE.format(key=key, value=value)] * self.needle_count()]

    def needles_phrase(self) -> str:
        return f"{self.needle_count()} needle(s) of {self.value_digits}-digit numbers"


class NiahSingleConfig(NiahConfig):
    name: Literal["niah_single"] = "niah_single"
    answer_prefix: str = Field(
        "The special magic number for {key} mentioned in the provided text is", max_length=1000,
        description="Assistant text placed before generation; {key} is the queried key.",
    )


class NiahMultikeyConfig(NiahConfig):
    name: Literal["niah_multikey"] = "niah_multikey"
    num_keys: int = Field(
        4, ge=2, le=256, description="Needles, each with its own key; one key is asked for, the others distract."
    )
    answer_prefix: str = Field(
        "The special magic number for {key} mentioned in the provided text is", max_length=1000,
        description="Assistant text placed before generation; {key} is the queried key.",
    )

    def needle_count(self) -> int:
        return self.num_keys


class NiahMultivalueConfig(NiahConfig):
    name: Literal["niah_multivalue"] = "niah_multivalue"
    num_values: int = Field(4, ge=2, le=32, description="Needles sharing the queried key; all values must be returned.")
    answer_prefix: str = Field(
        "The special magic numbers for {key} mentioned in the provided text are", max_length=1000,
        description="Assistant text placed before generation; {key} is the queried key.",
    )

    def needle_count(self) -> int:
        return self.num_values


class NiahMultiqueryConfig(NiahConfig):
    name: Literal["niah_multiquery"] = "niah_multiquery"
    prefix_fields: ClassVar[frozenset[str]] = frozenset({"keys"})
    num_queries: int = Field(4, ge=2, le=32, description="Needles with distinct keys, all asked for at once.")
    answer_prefix: str = Field(
        "The special magic numbers for {keys} mentioned in the provided text are", max_length=1000,
        description="Assistant text placed before generation; {keys} lists the queried keys.",
    )

    def needle_count(self) -> int:
        return self.num_queries

    def fixed_texts(self) -> list[str]:
        keys = enumerate_words(["curious-lobster"] * self.num_queries)
        return [NIAH_INTRO, NIAH_QUESTION_ALL.format(key=keys), self.answer_prefix.replace("{keys}", keys),
                *[NIAH_NEEDLE.format(key="curious-lobster", value="9" * self.value_digits)] * self.num_queries]


# -- task base ------------------------------------------------------------------------------------------


@dataclass
class Draft:
    """A sample before its haystack: what to insert where, and what is asked."""

    intro: str
    inserts: list[tuple[float, str]]  # (depth, text), in the order they should appear at equal depth
    question: str
    prefix_values: dict[str, str]
    answers: tuple[str, ...]
    target: str
    answer_needles: list[str]  # needles whose content is the answer (their spans are recorded)
    distractors: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


class RulerTask(Task):
    """Shared machinery: prompt assembly to ``context_tokens``, needle spans, ``string_match_all``."""

    config: RulerConfig
    category = "sensitive"
    metric = "string_match_all"

    @abstractmethod
    def draft(self, rng: random.Random, split: Split, depth: float | None) -> Draft:
        """Draw one sample's needles and question (``depth``: of the first answer needle, if given)."""

    def answer_depths(self, rng: random.Random, split: Split) -> list[float | None]:
        """Depth of the first answer needle per sample (``None``: the task places it itself)."""
        return [None] * self.config.num_samples

    def samples(self, tokenizer: Any, *, seed: int, split: Split = "eval") -> list[Sample]:
        check_split(split)
        rng = random.Random(f"{self.name}:{split}:{seed}")
        return [self._assemble(tokenizer, rng, split, self.draft(rng, split, depth))
                for depth in self.answer_depths(rng, split)]

    def score(self, sample: Sample, completion: str) -> float:
        return string_match_all(completion, sample.answers or (sample.answer,))

    # -- prompt assembly ------------------------------------------------------------------------------
    def render(self, tokenizer: Any, body: str, prefix: str) -> str:
        if self.config.chat_template and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
            )
        else:
            text = body + "\n"
        return text + prefix

    def haystack(self, tokenizer: Any, n_tokens: int, seed: int, split: Split, draft: Draft) -> str:
        """The context: ``n_tokens`` of corpus text with the draft's inserts at their depths."""
        config = self.config
        if not isinstance(config, CorpusConfig):
            raise NotImplementedError(f"task {self.name!r} must define its own haystack")
        corpus = Corpus(tuple(config.corpus))
        hay = corpus.fill(tokenizer, n_tokens, random.Random(seed), split)
        return "\n".join(hay.with_inserts(sorted(draft.inserts, key=lambda item: item[0])))

    def _assemble(self, tokenizer: Any, rng: random.Random, split: Split, draft: Draft) -> Sample:
        cfg = self.config
        prefix = cfg.answer_prefix.format(**draft.prefix_values)

        def text_of(context: str) -> str:
            return self.render(tokenizer, f"{draft.intro}\n{context}\n{draft.question}", prefix)

        def count(text: str) -> int:
            return len(tokenizer(text, add_special_tokens=False)["input_ids"])

        overhead = count(text_of("\n".join(text for _, text in draft.inserts)))
        budget = cfg.context_tokens - overhead
        if budget < MIN_HAYSTACK_SHARE * cfg.context_tokens:
            raise UnsupportedInputError(
                f"task {self.name!r}: with this tokenizer the instructions and needles take {overhead} tokens, "
                f"leaving {budget} of context_tokens={cfg.context_tokens} for the haystack (at least "
                f"{MIN_HAYSTACK_SHARE:.0%} is needed); raise context_tokens or use fewer/shorter needles"
            )
        hay_seed = rng.getrandbits(64)
        for _ in range(6):  # token counts of joined paragraphs are not exactly additive: correct
            text = text_of(self.haystack(tokenizer, budget, hay_seed, split, draft))
            n = count(text)
            if abs(n - cfg.context_tokens) <= TARGET_TOLERANCE * cfg.context_tokens:
                break
            budget = max(0, budget + cfg.context_tokens - n)
        if abs(n - cfg.context_tokens) > MAX_TOLERANCE * cfg.context_tokens:
            raise UnsupportedInputError(
                f"task {self.name!r}: could not build a prompt of about {cfg.context_tokens} tokens (got {n})"
            )
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
        spans = token_spans(offsets, text, draft.answer_needles)
        meta = {**draft.meta, "split": split, "tokens": len(enc["input_ids"]),
                "distractor_spans": [list(s) for s in token_spans(offsets, text, draft.distractors)]}
        return Sample(
            list(enc["input_ids"]), draft.answers[0], spans[0] if spans else None, meta,
            target=draft.target, answers=draft.answers, needle_spans=tuple(spans),
        )


# -- needle in a haystack -----------------------------------------------------------------------------


class NiahTask(RulerTask):
    """Base of the four needle-in-a-haystack variants."""

    config: NiahConfig

    def answer_depths(self, rng: random.Random, split: Split) -> list[float | None]:
        return list(depth_grid(self.config.depths, self.config, rng, split))

    def answer_count(self) -> int:
        return 1

    @property
    def max_new_tokens(self) -> int:
        configured = self.config.max_new_tokens
        return configured if configured is not None else self.answer_count() * (self.config.value_digits + 3) + 6

    def needles(self, rng: random.Random, split: Split, depth: float | None, keys: list[str],
                values: list[str]) -> list[tuple[float, str]]:
        """(depth, needle) pairs: the first at ``depth``, the others uniform in [depth_min, depth_max]."""
        cfg = self.config
        first = depth if depth is not None else rng.uniform(cfg.depth_min, cfg.depth_max)
        depths = [first] + [rng.uniform(cfg.depth_min, cfg.depth_max) for _ in keys[1:]]
        return [(d, NIAH_NEEDLE.format(key=k, value=v)) for d, k, v in zip(depths, keys, values)]

    def draw(self, rng: random.Random, split: Split, n_keys: int, n_values: int) -> tuple[list[str], list[str]]:
        keys: set[str] = set()
        values: set[str] = set()
        return ([draw_for_split(rng, word_key, split, keys) for _ in range(n_keys)],
                [draw_for_split(rng, number(self.config.value_digits), split, values) for _ in range(n_values)])

    @staticmethod
    def listed(values: Sequence[str]) -> str:
        return " " + ", ".join(values) + "."


class NiahSingleTask(NiahTask):
    """RULER niah_single: one needle ("the special magic number for <key>") in prose; repeat its number."""

    name = "niah_single"
    config_class = NiahSingleConfig
    default_max_new_tokens = 16

    def draft(self, rng: random.Random, split: Split, depth: float | None) -> Draft:
        keys, values = self.draw(rng, split, 1, 1)
        inserts = self.needles(rng, split, depth, keys, values)
        return Draft(
            NIAH_INTRO, inserts, NIAH_QUESTION_ONE.format(key=keys[0]), {"key": keys[0]}, (values[0],),
            self.listed(values), [inserts[0][1]], meta={"depth": inserts[0][0], "key": keys[0]},
        )


class NiahMultikeyTask(NiahTask):
    """RULER niah_multikey: several needles with different keys; return the number of the asked key."""

    name = "niah_multikey"
    config_class = NiahMultikeyConfig
    config: NiahMultikeyConfig
    default_max_new_tokens = 16

    def draft(self, rng: random.Random, split: Split, depth: float | None) -> Draft:
        n = self.config.num_keys
        keys, values = self.draw(rng, split, n, n)
        inserts = self.needles(rng, split, depth, keys, values)
        return Draft(
            NIAH_INTRO, inserts, NIAH_QUESTION_ONE.format(key=keys[0]), {"key": keys[0]}, (values[0],),
            self.listed(values[:1]), [inserts[0][1]], [text for _, text in inserts[1:]],
            meta={"depth": inserts[0][0], "key": keys[0], "distractor_keys": keys[1:]},
        )


class NiahMultivalueTask(NiahTask):
    """RULER niah_multivalue: several needles share one key; return all of their numbers."""

    name = "niah_multivalue"
    config_class = NiahMultivalueConfig
    config: NiahMultivalueConfig
    default_max_new_tokens = 46

    def answer_count(self) -> int:
        return self.config.num_values

    def draft(self, rng: random.Random, split: Split, depth: float | None) -> Draft:
        n = self.config.num_values
        keys, values = self.draw(rng, split, 1, n)
        inserts = self.needles(rng, split, depth, keys * n, values)
        in_order = [v for _, v in sorted(zip(inserts, values), key=lambda x: x[0][0])]  # order of appearance
        return Draft(
            NIAH_INTRO, inserts, NIAH_QUESTION_ALL.format(key=keys[0]), {"key": keys[0]}, tuple(values),
            self.listed(in_order), [text for _, text in inserts], meta={"depth": inserts[0][0], "key": keys[0]},
        )


class NiahMultiqueryTask(NiahTask):
    """RULER niah_multiquery: several needles with different keys, all asked at once; return every number."""

    name = "niah_multiquery"
    config_class = NiahMultiqueryConfig
    config: NiahMultiqueryConfig
    default_max_new_tokens = 46

    def answer_count(self) -> int:
        return self.config.num_queries

    def draft(self, rng: random.Random, split: Split, depth: float | None) -> Draft:
        n = self.config.num_queries
        keys, values = self.draw(rng, split, n, n)
        inserts = self.needles(rng, split, depth, keys, values)
        asked = enumerate_words(keys)
        return Draft(
            NIAH_INTRO, inserts, NIAH_QUESTION_ALL.format(key=asked), {"keys": asked}, tuple(values),
            self.listed(values), [text for _, text in inserts], meta={"depth": inserts[0][0], "keys": keys},
        )
