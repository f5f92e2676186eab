"""The split executor's gathered path: exact attention over a block layout with SDPA, over only the
key blocks the queries use (the CPU's sparse path).

Four forms, each where it costs least: **chunks** (the general one: per chunk of query rows, the
key blocks any row computes, gathered, under an exact additive mask), **block rows**
(:func:`block_rows_attention`: each query block over exactly its own key blocks, taken where the
chunks would compute more than :data:`BLOCK_ROWS_COST` times its tiles), **one row**
(:func:`one_row_attention`: a decode step reading at least half the blocks, two matmuls over every
key) and **shared decode** (one block pattern for every head and sample: the selected keys, one
unmasked call). At inference the float mask is written into one reused buffer
(:class:`MaskBuffer`). How the mask is built, the thresholds and their CPU measurements:
``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from elasticfw.attention.layout import BlockLayout, block_grid, expand_heads
from elasticfw.attention.mode import AttentionOutput
from elasticfw.attention.seq import SeqInfo

__all__ = [
    "BLOCK_ROWS_CALL_BYTES",
    "BLOCK_ROWS_COST",
    "MASKED_DECODE_PAIRS",
    "MaskBuffer",
    "block_rows_attention",
    "causal_block_flags",
    "chunked_and_exact_tiles",
    "decode_dropped_keys",
    "decode_key_bias",
    "gather_keys",
    "gathered_attention",
    "one_row_attention",
]

#: A routed decode step runs as one masked SDPA call over every head and key
#: (:func:`decode_key_bias`) while that call attends at most this many (sample, query head, key)
#: pairs the sparse heads' layout drops; above, as two calls (the dense heads, then the sparse
#: ones over their own keys). On the 2-core CPU machine at the default model's shape (9 / 3 heads,
#: head dim 64, 6 sparse heads, streaming sink 64 / window 256; ``scripts/cpu_routed_decode_timing.py``,
#: ``results/bench/routed-decode-masked-call/cpu_routed_decode.json``): batch 1 at 1,441 keys (6,726 pairs)
#: 0.21 ms against 0.32 for the two calls (dense 0.13); the two calls slightly ahead at 4,097 keys
#: (22,662 pairs: 0.44 against 0.41) and at batch 4 and 1,441 keys (26,904: 0.58 against 0.56),
#: clearly beyond (batch 1 at 8,193 keys: 0.85 against 0.55). (Those pair counts took the last,
#: partial block whole; counted exactly, :func:`decode_dropped_keys`, they are up to 63 keys per
#: head higher, the same side of the bound.)
MASKED_DECODE_PAIRS = 16_384


def gather_keys(
    k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, bs: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the (ascending) key blocks ``ids``: views when they are one run of
    consecutive blocks (every key included), else one concatenation of slices, one per run."""
    blocks = [int(i) for i in ids.tolist()]
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b * bs:
            runs[-1] = (runs[-1][0], min((b + 1) * bs, capacity))
        else:
            runs.append((b * bs, min((b + 1) * bs, capacity)))
    if len(runs) == 1:
        a, z = runs[0]
        return k[:, :, a:z], v[:, :, a:z]
    return torch.cat([k[:, :, a:z] for a, z in runs], 2), torch.cat([v[:, :, a:z] for a, z in runs], 2)


def decode_dropped_keys(layout: BlockLayout, kv_capacity: int) -> int | None:
    """The most keys one head of ``layout`` drops from a host-dense decode step's one row (its query
    at the last position: every key causal, no key padding) over ``kv_capacity`` keys, counting the
    last block only up to the capacity; ``None`` when no additive mask stands for the layout
    (:func:`decode_key_bias`: a token mask, more than one row, or a head's row keeping no key). Reads
    one number from the layout's device; builds no mask."""
    blocks = layout.blocks
    if layout.token_mask is not None or blocks.shape[2] != 1:
        return None
    bs = layout.block_size
    keep = blocks[:, :, 0, : -(-kv_capacity // bs)]
    kept = keep.sum(-1) * bs - keep[..., -1] * (keep.shape[-1] * bs - kv_capacity)  # the last block's real keys
    least = int(kept.min())
    return None if least == 0 else kv_capacity - least


def decode_key_bias(layout: BlockLayout, kv_capacity: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask (0 kept, ``-inf`` dropped; ``layout``'s heads, (B or 1, H, 1,
    ``kv_capacity``) in ``dtype``) of a host-dense decode step's one row under ``layout``'s blocks;
    ``None`` where :func:`decode_dropped_keys` is (a softmax over no key: the other paths give such
    a row zeros). Ask :func:`decode_dropped_keys` first: this builds the whole mask."""
    if decode_dropped_keys(layout, kv_capacity) is None:
        return None
    keep = layout.blocks[:, :, :, : -(-kv_capacity // layout.block_size)]
    bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))
    return bias.repeat_interleave(layout.block_size, dim=-1)[..., :kv_capacity]


class MaskBuffer:
    """One tensor that inference calls write their additive masks (or, for the block rows, their
    gathered keys or values) into, grown as needed, so that no call allocates (and, on a CPU,
    page-faults) one of its own."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, reuse: bool) -> torch.Tensor:
        """An uninitialised tensor of ``shape``: a view of the buffer with ``reuse``, else a new one."""
        if not reuse:
            return torch.empty(shape, dtype=dtype, device=device)
        numel = math.prod(shape)
        buf = self._buffer
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffer = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


#: the block-rows form's cost per computed tile, in units of the chunks': its K/V gather copies
#: every key block once per query block computing it (calibrated on the 2-core CPU machine, module
#: docstring)
BLOCK_ROWS_COST = 1.6

#: bytes of gathered keys and values one block-rows SDPA call may hold (larger groups are split):
#: on the 2-core CPU machine 4 MiB ran an XAttention layer in 72-80 ms, 16-32 MiB in 80-117 (each
#: call's gathered tensors then come from fresh pages)
BLOCK_ROWS_CALL_BYTES = 4 << 20


def causal_block_flags(lay: BlockLayout, seq: SeqInfo) -> torch.Tensor:
    """(B, H or 1, NQB, NKB) bool: the layout's blocks holding a causal pair for some query of the
    row (key block ``<=`` the row's position block ``q_block_start + t``)."""
    q_blocks, k_blocks = block_grid(seq, lay.block_size)
    return lay.blocks & (k_blocks <= q_blocks)[:, None]


def chunked_and_exact_tiles(flags: torch.Tensor, rows_per_chunk: int, batch: int, heads: int) -> tuple[int, int]:
    """(tiles the chunked path computes, tiles the layout computes) for :func:`causal_block_flags`
    ``flags``: per chunk of ``rows_per_chunk`` query blocks the chunked path computes every key
    block that any sample or head of the chunk uses, for all of them."""
    exact = int(flags.sum()) * (batch // flags.shape[0]) * (heads // flags.shape[1])
    nqb = flags.shape[2]
    used = flags.any(1).any(0)  # (NQB, NKB)
    union = sum(
        int(used[t : t + rows_per_chunk].any(0).sum()) * min(rows_per_chunk, nqb - t)
        for t in range(0, nqb, rows_per_chunk)
    )
    return union * batch * heads, exact


def block_rows_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flags: torch.Tensor, seq: SeqInfo, *, block_size: int,
    scale: float, buffers: tuple[MaskBuffer, MaskBuffer] | None = None,
) -> torch.Tensor:
    """Exact attention of queries starting on the block grid (every ``q_start`` a multiple of
    ``block_size``) over a block layout: every (sample, head, query block) over exactly the key
    blocks it computes, ``flags`` (B or 1, Hq or 1, NQB, NKB) from :func:`causal_block_flags`.

    The query blocks computing the same number of key blocks form one SDPA call (split to hold at
    most :data:`BLOCK_ROWS_CALL_BYTES` of keys and values): their key blocks gathered in ascending
    order, so that a query block's diagonal block (its own position block), when it computes it,
    is its last one, and one causal mask over that last block serves the whole call; a call of
    query blocks without their diagonal needs no mask. A query block computing no key block gives
    zeros, as the chunked path does for rows seeing no key. Query rows past ``q_len`` and keys past
    the capacity are zero padding, masked by causality wherever a real row could reach them.
    ``buffers``: two buffers the calls gather keys and values into (kept by the caller), else new
    tensors per call (on a CPU the allocator then maps fresh pages for each: up to 40% slower)."""
    batch, hq, sq, dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    bs = block_size
    nqb, nkb = flags.shape[2], flags.shape[3]
    dev = q.device
    pad_q, pad_k = nqb * bs - sq, nkb * bs - k.shape[2]
    q_tiles = (F.pad(q, (0, 0, 0, pad_q)) if pad_q else q).reshape(batch * hq * nqb, bs, dim)
    k_tiles = (F.pad(k, (0, 0, 0, pad_k)) if pad_k else k).reshape(batch * hkv * nkb, bs * dim)
    v_tiles = (F.pad(v, (0, 0, 0, pad_k)) if pad_k else v).reshape(batch * hkv * nkb, bs * dim)
    flat = flags.expand(batch, hq, nqb, nkb).reshape(-1, nkb)
    counts = flat.sum(-1)  # (R,) key blocks of each (sample, head, query block)
    row = torch.arange(flat.shape[0], device=dev)
    t = row % nqb
    b, h = row // (hq * nqb), (row // nqb) % hq
    kv_first = (b * hkv + h // group) * nkb  # the row's first key tile in k_tiles
    diagonal = seq.q_block_start(bs)[b] + t
    out = q_tiles.new_empty(q_tiles.shape)
    tril = torch.ones(bs, bs, dtype=torch.bool, device=dev).triu(1)
    for n_blocks, n_rows in enumerate(torch.bincount(counts, minlength=nkb + 1).tolist()):
        if n_rows == 0:
            continue
        rows = (counts == n_blocks).nonzero().flatten()
        if n_blocks == 0:
            out.index_fill_(0, rows, 0.0)
            continue
        ids = flat.index_select(0, rows).nonzero()[:, 1].view(-1, n_blocks)  # ascending per row
        with_diagonal = ids[:, -1] == diagonal.index_select(0, rows)
        per_call = max(1, BLOCK_ROWS_CALL_BYTES // (2 * n_blocks * bs * dim * q.element_size()))
        mask = torch.zeros(bs, n_blocks * bs, dtype=q.dtype, device=dev)
        mask[:, -bs:].masked_fill_(tril, -math.inf)
        for side in (with_diagonal, ~with_diagonal):
            part_rows, part_ids = rows[side], ids[side]
            for a in range(0, part_rows.shape[0], per_call):
                r, i = part_rows[a : a + per_call], part_ids[a : a + per_call]
                tiles = (kv_first.index_select(0, r)[:, None] + i).flatten()
                kc, vc = (
                    torch.index_select(
                        src, 0, tiles,
                        out=held.take((tiles.shape[0], bs * dim), q.dtype, dev, True) if held is not None else None,
                    ).view(r.shape[0], 1, n_blocks * bs, dim)
                    for src, held in zip((k_tiles, v_tiles), buffers or (None, None), strict=True)
                )
                qc = q_tiles.index_select(0, r).view(r.shape[0], 1, bs, dim)
                o = F.scaled_dot_product_attention(
                    qc, kc, vc, attn_mask=mask if side is with_diagonal else None, scale=scale
                )
                out.index_copy_(0, r, o.view(r.shape[0], bs, dim))
    return out.view(batch, hq, nqb * bs, dim)[:, :, :sq]


def one_row_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: BlockLayout, seq: SeqInfo, *, scale: float,
    need_lse: bool,
) -> AttentionOutput:
    """Exact attention of one query row per sample (a decode step) over a block layout without
    token mask, by two matmuls over every key: each KV head's query heads against its keys at once
    (no K/V copy), the pairs the layout does not compute masked at block level, then causality and
    key padding (none to mask for a host-dense step: its query is the last key), the softmax
    between. A row seeing no key gives 0 (log-sum-exp ``-inf``). Half-precision inputs are computed
    in float32."""
    batch, hq, _, dim = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group, bs = hq // hkv, lay.block_size
    dtype = q.dtype
    if dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q.reshape(batch, hkv, group, dim), k.transpose(-1, -2)).mul_(scale)  # (B, Hkv, g, Sk)
    flags = lay.blocks[:, :, :1].expand(batch, hq, 1, lay.blocks.shape[-1]).reshape(batch, hkv, group, -1)
    whole = sk // bs  # blocks of bs keys, then a last partial one
    scores[..., : whole * bs].view(batch, hkv, group, whole, bs).masked_fill_(~flags[..., :whole, None], -math.inf)
    if whole * bs < sk:
        scores[..., whole * bs :].masked_fill_(~flags[..., whole : whole + 1], -math.inf)
    if seq.host_signature() is None:  # keys after the row's position or past kv_len
        reach = torch.minimum(seq.q_start, seq.kv_len - 1)[:, None, None, None]
        scores.masked_fill_(torch.arange(sk, device=q.device) > reach, -math.inf)
    lse = torch.logsumexp(scores, -1) if need_lse else None  # (B, Hkv, g)
    probs = torch.softmax(scores, -1).nan_to_num_(0.0)  # a row seeing no key: NaN -> 0
    out = torch.matmul(probs, v).view(batch, hq, 1, dim).to(dtype)
    return AttentionOutput(out, lse.view(batch, hq, 1) if lse is not None else None)


def _decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: BlockLayout, seq: SeqInfo, *, scale: float,
    need_lse: bool,
) -> AttentionOutput | None:
    """A decode step's forms without a mask tensor (module docstring), or ``None`` for the chunks:
    *one row* when the step reads at least half the key blocks (over every head and sample, as the
    chunks would gather them); *shared decode* when a host-dense step's blocks are one pattern for
    every head and sample."""
    row = lay.blocks[:, :, 0]  # (B or 1, 1 or H, NKB): the step's flags
    used = row.any(1).any(0)  # (NKB,)
    if 2 * int(used.sum()) >= row.shape[-1]:
        return one_row_attention(q, k, v, lay, seq, scale=scale, need_lse=need_lse)
    if lay.num_heads == 1 and not need_lse and seq.host_signature() is not None and bool((row == row[:1]).all()):
        # its query is the last key (every key causal): the blocks' keys, one unmasked SDPA call
        ids = used.nonzero().flatten()
        if ids.numel() == 0:
            return AttentionOutput(torch.zeros_like(q), None)
        kc, vc = gather_keys(k, v, ids, lay.block_size, seq.kv_capacity)
        return AttentionOutput(F.scaled_dot_product_attention(q, kc, vc, scale=scale, enable_gqa=True), None)
    return None


def gathered_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    seq: SeqInfo,
    *,
    scale: float,
    need_lse: bool,
    query_chunk: int,
    buffer: MaskBuffer,
    gather_buffers: tuple[MaskBuffer, MaskBuffer] | None = None,
) -> AttentionOutput:
    """Exact attention over ``layout``, per chunk of ``query_chunk`` rows only over the key blocks it
    uses (module docstring); ``q`` (B, Hq, Sq, D), ``k`` / ``v`` (B, Hkv, Sk, D)."""
    batch, hq, sq, dim = q.shape
    group = hq // k.shape[1]
    bs = layout.block_size
    dev = q.device
    lay = expand_heads(layout, hq)  # 1 or Hq heads; a per-KV-head token mask sees query heads // group
    # inference: one float mask buffer for every chunk (nothing keeps a chunk's mask after its call)
    reuse = not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
    if sq == 1 and lay.token_mask is None and reuse:
        step = _decode_step(q, k, v, lay, seq, scale=scale, need_lse=need_lse)
        if step is not None:
            return step
    heads = lay.num_heads
    nqb, nkb = lay.blocks.shape[2], lay.blocks.shape[3]
    # one mask for the whole batch when it cannot differ between samples (a 1-sample layout
    # without token mask and one query start: a plain prefill), else one per sample
    shared = lay.blocks.shape[0] == 1 and lay.token_mask is None and bool((seq.q_start == seq.q_start[0]).all())
    mask_batch = 1 if shared else batch
    blocks = lay.blocks.expand(mask_batch, heads, nqb, nkb)
    q_start = seq.q_start[:mask_batch]
    q_block0 = seq.q_block_start(bs)[:mask_batch]
    b_idx = torch.arange(batch, device=dev)[:, None, None, None]
    h_idx = torch.arange(heads, device=dev)[None, :, None, None]
    offsets = torch.arange(bs, device=dev)
    if lay.token_mask is None and not need_lse and reuse and sq > 1 and bool((seq.q_start % bs == 0).all()):
        flags = causal_block_flags(lay, seq)
        chunked, exact = chunked_and_exact_tiles(flags, -(-query_chunk // bs), batch, hq)
        if exact * BLOCK_ROWS_COST < chunked:
            out = block_rows_attention(q, k, v, flags, seq, block_size=bs, scale=scale, buffers=gather_buffers)
            return AttentionOutput(out, None)
    ninf = torch.full((), -math.inf, dtype=q.dtype, device=dev)
    zero = torch.zeros((), dtype=q.dtype, device=dev)
    outs, lses = [], []
    for start in range(0, sq, query_chunk):
        rows = torch.arange(start, min(sq, start + query_chunk), device=dev)
        n_rows = rows.shape[0]
        pos = q_start[:, None] + rows[None, :]  # (B or 1, R)
        t = (torch.div(pos, bs, rounding_mode="floor") - q_block0[:, None]).clamp(0, nqb - 1)
        row_blocks = blocks.gather(2, t[:, None, :, None].expand(mask_batch, heads, n_rows, nkb))
        used = row_blocks.any(2).any(1).any(0)  # (NKB,) key blocks any row of the chunk computes
        used &= torch.arange(nkb, device=dev) * bs <= int(pos.max())  # no block past the last position
        ids = used.nonzero().flatten()
        qc = q[:, :, start : start + n_rows]
        if ids.numel() == 0:
            outs.append(torch.zeros_like(qc))
            if need_lse:
                lses.append(torch.full(qc.shape[:3], -math.inf, device=dev))
            continue
        kc, vc = gather_keys(k, v, ids, bs, seq.kv_capacity)
        n_keys, n_blocks = kc.shape[2], ids.numel()
        flags = row_blocks[..., ids]  # (B or 1, H, R, U): the rows' flags over the gathered blocks
        mask5 = buffer.take((mask_batch, heads, n_rows, n_blocks, bs), q.dtype, dev, reuse)
        torch.where(flags[..., None].expand(mask5.shape), zero, ninf, out=mask5)
        # causality, on the blocks that may hold a key after some row of the chunk (ids ascend)
        late = int(torch.searchsorted(ids * bs + bs - 1, pos.min().reshape(1), right=True)[0])
        if late < n_blocks:
            cols = ids[late:, None] * bs + offsets  # (U', bs)
            mask5[:, :, :, late:].masked_fill_(cols > pos[:, None, :, None, None], -math.inf)
        mask = mask5.view(mask_batch, heads, n_rows, n_blocks * bs)[..., :n_keys]  # a last block may be short
        if lay.token_mask is not None:
            cols = (ids[:, None] * bs + offsets).flatten()[:n_keys]
            seen = lay.token_mask(b_idx, h_idx, pos[:, None, :, None], cols[None, None, None, :])
            mask.masked_fill_(~seen, -math.inf)
            empty = mask.eq(-math.inf).all(-1)  # (B, H, R) rows that see no key
        else:  # a row sees a key of a block it selects iff the block's first key is causal for it
            empty = ~(flags & (ids * bs <= pos[:, None, :, None])).any(-1)
        has_empty = bool(empty.any())
        if has_empty:  # give SDPA one key, zero the result
            mask[..., 0].masked_fill_(empty, 0.0)
        if n_keys < n_blocks * bs:
            mask = mask.contiguous()
        out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(out.masked_fill(empty[..., None], 0.0) if has_empty else out)
        if need_lse:
            scores = torch.matmul(qc.float(), kc.float().repeat_interleave(group, 1).transpose(-1, -2)) * scale
            lses.append(torch.logsumexp(scores + mask.float(), -1).masked_fill(empty, -math.inf))
    if not outs:
        return AttentionOutput(torch.zeros_like(q), torch.zeros(q.shape[:3], device=dev) if need_lse else None)
    if len(outs) == 1:  # one chunk (a decode step): no copy
        return AttentionOutput(outs[0], lses[0] if need_lse else None)
    return AttentionOutput(torch.cat(outs, 2), torch.cat(lses, 2) if need_lse else None)
