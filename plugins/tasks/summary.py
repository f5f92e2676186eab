"""One-line summarisation of a documented function, scored by ROUGE-L F1: a summarisation task in
the sense of LongBench's ``gov_report`` / ``multi_news`` / ``samsum`` (Bai et al., 2024, arXiv
2308.14508), built offline from the running Python's standard library. A sparsity-robust task
(Elastic Attention, arXiv 2601.17367, §4).

A sample shows a standard-library function with the one-line summary removed from its docstring
(PEP 257's first line, written by its author) and asks for that line; the function comes last,
after the code of its own file up to ``context_tokens``, so the evidence lies right before the
question. Files are split as in :mod:`elasticfw_plugins.tasks.code_completion`. Score:
:func:`elasticfw.eval.metrics.rouge_l` (F1, no stemming) of the completion's first non-empty
line. Why this construction, and the baseline a fixed answer sets:
``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from pydantic import Field, model_validator

from elasticfw.errors import UnsupportedInputError
from elasticfw.eval.metrics import first_line, rouge_l
from elasticfw.eval.task import Sample, Split, Task, TaskConfig, check_split
from elasticfw_plugins.tasks.code_completion import (
    TokenizedFile,
    check_length,
    definitions,
    may_hold,
    n_tokens,
    parse_source,
    read_source,
    render_prompt,
    split_files,
)

HEADER = "Here is Python code from the file `{file}` of the standard library.\n\n```python\n"
QUESTION = (
    "```\n\nThe first line of the docstring of `{name}`, the last function above, was removed. "
    "Write that line: a one-sentence summary of what `{name}` does."
)
_OPENING = re.compile(r"^(\s*[rRuU]?(?:\"\"\"|'''))(.*)$")


@dataclass(frozen=True)
class Documented:
    """A function whose docstring summary can be removed: where it is and what remains."""

    file: str
    qualname: str
    start_line: int  # 1-based first line of the definition (its first decorator)
    start_offset: int  # character offset of that line in the file
    source: str  # the definition's source with the summary paragraph removed from its docstring
    summary: str  # the removed paragraph, whitespace collapsed
    body_words: int


def _docstring_summary(doc: str) -> tuple[str, str]:
    head, _, rest = doc.strip().partition("\n\n")
    return " ".join(head.split()), rest.strip()


def _functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method, in source order."""
    return [(name, node) for name, node in definitions(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def remove_summary(lines: list[str], fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The function's source with its docstring's first paragraph removed; ``None`` when the
    docstring is not a triple-quoted literal with a blank line after its summary."""
    doc = fn.body[0]
    first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
    seg = lines[doc.lineno - 1 : doc.end_lineno]
    match = _OPENING.match(seg[0])
    if match is None:
        return None
    start = 1 if not match.group(2).strip() else 0  # the summary starts after the quotes or below them
    blank = next((k for k in range(start + 1, len(seg) - 1) if not seg[k].strip()), None)
    if blank is None:
        return None
    kept = [match.group(1), *seg[blank + 1 :]]
    return "\n".join(lines[first - 1 : doc.lineno - 1] + kept + lines[doc.end_lineno : fn.end_lineno])


def _reparsed_docstring(source: str, indented: bool) -> str | None:
    text = "if 1:\n" + source if indented else source
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    node = tree.body[0].body[0] if indented else tree.body[0]  # type: ignore[attr-defined]
    return ast.get_docstring(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


@lru_cache(maxsize=1024)
def documented_functions(rel_path: str, min_words: int, max_words: int, min_body_words: int) -> tuple[Documented, ...]:
    """The functions of a corpus file usable as samples, in source order."""
    tree = parse_source(rel_path)
    if tree is None:
        return ()
    lines = read_source(rel_path).split("\n")
    out = []
    for qualname, fn in _functions(tree):
        doc = ast.get_docstring(fn)
        if not doc:
            continue
        summary, body = _docstring_summary(doc)
        body_words = len(body.split())
        if not (min_words <= len(summary.split()) <= max_words and body_words >= min_body_words):
            continue
        source = remove_summary(lines, fn)
        # keep the function only if the edit leaves exactly the rest of the docstring
        if source is None or _reparsed_docstring(source, fn.col_offset > 0) != body:
            continue
        first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
        offset = sum(len(line) + 1 for line in lines[: first - 1])
        out.append(Documented(rel_path, qualname, first, offset, source, summary, body_words))
    return tuple(out)


class SummaryConfig(TaskConfig):
    name: Literal["summary"] = "summary"
    context_tokens: int = Field(1500, ge=256, le=1_000_000, description="Approximate prompt length in tokens.")
    num_samples: int = Field(20, ge=1, le=1_000_000, description="Number of samples (per split).")
    chat_template: bool = Field(True, description="Wrap the prompt in the tokenizer's chat template if it has one.")
    answer_prefix: str = Field("", max_length=200, description="Assistant text placed before generation.")
    min_summary_words: int = Field(4, ge=1, le=100, description="Shortest reference summary, in words.")
    max_summary_words: int = Field(30, ge=1, le=100, description="Longest reference summary, in words.")
    min_body_words: int = Field(
        20, ge=0, le=10_000, description="Fewest words the docstring keeps once its summary is removed."
    )

    @model_validator(mode="after")
    def _word_bounds(self) -> SummaryConfig:
        if self.min_summary_words > self.max_summary_words:
            raise ValueError(
                f"min_summary_words ({self.min_summary_words}) must not exceed max_summary_words "
                f"({self.max_summary_words})"
            )
        return self


class SummaryTask(Task):
    """Write the removed one-line summary of a standard-library function's docstring (ROUGE-L)."""

    name = "summary"
    config_class = SummaryConfig
    config: SummaryConfig
    category = "robust"
    metric = "rougeL"
    default_max_new_tokens = 48

    def _render(self, tokenizer: Any, item: Documented, context: str) -> str:
        cfg = self.config
        body = (
            HEADER.format(file=item.file) + context + item.source + "\n" + QUESTION.format(name=item.qualname)
        )
        return render_prompt(tokenizer, body, chat_template=cfg.chat_template, answer_prefix=cfg.answer_prefix)

    def _items(self, rel: str) -> tuple[Documented, ...]:
        cfg = self.config
        return documented_functions(rel, cfg.min_summary_words, cfg.max_summary_words, cfg.min_body_words)

    def samples(self, tokenizer: Any, *, seed: int, split: Split = "eval") -> list[Sample]:
        check_split(split)
        cfg = self.config
        rng = random.Random(f"summary:{split}:{seed}")
        files = split_files(split)
        rng.shuffle(files)
        tokenized: dict[str, TokenizedFile] = {}
        used: set[tuple[str, str]] = set()
        out: list[Sample] = []
        while len(out) < cfg.num_samples:
            added = 0
            for rel in files:
                if len(out) == cfg.num_samples:
                    break
                sample = self._draw(tokenizer, rel, rng, used, tokenized)
                if sample is not None:
                    out.append(sample)
                    added += 1
            if added == 0:
                raise UnsupportedInputError(
                    f"task 'summary': the {split} split has only {len(out)} documented functions with enough code "
                    f"before them for context_tokens={cfg.context_tokens}, fewer than num_samples={cfg.num_samples}; "
                    "lower context_tokens or num_samples"
                )
        return out

    def _draw(
        self, tokenizer: Any, rel: str, rng: random.Random, used: set[tuple[str, str]], cache: dict[str, TokenizedFile]
    ) -> Sample | None:
        cfg = self.config
        choices = [item for item in self._items(rel) if (rel, item.qualname) not in used]
        rng.shuffle(choices)
        for item in choices:
            used.add((rel, item.qualname))
            budget = cfg.context_tokens - n_tokens(tokenizer, self._render(tokenizer, item, ""))
            if budget < 0:
                continue  # the function alone is longer than the whole prompt may be
            if not may_hold(read_source(rel)[: item.start_offset], budget):
                continue  # too little code before the function
            tf = cache.get(rel) or TokenizedFile.build(tokenizer, read_source(rel))
            cache[rel] = tf
            end = item.start_offset
            start = tf.window_start(end, budget)
            if start is None:
                continue  # too little code before the function
            if item.summary in " ".join(tf.text[start:end].split()):
                continue  # the same summary documents an earlier definition: the answer would be in the prompt
            ids = list(tokenizer(self._render(tokenizer, item, tf.text[start:end]), add_special_tokens=False)["input_ids"])
            check_length(self.name, len(ids), cfg.context_tokens)
            spaced = bool(cfg.answer_prefix) and not cfg.answer_prefix.endswith((" ", "\n"))
            return Sample(
                ids,
                item.summary,
                meta={
                    "file": rel, "function": item.qualname, "line": item.start_line, "context_start": start,
                    "tokens": len(ids),
                },
                target=(" " if spaced else "") + item.summary,
                answers=(item.summary,),
            )
        return None

    def score(self, sample: Sample, completion: str) -> float:
        return rouge_l(first_line(completion), sample.answer)
