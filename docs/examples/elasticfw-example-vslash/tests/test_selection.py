"""The vertical-slash selection on a case computed by hand.

Eight tokens, head_dim 1, scale 1, every query q = 1 and key j = ln(w_j) with
w = (1, 1, 4, 1, 1, 2, 1, 1), so a query at position p puts w_j / sum(w_0..w_p) on key j <= p.
The last two queries (positions 6 and 7, sums 11 and 12) estimate the lines; in units of 1/132:

    vertical[j] = w_j/11 + w_j/12    -> 23 w_j for j <= 6, 11 for j = 7: key 2 (92), key 5 (46), rest 23
    slash[d]    = w_{6-d}/11 + w_{7-d}/12
                -> d: 0   1   2   3   4   5   6   7
                     23  35  34  23  59  56  23  11

With sink_columns 1 and vertical_size 3: columns {0} + {2, 5}. With local_diagonals 1 and
slash_size 3: diagonals {0} + {4, 5}.
"""

import math

import torch

from elasticfw.attention.layout import dense_mask
from elasticfw.attention.seq import SeqInfo
from elasticfw.testing.modes import make_mode

W = [1, 1, 4, 1, 1, 2, 1, 1]
CONFIG = {"block_size": 16, "last_queries": 2, "vertical_size": 3, "slash_size": 3,
          "sink_columns": 1, "local_diagonals": 1}


def _inputs(query_heads=2):
    q = torch.ones(1, query_heads, 8, 1)
    k = torch.tensor([math.log(w) for w in W]).view(1, 1, 8, 1)
    return q, k, SeqInfo.dense(1, 8, 8)


def test_lines_hand_computed():
    mode = make_mode("vertical_slash", CONFIG)
    q, k, seq = _inputs()
    columns, diagonals = mode.select_lines(q, k, seq, scale=1.0)
    assert columns[0, 0].nonzero().flatten().tolist() == [0, 2, 5]
    assert diagonals[0, 0].nonzero().flatten().tolist() == [0, 4, 5]


def test_visible_keys_hand_computed():
    """Position p sees j <= p with j in {0, 2, 5} or p - j in {0, 4, 5}."""
    mode = make_mode("vertical_slash", CONFIG)
    q, k, seq = _inputs()
    mask = dense_mask(mode.build_layout(q, k, seq, scale=1.0), seq, num_heads=2)
    visible = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 2, 3], 4: [0, 2, 4], 5: [0, 1, 2, 5],
               6: [0, 1, 2, 5, 6], 7: [0, 2, 3, 5, 7]}
    for p, keys in visible.items():
        for h in range(2):
            assert mask[0, h, p].nonzero().flatten().tolist() == keys, (p, h)


def test_ties_go_to_the_lower_index():
    """All-zero keys: every causal key equally likely, so the lines are the lowest indices."""
    mode = make_mode("vertical_slash", {**CONFIG, "sink_columns": 0, "local_diagonals": 0})
    q, _, seq = _inputs()
    columns, diagonals = mode.select_lines(q, torch.zeros(1, 1, 8, 1), seq, scale=1.0)
    # uniform rows: vertical is 1/7 + 1/8 for j <= 6 (ties: 0, 1, 2 win); slash likewise for d <= 6
    assert columns[0, 0].nonzero().flatten().tolist() == [0, 1, 2]
    assert diagonals[0, 0].nonzero().flatten().tolist() == [0, 1, 2]
