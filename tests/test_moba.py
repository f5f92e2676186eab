"""MoBA mode: upstream equivalence (granularity token), hand-computed layouts, the block-granular
variant through the conformance suite, tie-breaking, dtypes and config errors.

Upstream: MoonshotAI/MoBA ``moba/moba_naive.py::moba_attn_varlen_naive`` (Lu et al., 2025,
arXiv 2502.13189); re-expressed below in plain PyTorch from reading it.
"""

from __future__ import annotations

import math

import pytest
import torch
from mode_definitions.common import causal
from pydantic import ValidationError

import elasticfw_plugins.modes.moba as moba_module
from elasticfw.attention.layout import dense_mask
from elasticfw.attention.seq import SeqInfo
from elasticfw.testing.modes import ModeConformance, make_inputs, make_mode, reference_executor
from elasticfw_plugins.modes.moba import MobaConfig, select_blocks


def _mode(**overrides):
    return make_mode("moba", overrides)


# ---------------------------------------------------------------------------------------
# Granularity "token" == upstream moba_attn_varlen_naive
# ---------------------------------------------------------------------------------------


def upstream_moba_naive(q, k, v, cu_seqlens, chunk, topk):
    """Packed varlen MoBA as upstream's naive reference computes it: q/k/v (S_total, H, D), equal heads.

    Per sequence: gate = q . mean(K_n) (float32) for every key chunk n; chunk n is set to -inf for
    queries before the end of chunk n and to +inf for queries inside chunk n; torch.topk keeps
    min(topk, n_chunks) chunks; the kept chunks, causally masked, form the softmax support.
    """
    out = torch.zeros_like(q, dtype=torch.float32)
    scale = q.shape[-1] ** -0.5
    for s0, s1 in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qs, ks, vs = (t[s0:s1].float() for t in (q, k, v))
        n = s1 - s0
        nblk = math.ceil(n / chunk)
        kmean = torch.stack(
            [ks[i * chunk : min(n, (i + 1) * chunk)].mean(0) for i in range(nblk)]
        )  # (N, H, D)
        gate = torch.einsum("shd,nhd->hsn", qs, kmean)
        for i in range(nblk):
            gate[:, : (i + 1) * chunk, i] = -math.inf
            gate[:, i * chunk : (i + 1) * chunk, i] = math.inf
        _, idx = torch.topk(gate, k=min(topk, nblk), dim=-1)
        keep = torch.zeros_like(gate, dtype=torch.bool).scatter_(-1, idx, True)
        keep = keep.repeat_interleave(chunk, dim=-1)[..., :n] & torch.ones(n, n, dtype=torch.bool).tril()
        scores = torch.einsum("xhd,yhd->hxy", qs, ks) * scale
        probs = scores.masked_fill(~keep, -math.inf).softmax(-1)
        out[s0:s1] = torch.einsum("hxy,yhd->xhd", probs, vs)
    return out


@pytest.mark.parametrize("top_k", [1, 3, 5])
def test_token_granularity_equals_upstream_varlen(top_k):
    lens = [70, 129, 20, 96]  # several sequences; not multiples of the MoBA block; one shorter than it
    hq, hkv, dim, chunk = 4, 2, 16, 32
    g = torch.Generator().manual_seed(11)
    total = sum(lens)
    q = torch.randn(total, hq, dim, generator=g)
    k = torch.randn(total, hkv, dim, generator=g)
    v = torch.randn(total, hkv, dim, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    expected = upstream_moba_naive(
        q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1), cu, chunk, top_k
    )

    # the same sequences as a right-padded batch in canonical coordinates, garbage in the padding
    smax = max(lens)
    qb = torch.full((len(lens), hq, smax, dim), 7.0)
    kb = torch.full((len(lens), hkv, smax, dim), -5.0)
    vb = torch.full((len(lens), hkv, smax, dim), 9.0)
    for b, (s0, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        qb[b, :, :n], kb[b, :, :n], vb[b, :, :n] = (t[s0 : s0 + n].transpose(0, 1) for t in (q, k, v))
    seq = SeqInfo.from_lengths(torch.tensor(lens), smax, smax)
    mode = _mode(moba_block_size=chunk, top_k=top_k, block_size=16)
    out = mode.attend(qb, kb, vb, seq, reference_executor(), scale=dim**-0.5).out
    for b, (s0, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        torch.testing.assert_close(out[b, :, :n].transpose(0, 1), expected[s0 : s0 + n], atol=1e-5, rtol=1e-5)


def test_token_granularity_decode_and_chunked_prefill_equal_prefill():
    q, k, v, seq = make_inputs((1, 4, 2, 150, 150, 16))
    mode = _mode(moba_block_size=32, top_k=3, block_size=16, decode="sparse")
    ex, scale = reference_executor(), 16**-0.5
    full = mode.attend(q, k, v, seq, ex, scale=scale).out
    chunked = SeqInfo(torch.tensor([110]), torch.tensor([150]), 40, 150)
    torch.testing.assert_close(
        mode.attend(q[:, :, 110:], k, v, chunked, ex, scale=scale).out, full[:, :, 110:]
    )
    for p in (0, 31, 32, 64, 95, 149):
        step = mode.attend(
            q[:, :, p : p + 1],
            k[:, :, : p + 1],
            v[:, :, : p + 1],
            SeqInfo.dense(1, 1, p + 1),
            ex,
            scale=scale,
        )
        torch.testing.assert_close(step.out, full[:, :, p : p + 1])


# ---------------------------------------------------------------------------------------
# Hand-computed tiny case
# ---------------------------------------------------------------------------------------

# 8 keys, D = 1, MoBA blocks of 2: block means 1, 3, 2, 0. Query head 0 has q = +1 (gates = means),
# head 1 has q = -1 (gates = -means); one KV head. top_k = 2: the current block + the best earlier one.
_TINY_K = torch.tensor([1.0, 1.0, 3.0, 3.0, 2.0, 2.0, 0.0, 0.0])
_TINY_VISIBLE = {
    0: [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [2, 3, 4], [2, 3, 4, 5], [2, 3, 6], [2, 3, 6, 7]],
    1: [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 4], [0, 1, 4, 5], [0, 1, 6], [0, 1, 6, 7]],
}


def _tiny_inputs(q_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, SeqInfo]:
    """q_values (2 heads, 8 rows) -> q (1, 2, 8, 1), k (1, 1, 8, 1)."""
    return q_values.reshape(1, 2, 8, 1), _TINY_K.reshape(1, 1, 8, 1), SeqInfo.dense(1, 8, 8)


def _visible_mask(visible: dict[int, list[list[int]]]) -> torch.Tensor:
    mask = torch.zeros(1, len(visible), 8, 8, dtype=torch.bool)
    for h, rows in visible.items():
        for i, keys in enumerate(rows):
            mask[0, h, i, keys] = True
    return mask


@pytest.mark.parametrize("block_size", [1, 2])
def test_hand_computed_token_granularity(block_size):
    q, k, seq = _tiny_inputs(torch.tensor([[1.0] * 8, [-1.0] * 8]))
    mode = _mode(moba_block_size=2, top_k=2, block_size=block_size)
    layout = mode.build_layout(q, k, seq)
    assert torch.equal(dense_mask(layout, seq, num_heads=2), _visible_mask(_TINY_VISIBLE))


def test_hand_computed_block_granularity_uses_the_mean_query():
    # Head 0: positions 6 and 7 (one tile, MoBA block 3) have q = +1 and -3. Per token, row 6 picks
    # block 1 (gate 3) and row 7 block 0 (gate -1); the tile's mean query is -1, whose best block is 0
    # (a max over the rows' gates would pick block 1). Head 1 is the all -1 head of the token case.
    q_values = torch.tensor([[1.0] * 7 + [-3.0], [-1.0] * 8])
    q, k, seq = _tiny_inputs(q_values)
    token = dense_mask(
        _mode(moba_block_size=2, top_k=2, block_size=2).build_layout(q, k, seq), seq, num_heads=2
    )
    block = dense_mask(
        _mode(moba_block_size=2, top_k=2, block_size=2, query_granularity="block").build_layout(q, k, seq),
        seq,
        num_heads=2,
    )
    assert token[0, 0, 6].nonzero().flatten().tolist() == [2, 3, 6]
    assert token[0, 0, 7].nonzero().flatten().tolist() == [0, 1, 6, 7]
    assert block[0, 0, 6].nonzero().flatten().tolist() == [0, 1, 6]
    assert block[0, 0, 7].nonzero().flatten().tolist() == [0, 1, 6, 7]
    assert torch.equal(block[0, 1], _visible_mask(_TINY_VISIBLE)[0, 1])


def test_block_granularity_with_one_token_tiles_is_token_granularity():
    q, k, _, seq = make_inputs((2, 6, 2, 203, 203, 16), kv_lens=[203, 150])
    masks = [
        dense_mask(
            _mode(moba_block_size=32, top_k=3, block_size=1, query_granularity=g).build_layout(q, k, seq),
            seq,
            num_heads=6,
        )
        for g in ("token", "block")
    ]
    assert torch.equal(masks[0], masks[1])


# ---------------------------------------------------------------------------------------
# Granularity "block" through the conformance suite, with its own definition
# ---------------------------------------------------------------------------------------


def block_granularity_reference(q, k, seq, config):
    """Per layout tile of a sample: the tile's real queries are averaged (float32) into one query,
    gated against the mean of each whole MoBA block before the tile's MoBA block; the tile's MoBA
    block plus the top_k - 1 best (ties: lower block) are visible to every row of the tile, causally."""
    size, tile, top_k = config.moba_block_size, config.block_size, config.top_k
    batch, hq, sq, _ = q.shape
    group = hq // k.shape[1]
    block_of_key = torch.arange(seq.kv_capacity) // size
    out = causal(seq, hq).clone()
    for b in range(batch):
        kv_len = int(seq.kv_len[b])
        rows_of_tile: dict[int, list[int]] = {}
        for i, pos in enumerate(seq.query_positions()[b].tolist()):
            if pos < kv_len:
                rows_of_tile.setdefault(pos // tile, []).append(i)
        for h in range(hq):
            keys = k[b, h // group].float()
            means = [keys[n * size : (n + 1) * size].mean(0) for n in range(kv_len // size)]  # whole blocks
            for t, rows in rows_of_tile.items():
                query = q[b, h, rows].float().mean(0)
                current = t * tile // size
                scored = [(float(query @ means[n]), n) for n in range(current)]
                best = sorted(scored, key=lambda s: (-s[0], s[1]))[: top_k - 1]
                out[b, h, rows] &= torch.isin(block_of_key, torch.tensor([current] + [n for _, n in best]))[
                    None
                ]
    return out


class TestMobaBlockGranularity(ModeConformance):
    mode_name = "moba"
    small_config = {"block_size": 16, "moba_block_size": 32, "top_k": 3, "query_granularity": "block",
                    "decode": "sparse"}
    dense_config = {"block_size": 16, "moba_block_size": 32, "top_k": 1000, "query_granularity": "block"}
    token_causal = False
    token_reference = staticmethod(block_granularity_reference)


# ---------------------------------------------------------------------------------------
# Ties, dtypes, chunking, config
# ---------------------------------------------------------------------------------------


def test_select_blocks_ties_prefer_lower_index():
    gates = torch.tensor([[2.0, 5.0, 5.0, 2.0, 5.0, 9.0]])
    assert select_blocks(gates, torch.tensor([5]), 3)[0].nonzero().flatten().tolist() == [1, 2, 5]
    assert select_blocks(gates, torch.tensor([5]), 5)[0].nonzero().flatten().tolist() == [0, 1, 2, 4, 5]
    # the current block is kept whatever its gate; later blocks are never candidates
    assert select_blocks(gates, torch.tensor([4]), 2)[0].nonzero().flatten().tolist() == [1, 4]
    assert select_blocks(gates, torch.tensor([2]), 2)[0].nonzero().flatten().tolist() == [1, 2]
    assert select_blocks(gates, torch.tensor([0]), 6)[0].nonzero().flatten().tolist() == [0]


@pytest.mark.parametrize("granularity", ["token", "block"])
def test_equal_gates_select_the_earlier_block(granularity):
    # blocks 0, 1, 2 hold identical keys, so every query scores them equally; block 3 is current
    g = torch.Generator().manual_seed(5)
    block = torch.randn(1, 2, 8, 4, generator=g)
    k = torch.cat([block, block, block, torch.randn(1, 2, 8, 4, generator=g)], dim=2)
    q = torch.randn(1, 4, 32, 4, generator=g)
    seq = SeqInfo.dense(1, 32, 32)
    for top_k, kept in ((2, [0]), (3, [0, 1])):
        config = MobaConfig(moba_block_size=8, top_k=top_k, block_size=8, query_granularity=granularity)
        mask = dense_mask(make_mode("moba", config.model_dump()).build_layout(q, k, seq), seq, num_heads=4)
        expected = torch.zeros(32, dtype=torch.bool)
        for n in kept:
            expected[n * 8 : n * 8 + 8] = True
        assert torch.equal(mask[0, :, 24:, :24], expected[:24].expand(4, 8, 24))
        if granularity == "token":
            from mode_definitions.moba import token_reference

            assert torch.equal(token_reference(q, k, seq, config), mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("granularity", ["token", "block"])
def test_gating_runs_in_float32(dtype, granularity):
    q, k, _, seq = make_inputs((2, 6, 2, 203, 203, 16), dtype=dtype, kv_lens=[203, 170])
    mode = _mode(moba_block_size=32, top_k=3, block_size=16, query_granularity=granularity)
    low = dense_mask(mode.build_layout(q, k, seq), seq, num_heads=6)
    high = dense_mask(mode.build_layout(q.float(), k.float(), seq), seq, num_heads=6)
    assert torch.equal(low, high)


def test_gate_chunking_does_not_change_the_layout(monkeypatch):
    q, k, _, seq = make_inputs((2, 3, 1, 97, 181, 16), kv_lens=[181, 120])
    mode = _mode(moba_block_size=32, top_k=3, block_size=16)
    whole = dense_mask(mode.build_layout(q, k, seq), seq, num_heads=3)
    monkeypatch.setattr(moba_module, "GATE_CHUNK", 7)
    assert torch.equal(dense_mask(mode.build_layout(q, k, seq), seq, num_heads=3), whole)


def test_config_defaults_are_the_papers():
    config = MobaConfig()
    assert (config.moba_block_size, config.top_k, config.query_granularity) == (1024, 8, "token")
    assert _mode().block_size == config.block_size == 64


@pytest.mark.parametrize(
    "overrides",
    [
        {"top_k": 0},
        {"moba_block_size": 0},
        {"block_size": 0},
        {"moba_block_size": 48, "block_size": 32},  # MoBA block not a whole number of layout blocks
        {"query_granularity": "row"},
        {"topk": 8},  # unknown key
    ],
)
def test_config_errors(overrides):
    with pytest.raises(ValidationError):
        MobaConfig(**overrides)
