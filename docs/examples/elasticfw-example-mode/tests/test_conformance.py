"""elasticfw's conformance suite, run on the strided mode.

``strided_reference`` is the mode's definition written token by token, independently of the
plugin's layout code: the suite compares the layout, the outputs and the reported sparsity
against it.
"""

import torch

from elasticfw.testing.modes import ModeConformance


def strided_reference(q, k, seq, config):
    """(B, Hq, Sq, Sk) bool: key j visible to the query at position p, causality included."""
    bs = config.block_size
    q_pos = seq.query_positions()[:, None, :, None]  # (B, 1, Sq, 1)
    kv = torch.arange(seq.kv_capacity)[None, None, None, :]  # (1, 1, 1, Sk)
    distance = q_pos // bs - kv // bs
    visible = (kv <= q_pos) & ((distance < config.local_blocks) | (distance % config.stride == 0))
    return visible.expand(q.shape[0], q.shape[1], seq.q_len, seq.kv_capacity)


class TestStrided(ModeConformance):
    mode_name = "strided"
    small_config = {"block_size": 16, "stride": 3, "local_blocks": 2}
    dense_config = {"block_size": 16, "stride": 1}
    token_causal = True  # the pattern ignores the data: no row depends on a later token
    token_reference = staticmethod(strided_reference)
