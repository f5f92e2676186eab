"""Batched greedy evaluation of an elastic model on task samples."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from elasticfw.errors import ElasticError
from elasticfw.eval.task import Sample, Task, check_context, context_window


@dataclass
class SampleResult:
    """One sample's completion and score, its routing and its batch's timing.

    ``decisions`` lists, per routed layer, each KV head's decision (1: sparse mode, 0: retrieval
    mode); ``None`` for a plain model. ``prefill_seconds`` is the sample's share of its batch's
    prefill time (apportioned by prompt tokens), so the shares of a set of samples add up to the
    time their batches took."""

    completion: str
    score: float
    msr: float
    esr: float
    esr_last_layer: float
    tokens: int
    decisions: list[list[int]] | None = None
    #: per routed layer, each KV head's noise-free P(sparse) (4 decimals); ``None`` for a plain model
    prob_sparse: list[list[float]] | None = None
    routed_layers: list[int] | None = None
    #: K >= 3 modes: per routed layer, each KV head's mode (0: the first); ``None`` otherwise
    modes: list[list[int]] | None = None
    #: the share of routed (layer, KV head) in each mode, and the expected cost of the routing: the mean
    #: over them of their mode's relative cost at the prompt's length (full attention 1); ``None`` for a
    #: plain model
    shares: list[float] | None = None
    cost: float | None = None
    prefill_seconds: float = 0.0
    batch_prefill_seconds: float = 0.0
    generate_seconds: float = 0.0
    batch_size: int = 1
    batch_tokens: int = 0


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


class PrefillTimer:
    """Wall time of the first forward call of ``module`` inside the block: the prefill of a
    ``generate()`` call (CUDA work is synchronised on both sides)."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.module, self.device = module, device
        self.seconds: float | None = None
        self._start: float | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()

    def _pre(self, *_: Any, **__: Any) -> None:
        if self._start is None:
            self._sync()
            self._start = time.perf_counter()

    def _post(self, *_: Any, **__: Any) -> None:
        if self.seconds is None and self._start is not None:
            self._sync()
            self.seconds = time.perf_counter() - self._start

    def __enter__(self) -> PrefillTimer:
        self._handles = [self.module.register_forward_pre_hook(self._pre), self.module.register_forward_hook(self._post)]
        return self

    def __exit__(self, *_: Any) -> None:
        for handle in self._handles:
            handle.remove()


@torch.no_grad()
def generate_batch(
    elastic: Any,
    tokenizer: Any,
    task: Task,
    batch: list[Sample],
    *,
    max_new_tokens: int,
    padding_side: str = "left",
) -> list[SampleResult]:
    """Greedy-generate one padded batch, score it, and time its prefill and its whole generate()."""
    model = getattr(elastic, "base", elastic)
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = pad_batch(batch, pad_id, padding_side, device)
    with PrefillTimer(model, device) as timer:
        start = time.perf_counter()
        out = elastic.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id
        )
        timer._sync()
        total = time.perf_counter() - start
    if timer.seconds is None:
        raise ElasticError(f"{type(model).__name__}.generate() never called its forward: no prefill time to report")
    prefill = timer.seconds
    routing = elastic.routing if model is not elastic else None
    decisions = routing.decisions.int().tolist() if routing is not None else None
    probs = routing.prob_sparse.float().round(decimals=4).tolist() if routing is not None else None
    modes = routing.mode_index.tolist() if routing is not None and routing.mode_index is not None else None
    shares = costs = None
    if routing is not None:
        shares = routing.mode_shares().cpu().double()  # (B, K) beside the costs table (float64, CPU)
        costs = (shares * elastic.costs.table([len(s.input_ids) for s in batch])).sum(-1).tolist()
    batch_tokens = sum(len(s.input_ids) for s in batch)
    results = []
    for i, sample in enumerate(batch):
        text = tokenizer.decode(out[i, ids.shape[1] :], skip_special_tokens=True)
        results.append(
            SampleResult(
                completion=text,
                score=task.score(sample, text),
                msr=float(routing.msr[i]) if routing is not None else 0.0,
                esr=float(routing.esr[i]) if routing is not None else 0.0,
                esr_last_layer=float(routing.esr_last_layer[i]) if routing is not None else 0.0,
                tokens=len(sample.input_ids),
                decisions=decisions[i] if decisions is not None else None,
                prob_sparse=probs[i] if probs is not None else None,
                routed_layers=list(routing.routed_layers) if routing is not None else None,
                modes=modes[i] if modes is not None else None,
                shares=shares[i].tolist() if shares is not None else None,
                cost=costs[i] if costs is not None else None,
                prefill_seconds=prefill * len(sample.input_ids) / batch_tokens,
                batch_prefill_seconds=prefill,
                generate_seconds=total,
                batch_size=len(batch),
                batch_tokens=batch_tokens,
            )
        )
    return results


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
    result = EvalResult()
    start = time.perf_counter()
    for first in range(0, len(samples), batch_size):
        batch = samples[first : first + batch_size]
        result.results.extend(
            generate_batch(elastic, tokenizer, task, batch, max_new_tokens=max_new_tokens, padding_side=padding_side)
        )
        if progress is not None:
            progress(min(first + batch_size, len(samples)), len(samples))
    result.seconds = time.perf_counter() - start
    return result
