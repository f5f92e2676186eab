"""Layouts that compute every causal pair (a data-dependent mode at a short context), and what the
framework saves on them:

* :func:`~elasticfw.attention.layout.computes_every_causal_pair` against the pair-level definition
  (``dense_mask``, built token by token, against every causal pair of the real rows), over random
  block layouts and row selections near the dense limit, with padding, chunked prefill and decode;
* the split executor's gathered (CPU) path runs such a layout as one dense causal SDPA call, with the
  reference executor's output, and keeps the gathered path otherwise;
* NSA (``top_n``) and MoBA (``top_k``) at least as large as the key blocks skip their scoring and
  return the dense causal layout (``dense_at``), with the very pairs scoring would give (forced
  here) and the definition's: every causal pair;
* every mode's ``dense_at`` against the pair definition on both sides of its boundary, the runtime
  building a dense-at layout once per forward, and a routed layer of two dense-at modes running as
  one dense call.
"""

from __future__ import annotations

import math

import pytest
import torch

import elasticfw_plugins.executors.split as split_module
from elasticfw.attention.layout import BlockLayout, RowSelection, computes_every_causal_pair, dense_mask
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import UnsupportedInputError
from elasticfw.testing.modes import make_inputs, make_mode, reference_executor


def _every_pair_by_definition(layout: BlockLayout, seq: SeqInfo, heads: int) -> bool:
    """dense_mask (the layout's pairs, token by token) holds every causal pair of every real row."""
    pos = seq.query_positions()[:, None, :, None]
    j = torch.arange(seq.kv_capacity)[None, None, None, :]
    causal = (j <= pos) & (pos < seq.kv_len[:, None, None, None])
    return bool((dense_mask(layout, seq, num_heads=heads) | ~causal).all())


SEQS = {
    "prefill": lambda: SeqInfo.dense(2, 150, 150),
    "padded": lambda: SeqInfo(torch.tensor([0, 0]), torch.tensor([150, 97]), 150, 150),
    "chunk_unaligned": lambda: SeqInfo(torch.tensor([37, 50]), torch.tensor([170, 118]), 70, 170),
    "decode": lambda: SeqInfo(torch.tensor([149, 96]), torch.tensor([150, 97]), 1, 150),
}


def _causal_table(seq: SeqInfo, rows: int, row_block: int, groups: int, group: int) -> torch.Tensor:
    """(B, 1, rows, groups): flag row r selects every group up to its last position."""
    first = torch.div(seq.q_start, row_block, rounding_mode="floor")[:, None, None]
    last = (first + torch.arange(rows)[None, :, None] + 1) * row_block - 1
    return (torch.arange(groups)[None, None, :] * group <= last)[:, None]


@pytest.mark.parametrize("seq_name", list(SEQS))
@pytest.mark.parametrize("kind", ["blocks", "per_token_rows", "block_rows_window", "narrow_table"])
def test_every_causal_pair_matches_the_pair_definition(seq_name, kind):
    seq = SEQS[seq_name]()
    g = torch.Generator().manual_seed(sum(map(ord, seq_name + kind)))
    bs, heads = 16, 4
    answers = set()
    for trial in range(12):
        if kind == "blocks":
            nqb, nkb = seq.num_query_blocks(bs), seq.num_key_blocks(bs)
            table = _causal_table(seq, nqb, bs, nkb, bs).expand(seq.batch, heads, nqb, nkb).clone()
            table |= torch.rand(table.shape, generator=g) < 0.3  # blocks past the diagonal change nothing
            selection = None
        else:
            row_block = 1 if kind == "per_token_rows" else bs
            rows = seq.num_query_blocks(row_block)
            groups = math.ceil(seq.kv_capacity / 32) - (1 if kind == "narrow_table" else 0)
            table = _causal_table(seq, rows, row_block, groups, 32).expand(seq.batch, heads, rows, groups).clone()
            selection = table
        if trial % 2:  # drop one entry: needed (a pair lost) or not (past a row's reach)
            b, h, r, c = (int(torch.randint(n, (1,), generator=g)) for n in table.shape)
            table[b, h, r, c] = False
        if selection is None:
            layout = BlockLayout(table, bs)
        else:
            window = 20 if kind == "block_rows_window" else 0
            rs = RowSelection(table, 32, row_block=row_block, window=window)
            blocks = torch.ones(seq.batch, heads, seq.num_query_blocks(bs), seq.num_key_blocks(bs), dtype=torch.bool)

            def token_mask(bi, hi, qp, kp, _t=table, _rb=row_block, _q0=seq.q_start, _w=window):  # the selection
                row = (torch.div(qp, _rb, rounding_mode="floor") - torch.div(_q0[bi], _rb, rounding_mode="floor"))
                row = row.clamp(0, _t.shape[2] - 1)
                grp = torch.div(kp, 32, rounding_mode="floor").clamp(0, _t.shape[3] - 1)
                chosen = _t[bi, hi, row, grp] & (kp < _t.shape[3] * 32)
                return chosen | (kp > qp - _w) if _w else chosen

            layout = BlockLayout(blocks, bs, token_mask, row_selection=rs)
        got = computes_every_causal_pair(layout, seq)
        want = _every_pair_by_definition(layout, seq, heads)
        if kind == "block_rows_window" and not got:
            assert not want or trial % 2  # the window is not counted: "no" may be conservative
        else:
            assert got == want, (trial, got, want)
        answers.add(got)
    if kind != "narrow_table":  # (a narrow table loses the pairs of rows that reach its missing group)
        assert True in answers  # both answers were exercised
    if kind in ("blocks", "per_token_rows"):
        assert False in answers


def test_other_token_masks_and_dense_causal():
    seq = SeqInfo.dense(1, 64, 64)
    every = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    assert computes_every_causal_pair(BlockLayout(every, 16, dense_causal=True), seq)
    assert computes_every_causal_pair(BlockLayout(every, 16), seq)
    assert not computes_every_causal_pair(BlockLayout(every, 16, lambda b, h, q, k: q >= 0), seq)  # not decided
    assert not computes_every_causal_pair(BlockLayout(every.tril(-1), 16), seq)  # no diagonal block


def _split_calls(monkeypatch):
    calls = []
    ex = split_module.SplitExecutor(split_module.SplitConfig())
    real_dense, real_gathered = ex.dense, ex.gathered
    monkeypatch.setattr(ex, "dense", lambda *a, **kw: calls.append("dense") or real_dense(*a, **kw))
    monkeypatch.setattr(ex, "gathered", lambda *a, **kw: calls.append("gathered") or real_gathered(*a, **kw))
    return ex, calls


@pytest.mark.parametrize("name, overrides", [
    ("moba", {"moba_block_size": 32, "top_k": 8, "block_size": 16}),
    ("nsa", {"block_size": 16, "compress_kernel": 8, "compress_stride": 4, "top_n": 16, "window": 32}),
])
def test_split_runs_every_pair_layouts_as_one_dense_call(name, overrides, monkeypatch):
    q, k, v, seq = make_inputs((2, 4, 2, 160, 160, 16))
    mode = make_mode(name, overrides)
    monkeypatch.setattr(type(mode), "dense_at", lambda self, seq: False)  # the scored layout, not causal_layout
    layout = mode.build_layout(q, k, seq)
    assert not layout.dense_causal and computes_every_causal_pair(layout, seq)
    ex, calls = _split_calls(monkeypatch)
    with torch.no_grad():
        got = ex.attend(q, k, v, layout, seq, scale=0.25, need_lse=False).out
        want = reference_executor().attend(q, k, v, layout, seq, scale=0.25).out
        assert calls == ["dense"]
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        with_lse = ex.attend(q, k, v, layout, seq, scale=0.25, need_lse=True)  # SDPA gives no lse: gathered
        assert calls == ["dense", "gathered"] and with_lse.lse is not None
        sparse = make_mode(name, {**overrides, **({"top_k": 2} if name == "moba" else {"top_n": 4})})
        layout = sparse.build_layout(q, k, seq)
        assert not computes_every_causal_pair(layout, seq)
        got = ex.attend(q, k, v, layout, seq, scale=0.25, need_lse=False).out
        assert calls == ["dense", "gathered", "gathered"]
        torch.testing.assert_close(got, reference_executor().attend(q, k, v, layout, seq, scale=0.25).out,
                                   rtol=2e-5, atol=2e-5)


def _same_pairs_on_real_rows(a: BlockLayout, b: BlockLayout, seq: SeqInfo, heads: int) -> bool:
    """The two layouts' pairs (dense_mask, token by token) agree on every real query row."""
    real = seq.query_valid()[:, None, :, None]
    return bool(((dense_mask(a, seq, num_heads=heads) == dense_mask(b, seq, num_heads=heads)) | ~real).all())


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_nsa_selecting_every_block_is_full_attention(granularity, monkeypatch):
    """top_n covering every key block: the dense causal layout without scoring, the very pairs that
    scoring (forced here) selects, and every causal pair by the definition."""
    from elasticfw_plugins.modes import nsa as nsa_module

    q, k, _, seq = make_inputs((2, 4, 2, 150, 150, 16), kv_lens=[150, 97])
    cfg = {"block_size": 16, "compress_kernel": 8, "compress_stride": 4, "top_n": 10, "window": 24,
           "query_granularity": granularity}
    mode = make_mode("nsa", cfg)
    assert mode.selects_every_block(seq) and mode.dense_at(seq)  # 10 key blocks
    scored = []
    for name in ("block_importance", "row_importance"):
        real = getattr(nsa_module.NSAAttention, name)
        monkeypatch.setattr(nsa_module.NSAAttention, name,
                            lambda self, *a, _r=real, **kw: scored.append(1) or _r(self, *a, **kw))
    with torch.no_grad():
        fast = mode.build_layout(q, k, seq)
        assert scored == [] and fast.dense_causal
        monkeypatch.setattr(nsa_module.NSAAttention, "selects_every_block", lambda self, seq: False)
        assert not mode.dense_at(seq)
        slow = mode.build_layout(q, k, seq)
        assert scored and not slow.dense_causal
    assert _every_pair_by_definition(slow, seq, 4) and _same_pairs_on_real_rows(fast, slow, seq, 4)
    if granularity == "block":
        every = _causal_table(seq, seq.num_query_blocks(16), 16, 10, 16)  # the definition: every causal block
        assert torch.equal(slow.row_selection.selected, every.expand(2, 2, -1, -1))
    assert not make_mode("nsa", {**cfg, "top_n": 9}).dense_at(seq)


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_moba_selecting_every_block_is_full_attention(granularity, monkeypatch):
    from elasticfw_plugins.modes import moba as moba_module

    q, k, _, seq = make_inputs((2, 4, 2, 150, 150, 16), kv_lens=[150, 97])
    mode = make_mode("moba", {"moba_block_size": 32, "top_k": 5, "block_size": 16, "query_granularity": granularity})
    assert mode.num_blocks(seq) == 5 and mode.selects_every_block(seq) and mode.dense_at(seq)  # 150 keys / 32
    assert not make_mode("moba", {"moba_block_size": 32, "top_k": 4, "block_size": 16}).dense_at(seq)
    gated = []
    real = moba_module.gate_scores
    monkeypatch.setattr(moba_module, "gate_scores", lambda *a: gated.append(1) or real(*a))
    with torch.no_grad():
        fast = mode.build_layout(q, k, seq)
        assert gated == [] and fast.dense_causal
        monkeypatch.setattr(moba_module.MobaAttention, "selects_every_block", lambda self, seq: False)
        slow = mode.build_layout(q, k, seq)
        assert gated and not slow.dense_causal
    assert _every_pair_by_definition(slow, seq, 4) and _same_pairs_on_real_rows(fast, slow, seq, 4)
    if granularity == "token":
        current = torch.div(seq.query_positions(), 32, rounding_mode="floor")  # every block up to the row's own
        want = (torch.arange(5)[None, None, :] <= current[:, :, None]) & seq.query_valid()[:, :, None]
        assert torch.equal(slow.row_selection.selected, want[:, None].expand(2, 4, -1, -1))


def test_split_decides_every_pair_once_per_reusable_layout(monkeypatch):
    """A reusable layout (one object for every layer of a forward) is checked once per SeqInfo
    signature; a layout built per call is checked at every call; both answers stay right."""
    import dataclasses

    calls = []
    real = split_module.computes_every_causal_pair
    monkeypatch.setattr(split_module, "computes_every_causal_pair", lambda *a: calls.append(1) or real(*a))
    q, k, v, _ = make_inputs((1, 4, 2, 160, 160, 16))
    seq = SeqInfo.dense(1, 160, 160)  # lengths known on the host: the runtime's reusable layouts
    stream = make_mode("streaming", {"block_size": 16, "sink_tokens": 16, "local_tokens": 32})
    layout = dataclasses.replace(stream.build_layout(q, k, seq), reusable=True)
    ex = split_module.SplitExecutor(split_module.SplitConfig())
    want = reference_executor().attend(q, k, v, layout, seq, scale=0.25).out
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(ex.attend(q, k, v, layout, seq, scale=0.25, need_lse=False).out, want,
                                       rtol=2e-5, atol=2e-5)
        assert len(calls) == 1
        moba = make_mode("moba", {"moba_block_size": 32, "top_k": 8, "block_size": 16})
        monkeypatch.setattr(type(moba), "dense_at", lambda self, seq: False)  # the gated layout, built per call
        every = moba.build_layout(q, k, seq)
        for _ in range(2):
            ex.attend(q, k, v, every, seq, scale=0.25, need_lse=False)
        assert len(calls) == 3


# -- dense_at: every mode against the pair definition, the runtime and routed layers --------------

#: (mode, config, the plugin class attribute that switches its dense shortcut off, key lengths
#: straddling its boundary)
DENSE_AT = [
    ("streaming", {"block_size": 16, "sink_tokens": 16, "local_tokens": 32}, "dense_at", [32, 48, 49, 64, 65]),
    ("streaming", {"block_size": 16, "sink_tokens": 10, "local_tokens": 30, "granularity": "token"}, "dense_at",
     [39, 40, 41, 64]),
    ("streaming", {"block_size": 16, "sink_tokens": 0, "local_tokens": 24, "granularity": "token"}, "dense_at",
     [24, 25]),
    ("moba", {"moba_block_size": 32, "top_k": 3, "block_size": 16}, "selects_every_block", [64, 96, 97, 128]),
    ("moba", {"moba_block_size": 32, "top_k": 3, "block_size": 16, "query_granularity": "block"},
     "selects_every_block", [96, 97]),
    ("nsa", {"block_size": 16, "compress_kernel": 8, "compress_stride": 4, "top_n": 4, "window": 0},
     "selects_every_block", [48, 64, 65, 80]),
    ("nsa", {"block_size": 16, "compress_kernel": 8, "compress_stride": 4, "top_n": 4, "window": 16,
             "query_granularity": "token"}, "selects_every_block", [64, 65]),
    ("xattention", {"block_size": 16, "stride": 4, "threshold": 0.5, "chunk_size": 64}, "dense_at", [32, 33]),
]


@pytest.mark.parametrize("name, config, switch, lengths", DENSE_AT)
def test_dense_at_is_the_pair_definition(name, config, switch, lengths, monkeypatch):
    """``dense_at(seq)`` is True exactly where the mode's general layout (its shortcut switched off)
    holds every causal pair by the token-level definition (XAttention: only True there, its answer
    past two key blocks depends on the data), and then ``build_layout`` is the dense causal layout."""
    mode = make_mode(name, config)
    answers = set()
    for n in lengths:
        q, k, _, seq = make_inputs((2, 4, 2, n, n, 16), kv_lens=[n, n - 5], seed=n)
        dense = mode.dense_at(seq)
        answers.add(dense)
        with torch.no_grad():
            layout = mode.build_layout(q, k, seq)
            assert layout.dense_causal == dense, n
            with monkeypatch.context() as m:
                m.setattr(type(mode), switch, lambda self, seq: False)
                general = mode.build_layout(q, k, seq)
        every = _every_pair_by_definition(general, seq, 4)
        if name == "xattention":
            assert every or not dense, n
        else:
            assert every == dense, n
    assert answers == {True, False}


def test_full_is_dense_everywhere():
    assert make_mode("full", {"block_size": 16}).dense_at(SeqInfo.dense(1, 1, 10**6))


def test_routed_layer_of_two_dense_modes_is_one_dense_call(monkeypatch):
    """Full + MoBA at a length where MoBA selects every block: one ``attend`` over a dense layout,
    no routed launch, and dense causal attention's output (SDPA, built independently)."""
    from elasticfw.attention.mode import attend_routed

    q, k, v, seq = make_inputs((2, 4, 2, 96, 96, 16))
    full = make_mode("full", {"block_size": 16})
    moba = make_mode("moba", {"moba_block_size": 32, "top_k": 3, "block_size": 16})
    layouts = (full.build_layout(q, k, seq), moba.build_layout(q, k, seq))
    ex, calls = _split_calls(monkeypatch)
    monkeypatch.setattr(ex, "attend_routed", lambda *a, **kw: pytest.fail("routed launch for two dense layouts"))
    hard = torch.tensor([[False, False, True, True], [True, True, False, False]])
    with torch.no_grad():
        got = attend_routed(q, k, v, seq, ex, retrieval=full, sparse=moba, hard=hard, layouts=layouts, scale=0.25).out
        with pytest.raises(UnsupportedInputError, match="hard must be"):
            attend_routed(q, k, v, seq, ex, retrieval=full, sparse=moba, hard=hard[:, :2], layouts=layouts, scale=0.25)
    assert calls == ["dense"]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, scale=0.25
    )
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
