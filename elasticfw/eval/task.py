"""The contract of a task plugin.

A task builds prompts with known answers, deterministically from a seed, for two *splits*:
``"train"`` (router training: the loss is cross-entropy on :meth:`Task.target`) and ``"eval"``
(greedy generation scored by :meth:`Task.score`). The two splits must not share samples: a task
drawing from a finite pool (source files, documents) partitions it between them.

Every task belongs to a sparsity *category* (paper §4): ``"sensitive"`` tasks (retrieval, QA)
lose accuracy under sparse attention, ``"robust"`` ones (code, summarisation, in-context
learning) do not. A recipe may override the category per training entry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field

from elasticfw.errors import UnsupportedInputError
from elasticfw.registry import PluginConfig

Split = Literal["train", "eval"]
SPLITS: tuple[str, ...] = ("train", "eval")
Category = Literal["sensitive", "robust"]


class TaskConfig(PluginConfig):
    """Base of every task's recipe section."""

    num_samples: int = Field(20, ge=1, le=1_000_000, description="Number of samples (per split).")
    max_new_tokens: int | None = Field(
        None, ge=1, le=4096, description="Greedy tokens generated per sample; default: the task's own."
    )


@dataclass(frozen=True)
class Sample:
    """One prompt with its expected answer.

    ``input_ids`` is the tokenised prompt (chat template applied when the task asks for it);
    ``answer`` the reference answer (``answers`` lists every acceptable one when there are
    several, e.g. multi-value retrieval); ``target`` the text a model should produce after the
    prompt, the training target (default ``" " + answer``). ``needle_span`` is the [start, end)
    token span of the fact to retrieve, if the task has one (retrieval-score calibration reads
    it); ``needle_spans`` every needle's span when there are several.
    """

    input_ids: list[int]
    answer: str
    needle_span: tuple[int, int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    target: str | None = None
    answers: tuple[str, ...] = ()
    needle_spans: tuple[tuple[int, int], ...] = ()

    @property
    def target_text(self) -> str:
        return self.target if self.target is not None else " " + self.answer


class Task(ABC):
    """Builds samples and scores completions."""

    name: ClassVar[str]
    config_class: ClassVar[type[TaskConfig]]
    #: the sparsity category of the task (paper §4); a training recipe may override it
    category: ClassVar[Category] = "sensitive"
    #: name of what :meth:`score` measures (reported beside the score)
    metric: ClassVar[str] = "accuracy"
    #: greedy tokens an answer needs, unless the recipe's ``max_new_tokens`` says otherwise
    default_max_new_tokens: ClassVar[int] = 12

    def __init__(self, config: TaskConfig | None = None) -> None:
        self.config = config if config is not None else self.config_class.model_validate({})

    @abstractmethod
    def samples(self, tokenizer: Any, *, seed: int, split: Split = "eval") -> list[Sample]:
        """``config.num_samples`` samples of ``split``, deterministic given ``seed``."""

    @abstractmethod
    def score(self, sample: Sample, completion: str) -> float:
        """Score of a completion in [0, 1]."""

    def target(self, sample: Sample) -> str:
        """Training target: the text that follows the prompt (loss is taken on its tokens)."""
        return sample.target_text

    @property
    def max_new_tokens(self) -> int:
        configured = getattr(self.config, "max_new_tokens", None)
        return int(configured) if configured is not None else self.default_max_new_tokens


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise UnsupportedInputError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")


def check_context(task_name: str, samples: Sequence[Sample], limit: int | None, *, extra: int = 0) -> None:
    """Refuse samples whose prompt (+ ``extra`` tokens: the answer or the generated tokens) does not
    fit the model's context window ``limit`` (``None``: unknown, nothing to check)."""
    if limit is None or not samples:
        return
    longest = max(range(len(samples)), key=lambda i: len(samples[i].input_ids))
    need = len(samples[longest].input_ids) + extra
    if need > limit:
        raise UnsupportedInputError(
            f"task {task_name!r}: sample {longest} needs {need} tokens ({len(samples[longest].input_ids)} prompt"
            f"{f' + {extra} generated/answer' if extra else ''}) but the model's context window is {limit} tokens; "
            "lower the task's context_tokens"
        )


def context_window(model: Any) -> int | None:
    """The model's context window (``max_position_embeddings``), if its config declares one."""
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None
