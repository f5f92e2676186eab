"""XAttention (Xu et al., 2025, arXiv 2503.16428), token-level, written from the description alone.

For each sample and query head, on the position grid (query position p = q_start + row; a grid
position with no real query of the sample, and a key index >= kv_len, contributes nothing):

1. full score matrix Q K^T in float64 (real queries x real keys, zero elsewhere);
2. antidiagonal sum of each S x S tile: A[m, n] = sum_i scores[m*S + i, n*S + S-1-i];
3. scale by 1/(sqrt(d) S), softmax over strided keys n <= m, only for strided rows holding at
   least one real query;
4. mass[M, N] = sum of those probabilities over strided rows of block M and strided keys of
   block N (``kv_group``: summed over the query heads of the KV group);
5. per block M: keep key block 0 and block M; walk the other blocks N < M by descending mass
   (ties: lower N first), keeping a block while the mass kept so far is < threshold * total
   (so the block that crosses the threshold is kept); threshold 1 keeps every causal block;
6. row at position p sees key j iff j <= p and block j // bs was kept for block p // bs.

Plain loops, slow, independent of the plugin's code.
"""

import math

import torch

from mode_definitions.common import causal


def _selected(mass: list[float], row_block: int, threshold: float) -> set[int]:
    keep = {0, row_block}
    if threshold >= 1.0:
        return set(range(row_block + 1))
    total = 0.0
    for n in range(row_block + 1):
        total += mass[n]
    kept = 0.0
    for n in sorted(keep):
        kept += mass[n]
    others = sorted((n for n in range(1, row_block)), key=lambda n: (-mass[n], n))
    for n in others:
        if kept < threshold * total:
            keep.add(n)
            kept += mass[n]
        else:
            break
    return keep


def token_reference(q, k, seq, config, scale=None):
    bs, s, tau = config.block_size, config.stride, config.threshold
    batch, hq, sq, dim = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    if config.decode == "full" and sq == 1:
        return causal(seq, hq)  # a decode step under decode: full is full attention (upstream's dense decode)
    out = torch.zeros(batch, hq, sq, sk, dtype=torch.bool)
    for b in range(batch):
        q_start, kv_len = int(seq.q_start[b]), int(seq.kv_len[b])
        # positions with a real query of this sample
        real_pos = [q_start + i for i in range(sq) if q_start + i < kv_len]
        real_set = set(real_pos)
        if not real_pos:
            continue
        first_block, last_block = real_pos[0] // bs, real_pos[-1] // bs
        grid = (last_block + 1) * bs  # positions 0 .. grid-1
        masses = {}  # (head, M) -> list of masses over key blocks 0..M
        for h in range(hq):
            qg = torch.zeros(grid, dim, dtype=torch.float64)
            for p in real_pos:
                qg[p] = q[b, h, p - q_start].double()
            kg = torch.zeros(grid, dim, dtype=torch.float64)
            n_keys = min(kv_len, grid)
            kg[:n_keys] = k[b, h // group, :n_keys].double()
            scores = qg @ kg.T
            for big_m in range(first_block, last_block + 1):
                mass = [0.0] * (big_m + 1)
                for m in range(big_m * bs // s, (big_m + 1) * bs // s):
                    if not any(p in real_set for p in range(m * s, m * s + s)):
                        continue
                    # row[n] = sum_i scores[m*s + i, n*s + s-1-i], for every n <= m at once
                    row = torch.zeros(m + 1, dtype=torch.float64)
                    for i in range(s):
                        row += scores[m * s + i, s - 1 - i :: s][: m + 1]
                    probs = torch.softmax(row * (scale if scale is not None else 1 / math.sqrt(dim)) / s, dim=0).tolist()
                    for n in range(m + 1):
                        mass[n * s // bs] += probs[n]
                masses[(h, big_m)] = mass
        for h in range(hq):
            for big_m in range(first_block, last_block + 1):
                if config.head_aggregation == "kv_group":
                    first = (h // group) * group
                    members = [masses[(g, big_m)] for g in range(first, first + group)]
                    mass = [sum(m[n] for m in members) for n in range(big_m + 1)]
                else:
                    mass = masses[(h, big_m)]
                keep = _selected(mass, big_m, tau)
                visible = torch.tensor([j // bs in keep for j in range(sk)])
                for p in real_pos:
                    if p // bs == big_m:
                        out[b, h, p - q_start, : p + 1] = visible[: p + 1]
    return out & causal(seq, hq)


def brute_mass(q, k, seq, block_size, stride, scale=None):
    """(B, Hq, NQB, NKB) float64: steps 2-4 (the mass, per query head) from the definition, one
    strided row at a time."""
    q, k = q.double().cpu(), k.double().cpu()
    batch, hq, q_len, dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    bs, s = block_size, stride
    g = bs // s
    nqb, nkb = seq.num_query_blocks(bs), seq.num_key_blocks(bs)
    scale = (1.0 / math.sqrt(dim) if scale is None else scale) / s
    out = torch.zeros(batch, hq, nqb, nkb, dtype=torch.float64)
    for b in range(batch):
        q_start, kv_len = int(seq.q_start[b]), int(seq.kv_len[b])
        keys = torch.zeros(hkv, nkb * bs, dim, dtype=torch.float64)
        keys[:, :kv_len] = k[b, :, :kv_len]  # keys past kv_len are zero vectors
        first = q_start // bs
        for t in range(nqb):
            for j in range(g):
                m = (first + t) * g + j  # absolute strided row
                rows = torch.zeros(hq, s, dim, dtype=torch.float64)
                real = False
                for i in range(s):
                    pos = m * s + i
                    if q_start <= pos < q_start + q_len and pos < kv_len:
                        rows[:, i] = q[b, :, pos - q_start]
                        real = True
                if not real:
                    continue
                n_keys = m + 1  # strided causal: n <= m
                # tile[h, n, i] = k[n*s + s-1-i]: the antidiagonal partner of query row m*s + i
                tile = keys[:, : n_keys * s].reshape(hkv, n_keys, s, dim).flip(2)
                scores = torch.einsum("kgid,knid->kgn", rows.view(hkv, group, s, dim), tile).reshape(hq, n_keys)
                p = torch.softmax(scores * scale, dim=-1)
                pad = -n_keys % g
                per_block = torch.nn.functional.pad(p, (0, pad)).view(hq, -1, g).sum(-1)
                out[b, :, t, : per_block.shape[1]] += per_block
    return out


DEFINITION = dict(
    small_config={"block_size": 16, "stride": 4, "threshold": 0.9, "decode": "sparse"},
    dense_config={"block_size": 16, "stride": 4, "threshold": 1.0},
    token_causal=False,
    token_reference=token_reference,
)
