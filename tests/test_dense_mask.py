"""`dense_mask`, the public token-level view of a layout, against hand-written answers.

The answers below are written out by hand (key lists per query row), not computed by any
elasticfw function. Two patterns at block size 2 over 6 keys (3 key blocks):

* ``A`` (sink + diagonal): query-block row ``t`` computes key block 0 and key block ``t``;
* ``B`` (causal): row ``t`` computes key blocks ``0..t``.

Bugs these tests catch, each failing on the old ``dense_mask``:

* padding rows (positions at or past a sample's length) were filled in like real rows, and
  their causal keys reached padding keys;
* ``num_heads`` was optional, and left out gave the layout's own head count (1 or Hkv) instead of
  the query heads.
"""

from __future__ import annotations

import pytest
import torch

from elasticfw.attention.layout import BlockLayout, computed_pairs, dense_mask
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import UnsupportedInputError
from elasticfw.model.bridge import KeyPaddingInfo
from elasticfw.model.canonical import canonicalize

BS = 2
A_BLOCKS = [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
B_BLOCKS = [[1, 0, 0], [1, 1, 0], [1, 1, 1]]

# keys each position p attends to under A and B, for a sample with all 6 keys real
A_KEYS = {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 4], 5: [0, 1, 4, 5]}
B_KEYS = {p: list(range(p + 1)) for p in range(6)}


def _layout(patterns: list[list[list[int]]]) -> BlockLayout:
    """A prefill layout (rows = position blocks 0..2) with one head per pattern, shared by the batch."""
    return BlockLayout(torch.tensor([patterns], dtype=torch.bool), BS)


def _mask(rows_per_head: list[list[list[int]]], keys: int = 6) -> torch.Tensor:
    """(H, R, keys) bool from per head, per row, the list of keys attended."""
    out = torch.zeros(len(rows_per_head), len(rows_per_head[0]), keys, dtype=torch.bool)
    for h, rows in enumerate(rows_per_head):
        for i, ks in enumerate(rows):
            out[h, i, ks] = True
    return out


def _prefill_seq() -> SeqInfo:
    """Three samples of capacity 6, as the transformers bridge puts them into canonical coordinates:
    no padding (6 tokens), right padding (4 tokens), left padding (3 tokens, rolled to the start)."""
    key_mask = torch.tensor(
        [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]], dtype=torch.bool
    )
    x = torch.zeros(3, 1, 6, 1)
    seq = canonicalize(x, x, x, KeyPaddingInfo(key_mask, 0, 6, 6)).seq
    assert seq.kv_len.tolist() == [6, 4, 3] and seq.q_start.tolist() == [0, 0, 0]
    return seq


def _prefill_answer(pattern_of_head: list[dict[int, list[int]]]) -> torch.Tensor:
    """(3, H, 6, 6): sample 0 every row real; sample 1 rows 4, 5 padding; sample 2 rows 3..5 padding."""
    per_sample = []
    for length in (6, 4, 3):
        per_sample.append(_mask([[keys[p] if p < length else [] for p in range(6)] for keys in pattern_of_head]))
    return torch.stack(per_sample)


@pytest.mark.parametrize(
    "heads",
    [
        pytest.param("one", id="1 head: one pattern for every query head"),
        pytest.param("kv", id="Hkv=2 heads: each repeated for its group of 2"),
        pytest.param("q", id="Hq=4 heads: one each"),
    ],
)
def test_prefill_with_left_and_right_padding(heads: str) -> None:
    seq = _prefill_seq()
    layout, per_head = {
        "one": (_layout([A_BLOCKS]), [A_KEYS] * 4),
        "kv": (_layout([A_BLOCKS, B_BLOCKS]), [A_KEYS, A_KEYS, B_KEYS, B_KEYS]),
        "q": (_layout([A_BLOCKS, B_BLOCKS, B_BLOCKS, A_BLOCKS]), [A_KEYS, B_KEYS, B_KEYS, A_KEYS]),
    }[heads]
    got = dense_mask(layout, seq, num_heads=4)
    assert got.shape == (3, 4, 6, 6) and got.dtype == torch.bool
    assert torch.equal(got, _prefill_answer(per_head))
    # row chunks, as the executors ask for them, are slices of the whole
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        assert torch.equal(dense_mask(layout, seq, rows, num_heads=4), got[:, :, rows])


def test_padding_rows_and_columns_are_false() -> None:
    """The old behaviour filled padding row 4 of the 4-token sample with keys 0, 1, 4 (4 is a padding key)."""
    seq = _prefill_seq()
    got = dense_mask(_layout([A_BLOCKS]), seq, num_heads=1)
    assert not got[1, :, 4:].any() and not got[2, :, 3:].any()
    assert not got[1, ..., 4:].any() and not got[2, ..., 3:].any()


def test_chunked_queries_past_a_short_sample_and_an_empty_sample() -> None:
    """Two query rows against a cache (q_start > 0): sample 0 (6 tokens) at positions 4, 5; sample 1
    (3 tokens) at positions 2 (real) and 3 (padding); sample 2 holds no token at all."""
    seq = SeqInfo(torch.tensor([4, 2, 0]), torch.tensor([6, 3, 0]), 2, 6)
    # layout rows are the position blocks q_start // 2 = 2, 1, 0 of each sample
    blocks = torch.tensor(
        [[[A_BLOCKS[2]], [B_BLOCKS[2]]], [[A_BLOCKS[1]], [B_BLOCKS[1]]], [[A_BLOCKS[0]], [B_BLOCKS[0]]]],
        dtype=torch.bool,
    )
    layout = BlockLayout(blocks, BS)  # (3, Hkv=2, 1, 3)
    expected = torch.stack(
        [
            _mask([[[0, 1, 4], [0, 1, 4, 5]]] * 2 + [[[0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]]] * 2),
            _mask([[[0, 1, 2], []]] * 4),  # the old mask gave row 1 keys 0..3, key 3 a padding key
            _mask([[[], []]] * 4),
        ]
    )
    assert torch.equal(dense_mask(layout, seq, num_heads=4), expected)


def test_a_token_mask_never_turns_padding_on() -> None:
    """A token mask that is True on padding (here: every pair but the key just before the query)."""
    seq = _prefill_seq()

    def skip_previous(b, h, q, k):  # type: ignore[no-untyped-def]
        return (q - k) != 1

    layout = BlockLayout(torch.tensor([[B_BLOCKS]], dtype=torch.bool), BS, skip_previous)
    keys = {p: [j for j in range(p + 1) if p - j != 1] for p in range(6)}
    assert keys[3] == [0, 1, 3]  # written out: position 3 skips key 2
    assert torch.equal(dense_mask(layout, seq, num_heads=2), _prefill_answer([keys, keys]))


def test_counts_agree_with_computed_pairs() -> None:
    """What the docstring promises: summed over rows and keys, the mask counts computed_pairs."""
    seq = _prefill_seq()
    layout = _layout([A_BLOCKS, B_BLOCKS])
    # by hand: A over 6, 4, 3 real rows: 21 - 4 = 17 (positions 4 and 5 each skip keys 2, 3), 10, 6; B: 21, 10, 6
    expected = torch.tensor([[17, 17, 21, 21], [10, 10, 10, 10], [6, 6, 6, 6]])
    assert torch.equal(dense_mask(layout, seq, num_heads=4).sum((-1, -2)), expected)
    assert torch.equal(computed_pairs(layout, seq, num_heads=4), expected)


def test_num_heads_is_required_and_checked() -> None:
    seq = _prefill_seq()
    layout = _layout([A_BLOCKS, B_BLOCKS])
    with pytest.raises(TypeError, match="num_heads"):
        dense_mask(layout, seq)  # type: ignore[call-arg]  # the old default: the layout's 2 heads
    for bad in (0, -2, True, 2.0):
        with pytest.raises(UnsupportedInputError, match="num_heads must be a positive int"):
            dense_mask(layout, seq, num_heads=bad)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedInputError, match="not a multiple"):
        dense_mask(layout, seq, num_heads=3)
