"""In-context classification, LongBench ``trec``-style (Bai et al., 2024, arXiv 2308.14508; TREC:
Li & Roth, 2002): many labelled examples, then a query to label from the same closed label set,
scored by exact match. A sparsity-robust task (Elastic Attention, arXiv 2601.17367, §4).

Each example is a documented standard-library function or class (its qualified name and its
docstring's summary), labelled with its top-level package; the splits are disjoint by source file.
The examples nearest the query are a balanced block of ``near_examples_per_label`` per label, so a
local window sees every label; the rest of the context is drawn from the whole split. Queries
cycle through the labels (chance: ``1 / len(labels)``). Score:
:func:`elasticfw.eval.metrics.exact_match` of the completion's first line. The label choice and
what a small model does with it: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import ast
import random
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from pydantic import Field, field_validator

from elasticfw.errors import UnsupportedInputError
from elasticfw.eval.metrics import exact_match
from elasticfw.eval.task import Sample, Split, Task, TaskConfig, check_split
from elasticfw_plugins.tasks.code_completion import (
    check_length,
    definitions,
    n_tokens,
    parse_source,
    render_prompt,
    split_of,
    stdlib_files,
)

# tkinter is left out: Python builds without Tk (many containers) lack its sources
DEFAULT_LABELS = ("asyncio", "email", "importlib", "multiprocessing", "unittest", "xml")
INSTRUCTION = (
    "Each docstring below comes from a package of Python's standard library. "
    "Determine the package of the last one. Here are some examples.\n\n"
)
EXAMPLE = "Definition: {qualname}\nDocstring: {text}\nPackage: {label}\n\n"
QUERY = "Definition: {qualname}\nDocstring: {text}\n"


@dataclass(frozen=True)
class Item:
    """One labelled example: a definition's docstring summary and its package."""

    file: str
    qualname: str
    text: str
    label: str

    def example(self) -> str:
        return EXAMPLE.format(qualname=self.qualname, text=self.text, label=self.label)

    def query(self) -> str:
        return QUERY.format(qualname=self.qualname, text=self.text)


def docstring_summary(doc: str) -> str:
    """The summary of a (cleaned) docstring: its first paragraph with whitespace collapsed."""
    return " ".join(doc.strip().split("\n\n", 1)[0].split())


@lru_cache(maxsize=8)
def labelled_items(labels: tuple[str, ...], min_words: int = 3, max_words: int = 30) -> tuple[Item, ...]:
    """Every usable example of the packages ``labels``, over both splits, in corpus order."""
    items: list[Item] = []
    for rel in stdlib_files():
        package = rel.split("/", 1)[0]
        if "/" not in rel or package not in labels:
            continue
        tree = parse_source(rel)
        if tree is None:
            continue
        for qualname, node in definitions(tree):
            doc = ast.get_docstring(node)  # type: ignore[arg-type]
            if not doc:
                continue
            text = docstring_summary(doc)
            if min_words <= len(text.split()) <= max_words:
                items.append(Item(rel, qualname, text, package))
    counts = Counter(item.text for item in items)
    return tuple(item for item in items if counts[item.text] == 1)


class FewshotConfig(TaskConfig):
    name: Literal["fewshot"] = "fewshot"
    context_tokens: int = Field(1500, ge=128, le=1_000_000, description="Approximate prompt length in tokens.")
    num_samples: int = Field(20, ge=1, le=1_000_000, description="Number of samples (per split).")
    labels: list[str] = Field(
        list(DEFAULT_LABELS), min_length=2, max_length=30,
        description="The closed label set: top-level standard-library packages (their docstrings are the examples).",
    )
    near_examples_per_label: int = Field(
        2, ge=1, le=50, description="Examples of every label in the block right before the query."
    )
    chat_template: bool = Field(
        False, description="Wrap the prompt in the tokenizer's chat template if it has one (LongBench trec: no)."
    )
    answer_prefix: str = Field("Package:", max_length=200, description="Text placed right before the answer.")

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: list[str]) -> list[str]:
        bad = [v for v in value if not v.isidentifier()]
        if bad:
            raise ValueError(f"labels must be package names (Python identifiers), got {bad}")
        dup = sorted(v for v, n in Counter(value).items() if n > 1)
        if dup:
            raise ValueError(f"labels must be distinct; repeated: {dup}")
        return value


class FewshotTask(Task):
    """Label a standard-library docstring with its package from many examples (LongBench trec-style)."""

    name = "fewshot"
    config_class = FewshotConfig
    config: FewshotConfig
    category = "robust"
    metric = "accuracy"
    default_max_new_tokens = 6

    def pool(self, split: Split) -> dict[str, list[Item]]:
        """The examples of ``split``, per label (corpus order); every label must have enough."""
        check_split(split)
        cfg = self.config
        by_label: dict[str, list[Item]] = defaultdict(list)
        for item in labelled_items(tuple(sorted(cfg.labels))):
            if split_of(item.file) == split:
                by_label[item.label].append(item)
        need = cfg.near_examples_per_label + 1
        short = {label: len(by_label[label]) for label in cfg.labels if len(by_label[label]) < need}
        if short:
            raise UnsupportedInputError(
                f"fewshot task, field labels: the {split} split holds too few documented definitions of {short} "
                f"(need at least near_examples_per_label + 1 = {need} each, in the standard library of this "
                "Python); choose packages with more docstrings"
            )
        return {label: by_label[label] for label in cfg.labels}

    def _render(self, tokenizer: Any, body: str) -> str:
        cfg = self.config
        return render_prompt(tokenizer, body, chat_template=cfg.chat_template, answer_prefix=cfg.answer_prefix)

    def samples(self, tokenizer: Any, *, seed: int, split: Split = "eval") -> list[Sample]:
        check_split(split)
        cfg = self.config
        rng = random.Random(f"fewshot:{split}:{seed}")
        pool = self.pool(split)
        everything = [item for label in cfg.labels for item in pool[label]]
        cost: dict[Item, int] = {}

        def tokens(item: Item) -> int:
            if item not in cost:
                cost[item] = n_tokens(tokenizer, item.example())
            return cost[item]

        spaced = bool(cfg.answer_prefix) and not cfg.answer_prefix.endswith((" ", "\n"))
        order = list(cfg.labels)
        rng.shuffle(order)
        out: list[Sample] = []
        for i in range(cfg.num_samples):
            label = order[i % len(order)]
            query = rng.choice(pool[label])
            near: list[Item] = []
            for other in cfg.labels:
                near += rng.sample([it for it in pool[other] if it != query], cfg.near_examples_per_label)
            rng.shuffle(near)
            tail = "".join(it.example() for it in near) + query.query()
            shortest = len(self._encode(tokenizer, [], tail))
            if shortest > 1.1 * cfg.context_tokens:
                raise UnsupportedInputError(
                    f"fewshot task, field context_tokens={cfg.context_tokens} is too short for the instruction, the "
                    "query and "
                    f"{cfg.near_examples_per_label} examples of each of {len(cfg.labels)} labels ({shortest} tokens); "
                    "raise context_tokens or lower near_examples_per_label"
                )
            room = cfg.context_tokens - shortest
            taken = {query, *near}
            candidates = [it for it in everything if it not in taken]
            rng.shuffle(candidates)
            # a generous first guess from per-example counts, then the exact count of far examples
            guess = 0
            for item in candidates:
                if room <= 0:
                    break
                guess += 1
                room -= tokens(item)
            size = guess + guess // 4 + 2
            while True:
                far = candidates[:size]

                def encode(k: int, far: list[Item] = far, tail: str = tail) -> list[int]:
                    return self._encode(tokenizer, far[:k], tail)

                k = self._fit(encode, len(far), cfg.context_tokens)
                if k < len(far) or len(far) == len(candidates):
                    break
                size *= 2  # the guess was short: every candidate fitted
            far = far[:k]
            ids = encode(k)
            # the next example overshoots: fill the gap with the first unused example that fits it
            gap = cfg.context_tokens - len(ids)
            spare = (it for it in candidates[k:] if tokens(it) <= gap)
            filler = next(spare, None) if gap > 0.02 * cfg.context_tokens else None
            if filler is not None:
                far.append(filler)
                ids = self._encode(tokenizer, far, tail)
            if len(ids) < 0.9 * cfg.context_tokens and k == len(candidates):
                raise UnsupportedInputError(
                    f"task 'fewshot': the {split} split has {len(everything)} examples of labels {cfg.labels}, "
                    f"too few to fill context_tokens={cfg.context_tokens}; lower context_tokens"
                )
            check_length(self.name, len(ids), cfg.context_tokens)
            files = sorted({it.file for it in far + near})
            out.append(
                Sample(
                    ids,
                    label,
                    meta={
                        "query_file": query.file, "query": query.qualname, "text": query.text,
                        "example_files": files, "examples": len(far) + len(near), "near_examples": len(near),
                        "tokens": len(ids),
                    },
                    target=(" " if spaced else "") + label,
                    answers=(label,),
                )
            )
        return out

    def _encode(self, tokenizer: Any, far: list[Item], tail: str) -> list[int]:
        body = INSTRUCTION + "".join(it.example() for it in far) + tail
        return list(tokenizer(self._render(tokenizer, body), add_special_tokens=False)["input_ids"])

    @staticmethod
    def _fit(encode: Callable[[int], list[int]], most: int, target: int) -> int:
        """The number ``k <= most`` of far examples whose prompt length is closest to ``target``
        (prompt length grows with ``k``; binary search for the last ``k`` at or below it)."""
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(encode(mid)) <= target:
                lo = mid
            else:
                hi = mid - 1
        if lo < most and abs(len(encode(lo + 1)) - target) < abs(len(encode(lo)) - target):
            return lo + 1
        return lo

    def score(self, sample: Sample, completion: str) -> float:
        return exact_match(completion, sample.answer)
