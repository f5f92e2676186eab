"""NSA mode, ``query_granularity: token``: per-token selection as upstream NSA.

Checked against plain-PyTorch definitions written here token by token (never the mode's helpers):

* :func:`reference_selection` — the mode's documented semantics row by row: mean-pooled
  compressed keys, a softmax per query head over the windows that end at or before the token,
  Eq. 9's overlap weights onto selection blocks, the sum over the KV group's query heads, the
  token's initial and local blocks forced, the rest of ``top_n`` by importance (ties: lower
  block);
* :func:`fla_form_selection` — fla's ``naive_nsa_topk`` formulation, re-expressed from reading it
  (fla-org/flash-linear-attention ``fla/ops/nsa/naive.py``): compression blocks equal to selection
  blocks, block ``c`` visible to token ``t`` once ``(c + 1) * bs - 1 <= t``, the group's *mean*
  probability as the score, the first, current and previous blocks forced by a score of 1, top-S
  over all blocks, then the causally invisible ones dropped;
* outputs: one float64 softmax per row over its visible keys (and its valid compressed keys when
  the compression branch is on), and the conformance suite on the per-token config;
* prefill, chunked prefill and token-by-token decode against a growing cache select the same
  blocks and give the same outputs per position; the block-granular default does not.
"""

from __future__ import annotations

import math

import pytest
import torch
from mode_definitions.nsa import DEFINITION as NSA_DEFINITION
from pydantic import ValidationError

from elasticfw.attention.layout import computed_pairs, dense_mask
from elasticfw.attention.seq import SeqInfo
from elasticfw.testing.modes import ModeConformance, make_inputs, make_mode, reference_executor
from elasticfw_plugins.modes.nsa import NSAConfig

SMALL = NSA_DEFINITION["small_config"]  # the conformance suite's small config: one definition
TOKEN = {**SMALL, "query_granularity": "token"}

#: (batch, query heads, kv heads, q_len, kv_len, head_dim): GQA groups 3, 4 and 16 (fla's minimum),
#: lengths off the block grid, chunked prefill (q_len < kv_len) and decode (q_len 1)
GQA_SHAPES = [
    (2, 6, 2, 203, 203, 16),
    (2, 8, 2, 130, 130, 8),
    (1, 8, 2, 97, 250, 16),
    (2, 3, 1, 1, 181, 16),
    (1, 16, 1, 77, 77, 8),
]


def token_mode(**overrides):
    return make_mode("nsa", {**TOKEN, **overrides})


def _kv_lens(shape):
    """Padding for batched full prefills; none for chunked prefill / decode shapes."""
    batch, _, _, sq, sk, _ = shape
    return [sk, sk - 37][:batch] if sq == sk else None


# ---------------------------------------------------------------------------------------
# Independent per-token definitions
# ---------------------------------------------------------------------------------------


def reference_selection(q, k, seq, config, scale=None):
    """(B, Hkv, Sq, NKB) bool: the key blocks each real query token selects (padding rows: none);
    importance scores use ``scale`` (default 1/sqrt(head_dim))."""
    batch, hq, sq, dim = q.shape
    scale = scale if scale is not None else 1 / math.sqrt(dim)
    hkv = k.shape[1]
    group = hq // hkv
    bs, kernel, stride = config.block_size, config.compress_kernel, config.compress_stride
    nkb = -(-seq.kv_capacity // bs)
    out = torch.zeros(batch, hkv, sq, nkb, dtype=torch.bool)
    for b in range(batch):
        kv_len = int(seq.kv_len[b])
        for g in range(hkv):
            starts, pooled = [], []
            start = 0
            while start + kernel <= kv_len:
                starts.append(start)
                pooled.append(k[b, g, start : start + kernel].double().mean(0))
                start += stride
            for r in range(sq):
                pos = int(seq.q_start[b]) + r
                if pos >= kv_len:
                    continue
                importance = [0.0] * nkb
                seen = [i for i, s in enumerate(starts) if s + kernel <= pos + 1]
                if seen:
                    keys = torch.stack([pooled[i] for i in seen])
                    for h in range(g * group, (g + 1) * group):
                        probs = torch.softmax(keys @ q[b, h, r].double() * scale, 0)
                        for i, p in zip(seen, probs.tolist()):
                            lo, hi = starts[i], starts[i] + kernel
                            for n in range(nkb):
                                shared = min(hi, (n + 1) * bs) - max(lo, n * bs)
                                if shared > 0:
                                    importance[n] += p * shared / stride
                own = pos // bs
                forced = [
                    n for n in range(own + 1) if n < config.init_blocks or n > own - config.local_blocks
                ]
                rest = sorted(
                    (n for n in range(own + 1) if n not in forced), key=lambda n: (-importance[n], n)
                )
                for n in forced + rest[: config.top_n - len(forced)]:
                    out[b, g, r, n] = True
    return out


def reference_mask(q, k, seq, config, scale=None):
    """(B, Hq, Sq, Sk) bool: key j visible to row r at position p iff j <= p and (j's block is
    selected for r, or j > p - window); every query head of a group shares its selection."""
    batch, hq, sq, _ = q.shape
    group = hq // k.shape[1]
    selection = reference_selection(q, k, seq, config, scale)
    keys = torch.arange(seq.kv_capacity)
    mask = torch.zeros(batch, hq, sq, seq.kv_capacity, dtype=torch.bool)
    for b in range(batch):
        for r in range(sq):
            pos = int(seq.q_start[b]) + r
            in_window = (
                keys > pos - config.window if config.window > 0 else torch.zeros_like(keys, dtype=torch.bool)
            )
            for h in range(hq):
                in_selected = selection[b, h // group, r, keys // config.block_size]
                mask[b, h, r] = (keys <= pos) & (in_window | in_selected)
    return mask


def fla_form_selection(q, k, seq, block_size, top_s):
    """fla's ``naive_nsa_topk`` semantics per token (compression block = selection block =
    ``block_size``; forced first/current/previous blocks), as (B, Hkv, Sq, NKB) bool."""
    batch, hq, sq, dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    nkb = -(-seq.kv_capacity // block_size)
    out = torch.zeros(batch, hkv, sq, nkb, dtype=torch.bool)
    for b in range(batch):
        kv_len = int(seq.kv_len[b])
        for g in range(hkv):
            blocks = [k[b, g, c * block_size : (c + 1) * block_size].double().mean(0) for c in range(nkb)]
            for r in range(sq):
                t = int(seq.q_start[b]) + r
                if t >= kv_len:
                    continue
                visible = [c for c in range(nkb) if (c + 1) * block_size - 1 <= t]
                score = [0.0] * nkb
                if visible:
                    keys = torch.stack([blocks[c] for c in visible])
                    for h in range(g * group, (g + 1) * group):
                        probs = torch.softmax(keys @ q[b, h, r].double() / math.sqrt(dim), 0)
                        for c, p in zip(visible, probs.tolist()):
                            score[c] += p / group
                own = t // block_size
                forced = {0, own, own - 1} - {-1}
                for c in forced:
                    score[c] = 1.0
                top = sorted(range(nkb), key=lambda c: (-score[c], c))[: min(top_s, nkb)]
                for c in top:
                    if c in forced or c in visible:
                        out[b, g, r, c] = True
    return out


def reference_output(q, k, v, seq, config, mask):
    """(B, Hq, Sq, D) float64: one softmax per real row over its visible keys, plus (compression
    branch) its valid mean-pooled keys/values."""
    batch, hq, sq, dim = q.shape
    group = hq // k.shape[1]
    kernel, stride = config.compress_kernel, config.compress_stride
    out = torch.zeros(batch, hq, sq, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        kv_len = int(seq.kv_len[b])
        for h in range(hq):
            g = h // group
            keys, values = [k[b, g].double()], [v[b, g].double()]
            ends = []
            if config.compression_branch:
                start = 0
                while start + kernel <= kv_len:
                    keys.append(k[b, g, start : start + kernel].double().mean(0, keepdim=True))
                    values.append(v[b, g, start : start + kernel].double().mean(0, keepdim=True))
                    ends.append(start + kernel)
                    start += stride
            all_keys, all_values = torch.cat(keys), torch.cat(values)
            for r in range(sq):
                pos = int(seq.q_start[b]) + r
                if pos >= kv_len:
                    continue
                allowed = torch.cat(
                    [mask[b, h, r], torch.tensor([e <= pos + 1 for e in ends], dtype=torch.bool)]
                )
                scores = (all_keys @ q[b, h, r].double()) / math.sqrt(dim)
                probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), 0)
                out[b, h, r] = probs @ all_values
    return out


def _real(seq, like):
    return seq.query_valid()[:, None, :, None].expand_as(like)


# ---------------------------------------------------------------------------------------
# Selection and layout against the definitions
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", GQA_SHAPES, ids=lambda s: f"b{s[0]}_group{s[1] // s[2]}_q{s[3]}_kv{s[4]}")
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"window": 0, "top_n": 4},
        {"compress_kernel": 16, "compress_stride": 16, "init_blocks": 0, "local_blocks": 1, "top_n": 3},
        {"compress_kernel": 32, "compress_stride": 8, "window": 40, "init_blocks": 2, "top_n": 6},
    ],
    ids=["small", "no_window", "kernel_eq_stride", "wide_kernel"],
)
def test_selection_and_mask_match_the_per_token_definition(shape, overrides):
    mode = token_mode(**overrides)
    q, k, _, seq = make_inputs(shape, seed=4, kv_lens=_kv_lens(shape))
    got = mode.token_selection(q, k, seq)
    expected = reference_selection(q, k, seq, mode.config)
    rows = seq.query_valid()[:, None, :, None].expand_as(got)
    assert torch.equal(got & rows, expected)
    mask = dense_mask(mode.build_layout(q, k, seq), seq, num_heads=q.shape[1])
    ref = reference_mask(q, k, seq, mode.config)
    diff = (mask != ref) & _real(seq, mask)
    assert not diff.any(), f"{int(diff.sum())} (row, key) pairs differ from the per-token definition"


@pytest.mark.parametrize("shape", GQA_SHAPES, ids=lambda s: f"b{s[0]}_group{s[1] // s[2]}_q{s[3]}_kv{s[4]}")
@pytest.mark.parametrize("top_s", [3, 4, 100])
def test_fla_configuration_selects_what_naive_nsa_topk_selects(shape, top_s):
    """Compression block = selection block, 1 initial + 2 local blocks: fla's per-token top-S."""
    bs = 16
    mode = token_mode(block_size=bs, compress_kernel=bs, compress_stride=bs, top_n=top_s, window=0)
    q, k, _, seq = make_inputs(shape, seed=8, kv_lens=_kv_lens(shape))
    got = mode.token_selection(q, k, seq) & seq.query_valid()[:, None, :, None]
    assert torch.equal(got, fla_form_selection(q, k, seq, bs, top_s))


def test_ties_go_to_the_lower_block_per_token():
    """Zero keys: every fully covered block has the same importance; the earliest ones win."""
    q = torch.randn(1, 2, 128, 16, generator=torch.Generator().manual_seed(2))
    k = torch.zeros(1, 1, 128, 16)
    seq = SeqInfo.dense(1, 128, 128)
    selection = token_mode(top_n=5, window=0).token_selection(q, k, seq)
    for r in (95, 100, 127):  # blocks 5 and 6 / 6 and 7 are local; 0 initial; 1 and 2 win the ties
        own = r // 16
        assert selection[0, 0, r].nonzero().flatten().tolist() == [0, 1, 2, own - 1, own]


def test_one_row_per_tile_is_the_block_granularity():
    """A decode step (one row) scores its tile with that row alone in both granularities."""
    q, k, _, seq = make_inputs((2, 6, 2, 1, 181, 16), seed=6)
    token = dense_mask(token_mode().build_layout(q, k, seq), seq, num_heads=6)
    block = dense_mask(make_mode("nsa", SMALL).build_layout(q, k, seq), seq, num_heads=6)
    assert torch.equal(token, block)


def test_tiles_hold_the_union_of_their_rows_and_are_partial_where_rows_disagree():
    mode = token_mode(window=0)
    q, k, _, seq = make_inputs((2, 6, 2, 203, 203, 16), seed=9, kv_lens=[203, 166])
    layout = mode.build_layout(q, k, seq)
    selection = mode.token_selection(q, k, seq)
    real = seq.query_valid()
    for b in range(2):
        for t in range(layout.blocks.shape[2]):
            rows = [r for r in range(t * 16, min(203, t * 16 + 16)) if real[b, r]]
            if not rows:
                assert not layout.blocks[b, :, t].any()  # tiles without a real row compute nothing
                continue
            union = selection[b, :, rows].any(1)
            common = selection[b, :, rows].all(1)
            assert torch.equal(layout.blocks[b, :, t], union)
            assert torch.equal(layout.partial[b, :, t], union & ~common)
    # with random inputs nearly every computed tile off the forced blocks is partial
    assert layout.partial.sum() > 0.3 * layout.blocks.sum()
    counted = (dense_mask(layout, seq, num_heads=6) & real[:, None, :, None]).sum((-1, -2))
    assert torch.equal(computed_pairs(layout, seq, 6), counted)


# ---------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("compression_branch", [False, True], ids=["selection+window", "with_compression"])
@pytest.mark.parametrize(
    "shape", GQA_SHAPES[:4], ids=lambda s: f"b{s[0]}_group{s[1] // s[2]}_q{s[3]}_kv{s[4]}"
)
def test_outputs_match_the_per_token_definition(shape, compression_branch):
    mode = token_mode(compression_branch=compression_branch)
    q, k, v, seq = make_inputs(shape, seed=12, kv_lens=_kv_lens(shape))
    got = mode.attend(q, k, v, seq, reference_executor(), scale=q.shape[-1] ** -0.5).out
    expected = reference_output(q, k, v, seq, mode.config, reference_mask(q, k, seq, mode.config))
    rows = _real(seq, got)
    assert torch.allclose(got[rows].double(), expected[rows], atol=1e-5)


# ---------------------------------------------------------------------------------------
# Prefill vs token-by-token decode
# ---------------------------------------------------------------------------------------


def _decode_steps(mode, q, k, v, positions, *, compression=False):
    """One q_len-1 call per position against a fixed-capacity cache filled up to that position
    (garbage after it): (selections {p: (Hkv, NKB)}, outputs {p: (Hq, D)})."""
    capacity = k.shape[2]
    selections, outputs = {}, {}
    for p in positions:
        k_cache, v_cache = k.clone(), v.clone()
        k_cache[:, :, p + 1 :] = 50.0
        v_cache[:, :, p + 1 :] = -70.0
        seq = SeqInfo(torch.tensor([p]), torch.tensor([p + 1]), 1, capacity)
        qp = q[:, :, p : p + 1]
        if mode.config.query_granularity == "token":
            selections[p] = mode.token_selection(qp, k_cache, seq)[0, :, 0]
        else:
            selections[p] = mode.select_blocks(mode.block_importance(qp, k_cache, seq), seq)[0, :, 0]
        out = mode.attend(qp, k_cache, v_cache, seq, reference_executor(), scale=q.shape[-1] ** -0.5)
        outputs[p] = out.out[0, :, 0]
    return selections, outputs


@pytest.mark.parametrize("compression_branch", [False, True], ids=["selection+window", "with_compression"])
def test_token_granularity_decode_and_chunked_prefill_equal_prefill(compression_branch):
    mode = token_mode(compression_branch=compression_branch, top_n=4)
    q, k, v, seq = make_inputs((1, 8, 2, 150, 150, 16), seed=21)
    scale = 16**-0.5
    prefill = mode.attend(q, k, v, seq, reference_executor(), scale=scale).out
    table = mode.token_selection(q, k, seq)  # (1, Hkv, 150, NKB)
    selections, outputs = _decode_steps(mode, q, k, v, range(150))
    for p in range(150):
        assert torch.equal(selections[p], table[0, :, p]), f"position {p}: decode selected other blocks"
        torch.testing.assert_close(outputs[p], prefill[0, :, p], atol=1e-5, rtol=1e-5)
    # a chunked prefill starting off the block grid (rows 0..4 of its first tile are in the cache)
    chunked = SeqInfo(torch.tensor([101]), torch.tensor([150]), 49, 150)
    out = mode.attend(q[:, :, 101:], k, v, chunked, reference_executor(), scale=scale).out
    torch.testing.assert_close(out, prefill[:, :, 101:], atol=1e-5, rtol=1e-5)
    assert torch.equal(mode.token_selection(q[:, :, 101:], k, chunked), table[:, :, 101:])


def test_token_granularity_batched_decode_with_padding_equals_prefill():
    """Two samples of different lengths decode one token each in one padded batch."""
    mode = token_mode()
    q, k, v, seq = make_inputs((2, 6, 2, 140, 140, 16), seed=5, kv_lens=[140, 93])
    scale = 16**-0.5
    prefill = mode.attend(q, k, v, seq, reference_executor(), scale=scale).out
    for pa, pb in ((139, 92), (70, 40), (16, 15)):
        q_step = torch.stack([q[0, :, pa : pa + 1], q[1, :, pb : pb + 1]])
        step_seq = SeqInfo(torch.tensor([pa, pb]), torch.tensor([pa + 1, pb + 1]), 1, 140)
        out = mode.attend(q_step, k, v, step_seq, reference_executor(), scale=scale).out
        torch.testing.assert_close(out[0, :, 0], prefill[0, :, pa], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[1, :, 0], prefill[1, :, pb], atol=1e-5, rtol=1e-5)


def test_block_granularity_decode_can_differ_from_prefill():
    """The default (block) selects once per tile from all its rows; a decode step selects for its
    own row: for the same position the blocks (and the outputs) differ. Per token they never do."""
    q, k, v, seq = make_inputs((1, 8, 2, 150, 150, 16), seed=21)
    scale = 16**-0.5
    block = make_mode("nsa", {**SMALL, "top_n": 4})
    tiles = block.select_blocks(block.block_importance(q, k, seq), seq)  # (1, Hkv, NQB, NKB)
    prefill = block.attend(q, k, v, seq, reference_executor(), scale=scale).out
    selections, outputs = _decode_steps(block, q, k, v, range(150))
    differ = [p for p in range(150) if not torch.equal(selections[p], tiles[0, :, p // 16])]
    assert len(differ) > 20, differ
    moved = [p for p in differ if not torch.allclose(outputs[p], prefill[0, :, p], atol=1e-4)]
    assert len(moved) > 20, moved


# ---------------------------------------------------------------------------------------
# Conformance suite on the per-token configuration
# ---------------------------------------------------------------------------------------


class TestNSATokenGranularity(ModeConformance):
    mode_name = "nsa"
    small_config = TOKEN
    dense_config = {
        "block_size": 16,
        "top_n": 100000,
        "window": 0,
        "compress_kernel": 8,
        "compress_stride": 4,
        "query_granularity": "token",
    }
    token_causal = True
    token_reference = staticmethod(reference_mask)


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------


def test_block_granularity_stays_the_default():
    assert NSAConfig().query_granularity == "block"
    description = NSAConfig.model_fields["query_granularity"].description or ""
    assert "`block` (default)" in description


def test_unknown_granularity_is_refused():
    with pytest.raises(ValidationError, match="query_granularity"):
        NSAConfig.model_validate({**SMALL, "query_granularity": "row"})
