"""Greedy decoding in steps of fixed shapes, replayed from one CUDA graph.

Routing is decided at prefill and held, so once a compact KV cache
(:class:`~elasticfw.model.kv_cache.ElasticKVCache`) has compacted every layer, a decode step of one
token per sample has the same shapes at every step, if the cache's stores are reserved for the
whole generation up front and the step reads its position from the device. :class:`StaticDecoder`
sets the cache up so (:meth:`ElasticKVLayer.freeze` with a :class:`StaticStep`), runs a few steps eagerly, captures the next
one in a CUDA graph and replays it: each step then costs its GPU work, with no Python, no kernel
launches and no device reads on the host. On a device without CUDA graphs (the CPU) every step
runs eagerly through the same code, which is what the CPU tests check.

In a frozen step each store's attention is a plain softmax over its slots under a mask computed
on the device from the step's position (:func:`decode_attention_masked`): a full store (a head
routed to a mode that reads any past key) reads the slots up to the position, a compact store
(sink + ring) the slots its :class:`~elasticfw.attention.mode.DecodeKeep` says. So a full store's
mode must be dense at a decode step (:meth:`AttentionMode.dense_at`: full attention, XAttention and
MoBA under ``decode: full``); a mode that selects past keys by content at decode is refused.

    >>> cache = elastic.make_kv_cache()
    >>> out = elastic(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
    >>> decoder = StaticDecoder(elastic, cache, out.logits[:, -1:].argmax(-1), max_new_tokens=255)
    >>> tokens = decoder.run()          # (B, 255): the tokens after the first one
    >>> decoder.close()                 # the cache can serve an ordinary forward or generate again

Samples may differ in length (a left-padded prefill: the stores hold real tokens only, and each
sample's position is its own). Limits: one token per step, greedy, every layer of the cache
compacted (a routed layer without a native window: an unrouted layer's dynamic cache grows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from elasticfw.attention.mode import DecodeKeep
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import ElasticError, UnsupportedInputError
from elasticfw.model.kv_cache import ElasticKVLayer, _prefill_positions

if TYPE_CHECKING:
    from elasticfw.model.kv_cache import ElasticKVCache

#: eager steps before the capture (the first calls compile kernels and warm the allocator)
WARMUP_STEPS = 2
#: a full store's slots are reserved in multiples of this (and its attention sums in chunks of it)
CAPACITY_MULTIPLE = 1024


def _chunk(slots: int, widest: int = CAPACITY_MULTIPLE) -> int:
    """The widest power of two up to ``widest`` that divides ``slots`` (1 at worst)."""
    chunk = widest
    while slots % chunk:
        chunk //= 2
    return chunk


def decode_attention_masked(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """One decode query per row over a store's slots: ``q`` (N, G, D) the GQA group's query heads of
    each (sample, KV head) row, ``keys`` / ``values`` (N, slots, D), ``visible`` (slots,) or
    (N, slots) bool (the slots each row reads; at least one per row). Returns (N, G, Dv) in q's dtype.

    Scores accumulate and stay in float32 (on CUDA straight out of the half-precision product), the
    softmax too; the weighted sum runs over chunks of slots as one batched matrix product (parallel
    over the chunks, which a single long reduction is not) and adds the chunks' partial sums."""
    n, g, _ = q.shape
    slots = keys.shape[1]
    qs = (q * scale).to(keys.dtype)
    if keys.is_cuda and keys.dtype in (torch.float16, torch.bfloat16):
        scores = torch.bmm(qs, keys.transpose(1, 2), out_dtype=torch.float32)  # (N, G, slots)
    else:
        scores = torch.bmm(qs, keys.transpose(1, 2)).float()
    scores = scores.masked_fill(~visible.view(-1, 1, slots), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    chunk = _chunk(slots)
    parts = torch.matmul(
        probs.view(n, g, slots // chunk, chunk).transpose(1, 2),  # (N, C, G, chunk)
        values.view(n, slots // chunk, chunk, values.shape[-1]),  # (N, C, chunk, Dv)
    )  # (N, C, G, Dv)
    return parts.sum(dim=1, dtype=torch.float32).to(q.dtype)


class StaticStep:
    """What the frozen layers of one cache share: each sample's position on the device (its real
    tokens before the step's: samples may differ) and the slot masks, (B, slots) per store
    geometry, computed from the positions at the start of the step (:meth:`refresh`, inside the
    captured graph) and read by every layer: a full store of ``slots`` reads slots
    ``0 .. position``; a compact store the slots its :class:`DecodeKeep` makes visible once it
    holds every position up to ``position``. A frozen :class:`ElasticKVLayer` calls
    :meth:`freeze_layer` and :meth:`attend`."""

    def __init__(self, position: torch.Tensor) -> None:
        self.position = position  # (B,) int64 on the device: the position of each sample's token
        self._masks: dict[tuple[DecodeKeep | None, int], torch.Tensor | None] = {}
        #: per store (by id): its rows' sample, and the rows 0 .. N - 1, both on the device
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def register(self, keep: DecodeKeep | None, slots: int) -> None:
        self._masks.setdefault((keep, slots), None)

    def refresh(self) -> None:
        at = self.position[:, None]
        for keep, slots in self._masks:
            if keep is None:
                mask = torch.arange(slots, device=at.device)[None, :] <= at
            else:
                mask = keep.visible(_prefill_positions(keep, self.position + 1, slots), at)
            self._masks[(keep, slots)] = mask

    def get(self, keep: DecodeKeep | None, slots: int) -> torch.Tensor:
        mask = self._masks.get((keep, slots))
        if mask is None:
            raise ElasticError(f"static decode: no mask for a store of {slots} slots (keep {keep}) this step")
        return mask

    def freeze_layer(self, layer: ElasticKVLayer, capacity: int) -> None:
        """Grow a compacted layer's stores for steps up to ``capacity`` positions, now: a full store to
        at least ``capacity`` slots, a compact one to what it will hold; register each store's geometry
        with this step. A full store's mode must be dense at a decode step."""
        assert layer.stores is not None
        longest = max(layer.lengths, default=0)
        for store in layer.stores:
            if store.keep is None:
                decode = SeqInfo.dense(store.size, 1, longest + 1, store.keys.device)
                if not store.mode.dense_at(decode):
                    raise UnsupportedInputError(
                        f"static decode: mode {store.mode.name!r} (layer {layer.layer_idx}) selects past keys by content "
                        "at a decode step (dense_at is False), which a fixed-shape step cannot: decode it with the "
                        "ordinary path (generate), or set the mode's decode to full where it has one"
                    )
                have = store.keys.shape[1]
                if have < capacity:
                    n = store.size
                    store.keys = torch.cat([store.keys, store.keys.new_zeros(n, capacity - have, store.keys.shape[2])], 1)
                    store.values = torch.cat(
                        [store.values, store.values.new_zeros(n, capacity - have, store.values.shape[2])], 1)
            else:
                store.reserve(capacity, layer.growth)
            self.register(store.keep, store.keys.shape[1])
            self._rows[id(store)] = (store.samples.to(self.position.device),
                                     torch.arange(store.size, device=self.position.device))

    def attend(
        self, layer: ElasticKVLayer, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """A frozen layer's step: write the new token (``k_new`` / ``v_new`` (B, Hkv, 1, D)) of every
        store at its sample's device position, then each store's masked softmax
        (:func:`decode_attention_masked`) for the queries ``q`` (B, Hq, 1, D). Returns
        (B, Hq, 1, Dv). Only device work."""
        assert layer.stores is not None
        batch, hq, steps, d = q.shape
        if steps != 1:
            raise UnsupportedInputError(f"static decode takes one token per step, got {steps}")
        hkv, dv = k_new.shape[1], v_new.shape[-1]
        group = hq // hkv
        qg_all = q.reshape(batch, hkv, group, d)
        out = q.new_empty(batch, hkv, group, dv)
        for store in layer.stores:
            n = store.size
            if store.span is not None:  # every sample's heads h0 .. h1 - 1: slices, not gathers
                h0, h1 = store.span
                qg = qg_all[:, h0:h1].reshape(n, group, d)
                kb, vb = k_new[:, h0:h1].reshape(n, 1, -1), v_new[:, h0:h1].reshape(n, 1, dv)
            else:
                b, h = store.samples, store.heads
                qg, kb, vb = qg_all[b, h], k_new[b, h], v_new[b, h]
            samples, rows = self._rows[id(store)]
            position = self.position[samples]  # (N,): each row's sample's
            slot = store.slot_of(position)
            store.keys[rows, slot] = kb[:, 0].to(store.keys.dtype)
            store.values[rows, slot] = vb[:, 0].to(store.values.dtype)
            if store.positions is not None:  # what an ordinary step after unfreeze() reads
                store.positions[rows, slot] = position.to(store.positions.dtype)
            visible = self.get(store.keep, store.keys.shape[1])[samples]  # (N, slots)
            result = decode_attention_masked(qg, store.keys, store.values, visible, scale)
            if store.span is not None:
                out[:, store.span[0] : store.span[1]] = result.view(batch, -1, group, dv).to(out.dtype)
            else:
                out[store.samples, store.heads] = result.to(out.dtype)
        return out.reshape(batch, hq, 1, dv)


def _frozen_layers(cache: ElasticKVCache) -> list[ElasticKVLayer]:
    layers: list[ElasticKVLayer] = []
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, ElasticKVLayer):
            raise UnsupportedInputError(
                f"static decode: layer {i}'s cache is {type(layer).__name__}, which grows every step; it needs "
                "every layer routed and without a native sliding window (an ElasticKVLayer)"
            )
        if not layer.compacted:
            raise UnsupportedInputError(
                f"static decode: layer {i} has not been compacted; run the prompt's prefill on this cache first"
            )
        layers.append(layer)
    return layers


class StaticDecoder:
    """Greedy decode steps of fixed shapes on a prefilled compact cache (see the module docstring).

    ``model``: the :class:`~elasticfw.model.elastic.ElasticModel` whose prefill filled ``cache``;
    ``token`` (B, 1) the token the prefill chose (the first new one), fed to the first step;
    ``max_new_tokens``: the steps this decoder may run (their stores are reserved now);
    ``graph``: capture and replay a CUDA graph (default: on CUDA).
    """

    def __init__(
        self, model: Any, cache: ElasticKVCache, token: torch.Tensor, *, max_new_tokens: int,
        graph: bool | None = None, warmup: int = WARMUP_STEPS,
    ) -> None:
        from elasticfw.model.elastic import cache_argument

        if max_new_tokens < 1:
            raise ValueError(f"static decode: max_new_tokens must be >= 1, got {max_new_tokens}")
        if token.dim() != 2 or token.shape[1] != 1 or token.dtype != torch.long:
            raise UnsupportedInputError(
                f"static decode: token must be (batch, 1) int64 (the prefill's next token), got "
                f"{tuple(token.shape)} {token.dtype}"
            )
        self.layers = _frozen_layers(cache)
        lengths = self.layers[0].lengths
        if any(layer.lengths != lengths for layer in self.layers):
            raise ElasticError(
                "static decode: the cache's layers hold different lengths "
                f"({sorted({tuple(layer.lengths) for layer in self.layers})}); it is inconsistent, start a new one"
            )
        if len(lengths) != token.shape[0]:
            raise UnsupportedInputError(
                f"static decode: token has batch {token.shape[0]} but the cache holds {len(self.layers[0].lengths)} samples"
            )
        device = token.device
        self.graph_enabled = device.type == "cuda" if graph is None else graph
        if self.graph_enabled and device.type != "cuda":
            raise UnsupportedInputError(f"static decode: CUDA graphs need a CUDA device, the token is on {device}")
        self.max_new_tokens = max_new_tokens
        self.warmup = warmup
        self.ids = token.clone()
        #: each sample's position: its real tokens so far (padding is not stored: canonical coordinates)
        self.position = torch.tensor(lengths, device=device, dtype=torch.long)
        self.tokens = torch.zeros(token.shape[0], max_new_tokens, dtype=torch.long, device=device)
        self._index = torch.zeros(1, dtype=torch.long, device=device)
        self.shared = StaticStep(self.position)
        capacity = -(-(max(lengths) + max_new_tokens) // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE
        frozen: list[ElasticKVLayer] = []
        try:
            for layer in self.layers:
                layer.freeze(self.shared, capacity)
                frozen.append(layer)
        except Exception:  # re-raised: a refused layer leaves none of the cache frozen
            for layer in frozen:
                layer.unfreeze(0)
            raise
        self._call_kwargs = {cache_argument(getattr(model, "base", model)): cache}
        self.model = model
        self.done = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.closed = False

    def _step(self) -> None:
        self.shared.refresh()
        out = self.model(input_ids=self.ids, position_ids=self.position.view(-1, 1), use_cache=True,
                         logits_to_keep=1, **self._call_kwargs)
        token = out.logits[:, -1:].argmax(-1)
        self.tokens.index_copy_(1, self._index, token)
        self.ids.copy_(token)
        self.position.add_(1)
        self._index.add_(1)

    @torch.no_grad()
    def step(self) -> None:
        """One decode step: the next token of every sample lands in :attr:`tokens`."""
        if self.closed:
            raise ElasticError("static decode: this decoder was closed")
        if self.done >= self.max_new_tokens:
            raise ElasticError(f"static decode: all {self.max_new_tokens} reserved steps have run")
        if self.graph_enabled and self.graph is None and self.done >= self.warmup:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._step()  # recorded, not run
            self.graph = graph
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        self.done += 1

    def run(self, steps: int | None = None) -> torch.Tensor:
        """``steps`` (default: the rest of ``max_new_tokens``) decode steps; returns every token
        decoded so far, (B, done)."""
        for _ in range(self.max_new_tokens - self.done if steps is None else steps):
            self.step()
        return self.tokens[:, : self.done]

    def close(self) -> None:
        """Hand the cache back to ordinary (eager, growing) use: each layer's host lengths move on by
        the steps run. Idempotent."""
        if self.closed:
            return
        for layer in self.layers:
            layer.unfreeze(self.done)
        self.graph = None
        self.closed = True

    def __enter__(self) -> StaticDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@torch.no_grad()
def static_greedy(model: Any, input_ids: torch.Tensor, max_new_tokens: int, *,
                  attention_mask: torch.Tensor | None = None, graph: bool | None = None,
                  cache: ElasticKVCache | None = None) -> torch.Tensor:
    """Greedy generation of ``max_new_tokens`` tokens after ``input_ids`` (B, S) with an elastic
    model: the prefill on a compact cache (``attention_mask`` (B, S) marks left padding, with
    positions counted over the real tokens, as ``generate`` counts them), then
    :class:`StaticDecoder`. Returns (B, max_new_tokens), the tokens ``generate`` with greedy
    decoding and no end-of-sequence stop would give."""
    from elasticfw.model.elastic import cache_argument

    cache = cache if cache is not None else model.make_kv_cache()
    extra: dict[str, Any] = {}
    if attention_mask is not None:
        extra = {"attention_mask": attention_mask,
                 "position_ids": (attention_mask.long().cumsum(-1) - 1).clamp_min(0)}
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1,
                **{cache_argument(getattr(model, "base", model)): cache}, **extra)
    first = out.logits[:, -1:].argmax(-1)
    if max_new_tokens == 1:
        return first
    with StaticDecoder(model, cache, first, max_new_tokens=max_new_tokens - 1, graph=graph) as decoder:
        rest = decoder.run()
        return torch.cat([first, rest], dim=1)
