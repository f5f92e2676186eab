"""The block-sparse kernel's TMA path (K and V through 2-D tensor descriptors) under Triton's
interpreter: which K/V layouts it takes, and its output against the float64 RowSelection
definition of test_block_sparse_attention for each, with NaN in the cache beyond ``kv_len``."""

from __future__ import annotations

import pytest
import torch
from test_block_sparse_attention import _brute, _seq

from elasticfw.attention.layout import RowSelection
from elasticfw.kernels import triton_unavailable

pytestmark = pytest.mark.skipif(triton_unavailable(torch.device("cpu")) is not None, reason="needs Triton's interpreter")


def _kv(layout: str, batch: int, heads: int, cap: int, dim: int, g: torch.Generator) -> torch.Tensor:
    """(B, H, S, D) keys in one of the memory layouts a model hands over."""
    if layout == "head_major":  # contiguous (B, H, S, D), e.g. a KV cache
        return torch.randn(batch, heads, cap, dim, generator=g).bfloat16()
    if layout == "token_major":  # a (B, S, H, D) projection viewed as (B, H, S, D)
        return torch.randn(batch, cap, heads, dim, generator=g).bfloat16().transpose(1, 2)
    if layout == "fused_slice":  # the keys of a fused (B, S, 3, H, D) QKV projection
        return torch.randn(batch, cap, 3, heads, dim, generator=g).bfloat16()[:, :, 1].transpose(1, 2)
    raise AssertionError(layout)


@pytest.mark.parametrize("layout, rows_h, cols_h", [("head_major", 150, 0), ("token_major", 0, 32), ("fused_slice", 0, 32)])
def test_descriptor_rows_and_columns_of_each_layout(layout, rows_h, cols_h):
    from elasticfw.kernels.block_sparse_attention import kv_descriptor

    k = _kv(layout, 2, 3, 150, 32, torch.Generator().manual_seed(0))
    desc, rows_b, got_rows_h, got_cols_h = kv_descriptor(k, 16)
    assert (got_rows_h, got_cols_h) == (rows_h, cols_h)
    assert rows_b == (3 * 150 if layout == "head_major" else 150)
    # row b * rows_b + h * rows_h + j, columns h * cols_h ..: element (b, h, j, :) of k
    flat = torch.as_strided(k, desc.shape, desc.strides)
    b, h, j = 1, 2, 77
    torch.testing.assert_close(flat[b * rows_b + h * rows_h + j, h * cols_h: h * cols_h + 32], k[b, h, j], rtol=0, atol=0)


def test_layouts_tma_cannot_read_keep_the_pointer_path():
    from elasticfw.kernels.block_sparse_attention import kv_descriptor

    g = torch.Generator().manual_seed(1)
    assert kv_descriptor(torch.randn(1, 2, 64, 32, generator=g), 16) is None  # float32
    assert kv_descriptor(torch.randn(1, 2, 64, 24, generator=g).bfloat16(), 16) is None  # D not a power of two
    assert kv_descriptor(torch.randn(1, 2, 64, 64, generator=g).bfloat16()[..., ::2], 16) is None  # strided D
    # the first 32 keys of 2 of 4 heads: heads neither consecutive rows nor side by side
    assert kv_descriptor(torch.randn(1, 4, 64, 32, generator=g).bfloat16()[:, :2, :32], 16) is None
    every_other = torch.randn(1, 2, 64, 32, generator=g).bfloat16()[:, :, ::2]  # rows of stride 64: readable
    desc, rows_b, rows_h, cols_h = kv_descriptor(every_other, 16)
    assert desc.strides == [64, 1] and rows_h == 32 and cols_h == 0


@pytest.mark.parametrize("layout", ["head_major", "token_major", "fused_slice"])
@pytest.mark.parametrize("tma", [True, False])
def test_kernel_through_descriptors_matches_the_definition(layout, tma, monkeypatch):
    from elasticfw.kernels import block_sparse_attention as bsa
    from elasticfw.kernels.work_lists import work_lists

    monkeypatch.setattr(bsa, "USE_TMA", tma)
    g = torch.Generator().manual_seed(5)
    # sample 1: a chunk at position 20, keys past 65 unwritten; 100 keys, not a multiple of the 16-key
    # chunk (the last chunk reads past the end of the cache); 3 tiles of 32 rows
    seq = _seq([0, 20], [100, 65], 80, 100)
    q = torch.randn(2, 4, 80, 32, generator=g).bfloat16()
    k, v = _kv(layout, 2, 2, 100, 32, g), _kv(layout, 2, 2, 100, 32, g)
    k[1, :, 65:] = float("nan")
    v[1, :, 65:] = float("nan")
    assert (bsa.kv_descriptor(k, 16) is not None) == tma
    selected = torch.rand(2, 2, 80, 4, generator=g) < 0.5
    selected[:, :, 32:, 0] = True  # rows past the first tile select group 0: clean chunks, the TMA loop
    _, n_clean, _, n_masked = work_lists(RowSelection(selected, 32), seq, 32, 16)
    assert n_clean.sum() > 0 and n_masked.sum() > 0  # both loops run (only the clean one loads through TMA)
    out, lse = bsa.row_selection_attention(q, k, v, RowSelection(selected, 32), seq, scale=32**-0.5,
                                           tiles=bsa.Tiles(block_m=32, block_n=16, num_warps=4, num_stages=2))
    ref_out, ref_lse = _brute(q, k, v, selected, 32, seq, 32**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_gathered_attention_through_descriptors_matches_the_definition(layout):
    from elasticfw.kernels import block_sparse_attention as bsa
    from elasticfw.kernels.gather_attention import gathered_selection_attention

    g = torch.Generator().manual_seed(6)
    seq = _seq([0, 20], [150, 97], 130, 150)
    q = torch.randn(2, 4, 130, 32, generator=g).bfloat16()
    k, v = _kv(layout, 2, 2, 150, 32, g), _kv(layout, 2, 2, 150, 32, g)
    k[1, :, 97:] = float("nan")
    v[1, :, 97:] = float("nan")
    assert bsa.kv_descriptor(k, 16) is not None
    selected = torch.rand(2, 2, 130, 5, generator=g) < 0.5
    out, _ = gathered_selection_attention(q, k, v, RowSelection(selected, 32), seq, scale=32**-0.5,
                                          tiles=bsa.Tiles(block_m=16, block_n=16, num_warps=4, num_stages=2))
    ref_out, _ = _brute(q, k, v, selected, 32, seq, 32**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)
