"""Passkey retrieval (Mohtashami & Jaggi, 2023, arXiv 2305.16300): a 5-digit key hidden in
repeated filler text; the model must repeat it. The needle's token span is recorded, so the
same samples serve as retrieval-score probes (Elastic Attention App. C, Eq. 9)."""

from __future__ import annotations

import math
import random
import re
from typing import Any, Literal

from pydantic import Field, field_validator

from elasticfw.errors import UnsupportedInputError
from elasticfw.eval.task import Sample, Split, Task, TaskConfig, check_split

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key?"


class PasskeyConfig(TaskConfig):
    name: Literal["passkey"] = "passkey"
    context_tokens: int = Field(1500, ge=64, le=1_000_000, description="Approximate prompt length in tokens.")
    num_samples: int = Field(20, ge=1, le=1_000_000, description="Number of samples (per split).")
    depths: list[float] | None = Field(
        None, description="Needle depths in [0, 1] cycled over samples; default: evenly spread 0.1..0.9."
    )
    digits: int = Field(5, ge=1, le=12, description="Digits of the pass key.")

    @field_validator("depths")
    @classmethod
    def _depths(cls, value: list[float] | None) -> list[float] | None:
        if value is not None:
            if not value:
                raise ValueError("give at least one depth, or leave depths out for the default spread")
            bad = [d for d in value if not (math.isfinite(d) and 0.0 <= d <= 1.0)]
            if bad:
                raise ValueError(f"every needle depth must lie in [0, 1] (0 = start, 1 = end), got {bad[0]!r}")
        return value
    chat_template: bool = Field(True, description="Wrap the prompt in the tokenizer's chat template if it has one.")
    answer_prefix: str = Field("The pass key is", description="Assistant text placed before generation.")


class PasskeyTask(Task):
    """Find the pass key in filler text (needle in a haystack)."""

    name = "passkey"
    config_class = PasskeyConfig
    config: PasskeyConfig
    category = "sensitive"
    default_max_new_tokens = 8

    def _depths(self) -> list[float]:
        cfg = self.config
        if cfg.depths:
            bad = [d for d in cfg.depths if not 0.0 <= d <= 1.0]
            if bad:
                raise UnsupportedInputError(f"eval.task.depths: {bad} outside [0, 1]")
            return [cfg.depths[i % len(cfg.depths)] for i in range(cfg.num_samples)]
        n = cfg.num_samples
        return [0.1 + 0.8 * (i / max(n - 1, 1)) for i in range(n)]

    def _render(self, tokenizer: Any, body: str) -> str:
        cfg = self.config
        if cfg.chat_template and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
            )
        else:
            text = body + "\n"
        return text + cfg.answer_prefix

    def samples(self, tokenizer: Any, *, seed: int, split: Split = "eval") -> list[Sample]:
        check_split(split)
        cfg = self.config
        # the eval split keeps the historical seed; the train split draws keys from another stream
        rng = random.Random(seed if split == "eval" else f"passkey-train-{seed}")
        filler_tokens = max(1, len(tokenizer(FILLER, add_special_tokens=False)["input_ids"]))
        overhead = len(tokenizer(self._render(tokenizer, INTRO + NEEDLE.format(key="0" * cfg.digits) + QUESTION),
                                 add_special_tokens=False)["input_ids"])
        repeats = max(1, (cfg.context_tokens - overhead) // filler_tokens)
        depths = self._depths()
        if split == "train" and not cfg.depths:  # training: random depths, not the evaluation grid
            depths = [rng.uniform(0.05, 0.95) for _ in depths]
        out = []
        for depth in depths:
            key = str(rng.randrange(10 ** (cfg.digits - 1), 10**cfg.digits))
            before = round(repeats * depth)
            needle = NEEDLE.format(key=key)
            body = INTRO + FILLER * before + needle + FILLER * (repeats - before) + QUESTION
            text = self._render(tokenizer, body)
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            start_char = text.index(needle)
            end_char = start_char + len(needle)
            toks = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < end_char and b > start_char]
            span = (toks[0], toks[-1] + 1) if toks else None
            out.append(
                Sample(
                    list(enc["input_ids"]), key, span, {"depth": depth, "tokens": len(enc["input_ids"])},
                    target=f" {key}.", answers=(key,), needle_spans=(span,) if span else (),
                )
            )
        return out

    def score(self, sample: Sample, completion: str) -> float:
        found = re.search(r"\d+", completion)
        return float(found is not None and found.group(0) == sample.answer)
