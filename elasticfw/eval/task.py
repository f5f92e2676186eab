"""The contract of a task plugin."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from elasticfw.registry import PluginConfig


class TaskConfig(PluginConfig):
    """Base of every task's recipe section."""


@dataclass(frozen=True)
class Sample:
    """One prompt with its expected answer.

    ``input_ids`` is the tokenised prompt (chat template applied when the task asks for it);
    ``needle_span`` is the [start, end) token span of the fact to retrieve, if the task has one
    (retrieval-score calibration reads it).
    """

    input_ids: list[int]
    answer: str
    needle_span: tuple[int, int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Task(ABC):
    """Builds samples and scores completions."""

    name: ClassVar[str]
    config_class: ClassVar[type[TaskConfig]]

    def __init__(self, config: TaskConfig | None = None) -> None:
        self.config = config if config is not None else self.config_class()

    @abstractmethod
    def samples(self, tokenizer: Any, *, seed: int) -> list[Sample]:
        """The task's samples, deterministic given ``seed``."""

    @abstractmethod
    def score(self, sample: Sample, completion: str) -> float:
        """Score of a completion in [0, 1]."""
