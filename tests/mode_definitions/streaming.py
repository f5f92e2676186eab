"""Streaming, token-exact (DuoAttention `generate_streaming_mask`): j <= i and (j < sink or j > i - local).

The block-granular variant is tested separately in test_streaming.py against Block-Sparse-
Attention's block semantics."""

from mode_definitions.common import causal, positions


def token_reference(q, k, seq, config):
    q_pos, kv = positions(seq)
    keep = (kv < config.sink_tokens) | (kv > q_pos - config.local_tokens)
    return causal(seq, q.shape[1]) & keep


DEFINITION = dict(
    # sink = bs + 1: the sink's last block holds one sink token (a floor instead of a ceiling drops it)
    small_config={"block_size": 16, "sink_tokens": 17, "local_tokens": 45, "granularity": "token"},
    dense_config={"block_size": 16, "sink_tokens": 0, "local_tokens": 100000, "granularity": "token"},
    token_causal=True,
    token_reference=token_reference,
)
