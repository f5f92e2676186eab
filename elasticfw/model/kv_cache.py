"""A compact KV cache for elastic models: each sample's sparse heads keep only what their mode can
still read at decode.

Routing is decided at prefill and held, so a head routed to a mode that declares
:meth:`~elasticfw.attention.mode.AttentionMode.decode_keep` (streaming: its sink and its window)
never reads its other keys again. :class:`ElasticKVCache` is a transformers
:class:`~transformers.cache_utils.Cache` (``cache=`` of ``generate`` or a forward, or
``elastic.kv_cache: compact``) that moves a routed layer's keys and values, right after its
prefill attention, into one store per (layer, mode) in canonical coordinates: a *full* store
(slot ``j`` holds position ``j``) or a *compact* one of ``sink + local`` slots (the sink, then a
ring for the window). Decode attention reads the stores in place, so greedy generation equals the
full cache's for the same routing, up to summation order. Layers not routed, native
sliding-window layers and training are not compacted; beam search, assisted decoding and cropping
are refused once a layer is. Storage and the handshake with the attention function in detail:
``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from elasticfw.attention.mode import AttentionMode, DecodeKeep
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import ElasticError, UnsupportedInputError

if TYPE_CHECKING:
    from elasticfw.attention.executor import Executor
    from elasticfw.model.bridge import KeyPaddingInfo
    from elasticfw.model.canonical import Canonical
    from elasticfw.model.runtime import ElasticRuntime
    from elasticfw.model.static_decode import StaticStep

#: default growth of a full store, in tokens (a store is reallocated once per this many steps)
GROWTH_TOKENS = 256


@dataclass
class _Store:
    """The (sample, KV head) pairs of one layer routed to one mode.

    ``keys`` / ``values`` are (N, slots, D); ``positions`` (N, slots) int32 is the position each
    slot holds (-1: empty) for a compact store, ``None`` for a full store (slot = position).
    """

    mode: AttentionMode
    keep: DecodeKeep | None
    samples: torch.Tensor  # (N,) int64
    heads: torch.Tensor  # (N,) int64
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor | None
    #: ``(h0, h1)`` when the pairs are every sample's KV heads ``h0 .. h1 - 1``, sample by sample (the
    #: usual case: one routing for the batch, a contiguous range of heads): the store's queries and
    #: new tokens are then slices of the layer's, not gathers
    span: tuple[int, int] | None = None

    @property
    def size(self) -> int:
        return int(self.samples.shape[0])

    @property
    def nbytes(self) -> int:
        extra = self.positions.nbytes if self.positions is not None else 0
        return int(self.keys.nbytes + self.values.nbytes + extra)

    def slot_of(self, position: torch.Tensor) -> torch.Tensor:
        if self.keep is None:
            return position
        sink, local = self.keep.sink_tokens, self.keep.local_tokens
        return torch.where(position < sink, position, sink + (position - sink) % local)

    def slot_at(self, position: int) -> int:
        """:meth:`slot_of` of a position known on the host."""
        if self.keep is None or position < self.keep.sink_tokens:
            return position
        return self.keep.sink_tokens + (position - self.keep.sink_tokens) % self.keep.local_tokens

    def slots_for(self, max_length: int) -> int:
        """Slots a store needs once its longest sequence has ``max_length`` tokens."""
        return max_length if self.keep is None else min(max_length, self.keep.capacity)

    def reserve(self, max_length: int, growth: int) -> None:
        """Grow the store (by at least ``growth`` slots, up to a compact store's capacity) so that
        sequences of ``max_length`` tokens fit."""
        needed = self.slots_for(max_length)
        have = self.keys.shape[1]
        if needed <= have:
            return
        new = self.slots_for(max_length + growth)
        pad = new - have
        n, _, d = self.keys.shape
        self.keys = torch.cat([self.keys, self.keys.new_zeros(n, pad, d)], dim=1)
        self.values = torch.cat([self.values, self.values.new_zeros(n, pad, self.values.shape[2])], dim=1)
        if self.positions is not None:
            self.positions = torch.cat([self.positions, self.positions.new_full((n, pad), -1)], dim=1)

    def write(self, position: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one token per pair: ``position`` (N,), ``k`` / ``v`` (N, D)."""
        rows = torch.arange(self.size, device=self.keys.device)
        slot = self.slot_of(position)
        self.keys[rows, slot] = k.to(self.keys.dtype)
        self.values[rows, slot] = v.to(self.values.dtype)
        if self.positions is not None:
            self.positions[rows, slot] = position.to(self.positions.dtype)

    def write_at(self, position: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one token at the same host-known ``position`` for every pair (slice writes, no index
        tensors): ``k`` / ``v`` (N, D), or (B, n, D) for a store whose pairs are every sample's heads
        ``span`` (written in place through a view, without gathering them into N rows first)."""
        slot = self.slot_at(position)
        keys, values = self.keys, self.values
        if k.dim() == 3:
            keys = keys.view(k.shape[0], k.shape[1], *keys.shape[1:])
            values = values.view(v.shape[0], v.shape[1], *values.shape[1:])
            keys[:, :, slot] = k.to(keys.dtype)
            values[:, :, slot] = v.to(values.dtype)
        else:
            keys[:, slot] = k.to(keys.dtype)
            values[:, slot] = v.to(values.dtype)
        if self.positions is not None:
            self.positions[:, slot] = position


class DecodeMasks:
    """The decode step's compact-store masks, shared by the layers of one cache.

    When every sample is as long (known on the host), every row of a compact store holds the same
    positions, :func:`_prefill_positions` of the step's length, in every layer: the slots a query
    at position ``p`` reads are a function of the mode's :class:`DecodeKeep`, ``p`` and the slot
    count alone. This keeps that (1, 1, 1, slots) mask for the step, so it is built once per step
    and keep instead of once per layer (about ten small device operations each). Only the last
    step's masks are kept."""

    def __init__(self) -> None:
        self._position: int | None = None
        self._masks: dict[tuple[DecodeKeep, int, torch.device], torch.Tensor] = {}

    def visible(self, keep: DecodeKeep, position: int, slots: int, device: torch.device) -> torch.Tensor:
        """(1, 1, 1, slots) bool: which slots of a compact store of ``keep`` a query at ``position``
        reads, once the store holds every position up to ``position``."""
        if position != self._position:
            self._position, self._masks = position, {}
        key = (keep, slots, device)
        mask = self._masks.get(key)
        if mask is None:
            at = torch.tensor([position], device=device)
            held = _prefill_positions(keep, at + 1, slots)
            mask = self._masks[key] = keep.visible(held, at).view(1, 1, 1, slots)
        return mask


def _prefill_positions(keep: DecodeKeep, lengths: torch.Tensor, slots: int) -> torch.Tensor:
    """(N, slots) position held by each compact slot after ``lengths`` tokens (-1: empty): the sink
    tokens, then for ring slot ``r`` the latest position ``j >= sink`` with ``(j - sink) % local == r``."""
    sink, local = keep.sink_tokens, keep.local_tokens
    s = torch.arange(slots, device=lengths.device)[None, :]
    n = lengths[:, None]
    in_sink = torch.where(s < n, s, torch.full_like(s, -1))
    r = s - sink
    past = n - sink  # tokens after the sink
    latest = sink + r + local * torch.div((past - 1 - r).clamp_min(0), local, rounding_mode="floor")
    in_ring = torch.where(past > r, latest, torch.full_like(latest, -1))
    return torch.where(s < sink, in_sink, in_ring)


def _head_span(pairs: torch.Tensor, batch: int) -> tuple[int, int] | None:
    """``(h0, h1)`` when ``pairs`` (N, 2) of (sample, KV head), in row-major order, are exactly every
    sample's heads ``h0 .. h1 - 1`` (:attr:`_Store.span`), else ``None``."""
    listed = [tuple(p) for p in pairs.tolist()]
    h0, h1 = min(h for _, h in listed), max(h for _, h in listed) + 1
    return (h0, h1) if listed == [(b, h) for b in range(batch) for h in range(h0, h1)] else None


class ElasticKVLayer(DynamicLayer):
    """One routed layer's cache: a transformers ``DynamicLayer`` until its first attention call,
    then one store per mode (see the module docstring)."""

    is_croppable = False

    def __init__(
        self, runtime: ElasticRuntime, layer_idx: int, growth_tokens: int = GROWTH_TOKENS,
        masks: DecodeMasks | None = None,
    ) -> None:
        super().__init__()
        if growth_tokens < 1:
            raise ValueError(f"growth_tokens must be >= 1, got {growth_tokens}")
        self.runtime = runtime
        self.layer_idx = layer_idx
        self.growth = growth_tokens
        #: the step's compact-store masks, shared with the cache's other layers
        self.masks = masks if masks is not None else DecodeMasks()
        self.stores: list[_Store] | None = None
        self.total = 0  # tokens transformers has passed through (padding included): its sequence length
        self.lengths: list[int] = []  # real tokens per sample (host)
        self.lengths_t: torch.Tensor | None = None  # the same on the device
        self._incoming: tuple[torch.Tensor, torch.Tensor] | None = None
        self._checked_mask: KeyPaddingInfo | None = None
        #: while frozen (:meth:`freeze`): the step shared by the cache's layers (its position on the
        #: device, its masks, the frozen attention)
        self.static: StaticStep | None = None

    def __repr__(self) -> str:
        state = "compacted" if self.compacted else "dense"
        return f"ElasticKVLayer(layer={self.layer_idx}, {state})"

    @property
    def compacted(self) -> bool:
        return self.stores is not None

    # -- the transformers layer contract --------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._incoming is not None:
            raise ElasticError(
                f"compact KV cache, layer {self.layer_idx}: the previous tokens' keys were never read by elastic "
                "attention (a forward failed half-way?); this cache is inconsistent, start a new one"
            )
        if not self.compacted:
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            self.runtime.kv_handoff[self.layer_idx] = (self, keys)
            return keys, values
        self._incoming = (key_states, value_states)
        if self.static is None:  # a frozen layer's host lengths move on at unfreeze()
            self.total += int(key_states.shape[-2])
        self.runtime.kv_handoff[self.layer_idx] = (self, key_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.total if self.compacted else super().get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def reset(self) -> None:
        if self.static is not None:
            raise ElasticError(f"compact KV cache, layer {self.layer_idx}: reset while a static decoder holds it")
        self.stores = None
        self.total = 0
        self.lengths, self.lengths_t = [], None
        self._incoming = self._checked_mask = None
        super().reset()

    def _refuse(self, what: str) -> None:
        if self.compacted:
            raise UnsupportedInputError(
                f"the compact KV cache cannot {what}: its sparse heads no longer hold the keys that would need; "
                "use elastic.kv_cache=full (greedy decoding and sampling work with compact)"
            )

    def crop(self, tokens_to_remove: int) -> None:
        self._refuse("crop tokens (assisted decoding)")
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse("reorder samples (beam search)")
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse("repeat samples")
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse("select samples")
        super().batch_select_indices(indices)

    def offload(self) -> None:
        self._refuse("offload to the CPU")
        super().offload()

    # -- accounting -----------------------------------------------------------------------------
    def kept_tokens(self) -> torch.Tensor:
        """(B, Hkv) int64: keys held per sample and KV head (a full head: its real tokens; a compact
        head: ``DecodeKeep.stored`` of them — its sink and ring, evicted keys excluded)."""
        if not self.compacted:
            raise ElasticError(f"layer {self.layer_idx} has not been compacted yet (no prefill has run)")
        assert self.stores is not None and self.lengths_t is not None
        heads = self.runtime.num_kv_heads
        out = torch.zeros(len(self.lengths), heads, dtype=torch.long)
        for store in self.stores:
            for b, h in zip(store.samples.tolist(), store.heads.tolist()):
                n = self.lengths[b]
                out[b, h] = n if store.keep is None else store.keep.stored(n)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors this layer holds (allocated slots, growth reserve included)."""
        if self.stores is not None:
            return sum(s.nbytes for s in self.stores)
        if self.keys is None or self.values is None:
            return 0
        return int(self.keys.nbytes + self.values.nbytes)

    # -- called by the runtime ------------------------------------------------------------------
    def compact(
        self, can: Canonical, index: torch.Tensor | None, modes: list[AttentionMode], *, mixing: bool = False
    ) -> None:
        """Replace this layer's dense keys by per-mode stores, after its prefill attention:
        ``can`` holds the canonical (start-aligned) keys, ``index`` (B, Hkv) each head's position in
        ``modes`` (the routing order: retrieval then sparse mode for two, ``elastic.modes`` for more);
        ``mixing``: the forward ran every mode for every head (a training router), refused."""
        if index is None:
            raise ElasticError(f"compact KV cache: layer {self.layer_idx} is not routed, it should not be compacted")
        if mixing:
            raise UnsupportedInputError(
                "the compact KV cache is for inference: the router is training (every head runs both modes); "
                "call elastic.eval() or use elastic.kv_cache=full"
            )
        lengths = can.seq.kv_len
        self.lengths = [int(n) for n in lengths.tolist()]
        self.lengths_t = lengths.clone()
        longest = max(self.lengths, default=0)
        stores = []
        for i, mode in enumerate(modes):
            pairs = (index == i).nonzero()
            if pairs.shape[0] == 0:
                continue
            b, h = pairs[:, 0], pairs[:, 1]
            keep = mode.decode_keep()
            store = _Store(mode, keep, b, h, can.k[:0, 0], can.v[:0, 0], None, _head_span(pairs, len(self.lengths)))
            slots = store.slots_for(longest + self.growth)
            if keep is None:
                n, d, dv = b.shape[0], can.k.shape[-1], can.v.shape[-1]
                store.keys = can.k.new_zeros(n, slots, d)
                store.values = can.v.new_zeros(n, slots, dv)
                store.keys[:, :longest] = can.k[b, h, :longest]
                store.values[:, :longest] = can.v[b, h, :longest]
            else:
                positions = _prefill_positions(keep, lengths[b], slots)
                index = positions.clamp_min(0)
                store.keys = can.k[b[:, None], h[:, None], index]
                store.values = can.v[b[:, None], h[:, None], index]
                store.positions = positions.to(torch.int32)  # half the bytes of int64; positions < 2**31
            stores.append(store)
        self.total = self.get_seq_length()
        self.keys = self.values = None  # the dense keys are gone from now on
        self.stores = stores

    def attend(
        self, q: torch.Tensor, info: KeyPaddingInfo | None, *, scale: float, executor: Executor
    ) -> torch.Tensor:
        """Decode attention of the queries q (B, Hq, S, D) over the stores, after writing the
        ``S`` tokens given to :meth:`update`; returns (B, Hq, S, Dv) in transformers' rows."""
        if self._incoming is None or self.stores is None or self.lengths_t is None:
            raise ElasticError(f"compact KV cache, layer {self.layer_idx}: attention without a preceding update")
        k_new, v_new = self._incoming
        self._incoming = None
        if self.stores and self.stores[0].keys.is_inference() and not torch.is_inference_mode_enabled():
            raise UnsupportedInputError(
                f"compact KV cache, layer {self.layer_idx}: the prefill ran under torch.inference_mode and this "
                "step does not, so the cache's tensors cannot be written: run every step under inference_mode, "
                "or none"
            )
        if self.static is not None:
            return self.static.attend(self, q, k_new, v_new, scale)
        batch, hq, steps, _ = q.shape
        hkv = k_new.shape[1]
        self._check_new_tokens(info, steps)
        group = hq // hkv
        longest = max(self.lengths, default=0) + steps
        # every sample as long (known on the host): the new tokens' positions are host integers
        first = self.lengths[0] if self.lengths and all(n == self.lengths[0] for n in self.lengths) else None
        positions = None  # (B, S) on the device, only where the samples' lengths differ
        if first is None:
            positions = self.lengths_t[:, None] + torch.arange(steps, device=q.device)[None, :]
        qg_all = q.reshape(batch, hkv, group, steps, q.shape[-1])
        out = q.new_empty(batch, hkv, group, steps, v_new.shape[-1])
        for store in self.stores:
            b, h = store.samples, store.heads
            pos: torch.Tensor | None = None  # (N, S)
            if store.span is not None:  # slices of every sample's heads h0 .. h1 - 1
                h0, h1 = store.span
                qg = qg_all[:, h0:h1].flatten(0, 1)  # (N, G, S, D)
                kb, vb = k_new[:, h0:h1], v_new[:, h0:h1]  # (B, n, S, D): written in place at host positions
                if positions is not None:
                    pos = positions.repeat_interleave(h1 - h0, 0)
            else:
                qg, kb, vb = qg_all[b, h], k_new[b, h], v_new[b, h]  # (N, G, S, D), (N, S, D)
                if positions is not None:
                    pos = positions[b]
            if store.keep is None:
                store.reserve(longest, self.growth)
                for i in range(steps):
                    if first is not None:
                        store.write_at(first + i, kb[..., i, :], vb[..., i, :])
                    else:
                        assert pos is not None
                        store.write(pos[:, i], kb[..., i, :].reshape(-1, kb.shape[-1]),
                                    vb[..., i, :].reshape(-1, vb.shape[-1]))
                if first is not None:  # every sample as long
                    seq = SeqInfo.dense(len(b), steps, longest, q.device)
                else:
                    lengths = self.lengths_t[b]
                    seq = SeqInfo.trusted(lengths, lengths + steps, steps, longest)
                keys, values = store.keys[:, None, :longest], store.values[:, None, :longest]
                layout = self.runtime.layout_for(store.mode, qg, keys, seq, scale=scale)
                result = store.mode.attend(qg, keys, values, seq, executor, scale=scale, layout=layout).out
            else:
                result = self._attend_compact(store, qg, pos, kb, vb, scale, longest, first)
            if store.span is not None:
                out[:, store.span[0] : store.span[1]] = result.view(batch, -1, *result.shape[1:]).to(out.dtype)
            else:
                out[b, h] = result.to(out.dtype)
        self.lengths_t = self.lengths_t + steps
        self.lengths = [n + steps for n in self.lengths]
        return out.reshape(batch, hq, steps, out.shape[-1])

    # -- frozen: fixed shapes, the position on the device (elasticfw.model.static_decode) --------
    def freeze(self, step: StaticStep, capacity: int) -> None:
        """Fix this layer's shapes for decode steps of one token up to ``capacity`` positions
        (:meth:`StaticStep.freeze_layer <elasticfw.model.static_decode.StaticStep.freeze_layer>`);
        until :meth:`unfreeze`, steps write at ``step.position`` on the device and move no host lengths."""
        if self.stores is None or self.lengths_t is None:
            raise ElasticError(f"compact KV cache, layer {self.layer_idx}: freeze before the prefill")
        if self.static is not None:
            raise ElasticError(f"compact KV cache, layer {self.layer_idx}: already frozen")
        step.freeze_layer(self, capacity)
        self.static = step

    def unfreeze(self, steps: int) -> None:
        """Back to ordinary steps after ``steps`` frozen ones: the host lengths move on by them."""
        if self.static is None:
            return
        self.static = None
        self.total += steps
        self.lengths = [n + steps for n in self.lengths]
        if self.lengths_t is not None:
            self.lengths_t = self.lengths_t + steps

    def _attend_compact(
        self, store: _Store, qg: torch.Tensor, pos: torch.Tensor | None, kb: torch.Tensor, vb: torch.Tensor,
        scale: float, longest: int, first: int | None,
    ) -> torch.Tensor:
        """A compact store's decode attention: a softmax over the slots its mode reads. ``kb`` / ``vb``:
        the new tokens, (N, S, D) or, for a store of every sample's heads ``span``, (B, n, S, D);
        ``pos`` (N, S) their positions where the samples' lengths differ (``first`` is then ``None``),
        else ``None`` and ``first`` the host-known position every sample's first new token has."""
        keep = store.keep
        assert keep is not None and store.positions is not None
        steps, n = kb.shape[-2], qg.shape[0]
        if steps == 1:  # write first: the ring slot it overwrites is not readable any more
            store.reserve(longest, self.growth)
            if first is not None:  # every sample as long: `pos` is None
                store.write_at(first, kb[..., 0, :], vb[..., 0, :])
            else:
                assert pos is not None
                store.write(pos[:, 0], kb[..., 0, :].reshape(n, -1), vb[..., 0, :].reshape(n, -1))
            keys, values, held = store.keys, store.values, store.positions
            mask = None
            if keep.granularity > 1 or min(self.lengths) + 1 < keep.capacity:
                if first is not None:  # every row holds the same positions: the step's mask
                    mask = self.masks.visible(keep, first, held.shape[1], held.device)  # (1, 1, 1, slots)
                else:
                    assert pos is not None
                    mask = keep.visible(held[:, None, None, :], pos[:, None, :, None])  # (N, 1, 1, slots)
            # else every sample's sink and ring are full and the ring holds the last `local` positions,
            # exactly the token window of the new query: every slot is read, no mask.
            # The group's query heads read the same keys and slots: one KV head, the heads as its rows
            # (no GQA broadcast, so SDPA keeps a fused kernel with a mask too)
            group = qg.shape[1]
            out = F.scaled_dot_product_attention(
                qg.to(keys.dtype).reshape(n, 1, group, -1), keys[:, None], values[:, None], attn_mask=mask, scale=scale
            )
            return out.reshape(n, group, 1, -1)
        # several tokens: earlier queries of the chunk may still read what the later tokens overwrite
        kn, vn = kb.reshape(n, steps, -1), vb.reshape(n, steps, -1)
        if first is not None:
            pos = (first + torch.arange(steps, device=qg.device)).expand(n, steps)
        assert pos is not None
        keys = torch.cat([store.keys, kn.to(store.keys.dtype)], dim=1)
        values = torch.cat([store.values, vn.to(store.values.dtype)], dim=1)
        held = torch.cat([store.positions, pos.to(store.positions.dtype)], dim=1)
        mask = keep.visible(held[:, None, None, :], pos[:, None, :, None])  # (N, 1, S, slots)
        dtype = keys.dtype
        result = F.scaled_dot_product_attention(
            qg.to(dtype), keys[:, None], values[:, None], attn_mask=mask, scale=scale, enable_gqa=True
        )
        store.reserve(longest, self.growth)
        for i in range(steps):
            store.write(pos[:, i], kn[:, i], vn[:, i])
        return result

    def _check_new_tokens(self, info: KeyPaddingInfo | None, steps: int) -> None:
        """The attention mask must be the prefill's extended by ones for the new tokens (generate
        appends them so): each sample's real tokens are its last ``lengths[b] + steps`` keys, as the
        stores hold them; a mask that says otherwise (changed after the prefill, padding inside or
        after a continuation, none after a padded prefill) would be read differently by the full
        cache, so it is refused. Checked once per mask object (one device read)."""
        if info is not None and info is self._checked_mask:
            return
        if info is not None and (info.kv_length != self.total or info.query_index != self.total - steps):
            raise UnsupportedInputError(
                f"compact KV cache, layer {self.layer_idx}: the attention mask covers {info.kv_length} keys with "
                f"queries at {info.query_index}, but the cache holds {self.total} tokens ending with these {steps}"
            )
        key_mask = None if info is None else info.key_mask
        if key_mask is None:
            if any(n + steps != self.total for n in self.lengths):
                raise UnsupportedInputError(
                    f"compact KV cache, layer {self.layer_idx}: this step has no attention mask (every key real), "
                    f"but the samples hold {[n + steps for n in self.lengths]} real tokens of {self.total} (the "
                    "prefill was padded): pass the prefill's attention mask extended by ones for the new tokens"
                )
            return
        assert self.lengths_t is not None  # attend checked it
        real = self.lengths_t.to(key_mask.device) + steps
        expected = torch.arange(self.total, device=key_mask.device)[None, :] >= (self.total - real)[:, None]
        if not torch.equal(key_mask.to(torch.bool), expected):
            raise UnsupportedInputError(
                "the compact KV cache needs the attention mask of the prefill extended by ones for the new tokens "
                "(each sample's real tokens last and contiguous): a mask changed after the prefill, or padding "
                "inside or after a continuation, is not supported"
            )
        self._checked_mask = info


class ElasticKVCache(Cache):
    """The KV cache of an elastic model with compacted sparse heads (see the module docstring).

    >>> cache = ElasticKVCache(elastic)
    >>> out = elastic.generate(**inputs, cache=cache, max_new_tokens=32)
    >>> cache.nbytes, cache.kept_tokens(layer_idx=3)    # bytes held; (B, Hkv) keys kept

    ``growth_tokens``: a full store grows by this many slots at a time.
    """

    def __init__(self, elastic: Any, *, growth_tokens: int = GROWTH_TOKENS) -> None:
        runtime: ElasticRuntime = elastic.runtime
        model = elastic.base
        config = model.config.get_text_config(decoder=True)
        layers: list[Any] = list(DynamicCache(config=config).layers)
        if len(layers) != runtime.num_layers:
            raise ElasticError(
                f"the backbone's cache has {len(layers)} layers but the elastic model {runtime.num_layers}"
            )
        masks = DecodeMasks()
        for i, layer in enumerate(layers):
            windowed = getattr(layer, "is_sliding", False) or elastic.adapter.sliding_window(model, i) is not None
            if i in runtime.routed and not windowed:
                layers[i] = ElasticKVLayer(runtime, i, growth_tokens, masks)
        super().__init__(layers=layers)

    def elastic_layers(self) -> dict[int, ElasticKVLayer]:
        """The layers that compact (routed, without a native window), by layer index."""
        return {i: layer for i, layer in enumerate(self.layers) if isinstance(layer, ElasticKVLayer)}

    def kept_tokens(self, layer_idx: int) -> torch.Tensor:
        """(B, Hkv) keys held by a compacting layer per sample and KV head (see
        :meth:`ElasticKVLayer.kept_tokens`)."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, ElasticKVLayer):
            raise ElasticError(f"layer {layer_idx} is not compacted by this cache (not routed, or natively windowed)")
        return layer.kept_tokens()

    @property
    def nbytes(self) -> int:
        """Bytes of every key, value and position tensor the cache holds, all layers."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, ElasticKVLayer):
                total += layer.nbytes
            else:
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    total += int(t.nbytes) if isinstance(t, torch.Tensor) else 0
        return total
