"""The block-sparse attention kernel on a GPU at long lengths, against compiled FlexAttention
over the same layouts (each checked against float32 references in the CPU tests)."""

from __future__ import annotations

import pytest
import torch

from elasticfw.attention.seq import SeqInfo

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _compare(mode_name, overrides, n, hq=8, hkv=2, **flex):
    from elasticfw.bench.inputs import structured_qkv
    from elasticfw.testing.modes import make_mode
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    q, k, v = (t.to("cuda", torch.bfloat16) for t in structured_qkv(1, hq, hkv, n, 128, seed=0))
    seq = SeqInfo.dense(1, n, n, device="cuda")
    with torch.no_grad():
        layout = make_mode(mode_name, overrides).build_layout(q, k, seq)
        got = FlexExecutor(FlexConfig(sparse_kernel="triton", **flex)).attend(q, k, v, layout, seq, scale=128**-0.5)
        ref = FlexExecutor(FlexConfig(sparse_kernel="flex")).attend(q, k, v, layout, seq, scale=128**-0.5)
    rel = ((got.out.float() - ref.out.float()).norm() / ref.out.float().norm()).item()
    assert rel < 1e-2, rel
    torch.testing.assert_close(got.lse, ref.lse, rtol=1e-3, atol=1e-2)
    return layout


def test_gpu_32k_moba_token_layer_matches_flexattention():  # the kernel's 128-key chunks of 1024-key groups
    layout = _compare("moba", {}, 32768, row_selection_strategy="tiles")
    assert layout.row_selection is not None


@pytest.mark.parametrize("merge", ["passes", "entries"])
def test_gpu_32k_moba_token_layer_gathered_matches_flexattention(merge):  # upstream MoBA's query gathering
    layout = _compare("moba", {}, 32768, gather_merge=merge)  # the default strategy
    assert layout.row_selection is not None


@pytest.mark.parametrize("mode", ["xattention", "nsa", "streaming", "full"])
def test_gpu_32k_block_layouts_match_flexattention(mode):
    from elasticfw.kernels.block_sparse_attention import unsupported_layout

    layout = _compare(mode, {}, 32768)
    assert unsupported_layout(layout) is None


@pytest.mark.parametrize("mode", ["xattention", "nsa"])
def test_gpu_32k_compact_work_lists_match_flexattention(mode, monkeypatch):
    """The compact work lists (every plan compact: the threshold at 0) through the flex executor."""
    from elasticfw.kernels import work_lists as wl

    plans = []
    real = wl.plan_work
    monkeypatch.setattr(wl, "COMPACT_LISTS_ABOVE", 0)
    monkeypatch.setattr(wl, "plan_work", lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])
    _compare(mode, {}, 32768)
    assert plans and all(p.start is not None for p in plans)


def test_gpu_unaligned_chunk_and_padding():
    """A chunked prefill whose rows start off the block grid, and a padded sample."""
    from elasticfw.testing.modes import make_mode
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 3000, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 9000, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    seq = SeqInfo(torch.tensor([5999, 2000], device="cuda"), torch.tensor([8999, 4100], device="cuda"), 3000, 9000)
    with torch.no_grad():
        layout = make_mode("xattention", {}).build_layout(q, k, seq)
        got = FlexExecutor(FlexConfig(sparse_kernel="triton")).attend(q, k, v, layout, seq, scale=128**-0.5)
        ref = FlexExecutor(FlexConfig(sparse_kernel="flex")).attend(q, k, v, layout, seq, scale=128**-0.5)
    rows = seq.query_valid()[:, None, :, None]
    diff = (got.out.float() - ref.out.float()) * rows
    assert (diff.norm() / (ref.out.float() * rows).norm()).item() < 1e-2


def test_gpu_token_major_kv_through_tma_with_unwritten_cache():
    """K/V as a model's (B, S, H, D) projections viewed as (B, H, S, D), read through TMA
    descriptors, with NaN in sample 1's cache past its kv_len (keys it must not see)."""
    from elasticfw.kernels.block_sparse_attention import kv_descriptor
    from elasticfw.testing.modes import make_mode
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 8, 3000, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(2, 9000, 2, 128, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(2, 9000, 2, 128, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    seq = SeqInfo(torch.tensor([5999, 2000], device="cuda"), torch.tensor([8999, 4100], device="cuda"), 3000, 9000)
    k_ref, v_ref = k.contiguous(), v.contiguous()  # the reference's copies keep finite keys there
    k[1, :, 4100:] = float("nan")
    v[1, :, 4100:] = float("nan")
    assert kv_descriptor(k, 128) is not None and kv_descriptor(v, 128) is not None
    with torch.no_grad():
        layout = make_mode("xattention", {}).build_layout(q, k_ref, seq)
        got = FlexExecutor(FlexConfig(sparse_kernel="triton")).attend(q, k, v, layout, seq, scale=128**-0.5)
        ref = FlexExecutor(FlexConfig(sparse_kernel="flex")).attend(q, k_ref, v_ref, layout, seq, scale=128**-0.5)
    rows = seq.query_valid()[:, None, :, None]
    assert not (got.out * rows).isnan().any()
    diff = (got.out.float() - ref.out.float()) * rows
    assert (diff.norm() / (ref.out.float() * rows).norm()).item() < 1e-2


@pytest.mark.parametrize("n", [32768, 131072])
def test_gpu_routed_decode_step_matches_the_reference(n):
    """The decode kernel on a routed FA-SSA layer (full heads and streaming heads, one launch) at
    32K and 128K cached keys, two samples at different positions with unwritten cache past the
    shorter one, against the reference executor's float32 masked attention over the combined layout."""
    from elasticfw.attention.mode import routed_layout
    from elasticfw.testing.modes import make_mode, reference_executor
    from elasticfw_plugins.executors.split import SplitConfig, SplitExecutor

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 32, 1, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(2, 8, n, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    short = n // 2 + 77
    k[1, :, short:] = float("nan")
    v[1, :, short:] = float("nan")
    seq = SeqInfo(torch.tensor([n - 1, short - 1], device="cuda"), torch.tensor([n, short], device="cuda"), 1, n)
    hard = torch.zeros(2, 32, dtype=torch.bool, device="cuda")
    hard[0, 4:] = True  # sample 0: KV head 0 full, the rest streaming
    hard[1, ::2] = True  # sample 1: every other query head streaming
    with torch.no_grad():
        layouts = (make_mode("full", {}).build_layout(q, k, seq), make_mode("streaming", {}).build_layout(q, k, seq))
        got = SplitExecutor(SplitConfig(decode_sparse="kernel")).attend_routed(
            q, k, v, seq, hard=hard, layouts=layouts, scale=128**-0.5)
        ref = reference_executor().attend(q.float(), k.nan_to_num().float(), v.nan_to_num().float(),
                                          routed_layout(hard, layouts, seq), seq, scale=128**-0.5)
    rel = ((got.out.float() - ref.out).norm() / ref.out.norm()).item()
    assert rel < 1e-2, rel
    torch.testing.assert_close(got.lse, ref.lse, rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("mode, config", [("moba", {"decode": "sparse"}), ("nsa", {}),
                                          ("xattention", {"decode": "sparse"})])
def test_gpu_32k_decode_layouts_through_the_flex_executor(mode, config):
    """A decode step of each data-dependent mode's layout through the flex executor (the decode
    kernel) against FlexAttention over the same layout (``decode: sparse``: a selected step, not the
    dense one MoBA and XAttention decode by default)."""
    from elasticfw.bench.inputs import structured_qkv
    from elasticfw.testing.modes import make_mode
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    n = 32768
    q, k, v = (t.to("cuda", torch.bfloat16) for t in structured_qkv(1, 8, 2, n, 128, seed=0))
    q = q[:, :, -1:]
    seq = SeqInfo.dense(1, 1, n, device="cuda")
    with torch.no_grad():
        layout = make_mode(mode, config).build_layout(q, k, seq)
        assert not layout.dense_causal
        got = FlexExecutor(FlexConfig(sparse_kernel="triton")).attend(q, k, v, layout, seq, scale=128**-0.5)
        ref = FlexExecutor(FlexConfig(sparse_kernel="flex")).attend(q, k, v, layout, seq, scale=128**-0.5)
    rel = ((got.out.float() - ref.out.float()).norm() / ref.out.float().norm()).item()
    assert rel < 1e-2, rel
    torch.testing.assert_close(got.lse, ref.lse, rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("dim", [64, 80, 96, 256])
@pytest.mark.parametrize("mode", ["streaming", "moba"])
def test_gpu_head_dims_of_other_families(dim, mode):
    """Head dims other than Llama's 128 (80 and 96 pad to 128 and read no TMA; 256, Gemma's, holds
    the most shared memory per stage) through the flex executor's Triton kernels (MoBA per token:
    gathered rows; streaming: block-sparse), against float32 SDPA over the layout's pairs."""
    from elasticfw.attention.layout import dense_mask
    from elasticfw.bench.inputs import structured_qkv
    from elasticfw.testing.modes import make_mode
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    n, hq, hkv = 4096, 4, 2
    q, k, v = (t.to("cuda", torch.bfloat16) for t in structured_qkv(1, hq, hkv, n, dim, seed=1))
    seq = SeqInfo.dense(1, n, n, device="cuda")
    overrides = {"moba_block_size": 512, "top_k": 3} if mode == "moba" else {"sink_tokens": 128, "local_tokens": 1024}
    with torch.no_grad():
        layout = make_mode(mode, overrides).build_layout(q, k, seq)
        got = FlexExecutor(FlexConfig(sparse_kernel="triton")).attend(q, k, v, layout, seq, scale=dim**-0.5)
        mask = dense_mask(layout, seq, num_heads=hq)
        kk, vv = (t.float().repeat_interleave(hq // hkv, 1) for t in (k, v))
        want = torch.nn.functional.scaled_dot_product_attention(q.float(), kk, vv, attn_mask=mask, scale=dim**-0.5)
    assert mask.float().mean() < 0.6  # sparse: the kernel's selection matters
    rel = ((got.out.float() - want).norm() / want.norm()).item()
    assert rel < 1e-2, rel
