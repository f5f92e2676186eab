"""The row-selection attention kernel (elasticfw.kernels.row_select_attention) under Triton's
interpreter: against a float64 attention written here from the RowSelection definition, and
through the flex executor on per-token MoBA layouts against the reference executor."""

from __future__ import annotations

import math

import pytest
import torch

from elasticfw.attention.layout import RowSelection
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import triton_unavailable

DEV = torch.device("cpu")
pytestmark = pytest.mark.skipif(triton_unavailable(DEV) is not None, reason="needs Triton's interpreter")


def _seq(q_start, kv_len, q_len, cap):
    return SeqInfo(torch.tensor(q_start), torch.tensor(kv_len), q_len, cap)


def _brute(q, k, v, selected, group_size, seq, scale):
    """float64: row i of head h sees key j iff its selection holds j's group, j <= position, j < kv_len."""
    batch, hq, sq, dim = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    out = torch.zeros(batch, hq, sq, dim, dtype=torch.float64)
    lse = torch.full((batch, hq, sq), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(hq):
            hs = h // (hq // selected.shape[1])
            kh = h // (hq // hkv)
            for i in range(sq):
                pos = int(seq.q_start[b]) + i
                keys = [j for j in range(sk) if j <= pos and j < int(seq.kv_len[b])
                        and bool(selected[min(b, selected.shape[0] - 1), hs, i, j // group_size])]
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
    from elasticfw.kernels.row_select_attention import row_selection_attention

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


def test_keep_heads_and_a_shared_selection():
    from elasticfw.kernels.row_select_attention import row_selection_attention

    seq = _seq([0, 10], [140, 130], 120, 140)
    q, k, v, selected = _inputs(seq, 4, 2, 16, torch.float32, 5, 32, 1, seed=3)
    shared = selected[:1]  # one table for both samples
    keep = torch.tensor([[True, False, True, False]])
    out, lse = row_selection_attention(q, k, v, RowSelection(shared, 32), seq, scale=0.25, keep_heads=keep)
    ref_out, ref_lse = _brute(q, k, v, shared, 32, seq, 0.25)
    torch.testing.assert_close(out[:, [0, 2]].double(), ref_out[:, [0, 2]], rtol=1e-5, atol=1e-5)
    assert (out[:, [1, 3]] == 0).all() and torch.isinf(lse[:, [1, 3]]).all()


def test_unsupported_inputs_are_named():
    from elasticfw.kernels.row_select_attention import row_selection_attention, unsupported

    q = torch.zeros(1, 2, 8, 16, dtype=torch.float64)
    assert "float64" in unsupported(q)
    with pytest.raises(BackendUnavailableError, match="float64"):
        row_selection_attention(q, q, q, RowSelection(torch.ones(1, 2, 8, 1, dtype=torch.bool), 8),
                                SeqInfo.dense(1, 8, 8), scale=1.0)


# -- through the flex executor, on per-token MoBA layouts -----------------------------------------


def _moba_case(kv_lens=None, sq=None, seed=0):
    from elasticfw.testing.modes import make_inputs, make_mode

    sk = 192
    q, k, v, seq = make_inputs((2, 4, 2, sq or sk, sk, 16), seed=seed, kv_lens=kv_lens)
    mode = make_mode("moba", {"moba_block_size": 32, "top_k": 3, "block_size": 16, "planner": "torch"})
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
    import elasticfw.kernels.row_select_attention as rsa

    real = rsa.row_selection_attention
    monkeypatch.setattr(rsa, "row_selection_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ex = FlexExecutor(FlexConfig(row_selection_kernel="triton"))
    with torch.no_grad():
        got = ex.attend(q, k, v, layout, seq, scale=0.25)
        ref = reference_executor().attend(q, k, v, layout, seq, scale=0.25)
    assert calls == [1]
    rows = seq.query_valid()[:, None, :]
    torch.testing.assert_close(got.out[rows.expand_as(got.lse)], ref.out[rows.expand_as(ref.lse)], rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(ref.lse) & rows
    torch.testing.assert_close(got.lse[finite], ref.lse[finite], rtol=1e-5, atol=1e-5)


def test_backend_choice_of_row_selection_layouts(monkeypatch):
    from elasticfw.attention.layout import select_heads, with_window
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    q, k, v, seq, layout = _moba_case()
    import elasticfw.kernels.row_select_attention as rsa

    def refuse(*a, **kw):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(rsa, "row_selection_attention", refuse)
    with torch.no_grad():  # `auto` on a CPU and the default `flex` keep FlexAttention
        FlexExecutor(FlexConfig(row_selection_kernel="auto")).attend(q, k, v, layout, seq, scale=0.25)
        FlexExecutor(FlexConfig()).attend(q, k, v, layout, seq, scale=0.25)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with pytest.raises(BackendUnavailableError, match="no backward.*row_selection_kernel"):
        FlexExecutor(FlexConfig(row_selection_kernel="triton")).attend(*leaves, layout, seq, scale=0.25)
    # transformations that change the pairs drop the row selection (an executor may trust it)
    assert with_window(layout, seq, 40).row_selection is None
    assert select_heads(torch.ones(2, 4, dtype=torch.bool), layout, layout).row_selection is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_32k_moba_token_layer_matches_flexattention():
    """Per-token MoBA at its paper defaults, 32K tokens, bf16: the kernel against the compiled
    FlexAttention run of the same layout (both against float32 references elsewhere)."""
    from elasticfw.bench.inputs import structured_qkv
    from elasticfw.testing.modes import make_mode
    from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor

    n = 32768
    q, k, v = (t.to("cuda", torch.bfloat16) for t in structured_qkv(1, 8, 2, n, 128, seed=0))
    seq = SeqInfo.dense(1, n, n, device="cuda")
    with torch.no_grad():
        layout = make_mode("moba", {}).build_layout(q, k, seq)
        assert layout.row_selection is not None
        got = FlexExecutor(FlexConfig(row_selection_kernel="triton")).attend(q, k, v, layout, seq, scale=128**-0.5)
        ref = FlexExecutor(FlexConfig()).attend(q, k, v, layout, seq, scale=128**-0.5)
    rel = ((got.out.float() - ref.out.float()).norm() / ref.out.float().norm()).item()
    assert rel < 1e-2, rel
    torch.testing.assert_close(got.lse, ref.lse, rtol=1e-3, atol=1e-2)
