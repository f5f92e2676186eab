"""Building blocks of data-dependent modes: estimate where attention goes, then select.

A data-dependent mode (XAttention, MoBA, MInference's vertical-slash, ...) *estimates* which keys
matter from ``q`` and ``k``, *selects* key blocks, columns or diagonals from that estimate
(:mod:`elasticfw.attention.selectors`, re-exported here: :func:`topk_select`,
:func:`threshold_select`) and *converts* the selection into a layout
(:mod:`elasticfw.attention.pattern_layouts`). This module holds the estimators: query-head
grouping and tile pooling, the last queries' attention (vertical and slash mass), XAttention's
antidiagonal block mass, NSA's window means and MoBA's gate.

Contract of every estimator: canonical coordinates (:mod:`elasticfw.attention.seq`), float32
whatever the input dtype, causality (key ``j`` reaches position ``p`` iff ``j <= p``) and padding
(keys ``>= kv_len``, padding rows) masked, the call's ``scale`` (``None``: ``head_dim ** -0.5``),
and query head ``h`` reading KV head ``h // (Hq // Hkv)``. The list of functions is in
``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from elasticfw.attention.selectors import threshold_select as threshold_select  # re-exported
from elasticfw.attention.selectors import topk_select as topk_select  # re-exported
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import triton_unavailable

GroupReduce = Literal["sum", "mean", "max"]
TileReduce = Literal["sum", "mean", "max", "any", "all"]
BlockReduce = Literal["sum", "mean", "max"]
EstimateBackend = Literal["torch", "triton"]


def _scale(scale: float | None, head_dim: int) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(head_dim)


def _check_group(num_query_heads: int, num_kv_heads: int, where: str) -> int:
    if num_kv_heads <= 0 or num_query_heads % num_kv_heads:
        raise ValueError(
            f"{where}: {num_query_heads} query heads are not a whole number of GQA groups of "
            f"{num_kv_heads} KV heads (expected query heads = a multiple of KV heads)"
        )
    return num_query_heads // num_kv_heads


# ---------------------------------------------------------------------------------------
# Heads
# ---------------------------------------------------------------------------------------


def reduce_groups(x: torch.Tensor, num_kv_heads: int, reduce: GroupReduce) -> torch.Tensor:
    """(B, Hq, ...) -> (B, Hkv, ...): ``reduce`` over the query heads of each GQA group.

    Query head ``h`` belongs to KV head ``h // (Hq // Hkv)`` (transformers' ``repeat_kv``)."""
    batch, hq = x.shape[:2]
    group = _check_group(hq, num_kv_heads, "reduce_groups")
    grouped = x.view(batch, num_kv_heads, group, *x.shape[2:])
    if reduce == "sum":
        return grouped.sum(2)
    if reduce == "mean":
        return grouped.mean(2)
    if reduce == "max":
        return grouped.amax(2)
    raise ValueError(f"reduce_groups: reduce must be 'sum', 'mean' or 'max', got {reduce!r}")


# ---------------------------------------------------------------------------------------
# Query rows on the layout's tiles
# ---------------------------------------------------------------------------------------


def query_grid(
    x: torch.Tensor, seq: SeqInfo, block_size: int, rows: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay per-query-row values on the layout's tiles.

    ``x`` is (B, H, Sq, ...) (query rows on dim 2: ``q`` itself, per-row scores or selections).
    Returns ``(grid, valid)``: ``grid`` (B, H, R, ...) with ``R = (t1 - t0) * block_size`` for
    layout rows ``rows = (t0, t1)`` (default: all ``seq.num_query_blocks(block_size)``), where grid
    row ``r`` of sample ``b`` is position ``(seq.q_block_start(block_size)[b] + t0) * block_size + r``;
    and ``valid`` (B, R) bool, the grid rows holding a real query of the sample. Grid rows without
    one are zero (``False`` for bool ``x``). The grid may be a view of ``x`` (queries that fill the
    rows, known on the host): read it, do not write it.
    """
    bs = block_size
    t0, t1 = rows if rows is not None else (0, seq.num_query_blocks(bs))
    batch, heads = x.shape[:2]
    rest = x.shape[3:]
    n_rows = (t1 - t0) * bs
    dev = x.device
    if seq.host_signature() is not None and (seq.kv_capacity - seq.q_len) % bs == 0:
        # every sample's queries are the last q_len positions, starting on the tile grid (known on the
        # host): grid row r is query row t0 * bs + r for every sample, a slice (no index gather)
        a = t0 * bs
        z = min(seq.q_len, a + n_rows)
        valid = (torch.arange(n_rows, device=dev) < z - a)[None, :].expand(batch, n_rows)
        if z - a == n_rows:
            return x[:, :, a:z], valid  # no padding row: a view of x
        grid = x.new_zeros(batch, heads, n_rows, *rest)
        grid[:, :, : max(z - a, 0)] = x[:, :, a:z]
        return grid, valid
    pos = (seq.q_block_start(bs)[:, None] + t0) * bs + torch.arange(n_rows, device=dev)[None, :]  # (B, R)
    idx = pos - seq.q_start[:, None]
    valid = (idx >= 0) & (idx < seq.q_len) & (pos < seq.kv_len[:, None])
    if seq.q_len == 0:
        return x.new_zeros(batch, heads, n_rows, *rest), valid
    shape = (batch, heads, n_rows, *rest)
    gather = idx.clamp(0, seq.q_len - 1).view(batch, 1, n_rows, *([1] * len(rest))).expand(shape)
    keep = valid.view(batch, 1, n_rows, *([1] * len(rest)))
    return torch.where(keep, torch.gather(x, 2, gather), torch.zeros((), dtype=x.dtype, device=dev)), valid


def pool_tiles(grid: torch.Tensor, valid: torch.Tensor, block_size: int, reduce: TileReduce) -> torch.Tensor:
    """(B, H, NQB * bs, ...) from :func:`query_grid` -> (B, H, NQB, ...): ``reduce`` over each tile's
    real rows. ``sum``/``mean``/``max`` for numbers (a tile without a real row gives 0 for sum and
    mean, ``-inf`` for max); ``any``/``all`` for bools (a tile without a real row gives ``False``
    for both)."""
    batch, heads, n_rows = grid.shape[:3]
    rest = grid.shape[3:]
    if n_rows % block_size:
        raise ValueError(f"pool_tiles: {n_rows} grid rows are not whole tiles of block_size {block_size}")
    nqb = n_rows // block_size
    keep = valid.view(batch, 1, n_rows, *([1] * len(rest)))
    tiles = (batch, heads, nqb, block_size, *rest)
    occupied = valid.view(batch, nqb, block_size).any(-1).view(batch, 1, nqb, *([1] * len(rest)))
    if reduce in ("any", "all"):
        if grid.dtype != torch.bool:
            raise ValueError(f"pool_tiles: reduce {reduce!r} needs a bool grid, got {grid.dtype}")
        if reduce == "any":
            return (grid & keep).view(tiles).any(3)
        return (grid | ~keep).view(tiles).all(3) & occupied
    zero = torch.zeros((), dtype=grid.dtype, device=grid.device)
    if reduce == "sum":
        return torch.where(keep, grid, zero).view(tiles).sum(3)
    if reduce == "mean":
        counts = valid.to(grid.dtype).view(batch, nqb, block_size).sum(-1).clamp_min(1)
        return torch.where(keep, grid, zero).view(tiles).sum(3) / counts.view(batch, 1, nqb, *([1] * len(rest)))
    if reduce == "max":
        low = torch.full((), -math.inf, dtype=grid.dtype, device=grid.device)
        return torch.where(keep, grid, low).view(tiles).amax(3)
    raise ValueError(f"pool_tiles: reduce must be one of sum, mean, max, any, all; got {reduce!r}")


def pool_blocks(
    x: torch.Tensor, block: tuple[int, int], reduce: BlockReduce, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """(..., R, C) -> (..., ceil(R/r), ceil(C/c)): ``reduce`` over each ``r x c`` cell.

    ``block = (r, c)``. ``valid`` (bool, broadcastable to ``x``) excludes entries: they count as 0
    for ``sum``, are not counted by ``mean`` (the mean of a cell's valid entries, 0 if none) and
    never win ``max`` (``-inf`` if none). Edges that are not whole cells are padded with excluded
    entries. Use it on probabilities (mass per block) or on logits (a block's best score)."""
    r, c = block
    if r <= 0 or c <= 0:
        raise ValueError(f"pool_blocks: block must be two positive sizes, got {block}")
    rows, cols = x.shape[-2], x.shape[-1]
    pad_r, pad_c = -rows % r, -cols % c
    ok = None
    if valid is not None or pad_r or pad_c:
        ok = torch.ones((), dtype=torch.bool, device=x.device) if valid is None else valid
        ok = torch.nn.functional.pad(ok.expand(x.shape), (0, pad_c, 0, pad_r), value=False)
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    cells = (*x.shape[:-2], x.shape[-2] // r, r, x.shape[-1] // c, c)
    if reduce == "max":
        low = torch.full((), -math.inf, dtype=x.dtype, device=x.device)
        return (x if ok is None else torch.where(ok, x, low)).view(cells).amax(dim=(-3, -1))
    if reduce not in ("sum", "mean"):
        raise ValueError(f"pool_blocks: reduce must be 'sum', 'mean' or 'max', got {reduce!r}")
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    total = (x if ok is None else torch.where(ok, x, zero)).view(cells).sum(dim=(-3, -1))
    if reduce == "sum":
        return total
    count = float(r * c) if ok is None else ok.to(x.dtype).view(cells).sum(dim=(-3, -1)).clamp_min(1)
    return total / count


# ---------------------------------------------------------------------------------------
# Last-query estimate (vertical / slash lines)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LastQueries:
    """The attention of each sample's last real queries (:func:`last_query_attention`).

    ``probs`` (B, H, n, Sk) float32: softmax over the causal real keys of each estimating row
    (zero rows where ``valid`` is False); ``positions`` (B, n) int64 their positions (row ``n - 1``
    is the sample's last real query); ``valid`` (B, n) bool: the row holds a real query (a sample
    with fewer than ``n`` real query rows has invalid leading rows).
    """

    probs: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor


def last_query_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    seq: SeqInfo,
    *,
    last: int,
    scale: float | None = None,
    group: GroupReduce | None = "mean",
) -> LastQueries:
    """Attention probabilities of each sample's ``last`` final real query rows over all keys.

    For sample ``b`` the estimating rows are its last ``last`` real query rows (the rows before
    position ``kv_len[b]``, fewer if the call has fewer). Row with position ``p`` puts
    ``softmax_j(scale * q . k_j)`` on keys ``j <= p`` (``j < kv_len[b]`` follows), in float32.
    ``group``: ``None`` keeps one estimate per query head (``H = Hq``), otherwise the query heads
    of a GQA group are reduced (``"mean"``, ``"max"`` or ``"sum"``) into one per KV head
    (``H = Hkv``). Memory: B x Hq x last x Sk floats.
    """
    if last < 1:
        raise ValueError(f"last_query_attention: last must be >= 1 query rows, got {last}")
    batch, hq, sq, dim = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    groups = _check_group(hq, hkv, "last_query_attention")
    dev = q.device
    # real query rows of sample b are [0, n_real[b]); the estimate takes the last `last` of them
    n_real = (seq.kv_len - seq.q_start).clamp(0, sq)  # (B,)
    rows = n_real[:, None] - last + torch.arange(last, device=dev)[None, :]  # (B, n)
    valid = rows >= 0
    rows = rows.clamp_min(0)
    positions = seq.q_start[:, None] + rows
    if sq == 0:
        probs = torch.zeros(batch, hq, last, sk, dtype=torch.float32, device=dev)
    else:
        gather = rows.clamp_max(sq - 1)[:, None, :, None].expand(batch, hq, last, dim)
        qs = torch.gather(q, 2, gather).float().view(batch, hkv, groups, last, dim)
        scores = torch.einsum("bkgnd,bkjd->bkgnj", qs, k.float()).reshape(batch, hq, last, sk)
        scores = scores * _scale(scale, dim)
        keys = torch.arange(sk, device=dev)
        visible = (keys[None, None, :] <= positions[:, :, None]) & (keys[None, None, :] < seq.kv_len[:, None, None])
        visible = visible & valid[:, :, None]
        scores = scores.masked_fill(~visible[:, None], -math.inf)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows seeing no key: all zero
        probs = torch.where(visible[:, None], probs, torch.zeros((), device=dev))
    if group is not None:
        probs = reduce_groups(probs, hkv, group)
    return LastQueries(probs, positions, valid)


def column_mass(est: LastQueries) -> torch.Tensor:
    """(B, H, Sk) float32: the estimate's probability on each key column, summed over its rows
    (MInference's vertical lines)."""
    return est.probs.sum(-2)


def diagonal_mass(est: LastQueries) -> torch.Tensor:
    """(B, H, Sk) float32: the estimate's probability summed along each diagonal: entry ``d`` is
    the mass on pairs (position ``p``, key ``p - d``), ``0 <= d < Sk`` (MInference's slash lines;
    ``d = 0`` is the main diagonal, a query's own key)."""
    batch, heads, n, sk = est.probs.shape
    keys = torch.arange(sk, device=est.probs.device)
    offset = est.positions[:, :, None] - keys[None, None, :]  # (B, n, Sk)
    causal = (offset >= 0)[:, None]
    idx = offset.clamp(0, max(sk - 1, 0))[:, None].expand(batch, heads, n, sk).reshape(batch, heads, n * sk)
    src = torch.where(causal, est.probs, torch.zeros((), device=est.probs.device)).reshape(batch, heads, n * sk)
    out = torch.zeros(batch, heads, sk, dtype=est.probs.dtype, device=est.probs.device)
    return out.scatter_add_(-1, idx, src)


# ---------------------------------------------------------------------------------------
# XAttention's antidiagonal estimate
# ---------------------------------------------------------------------------------------


def antidiagonal_scores(q: torch.Tensor, k: torch.Tensor, stride: int) -> torch.Tensor:
    """Raw antidiagonal sums ``A[m, n] = sum_i q[m*S + i] . k[n*S + S-1-i]`` in float32.

    ``q`` (B, Hq, Rq, D) and ``k`` (B, Hkv, Rk, D) with ``Rq``, ``Rk`` multiples of ``stride`` and
    ``Hq`` a multiple of ``Hkv`` (query head ``h`` reads KV head ``h // (Hq // Hkv)``); returns
    (B, Hq, Rq/S, Rk/S). One matmul: one side reversed within each stride tile (the smaller: the
    keys at a prefill, the queries at a decode step) and both concatenated, so the concatenated dot
    product walks the tile's antidiagonal.
    """
    rq, rk = q.shape[2], k.shape[2]
    if rq % stride or rk % stride:
        raise ValueError(f"antidiagonal_scores: lengths {rq}, {rk} must be multiples of stride {stride}")
    _check_group(q.shape[1], k.shape[1], "antidiagonal_scores")
    if _reverse_queries(q, k.shape[1], rk):
        return _antidiagonal_matmul(_stride_tiles(q, stride, reverse=True), _stride_tiles(k, stride), q.shape[1])
    return _antidiagonal_matmul(_stride_tiles(q, stride), _stride_tiles(k, stride, reverse=True), q.shape[1])


def _reverse_queries(q: torch.Tensor, hkv: int, n_keys: int) -> bool:
    """Whether the queries are the smaller side to reverse (fewer rows x heads than the keys)."""
    return q.shape[1] * q.shape[2] <= hkv * n_keys


def _stride_tiles(x: torch.Tensor, stride: int, *, reverse: bool = False) -> torch.Tensor:
    """(B, H, R, D) -> (B, H, R/S, S*D) float32: each stride tile of rows concatenated, reversed
    within the tile with ``reverse`` (a copy; a view of float32 contiguous rows otherwise)."""
    batch, heads, rows, dim = x.shape
    tiles = x.float().reshape(batch, heads, rows // stride, stride, dim)
    return (tiles.flip(3) if reverse else tiles).reshape(batch, heads, rows // stride, stride * dim)


def _antidiagonal_matmul(q_tiles: torch.Tensor, k_tiles: torch.Tensor, hq: int) -> torch.Tensor:
    """(B, Hq, Rq/S, Rk/S): :func:`_stride_tiles` of the queries (Hq heads) against those of the
    keys (Hkv heads), one side reversed: one matmul per KV head, its query heads stacked."""
    batch, _, mq, width = q_tiles.shape
    hkv = k_tiles.shape[1]
    qr = q_tiles.reshape(batch, hkv, (hq // hkv) * mq, width)
    return torch.matmul(qr, k_tiles.transpose(-1, -2)).view(batch, hq, mq, k_tiles.shape[2])


def _triton_antidiagonal_mass(
    q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, *, block_size: int, stride: int, chunk_size: int,
    scale: float | None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """The ``backend="triton"`` hook: imports the kernels only when asked (Triton is optional)."""
    reason = triton_unavailable(q.device)
    if reason is not None:
        raise BackendUnavailableError(f"antidiagonal estimate: backend 'triton' cannot run here: {reason}")
    from elasticfw.kernels.xattention_estimate import iter_antidiagonal_mass_triton

    return iter_antidiagonal_mass_triton(
        q, k, seq, block_size=block_size, stride=stride, chunk_size=chunk_size, scale=scale
    )


def iter_antidiagonal_mass(
    q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, *, block_size: int, stride: int, chunk_size: int,
    scale: float | None = None, backend: EstimateBackend = "torch",
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(t0, t1, mass)`` for layout rows ``[t0, t1)``: mass (B, Hq, t1-t0, NKB) float32.

    XAttention's estimate (``plugins/modes/xattention.py`` states it in full): queries on the
    position grid (:func:`query_grid`), keys zeroed past ``kv_len``, :func:`antidiagonal_scores`
    scaled by ``scale / stride``, masked causally at strided granularity, soft-maxed over strided
    keys, summed into (block/stride)^2 cells (:func:`pool_blocks`). ``mass[b, h, t, N]`` is the
    probability the real strided rows of position block ``seq.q_block_start(bs)[b] + t`` put on
    key block ``N``; a strided row counts only if it holds a real query. ``chunk_size`` query
    positions are estimated at once (a memory bound; the result does not depend on it).

    ``backend``: ``"torch"`` (this code, the reference) or ``"triton"`` (the fused kernels of
    :mod:`elasticfw.kernels.xattention_estimate`: the same masses up to float32 summation order,
    without the score tile; :class:`~elasticfw.errors.BackendUnavailableError` where they cannot run).
    """
    if backend == "triton":
        yield from _triton_antidiagonal_mass(
            q, k, seq, block_size=block_size, stride=stride, chunk_size=chunk_size, scale=scale
        )
        return
    if backend != "torch":
        raise ValueError(f"iter_antidiagonal_mass: backend must be 'torch' or 'triton', got {backend!r}")
    seq.check(q, k)
    bs, s = block_size, stride
    if s < 1 or bs < 1 or bs % s:
        raise ValueError(f"block_size={bs} must be a positive multiple of stride={s}")
    batch = q.shape[0]
    nqb, nkb = seq.num_query_blocks(bs), seq.num_key_blocks(bs)
    rows_per_chunk = max(1, chunk_size // bs)
    # keys to a whole number of strides (the strided keys past the capacity are after every position:
    # always masked, so the scores get them as padding columns below instead of zero keys here)
    n_cap = -(-seq.kv_capacity // s) * s
    keys = k.float() if n_cap == k.shape[2] else torch.nn.functional.pad(k.float(), (0, 0, 0, n_cap - k.shape[2]))
    if seq.host_signature() is None:  # keys past kv_len may be padding (a host-dense SeqInfo has none)
        key_ok = torch.arange(n_cap, device=k.device)[None, :] < seq.kv_len[:, None]
        keys = torch.where(key_ok[:, None, :, None], keys, torch.zeros((), device=k.device))
    scale = _scale(scale, q.shape[-1]) / s  # the call's scale, over the stride
    if seq.q_len == 1 and batch:  # a decode step: one strided row per sample holds a query
        yield 0, nqb, _one_query_mass(q, keys, seq, block_size=bs, stride=s, scale=scale, num_key_blocks=nkb)
        return
    hq, hkv = q.shape[1], k.shape[1]
    key_tiles: dict[bool, torch.Tensor] = {}  # reversed or not -> the keys' stride tiles, made when first needed
    # queries that are the last q_len positions from the tile grid (known on the host) are read in
    # place, the chunk's missing rows (past q_len) left out of the matmul instead of zero-filled
    in_place = seq.host_signature() is not None and (seq.kv_capacity - seq.q_len) % bs == 0
    qbs = seq.q_block_start(bs)  # (B,)
    dev = q.device
    for t0 in range(0, nqb, rows_per_chunk):
        t1 = min(nqb, t0 + rows_per_chunk)
        n_rows = (t1 - t0) * bs
        short = min(seq.q_len - t0 * bs, n_rows)  # rows of the chunk holding queries, when in place
        if in_place and short % s == 0:
            qc = q[:, :, t0 * bs : t0 * bs + short]
            valid = (torch.arange(n_rows, device=dev) < short)[None, :].expand(batch, n_rows)
        else:
            qc, valid = query_grid(q, seq, bs, (t0, t1))
        # keys beyond the chunk's last causal block are never needed
        kb_end = int(min(nkb, int((qbs + t1).max().item()))) if batch else 0
        kb_end = max(kb_end, 1)
        n_strided = min(kb_end * bs, n_cap) // s
        rev_q = _reverse_queries(qc, hkv, n_strided * s)  # reverse the smaller side
        if (not rev_q) not in key_tiles:
            key_tiles[not rev_q] = _stride_tiles(keys, s, reverse=not rev_q)
        scores = _antidiagonal_matmul(_stride_tiles(qc, s, reverse=rev_q), key_tiles[not rev_q][:, :, :n_strided], hq)
        # rows past q_len (no real row: weight 0 below) and strided keys past the capacity (masked
        # below) as zero padding: (B, Hq, R/S, K/S)
        missing_rows, missing_keys = n_rows // s - scores.shape[2], kb_end * bs // s - n_strided
        if missing_rows or missing_keys:
            scores = torch.nn.functional.pad(scores, (0, missing_keys, 0, missing_rows))
        scores.mul_(scale)
        pos = (qbs[:, None] + t0) * bs + torch.arange(n_rows, device=dev)[None, :]  # (B, R)
        m_abs = pos[:, ::s] // s  # (B, R/S) strided row index
        n_idx = torch.arange(kb_end * bs // s, device=dev)
        future = n_idx[None, None, :] > m_abs[:, :, None]  # (B, R/S, K/S)
        scores.masked_fill_(future[:, None], -math.inf)
        # in-place softmax over strided keys (n = 0 is never masked, so no row is empty)
        scores.sub_(scores.amax(-1, keepdim=True)).exp_()
        scores.div_(scores.sum(-1, keepdim=True))
        row_real = valid.view(batch, n_rows // s, s).any(-1)  # (B, R/S)
        scores.mul_(row_real[:, None, :, None])
        g = bs // s
        mass = pool_blocks(scores, (g, g), "sum")
        del scores
        if kb_end < nkb:
            mass = torch.nn.functional.pad(mass, (0, nkb - kb_end))
        yield t0, t1, mass


def _one_query_mass(
    q: torch.Tensor, keys: torch.Tensor, seq: SeqInfo, *, block_size: int, stride: int, scale: float,
    num_key_blocks: int,
) -> torch.Tensor:
    """(B, Hq, 1, NKB): :func:`iter_antidiagonal_mass` of one query per sample (``q_len == 1``).

    The query at position ``p = m*S + i`` is the only real row of its stride tile ``m``, the other
    tiles of its block hold none: the tile's antidiagonal sum against strided key ``n`` is the dot
    product of the query with key ``n*S + S-1-i`` alone. So one matmul with every strided key's
    partner (``Sk / S`` keys: a strided view when every sample's query is the last key, else a
    gather) replaces the block's query grid. ``keys`` (B, Hkv,
    Sk', D) float32 are the prepared keys (zero past ``kv_len``, ``Sk'`` a whole number of strides)
    and ``scale`` already over the stride."""
    batch, hq, _, dim = q.shape
    hkv, n_strided = keys.shape[1], keys.shape[2] // stride
    dev = q.device
    m, i = seq.q_start // stride, seq.q_start % stride  # (B,) the query's strided row and offset in it
    if seq.host_signature() is not None:  # every query at the last position: one offset, a strided view
        first = stride - 1 - (seq.kv_capacity - 1) % stride
        k_sel = keys[:, :, first::stride][:, :, :n_strided]
    else:
        partner = (torch.arange(n_strided, device=dev) * stride)[None, :] + (stride - 1 - i)[:, None]  # (B, N)
        k_sel = keys.gather(2, partner[:, None, :, None].expand(batch, hkv, n_strided, dim))
    scores = torch.matmul(q.float().reshape(batch, hkv, hq // hkv, dim), k_sel.transpose(-1, -2))
    scores = scores.reshape(batch, hq, n_strided).mul_(scale)
    scores.masked_fill_((torch.arange(n_strided, device=dev)[None, :] > m[:, None])[:, None], -math.inf)
    probs = torch.softmax(scores, -1).mul_((seq.q_start < seq.kv_len)[:, None, None])  # a padding row: 0
    g = block_size // stride
    probs = torch.nn.functional.pad(probs, (0, num_key_blocks * g - n_strided))
    return probs.view(batch, hq, num_key_blocks, g).sum(-1)[:, :, None]


def antidiagonal_mass(
    q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, *, block_size: int, stride: int, chunk_size: int = 16384,
    scale: float | None = None, backend: EstimateBackend = "torch",
) -> torch.Tensor:
    """(B, Hq, NQB, NKB) float32: :func:`iter_antidiagonal_mass` for every layout row at once."""
    parts = [
        m
        for _, _, m in iter_antidiagonal_mass(
            q, k, seq, block_size=block_size, stride=stride, chunk_size=chunk_size, scale=scale, backend=backend
        )
    ]
    if not parts:
        return q.new_zeros(q.shape[0], q.shape[1], 0, seq.num_key_blocks(block_size), dtype=torch.float32)
    return torch.cat(parts, dim=2)


# ---------------------------------------------------------------------------------------
# MoBA's gate: queries against mean-pooled key blocks
# ---------------------------------------------------------------------------------------


def window_means(x: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """(B, H, S, D) -> (B, H, M, D) float32: mean of ``x[m*stride : m*stride + kernel]`` for every
    complete window (``M = (S - kernel) // stride + 1``, 0 when ``S < kernel``): NSA's
    parameter-free compression of keys and values (overlapping windows when ``stride < kernel``)."""
    batch, heads, length, dim = x.shape
    if kernel < 1 or stride < 1:
        raise ValueError(f"window_means: kernel and stride must be positive, got {kernel} and {stride}")
    if length < kernel:
        return x.new_zeros(batch, heads, 0, dim, dtype=torch.float32)
    return x.float().unfold(2, kernel, stride).mean(-1)


def mean_pool_keys(k: torch.Tensor, seq: SeqInfo, block: int) -> torch.Tensor:
    """(B, Hkv, ceil(Sk/block), D) float32: the mean of each key block's real keys (keys
    ``< kv_len``); a block without any is zero."""
    if block <= 0:
        raise ValueError(f"mean_pool_keys: block must be a positive number of keys, got {block}")
    batch, hkv, sk, dim = k.shape
    nb = math.ceil(sk / block)
    pad = nb * block - sk
    valid = seq.key_valid()  # (B, Sk)
    kf = torch.where(valid[:, None, :, None], k.float(), 0.0)
    kf = torch.nn.functional.pad(kf, (0, 0, 0, pad))
    sums = kf.view(batch, hkv, nb, block, dim).sum(3)
    counts = torch.nn.functional.pad(valid.float(), (0, pad)).view(batch, nb, block).sum(-1)
    return sums / counts.clamp_min(1)[:, None, :, None]


def gate_scores(q: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """(B, Hq, R, N) float32 ``q . pooled_n``: each query row (``q`` (B, Hq, R, D), any rows: tokens
    or pooled tiles) against the pooled keys (B, Hkv, N, D) of its KV head."""
    batch, hq, rows, dim = q.shape
    hkv = pooled.shape[1]
    group = _check_group(hq, hkv, "gate_scores")
    grouped = q.float().view(batch, hkv, group, rows, dim)
    return torch.einsum("bkgrd,bknd->bkgrn", grouped, pooled).reshape(batch, hq, rows, -1)
