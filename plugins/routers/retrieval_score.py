"""Retrieval-score router: training-free, input-independent ranking of KV heads.

Elastic Attention §2.2 and App. C (after Retrieval Head, Wu et al. 2024, arXiv 2404.15574):
on needle-in-a-haystack probes, the retrieval score of a head is the attention mass the last
token puts on the needle tokens (Eq. 9), averaged over probes. Heads are ranked over the
whole model and the top ``floor((1 - target_msr) * L * H)`` keep the retrieval mode (FA); the
rest go sparse. Scores are measured under full attention (every head on the retrieval mode
while probing) and per query head, then aggregated over each KV head's query group.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import Field, ValidationInfo, field_validator

from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import ElasticError, RecipeError
from elasticfw.routing.base import HeadLayout, HostCopy, Router, RouterConfig, RouterDecision


class RetrievalScoreConfig(RouterConfig):
    name: Literal["retrieval_score"] = "retrieval_score"
    target_msr: float = Field(0.5, ge=0.0, le=1.0, description="Fraction of (layer, KV head) pairs sent sparse.")
    probe_task: dict[str, Any] = Field(
        default_factory=lambda: {"name": "passkey", "context_tokens": 1000, "num_samples": 6},
        description="Task whose samples (with needle spans) serve as probes; validated by the task plugin.",
    )
    aggregate: Literal["mean", "max"] = Field("mean", description="Query heads -> KV head aggregation.")

    @field_validator("probe_task")
    @classmethod
    def _task(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        from pydantic import ValidationError

        from elasticfw.registry import get_registry, unknown_name_message

        registry = (info.context or {}).get("registry") or get_registry()
        name = value.get("name")
        known = registry.names("task")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name = {name!r}: a task plugin's name is required (registered: {', '.join(known)})")
        if ("task", name) not in registry:
            raise ValueError(f"name = {name!r}: " + unknown_name_message("task", name, known))
        try:
            registry.entry("task", name).config_class.model_validate(value)  # type: ignore[union-attr]
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors(include_url=False)
            )
            raise ValueError(f"not a valid {name!r} task: {problems}") from None
        return value


class RetrievalScoreRouter(Router):
    """Keep the heads with the highest needle-retrieval scores on the retrieval mode."""

    name = "retrieval_score"
    config_class = RetrievalScoreConfig
    config: RetrievalScoreConfig
    table: torch.Tensor  # (routed layers, Hkv) buffer: 1.0 sparse, 0.0 retrieval

    def __init__(self, config: RetrievalScoreConfig, heads: HeadLayout) -> None:
        super().__init__(config, heads)
        self.register_buffer("table", torch.zeros(heads.num_routed, heads.num_kv_heads), persistent=False)
        self.scores: torch.Tensor | None = None  # (L_routed, Hkv)
        self._probing = False
        self._host = HostCopy()  # the table on the CPU: the decisions' ``host``

    def decide(self, layer: int, keys: torch.Tensor, seq: SeqInfo) -> RouterDecision:
        if self.scores is None and not self._probing:
            raise ElasticError("retrieval_score router used before calibration: call router.prepare(elastic, tokenizer)")
        if self._probing:
            return RouterDecision.constant(torch.zeros_like(self.table[layer]), keys.shape[0], keys.device)
        return RouterDecision.constant(self.table[layer], keys.shape[0], keys.device, host_row=self._host(self.table)[layer])

    # -- calibration -----------------------------------------------------------------------------
    def prepare(self, elastic: Any, tokenizer: Any, *, seed: int = 0) -> None:
        if self.scores is not None:
            return
        from elasticfw.registry import get_registry

        registry = get_registry()
        task_cfg = registry.entry("task", self.config.probe_task["name"]).config_class.model_validate(  # type: ignore[union-attr]
            self.config.probe_task
        )
        task = registry.make("task", task_cfg)
        probes = [s for s in task.samples(tokenizer, seed=seed + 1) if s.needle_span is not None]
        if not probes:
            raise RecipeError(f"elastic.router.probe_task {task.name!r} produced no samples with a needle span")
        self.set_scores(self.measure(elastic, probes))

    @torch.no_grad()
    def measure(self, elastic: Any, probes: list[Any]) -> torch.Tensor:
        """(L_routed, Hq) mean needle attention mass of the last token, over probes."""
        heads = self.heads
        routed = {layer: i for i, layer in enumerate(heads.routed_layers)}
        total = torch.zeros(heads.num_routed, heads.num_q_heads, dtype=torch.float64)
        span: tuple[int, int] = (0, 0)

        def observe(layer_idx: int, can: Any, scale: float) -> None:
            if layer_idx not in routed or not can.first_chunk:
                return
            q, k = can.q, can.k
            last = int(can.seq.kv_len[0]) - 1 - int(can.seq.q_start[0])
            group = q.shape[1] // k.shape[1]
            n = int(can.seq.kv_len[0])
            scores = torch.einsum("hd,hkd->hk", q[0, :, last].float(), k[0, :, :n].float().repeat_interleave(group, 0))
            probs = torch.softmax(scores * scale, dim=-1)
            total[routed[layer_idx]] += probs[:, span[0] : span[1]].sum(-1).double().cpu()

        device = next(elastic.base.parameters()).device
        elastic.runtime.observers.append(observe)
        self._probing = True
        try:
            for sample in probes:
                span = sample.needle_span
                elastic(input_ids=torch.tensor([sample.input_ids], device=device))
        finally:
            self._probing = False
            elastic.runtime.observers.remove(observe)
        return (total / len(probes)).float()

    def set_scores(self, per_query_head: torch.Tensor) -> None:
        """Rank heads from (L_routed, Hq) scores and fix the assignment."""
        heads = self.heads
        group = heads.num_q_heads // heads.num_kv_heads
        grouped = per_query_head.view(heads.num_routed, heads.num_kv_heads, group)
        self._rank(grouped.mean(-1) if self.config.aggregate == "mean" else grouped.amax(-1))

    def _rank(self, scores: torch.Tensor) -> None:
        """Fix the assignment from (L_routed, Hkv) per-KV-head scores (kept in float32, as saved)."""
        scores = scores.detach().to(torch.float32)
        keep = math.floor((1.0 - self.config.target_msr) * scores.numel() + 1e-9)
        order = torch.argsort(scores.flatten(), descending=True, stable=True)
        table = torch.ones(scores.numel())
        table[order[:keep]] = 0.0
        self.table.copy_(table.view_as(scores))
        self.scores = scores

    def extra_state(self) -> dict:
        return {} if self.scores is None else {"scores": self.scores.tolist()}

    def load_extra_state(self, state: dict) -> None:
        if "scores" not in state:
            return
        # stored per KV head (float32 values, exact in JSON): rank them as they are; going back
        # through set_scores' aggregation would not return them bit for bit (a mean of copies)
        want = (self.heads.num_routed, self.heads.num_kv_heads)
        try:
            scores = torch.tensor(state["scores"], dtype=torch.float32)
        except (TypeError, ValueError):
            raise ElasticError(f"retrieval_score scores must be a {want[0]} x {want[1]} list of numbers") from None
        if tuple(scores.shape) != want:
            raise ElasticError(
                f"retrieval_score scores have shape {tuple(scores.shape)}, expected {want} (routed layers x KV heads)"
            )
        if not bool(torch.isfinite(scores).all()):
            raise ElasticError("retrieval_score scores hold NaN or Inf")
        self._rank(scores)
