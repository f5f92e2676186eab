"""Key-value retrieval (Liu et al., 2023, "Lost in the Middle", arXiv 2307.03172; RULER's
``niah_multikey_3`` is the same idea, Hsieh et al., 2024, arXiv 2404.06654).

The haystack is a JSON object of random UUID-like keys and values (``"3f9a-c21e": "7b0d-e4a9"``),
as many pairs as fill ``context_tokens``; the model must return the value of one key. Every pair
but one is a distractor that looks exactly like the answer, so the task does not tolerate
attention that blurs positions. Keys and values are partitioned between the ``train`` and
``eval`` splits by a stable hash, so the splits share no pair.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal

from pydantic import Field

from elasticfw.eval.corpus import draw_for_split
from elasticfw.eval.task import Split
from elasticfw_plugins.tasks.ruler import DEPTHS_DESCRIPTION, Depth, Draft, RulerConfig, RulerTask, depth_grid

INTRO = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:"
PAIR = '"{key}": "{value}"'
QUESTION = 'Key: "{key}"\nWhat is the value corresponding to this key in the JSON object above?'
HEX = "0123456789abcdef"


def uuid_like(chars: int) -> Callable[[random.Random], str]:
    """A drawer of ``chars`` lowercase hex digits grouped by four with hyphens (``3f9a-c21e``)."""

    def draw(rng: random.Random) -> str:
        digits = "".join(rng.choice(HEX) for _ in range(chars))
        return "-".join(digits[i:i + 4] for i in range(0, chars, 4))

    return draw


class KvRetrievalConfig(RulerConfig):
    name: Literal["kv_retrieval"] = "kv_retrieval"
    prefix_fields: ClassVar[frozenset[str]] = frozenset({"key"})

    key_chars: int = Field(8, ge=4, le=32, description="Hex digits of each key (grouped by four with hyphens).")
    value_chars: int = Field(8, ge=4, le=32, description="Hex digits of each value (grouped by four with hyphens).")
    depths: tuple[Depth, ...] | None = Field(
        None, min_length=1, max_length=10_000,
        description=DEPTHS_DESCRIPTION + " The depth is the asked pair's position among the pairs.",
    )
    answer_prefix: str = Field(
        'The value corresponding to the key "{key}" is', max_length=1000,
        description="Assistant text placed before generation; {key} is the asked key.",
    )

    def fixed_texts(self) -> list[str]:
        key, value = "9" * self.key_chars, "9" * self.value_chars
        return [INTRO, QUESTION.format(key=key), self.answer_prefix.replace("{key}", key), "{", "}",
                PAIR.format(key=key, value=value)]

    def needles_phrase(self) -> str:
        return "the instructions and at least one distractor pair"


class KvRetrievalTask(RulerTask):
    """Key-value retrieval: return the value of one key of a JSON object of random UUID-like pairs."""

    name = "kv_retrieval"
    config_class = KvRetrievalConfig
    config: KvRetrievalConfig
    default_max_new_tokens = 20

    @property
    def max_new_tokens(self) -> int:
        configured = self.config.max_new_tokens
        return configured if configured is not None else self.config.value_chars + self.config.value_chars // 4 + 8

    def answer_depths(self, rng: random.Random, split: Split) -> list[float | None]:
        return list(depth_grid(self.config.depths, self.config, rng, split))

    def draft(self, rng: random.Random, split: Split, depth: float | None) -> Draft:
        used: set[str] = set()
        key = draw_for_split(rng, uuid_like(self.config.key_chars), split, used)
        value = draw_for_split(rng, uuid_like(self.config.value_chars), split, used)
        pair = PAIR.format(key=key, value=value)
        depth = depth if depth is not None else rng.uniform(self.config.depth_min, self.config.depth_max)
        return Draft(INTRO, [(depth, pair)], QUESTION.format(key=key), {"key": key}, (value,), f' "{value}".',
                     [pair], meta={"depth": depth, "key": key})

    def _pairs(self, seed: int, split: Split, used: set[str]) -> Iterator[str]:
        rng = random.Random(seed)
        used = set(used)
        keys, values = uuid_like(self.config.key_chars), uuid_like(self.config.value_chars)
        while True:
            key = draw_for_split(rng, keys, split, used)
            yield PAIR.format(key=key, value=draw_for_split(rng, values, split, used))

    def haystack(self, tokenizer: Any, n_tokens: int, seed: int, split: Split, draft: Draft) -> str:
        """Distractor pairs worth about ``n_tokens`` tokens, with the asked pair at its depth."""
        (depth, pair), = draft.inserts
        lines: list[str] = []
        total = 0
        pairs = self._pairs(seed, split, {draft.prefix_values["key"], *draft.answers})
        full = n_tokens <= 0
        while not full:
            batch = [next(pairs) for _ in range(32)]
            for line, ids in zip(batch, tokenizer([line + "," for line in batch], add_special_tokens=False)["input_ids"]):
                full = total + len(ids) > n_tokens
                if full:
                    break
                lines.append(line)
                total += len(ids)
        lines.insert(round(depth * len(lines)), pair)
        return "{\n  " + ",\n  ".join(lines) + "\n}"
