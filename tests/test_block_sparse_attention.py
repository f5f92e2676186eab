"""The row-selection attention kernel (elasticfw.kernels.block_sparse_attention) under Triton's
interpreter: against a float64 attention written here from the RowSelection definition, and
through the flex executor on per-token MoBA layouts against the reference executor."""

from __future__ import annotations

import math

import pytest
import torch

from elasticfw.attention.layout import BlockLayout, RowSelection
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import triton_unavailable

DEV = torch.device("cpu")
pytestmark = pytest.mark.skipif(triton_unavailable(DEV) is not None, reason="needs Triton's interpreter")


def _seq(q_start, kv_len, q_len, cap):
    return SeqInfo(torch.tensor(q_start), torch.tensor(kv_len), q_len, cap)


def _brute(q, k, v, selected, group_size, seq, scale, row_block=1, window=0):
    """float64: the query at position p (row i) of head h sees key j iff j <= p, j < kv_len and (its
    flag row p // row_block - q_start // row_block selects j's group, or p - window < j with a window)."""
    batch, hq, sq, dim = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    out = torch.zeros(batch, hq, sq, dim, dtype=torch.float64)
    lse = torch.full((batch, hq, sq), -math.inf, dtype=torch.float64)
    for b in range(batch):
        q0 = int(seq.q_start[b])
        for h in range(hq):
            hs = h // (hq // selected.shape[1])
            kh = h // (hq // hkv)
            for i in range(sq):
                pos = q0 + i
                row = selected[min(b, selected.shape[0] - 1), hs, pos // row_block - q0 // row_block]
                keys = [j for j in range(sk) if j <= pos and j < int(seq.kv_len[b])  # past the table: not selected
                        and ((j // group_size < row.numel() and bool(row[j // group_size]))
                             or (window > 0 and j > pos - window))]
                if not keys:
                    continue
                s = q[b, h, i].double() @ k[b, kh, keys].double().T * scale
                lse[b, h, i] = torch.logsumexp(s, 0)
                out[b, h, i] = torch.softmax(s, 0) @ v[b, kh, keys].double()
    return out, lse


def _inputs(seq, hq, hkv, dim, dtype, groups, group_size, sel_heads, seed=0, density=0.4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq.batch, hq, seq.q_len, dim, generator=g).to(dtype)
    k = torch.randn(seq.batch, hkv, seq.kv_capacity, dim, generator=g).to(dtype)
    v = torch.randn(seq.batch, hkv, seq.kv_capacity, dim, generator=g).to(dtype)
    selected = torch.rand(seq.batch, sel_heads, seq.q_len, groups, generator=g) < density
    return q, k, v, selected


CASES = {
    # name: (seq, Hq, Hkv, sel heads, D, dtype, groups, group size)
    "prefill": (lambda: SeqInfo.dense(1, 150, 150), 4, 2, 4, 32, torch.float32, 5, 32),
    "gqa_selection_per_kv_head": (lambda: SeqInfo.dense(1, 140, 140), 4, 2, 2, 16, torch.float32, 9, 16),
    "right_padded": (lambda: _seq([0, 0], [130, 77], 130, 130), 2, 1, 2, 16, torch.float32, 5, 32),
    "chunked_unaligned": (lambda: _seq([37, 50], [170, 110], 70, 170), 2, 2, 2, 24, torch.float32, 6, 32),
    "decode": (lambda: _seq([149, 96], [150, 97], 1, 150), 4, 1, 4, 16, torch.float32, 10, 16),
    "bf16": (lambda: SeqInfo.dense(1, 130, 130), 2, 1, 2, 32, torch.bfloat16, 5, 32),
    "fp16": (lambda: _seq([5], [120], 100, 120), 2, 1, 1, 16, torch.float16, 8, 16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_the_definition(name):
    from elasticfw.kernels.block_sparse_attention import row_selection_attention

    make, hq, hkv, hs, dim, dtype, groups, gsize = CASES[name]
    seq = make()
    q, k, v, selected = _inputs(seq, hq, hkv, dim, dtype, groups, gsize, hs)
    scale = dim**-0.5
    out, lse = row_selection_attention(q, k, v, RowSelection(selected, gsize), seq, scale=scale)
    ref_out, ref_lse = _brute(q, k, v, selected, gsize, seq, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)  # rows that see nothing: -inf, zero output
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-4)
    assert (out[~finite] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_head_dim_below_16_in_16_bit_matches_the_definition(dtype):
    """Head dim 8 is a power of two, but the kernel pads head dims to 16: its K/V must not come
    through TMA, whose tiles would be 8 wide (every row selects both groups, so every chunk is
    clean, the loop that loads through TMA)."""
    from elasticfw.kernels.block_sparse_attention import row_selection_attention

    seq = SeqInfo.dense(1, 256, 256)
    q, k, v, _ = _inputs(seq, 2, 1, 8, dtype, 2, 128, 2)
    selected = torch.ones(1, 2, 256, 2, dtype=torch.bool)
    out, lse = row_selection_attention(q, k, v, RowSelection(selected, 128), seq, scale=8**-0.5)
    ref_out, ref_lse = _brute(q, k, v, selected, 128, seq, 8**-0.5)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("reverse", [True, False])
def test_every_program_order_computes_every_tile_of_every_head(grouped, reverse, monkeypatch):
    """The grid's order (GQA groups side by side or head by head, tiles last first or first first)
    must map the programs one to one onto (tile, query head): a wrong map leaves rows unwritten or
    gives them another head's keys. Groups of 3 query heads, 6 tiles (not coprime: a map that mixes
    tile and head indices up can still be one to one when they are), a selection per query head."""
    from elasticfw.kernels import block_sparse_attention as bsa

    monkeypatch.setattr(bsa, "GROUP_HEADS", grouped)
    monkeypatch.setattr(bsa, "REVERSE_TILES", reverse)
    seq = _seq([0, 12], [180, 175], 168, 180)
    q, k, v, selected = _inputs(seq, 6, 2, 16, torch.float32, 12, 16, 6, seed=7)
    out, lse = bsa.row_selection_attention(q, k, v, RowSelection(selected, 16), seq, scale=0.25,
                                           tiles=bsa.Tiles(block_m=32, block_n=16, num_warps=4, num_stages=2))
    ref_out, ref_lse = _brute(q, k, v, selected, 16, seq, 0.25)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-4)


def test_keep_heads_and_a_shared_selection():
    from elasticfw.kernels.block_sparse_attention import row_selection_attention

    seq = _seq([0, 10], [140, 130], 120, 140)
    q, k, v, selected = _inputs(seq, 4, 2, 16, torch.float32, 5, 32, 1, seed=3)
    shared = selected[:1]  # one table for both samples
    keep = torch.tensor([[True, False, True, False]])
    out, lse = row_selection_attention(q, k, v, RowSelection(shared, 32), seq, scale=0.25, keep_heads=keep)
    ref_out, ref_lse = _brute(q, k, v, shared, 32, seq, 0.25)
    torch.testing.assert_close(out[:, [0, 2]].double(), ref_out[:, [0, 2]], rtol=1e-5, atol=1e-5)
    assert (out[:, [1, 3]] == 0).all() and torch.isinf(lse[:, [1, 3]]).all()


def test_unsupported_inputs_are_named():
    from elasticfw.kernels.block_sparse_attention import row_selection_attention, unsupported

    q = torch.zeros(1, 2, 8, 16, dtype=torch.float64)
    assert "float64" in unsupported(q)
    with pytest.raises(BackendUnavailableError, match="float64"):
        row_selection_attention(q, q, q, RowSelection(torch.ones(1, 2, 8, 1, dtype=torch.bool), 8),
                                SeqInfo.dense(1, 8, 8), scale=1.0)
    q, k = torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16)
    for v in (torch.zeros(1, 1, 8, 16), torch.zeros(1, 2, 6, 16)):  # fewer heads, fewer keys than k
        with pytest.raises(ValueError, match="v must have k's shape"):
            row_selection_attention(q, k, v, RowSelection(torch.ones(1, 2, 8, 1, dtype=torch.bool), 8),
                                    SeqInfo.dense(1, 8, 8), scale=1.0)
    with pytest.raises(ValueError, match="selection table must be"):  # a table of no heads (was ZeroDivisionError)
        row_selection_attention(q, k, k, RowSelection(torch.ones(1, 0, 8, 1, dtype=torch.bool), 8),
                                SeqInfo.dense(1, 8, 8), scale=1.0)


# -- through the flex executor, on per-token MoBA layouts -----------------------------------------


def _moba_case(kv_lens=None, sq=None, seed=0):
    from elasticfw.testing.modes import make_inputs, make_mode

    sk = 192
    q, k, v, seq = make_inputs((2, 4, 2, sq or sk, sk, 16), seed=seed, kv_lens=kv_lens)
    mode = make_mode("moba", {"moba_block_size": 32, "top_k": 3, "block_size": 16, "planner": "torch",
                              "decode": "sparse"})
    with torch.no_grad():
        layout = mode.build_layout(q, k, seq)
    return q, k, v, seq, layout


@pytest.mark.parametrize("case", ["prefill", "padded", "decode"])
def test_flex_executor_runs_moba_token_layouts_through_the_kernel(case, monkeypatch):
    from elasticfw.testing.modes import reference_executor
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    kw = {"prefill": {}, "padded": {"kv_lens": [192, 131]}, "decode": {"kv_lens": [192, 150], "sq": 1}}[case]
    q, k, v, seq, layout = _moba_case(**kw)
    assert layout.row_selection is not None and layout.row_selection.group_size == 32
    calls = []
    import elasticfw.kernels.block_sparse_attention as bsa
    import elasticfw.kernels.decode_attention as dec

    real, real_dec = bsa.row_selection_attention, dec.decode_attention
    monkeypatch.setattr(bsa, "row_selection_attention", lambda *a, **kw: calls.append("tiles") or real(*a, **kw))
    monkeypatch.setattr(dec, "decode_attention", lambda *a, **kw: calls.append("decode") or real_dec(*a, **kw))
    ex = FlexExecutor(FlexConfig(sparse_kernel="triton", row_selection_strategy="tiles"))
    with torch.no_grad():
        got = ex.attend(q, k, v, layout, seq, scale=0.25)
        ref = reference_executor().attend(q, k, v, layout, seq, scale=0.25)
    assert calls == ["decode" if case == "decode" else "tiles"]  # a decode step: no 128-row tile
    rows = seq.query_valid()[:, None, :]
    torch.testing.assert_close(got.out[rows.expand_as(got.lse)], ref.out[rows.expand_as(ref.lse)], rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref.lse) & rows
    torch.testing.assert_close(got.lse[finite], ref.lse[finite], rtol=1e-5, atol=1e-5)


def test_backend_choice_of_row_selection_layouts(monkeypatch):
    from elasticfw.attention.layout import select_heads, with_window
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    q, k, v, seq, layout = _moba_case()
    import elasticfw.kernels.block_sparse_attention as bsa

    def refuse(*a, **kw):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(bsa, "row_selection_attention", refuse)
    with torch.no_grad():  # `auto` on a CPU and the default `flex` keep FlexAttention
        FlexExecutor(FlexConfig(sparse_kernel="auto")).attend(q, k, v, layout, seq, scale=0.25)
        FlexExecutor(FlexConfig()).attend(q, k, v, layout, seq, scale=0.25)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with pytest.raises(BackendUnavailableError, match="no backward.*sparse_kernel"):
        FlexExecutor(FlexConfig(sparse_kernel="triton")).attend(*leaves, layout, seq, scale=0.25)
    # transformations that change the pairs drop the row selection (an executor may trust it)
    assert with_window(layout, seq, 40).row_selection is None
    assert select_heads(torch.ones(2, 4, dtype=torch.bool), layout, layout).row_selection is None


def test_row_selection_tiles_smaller_than_the_group_and_strided_inputs():
    """64-row tiles against 32-key groups through 16-key chunks; q/k/v views of a packed tensor."""
    from elasticfw.kernels.block_sparse_attention import Tiles, row_selection_attention

    seq = _seq([0, 20], [160, 150], 140, 160)
    g = torch.Generator().manual_seed(5)
    packed = torch.randn(2, 160, 3, 2, 16, generator=g)  # (B, S, q/k/v, H, D): strided head views
    q, k, v = (packed[:, :140 if n == 0 else 160, n].transpose(1, 2) for n in range(3))
    selected = torch.rand(2, 2, 140, 5, generator=g) < 0.5
    out, lse = row_selection_attention(q, k, v, RowSelection(selected, 32), seq, scale=0.3,
                                       tiles=Tiles(block_m=64, block_n=16, num_warps=4, num_stages=2))
    ref_out, ref_lse = _brute(q, k, v, selected, 32, seq, 0.3)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)


# -- block layouts (no token mask) -----------------------------------------------------------------


BLOCK_CASES = {
    # name: (seq, Hq, Hkv, table heads, D, dtype, block size, density, tiles (block_m, block_n))
    "prefill_per_query_head": (lambda: SeqInfo.dense(1, 200, 200), 4, 2, 4, 32, torch.float32, 16, 0.5, (32, 16)),
    "dense_blocks_clean_path": (lambda: SeqInfo.dense(1, 192, 192), 2, 1, 1, 16, torch.float32, 32, 1.0, (32, 32)),
    "per_kv_head_gqa": (lambda: SeqInfo.dense(2, 160, 160), 4, 2, 2, 16, torch.float32, 32, 0.6, (64, 32)),
    "right_padded": (lambda: _seq([0, 0], [150, 83], 150, 150), 2, 1, 2, 16, torch.float32, 16, 0.7, (32, 16)),
    "chunked_unaligned": (lambda: _seq([37, 50], [170, 118], 70, 170), 2, 2, 1, 24, torch.float32, 16, 0.6, (32, 16)),
    "decode": (lambda: _seq([149, 96], [150, 97], 1, 150), 4, 1, 4, 16, torch.float32, 16, 0.5, (16, 16)),
    "tile_smaller_than_block": (lambda: _seq([5], [140], 135, 140), 2, 1, 2, 16, torch.float32, 64, 0.7, (32, 32)),
    "bf16": (lambda: SeqInfo.dense(1, 160, 160), 2, 1, 2, 32, torch.bfloat16, 32, 0.6, (64, 32)),
    "fp16": (lambda: _seq([3], [130], 127, 130), 2, 1, 1, 16, torch.float16, 16, 0.6, (32, 16)),
}


def _block_inputs(seq, hq, hkv, hs, dim, dtype, bs, density, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq.batch, hq, seq.q_len, dim, generator=g).to(dtype)
    k = torch.randn(seq.batch, hkv, seq.kv_capacity, dim, generator=g).to(dtype)
    v = torch.randn(seq.batch, hkv, seq.kv_capacity, dim, generator=g).to(dtype)
    nqb, nkb = seq.num_query_blocks(bs), seq.num_key_blocks(bs)
    blocks = torch.rand(seq.batch, hs, nqb, nkb, generator=g) < density
    return q, k, v, BlockLayout(blocks, bs)


@pytest.mark.parametrize("name", list(BLOCK_CASES))
def test_block_layout_kernel_matches_the_definition(name):
    from elasticfw.kernels.block_sparse_attention import Tiles, block_layout_attention
    from elasticfw.kernels.work_lists import work_lists

    make, hq, hkv, hs, dim, dtype, bs, density, (bm, bn) = BLOCK_CASES[name]
    seq = make()
    q, k, v, layout = _block_inputs(seq, hq, hkv, hs, dim, dtype, bs, density)
    tiles = Tiles(block_m=bm, block_n=bn, num_warps=4, num_stages=2)
    out, lse = block_layout_attention(q, k, v, layout, seq, scale=dim**-0.5, tiles=tiles)
    ref_out, ref_lse = _brute(q, k, v, layout.blocks, bs, seq, dim**-0.5, row_block=bs)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-4)
    assert (out[~finite] == 0).all()
    _, n_clean, _, n_masked = work_lists(RowSelection(layout.blocks, bs, row_block=bs), seq, bm, min(bn, bs))
    assert n_masked.sum() > 0  # every case has diagonal chunks
    if name in ("dense_blocks_clean_path", "prefill_per_query_head", "per_kv_head_gqa", "bf16"):
        assert n_clean.sum() > 0  # and these also take the unmasked loop


def test_work_lists_split_clean_from_masked_chunks():
    """Hand-checked lists: 4 query rows per tile, 2 keys per chunk, one 4-key block per layout row."""
    from elasticfw.kernels.work_lists import work_lists

    seq = SeqInfo.dense(1, 12, 12)  # 3 tiles of 4 rows, 6 chunks of 2 keys, 3 blocks of 4
    blocks = torch.tensor([[[[1, 0, 0], [1, 1, 0], [0, 1, 1]]]], dtype=torch.bool)
    sel = RowSelection(blocks, 4, row_block=4)
    clean, n_clean, masked, n_masked = work_lists(sel, seq, 4, 2)
    lists = lambda li, n, t: li[0, 0, t, : n[0, 0, t]].tolist()  # noqa: E731
    # tile 0 (positions 0-3): block 0 only, its chunks 0-1 both cross the diagonal
    assert lists(clean, n_clean, 0) == [] and lists(masked, n_masked, 0) == [0, 1]
    # tile 1 (positions 4-7): block 0 is wholly before position 4 (clean), block 1 holds the diagonal
    assert lists(clean, n_clean, 1) == [0, 1] and lists(masked, n_masked, 1) == [2, 3]
    # tile 2 (positions 8-11): blocks 1 (clean) and 2 (diagonal)
    assert lists(clean, n_clean, 2) == [2, 3] and lists(masked, n_masked, 2) == [4, 5]
    # 8-row tiles over 4-row layout rows: a block only one of its layout rows selects is masked
    clean, n_clean, masked, n_masked = work_lists(sel, seq, 8, 2)
    assert lists(clean, n_clean, 0) == [] and lists(masked, n_masked, 0) == [0, 1, 2, 3]
    assert lists(clean, n_clean, 1) == [2, 3] and lists(masked, n_masked, 1) == [4, 5]  # rows 8-11: row 2 only


def test_unsupported_layouts_are_named():
    from elasticfw.kernels.block_sparse_attention import block_layout_attention, unsupported_layout

    seq = SeqInfo.dense(1, 24, 24)
    odd = BlockLayout(torch.ones(1, 1, 3, 3, dtype=torch.bool), 8)
    assert "multiple of 16" in unsupported_layout(odd)
    masked = BlockLayout(torch.ones(1, 1, 2, 2, dtype=torch.bool), 16, token_mask=lambda b, h, q, k: q >= k)
    assert "token mask" in unsupported_layout(masked)
    q = torch.zeros(1, 1, 24, 16)
    with pytest.raises(BackendUnavailableError, match="multiple of 16"):
        block_layout_attention(q, q, q, odd, seq, scale=1.0)


def _mode_layout(name, overrides, kv_lens=None, sq=None, seed=0, sk=256):
    from elasticfw.testing.modes import make_inputs, make_mode

    q, k, v, seq = make_inputs((2, 4, 2, sq or sk, sk, 16), seed=seed, kv_lens=kv_lens)
    with torch.no_grad():
        layout = make_mode(name, overrides).build_layout(q, k, seq)
    return q, k, v, seq, layout


MODE_CASES = {
    "xattention": ("xattention", {"block_size": 16, "stride": 4, "threshold": 0.9, "estimator": "torch"}),
    "nsa_block": ("nsa", {"block_size": 16, "top_n": 4, "window": 32, "compress_kernel": 16, "compress_stride": 8,
                          "local_blocks": 1, "query_granularity": "block", "scorer": "torch"}),
    "streaming_block": ("streaming", {"sink_tokens": 16, "local_tokens": 64, "block_size": 16, "granularity": "block"}),
    "nsa_token": ("nsa", {"block_size": 16, "top_n": 4, "window": 24, "compress_kernel": 16, "compress_stride": 8,
                          "local_blocks": 1, "query_granularity": "token", "scorer": "torch"}),
    "nsa_no_window": ("nsa", {"block_size": 16, "top_n": 4, "window": 0, "compress_kernel": 16,
                              "compress_stride": 8, "local_blocks": 1, "scorer": "torch"}),
    "moba_block": ("moba", {"moba_block_size": 32, "top_k": 3, "block_size": 16, "query_granularity": "block",
                            "planner": "torch"}),
    "full": ("full", {"block_size": 16}),
}


@pytest.mark.parametrize("case", ["prefill", "padded", "chunk"])
@pytest.mark.parametrize("mode", list(MODE_CASES))
def test_flex_executor_runs_block_layouts_through_the_kernel(mode, case, monkeypatch):
    from elasticfw.testing.modes import reference_executor
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    name, overrides = MODE_CASES[mode]
    kw = {"prefill": {}, "padded": {"kv_lens": [256, 171]}, "chunk": {"kv_lens": [256, 200], "sq": 72}}[case]
    q, k, v, seq, layout = _mode_layout(name, overrides, **kw)
    if layout.token_mask is not None and layout.row_selection is None:
        pytest.fail(f"{mode}: the case must build a layout the kernel takes")
    import elasticfw.kernels.block_sparse_attention as bsa

    calls = []
    real = bsa.block_layout_attention
    monkeypatch.setattr(bsa, "block_layout_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        got = FlexExecutor(FlexConfig(sparse_kernel="triton")).attend(q, k, v, layout, seq, scale=0.25)
        ref = reference_executor().attend(q, k, v, layout, seq, scale=0.25)
    assert calls == [1]
    rows = seq.query_valid()[:, None, :].expand_as(ref.lse)
    torch.testing.assert_close(got.out[rows], ref.out[rows], rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref.lse) & rows
    torch.testing.assert_close(got.lse[finite], ref.lse[finite], rtol=1e-5, atol=1e-5)


def test_token_mask_layouts_stay_on_flexattention(monkeypatch):
    """A pinned kernel still leaves a token-mask layout (token streaming) to FlexAttention."""
    from elasticfw.testing.modes import reference_executor
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    q, k, v, seq, layout = _mode_layout("streaming", {"sink_tokens": 8, "local_tokens": 40, "block_size": 16,
                                                      "granularity": "token"})
    assert layout.token_mask is not None and layout.row_selection is None
    import elasticfw.kernels.block_sparse_attention as bsa

    monkeypatch.setattr(bsa, "_attend", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("the kernel ran")))
    with torch.no_grad():
        got = FlexExecutor(FlexConfig(sparse_kernel="triton")).attend(q, k, v, layout, seq, scale=0.25)
        ref = reference_executor().attend(q, k, v, layout, seq, scale=0.25)
    torch.testing.assert_close(got.out, ref.out, rtol=1e-5, atol=1e-5)


def test_split_routed_layer_through_the_kernel():
    """Under split, a routed layer's sparse heads (keep_heads) run through the kernel; full heads
    through SDPA; the whole layer equals the reference executor's per-head combination."""
    from elasticfw.attention.layout import causal_layout, select_heads
    from elasticfw.testing.modes import reference_executor
    from elasticfw_plugins.executors.flex import FlexConfig
    from elasticfw_plugins.executors.split import SplitConfig, SplitExecutor

    q, k, v, seq, sparse = _mode_layout("xattention", MODE_CASES["xattention"][1])
    full = causal_layout(seq, 16)
    hard = torch.tensor([[False, False, True, True]]).expand(2, 4)  # GQA group 0 full, group 1 sparse
    import elasticfw.kernels.block_sparse_attention as bsa

    calls = []
    real = bsa.block_layout_attention
    bsa_patch = pytest.MonkeyPatch()
    bsa_patch.setattr(bsa, "block_layout_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    ex = SplitExecutor(SplitConfig(sparse="flex", flex=FlexConfig(sparse_kernel="triton")))
    try:
        with torch.no_grad():
            got = ex.attend_routed(q, k, v, seq, hard=hard, layouts=(full, sparse), scale=0.25, need_lse=False)
            ref = reference_executor().attend(q, k, v, select_heads(~hard, full, sparse), seq, scale=0.25)
    finally:
        bsa_patch.undo()
    assert len(calls) == 1 and calls[0]["keep_heads"] is not None  # the sparse heads only, in the kernel
    torch.testing.assert_close(got.out, ref.out, rtol=1e-5, atol=1e-5)


WINDOW_CASES = {
    # name: (seq, Hq, Hkv, table heads, D, row_block, group, window, density, tiles)
    "per_block_rows": (lambda: SeqInfo.dense(1, 200, 200), 4, 2, 2, 16, 16, 16, 40, 0.2, (32, 16)),
    "per_token_rows": (lambda: _seq([0, 30], [150, 140], 110, 150), 2, 1, 2, 16, 1, 32, 24, 0.3, (32, 16)),
    "window_wider_than_tile": (lambda: _seq([20], [200], 180, 200), 2, 1, 1, 16, 32, 32, 100, 0.1, (32, 16)),
    "decode": (lambda: _seq([149, 96], [150, 97], 1, 150), 4, 1, 4, 16, 16, 16, 33, 0.3, (16, 16)),
    # a table of 2 groups for 4 groups of keys: the window alone reaches keys 64-127 (the kernel once
    # read the next row's flags for them)
    "table_narrower_than_the_keys": (lambda: SeqInfo.dense(1, 128, 128), 2, 1, 1, 16, 1, 32, 16, 0.6, (32, 16), 2),
    # a table of no groups: the window alone (the kernel read the flag before the table, a crash)
    "table_of_no_groups": (lambda: SeqInfo.dense(1, 64, 64), 2, 2, 2, 16, 1, 16, 8, 0.5, (32, 16), 0),
}


@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_selection_with_a_sliding_window_matches_the_definition(name):
    from elasticfw.kernels.block_sparse_attention import Tiles, row_selection_attention
    from elasticfw.kernels.work_lists import work_lists

    make, hq, hkv, hs, dim, row_block, group, window, density, (bm, bn), *table = WINDOW_CASES[name]
    seq = make()
    g = torch.Generator().manual_seed(7)
    q = torch.randn(seq.batch, hq, seq.q_len, dim, generator=g)
    k = torch.randn(seq.batch, hkv, seq.kv_capacity, dim, generator=g)
    v = torch.randn(seq.batch, hkv, seq.kv_capacity, dim, generator=g)
    rows = seq.num_query_blocks(row_block)
    groups = table[0] if table else math.ceil(seq.kv_capacity / group)
    selected = torch.rand(seq.batch, hs, rows, groups, generator=g) < density
    selection = RowSelection(selected, group, row_block=row_block, window=window)
    tiles = Tiles(block_m=bm, block_n=bn, num_warps=4, num_stages=2)
    out, lse = row_selection_attention(q, k, v, selection, seq, scale=0.25, tiles=tiles)
    ref_out, ref_lse = _brute(q, k, v, selected, group, seq, 0.25, row_block=row_block, window=window)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-4)
    if name == "window_wider_than_tile":  # chunks wholly inside every row's window take the clean loop
        _, n_clean, _, _ = work_lists(selection, seq, bm, bn)
        assert n_clean.sum() > 0


def test_reusable_layouts_plan_their_work_once(monkeypatch):
    """The flex executor keeps a reusable layout's work lists (as it keeps its BlockMask) and reuses
    them for the next layer; a new layout object is planned again. Both calls match the reference."""
    import dataclasses

    from elasticfw.testing.modes import reference_executor
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    q, k, v, _, layout = _mode_layout("streaming", MODE_CASES["streaming_block"][1], sk=128)
    seq = SeqInfo.dense(2, 128, 128)  # a host signature: what the runtime's prefill passes
    layout = dataclasses.replace(layout, reusable=True)
    import elasticfw.kernels.block_sparse_attention as bsa
    import elasticfw.kernels.work_lists as wl

    plans = []
    real = wl.plan_work
    monkeypatch.setattr(wl, "plan_work", lambda *a, **kw: plans.append(1) or real(*a, **kw))
    ex = FlexExecutor(FlexConfig(sparse_kernel="triton"))
    with torch.no_grad():
        ref = reference_executor().attend(q, k, v, layout, seq, scale=0.25)
        for _ in range(3):
            got = ex.attend(q, k, v, layout, seq, scale=0.25)
            torch.testing.assert_close(got.out, ref.out, rtol=1e-5, atol=1e-5)
        assert plans == [1]
        ex.attend(q, k, v, dataclasses.replace(layout), seq, scale=0.25)  # another object: planned anew
    assert plans == [1, 1]
    with pytest.raises(ValueError, match="work plan"):
        bsa.block_layout_attention(q, k, v, layout, seq, scale=0.25, plan=real(bsa.layout_selection(layout), seq),
                                   tiles=bsa.Tiles(block_m=64))


def test_sparse_kernel_tiles_are_validated_and_reach_the_kernel(monkeypatch):
    import pydantic

    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    for bad, field in (([48, 64, 8, 3], "BLOCK_M"), ([128, 8, 8, 3], "BLOCK_N"), ([128, 64, 0, 3], "num_warps")):
        with pytest.raises(pydantic.ValidationError, match=f"sparse_kernel_tiles.*{field}"):
            FlexConfig(sparse_kernel_tiles=bad)
    q, k, v, seq, layout = _mode_layout("xattention", MODE_CASES["xattention"][1], sk=128)
    import elasticfw.kernels.block_sparse_attention as bsa

    seen = []
    real = bsa.block_layout_attention
    monkeypatch.setattr(bsa, "block_layout_attention", lambda *a, **kw: seen.append(kw["tiles"]) or real(*a, **kw))
    with torch.no_grad():
        FlexExecutor(FlexConfig(sparse_kernel="triton", sparse_kernel_tiles=[32, 16, 4, 2])).attend(
            q, k, v, layout, seq, scale=0.25)
    assert seen == [bsa.Tiles(block_m=32, block_n=16, num_warps=4, num_stages=2)]


def test_default_tiles_follow_the_key_chunk():
    """Groups read in 64-key chunks (64, 192, ...) take 64-row tiles; groups of 128 keys or more of
    them, and groups below 64, keep the 128 x 128 defaults."""
    from elasticfw.kernels.block_sparse_attention import DEFAULT_TILES, SMALL_TILES, default_tiles

    table = torch.zeros(1, 1, 1, 1, dtype=torch.bool)
    expected = {64: SMALL_TILES, 192: SMALL_TILES, 128: DEFAULT_TILES, 1024: DEFAULT_TILES, 32: DEFAULT_TILES,
                16: DEFAULT_TILES}
    for group, tiles in expected.items():
        assert default_tiles(RowSelection(table, group, row_block=group)) == tiles, group
    assert (SMALL_TILES.block_m, SMALL_TILES.block_n) == (64, 64)


def test_64_token_layouts_run_64_row_tiles_and_match_the_definition(monkeypatch):
    """Without ``tiles`` a 64-token block layout runs 64-row tiles (one layout row per tile: its
    work lists hold only what that row selects), and the result meets the float64 definition; through
    the flex executor with no ``sparse_kernel_tiles`` the kernel receives the same configuration."""
    import elasticfw.kernels.block_sparse_attention as bsa
    import elasticfw.kernels.work_lists as wl
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    seq = _seq([0, 0], [256, 190], 256, 256)
    q, k, v, layout = _block_inputs(seq, 4, 2, 2, 16, torch.float32, 64, 0.5, seed=3)
    plans = []
    real_plan = wl.plan_work
    monkeypatch.setattr(wl, "plan_work", lambda *a, **kw: plans.append(real_plan(*a, **kw)) or plans[-1])
    out, lse = bsa.block_layout_attention(q, k, v, layout, seq, scale=0.25)
    assert [(p.block_m, p.block_n) for p in plans] == [(64, 64)]
    # one tile per layout row: a tile's clean list is exactly its row's selected blocks before its
    # own (a 128-row tile over two rows counts only the blocks both select as clean)
    n_clean = plans[0].clean_count
    selected = layout.blocks.expand(2, -1, -1, -1)
    below = torch.tril(selected, diagonal=-1).sum(-1)  # selected blocks strictly before the row's own
    for b, kv_len in enumerate((256, 190)):
        rows = -(-kv_len // 64)
        assert torch.equal(n_clean[b, :, :rows], below[b, :, :rows].int()), b
    ref_out, ref_lse = _brute(q, k, v, layout.blocks, 64, seq, 0.25, row_block=64)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-4)

    seen = []
    real = bsa.block_layout_attention
    monkeypatch.setattr(bsa, "block_layout_attention", lambda *a, **kw: seen.append(kw["tiles"]) or real(*a, **kw))
    with torch.no_grad():
        got = FlexExecutor(FlexConfig(sparse_kernel="triton")).attend(q, k, v, layout, seq, scale=0.25)
    assert seen == [bsa.SMALL_TILES]
    torch.testing.assert_close(got.out.double(), ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("triton_lists", [True, False])
def test_compact_work_lists_attend_as_the_definition(triton_lists, monkeypatch):
    """The compact work plan (one flat list, a start offset per tile; plan_work(compact=True)) from
    either builder: the kernel over it meets the float64 definition for two samples with different
    starts and lengths, GQA over a selection per query head, a sliding window, per-token rows,
    heads left out; the plan holds fewer entries than the dense lists. A kernel that read the flat
    list with the dense strides, or a tile's masked chunks from its start instead of after its clean
    ones, gives other keys."""
    from elasticfw.kernels import block_sparse_attention as bsa
    from elasticfw.kernels import work_lists as wl

    monkeypatch.setattr(wl, "TRITON_WORK_LISTS", triton_lists)
    seq = _seq([0, 30], [150, 140], 110, 150)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 110, 16, generator=g)
    k, v = (torch.randn(2, 2, 150, 16, generator=g) for _ in range(2))
    selected = torch.rand(2, 4, 110, 5, generator=g) < 0.4
    selected[..., 0] = True  # every row selects the first group: clean chunks for the later tiles
    selection = RowSelection(selected, 32, row_block=1, window=24)
    tiles = bsa.Tiles(block_m=32, block_n=16, num_warps=4, num_stages=2)
    plan = wl.plan_work(selection, seq, tiles, compact=True)
    dense = wl.work_lists(selection, seq, 32, 16)
    assert plan.start is not None and plan.masked is plan.clean and plan.clean.dim() == 1
    assert plan.clean.numel() == int(dense[1].sum() + dense[3].sum()) < dense[0].numel()
    assert int(dense[1].sum()) > 0 and int(dense[3].sum()) > 0  # both loops read the flat list
    keep = torch.tensor([[True, True, False, True], [True, False, True, True]])
    out, lse = bsa.row_selection_attention(q, k, v, selection, seq, scale=0.25, keep_heads=keep, tiles=tiles,
                                           plan=plan)
    ref_out, ref_lse = _brute(q, k, v, selected, 32, seq, 0.25, row_block=1, window=24)
    for b in range(2):
        kept = keep[b].nonzero().flatten()
        torch.testing.assert_close(out[b, kept].double(), ref_out[b, kept], rtol=1e-5, atol=1e-5)
        finite = torch.isfinite(ref_lse[b, kept])
        torch.testing.assert_close(lse[b, kept].double()[finite], ref_lse[b, kept][finite], rtol=1e-5, atol=1e-4)
        assert (out[b, ~keep[b]] == 0).all() and torch.isinf(lse[b, ~keep[b]]).all()


def test_plan_work_goes_compact_above_the_threshold(monkeypatch):
    """``compact=None`` takes the compact form exactly when the dense lists would pass
    ``COMPACT_LISTS_ABOVE`` bytes (2 * 4 * B * H * tiles * chunks, counted here by hand), and a
    malformed compact plan is refused by name."""
    from elasticfw.kernels import block_sparse_attention as bsa
    from elasticfw.kernels import work_lists as wl

    seq = SeqInfo.dense(1, 96, 96)
    selection = RowSelection(torch.ones(1, 2, 3, 3, dtype=torch.bool), 32, row_block=32)
    tiles = bsa.Tiles(block_m=32, block_n=32, num_warps=4, num_stages=2)
    assert wl.dense_list_bytes(selection, seq, 32, 32) == 2 * 4 * 1 * 2 * 3 * 3
    assert wl.COMPACT_LISTS_ABOVE == 2 * 2**30
    assert wl.plan_work(selection, seq, tiles).start is None
    monkeypatch.setattr(wl, "COMPACT_LISTS_ABOVE", 144)
    assert wl.plan_work(selection, seq, tiles).start is None  # 144 bytes is not above 144
    monkeypatch.setattr(wl, "COMPACT_LISTS_ABOVE", 143)
    plan = wl.plan_work(selection, seq, tiles)
    assert plan.start is not None and plan.start.tolist() == [[[0, 1, 3], [0 + 6, 7, 9]]]
    q = k = v = torch.randn(1, 2, 96, 16)
    bad = wl.WorkPlan(plan.clean, plan.clean_count, plan.clean.clone(), plan.masked_count, 32, 32, plan.start)
    with pytest.raises(ValueError, match="compact work plan"):
        bsa.row_selection_attention(q, k, v, selection, seq, scale=0.25, tiles=tiles, plan=bad)


def _fake_gpu(monkeypatch, limit, hopper=True):
    """The block-sparse module's view of a GPU with ``limit`` bytes of shared memory per block (the
    kernels still run on the CPU, under the interpreter)."""
    import elasticfw.kernels.block_sparse_attention as bsa

    monkeypatch.setattr(bsa, "shared_memory_limit", lambda device: limit)
    monkeypatch.setattr(bsa, "hopper_or_newer", lambda device: hopper)


def test_a_head_dim_too_wide_for_the_shared_memory_is_named(monkeypatch):
    """Where even 32 x 32 tiles at one stage do not fit ((2 x 32 + 32) x 256 x 4 + 1,024 = 99,328
    bytes for float32 at head dim 256, against a T4's 65,536), ``unsupported`` says so (so that
    ``sparse_kernel: auto`` keeps FlexAttention) and a call raises BackendUnavailableError naming the
    bytes, instead of Triton's launch error; head dim 128 there fits ((64 + 32) x 128 x 4 + 1,024)."""
    from elasticfw.kernels.block_sparse_attention import row_selection_attention, unsupported

    _fake_gpu(monkeypatch, 65_536, hopper=False)
    q = torch.zeros(1, 2, 8, 256)
    assert "99328 bytes of shared memory" in unsupported(q)
    assert unsupported(q[..., :128]) is None
    with pytest.raises(BackendUnavailableError, match="99328 bytes"):
        row_selection_attention(q, q, q, RowSelection(torch.ones(1, 2, 8, 1, dtype=torch.bool), 8),
                                SeqInfo.dense(1, 8, 8), scale=1.0)


@pytest.mark.parametrize("mode", ["streaming_block", "nsa_token", "xattention"])
def test_tiles_shrunk_to_fit_before_planning_match_the_reference(mode, monkeypatch):
    """Under a limit the defaults do not fit (10,000 bytes against (3 x 2 x 128 + 128) x 16 x 4 =
    57,344 at head dim 16 in float32), the flex executor plans the kernel's work for fitted tiles
    (32-row tiles of 32-key chunks, one stage: (2 x 32 + 32) x 64 + 1,024 = 7,168 bytes) and the
    output meets the reference executor's."""
    import elasticfw.kernels.block_sparse_attention as bsa
    from elasticfw.kernels.work_lists import plan_work as real_plan
    from elasticfw.testing.modes import reference_executor
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    name, overrides = MODE_CASES[mode]
    q, k, v, seq, layout = _mode_layout(name, overrides, kv_lens=[128, 86], sk=128)  # 4 tiles of 32 rows
    assert q.shape[-1] == 16 and q.dtype == torch.float32
    _fake_gpu(monkeypatch, 10_000)
    planned = []
    import elasticfw.kernels.work_lists as wl

    monkeypatch.setattr(wl, "plan_work", lambda sel, sq, tiles: planned.append(tiles) or real_plan(sel, sq, tiles))
    assert bsa.planned_tiles(bsa.DEFAULT_TILES, q) == bsa.Tiles(32, 32, 8, 1)
    with torch.no_grad():
        got = FlexExecutor(FlexConfig(sparse_kernel="triton", row_selection_strategy="tiles")).attend(
            q, k, v, layout, seq, scale=0.25)
        ref = reference_executor().attend(q, k, v, layout, seq, scale=0.25)
    assert planned and all(t.block_m == 32 and t.block_n <= 32 and t.num_stages == 1 for t in planned)
    rows = seq.query_valid()[:, None, :].expand_as(ref.lse)
    torch.testing.assert_close(got.out[rows], ref.out[rows], rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref.lse) & rows
    torch.testing.assert_close(got.lse[finite], ref.lse[finite], rtol=1e-5, atol=1e-5)
