"""Split executor: each group of heads through the fastest kernel that computes it exactly.

A routed layer has dense causal heads (the retrieval mode, usually full attention) and sparse ones.
Instead of one block-sparse launch over both (``flex``), this executor runs the dense causal heads
of a plain prefill through dense causal SDPA (``dense_backend``: cuDNN first on CUDA, a pinned
backend, or ``flash_attn``) and every other layout through the sparse path (``sparse``: ``flex`` on
CUDA, ``gathered`` elsewhere, :mod:`elasticfw_plugins.executors.gathered`); decode steps take
``decode_sparse`` (the Triton decode kernel on CUDA, one launch per routed layer; ``gathered``
elsewhere). A routed call is split only where that is exact and cheap (one dense layout, a plain
prefill or a decode step, no log-sum-exp asked for, one routing for every sample, whole GQA
groups); otherwise it is one sparse launch over the combined layout. Gradients flow through both
groups. The conditions, what is copied and the measurements behind the choices:
``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import functools
import inspect
from collections import OrderedDict
from typing import Literal, cast

import torch
import torch.nn.functional as F
from pydantic import Field

from elasticfw.attention.executor import Executor, ExecutorConfig
from elasticfw.attention.inputs import check_layout
from elasticfw.attention.layout import BlockLayout, RowSelection, computes_every_causal_pair, select_heads
from elasticfw.attention.mode import AttentionOutput, routed_layout
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError, UnsupportedInputError
from elasticfw.kernels import triton_unavailable
from elasticfw_plugins.executors import gathered as gathered_module
from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor
from elasticfw_plugins.executors.gathered import (
    MaskBuffer,
    decode_dropped_keys,
    decode_key_bias,
    gathered_attention,
)

DenseBackend = Literal["auto", "cudnn", "flash", "efficient", "math", "flash_attn"]


class SplitConfig(ExecutorConfig):
    name: Literal["split"] = "split"
    dense_backend: DenseBackend = Field(
        "auto",
        description="Kernel of dense causal heads on CUDA: `auto` (SDPA, cuDNN first, then FlashAttention-2, "
        "memory-efficient, math), one SDPA backend (`cudnn`, `flash`, `efficient`, `math`: pinned, an error "
        "if it cannot run), or `flash_attn` (the flash-attn package). On a CPU: SDPA.",
    )
    sparse: Literal["auto", "flex", "gathered"] = Field(
        "auto",
        description="Path of every other layout: `flex` (the flex executor, options in `flex`), `gathered` "
        "(SDPA over the key blocks each query chunk needs, exact mask); `auto`: flex on CUDA, gathered elsewhere.",
    )
    flex: FlexConfig | None = Field(
        None, description="Options of the flex sparse path (a flex executor section without `name`; null: defaults)."
    )
    query_chunk: int = Field(
        192, ge=1, description="Gathered path: query rows per SDPA call (the key blocks are gathered per chunk)."
    )
    decode_sparse: Literal["auto", "kernel", "gathered", "flex"] = Field(
        "auto",
        description="Path of decode steps (one query row per sample) that are not plain dense attention: `kernel` "
        "(the Triton decode kernel: a routed layer in one launch, both layouts' heads, split over the keys, no "
        "device read), `gathered` (SDPA over only the key blocks the row reads), `flex` (the query padded to one "
        "FlexAttention tile); `auto`: kernel on CUDA where it takes the layouts, gathered elsewhere.",
    )

    def check_layout_block_size(self, block_size: int) -> None:
        if self.sparse != "gathered":
            self.flex_config().check_layout_block_size(block_size)

    def flex_config(self) -> FlexConfig:
        return self.flex if self.flex is not None else FlexConfig()


def _sdpa_backends(name: str) -> list:
    from torch.nn.attention import SDPBackend

    table = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    if name == "auto":
        return [table["cudnn"], table["flash"], table["efficient"], table["math"]]
    return [table[name]]


@functools.cache
def _sdpa_takes_priority() -> bool:
    """Whether ``sdpa_kernel`` takes ``set_priority`` (torch >= 2.6: the list's order is the
    priority). Asked once: ``inspect.signature`` costs about 10 us of host time, and a decode step
    of an all-full layer calls :meth:`SplitExecutor.dense` once per layer."""
    from torch.nn.attention import sdpa_kernel

    return "set_priority" in inspect.signature(sdpa_kernel).parameters


def _sdpa_context(backends: list):  # type: ignore[no-untyped-def]
    from torch.nn.attention import sdpa_kernel

    if _sdpa_takes_priority():
        return sdpa_kernel(backends, set_priority=True)
    return sdpa_kernel(backends)


def _plain_prefill(seq: SeqInfo) -> bool:
    """Queries are every position from 0 (``is_causal`` then means exactly ``key <= position``).
    Without a device read when the lengths are known on the host (``SeqInfo.dense``)."""
    if seq.q_len != seq.kv_capacity:
        return False
    if seq.host_signature() is not None:  # dense: q_start = kv_capacity - q_len = 0
        return True
    return not bool(seq.q_start.any())


def _dense_decode(seq: SeqInfo) -> bool:
    """One query per sample at the last position, no key padding (known on the host): its causal
    keys are every key, so dense attention needs no mask."""
    return seq.q_len == 1 and seq.host_signature() is not None


def _dense_shape(seq: SeqInfo) -> bool:
    """Dense causal attention of these queries is one unmasked SDPA call (prefill or decode)."""
    return _plain_prefill(seq) or _dense_decode(seq)


def _decode_kernel_reason(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layouts: tuple[BlockLayout, ...]
) -> tuple[str | None, list[RowSelection]]:
    """``(None, the layouts' row selections)`` when the Triton decode kernel computes these layouts
    for ``q``, else ``(why not, [])``."""
    reason = triton_unavailable(q.device)
    if reason is not None:
        return reason, []
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return "it has no backward (autograd is recording)", []
    try:
        from elasticfw.kernels.block_sparse_attention import layout_selection
        from elasticfw.kernels.decode_attention import unsupported
    except ImportError as exc:  # triton installed but broken
        return f"the Triton kernel failed to import ({exc})", []
    selections = [layout_selection(layout) for layout in layouts]
    if any(s is None for s in selections):
        return "a layout has a token mask (pairs inside blocks) that is not a row selection", []
    chosen = cast("list[RowSelection]", selections)
    reason = unsupported(q, *chosen)
    return reason, (chosen if reason is None else [])


#: entries each of a split executor's caches keeps (head indices, per-layout and per-routing answers)
INDEX_CACHE_SIZE = 256


def _keep(cache: OrderedDict, key: object, value: object) -> None:
    """Store ``value`` under ``key``, dropping the oldest entries past :data:`INDEX_CACHE_SIZE`."""
    cache[key] = value
    while len(cache) > INDEX_CACHE_SIZE:
        cache.popitem(last=False)


def _empty_like_layout(layout: BlockLayout) -> BlockLayout:
    """A layout of the same block grid computing nothing."""
    shape = (1, 1, *layout.blocks.shape[2:])
    return BlockLayout(torch.zeros(shape, dtype=torch.bool, device=layout.blocks.device), layout.block_size)


class SplitExecutor(Executor):
    """Dense causal heads through dense SDPA (cuDNN first on CUDA), the others through FlexAttention
    (CUDA) or block-gathered SDPA (CPU); see the module docstring."""

    name = "split"
    config_class = SplitConfig
    config: SplitConfig
    takes_host_routing = True  # the runtime's CPU copy of the routing: no device read per routed layer

    def __init__(self, config: SplitConfig | None = None) -> None:
        super().__init__(config)
        self._flex: FlexExecutor | None = None
        #: (device, heads) -> the heads as an int64 index on that device: built once per routing
        #: pattern (building it from a list is a copy to the device, which waits for queued kernels)
        self._indices: OrderedDict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = OrderedDict()
        #: the gathered path's additive masks at inference (:mod:`elasticfw_plugins.executors.gathered`)
        self._mask_buffer = MaskBuffer()
        #: the block rows' gathered keys and values at inference (the same module)
        self._gather_buffers = (MaskBuffer(), MaskBuffer())
        #: (id of a reusable layout, SeqInfo signature) -> (the layout, whether it computes every causal pair)
        self._every_pair_cache: OrderedDict[tuple[int, tuple], tuple[BlockLayout, bool]] = OrderedDict()
        #: (the routing's bytes on the host, its shape, retrieval layout dense, Hkv) -> :meth:`split_heads`'
        #: answer: one decision per routing, not per layer and step
        self._split_memo: OrderedDict[tuple, tuple[list[int], list[int]] | None] = OrderedDict()
        #: (id of a reusable layout, key capacity, dtype) -> (the layout, :func:`decode_dropped_keys`,
        #: :func:`decode_key_bias` or ``None`` until a call takes the mask): a decode step's reusable
        #: layout is shared by every layer, so its mask is built at most once per step
        self._bias_cache: OrderedDict[tuple, tuple[BlockLayout, int | None, torch.Tensor | None]] = OrderedDict()
        #: (ids of reusable layouts, q's device, dtype and head shape) -> (the layouts,
        #: :func:`_decode_kernel_reason`'s answer): asked once per decode step, not at every layer
        self._kernel_verdicts: OrderedDict[tuple, tuple[tuple[BlockLayout, ...], tuple[str | None, list]]] = (
            OrderedDict()
        )
        #: (ids of reusable layouts, the call's batch, head and key geometry, q's device) -> the layouts,
        #: whose :func:`check_layout` passed: a decode step's layouts are checked once, not at every layer
        self._checked_layouts: OrderedDict[tuple, tuple[BlockLayout, ...]] = OrderedDict()

    def _head_index(self, heads: list[int], device: torch.device) -> torch.Tensor:
        """``heads`` as an int64 tensor on ``device``, kept for the next layer or forward with the
        same heads (at most :data:`INDEX_CACHE_SIZE` patterns, least recently used dropped first)."""
        key = (device, tuple(heads))
        index = self._indices.get(key)
        if index is None:
            index = torch.tensor(heads, device=device)
            _keep(self._indices, key, index)
        else:
            self._indices.move_to_end(key)
        return index

    def _every_pair(self, layout: BlockLayout, seq: SeqInfo) -> bool:
        """:func:`~elasticfw.attention.layout.computes_every_causal_pair`, decided once per reusable
        layout object and SeqInfo signature (the layers of a forward share a streaming layout: a
        decode step would otherwise pay the check, about 0.15 ms on the CPU, at every layer)."""
        signature = seq.host_signature()
        if not layout.reusable or signature is None:
            return computes_every_causal_pair(layout, seq)
        key = (id(layout), signature)
        hit = self._every_pair_cache.get(key)
        if hit is not None and hit[0] is layout:
            return hit[1]
        answer = computes_every_causal_pair(layout, seq)
        _keep(self._every_pair_cache, key, (layout, answer))
        return answer

    def _kernel_verdict(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layouts: tuple[BlockLayout, ...]
    ) -> tuple[str | None, list[RowSelection]]:
        """:func:`_decode_kernel_reason`, decided once per tuple of reusable layout objects and q's
        device, dtype and head shape (a decode step's layouts are shared by every layer: about 11 us
        of host time per layer otherwise). Autograd is asked at every call."""
        if q.dim() != 4 or not all(layout.reusable for layout in layouts) or (
            torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        ):
            return _decode_kernel_reason(q, k, v, layouts)
        key = (*map(id, layouts), q.device, q.dtype, q.shape[1], q.shape[3])
        hit = self._kernel_verdicts.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], layouts, strict=True)):
            return hit[1]
        answer = _decode_kernel_reason(q, k, v, layouts)
        _keep(self._kernel_verdicts, key, (layouts, answer))
        return answer

    def _check_layouts(
        self, layouts: tuple[BlockLayout, ...], q: torch.Tensor, k: torch.Tensor, seq: SeqInfo
    ) -> None:
        """:func:`check_layout` of each layout (after q, k, v and ``seq`` are checked), once per tuple
        of reusable layout objects and call geometry: the checks read only the layouts' shapes and
        devices, which a reusable layout never changes (about 4 us of host time per layout and layer)."""
        key = (*map(id, layouts), q.shape[0], q.shape[1], k.shape[1], seq.q_len, seq.kv_capacity, q.device)
        reusable = all(isinstance(layout, BlockLayout) and layout.reusable for layout in layouts)
        hit = self._checked_layouts.get(key) if reusable else None
        if hit is not None and all(a is b for a, b in zip(hit, layouts, strict=True)):
            return
        for layout in layouts:
            check_layout(layout, q, k, seq, context=f"executor {self.name!r}")
        if reusable:
            _keep(self._checked_layouts, key, layouts)

    def _take_heads(self, t: torch.Tensor, heads: list[int]) -> torch.Tensor:
        """Heads ``heads`` (ascending) of a (B, H, S, D) tensor: a view for a contiguous range, else a gather."""
        if heads == list(range(heads[0], heads[-1] + 1)):
            return t[:, heads[0] : heads[-1] + 1]
        return t.index_select(1, self._head_index(heads, t.device))

    # -- decisions -----------------------------------------------------------------------------
    def sparse_path(self, device: torch.device, seq: SeqInfo | None = None) -> str:
        """``flex`` or ``gathered`` (or ``kernel`` at decode): the path of layouts that are not dense
        causal, on ``device`` (for decode steps of ``seq``, one query row per sample:
        ``decode_sparse``, ``auto`` resolved to ``kernel`` on CUDA where Triton runs)."""
        if seq is not None and seq.q_len == 1:
            choice = self.config.decode_sparse
            if choice == "auto":
                return "kernel" if device.type == "cuda" and triton_unavailable(device) is None else "gathered"
            return choice
        choice = self.config.sparse
        if choice == "auto":
            return "flex" if device.type == "cuda" else "gathered"
        return choice

    def dense_ok(self, layout: BlockLayout, seq: SeqInfo, need_lse: bool) -> bool:
        """Whether ``layout`` runs through the dense causal kernel."""
        return layout.dense_causal and not need_lse and _dense_shape(seq)

    # -- the contract ------------------------------------------------------------------------
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BlockLayout,
        seq: SeqInfo,
        *,
        scale: float,
        need_lse: bool = True,
    ) -> AttentionOutput:
        if self.dense_ok(layout, seq, need_lse):
            return AttentionOutput(self.dense(q, k, v, scale=scale, causal=seq.q_len > 1), None)
        return self.sparse(q, k, v, layout, seq, scale=scale, need_lse=need_lse)

    def attend_routed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq: SeqInfo,
        *,
        hard: torch.Tensor,
        layouts: tuple[BlockLayout, BlockLayout],
        scale: float,
        need_lse: bool = True,
        hard_host: torch.Tensor | None = None,
    ) -> AttentionOutput:
        lay_r, lay_s = layouts
        if self.sparse_path(q.device, seq) == "kernel":
            reason, selections = self._kernel_verdict(q, k, v, layouts)
            if reason is None or self.config.decode_sparse == "kernel":  # both layouts' heads in one launch
                self.check_inputs(q, k, v, seq, scale=scale)  # q, k, v and the scale
                self._check_layouts(layouts, q, k, seq)
                if hard.shape != (q.shape[0], q.shape[1]):
                    raise UnsupportedInputError(
                        f"executor 'split': hard must be (batch, query heads) = {tuple(q.shape[:2])}, got "
                        f"{tuple(hard.shape)}"
                    )
                return self.decode_kernel(q, k, v, seq, layouts, scale=scale, need_lse=need_lse, reason=reason,
                                          second_heads=hard, selections=selections)
        dense_heads = self.split_heads(q, k, seq, hard, layouts, need_lse, hard_host=hard_host)
        if dense_heads is None:
            return super().attend_routed(q, k, v, seq, hard=hard, layouts=layouts, scale=scale, need_lse=need_lse)
        self.check_inputs(q, k, v, seq, scale=scale)  # q, k, v and the scale
        self._check_layouts(layouts, q, k, seq)
        dense_q, dense_kv = dense_heads
        sparse_layout, sparse_heads = (lay_s, hard) if lay_r.dense_causal else (lay_r, ~hard)
        hq = q.shape[1]
        causal = seq.q_len > 1
        if not dense_q:
            return self.sparse(q, k, v, sparse_layout, seq, scale=scale, need_lse=False)
        if len(dense_q) == hq:
            return AttentionOutput(self.dense(q, k, v, scale=scale, causal=causal), None)
        if not causal and q.device.type == "cpu" and self.sparse_path(q.device, seq) == "gathered":
            masked = self._masked_decode(q, k, v, seq, sparse_layout, sparse_heads, hq - len(dense_q), scale)
            if masked is not None:
                return AttentionOutput(masked, None)
        out_d = self.dense(
            self._take_heads(q, dense_q), self._take_heads(k, dense_kv), self._take_heads(v, dense_kv), scale=scale,
            causal=causal,
        )
        # the sparse group over all heads, the dense heads' rows empty: no q/K/V copy, one kernel shape
        if self.sparse_path(q.device, seq) == "flex":  # the layout's mask converted once, dense heads dropped
            out_s = self.flex_executor().attend(
                q, k, v, sparse_layout, seq, scale=scale, need_lse=False, keep_heads=sparse_heads[:1],
                keep_key=("dense_q", *dense_q),
            ).out
        elif not causal and sparse_layout.num_heads == 1 and sparse_layout.token_mask is None:
            # a decode step over one pattern for every head (streaming): every head through it, no
            # per-head mask (a few blocks per head); the dense heads' rows are overwritten below
            out_s = self.gathered(q, k, v, sparse_layout, seq, scale=scale, need_lse=False).out
        else:
            rest = select_heads(sparse_heads, sparse_layout, _empty_like_layout(sparse_layout))
            out_s = self.gathered(q, k, v, rest, seq, scale=scale, need_lse=False).out
        index = self._head_index(dense_q, q.device)
        if out_s.requires_grad:  # autograd keeps FlexAttention's output for its backward: a new tensor
            return AttentionOutput(out_s.index_copy(1, index, out_d.to(out_s.dtype)), None)
        # inference: write only the dense heads' rows into the sparse launch's output
        return AttentionOutput(out_s.index_copy_(1, index, out_d.to(out_s.dtype)), None)

    def _masked_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqInfo, layout: BlockLayout,
        sparse_heads: torch.Tensor, n_sparse: int, scale: float,
    ) -> torch.Tensor | None:
        """A routed host-dense decode step as one SDPA call over every head and key: the sparse
        heads' keys outside ``layout`` masked (:func:`decode_key_bias`), the dense heads' none.
        ``None`` (two calls instead) when the layout has no such mask or the call would attend more
        than :data:`~elasticfw_plugins.executors.gathered.MASKED_DECODE_PAIRS` dropped pairs."""
        key = (id(layout), seq.kv_capacity, q.dtype)
        hit = self._bias_cache.get(key) if layout.reusable else None
        if hit is None or hit[0] is not layout:
            hit = (layout, decode_dropped_keys(layout, seq.kv_capacity), None)
        dropped, bias = hit[1], hit[2]
        if dropped is not None and q.shape[0] * n_sparse * dropped <= gathered_module.MASKED_DECODE_PAIRS:
            if bias is None:  # the mask is built only for a call that takes it
                bias = decode_key_bias(layout, seq.kv_capacity, q.dtype)
                hit = (layout, dropped, bias)
        else:
            bias = None
        if layout.reusable:
            _keep(self._bias_cache, key, hit)
        if bias is None:
            return None
        hq = q.shape[1]
        if bias.shape[1] not in (1, hq):  # one layout per KV head: its query heads share it
            bias = bias.repeat_interleave(hq // bias.shape[1], dim=1)
        mask = torch.where(sparse_heads[:, :, None, None], bias, 0.0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    def split_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        seq: SeqInfo,
        hard: torch.Tensor,
        layouts: tuple[BlockLayout, BlockLayout],
        need_lse: bool,
        *,
        hard_host: torch.Tensor | None = None,
    ) -> tuple[list[int], list[int]] | None:
        """(dense query heads, their KV heads) when a routed call splits, else ``None`` (one launch).
        ``hard_host``: ``hard`` on the CPU when the caller has it (no device read here; without it,
        every call reads ``hard`` from the device, a synchronisation on a GPU: the model runtime
        always passes it)."""
        lay_r, lay_s = layouts
        hq, hkv = q.shape[1], k.shape[1]
        if hard.shape != (q.shape[0], hq):
            raise UnsupportedInputError(
                f"executor 'split': hard must be (batch, query heads) = {(q.shape[0], hq)}, got {tuple(hard.shape)}"
            )
        if need_lse or lay_r.dense_causal == lay_s.dense_causal or not _dense_shape(seq):
            return None
        if hard_host is not None and hard_host.shape != hard.shape:
            raise UnsupportedInputError(
                f"executor 'split': hard_host must have hard's shape {tuple(hard.shape)}, got {tuple(hard_host.shape)}"
            )
        if hard_host is not None and hard_host.device.type != "cpu":
            raise UnsupportedInputError(
                f"executor 'split': hard_host must be on the CPU (the routing the caller holds there), "
                f"got a tensor on {hard_host.device}"
            )
        # one device read for every decision below (each would be a synchronisation), none when given
        host = hard.cpu() if hard_host is None else hard_host
        # the answer depends on the routing's values and which layout is dense: kept per routing
        # *value* (its bytes), so that the layers and decode steps that reuse one routing decide once
        # (each decision below is several small operations). Not per tensor object: a tensor made
        # under inference_mode has no version counter, and a write through .numpy() bumps none.
        key = (host.to(torch.bool).contiguous().numpy().tobytes(), tuple(host.shape), lay_r.dense_causal, hkv)
        if key in self._split_memo:
            self._split_memo.move_to_end(key)
            return self._split_memo[key]
        answer: tuple[list[int], list[int]] | None = None
        if bool((host == host[:1]).all()):  # else samples routed differently: one launch (documented)
            dense = (~host[0] if lay_r.dense_causal else host[0]).view(hkv, hq // hkv)
            if bool((dense.all(1) | ~dense.any(1)).all()):  # else a GQA group split between the layouts
                dense_kv = [int(i) for i in dense.all(1).nonzero().flatten().tolist()]
                group = hq // hkv
                answer = [h * group + j for h in dense_kv for j in range(group)], dense_kv
        _keep(self._split_memo, key, answer)
        return answer

    # -- the two paths -------------------------------------------------------------------------
    def flex_executor(self) -> FlexExecutor:
        """The flex executor of the sparse path (built on first use, with the ``flex`` options)."""
        if self._flex is None:
            self._flex = FlexExecutor(self.config.flex_config())
        return self._flex

    def dense(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = True
    ) -> torch.Tensor:
        """Dense causal attention (GQA without repeating K/V) of a plain prefill (``causal``) or of a
        decode step (one query at the last position: every key, no mask). On CUDA a decode step
        with ``dense_backend: auto`` skips cuDNN, which rebuilds its plan for every new key length
        (about 9 ms of host time per call on an H200; results/bench/decode-memory/README.md)."""
        backend = self.config.dense_backend
        if q.device.type != "cuda":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        if backend == "flash_attn":
            return self._flash_attn(q, k, v, scale, causal)
        backends = _sdpa_backends(backend)
        if not causal and backend == "auto":
            backends = backends[1:]  # cuDNN first in the list: not for decode shapes
        with _sdpa_context(backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)

    @staticmethod
    def _flash_attn(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True
    ) -> torch.Tensor:
        try:
            from flash_attn import flash_attn_func
        except ImportError as exc:
            raise BackendUnavailableError(
                f"executor 'split': dense_backend 'flash_attn' needs the flash-attn package ({exc})"
            ) from exc
        out = flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, softmax_scale=scale
        )
        return out.transpose(1, 2)

    def sparse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BlockLayout,
        seq: SeqInfo,
        *,
        scale: float,
        need_lse: bool,
    ) -> AttentionOutput:
        path = self.sparse_path(q.device, seq)
        if path == "flex":
            return self.flex_executor().attend(q, k, v, layout, seq, scale=scale, need_lse=need_lse)
        if path == "gathered" and not need_lse and _dense_shape(seq) and self._every_pair(layout, seq):
            # every causal pair (a data-dependent mode at a short context): the dense kernel's exact work
            return AttentionOutput(self.dense(q, k, v, scale=scale, causal=seq.q_len > 1), None)
        if path == "kernel":
            reason, selections = self._kernel_verdict(q, k, v, (layout,))
            return self.decode_kernel(q, k, v, seq, (layout,), scale=scale, need_lse=need_lse, reason=reason,
                                      selections=selections)
        return self.gathered(q, k, v, layout, seq, scale=scale, need_lse=need_lse)

    def decode_kernel(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq: SeqInfo,
        layouts: tuple[BlockLayout, ...],
        *,
        scale: float,
        need_lse: bool,
        reason: str | None,
        second_heads: torch.Tensor | None = None,
        selections: list[RowSelection] | None = None,
    ) -> AttentionOutput:
        """A decode step through the Triton decode kernel (:mod:`elasticfw.kernels.decode_attention`):
        one layout, or two with ``second_heads`` (B, Hq) the heads reading the second. ``reason`` and
        ``selections``: :func:`_decode_kernel_reason` of these inputs (``None`` and the layouts' row
        selections: the kernel takes them), computed by the caller, which decided on it and has
        checked the inputs (the kernel does not check them again). An input the kernel cannot take
        raises (``decode_sparse: kernel`` named) under a pinned ``kernel``, and takes the gathered
        path under ``auto``."""
        if reason is None:
            from elasticfw.kernels.decode_attention import decode_attention

            if not selections or len(selections) != len(layouts):
                raise ValueError("executor 'split': decode_kernel needs the layouts' row selections with reason None")
            out, lse = decode_attention(
                q, k, v, selections[0], seq, scale=scale,
                second=selections[1] if len(selections) > 1 else None, second_heads=second_heads, checked=True,
            )
            return AttentionOutput(out, lse if need_lse else None)
        if self.config.decode_sparse == "kernel":
            raise BackendUnavailableError(
                f"executor 'split': decode_sparse 'kernel' cannot run this decode step: {reason} (set "
                "elastic.executor.decode_sparse to 'auto' or 'gathered')"
            )
        if second_heads is None:
            return self.gathered(q, k, v, layouts[0], seq, scale=scale, need_lse=need_lse)
        combined = routed_layout(second_heads, (layouts[0], layouts[1]), seq)
        return self.gathered(q, k, v, combined, seq, scale=scale, need_lse=need_lse)

    def gathered(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BlockLayout,
        seq: SeqInfo,
        *,
        scale: float,
        need_lse: bool,
    ) -> AttentionOutput:
        """Exact attention over ``layout``, computing per query chunk only the key blocks it uses
        (:func:`elasticfw_plugins.executors.gathered.gathered_attention`)."""
        return gathered_attention(q, k, v, layout, seq, scale=scale, need_lse=need_lse,
                                  query_chunk=self.config.query_chunk, buffer=self._mask_buffer,
                                  gather_buffers=self._gather_buffers)
