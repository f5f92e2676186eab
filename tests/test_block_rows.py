"""Two forms of the gathered path (``elasticfw_plugins.executors.gathered``) beside its chunks:
block rows (every (sample, head, query block) over exactly the key blocks it computes, one SDPA
call per count of key blocks) and one row (a decode step by two matmuls over every key).

Checked against softmax attention in float64 written here from the layout's definition (a pair is
computed when its block is set, the key is causal and real), on inputs where each thing it
handles differs: per-sample query starts on the block grid, a padded last query block, a key
capacity that is not a whole number of blocks, padded keys, query blocks that compute nothing or
not their diagonal, layouts of one, KV and query heads, GQA, calls split to a byte budget; then
which calls the executor sends to it (the tile counts it decides on, by hand). The one-row form
the same way, with its log-sum-exp.
"""

from __future__ import annotations

import math

import pytest
import torch

import elasticfw_plugins.executors.gathered as gathered
from elasticfw.attention.layout import BlockLayout, expand_heads
from elasticfw.attention.seq import SeqInfo
from elasticfw.testing.modes import TOLERANCE, make_mode, real_rows, rel_rms
from elasticfw_plugins.executors.split import SplitConfig, SplitExecutor

BS = 16


def _definition(q, k, v, blocks, seq, scale):
    """(B, Hq, Sq, D) float64: attention over the pairs the layout computes, 0 for a row without any."""
    batch, hq, sq, dim = q.shape
    hkv, cap = k.shape[1], k.shape[2]
    if blocks.shape[1] not in (1, hq):  # one layout per KV head: repeated for its query heads
        blocks = blocks.repeat_interleave(hq // blocks.shape[1], 1)
    blocks = blocks.expand(batch, hq, *blocks.shape[2:])
    out = torch.zeros(batch, hq, sq, dim, dtype=torch.float64)
    for b in range(batch):
        start, kv_len = int(seq.q_start[b]), int(seq.kv_len[b])
        for h in range(hq):
            kk, vv = k[b, h // (hq // hkv)].double(), v[b, h // (hq // hkv)].double()
            for i in range(sq):
                p = start + i
                t = p // BS - start // BS
                keys = [j for j in range(cap) if j <= p and j < kv_len and bool(blocks[b, h, t, j // BS])]
                if not keys:
                    continue
                s = (kk[keys] @ q[b, h, i].double()) * scale
                out[b, h, i] = torch.softmax(s, 0) @ vv[keys]
    return out


def _blocks(batch, heads, nqb, nkb, seed):
    """Random block flags (about 40% set), with query blocks that compute nothing and ones that
    skip their diagonal, as a data-dependent mode may give."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.rand(batch, heads, nqb, nkb, generator=g) < 0.4
    blocks[:, :, 0] = False  # nothing in the first query block of every head
    blocks[0, 0, -1] = True  # every key block, diagonal included
    return blocks


def _qkv(batch, hq, hkv, sq, cap, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, sq, 8, generator=g).to(dtype)
    k = torch.randn(batch, hkv, cap, 8, generator=g).to(dtype)
    v = torch.randn(batch, hkv, cap, 8, generator=g).to(dtype)
    return q, k, v


# name: (q_start, kv_len, q_len, kv_capacity, Hq, Hkv, heads of the layout (0: one), dtype)
CASES = {
    # a padded batch: sample 1's rows past 60 and keys past 60 are padding; 83 = 5 blocks + 3
    "prefill_padded": ([0, 0], [83, 60], 83, 83, 4, 2, 4, torch.float32),
    # chunked prefill against a cache, each sample's queries from another block of the grid
    "chunked": ([32, 16], [83, 67], 51, 83, 4, 2, 4, torch.float32),
    "per_kv_head": ([0, 0], [96, 77], 96, 96, 6, 2, 2, torch.float32),
    "one_layout": ([0], [70], 70, 70, 2, 1, 0, torch.float32),
    "bf16": ([16, 0], [80, 64], 64, 80, 4, 1, 4, torch.bfloat16),
}


@pytest.mark.parametrize("call_bytes", [gathered.BLOCK_ROWS_CALL_BYTES, 1], ids=["one_call", "row_per_call"])
@pytest.mark.parametrize("name", list(CASES))
def test_block_rows_match_the_definition(name, call_bytes, monkeypatch):
    starts, lens, sq, cap, hq, hkv, heads, dtype = CASES[name]
    monkeypatch.setattr(gathered, "BLOCK_ROWS_CALL_BYTES", call_bytes)
    seq = SeqInfo(torch.tensor(starts), torch.tensor(lens), sq, cap)
    batch = len(starts)
    q, k, v = _qkv(batch, hq, hkv, sq, cap, dtype)
    nqb, nkb = seq.num_query_blocks(BS), seq.num_key_blocks(BS)
    blocks = _blocks(batch if heads else 1, heads or 1, nqb, nkb, seed=len(name))
    lay = expand_heads(BlockLayout(blocks, BS), hq)
    with torch.no_grad():
        got = gathered.block_rows_attention(
            q, k, v, gathered.causal_block_flags(lay, seq), seq, block_size=BS, scale=0.3
        )
    want = _definition(q, k, v, blocks, seq, 0.3)
    real = real_rows(seq).expand_as(got)
    assert got.shape == q.shape and bool(torch.isfinite(got).all())
    assert rel_rms(got[real], want[real]) < TOLERANCE[dtype]
    assert not got[:, :, :BS].any()  # the first query block of every head computes nothing: zeros


def test_causal_block_flags_by_hand():
    """Key block ``<=`` the row's position block, per sample: q_start 32 puts row 0 at block 2."""
    seq = SeqInfo(torch.tensor([0, 32]), torch.tensor([48, 64]), 32, 64)
    lay = BlockLayout(torch.ones(1, 1, 2, 4, dtype=torch.bool), BS)
    flags = gathered.causal_block_flags(lay, seq)
    assert flags.shape == (2, 1, 2, 4)
    assert flags[0, 0].tolist() == [[True, False, False, False], [True, True, False, False]]
    assert flags[1, 0].tolist() == [[True, True, True, False], [True, True, True, True]]


def test_tile_counts_by_hand():
    """Chunks of 2 query blocks: the chunked path computes, for every sample and head, each key
    block that any of them uses in the chunk; the layout computes only its own."""
    flags = torch.zeros(2, 3, 3, 3, dtype=torch.bool)
    flags[0, 0, 0, 0] = True  # chunk 0 (blocks 0-1): key block 0
    flags[1, 2, 1, 1] = True  # chunk 0: key block 1
    flags[0, 1, 2, 2] = True  # chunk 1 (block 2): key block 2
    chunked, exact = gathered.chunked_and_exact_tiles(flags, 2, batch=2, heads=3)
    assert exact == 3
    assert chunked == (2 * 2 + 1 * 1) * 2 * 3  # (2 key blocks x 2 rows + 1 x 1) for 6 (sample, head)s
    shared = torch.zeros(1, 1, 3, 3, dtype=torch.bool)
    shared[0, 0, 2, :] = True  # one layout for every sample and head: exact counts them all
    assert gathered.chunked_and_exact_tiles(shared, 2, batch=2, heads=3) == (3 * 6, 3 * 6)


def _spy(monkeypatch):
    calls = []
    real = gathered.block_rows_attention

    def spy(*args, **kwargs):
        calls.append(args[3].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(gathered, "block_rows_attention", spy)
    return calls


def test_executor_takes_block_rows_where_they_compute_fewer_tiles(monkeypatch):
    """A layout whose heads pick different blocks (the chunks' union is most blocks) goes to the
    block-rows form at inference, and meets the definition; the same call recording autograd,
    asking for the log-sum-exp, or with queries off the block grid goes through the chunked path
    (which meets it too)."""
    calls = _spy(monkeypatch)
    seq = SeqInfo(torch.tensor([0, 0]), torch.tensor([96, 80]), 96, 96)
    q, k, v = _qkv(2, 4, 2, 96, 96)
    blocks = torch.zeros(2, 4, 6, 6, dtype=torch.bool)
    for h in range(4):  # head h: its diagonal and key block h only
        blocks[:, h, :, h] = True
        blocks[:, h] |= torch.eye(6, dtype=torch.bool)
    layout = BlockLayout(blocks, BS)
    ex = SplitExecutor(SplitConfig(query_chunk=48))
    flags = gathered.causal_block_flags(layout, seq)
    chunked, exact = gathered.chunked_and_exact_tiles(flags, 3, 2, 4)
    assert exact * gathered.BLOCK_ROWS_COST < chunked
    want = _definition(q, k, v, blocks, seq, 0.25)
    real = real_rows(seq).expand_as(q)
    with torch.no_grad():
        got = ex.attend(q, k, v, layout, seq, scale=0.25, need_lse=False).out
    assert len(calls) == 1 and rel_rms(got[real], want[real]) < TOLERANCE[torch.float32]
    held = ex._gather_buffers[0]._buffer
    assert held is not None  # the gathered keys went into the executor's buffer
    # a second, smaller call through the same buffers (a view of them): still exact
    seq2 = SeqInfo(torch.tensor([0, 0]), torch.tensor([64, 50]), 64, 64)
    with torch.no_grad():
        got2 = ex.attend(q[:, :, :64], k[:, :, :64], v[:, :, :64], BlockLayout(blocks[:, :, :4, :4], BS), seq2,
                         scale=0.25, need_lse=False).out
    want2 = _definition(q[:, :, :64], k[:, :, :64], v[:, :, :64], blocks[:, :, :4, :4], seq2, 0.25)
    real2 = real_rows(seq2).expand_as(got2)
    assert len(calls) == 2 and ex._gather_buffers[0]._buffer is held
    assert rel_rms(got2[real2], want2[real2]) < TOLERANCE[torch.float32]
    with torch.no_grad():
        with_lse = ex.attend(q, k, v, layout, seq, scale=0.25, need_lse=True)
    qg = q.clone().requires_grad_(True)
    recorded = ex.attend(qg, k, v, layout, seq, scale=0.25, need_lse=False).out
    assert len(calls) == 2  # neither took the block rows
    for out in (with_lse.out, recorded.detach()):
        assert rel_rms(out[real], want[real]) < TOLERANCE[torch.float32]
    off_grid = SeqInfo(torch.tensor([8, 0]), torch.tensor([96, 80]), 88, 96)  # sample 0 starts mid-block
    with torch.no_grad():
        ex.attend(q[:, :, :88], k, v, BlockLayout(blocks, BS), off_grid, scale=0.25, need_lse=False)
    assert len(calls) == 2


def test_executor_keeps_the_chunked_path_for_a_shared_window(monkeypatch):
    """A streaming layout (one pattern for every head: each chunk's union is nearly its exact
    blocks) stays on the chunked path, whose cost per tile is lower: chunks of 3 blocks (the
    default model's 192 rows of 64-token blocks) hold 8 key blocks where each row computes 6."""
    calls = _spy(monkeypatch)
    seq = SeqInfo.dense(2, 160, 160)
    q, k, v = _qkv(2, 4, 2, 160, 160)
    layout = make_mode("streaming", {"block_size": BS, "sink_tokens": BS, "local_tokens": 64}).build_layout(q, k, seq)
    with torch.no_grad():
        got = SplitExecutor(SplitConfig(query_chunk=3 * BS)).attend(q, k, v, layout, seq, scale=0.25, need_lse=False).out
    assert not calls
    assert rel_rms(got, _definition(q, k, v, layout.blocks, seq, 0.25)) < TOLERANCE[torch.float32]


def _definition_lse(q, k, blocks, seq, scale):
    """(B, Hq, 1) float64 log-sum-exp of one query row per sample over the pairs the layout computes."""
    batch, hq, _, _ = q.shape
    hkv = k.shape[1]
    if blocks.shape[1] not in (1, hq):
        blocks = blocks.repeat_interleave(hq // blocks.shape[1], 1)
    blocks = blocks.expand(batch, hq, *blocks.shape[2:])
    lse = torch.full((batch, hq, 1), -math.inf, dtype=torch.float64)
    for b in range(batch):
        p, kv_len = int(seq.q_start[b]), int(seq.kv_len[b])
        for h in range(hq):
            keys = [j for j in range(k.shape[2]) if j <= p and j < kv_len and bool(blocks[b, h, 0, j // BS])]
            if keys:
                s = (k[b, h // (hq // hkv), keys].double() @ q[b, h, 0].double()) * scale
                lse[b, h, 0] = torch.logsumexp(s, 0)
    return lse


# name: (SeqInfo, Hq, Hkv, heads of the layout (0: one), dtype)
ONE_ROW = {
    "host_dense": (lambda: SeqInfo.dense(2, 1, 83), 4, 2, 4, torch.float32),
    # a padded batch's decode step: sample 1's keys past 61 are padding
    "padded": (lambda: SeqInfo(torch.tensor([82, 60]), torch.tensor([83, 61]), 1, 83), 6, 2, 2, torch.float32),
    "one_layout": (lambda: SeqInfo.dense(3, 1, 64), 2, 1, 0, torch.float32),
    "bf16": (lambda: SeqInfo(torch.tensor([70, 40]), torch.tensor([71, 41]), 1, 80), 4, 1, 4, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(ONE_ROW))
def test_one_row_matches_the_definition(name):
    make_seq, hq, hkv, heads, dtype = ONE_ROW[name]
    seq = make_seq()
    batch, cap = seq.batch, seq.kv_capacity
    q, k, v = _qkv(batch, hq, hkv, 1, cap, dtype, seed=2)
    blocks = _blocks(batch if heads else 1, heads or 1, 1, seq.num_key_blocks(BS), seed=7)
    blocks[..., 0, 0] = True
    if heads:
        blocks[-1, -1, 0] = False  # one head of the last sample reads nothing
    layout = BlockLayout(blocks, BS)
    with torch.no_grad():
        got = gathered.one_row_attention(q, k, v, expand_heads(layout, hq), seq, scale=0.3, need_lse=True)
    want = _definition(q, k, v, blocks, seq, 0.3)
    assert got.out.dtype == dtype and rel_rms(got.out, want) < TOLERANCE[dtype]
    want_lse = _definition_lse(q, k, blocks, seq, 0.3)
    assert torch.equal(torch.isneginf(got.lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(got.lse[finite].double(), want_lse[finite], rtol=0, atol=1e-4)
    if heads:
        assert not got.out[-1, -1].any()


def test_decode_takes_one_row_where_most_blocks_are_read(monkeypatch):
    """A decode step reading most key blocks goes to the one-row form (meeting the definition); one
    reading a window of them, or recording autograd, stays on the chunked path."""
    calls = []
    real = gathered.one_row_attention
    monkeypatch.setattr(gathered, "one_row_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    seq = SeqInfo.dense(2, 1, 160)
    q, k, v = _qkv(2, 4, 2, 1, 160)
    ex = SplitExecutor()
    most = torch.ones(2, 4, 1, 10, dtype=torch.bool)
    most[:, :, :, 3:6] = False  # 7 of 10 blocks
    window = torch.zeros(1, 1, 1, 10, dtype=torch.bool)
    window[..., 7:] = True  # 3 of 10
    with torch.no_grad():
        got = ex.attend(q, k, v, BlockLayout(most, BS), seq, scale=0.25, need_lse=False).out
        assert len(calls) == 1 and rel_rms(got, _definition(q, k, v, most, seq, 0.25)) < TOLERANCE[torch.float32]
        got = ex.attend(q, k, v, BlockLayout(window, BS), seq, scale=0.25, need_lse=False).out
        assert len(calls) == 1 and rel_rms(got, _definition(q, k, v, window, seq, 0.25)) < TOLERANCE[torch.float32]
    ex.attend(q.requires_grad_(True), k, v, BlockLayout(most, BS), seq, scale=0.25, need_lse=False)
    assert len(calls) == 1
