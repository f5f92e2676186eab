"""Query-gather attention (elasticfw.kernels.gather_attention) under Triton's interpreter, against
the float64 RowSelection definition of test_block_sparse_attention and through the flex executor
on per-token MoBA layouts against the reference executor."""

from __future__ import annotations

import pytest
import torch
from test_block_sparse_attention import _brute, _mode_layout, _seq

from elasticfw.attention.layout import RowSelection
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import triton_unavailable

pytestmark = pytest.mark.skipif(triton_unavailable(torch.device("cpu")) is not None, reason="needs Triton's interpreter")


def _qkv(seq, hq, hkv, dim, g):
    """Standard normal q (B, hq, Sq, dim), k and v (B, hkv, capacity, dim), in that order from ``g``."""
    q = torch.randn(seq.batch, hq, seq.q_len, dim, generator=g)
    k = torch.randn(seq.batch, hkv, seq.kv_capacity, dim, generator=g)
    return q, k, torch.randn(seq.batch, hkv, seq.kv_capacity, dim, generator=g)

CASES = {
    # name: (seq, Hq, Hkv, table heads, D, dtype, groups, group size, density, block_m)
    "prefill": (lambda: SeqInfo.dense(1, 150, 150), 4, 2, 4, 32, torch.float32, 5, 32, 0.4, 32),
    "gqa_table_per_kv_head": (lambda: SeqInfo.dense(1, 140, 140), 4, 2, 2, 16, torch.float32, 9, 16, 0.4, 16),
    "right_padded": (lambda: _seq([0, 0], [130, 77], 130, 130), 2, 1, 2, 16, torch.float32, 5, 32, 0.5, 32),
    "chunked_unaligned": (lambda: _seq([37, 50], [170, 110], 70, 170), 2, 2, 2, 24, torch.float32, 6, 32, 0.5, 16),
    "decode": (lambda: _seq([149, 96], [150, 97], 1, 150), 4, 1, 4, 16, torch.float32, 10, 16, 0.5, 16),
    "group_not_a_power_of_two": (lambda: SeqInfo.dense(1, 120, 120), 2, 1, 2, 16, torch.float32, 5, 24, 0.5, 16),
    "dense_selection_many_ranks": (lambda: SeqInfo.dense(1, 96, 96), 2, 1, 1, 16, torch.float32, 6, 16, 0.9, 16),
    "bf16": (lambda: SeqInfo.dense(1, 130, 130), 2, 1, 2, 32, torch.bfloat16, 5, 32, 0.4, 32),
    "fp16": (lambda: _seq([5], [120], 100, 120), 2, 1, 1, 16, torch.float16, 8, 16, 0.4, 32),
    # a power of two below the 16 the kernel pads to: no TMA (its tiles would be 8 wide)
    "fp16_head_dim_8": (lambda: SeqInfo.dense(1, 100, 100), 2, 1, 2, 8, torch.float16, 4, 32, 0.5, 32),
}


@pytest.mark.parametrize("merge", ["passes", "entries"])
@pytest.mark.parametrize("name", list(CASES))
def test_gathered_attention_matches_the_definition(name, merge):
    from elasticfw.kernels.block_sparse_attention import Tiles
    from elasticfw.kernels.gather_attention import (
        gather_entry_plan,
        gather_plan,
        gathered_selection_attention,
    )

    make, hq, hkv, hs, dim, dtype, groups, gsize, density, bm = CASES[name]
    seq = make()
    g = torch.Generator().manual_seed(11)
    q = torch.randn(seq.batch, hq, seq.q_len, dim, generator=g).to(dtype)
    k = torch.randn(seq.batch, hkv, seq.kv_capacity, dim, generator=g).to(dtype)
    v = torch.randn(seq.batch, hkv, seq.kv_capacity, dim, generator=g).to(dtype)
    selected = torch.rand(seq.batch, hs, seq.q_len, groups, generator=g) < density  # future groups too
    tiles = Tiles(block_m=bm, block_n=16, num_warps=4, num_stages=2)
    out, lse = gathered_selection_attention(q, k, v, RowSelection(selected, gsize), seq, scale=dim**-0.5, tiles=tiles,
                                            merge=merge)
    ref_out, ref_lse = _brute(q, k, v, selected, gsize, seq, dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-4)
    assert (out[~finite] == 0).all()
    if merge == "passes":
        plan = gather_plan(RowSelection(selected, gsize), seq.batch, bm)
        assert len(plan.pass_bounds) - 1 == int(selected.sum(-1).max())  # one pass per rank
    else:
        plan = gather_entry_plan(RowSelection(selected, gsize), seq.batch, bm)
        assert plan.max_entries == int(selected.sum(-1).max())
        assert sorted(plan.slots.tolist()) == list(range(int(selected.sum())))  # every entry once
    assert int(plan.tile_count.sum()) == int(selected.sum()) and int(plan.tile_count.max()) <= bm


def test_gather_plan_by_hand():
    """Two rows, three groups: entries sorted by (rank, head, group, row), tiles of at most 2 rows."""
    from elasticfw.kernels.gather_attention import gather_plan

    selected = torch.tensor([[[[1, 0, 1], [1, 1, 0], [1, 0, 1]]]], dtype=torch.bool)  # rows 0-2
    plan = gather_plan(RowSelection(selected, 4), 1, 2)
    # rank 0: group 0 for rows 0, 1, 2 (tiles [0, 1], [2]); rank 1: group 1 row 1, group 2 rows 0, 2
    assert plan.rows.tolist() == [0, 1, 2, 1, 0, 2]
    assert plan.tile_g.tolist() == [0, 0, 1, 2] and plan.tile_count.tolist() == [2, 1, 1, 2]
    assert plan.pass_bounds == [0, 2, 4]


def _plan_by_definition(selected, batch, block_m):
    """The plan of the module docstring by enumeration: entries sorted by (rank, sample, head, group,
    row), each (rank, sample, head, group) cut into tiles of at most ``block_m`` rows."""
    table = selected.expand(batch, *selected.shape[1:])
    entries = []
    for b, h, r in torch.cartesian_prod(*(torch.arange(n) for n in table.shape[:3])).tolist():
        for rank, g in enumerate(table[b, h, r].nonzero().flatten().tolist()):
            entries.append((rank, b, h, g, r))
    entries.sort()
    rows, tiles = [], []  # tiles: (start, count, b, h, g, rank)
    for e, (rank, b, h, g, r) in enumerate(entries):
        if not tiles or tuple(tiles[-1][2:]) != (b, h, g, rank) or tiles[-1][1] == block_m:
            tiles.append([e, 0, b, h, g, rank])
        tiles[-1][1] += 1
        rows.append(r)
    bounds = [sum(t[5] < rank for t in tiles) for rank in range(max(t[5] for t in tiles) + 2)]
    return rows, tiles, bounds


@pytest.mark.parametrize("shape, batch, block_m, density", [((1, 3, 40, 7), 2, 4, 0.5), ((2, 2, 33, 5), 2, 8, 0.8),
                                                             ((1, 1, 64, 9), 1, 16, 0.3)])
def test_gather_plan_matches_its_definition(shape, batch, block_m, density):
    from elasticfw.kernels.gather_attention import gather_plan

    selected = torch.rand(*shape, generator=torch.Generator().manual_seed(sum(shape))) < density
    plan = gather_plan(RowSelection(selected, 16), batch, block_m)
    rows, tiles, bounds = _plan_by_definition(selected, batch, block_m)
    assert plan.rows.tolist() == rows
    assert plan.tile_start.tolist() == [t[0] for t in tiles] and plan.tile_count.tolist() == [t[1] for t in tiles]
    assert plan.tile_b.tolist() == [t[2] for t in tiles] and plan.tile_h.tolist() == [t[3] for t in tiles]
    assert plan.tile_g.tolist() == [t[4] for t in tiles] and plan.pass_bounds == bounds


@pytest.mark.parametrize("merge", ["passes", "entries"])
def test_keep_heads_and_unsupported_selections(merge):
    from elasticfw.kernels.gather_attention import gathered_selection_attention, unsupported_selection

    seq = _seq([0, 10], [140, 130], 120, 140)
    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(seq, 4, 2, 16, g)
    shared = torch.rand(1, 1, 120, 5, generator=g) < 0.5
    keep = torch.tensor([[True, False, True, False]])
    out, lse = gathered_selection_attention(q, k, v, RowSelection(shared, 32), seq, scale=0.25, keep_heads=keep,
                                            merge=merge)
    ref_out, _ = _brute(q, k, v, shared, 32, seq, 0.25)
    torch.testing.assert_close(out[:, [0, 2]].double(), ref_out[:, [0, 2]], rtol=1e-5, atol=1e-5)
    assert (out[:, [1, 3]] == 0).all() and torch.isinf(lse[:, [1, 3]]).all()
    assert "row_block" in unsupported_selection(RowSelection(shared, 32, row_block=16))
    assert "window" in unsupported_selection(RowSelection(shared, 32, window=8))
    with pytest.raises(BackendUnavailableError, match="window"):
        gathered_selection_attention(q, k, v, RowSelection(shared, 32, window=8), seq, scale=0.25)
    with pytest.raises(ValueError, match="merge must be"):
        gathered_selection_attention(q, k, v, RowSelection(shared, 32), seq, scale=0.25, merge="ranks")


@pytest.mark.parametrize("merge", ["passes", "entries"])
def test_flags_of_any_nonzero_value_select_once(merge):
    """A uint8 table's flags may hold any nonzero value (2, 5): each selects its group once (the
    entries merge once counted a row's entries as the sum of its flags)."""
    from elasticfw.kernels.block_sparse_attention import Tiles
    from elasticfw.kernels.gather_attention import gathered_selection_attention

    seq = _seq([0, 7], [120, 110], 100, 120)
    g = torch.Generator().manual_seed(5)
    q, k, v = _qkv(seq, 2, 1, 16, g)
    flags = torch.randint(0, 3, (2, 2, 100, 4), generator=g).to(torch.uint8) * torch.tensor([1, 2, 5, 2], dtype=torch.uint8)
    assert (flags > 1).any()
    out, lse = gathered_selection_attention(q, k, v, RowSelection(flags, 32), seq, scale=0.25, merge=merge,
                                            tiles=Tiles(block_m=32, block_n=16, num_warps=4, num_stages=2))
    ref_out, ref_lse = _brute(q, k, v, flags != 0, 32, seq, 0.25)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="v must have k's shape"):
        gathered_selection_attention(q, k, v[:, :, :60], RowSelection(flags, 32), seq, scale=0.25, merge=merge)


@pytest.mark.parametrize("merge", ["passes", "entries"])
@pytest.mark.parametrize("case", ["prefill", "padded", "decode"])
def test_flex_executor_gathers_moba_token_layouts(case, merge, monkeypatch):
    from elasticfw.testing.modes import reference_executor
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    kw = {"prefill": {}, "padded": {"kv_lens": [256, 171]}, "decode": {"kv_lens": [256, 150], "sq": 1}}[case]
    q, k, v, seq, layout = _mode_layout("moba", {"moba_block_size": 32, "top_k": 3, "block_size": 16,
                                                 "planner": "torch", "decode": "sparse"}, **kw)
    import elasticfw.kernels.decode_attention as dec
    import elasticfw.kernels.gather_attention as ga

    calls, merges = [], []
    real, real_dec = ga.gathered_selection_attention, dec.decode_attention
    monkeypatch.setattr(ga, "gathered_selection_attention",
                        lambda *a, **kw: calls.append("gather") or merges.append(kw["merge"]) or real(*a, **kw))
    monkeypatch.setattr(dec, "decode_attention", lambda *a, **kw: calls.append("decode") or real_dec(*a, **kw))
    ex = FlexExecutor(FlexConfig(sparse_kernel="triton", gather_merge=merge))  # gather: the default strategy
    with torch.no_grad():
        got = ex.attend(q, k, v, layout, seq, scale=0.25)
        ref = reference_executor().attend(q, k, v, layout, seq, scale=0.25)
    assert calls == ["decode" if case == "decode" else "gather"]  # a decode step takes the decode kernel
    assert merges == ([] if case == "decode" else [merge])
    rows = seq.query_valid()[:, None, :].expand_as(ref.lse)
    torch.testing.assert_close(got.out[rows], ref.out[rows], rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref.lse) & rows
    torch.testing.assert_close(got.lse[finite], ref.lse[finite], rtol=1e-5, atol=1e-5)


def test_tiles_fit_the_gpus_shared_memory(monkeypatch):
    """fit_tiles against the shared memory an H100 / H200 allows per block (232,448 bytes), by hand:
    (stages x 2 x block_n + block_m) x padded head dim x element size + 1 KB of slack. The 128-dim
    defaults fit as they are (229,376 + 1,024); head dim 256 (Gemma's) does not (Triton asked for
    459,776 bytes on an H100). A kernel whose work is planned keeps its rows and chunk (only stages)."""
    from elasticfw.kernels import block_sparse_attention as bsa
    from elasticfw.kernels.block_sparse_attention import DEFAULT_TILES, SMALL_TILES, Tiles, fit_tiles

    cuda = torch.device("cuda")
    monkeypatch.setattr(bsa, "shared_memory_limit", lambda device: 232_448)
    monkeypatch.setattr(bsa, "hopper_or_newer", lambda device: True)
    assert fit_tiles(DEFAULT_TILES, 128, 128, 2, cuda, shrink=True) == (DEFAULT_TILES, 128)
    assert fit_tiles(SMALL_TILES, 64, 256, 2, cuda, shrink=False) == (SMALL_TILES, 64)  # (2 x 2 x 64 + 64) x 512
    # 3 -> 2 stages: 327,680; half the chunk: (2 x 2 x 64 + 128) x 256 x 2 = 196,608
    assert fit_tiles(DEFAULT_TILES, 128, 256, 2, cuda, shrink=True) == (Tiles(128, 128, 8, 2), 64)
    assert fit_tiles(DEFAULT_TILES, 128, 256, 2, cuda, shrink=False) == (Tiles(128, 128, 8, 1), 128)
    # float32 at 256: (2 x 2 x 32 + 64) x 256 x 4 = 196,608 after the chunk and the rows are halved
    assert fit_tiles(DEFAULT_TILES, 128, 256, 4, cuda, shrink=True) == (Tiles(64, 128, 8, 2), 32)
    monkeypatch.setattr(bsa, "shared_memory_limit", lambda device: None)  # off a GPU: as given
    assert fit_tiles(DEFAULT_TILES, 128, 256, 2, cuda, shrink=True) == (DEFAULT_TILES, 128)


def test_tiles_fit_gpus_before_hopper_with_one_stage_fewer(monkeypatch):
    """Below compute capability 9 Triton's pipeline keeps num_stages - 1 K/V buffers (at least one):
    the defaults at head dim 128 in bf16 take (2 x 2 x 128 + 128) x 128 x 2 = 163,840 bytes there
    (what Triton 3.9 compiles for sm_80), within an A100's 166,912 with the slack, so they are kept
    (the Hopper estimate, 229,376 + 1,024, would drop a stage there); an RTX 4090's 101,376 keeps 2 stages of
    128 x 128 (98,304). Where nothing fits, the error names the bytes; a planned call (no shrink)
    says to plan with smaller tiles."""
    from elasticfw.errors import BackendUnavailableError
    from elasticfw.kernels import block_sparse_attention as bsa
    from elasticfw.kernels.block_sparse_attention import DEFAULT_TILES, Tiles, fit_tiles, pipeline_bytes

    cuda = torch.device("cuda")
    assert pipeline_bytes(128, 128, 3, 128, 2, hopper=False) == 163_840
    assert pipeline_bytes(128, 128, 1, 128, 2, hopper=False) == pipeline_bytes(128, 128, 2, 128, 2, hopper=False)
    assert pipeline_bytes(128, 128, 3, 128, 2) == 229_376
    monkeypatch.setattr(bsa, "hopper_or_newer", lambda device: False)
    monkeypatch.setattr(bsa, "shared_memory_limit", lambda device: 166_912)
    assert fit_tiles(DEFAULT_TILES, 128, 128, 2, cuda, shrink=True) == (DEFAULT_TILES, 128)
    monkeypatch.setattr(bsa, "shared_memory_limit", lambda device: 101_376)
    assert fit_tiles(Tiles(128, 128, 8, 2), 128, 128, 2, cuda, shrink=True) == (Tiles(128, 128, 8, 2), 128)
    assert fit_tiles(DEFAULT_TILES, 128, 128, 2, cuda, shrink=True) == (Tiles(128, 128, 8, 2), 128)
    monkeypatch.setattr(bsa, "shared_memory_limit", lambda device: 65_536)  # float32, 256: 99,328 at the least
    with pytest.raises(BackendUnavailableError, match="need 99328 bytes of shared memory, above this GPU's 65536"):
        fit_tiles(DEFAULT_TILES, 128, 256, 4, cuda, shrink=True)
    with pytest.raises(BackendUnavailableError, match="plan with smaller ones"):
        fit_tiles(DEFAULT_TILES, 128, 256, 4, cuda, shrink=False)


@pytest.mark.parametrize("merge", ["passes", "entries"])
def test_gathered_attention_in_fitted_tiles_matches_the_definition(merge, monkeypatch):
    """Where the tiles are shrunk to fit (a limit of 20,000 bytes forced on the CPU: 32-row tiles of
    32-key chunks, one stage), the gathered attention still meets the float64 definition."""
    from elasticfw.kernels import block_sparse_attention as bsa
    from elasticfw.kernels.gather_attention import gathered_selection_attention

    monkeypatch.setattr(bsa, "shared_memory_limit", lambda device: 20_000)
    monkeypatch.setattr(bsa, "hopper_or_newer", lambda device: True)
    assert bsa.fit_tiles(bsa.DEFAULT_TILES, 128, 32, 4, torch.device("cpu"), shrink=True) == (
        bsa.Tiles(32, 128, 8, 1), 32)
    seq = _seq([0, 9], [160, 150], 140, 160)
    g = torch.Generator().manual_seed(8)
    q, k, v = _qkv(seq, 4, 2, 32, g)
    selected = torch.rand(2, 2, 140, 3, generator=g) < 0.5
    out, lse = gathered_selection_attention(q, k, v, RowSelection(selected, 64), seq, scale=0.2, merge=merge)
    ref_out, ref_lse = _brute(q, k, v, selected, 64, seq, 0.2)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-4)
