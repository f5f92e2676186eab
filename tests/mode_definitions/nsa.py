"""NSA-like (training-free), token level, written from NSA (arXiv 2502.11089) §3.3 the slow way.

For query position p of sample b and KV head g, the tile T = p // block_size. Every real query
row r of tile T (its position p_r < kv_len) and every query head of group g scores the mean-pooled
compressed keys c_m = mean(k[m*s : m*s + kernel]) whose window ends at or before p_r
(m*s + kernel <= p_r + 1) with softmax(q . c_m / sqrt(d)); window m credits block n with
prob * (tokens shared by the window and block n) / s. Block importance = sum over the rows and
heads. Tile T keeps blocks n <= T with n < init or n > T - local, then the most important other
causal blocks (ties: lower n) up to top_n in all. Key j is visible to p iff j <= p and
(block(j) is kept or j > p - window). The compression branch is not part of the layout.
"""

import math

import torch

from mode_definitions.common import causal


def _compressed_keys(k, b, g, kv_len, config):
    """[(m, mean of the window's keys)] for every complete window inside the sample, by hand."""
    kernel, s = config.compress_kernel, config.compress_stride
    out = []
    m = 0
    while m * s + kernel <= kv_len:
        out.append((m, k[b, g, m * s : m * s + kernel].double().mean(0)))
        m += 1
    return out


def _kept_blocks(q, compressed, b, g, group, tile, rows, seq, config, scale):
    bs, kernel, s = config.block_size, config.compress_kernel, config.compress_stride
    nkb = (seq.kv_capacity + bs - 1) // bs
    importance = [0.0] * nkb
    for r in rows:
        pos = int(seq.q_start[b]) + r
        valid = [(m, c) for m, c in compressed if m * s + kernel <= pos + 1]
        if not valid:
            continue
        keys = torch.stack([c for _, c in valid])
        for head in range(g * group, (g + 1) * group):
            logits = keys @ q[b, head, r].double() * scale
            probs = torch.softmax(logits, 0).tolist()
            for (m, _), p in zip(valid, probs):
                for n in range(m * s // bs, min(nkb, (m * s + kernel - 1) // bs + 1)):
                    overlap = min(m * s + kernel, (n + 1) * bs) - max(m * s, n * bs)
                    if overlap > 0:
                        importance[n] += p * overlap / s
    causal_blocks = list(range(tile + 1))
    forced = [n for n in causal_blocks if n < config.init_blocks or n > tile - config.local_blocks]
    others = sorted((n for n in causal_blocks if n not in forced), key=lambda n: (-importance[n], n))
    return set(forced) | set(others[: config.top_n - len(forced)])


def token_reference(q, k, seq, config, scale=None):
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    batch, hq, sq, _ = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    bs = config.block_size
    mask = torch.zeros(batch, hq, sq, seq.kv_capacity, dtype=torch.bool)
    key_idx = torch.arange(seq.kv_capacity)
    for b in range(batch):
        kv_len = int(seq.kv_len[b])
        positions = [int(seq.q_start[b]) + r for r in range(sq)]
        tiles: dict[int, list[int]] = {}
        for r, pos in enumerate(positions):
            tiles.setdefault(pos // bs, []).append(r)
        for g in range(hkv):
            compressed = _compressed_keys(k, b, g, kv_len, config)
            for tile, tile_rows in tiles.items():
                real = [r for r in tile_rows if positions[r] < kv_len]
                kept = _kept_blocks(q, compressed, b, g, group, tile, real, seq, config, scale)
                in_kept = torch.tensor([int(j) // bs in kept for j in key_idx])
                for r in tile_rows:
                    visible = in_kept | (key_idx > positions[r] - config.window)
                    mask[b, g * group : (g + 1) * group, r] = visible
    return mask & causal(seq, hq)


DEFINITION = dict(
    small_config={
        "block_size": 16,
        "top_n": 5,
        "window": 24,
        "compress_kernel": 8,
        "compress_stride": 4,
        "init_blocks": 1,
        "local_blocks": 2,
    },
    dense_config={"block_size": 16, "top_n": 100000, "window": 0, "compress_kernel": 8, "compress_stride": 4},
    token_causal=False,
    token_reference=token_reference,
)
