"""The ``mlp`` router's inference decision as one Triton kernel (one launch per layer).

:func:`fused_decide` computes what the eager inference path of
:meth:`elasticfw_plugins.routers.mlp.MLPRouter.decide` computes (about eleven small operations per
layer, whose cost is their dispatch) in one launch: boundary pooling of the keys through their
strides (the eager fast path: no padding, Sk >= 2 x pool_tokens; :func:`fused_mlp` takes pooled
vectors instead), both MLPs as float32 multiply-adds rounded as the eager path rounds with 16-bit
weights, the logits, P(sparse) and the hard decision (``torch.round``: a tie goes to the retrieval
mode). One program per (sample, KV head); no autograd (training runs the eager path). Import this
module only once :func:`elasticfw.kernels.triton_unavailable` has returned ``None``;
:func:`unsupported` says why the kernel cannot run. The numerics in detail:
``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from elasticfw.errors import UnsupportedInputError
from elasticfw.kernels import next_pow2, triton_unavailable

__all__ = ["fused_decide", "fused_mlp", "unsupported"]

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KEY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 1024  # one row of d' floats per thread block, weight tiles of at least 8 x d'
TILE = 8192  # elements of one weight or key tile (BLOCK_H x BLOCK_D), 32 per thread at 8 warps
NUM_WARPS = 8


@triton.jit
def _round(x, dtype: tl.constexpr, ROUND: tl.constexpr):
    # the eager path's intermediate tensors are in the weights' dtype
    if ROUND:
        x = x.to(dtype).to(tl.float32)
    return x


@triton.jit
def _silu(x, dtype: tl.constexpr, ROUND: tl.constexpr):
    return _round(x * tl.sigmoid(x), dtype, ROUND)


@triton.jit
def _mlp(x, w_in, b_in, w_out, b_out, offs_d, dmask,
         DIM: tl.constexpr, HID: tl.constexpr, BLOCK_H: tl.constexpr, ROUND: tl.constexpr):
    """linear(silu(linear(x, w_in, b_in)), w_out, b_out) for one (BLOCK_D,) float32 row."""
    wdt = w_in.dtype.element_ty
    acc = tl.zeros_like(x)
    for start in range(0, HID, BLOCK_H):
        offs_h = start + tl.arange(0, BLOCK_H)
        hmask = offs_h < HID
        wmask = hmask[:, None] & dmask[None, :]
        # both tiles of this chunk as (BLOCK_H, BLOCK_D): w_in is (HID, DIM), tile[j, i] =
        # w_in[start + j, i]; w_out is (DIM, HID), tile[j, i] = w_out[i, start + j]
        w1 = tl.load(w_in + offs_h[:, None] * DIM + offs_d[None, :], mask=wmask, other=0.0)
        w2 = tl.load(w_out + offs_d[None, :] * HID + offs_h[:, None], mask=wmask, other=0.0)
        b1 = tl.load(b_in + offs_h, mask=hmask, other=0.0)
        h = tl.sum(w1.to(tl.float32) * x[None, :], axis=1)
        h = _silu(_round(h + b1.to(tl.float32), wdt, ROUND), wdt, ROUND)  # masked units: silu(0) = 0
        acc += tl.sum(w2.to(tl.float32) * h[:, None], axis=0)
    return _round(acc + tl.load(b_out + offs_d, mask=dmask, other=0.0).to(tl.float32), wdt, ROUND)


@triton.jit
def mlp_router_kernel(
    src, sk, s_b, s_h, s_s, s_d, heads,
    t1w, t1b, t2w, t2b, r1w, r1b, r2w, r2b, r3w, r3b,
    hard_out, prob_out, logits_out,
    DIM: tl.constexpr, HID: tl.constexpr, POOL: tl.constexpr, FROM_KEYS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, ROUND: tl.constexpr,
):
    row = tl.program_id(0)  # b * heads + h
    b = (row // heads).to(tl.int64)
    h = (row % heads).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < DIM
    base = src + b * s_b + h * s_h
    if FROM_KEYS:
        # the first POOL and the last POOL tokens: pooled index j < POOL is token j, else token
        # sk - 2 POOL + j; float32 sum, then one division by 2 POOL (the eager reduction)
        acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
        for start in range(0, 2 * POOL, BLOCK_T):
            j = start + tl.arange(0, BLOCK_T)
            tok = tl.where(j < POOL, j, j + (sk - 2 * POOL)).to(tl.int64)
            mask = (j < 2 * POOL)[:, None] & dmask[None, :]
            tile = tl.load(base + tok[:, None] * s_s + offs_d[None, :] * s_d, mask=mask, other=0.0)
            acc += tile.to(tl.float32)
        x = tl.div_rn(tl.sum(acc, axis=0), 2.0 * POOL)  # IEEE division, as torch's div_
    else:
        x = tl.load(base + offs_d * s_d, mask=dmask, other=0.0).to(tl.float32)
    x = x.to(t1w.dtype.element_ty).to(tl.float32)  # eager: pooled.to(weight dtype)

    t = _mlp(x, t1w, t1b, t2w, t2b, offs_d, dmask, DIM, HID, BLOCK_H, ROUND)
    u = _mlp(t, r1w, r1b, r2w, r2b, offs_d, dmask, DIM, HID, BLOCK_H, ROUND)
    u = _silu(u, t1w.dtype.element_ty, ROUND)
    w_ret = tl.load(r3w + offs_d, mask=dmask, other=0.0).to(tl.float32)
    w_sp = tl.load(r3w + DIM + offs_d, mask=dmask, other=0.0).to(tl.float32)
    z0 = tl.sum(u * w_ret, axis=0) + tl.load(r3b).to(tl.float32)
    z1 = tl.sum(u * w_sp, axis=0) + tl.load(r3b + 1).to(tl.float32)
    z0 = z0.to(logits_out.dtype.element_ty)
    z1 = z1.to(logits_out.dtype.element_ty)
    tl.store(logits_out + 2 * row, z0)
    tl.store(logits_out + 2 * row + 1, z1)
    # softmax of the stored logits, as torch computes it: exp(z - max z), normalised
    z0f = z0.to(tl.float32)
    z1f = z1.to(tl.float32)
    top = tl.maximum(z0f, z1f)
    e0 = tl.exp(z0f - top)
    e1 = tl.exp(z1f - top)
    prob = tl.div_rn(e1, e0 + e1)  # IEEE division: a tie is exactly 0.5
    tl.store(prob_out + row, prob)
    tl.store(hard_out + row, tl.where(prob > 0.5, 1.0, 0.0))  # torch.round: 0.5 -> 0


def unsupported(params: Sequence[torch.Tensor], x: torch.Tensor) -> str | None:
    """``None`` when the fused kernel can take ``x`` (keys or pooled vectors, ``D`` last) and the
    layer's ``params``, else why not (a sentence for an error or to explain a fallback)."""
    reason = triton_unavailable(x.device)
    if reason is not None:
        return reason
    weight = params[0]
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or weight.dtype not in WEIGHT_DTYPES:
        return f"the router weights must share one dtype among {WEIGHT_DTYPES}, got {sorted(map(str, dtypes))}"
    if {p.get_device() for p in params} != {x.get_device()}:  # ints: cheaper than torch.device objects
        return f"the router weights are on {sorted({str(p.device) for p in params})} and the keys on {x.device}"
    if x.dtype not in KEY_DTYPES:
        return f"the keys must be one of {KEY_DTYPES}, got {x.dtype}"
    if not 1 <= x.shape[-1] <= MAX_HEAD_DIM:
        return f"head_dim must be in [1, {MAX_HEAD_DIM}], got {x.shape[-1]}"
    if x.shape[-1] != weight.shape[1]:
        return f"the keys have head_dim {x.shape[-1]}, the router layer expects {weight.shape[1]}"
    return None


#: the launch's compile-time arguments per (head dim, hidden, pool, from keys, weight dtype): built once
_META: dict[tuple[int, int, int, bool, torch.dtype], dict[str, object]] = {}


def _meta(dim: int, hidden: int, pool: int, from_keys: bool, wdtype: torch.dtype) -> dict[str, object]:
    key = (dim, hidden, pool, from_keys, wdtype)
    meta = _META.get(key)
    if meta is None:
        block_d = max(16, next_pow2(dim))
        block = max(8, TILE // block_d)
        meta = _META[key] = dict(DIM=dim, HID=hidden, POOL=pool, FROM_KEYS=from_keys, BLOCK_D=block_d, BLOCK_H=block,
                                 BLOCK_T=block, ROUND=wdtype != torch.float32, num_warps=NUM_WARPS)
    return meta


def _launch(params: Sequence[torch.Tensor], src: torch.Tensor, sk: int, strides: tuple[int, int, int, int],
            pool: int, from_keys: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the router's own host time is most of its cost (a launch per layer): nothing here is recomputed per call
    if not all(map(torch.Tensor.is_contiguous, params)):
        params = [p.contiguous() for p in params]
    batch, heads = src.shape[0], src.shape[1]
    weight, device = params[0], src.device
    decisions = torch.empty((2, batch, heads), device=device, dtype=torch.float32)  # one allocation
    hard, prob = decisions.unbind(0)  # contiguous (B, Hkv) views
    logits = torch.empty((batch, heads, 2), device=device, dtype=weight.dtype)
    if batch * heads == 0:
        return hard, prob, logits
    meta = _meta(src.shape[-1], weight.shape[0], pool, from_keys, weight.dtype)
    launch = mlp_router_kernel[(batch * heads,)]
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):  # Triton launches on the current device
            launch(src, sk, *strides, heads, *params, hard, prob, logits, **meta)
    else:
        launch(src, sk, *strides, heads, *params, hard, prob, logits, **meta)
    return hard, prob, logits


def fused_decide(
    params: Sequence[torch.Tensor], keys: torch.Tensor, pool_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hard, P(sparse), logits) of one layer from its keys (B, Hkv, Sk, D), in one launch.

    ``params``: the layer's ten weights and biases in order (task MLP first, then the router
    MLP; :meth:`elasticfw_plugins.routers.mlp._LayerRouter.kernel_params`). The keys must take
    the pooling fast path: no padding (the caller checks the batch's
    :class:`~elasticfw.attention.seq.SeqInfo`) and Sk >= 2 x pool_tokens. ``hard`` and ``prob``
    are (B, Hkv) float32, ``logits`` (B, Hkv, 2) in the weights' dtype. Check
    :func:`unsupported` first.
    """
    if keys.dim() != 4 or keys.shape[2] < 2 * pool_tokens:
        raise UnsupportedInputError(
            f"fused boundary pooling needs keys (B, Hkv, Sk, D) with Sk >= 2 x pool_tokens = {2 * pool_tokens}, "
            f"got shape {tuple(keys.shape)}"
        )
    s = keys.stride()
    return _launch(params, keys, keys.shape[2], (s[0], s[1], s[2], s[3]), pool_tokens, True)


def fused_mlp(
    params: Sequence[torch.Tensor], pooled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hard, P(sparse), logits) from pooled vectors (B, Hkv, D) (any float dtype; cast to the
    weights' dtype first, as in the eager path), in one launch: the MLPs and the decision."""
    if pooled.dim() != 3:
        raise UnsupportedInputError(f"pooled vectors must be (B, Hkv, D), got shape {tuple(pooled.shape)}")
    s = pooled.stride()
    return _launch(params, pooled, 1, (s[0], s[1], 0, s[2]), 1, False)
