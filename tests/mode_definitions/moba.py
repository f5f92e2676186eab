"""MoBA, per query token (upstream ``moba_attn_varlen_naive``), written row by row.

Query at position p (MoBA block c = p // M): key j is visible iff j <= p and j // M is c or one of
the top_k - 1 blocks n < c with the highest gate q · mean(K_n) (float32); equal gates go to the
lower n. A call of one query row under ``decode: full`` sees every j <= p. The suite runs
``decode: sparse`` (the gated decode step). The block-granular variant has its own definition in test_moba.py."""

import torch

from mode_definitions.common import causal


def token_reference(q, k, seq, config):
    size, top_k = config.moba_block_size, config.top_k
    batch, hq, sq, _ = q.shape
    group = hq // k.shape[1]
    block_of_key = torch.arange(seq.kv_capacity) // size
    out = causal(seq, hq).clone()
    if config.decode == "full" and sq == 1:
        return out  # a decode step under decode: full is full attention (upstream: no gating at decode)
    for b in range(batch):
        kv_len, q_start = int(seq.kv_len[b]), int(seq.q_start[b])
        for h in range(hq):
            keys = k[b, h // group].float()
            means = [keys[n * size : (n + 1) * size].mean(0) for n in range(kv_len // size)]  # whole blocks
            for i in range(sq):
                pos = q_start + i
                if pos >= kv_len:
                    continue  # padding row: not compared
                current = pos // size
                query = q[b, h, i].float()
                scored = [(float(query @ means[n]), n) for n in range(current)]
                best = sorted(scored, key=lambda s: (-s[0], s[1]))[: top_k - 1]
                chosen = torch.tensor([current] + [n for _, n in best])
                out[b, h, i] &= torch.isin(block_of_key, chosen)
    return out


DEFINITION = dict(
    small_config={"block_size": 16, "moba_block_size": 32, "top_k": 3, "query_granularity": "token",
                  "decode": "sparse"},
    dense_config={"block_size": 16, "moba_block_size": 32, "top_k": 1000, "query_granularity": "token"},
    token_causal=True,
    token_reference=token_reference,
)
