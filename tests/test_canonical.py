"""elasticfw.model.canonical: the SeqInfo an unpadded call gets, checked by hand.

An unpadded prefill whose queries are the last ``q_len`` of the keys is the dense case: its SeqInfo
is ``SeqInfo.dense``, whose host signature lets the layers of a forward reuse layouts and block
masks. Queries that end before the last key (a chunk inside the keys) are not that case."""

from __future__ import annotations

import torch

from elasticfw.model.bridge import KeyPaddingInfo
from elasticfw.model.canonical import canonicalize


def test_an_unpadded_prefill_of_the_last_positions_is_dense() -> None:
    # 3 queries at the end of 5 keys (positions 2, 3, 4), batch 2, no mask or a mask of no padding
    q, k = torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 5, 4)
    for info in (None, KeyPaddingInfo(None, 2, 3, 5)):
        seq = canonicalize(q, k, k, info).seq
        assert seq.q_start.tolist() == [2, 2] and seq.kv_len.tolist() == [5, 5]
        assert seq.host_signature() == ("dense", 2, 3, 5, "cpu")
    # the same 3 queries at positions 1, 2, 3 of the 5 keys: no dense signature
    seq = canonicalize(q, k, k, KeyPaddingInfo(None, 1, 3, 5)).seq
    assert seq.q_start.tolist() == [1, 1] and seq.kv_len.tolist() == [5, 5]
    assert seq.host_signature() is None
