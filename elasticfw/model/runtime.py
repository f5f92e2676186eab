"""Per-layer hybrid execution: route, run the modes, mix or merge, and record statistics.

Training (a learnable router in train mode with gradients on): every head computes *both*
modes and the outputs are mixed per KV-head group with the router's straight-through
decision, ``O = r * O_sparse + (1 - r) * O_retrieval`` (paper §3.2), so gradients reach the
router through both branches. Inference: each head is computed once, in its routed mode, in a
single executor call over the combined per-head layout. Decisions are made on a sequence's
first chunk (prefill) and reused for its later chunks and decode steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from elasticfw.attention.executor import Executor
from elasticfw.attention.layout import (
    BlockLayout,
    causal_layout,
    computed_pairs,
    with_window,
)
from elasticfw.attention.mode import AttentionMode, attend_modes, attend_routed
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import ElasticError
from elasticfw.model.bridge import KeyPaddingInfo
from elasticfw.model.canonical import Canonical, Padding, canonicalize
from elasticfw.model.rotary import RotaryCapture, unrotate
from elasticfw.routing.base import Router, RouterDecision

Observer = Callable[[int, Canonical, float], None]


class HandoffLayer(Protocol):
    """What the runtime needs of a KV-cache layer that pairs with a layer's attention call (the
    compact cache's :class:`~elasticfw.model.kv_cache.ElasticKVLayer`): whether it has compacted its
    keys, compacting them after the prefill, and the decode attention over what it kept."""

    @property
    def compacted(self) -> bool: ...

    def compact(
        self, can: Canonical, index: torch.Tensor | None, modes: list[AttentionMode], *, mixing: bool = False
    ) -> None: ...

    def attend(
        self, q: torch.Tensor, info: KeyPaddingInfo | None, *, scale: float, executor: Executor
    ) -> torch.Tensor: ...


#: layouts kept by :attr:`ElasticRuntime.layout_cache` (oldest dropped first): a few shapes at once
LAYOUT_CACHE_SIZE = 8


@dataclass
class LayerBinding:
    """Attached to each attention module (as a plain attribute, not a submodule)."""

    runtime: ElasticRuntime
    layer_idx: int


@dataclass
class LayerRecord:
    """Statistics of one layer for the last prefill."""

    sparse: torch.Tensor | None  # (B, Hkv) hard decisions, None for layers that are not routed
    prob_sparse: torch.Tensor | None
    computed: torch.Tensor  # (B, Hq) (query, key) pairs computed
    causal: torch.Tensor  # (B,)
    mode_index: torch.Tensor | None = None  # (B, Hkv) each head's mode among K >= 3 (``sparse``: not mode 0)


@dataclass
class ElasticRuntime:
    retrieval_mode: AttentionMode
    sparse_mode: AttentionMode
    executor: Executor
    router: Router
    routed: dict[int, int]  # absolute layer index -> position among routed layers
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    collect_stats: bool = True
    decisions: dict[int, RouterDecision] = field(default_factory=dict)
    records: dict[int, LayerRecord] = field(default_factory=dict)
    observers: list[Observer] = field(default_factory=list)
    #: inside ElasticModel.generate: keep the first decision of each layer for the whole call,
    #: so generation without a KV cache routes exactly like generation with one
    hold_decisions: bool = False
    #: (B,) number of each sample's leading real tokens the router may see (``None``: all of them).
    #: Training sets it to the prompt lengths, so the router decides on the prompt exactly as it
    #: does at inference and never sees the answer it is trained to produce.
    route_lengths: torch.Tensor | None = None
    #: set by a compact KV cache's ``update`` (:mod:`elasticfw.model.kv_cache`): layer -> (its cache
    #: layer, the keys it returned), so that the attention call that follows is paired with it
    kv_handoff: dict[int, tuple[HandoffLayer, torch.Tensor]] = field(default_factory=dict)
    #: layouts of modes that depend only on ``seq`` (``layout_depends_on_inputs = False``), kept per
    #: (mode, SeqInfo.host_signature, window): every layer of a forward gets the same object, so an
    #: executor converts it once (see :meth:`_layouts`)
    layout_cache: dict[tuple, tuple[AttentionMode, object, BlockLayout]] = field(default_factory=dict)
    #: the last layer's canonical coordinates (:func:`~elasticfw.model.canonical.canonicalize`): the
    #: layers of a forward share its mask information, so only the first reads the mask from the device
    #: and builds the SeqInfo
    padding_memo: Padding | None = None
    #: layer -> (its decision, hard (B, Hq), the same on the CPU, no head sparse, every head sparse) at
    #: inference, while the layer's decision is that object (:meth:`_hard_routing`)
    routing_memo: dict[int, tuple[RouterDecision, torch.Tensor, torch.Tensor, bool, bool]] = field(
        default_factory=dict
    )
    #: K >= 3 modes in routing order (``elastic.modes``), run by :meth:`_execute_modes`; ``None``: the
    #: two modes ``retrieval_mode`` and ``sparse_mode`` (then the first and the last of these)
    modes: list[AttentionMode] | None = None
    #: each attention module's rotary cos/sin of its last call, where the router reads the keys before
    #: the rotary embedding (:attr:`Router.reads_unrotated_keys`; set by the ElasticModel), else ``None``
    rotary: RotaryCapture | None = None

    # -- entry point (called by the bridge) ---------------------------------------------------
    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        info: KeyPaddingInfo | None,
        *,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        handoff = self.kv_handoff.pop(layer_idx, None)
        # a stale entry (a forward that failed after the cache's update) does not pair with these keys
        cache_layer = handoff[0] if handoff is not None and handoff[1] is k else None
        if torch.is_autocast_enabled(q.device.type):  # as SDPA under autocast: all three in the autocast dtype
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if cache_layer is not None and cache_layer.compacted:
            if self.observers:
                raise ElasticError(
                    "attention observers need every key, but this layer's compact KV cache evicted some; "
                    "use elastic.kv_cache=full while observing"
                )
            return cache_layer.attend(q, info, scale=scale, executor=self.executor)
        can = canonicalize(q, k, v, info, self.padding_memo)
        self.padding_memo = can.padding
        for observer in self.observers:
            observer(layer_idx, can, scale)
        decision = self._decision(layer_idx, can, k)
        out = self._execute(layer_idx, can, decision, scale, sliding_window)
        if cache_layer is not None:  # the prefill ran on the whole cache: now keep what each head reads
            mixing = self.mixing
            with torch.no_grad():
                modes = self.modes if self.modes is not None else [self.retrieval_mode, self.sparse_mode]
                cache_layer.compact(can, None if decision is None else decision.index(), modes, mixing=mixing)
        return can.restore(out)

    @property
    def mixing(self) -> bool:
        """Both modes for every head (training a learnable router)."""
        return (
            self.router.training
            and torch.is_grad_enabled()
            and any(p.requires_grad for p in self.router.parameters())
        )

    # -- routing --------------------------------------------------------------------------------
    def _decision(self, layer_idx: int, can: Canonical, keys: torch.Tensor) -> RouterDecision | None:
        """The layer's routing decision; ``keys``: the keys in transformers' layout (``can.k`` before
        the padding roll), which a router reading them unrotated gets with the rotation undone."""
        if layer_idx not in self.routed:
            return None
        held = self.decisions.get(layer_idx) if self.hold_decisions else None
        if held is not None and held.sparse.shape[0] == can.q.shape[0]:
            return held
        if can.first_chunk or self.mixing:
            if self.router.reads_unrotated_keys:
                if self.rotary is None:
                    raise ElasticError("the router reads unrotated keys but the runtime keeps no rotary embedding")
                cos, sin = self.rotary.pair(layer_idx)
                routed_keys = can.keys_like(unrotate(keys, cos, sin).to(keys.dtype))
            else:
                routed_keys = can.k
            decision = self.router.decide(self.routed[layer_idx], routed_keys, self._routing_seq(can))
            self.decisions[layer_idx] = decision
            return decision
        previous = self.decisions.get(layer_idx)
        if previous is None or previous.sparse.shape[0] != can.q.shape[0]:
            raise ElasticError(
                f"layer {layer_idx}: a continuation chunk (decode step or chunked prefill) arrived without the "
                "routing decision of its prefill; run the prompt from its first token first"
            )
        return previous

    def _routing_seq(self, can: Canonical) -> SeqInfo:
        if self.route_lengths is None:
            return can.seq
        lengths = self.route_lengths.to(can.seq.kv_len.device)
        if lengths.shape != can.seq.kv_len.shape:
            raise ElasticError(
                f"route_lengths has {tuple(lengths.shape)} entries but the batch has {can.seq.batch} samples"
            )
        if not can.first_chunk:
            raise ElasticError("route_lengths is set but the forward is not a prefill from the first token")
        return SeqInfo(can.seq.q_start, torch.minimum(lengths, can.seq.kv_len), can.seq.q_len, can.seq.kv_capacity)

    # -- execution ------------------------------------------------------------------------------
    def _layouts(
        self, modes: list[AttentionMode], can: Canonical, window: int | None, scale: float
    ) -> list[BlockLayout]:
        return [self.layout_for(mode, can.q, can.k, can.seq, scale=scale, window=window) for mode in modes]

    def layout_for(
        self,
        mode: AttentionMode,
        q: torch.Tensor,
        k: torch.Tensor,
        seq: SeqInfo,
        *,
        scale: float,
        window: int | None = None,
    ) -> BlockLayout:
        """``mode``'s layout for q and the keys k over ``seq`` (with the backbone's sliding
        ``window``, if any). A mode whose layout depends only on ``seq`` (and a mode that is full
        attention at these lengths, :meth:`~elasticfw.attention.mode.AttentionMode.dense_at`) builds
        it once per :meth:`SeqInfo.host_signature` and window: the layers of a forward (and a
        compact KV cache's full stores) share one object, marked ``reusable``, in
        :attr:`layout_cache`."""
        key = None
        signature = seq.host_signature()
        if signature is not None and (not mode.layout_depends_on_inputs or mode.dense_at(seq)):
            key = (id(mode), signature, window)
            hit = self.layout_cache.get(key)
            if hit is not None and hit[0] is mode and hit[1] is mode.config:
                return hit[2]
        with torch.no_grad():
            layout = mode.build_layout(q, k, seq, scale=scale)
        layout = with_window(layout, seq, window) if window else layout
        if key is not None:
            layout = replace(layout, reusable=True)
            if len(self.layout_cache) >= LAYOUT_CACHE_SIZE:
                self.layout_cache.pop(next(iter(self.layout_cache)))
            self.layout_cache[key] = (mode, mode.config, layout)
        return layout

    def _execute(
        self, layer_idx: int, can: Canonical, decision: RouterDecision | None, scale: float, window: int | None
    ) -> torch.Tensor:
        q, k, v, seq = can.q, can.k, can.v, can.seq
        hq, hkv = q.shape[1], k.shape[1]
        record = self.collect_stats and can.first_chunk and not (self.hold_decisions and layer_idx in self.records)
        if decision is None:  # layer kept native: full (windowed) attention
            layout = causal_layout(seq, self.retrieval_mode.block_size)
            layout = with_window(layout, seq, window) if window else layout
            out = self.executor.attend(q, k, v, layout, seq, scale=scale, need_lse=False).out
            if record:
                self.records[layer_idx] = LayerRecord(
                    None, None, computed_pairs(layout, seq, hq), seq.causal_pairs()
                )
            return out

        if self.modes is not None:
            return self._execute_modes(layer_idx, can, decision, scale, window, record)
        if self.mixing:
            sparse_q = decision.sparse.repeat_interleave(hq // hkv, dim=1)  # (B, Hq)
            hard = sparse_q.detach() > 0.5
            lay_r, lay_s = self._layouts([self.retrieval_mode, self.sparse_mode], can, window, scale)
            out_r = self.retrieval_mode.attend(q, k, v, seq, self.executor, scale=scale, layout=lay_r).out
            out_s = self.sparse_mode.attend(q, k, v, seq, self.executor, scale=scale, layout=lay_s).out
            r = sparse_q.to(out_r.dtype)[:, :, None, None]
            out = r * out_s + (1 - r) * out_r
            pairs = (lay_r, lay_s)
        else:
            hard, hard_host, none_sparse, all_sparse = self._hard_routing(layer_idx, decision, hq // hkv)
            if none_sparse or all_sparse:
                mode = self.sparse_mode if all_sparse else self.retrieval_mode
                (layout,) = self._layouts([mode], can, window, scale)
                out = mode.attend(q, k, v, seq, self.executor, scale=scale, layout=layout).out
                pairs = (layout, layout)
            else:
                lay_r, lay_s = self._layouts([self.retrieval_mode, self.sparse_mode], can, window, scale)
                out = self._one_launch(can, hard, hard_host, lay_r, lay_s, scale)
                pairs = (lay_r, lay_s)
        if record:
            self.records[layer_idx] = LayerRecord(
                decision.sparse.detach() > 0.5,
                decision.prob_sparse.detach(),
                self._pairs(pairs, hard, seq, hq),
                seq.causal_pairs(),
            )
        return out

    def _execute_modes(
        self, layer_idx: int, can: Canonical, decision: RouterDecision, scale: float, window: int | None,
        record: bool,
    ) -> torch.Tensor:
        """A routed layer among K >= 3 modes. Training (:attr:`mixing`): every head computes every mode
        and the outputs are mixed with the decision's one-hot, ``O = sum_k m_k O_k`` (m_k carries the
        straight-through gradient to mode k's logit). Inference: each head once, in its mode
        (:func:`~elasticfw.attention.mode.attend_modes`)."""
        assert self.modes is not None
        q, k, v, seq = can.q, can.k, can.v, can.seq
        hq, group = q.shape[1], q.shape[1] // k.shape[1]
        if decision.num_modes != len(self.modes):
            raise ElasticError(
                f"layer {layer_idx}: the router decided among {decision.num_modes} modes, the runtime has "
                f"{len(self.modes)} (elastic.modes)"
            )
        layouts = self._layouts(self.modes, can, window, scale)
        index = decision.index().repeat_interleave(group, dim=1)  # (B, Hq)
        if self.mixing:
            weights = decision.one_hot().repeat_interleave(group, dim=1)  # (B, Hq, K)
            out = None
            for i, (mode, layout) in enumerate(zip(self.modes, layouts)):
                term = mode.attend(q, k, v, seq, self.executor, scale=scale, layout=layout).out
                term = weights[..., i].to(term.dtype)[:, :, None, None] * term
                out = term if out is None else out + term
            assert out is not None
        else:
            host = decision.index_host
            out = attend_modes(
                q, k, v, seq, self.executor, modes=self.modes, index=index, layouts=layouts, scale=scale,
                index_host=None if host is None else host.repeat_interleave(group, dim=1),
            ).out
        if record:
            pairs = torch.stack([computed_pairs(layout, seq, hq) for layout in layouts], dim=-1)  # (B, Hq, K)
            self.records[layer_idx] = LayerRecord(
                decision.sparse.detach() > 0.5,
                decision.prob_sparse.detach(),
                pairs.gather(-1, index.to(pairs.device)[..., None])[..., 0],
                seq.causal_pairs(),
                decision.index(),
            )
        return out

    def _hard_routing(
        self, layer_idx: int, decision: RouterDecision, group: int
    ) -> tuple[torch.Tensor, torch.Tensor, bool, bool]:
        """``(hard (B, Hq) bool, the same on the CPU, no head sparse, every head sparse)`` of an
        inference decision: at most one device read for all of them (each would be a
        synchronisation; none when the router gave the decision's ``host`` copy), kept per layer
        while the decision is the same object, so the decode steps that reuse their prefill's
        decision read nothing from the device."""
        memo = self.routing_memo.get(layer_idx)
        if memo is not None and memo[0] is decision:
            return memo[1], memo[2], memo[3], memo[4]
        hard = decision.sparse.detach().repeat_interleave(group, dim=1) > 0.5
        source = decision.host if decision.host is not None else decision.sparse.detach().cpu()
        on_host = source.repeat_interleave(group, dim=1) > 0.5
        none_sparse, all_sparse = not bool(on_host.any()), bool(on_host.all())
        self.routing_memo[layer_idx] = (decision, hard, on_host, none_sparse, all_sparse)
        return hard, on_host, none_sparse, all_sparse

    def _one_launch(
        self, can: Canonical, hard: torch.Tensor, hard_host: torch.Tensor, lay_r: BlockLayout, lay_s: BlockLayout,
        scale: float,
    ) -> torch.Tensor:
        return attend_routed(
            can.q, can.k, can.v, can.seq, self.executor, retrieval=self.retrieval_mode, sparse=self.sparse_mode,
            hard=hard, layouts=(lay_r, lay_s), scale=scale, hard_host=hard_host,
        ).out

    @staticmethod
    def _pairs(layouts: tuple[BlockLayout, BlockLayout], hard: torch.Tensor, seq, hq: int) -> torch.Tensor:
        lay_r, lay_s = layouts
        if lay_r is lay_s:
            return computed_pairs(lay_r, seq, hq)
        return torch.where(hard, computed_pairs(lay_s, seq, hq), computed_pairs(lay_r, seq, hq))
