"""The `flex` executor: BlockMask conversion, padding/unaligned queries, lse, GQA, poisoning.

The conformance suite (tests/test_mode_conformance.py) already compares `flex` with the
reference for every registered mode; these tests pin the conversion itself. On CPU the
executor runs its emulated path, which computes exactly what the block-sparse kernel computes
from the BlockMask's block lists (full tiles whole, mask_mod in partial tiles), so checking it
against :func:`~elasticfw.attention.layout.dense_mask` checks the lists the GPU kernel reads.
"""

from __future__ import annotations

import os

import pytest
import torch

from elasticfw.attention.flex_mask import (
    bucket_length,
    default_kernel_block_size,
    dense_kernel_mask,
    restrict_heads,
    tile_masks,
    to_block_mask,
)
from elasticfw.attention.layout import BlockLayout, causal_layout, dense_mask, select_heads
from elasticfw.attention.mode import AttentionOutput
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError, UnsupportedInputError
from elasticfw.registry import get_registry
from elasticfw.testing.modes import make_inputs, make_mode, rel_rms
from elasticfw_plugins.executors import flex as flex_module
from elasticfw_plugins.executors.flex import FlexConfig, FlexExecutor


def _reference():
    return get_registry().get("executor", "reference")()


def _seq(q_start: list[int], kv_len: list[int], q_len: int, capacity: int) -> SeqInfo:
    return SeqInfo(torch.tensor(q_start), torch.tensor(kv_len), q_len, capacity)


#: (name, seq): unaligned per-sample q_start, decode, key padding, chunked prefill
SEQS = {
    "prefill": _seq([0, 0], [70, 70], 70, 70),
    "padded_keys": _seq([0, 0], [70, 45], 70, 70),
    "chunk_unaligned": _seq([37, 5], [77, 45], 40, 80),
    "decode": _seq([60, 18], [61, 19], 1, 64),
    "decode_aligned": _seq([63, 31], [64, 32], 1, 64),
}


def _random_layout(seq: SeqInfo, bs: int, heads: int, *, batch1: bool = False, token: bool = True, seed=0):
    """Random blocks; with ``token``, a random half of them partial, with a hashed token mask there
    (outside partial blocks the token mask keeps everything, as the layout contract requires)."""
    g = torch.Generator().manual_seed(seed)
    nqb, nkb = seq.num_query_blocks(bs), seq.num_key_blocks(bs)
    shape = (1 if batch1 else seq.batch, heads, nqb, nkb)
    blocks = torch.rand(shape, generator=g) < 0.6
    if not token:
        return BlockLayout(blocks, bs)
    partial = torch.rand(shape, generator=g) < 0.5
    q_block_start = seq.q_block_start(bs)

    def token_mask(b, h, q, k):
        row = (torch.div(q, bs, rounding_mode="floor") - q_block_start[b]).clamp(0, nqb - 1)
        col = torch.div(k, bs, rounding_mode="floor").clamp(0, nkb - 1)
        in_partial = partial[b * 0 if batch1 else b, h % heads, row, col]
        return ~in_partial | (((q * 7 + k * 3 + h + b) % 5) != 0)

    return BlockLayout(blocks, bs, token_mask, partial)


def _real_kernel_mask(fm, seq: SeqInfo, hq: int) -> torch.Tensor:
    """(B, Hq, Sq, Sk) pairs the kernel computes for real query rows; asserts nothing leaks past Sk."""
    km = dense_kernel_mask(fm, hq)
    km = fm.unpad_rows(km.expand(seq.batch, hq, *km.shape[2:]))
    assert not km[..., seq.kv_capacity :].any(), "a padded key is attended"
    return km[..., : seq.kv_capacity]


def _expected(layout: BlockLayout, seq: SeqInfo, hq: int) -> torch.Tensor:
    return dense_mask(layout, seq, num_heads=hq) & seq.key_valid()[:, None, None, :]


# ---------------------------------------------------------------------------------------
# BlockMask conversion
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_name", list(SEQS))
@pytest.mark.parametrize("kb", [8, 16, 32, 64])
@pytest.mark.parametrize("heads", ["one", "kv", "q"])
def test_block_mask_matches_dense_layout(seq_name, kb, heads):
    """Block lists + mask_mod (as the kernel applies them) give exactly the layout's pairs on real rows,
    for coarsened (kb > bs), equal and refined (kb < bs) kernel blocks and every head granularity."""
    seq = SEQS[seq_name]
    hq, hkv, bs = 6, 2, 16
    layout = _random_layout(seq, bs, {"one": 1, "kv": hkv, "q": hq}[heads], batch1=heads == "one")
    fm = to_block_mask(layout, seq, hq, kernel_block_size=kb)
    assert fm.block_lookup == (kb > bs)
    assert fm.block_mask.kv_num_blocks.shape[1] in (1, hq), "mask heads must be 1 or Hq"
    got = _real_kernel_mask(fm, seq, hq)
    rows = seq.query_valid()[:, None, :, None].expand_as(got)
    want = _expected(layout, seq, hq)
    assert torch.equal(got & rows, want & rows)


def test_block_lists_of_a_causal_layout():
    """Causal, S=256, block 64: the diagonal is the only partial tile, everything below is full."""
    seq = SeqInfo.dense(1, 256, 256)
    fm = to_block_mask(causal_layout(seq, 64), seq, 4)
    bm = fm.block_mask
    assert bm.kv_num_blocks.shape == (1, 1, 4)
    assert bm.kv_num_blocks.flatten().tolist() == [1, 1, 1, 1]
    assert bm.kv_indices[0, 0, :, 0].tolist() == [0, 1, 2, 3]
    assert bm.full_kv_num_blocks.flatten().tolist() == [0, 1, 2, 3]
    assert bm.full_kv_indices[0, 0, 3, :3].tolist() == [0, 1, 2]
    assert not fm.pads_queries and fm.kv_padded_len == 256
    assert bm.q_num_blocks is not None  # the backward's transposed lists


def test_key_padding_makes_tiles_partial_and_drops_empty_ones():
    seq = _seq([0], [150], 256, 256)
    fm = to_block_mask(causal_layout(seq, 64), seq, 1)
    partial, full = tile_masks(fm.block_mask)
    # key block 2 (128..191) holds keys >= 150: partial for every row that reaches it; block 3 is empty
    assert partial[0, 0, :, 2].tolist() == [False, False, True, True]
    assert not full[0, 0, :, 2].any() and not (partial | full)[0, 0, :, 3].any()
    assert full[0, 0, 3].tolist() == [True, True, False, False]


def test_unaligned_queries_are_front_padded_per_sample():
    seq = SEQS["chunk_unaligned"]  # q_start 37 and 5, 40 rows, kernel block 32
    fm = to_block_mask(causal_layout(seq, 16), seq, 2, kernel_block_size=32)
    assert fm.q_offsets == (5, 5) and fm.q_padded_len == 64  # 37 % 32, 5 % 32; ceil((5+40)/32) = 2 tiles
    q = torch.randn(2, 2, 40, 4)
    padded = fm.pad_queries(q)
    assert padded.shape == (2, 2, 64, 4) and torch.equal(padded[:, :, 5:45], q)
    assert torch.equal(fm.unpad_rows(padded), q)
    seq2 = _seq([37, 6], [77, 46], 40, 80)
    fm2 = to_block_mask(causal_layout(seq2, 16), seq2, 2, kernel_block_size=32)
    assert fm2.q_offsets == (5, 6)
    assert torch.equal(fm2.unpad_rows(fm2.pad_queries(q)), q)


def test_decode_pads_one_row_into_one_tile():
    seq = SEQS["decode"]
    fm = to_block_mask(causal_layout(seq, 16), seq, 3, kernel_block_size=32)
    assert fm.q_padded_len == 32 and fm.q_offsets == (60 % 32, 18 % 32)
    partial, full = tile_masks(fm.block_mask)
    assert partial.shape[2] == 1
    # sample 0 at position 60: key tile 0 full, tile 1 (32..63) partial (diagonal + padding past 61)
    assert full[0, 0, 0].tolist() == [True, False] and partial[0, 0, 0].tolist() == [False, True]


def test_select_heads_layout_and_compute_q_blocks_off():
    seq = SEQS["padded_keys"]
    hq = 4
    stream = make_mode(
        "streaming", {"block_size": 16, "sink_tokens": 5, "local_tokens": 20, "granularity": "token"}
    )
    q = torch.randn(2, hq, 70, 8)
    sparse = stream.build_layout(q, q[:, :2], seq)
    use_full = torch.tensor([[True, False, False, True], [False, True, False, False]])
    layout = select_heads(use_full, causal_layout(seq, 16), sparse)
    fm = to_block_mask(layout, seq, hq, kernel_block_size=32, compute_q_blocks=False)
    assert fm.block_mask.q_num_blocks is None
    got = _real_kernel_mask(fm, seq, hq)
    rows = seq.query_valid()[:, None, :, None].expand_as(got)  # padding rows' output is unspecified
    assert torch.equal(got & rows, _expected(layout, seq, hq) & rows)


def test_bad_kernel_block_size_is_rejected():
    seq = SEQS["prefill"]
    with pytest.raises(UnsupportedInputError, match="kernel block size 24"):
        to_block_mask(causal_layout(seq, 16), seq, 2, kernel_block_size=24)
    ex = FlexExecutor(FlexConfig(kernel_block_size=24))
    with pytest.raises(UnsupportedInputError, match="kernel_block_size 24"):
        ex.kernel_block_size(16, "emulated", torch.device("cpu"))
    # FlexAttention's default CUDA kernels need 128-multiples; the check names the size
    with pytest.raises(UnsupportedInputError, match="block size 64 is unsupported"):
        FlexExecutor(FlexConfig(kernel_block_size=64)).kernel_block_size(64, "compiled", torch.device("cuda"))
    assert FlexExecutor().kernel_block_size(64, "compiled", torch.device("cuda")) == 128
    assert (
        FlexExecutor(FlexConfig(kernel_block_size=64, kernel_options={"BLOCK_M": 64})).kernel_block_size(
            64, "compiled", torch.device("cuda")
        )
        == 64
    )
    assert default_kernel_block_size(64) == 128 and default_kernel_block_size(1024) == 128
    assert default_kernel_block_size(96) == 96


def test_bucket_length():
    for n in [1, 63, 64, 65, 1000, 4097, 8192, 12345, 32768, 100000]:
        b = bucket_length(n, 128, 8)
        assert b >= n and b % 128 == 0 and b - n <= max(128, n / 8)
    # at most 8 distinct buckets per octave above 8 * 128 tokens
    assert len({bucket_length(n, 128, 8) for n in range(8193, 16385, 7)}) <= 8
    assert bucket_length(8192, 128, 8) == 8192 and bucket_length(32768, 128, 8) == 32768
    assert bucket_length(1000, 128, 0) == 1024


def test_conversion_is_not_quadratic():
    """128K tokens, block 64 coarsened to 128: only per-tile tensors, built in well under a minute."""
    seq = SeqInfo.dense(1, 131072, 131072)
    layout = make_mode("streaming", {}).build_layout(torch.empty(1, 1, 0, 1), torch.empty(1, 1, 0, 1), seq)
    fm = to_block_mask(layout, seq, 32, kernel_block_size=128, compute_q_blocks=False)
    assert fm.block_mask.kv_indices.shape == (1, 1, 1024, 1024)
    # partial: the diagonal and the window's left edge (64-block window on 128 tiles)
    assert int(fm.block_mask.kv_num_blocks.max()) == 2
    assert int(fm.block_mask.full_kv_num_blocks.max()) == 1 + 2048 // 128 - 1  # sink + inner local tiles


# ---------------------------------------------------------------------------------------
# The executor against the reference
# ---------------------------------------------------------------------------------------


def _inputs(batch, hq, hkv, seq: SeqInfo, dim=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, seq.q_len, dim, generator=g).to(dtype)
    k = torch.randn(batch, hkv, seq.kv_capacity, dim, generator=g).to(dtype)
    v = torch.randn(batch, hkv, seq.kv_capacity, dim, generator=g).to(dtype)
    return q, k, v


def _run(ex, q, k, v, layout, seq, dout=None):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    res = ex.attend(q, k, v, layout, seq, scale=q.shape[-1] ** -0.5)
    if dout is None:
        dout = torch.randn(res.out.shape, generator=torch.Generator().manual_seed(1))
    (res.out.float() * dout).sum().backward()
    return AttentionOutput(res.out.detach(), res.lse.detach()), [t.grad for t in (q, k, v)]


def _compare(layout, seq, hq, hkv, kb=None, dtype=torch.float32):
    q, k, v = _inputs(seq.batch, hq, hkv, seq, dtype=dtype)
    ex = FlexExecutor(FlexConfig(kernel_block_size=kb))
    got, ggrads = _run(ex, q, k, v, layout, seq)
    ref, rgrads = _run(_reference(), q.float(), k.float(), v.float(), layout, seq)
    rows = seq.query_valid()[:, None, :]
    assert got.out.dtype == dtype and got.lse.dtype == torch.float32
    assert got.out.shape == q.shape and got.lse.shape == q.shape[:3]
    out_rows = rows[..., None].expand_as(got.out)
    assert rel_rms(got.out.float()[out_rows], ref.out[out_rows]) < 2e-5
    lse_rows = rows.expand_as(got.lse)
    a, b = got.lse[lse_rows], ref.lse[lse_rows]
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.allclose(
        a[a.isfinite()], b[b.isfinite()], atol=1e-5
    )
    if bool(seq.query_valid().all()):  # padding rows' outputs are meaningless, so are their gradients
        for name, x, y in zip("qkv", ggrads, rgrads):
            assert rel_rms(x.float(), y) < 6e-5, name
    return got


@pytest.mark.parametrize("seq_name", ["padded_keys", "chunk_unaligned", "decode"])
@pytest.mark.parametrize(("hq", "hkv"), [(6, 2), (8, 2), (4, 4)])
def test_gqa_matches_reference(seq_name, hq, hkv):
    seq = SEQS[seq_name]
    _compare(_random_layout(seq, 16, hkv, seed=hq), seq, hq, hkv)


@pytest.mark.parametrize("heads", [1, 6])
@pytest.mark.parametrize("kb", [8, 16, 64])
def test_head_broadcast_and_query_head_layouts(heads, kb):
    seq = SEQS["chunk_unaligned"]
    _compare(_random_layout(seq, 16, heads, batch1=heads == 1, seed=kb), seq, 6, 2, kb=kb)


def test_fully_masked_rows_give_zero_and_minus_inf():
    seq = SeqInfo.dense(1, 64, 64)
    blocks = torch.ones(1, 2, 4, 4, dtype=torch.bool).tril()
    blocks[0, 0, 2] = False  # head 0: query block 2 computes nothing
    layout = BlockLayout(blocks, 16)
    got = _compare(layout, seq, 4, 2)
    dead = got.out[0, :2, 32:48]  # query heads 0 and 1 share KV head 0's layout
    assert torch.equal(dead, torch.zeros_like(dead))
    assert torch.isneginf(got.lse[0, :2, 32:48]).all()
    assert torch.isfinite(got.lse[0, 2:]).all()


def test_lse_gradient_matches_reference():
    """merge_lse-style consumers differentiate through the lse."""
    seq = SEQS["chunk_unaligned"]
    layout = _random_layout(seq, 16, 2, seed=3)
    q, k, v = _inputs(2, 4, 2, seq)
    grads = []
    for ex in (FlexExecutor(), _reference()):
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        res = ex.attend(qq, kk, vv, layout, seq, scale=0.3)
        lse = torch.where(res.lse.isfinite(), res.lse, torch.zeros_like(res.lse))
        (lse * seq.query_valid()[:, None]).sum().backward()
        assert vv.grad is None  # the lse does not depend on v
        grads.append([qq.grad, kk.grad])
    for a, b in zip(*grads):
        assert torch.isfinite(a).all() and rel_rms(a, b) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_outputs(dtype):
    seq = SEQS["padded_keys"]
    layout = _random_layout(seq, 16, 2, seed=5)
    q, k, v = _inputs(2, 4, 2, seq, dtype=dtype)
    got = FlexExecutor().attend(q, k, v, layout, seq, scale=0.35)
    ref = _reference().attend(q.float(), k.float(), v.float(), layout, seq, scale=0.35)
    assert got.out.dtype == dtype
    rows = seq.query_valid()[:, None, :, None].expand_as(got.out)
    assert rel_rms(got.out.float()[rows], ref.out[rows]) < 1e-2


def test_nan_poisoning_and_garbage_padding():
    """Fresh allocations are NaN (deterministic mode fills uninitialised memory): every output and
    lse entry must still be written; garbage in padded keys never reaches real rows."""
    seq = SEQS["chunk_unaligned"]
    layout = _random_layout(seq, 16, 2, seed=7)
    q, k, v = _inputs(2, 4, 2, seq)
    clean = FlexExecutor().attend(q, k, v, layout, seq, scale=0.35)
    prev = torch.are_deterministic_algorithms_enabled()
    prev_fill = torch.utils.deterministic.fill_uninitialized_memory
    try:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        assert torch.isnan(torch.empty(4)).all()  # the poisoning is active
        poisoned = FlexExecutor().attend(q, k, v, layout, seq, scale=0.35)
    finally:
        torch.use_deterministic_algorithms(prev)
        torch.utils.deterministic.fill_uninitialized_memory = prev_fill
    assert torch.isfinite(poisoned.out).all()
    assert not torch.isnan(poisoned.lse).any()
    assert torch.equal(poisoned.out, clean.out)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 45:] = 1e4
    v2[1, :, 45:] = -1e5
    dirty = FlexExecutor().attend(q, k2, v2, layout, seq, scale=0.35)
    rows = seq.query_valid()[:, None, :, None].expand_as(dirty.out)
    assert torch.allclose(dirty.out[rows], clean.out[rows], atol=1e-6)
    assert torch.isfinite(dirty.out).all()  # padding rows stay finite too


# ---------------------------------------------------------------------------------------
# Other implementations and the compile policy
# ---------------------------------------------------------------------------------------


def test_eager_flex_attention_matches_reference():
    """PyTorch's own (uncompiled) flex_attention with our BlockMask: forward only on CPU."""
    seq = SEQS["chunk_unaligned"]
    layout = _random_layout(seq, 16, 2, seed=11)
    q, k, v = _inputs(2, 4, 2, seq)
    ex = FlexExecutor(FlexConfig(implementation="eager"))
    with torch.no_grad():
        got = ex.attend(q, k, v, layout, seq, scale=0.35)
        ref = _reference().attend(q, k, v, layout, seq, scale=0.35)
    rows = seq.query_valid()[:, None, :]
    assert (
        rel_rms(got.out[rows[..., None].expand_as(got.out)], ref.out[rows[..., None].expand_as(ref.out)])
        < 2e-5
    )
    assert torch.allclose(got.lse[rows.expand_as(got.lse)], ref.lse[rows.expand_as(ref.lse)], atol=1e-5)
    with pytest.raises(UnsupportedInputError, match="no backward on CPU"):
        ex.attend(q.requires_grad_(True), k, v, layout, seq, scale=0.35)


def test_auto_picks_emulation_on_cpu_and_compiled_on_cuda():
    ex = FlexExecutor()
    assert ex.implementation(torch.device("cpu")) == "emulated"
    assert ex.implementation(torch.device("cuda")) == "compiled"


def test_recompile_limit_hit_is_loud(monkeypatch):
    from torch._dynamo.exc import FailOnRecompileLimitHit

    seen = {}

    def fake_compiled(dynamic, mode):
        def run(*args, **kwargs):
            seen["limit"] = torch._dynamo.config.recompile_limit
            seen["fail"] = torch._dynamo.config.fail_on_recompile_limit_hit
            raise FailOnRecompileLimitHit("Hard failure due to fail_on_recompile_limit_hit")

        return run

    monkeypatch.setattr(flex_module, "_compiled_flex", fake_compiled)
    seq = SEQS["prefill"]
    q, k, v = _inputs(2, 2, 2, seq)
    ex = FlexExecutor(FlexConfig(implementation="compiled", recompile_limit=33))
    with pytest.raises(BackendUnavailableError, match="recompile limit"):
        ex.attend(q, k, v, causal_layout(seq, 16), seq, scale=0.3)
    assert seen == {"limit": max(33, torch._dynamo.config.recompile_limit), "fail": True}
    assert torch._dynamo.config.fail_on_recompile_limit_hit is False  # restored after the call


def test_compiled_path_recompiles_only_for_new_buckets(monkeypatch):
    """Dynamo's guards on our BlockMask/mask_mod: new layout values at the same bucket reuse the graph;
    a new length bucket or a token-masked layout (new mask_mod code) compiles once more."""
    from torch._dynamo.testing import CompileCounter
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    counter = CompileCounter()  # counts Dynamo frames, runs the graph eagerly: no C++/Triton compile
    compiled = torch.compile(flex_attention, backend=counter, fullgraph=True, dynamic=False)
    monkeypatch.setattr(flex_module, "_compiled_flex", lambda dynamic, mode: compiled)
    ex = FlexExecutor(FlexConfig(implementation="compiled", kernel_block_size=16))
    token = make_mode(
        "streaming", {"block_size": 16, "sink_tokens": 5, "local_tokens": 20, "granularity": "token"}
    )
    frames = []
    for S, layout_of in [
        (100, lambda seq, q: causal_layout(seq, 16)),
        (100, lambda seq, q: _random_layout(seq, 16, 1, token=False)),  # same bucket, other values
        (97, lambda seq, q: _random_layout(seq, 16, 1, token=False, seed=1)),  # 97 and 100 share a bucket
        (140, lambda seq, q: causal_layout(seq, 16)),  # next bucket
        (140, lambda seq, q: token.build_layout(q, q, seq)),  # a token mask: new mask_mod code
        (130, lambda seq, q: token.build_layout(q, q, seq)),
    ]:
        seq = SeqInfo.dense(1, S, S)
        q, k, v = _inputs(1, 4, 2, seq)
        with torch.no_grad():
            ex.attend(q, k, v, layout_of(seq, q[:, :2]), seq, scale=0.3)
        frames.append(counter.frame_count)
    torch._dynamo.reset()
    assert frames == [1, 1, 1, 2, 3, 3]


def test_compiled_path_pads_queries_and_keys_to_their_length_bucket(monkeypatch):
    """Compiled calls pad queries and keys to one of ``bucket_steps_per_octave`` (8) lengths per power
    of two, so near lengths share a kernel: 300 tokens at kernel block 16 are 19 blocks (304), in the
    octave (256, 512] whose 8 buckets lie 32 apart: 320; 310 tokens (20 blocks) pad to 320 as well.
    The rows kept are the reference's."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    padded = []

    def fake_compiled(dynamic, mode):  # PyTorch's uncompiled flex_attention, recording its shapes
        def run(q, k, v, **kwargs):
            padded.append((q.shape[2], k.shape[2]))
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
                return flex_attention(q, k, v, **kwargs)

        return run

    monkeypatch.setattr(flex_module, "_compiled_flex", fake_compiled)
    ex = FlexExecutor(FlexConfig(implementation="compiled", kernel_block_size=16))
    for length in (300, 310):
        seq = SeqInfo.dense(1, length, length)
        q, k, v = _inputs(1, 2, 1, seq)
        with torch.no_grad():
            got = ex.attend(q, k, v, causal_layout(seq, 16), seq, scale=0.3)
            ref = _reference().attend(q, k, v, causal_layout(seq, 16), seq, scale=0.3)
        assert got.out.shape == q.shape and rel_rms(got.out, ref.out) < 2e-5
        assert torch.allclose(got.lse, ref.lse, atol=1e-5)
    assert padded == [(320, 320), (320, 320)]


def test_dynamo_fails_loudly_past_the_limit():
    """The two Dynamo settings the compiled path relies on do what the policy says."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    from torch._dynamo.exc import FailOnRecompileLimitHit

    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        fn(torch.ones(1))
        fn(torch.ones(2))
        with pytest.raises(FailOnRecompileLimitHit):
            fn(torch.ones(3))
    torch._dynamo.reset()


@pytest.mark.skipif(
    not os.environ.get("ELASTICFW_TEST_FLEX_CPU_COMPILE"),
    reason="compiles FlexAttention's CPU kernel (minutes); set ELASTICFW_TEST_FLEX_CPU_COMPILE=1",
)
def test_compiled_cpu_kernel_reads_the_block_lists():
    """A real block-sparse kernel (inductor's CPU template; forward only, no lse on CPU) on our BlockMask."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    seq = SEQS["chunk_unaligned"]
    layout = _random_layout(seq, 16, 2, seed=13)
    q, k, v = _inputs(2, 4, 2, seq)
    for kb in (16, 32):
        fm = to_block_mask(layout, seq, 4, kernel_block_size=kb, compute_q_blocks=False)
        with torch.no_grad():
            out = fm.unpad_rows(
                fn(
                    fm.pad_queries(q),
                    fm.pad_keys(k),
                    fm.pad_keys(v),
                    block_mask=fm.block_mask,
                    scale=0.35,
                    enable_gqa=True,
                )
            )
            ref = _reference().attend(q, k, v, layout, seq, scale=0.35).out
        rows = seq.query_valid()[:, None, :, None].expand_as(out)
        assert rel_rms(out[rows], ref[rows]) < 1e-5


@pytest.mark.parametrize(
    ("field", "bad"),
    [("bucket_steps_per_octave", -1), ("recompile_limit", 0), ("emulation_query_chunk", 0)],
)
def test_config_refuses_values_without_meaning(field, bad):
    """Negative bucket steps, no recompile allowed, empty emulation chunks: refused at validation,
    naming the field (a recipe with them would fail deep inside a run, or loop)."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=field):
        FlexConfig(**{field: bad})


@pytest.mark.parametrize("layout_heads", [1, 6])
@pytest.mark.parametrize("seq_name", ["prefill", "padded_keys", "chunk_unaligned"])
def test_restrict_heads_equals_converting_the_per_head_selection(layout_heads, seq_name):
    """Restricting a converted mask to some heads gives the block lists (and the transposed lists
    the backward reads) of converting the per-head selection ``select_heads(keep, layout, empty)``."""
    seq, hq, bs = SEQS[seq_name], 6, 16
    layout = _random_layout(seq, bs, layout_heads, token=False, seed=3)
    keep = torch.tensor([[True, False, True, True, False, False]])
    empty = BlockLayout(torch.zeros(1, 1, *layout.blocks.shape[2:], dtype=torch.bool), bs)
    want = to_block_mask(select_heads(keep.expand(seq.batch, -1), layout, empty), seq, hq, kernel_block_size=32)
    got = restrict_heads(to_block_mask(layout, seq, hq, kernel_block_size=32, compute_q_blocks=False), keep,
                         compute_q_blocks=True)
    for a, b in zip(tile_masks(got.block_mask), tile_masks(want.block_mask), strict=True):
        assert torch.equal(a, b.expand_as(a))
    assert not tile_masks(got.block_mask)[0][:, ~keep[0]].any()  # dropped heads name no tile
    assert torch.equal(got.block_mask.q_num_blocks, want.block_mask.q_num_blocks.expand_as(got.block_mask.q_num_blocks))
    with pytest.raises(UnsupportedInputError, match="restrict_heads"):
        restrict_heads(got, torch.ones(1, 4, dtype=torch.bool))  # 6 heads cannot become 4


def test_flex_attend_with_keep_heads_gives_empty_rows_for_dropped_heads():
    """The executor's ``keep_heads``: kept heads as the reference over the layout, dropped heads
    zeros with a -inf log-sum-exp (FlexAttention's empty rows)."""
    q, k, v, seq = make_inputs((2, 6, 3, 70, 70, 8), kv_lens=[70, 45])
    layout = _random_layout(seq, 16, 1, token=False, seed=4)
    keep = torch.tensor([[True, False, True, True, False, True]])
    got = FlexExecutor(FlexConfig(implementation="emulated")).attend(q, k, v, layout, seq, scale=0.3, keep_heads=keep)
    ref = _reference().attend(q, k, v, layout, seq, scale=0.3)
    rows = seq.query_valid()[:, None, :]
    kept = keep[0]
    assert rel_rms(got.out[:, kept][rows.expand(-1, int(kept.sum()), -1)],
                   ref.out[:, kept][rows.expand(-1, int(kept.sum()), -1)]) < 1e-5
    assert torch.equal(got.out[:, ~kept], torch.zeros_like(got.out[:, ~kept]))
    assert torch.isneginf(got.lse[:, ~kept]).all()
