"""Batched greedy evaluation of an elastic model on task samples."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from elasticfw.eval.task import Sample, Task, check_context, context_window


@dataclass
class SampleResult:
    completion: str
    score: float
    msr: float
    esr: float
    esr_last_layer: float
    tokens: int


@dataclass
class EvalResult:
    results: list[SampleResult] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict[str, float]:
        n = max(len(self.results), 1)
        return {
            "accuracy": sum(r.score for r in self.results) / n,
            "msr": sum(r.msr for r in self.results) / n,
            "esr": sum(r.esr for r in self.results) / n,
            "esr_last_layer": sum(r.esr_last_layer for r in self.results) / n,
            "samples": len(self.results),
            "seconds": self.seconds,
        }


def pad_batch(samples: list[Sample], pad_id: int, side: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        sl = slice(width - n, width) if side == "left" else slice(0, n)
        ids[i, sl] = torch.tensor(s.input_ids)
        mask[i, sl] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def evaluate(
    elastic: Any,
    tokenizer: Any,
    task: Task,
    samples: list[Sample],
    *,
    batch_size: int = 1,
    max_new_tokens: int = 12,
    padding_side: str = "left",
    progress: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Greedy-generate for every sample (left-padded batches by default) and score it.

    ``elastic`` is an elastic model, or a plain causal LM (full attention: MSR and ESR 0)."""
    model = getattr(elastic, "base", elastic)
    check_context(task.name, samples, context_window(model), extra=max_new_tokens)
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    result = EvalResult()
    start = time.perf_counter()
    for first in range(0, len(samples), batch_size):
        batch = samples[first : first + batch_size]
        ids, mask = pad_batch(batch, pad_id, padding_side, device)
        out = elastic.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
        routing = elastic.routing if model is not elastic else None
        for i, sample in enumerate(batch):
            text = tokenizer.decode(out[i, ids.shape[1] :], skip_special_tokens=True)
            result.results.append(
                SampleResult(
                    completion=text,
                    score=task.score(sample, text),
                    msr=float(routing.msr[i]) if routing is not None else 0.0,
                    esr=float(routing.esr[i]) if routing is not None else 0.0,
                    esr_last_layer=float(routing.esr_last_layer[i]) if routing is not None else 0.0,
                    tokens=len(sample.input_ids),
                )
            )
        if progress is not None:
            progress(min(first + batch_size, len(samples)), len(samples))
    result.seconds = time.perf_counter() - start
    return result
