"""FlexAttention executor: one block-sparse launch for all heads of a layer.

Source: PyTorch FlexAttention (He et al., 2024, arXiv 2412.05496). The layout becomes a
``BlockMask`` (``BlockMask.from_kv_blocks``, never an S x S mask) through
:func:`elasticfw.attention.flex_mask.to_block_mask`. ``implementation``: ``compiled``
(``torch.compile(flex_attention)``, forward and backward; ``auto`` on CUDA), ``emulated`` (plain
PyTorch computing exactly what the compiled kernel computes from the same BlockMask,
differentiable anywhere; ``auto`` on CPU) or ``eager`` (PyTorch's O(S^2) reference path). One
compiled function per process; padded lengths are bucketed so that shapes rarely recompile, and
running out of Dynamo's recompile budget raises :class:`~elasticfw.errors.BackendUnavailableError`
instead of falling back silently. The BlockMask tile is 128 where it fits the layout's block size.
The recompilation policy and the kernel block size in detail: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from elasticfw.attention.executor import Executor, ExecutorConfig
from elasticfw.attention.flex_mask import (
    FlexMask,
    bucket_length,
    default_kernel_block_size,
    dense_kernel_mask,
    restrict_heads,
    tile_masks,
    to_block_mask,
)
from elasticfw.attention.layout import BlockLayout
from elasticfw.attention.mode import AttentionOutput
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError, UnsupportedInputError
from elasticfw.kernels import triton_unavailable

#: tile size FlexAttention's default CUDA kernel configurations divide (see module docstring)
CUDA_KERNEL_BLOCK = 128
#: BlockMasks of reusable layouts one executor keeps (least recently used dropped first). A mask
#: restricted to a routing's heads holds its block lists for every query head: at 128K tokens, 32
#: heads and 128-token tiles about 256 MB (two int32 lists of 32 x 1024 x 1024), so a few only
MASK_CACHE_SIZE = 4


class FlexConfig(ExecutorConfig):
    name: Literal["flex"] = "flex"
    implementation: Literal["auto", "compiled", "emulated", "eager"] = Field(
        "auto",
        description="`compiled`: torch.compile'd FlexAttention kernel; `emulated`: plain-PyTorch emulation of "
        "the kernel from the same BlockMask (differentiable anywhere); `eager`: uncompiled flex_attention "
        "(O(S^2) memory, forward only on CPU); `auto`: compiled on CUDA, emulated elsewhere.",
    )
    kernel_block_size: int | None = Field(
        None,
        ge=1,
        description="BlockMask tile size; must divide or be a multiple of the layout's block size. Default: "
        "128 when compatible with the layout's block size, else the layout's.",
    )
    kernel_options: dict[str, int | bool | str] | None = Field(
        None, description="Passed to flex_attention as kernel_options (e.g. BLOCK_M, fwd_num_warps)."
    )
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile mode of the compiled kernel."
    )
    dynamic: bool = Field(False, description="torch.compile(dynamic=...) of the compiled kernel.")
    bucket_steps_per_octave: int = Field(
        8,
        ge=0,
        description="Compiled path: round padded lengths up to this many geometric buckets per power of two "
        "(0: only to a multiple of the kernel block size).",
    )
    recompile_limit: int = Field(
        64, ge=1, description="Dynamo recompile limit while this executor runs; exceeding it is an error."
    )
    sparse_kernel: Literal["flex", "auto", "triton"] = Field(
        "auto",
        description="Layouts the Triton block-sparse kernel takes (elasticfw.kernels.block_sparse_attention: "
        "blocks without a token mask, and row selections such as per-token MoBA; each query tile visits only "
        "the key chunks its rows select): `flex` runs every layout through FlexAttention; `triton` runs those "
        "through the kernel (forward only, an error where it cannot run) and the rest through FlexAttention; "
        "`auto` the kernel on CUDA for calls without autograd (dense causal layouts too: 291.8 ms against "
        "FlexAttention's 350.4 at 128K on an H200), FlexAttention otherwise.",
    )
    row_selection_strategy: Literal["tiles", "gather"] = Field(
        "gather",
        description="How the Triton kernels run per-row selections without a window (per-token MoBA): "
        "`gather` (elasticfw.kernels.gather_attention: per key group, the query rows that chose it, merged by "
        "log-sum-exp; exactly the selected pairs; 58.5 ms against 183.1 for `tiles` on a 128K MoBA layer on "
        "an H200) or `tiles` (the block-sparse kernel: each 128-row tile over the union of its rows' "
        "selections). Selections with a window (NSA) and block layouts always take the block-sparse kernel.",
    )
    gather_merge: Literal["passes", "entries"] = Field(
        "passes",
        description="How `gather` merges a row's key groups: `passes` (one launch per rank of the row's "
        "groups, each merging its partial into float32 accumulators: 4 + 4 bytes per row, head and dimension "
        "read and written per rank) or `entries` (one launch over every entry storing its partial in the "
        "inputs' dtype, as upstream MoBA's per-block outputs, then one merge per row in float32: about half "
        "the memory traffic at top-k 8, about four times the passes' extra memory: 8.7 GB at 128K for 32 heads of "
        "128; not yet timed on a GPU).",
    )
    sparse_kernel_tiles: tuple[int, int, int, int] | None = Field(
        None,
        description="The Triton block-sparse kernel's launch configuration [BLOCK_M, BLOCK_N, num_warps, "
        "num_stages] (BLOCK_M, BLOCK_N powers of two >= 16; BLOCK_N is lowered to divide the key group size); "
        "null: the kernel's choice per layout (elasticfw.kernels.block_sparse_attention.default_tiles: 64 x 64 x 4 x 2 "
        "for groups of 64 keys such as 64-token block layouts, else 128 x 128 x 8 x 3; the gathered path 128 x 128 "
        "x 8 x 3).",
    )
    emulation_query_chunk: int = Field(
        512, ge=1, description="Emulated path: padded query rows processed at once (memory chunk x S)."
    )

    @field_validator("sparse_kernel_tiles")
    @classmethod
    def _tiles(cls, value: tuple[int, int, int, int] | None) -> tuple[int, int, int, int] | None:
        if value is not None:
            bm, bn, warps, stages = value
            for name, x in (("BLOCK_M", bm), ("BLOCK_N", bn)):
                if x < 16 or x & (x - 1):
                    raise ValueError(f"sparse_kernel_tiles: {name} must be a power of two >= 16, got {x}")
            if warps < 1 or stages < 1:
                raise ValueError(f"sparse_kernel_tiles: num_warps and num_stages must be positive, got {warps}, {stages}")
        return value

    def check_layout_block_size(self, block_size: int) -> None:
        kb = self.kernel_block_size
        if kb is not None and kb % block_size and block_size % kb:
            raise ValueError(
                f"executor.kernel_block_size = {kb} must divide or be a multiple of the modes' block_size "
                f"({block_size})"
            )


_COMPILED: dict[tuple[bool, str], Callable[..., Any]] = {}


def _compiled_flex(dynamic: bool, mode: str) -> Callable[..., Any]:
    """The process-wide compiled ``flex_attention`` for (dynamic, mode)."""
    from torch.nn.attention.flex_attention import flex_attention

    key = (dynamic, mode)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(
            flex_attention, dynamic=dynamic, fullgraph=True, mode=None if mode == "default" else mode
        )
    return _COMPILED[key]


def _call_flex(fn: Callable[..., Any], q, k, v, fm: FlexMask, scale: float, kernel_options) -> tuple:
    """Run ``fn`` (flex_attention or its compiled form); returns (out, natural-log lse)."""
    from torch.nn.attention import flex_attention as fa

    kwargs: dict[str, Any] = dict(
        block_mask=fm.block_mask, scale=scale, enable_gqa=True, kernel_options=kernel_options
    )
    if hasattr(fa, "AuxRequest"):
        out, aux = fn(q, k, v, return_aux=fa.AuxRequest(lse=True), **kwargs)
        return out, aux.lse
    return fn(q, k, v, return_lse=True, **kwargs)  # torch < 2.9


def emulate_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fm: FlexMask, scale: float, chunk: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the block-sparse FlexAttention kernel computes on padded q/k/v, in float32 PyTorch.

    GQA without repeating K/V (query heads grouped per KV head). Rows with nothing to attend give
    out 0 and lse -inf, as the kernel does. Returns (out in q.dtype, lse float32).
    """
    batch, hq, rows_total, dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    tiles = tile_masks(fm.block_mask)
    kf = k.float()[:, :, None]  # (B, Hkv, 1, Kp, D)
    vf = v.float()[:, :, None]
    outs, lses = [], []
    for start in range(0, rows_total, chunk):
        rows = slice(start, min(rows_total, start + chunk))
        n = rows.stop - rows.start
        mask = dense_kernel_mask(fm, hq, rows, tiles)  # (B, Hq or 1, n, Kp)
        if mask.shape[1] == 1:
            mask = mask[:, :, None]
        else:
            mask = mask.expand(batch, hq, n, mask.shape[-1]).reshape(batch, hkv, group, n, -1)
        qc = q[:, :, rows].float().reshape(batch, hkv, group, n, dim)
        scores = torch.matmul(qc, kf.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask, -math.inf)
        top = scores.amax(-1, keepdim=True).detach()
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        weights = torch.exp(scores - top)
        total = weights.sum(-1, keepdim=True)
        out = torch.matmul(weights, vf) / total.clamp_min(1.0)  # an empty row's total is exactly 0
        lse = torch.where(total > 0, top + torch.log(total.clamp_min(1.0)), torch.full_like(total, -math.inf))
        outs.append(out.reshape(batch, hq, n, dim))
        lses.append(lse.reshape(batch, hq, n))
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)


class FlexExecutor(Executor):
    """FlexAttention over the layout's BlockMask: compiled kernel on CUDA, exact emulation on CPU."""

    name = "flex"
    config_class = FlexConfig
    config: FlexConfig

    def __init__(self, config: FlexConfig | None = None) -> None:
        super().__init__(config)
        #: what is derived from reusable layouts: key -> (layout, FlexMask or the Triton kernel's WorkPlan),
        #: least recently used first
        self._masks: OrderedDict[tuple, tuple[BlockLayout, Any]] = OrderedDict()

    @classmethod
    def availability(cls) -> str | None:
        try:
            from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
        except ImportError as exc:
            return f"torch.nn.attention.flex_attention is not importable (torch {torch.__version__}): {exc}"
        return None

    # -- decisions -----------------------------------------------------------------------------
    def implementation(self, device: torch.device) -> str:
        """The path ``attend`` takes for tensors on ``device``."""
        impl = self.config.implementation
        if impl == "auto":
            return "compiled" if device.type == "cuda" else "emulated"
        return impl

    def kernel_block_size(self, layout_block_size: int, implementation: str, device: torch.device) -> int:
        """BlockMask tile size for a layout of ``layout_block_size`` (raises if unsupported)."""
        kb = self.config.kernel_block_size
        if kb is None:
            kb = default_kernel_block_size(layout_block_size, CUDA_KERNEL_BLOCK)
        if layout_block_size % kb and kb % layout_block_size:
            raise UnsupportedInputError(
                f"flex executor: kernel_block_size {kb} must divide or be a multiple of the layout's block "
                f"size {layout_block_size}"
            )
        if (
            implementation == "compiled"
            and device.type == "cuda"
            and kb % CUDA_KERNEL_BLOCK
            and not self.config.kernel_options
        ):
            raise UnsupportedInputError(
                f"flex executor: block size {kb} is unsupported by FlexAttention's default CUDA kernel "
                f"configurations (they need multiples of {CUDA_KERNEL_BLOCK}: forward BLOCK_M 128, backward "
                f"BLOCK_N1 128 on Hopper); set flex.kernel_block_size to a multiple of {CUDA_KERNEL_BLOCK} "
                "(layouts are coarsened exactly) or pass flex.kernel_options with tile sizes dividing it "
                "(training also needs flex.compile_mode 'max-autotune-no-cudagraphs')"
            )
        return kb

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
        keep_heads: torch.Tensor | None = None,
        keep_key: tuple | None = None,
    ) -> AttentionOutput:
        """The contract's ``attend``; ``keep_heads`` ((B or 1, Hq) bool, optional) computes only those
        heads (the others' rows are zeros, their log-sum-exp -inf) from the layout's mask converted
        once (:func:`~elasticfw.attention.flex_mask.restrict_heads`).

        The BlockMask of a ``reusable`` layout (:class:`~elasticfw.attention.layout.BlockLayout`)
        over a SeqInfo with a :meth:`~elasticfw.attention.seq.SeqInfo.host_signature` is kept
        (the last :data:`MASK_CACHE_SIZE`) and reused by later calls with the same layout object,
        shapes and ``keep_key``: a hashable host-side description of ``keep_heads`` that the caller
        vouches for (without it, a call with ``keep_heads`` is not cached).

        A layout the Triton block-sparse kernel takes (no token mask, or a
        :class:`~elasticfw.attention.layout.RowSelection`) runs through it instead when
        ``sparse_kernel`` says so."""
        cfg = self.config
        if self._sparse_kernel(q, k, v, layout):
            return self._attend_triton(q, k, v, layout, seq, scale=scale, keep_heads=keep_heads)
        impl = self.implementation(q.device)
        kb = self.kernel_block_size(layout.block_size, impl, q.device)
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if impl == "eager" and needs_grad and q.device.type == "cpu":
            raise UnsupportedInputError(
                "flex executor: FlexAttention has no backward on CPU; use implementation 'emulated' (or 'auto')"
            )
        q_pad = k_pad = None
        if impl == "compiled":
            steps = cfg.bucket_steps_per_octave
            q_pad = bucket_length(seq.num_query_blocks(kb) * kb, kb, steps)
            k_pad = bucket_length(seq.kv_capacity, kb, steps)
        # a reusable layout (the same object for every layer of a forward) is converted once per
        # shape, head selection and backward need; the entry holds the layout, so its id stays its own
        signature = seq.host_signature()
        cache_key = None
        fm: FlexMask | None = None
        if layout.reusable and signature is not None and (keep_heads is None or keep_key is not None):
            cache_key = (id(layout), signature, q.shape[1], kb, q_pad, k_pad, impl, needs_grad, keep_key)
            hit = self._masks.get(cache_key)
            if hit is not None and hit[0] is layout:
                self._masks.move_to_end(cache_key)
                fm = hit[1]
        if fm is None:
            fm = to_block_mask(
                layout,
                seq,
                q.shape[1],
                kernel_block_size=kb,
                q_padded_len=q_pad,
                kv_padded_len=k_pad,
                block_lookup=True if impl == "eager" else None,
                compute_q_blocks=needs_grad and keep_heads is None,
            )
            if keep_heads is not None:
                fm = restrict_heads(fm, keep_heads, compute_q_blocks=needs_grad)
            if cache_key is not None:
                self._masks[cache_key] = (layout, fm)
                while len(self._masks) > MASK_CACHE_SIZE:
                    self._masks.popitem(last=False)
        qp, kp, vp = fm.pad_queries(q), fm.pad_keys(k), fm.pad_keys(v)
        if impl == "emulated":
            out, lse = emulate_flex(qp, kp, vp, fm, scale, cfg.emulation_query_chunk)
        elif impl == "eager":
            from torch.nn.attention.flex_attention import flex_attention

            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
                out, lse = _call_flex(flex_attention, qp, kp, vp, fm, scale, cfg.kernel_options)
        else:
            out, lse = self._run_compiled(qp, kp, vp, fm, scale)
        return AttentionOutput(fm.unpad_rows(out), fm.unpad_rows(lse).float())

    def _attend_triton(
        self, q, k, v, layout: BlockLayout, seq: SeqInfo, *, scale: float, keep_heads: torch.Tensor | None
    ) -> AttentionOutput:
        """The Triton block-sparse kernel over ``layout`` (a decode step, one query row per sample:
        the decode kernel, :mod:`elasticfw.kernels.decode_attention`); a reusable layout's work lists
        are built once per SeqInfo signature and tile shape and kept beside the BlockMasks."""
        from elasticfw.kernels.block_sparse_attention import (
            Tiles,
            block_layout_attention,
            default_tiles,
            layout_selection,
            planned_tiles,
        )
        from elasticfw.kernels.work_lists import plan_work

        cfg = self.config
        if seq.q_len == 1:  # a decode step: the decode kernel, no 128-row query tile, no work lists
            from elasticfw.kernels import decode_attention as dec

            selection = layout_selection(layout)
            if selection is not None and dec.unsupported(q, selection) is None:
                out, lse = dec.decode_attention(q, k, v, selection, seq, scale=scale, keep_heads=keep_heads)
                return AttentionOutput(out, lse)
        pinned = None if cfg.sparse_kernel_tiles is None else Tiles(*cfg.sparse_kernel_tiles)
        if cfg.row_selection_strategy == "gather" and layout.row_selection is not None:
            from elasticfw.kernels import gather_attention

            if gather_attention.unsupported_selection(layout.row_selection) is None:
                out, lse = gather_attention.gathered_selection_attention(
                    q, k, v, layout.row_selection, seq, scale=scale, keep_heads=keep_heads,
                    tiles=gather_attention.DEFAULT_TILES if pinned is None else pinned, merge=cfg.gather_merge,
                )
                return AttentionOutput(out, lse)
        selection = layout_selection(layout)
        assert selection is not None  # _sparse_kernel checked unsupported_layout
        # fitted to the GPU's shared memory before the work is planned for them (head dim 256)
        tiles = planned_tiles(default_tiles(selection) if pinned is None else pinned, q)
        plan = None
        signature = seq.host_signature()
        if layout.reusable and signature is not None:
            key = ("triton", id(layout), signature, tiles)
            hit = self._masks.get(key)
            if hit is not None and hit[0] is layout:
                self._masks.move_to_end(key)
                plan = hit[1]
            else:
                plan = plan_work(selection, seq, tiles)
                self._masks[key] = (layout, plan)
                while len(self._masks) > MASK_CACHE_SIZE:
                    self._masks.popitem(last=False)
        out, lse = block_layout_attention(q, k, v, layout, seq, scale=scale, keep_heads=keep_heads, tiles=tiles,
                                          plan=plan)
        return AttentionOutput(out, lse)

    def _sparse_kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout) -> bool:
        """Whether ``layout`` runs through the Triton block-sparse kernel (``sparse_kernel``)."""
        choice = self.config.sparse_kernel
        if choice == "flex":
            return False
        try:
            from elasticfw.kernels.block_sparse_attention import unsupported, unsupported_layout
        except ImportError as exc:  # triton not installed, or installed but broken
            reason: str | None = triton_unavailable(q.device) or f"the Triton kernel failed to import ({exc})"
        else:
            if unsupported_layout(layout) is not None:
                return False  # a token mask: FlexAttention's, whatever the choice
            recording = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            reason = "it has no backward (autograd is recording)" if recording else unsupported(q)
        if choice == "auto":
            return reason is None and q.device.type == "cuda"
        if reason is not None:
            raise BackendUnavailableError(
                f"flex executor: sparse_kernel = 'triton' cannot run here: {reason} (set "
                "elastic.executor.sparse_kernel, or elastic.executor.flex.sparse_kernel under split, to 'auto' "
                "or 'flex')"
            )
        return True

    def _run_compiled(self, q, k, v, fm: FlexMask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        from torch._dynamo.exc import FailOnRecompileLimitHit

        cfg = self.config
        fn = _compiled_flex(cfg.dynamic, cfg.compile_mode)
        limit = max(int(torch._dynamo.config.recompile_limit), cfg.recompile_limit)
        try:
            with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
                return _call_flex(fn, q, k, v, fm, scale, cfg.kernel_options)
        except FailOnRecompileLimitHit as exc:
            raise BackendUnavailableError(
                f"flex executor: the compiled FlexAttention kernel hit the recompile limit ({limit}) at q "
                f"{tuple(q.shape)}, k {tuple(k.shape)}, {q.dtype}; raise flex.recompile_limit, coarsen "
                "flex.bucket_steps_per_octave, or run TORCH_LOGS=recompiles to see what changes"
            ) from exc
