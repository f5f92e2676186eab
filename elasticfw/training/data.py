"""Training data: the task mixture as token sequences, a deterministic batch schedule, collation.

Every training sample is a task prompt followed by the task's target text; the loss is taken on
the target tokens only, and the router sees the prompt only (``route_lengths``). Which samples
form step ``s`` depends on (seed, s) alone, and each sample's Gumbel noise on (seed, s, slot)
alone, so a resumed run, a run with another micro-batch size and a data-parallel run see the
same global batches and the same noise.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from elasticfw.errors import UnsupportedInputError
from elasticfw.eval.task import Sample, Task, check_context


@dataclass(frozen=True)
class TrainItem:
    """One training sequence: ``prompt`` token ids, then ``target`` token ids."""

    prompt: list[int]
    target: list[int]
    task: int  # index of the task in the mixture

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.target)


@dataclass
class MixtureTask:
    """A task of the mixture, resolved: its plugin, label, category, target and training pool.
    ``cost_target``: its expected-cost target under ``train.constraint: cost`` (else ``None``);
    ``share_targets``: its per-mode share targets {mode label: target} (``train.share_targets``)."""

    label: str
    task: Task
    category: str
    target: Any
    weight: float
    items: list[TrainItem]
    cost_target: Any = None
    share_targets: dict[str, Any] = field(default_factory=dict)

    def constrained_target(self, constraint: str) -> Any:
        """The target of the quantity ``constraint`` (``train.constraint``) names: MSR or cost."""
        return self.cost_target if constraint == "cost" else self.target


def encode_targets(task: Task, samples: list[Sample], tokenizer: Any, index: int, label: str) -> list[TrainItem]:
    items = []
    for i, sample in enumerate(samples):
        text = task.target(sample)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise UnsupportedInputError(
                f"training task {label!r}: sample {i} has an empty target ({text!r}); nothing to learn from"
            )
        items.append(TrainItem(list(sample.input_ids), ids, index))
    return items


def check_items(label: str, items: list[TrainItem], limit: int | None) -> None:
    """Refuse sequences (prompt + target) longer than the model's context window."""
    check_context(label, [Sample(it.prompt, "") for it in items], limit, extra=max(len(it.target) for it in items))


def _seed(*parts: object) -> int:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class Slot:
    """Position ``slot`` of the global batch of step ``step``: which sample, and its noise seed."""

    task: int
    item: int
    noise_seed: int


def step_slots(tasks: list[MixtureTask], step: int, batch_size: int, seed: int) -> list[Slot]:
    """The global batch of ``step``: tasks drawn by weight, samples uniformly from their pool."""
    rng = random.Random(_seed("batch", seed, step))
    weights = [t.weight for t in tasks]
    chosen = rng.choices(range(len(tasks)), weights=weights, k=batch_size)
    return [
        Slot(k, rng.randrange(len(tasks[k].items)), _seed("noise", seed, step, slot)) for slot, k in enumerate(chosen)
    ]


def shard(slots: list[Slot], rank: int, world: int) -> list[Slot]:
    """This process's share of a global batch (contiguous, equal sizes)."""
    if len(slots) % world:
        raise UnsupportedInputError(f"train.batch_size ({len(slots)}) must be a multiple of the {world} processes")
    per = len(slots) // world
    return slots[rank * per : (rank + 1) * per]


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) left-padded
    attention_mask: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, K): targets of the last K positions' next tokens, -100 elsewhere
    route_lengths: torch.Tensor  # (B,) prompt lengths
    task: torch.Tensor  # (B,) task index
    keep: int  # logits to keep (the last K positions)
    tokens: int  # real tokens in the batch

    def to(self, device: torch.device) -> Batch:
        return Batch(
            self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device),
            self.route_lengths.to(device), self.task.to(device), self.keep, self.tokens,
        )


def collate(items: list[TrainItem], pad_id: int) -> Batch:
    """Left-pad prompt+target so every target ends at the last position; keep only the logits
    that predict target tokens (``logits_to_keep``), which bounds the vocabulary projection's
    memory by the longest target, not the context."""
    width = max(it.length for it in items)
    keep = max(len(it.target) for it in items) + 1
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    labels = torch.full((len(items), keep), -100, dtype=torch.long)
    for b, it in enumerate(items):
        seq = it.prompt + it.target
        ids[b, width - len(seq) :] = torch.tensor(seq)
        mask[b, width - len(seq) :] = 1
        # kept position j (absolute width - keep + j) predicts token width - keep + j + 1
        n = len(it.target)
        labels[b, keep - 1 - n : keep - 1] = torch.tensor(it.target)
    return Batch(
        ids, mask, labels,
        torch.tensor([len(it.prompt) for it in items]), torch.tensor([it.task for it in items]),
        keep, int(mask.sum()),
    )
