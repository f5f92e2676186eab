"""Full attention: every causal pair."""

from mode_definitions.common import causal


def token_reference(q, k, seq, config):
    return causal(seq, q.shape[1])


DEFINITION = dict(
    small_config={"block_size": 16},
    dense_config={"block_size": 16},
    token_causal=True,
    token_reference=token_reference,
)
