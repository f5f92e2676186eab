"""XAttention's Triton planning kernels against the torch reference and against loops.

* The fused antidiagonal estimator (``elasticfw.kernels.xattention_estimate``) against
  ``iter_antidiagonal_mass`` (the reference) and against a float64 brute force written here from
  the definition (strided tiles summed along their antidiagonals, softmax over the causal strided
  keys, probabilities summed per block): prefill, padding, chunked prefill, decode, GQA, scale,
  chunking, dtypes, tile sizes, group sizes that are not powers of two, strided inputs.
* The threshold selection kernel (``elasticfw.kernels.xattention_select``) against
  ``select_blocks``: exactly, on masses whose sums are exact in float32 (ties, crossings that land
  on the threshold), and on random masses.
* ``XAttention.build_layout`` with ``estimator: triton`` against ``estimator: torch``, and the
  backend switch itself.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``), so shapes are small. The tests marked ``gpu`` run the kernels at 32K.
"""

from __future__ import annotations

import pytest
import torch

import elasticfw.kernels as kernels_module

pytest.importorskip("triton")

from mode_definitions.xattention import brute_mass

from elasticfw.attention.patterns import antidiagonal_mass, iter_antidiagonal_mass
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import triton_unavailable
from elasticfw.testing.modes import make_inputs, make_mode
from elasticfw_plugins.modes import xattention as xa
from elasticfw_plugins.modes.xattention import XAttentionConfig, select_blocks

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.skipif(
    triton_unavailable(DEV) is not None, reason=f"Triton kernels cannot run here: {triton_unavailable(DEV)}"
)


def _triton_mass(q, k, seq, **kw):
    from elasticfw.kernels.xattention_estimate import antidiagonal_mass_triton

    return antidiagonal_mass_triton(q, k, seq, **kw)


def _select_triton(mass, row_block, threshold, **kw):
    from elasticfw.kernels.xattention_select import select_blocks_triton

    return select_blocks_triton(mass, row_block, threshold, **kw)


# -- brute force ---------------------------------------------------------------------------------


def _inputs(seq, hq, hkv, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq.batch, hq, seq.q_len, dim, generator=g)
    k = torch.randn(seq.batch, hkv, seq.kv_capacity, dim, generator=g)
    # a few strong keys, so the masses are far from uniform
    k[:, :, :: max(1, seq.kv_capacity // 7)] += 1.5 * q.mean((0, 1, 2))
    return q.to(DEV, dtype), k.to(DEV, dtype)


def _seq(q_start, kv_len, q_len, cap):
    return SeqInfo(torch.tensor(q_start, device=DEV), torch.tensor(kv_len, device=DEV), q_len, cap)


# name: (SeqInfo factory, Hq, Hkv, head_dim, block, stride, dtype, scale, chunk_size, tiles)
CASES = {
    "prefill": (lambda: SeqInfo.dense(1, 160, 160, DEV), 4, 2, 16, 16, 4, torch.float32, None, 16384, {}),
    "right_padded": (lambda: _seq([0, 0], [160, 101], 160, 160), 2, 1, 16, 16, 4, torch.float32, None, 16384, {}),
    # a left-padded batch in canonical coordinates: queries end where each sample ends, unaligned starts
    "ends_aligned": (lambda: _seq([112, 53], [160, 101], 48, 160), 4, 2, 16, 16, 4, torch.float32, None, 16384, {}),
    # chunked prefill: unaligned q_start, sample 1's last rows past its kv_len (padding rows)
    "chunked": (lambda: _seq([37, 50], [150, 90], 60, 150), 4, 2, 16, 32, 8, torch.float32, None, 16384, {}),
    "decode": (lambda: _seq([149, 96], [150, 97], 1, 150), 4, 1, 16, 16, 4, torch.float32, None, 16384, {}),
    "gqa1": (lambda: _seq([0], [130], 130, 130), 2, 2, 16, 16, 4, torch.float32, None, 16384, {}),
    "gqa4": (lambda: _seq([0], [130], 130, 130), 4, 1, 16, 16, 4, torch.float32, None, 16384, {}),
    "scale": (lambda: _seq([21], [140], 119, 140), 2, 1, 16, 16, 4, torch.float32, 0.37, 16384, {}),
    "small_chunks": (lambda: _seq([0, 30], [200, 170], 140, 200), 2, 1, 16, 16, 4, torch.float32, None, 32, {}),
    "bf16": (lambda: _seq([0, 0], [160, 120], 160, 160), 4, 2, 32, 32, 8, torch.bfloat16, None, 16384, {}),
    "fp16": (lambda: _seq([13], [150], 137, 150), 2, 1, 16, 16, 4, torch.float16, None, 16384, {}),
    # several row and key tiles per sample (16 strided rows x 16 strided keys)
    "small_tiles": (
        lambda: _seq([0, 17], [190, 160], 150, 190), 2, 1, 16, 16, 4, torch.float32, None, 64,
        {"block_m": 16, "block_n": 16},
    ),
    # block / stride = 3 (padded to 4 per tile), head_dim 20 (padded to 32)
    "group3": (
        lambda: _seq([5, 40], [150, 100], 90, 150), 2, 1, 20, 24, 8, torch.float32, None, 48,
        {"block_m": 16, "block_n": 16},
    ),
    # block / stride = 1 (stride = block), head_dim 8 (padded to 16)
    "group1": (lambda: _seq([0], [100], 100, 100), 2, 1, 8, 16, 16, torch.float32, None, 16384, {}),
    # a sample of padding rows only (q_start >= kv_len), kv_len and q_start in one stride: no mass
    # (the kernel counted the strided row holding q_start as real, a uniform row of mass 1)
    "padding_only_sample": (lambda: _seq([9, 9], [9, 12], 6, 16), 4, 1, 16, 32, 8, torch.float32, None, 16384, {}),
    "padding_only_sample_in_a_batch": (
        lambda: _seq([64, 62], [128, 60], 64, 128), 2, 1, 16, 16, 8, torch.float32, None, 16384, {},
    ),
}


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_mass_matches_reference_and_brute_force(name, passes):
    make_seq, hq, hkv, dim, bs, s, dtype, scale, chunk, tiles = CASES[name]
    seq = make_seq()
    q, k = _inputs(seq, hq, hkv, dim, dtype)
    got = _triton_mass(q, k, seq, block_size=bs, stride=s, chunk_size=chunk, scale=scale, passes=passes, **tiles)
    ref = antidiagonal_mass(q, k, seq, block_size=bs, stride=s, chunk_size=chunk, scale=scale)
    assert got.shape == ref.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    brute = brute_mass(q, k, seq, bs, s, scale)
    torch.testing.assert_close(got.cpu().double(), brute, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("passes", [1, 2])
def test_running_max_rising_in_every_key_tile(passes):
    """Scores that grow with the key position, so the row maximum rises in every key tile and the
    single pass must rescale each tile's kept sums by its own running maximum."""
    seq = _seq([0, 9], [256, 230], 240, 256)
    g = torch.Generator().manual_seed(5)
    direction = torch.randn(16, generator=g)
    q = (direction + 0.1 * torch.randn(2, 2, 240, 16, generator=g)).to(DEV)
    ramp = torch.linspace(0, 3, 256)[None, None, :, None]
    k = (ramp * direction + 0.1 * torch.randn(2, 1, 256, 16, generator=g)).to(DEV)
    kw = dict(block_size=16, stride=4, chunk_size=64, block_m=16, block_n=16)
    got = _triton_mass(q, k, seq, passes=passes, **kw)
    ref = antidiagonal_mass(q, k, seq, block_size=16, stride=4, chunk_size=64)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.cpu().double(), brute_mass(q, k, seq, 16, 4, None), rtol=1e-5, atol=1e-6)


def test_chunks_match_the_reference_iterator():
    seq = _seq([0, 30], [200, 170], 140, 200)
    q, k = _inputs(seq, 2, 1, 16, torch.float32, seed=3)
    kw = dict(block_size=16, stride=4, chunk_size=48)
    ref = list(iter_antidiagonal_mass(q, k, seq, **kw))
    got = list(iter_antidiagonal_mass(q, k, seq, backend="triton", **kw))
    assert [(t0, t1) for t0, t1, _ in got] == [(t0, t1) for t0, t1, _ in ref]
    for (_, _, a), (_, _, b) in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_strided_inputs_are_read_in_place():
    """q and k in (B, S, H, D) memory, seen as (B, H, S, D) views: same masses as contiguous ones."""
    seq = _seq([0, 0], [150, 111], 150, 150)
    q, k = _inputs(seq, 4, 2, 16, torch.float32, seed=4)
    qt, kt = q.transpose(1, 2).contiguous().transpose(1, 2), k.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous() and not kt.is_contiguous()
    got = _triton_mass(qt, kt, seq, block_size=16, stride=4)
    torch.testing.assert_close(got, _triton_mass(q, k, seq, block_size=16, stride=4), rtol=0, atol=0)
    torch.testing.assert_close(got, antidiagonal_mass(q, k, seq, block_size=16, stride=4), rtol=1e-5, atol=1e-6)


def test_padding_never_reaches_real_rows():
    """Garbage in padding query rows and keys changes nothing (they are read as zero vectors)."""
    seq = _seq([0, 0], [150, 101], 150, 150)
    q, k = _inputs(seq, 2, 1, 16, torch.float32, seed=5)
    q2, k2 = q.clone(), k.clone()
    q2[1, :, 101:] = 1e4
    k2[1, :, 101:] = -1e4
    a = _triton_mass(q, k, seq, block_size=16, stride=4)
    b = _triton_mass(q2, k2, seq, block_size=16, stride=4)
    assert torch.equal(a, b)
    # the last real block of sample 1 (positions 96..111, real up to 100) holds two real strided rows
    assert a[1, :, 6].sum(-1).cpu().tolist() == pytest.approx([2.0, 2.0], abs=1e-5)


def test_unsupported_inputs_are_named():
    from elasticfw.kernels.xattention_estimate import unsupported

    q = torch.zeros(1, 2, 32, 16, dtype=torch.float64, device=DEV)
    assert "float64" in unsupported(q, block_size=16, stride=4)
    q = torch.zeros(1, 2, 32, 16, device=DEV)
    assert "strided rows per block" in unsupported(q, block_size=1024, stride=4)
    assert unsupported(q, block_size=16, stride=4) is None
    with pytest.raises(BackendUnavailableError, match="float64"):
        _triton_mass(q.double(), q.double(), SeqInfo.dense(1, 32, 32, DEV), block_size=16, stride=4)
    for block_size in (0, -16):  # a ZeroDivisionError / RuntimeError before
        assert "positive multiple" in unsupported(q, block_size=block_size, stride=4)
        with pytest.raises(ValueError, match=f"block_size={block_size} must be a positive multiple of stride=4"):
            _triton_mass(q, q, SeqInfo.dense(1, 32, 32, DEV), block_size=block_size, stride=4)
        with pytest.raises(ValueError, match="positive multiple"):
            antidiagonal_mass(q, q, SeqInfo.dense(1, 32, 32, DEV), block_size=block_size, stride=4)


# -- selection -----------------------------------------------------------------------------------


def _selection_cases():
    """Per NKB, one batch of three kinds of masses: multiples of 1/8 (every sum is exact in
    float32, so ties and crossings landing exactly on the threshold abound), random ones, and
    zeros (some -0.0); row blocks below, at and past the last key block."""
    g = torch.Generator().manual_seed(0)
    for nkb in (1, 17, 40):
        heads, rows = 2, 9
        dyadic = torch.randint(0, 5, (heads, rows, nkb), generator=g).float() / 8
        random = torch.rand(heads, rows, nkb, generator=g) ** 4
        zeros = torch.zeros(heads, rows, nkb)
        zeros[..., ::3] = -0.0
        row_block = torch.randint(0, nkb + 3, (3, rows), generator=g)
        yield nkb, torch.stack([dyadic, random, zeros]), row_block


@pytest.mark.parametrize("threshold", [0.05, 0.3, 0.5, 0.9, 0.999, 1.0])
def test_selection_matches_select_blocks_exactly(threshold):
    for nkb, mass, row_block in _selection_cases():
        mass, row_block = mass.to(DEV), row_block.to(DEV)
        ref = select_blocks(mass, row_block, threshold)
        got = _select_triton(mass, row_block, threshold)
        assert torch.equal(got, ref), f"NKB {nkb}: {(got != ref).sum(-1).tolist()} blocks differ per row"
        narrow = _select_triton(mass, row_block, threshold, max_row_block=int(row_block.max()))
        assert torch.equal(narrow, ref), f"NKB {nkb} (max_row_block)"


def test_bisection_selection_on_wide_rows_with_many_ties():
    """Rows of 300 blocks (the bisection runs its 31 steps over every bit pattern) whose masses take
    8 values only, so that the boundary level holds many tied candidates: kept by index order."""
    g = torch.Generator().manual_seed(3)
    mass = (torch.randint(0, 8, (2, 6, 300), generator=g).float() / 64).to(DEV)
    row_block = torch.randint(150, 300, (1, 6), generator=g).to(DEV)
    for threshold in (0.2, 0.5, 0.8, 0.95):
        ref = select_blocks(mass[None], row_block, threshold)
        assert torch.equal(_select_triton(mass[None], row_block, threshold), ref), threshold


def test_selection_exact_crossing_and_ties():
    """Row: forced 0.25 (block 0) + 0.125 (diagonal 5); candidates 0.25, 0.25 (tied), 0.125, 0; total 1."""
    mass = torch.tensor([0.25, 0.25, 0.25, 0.125, 0.0, 0.125, 0.0, 0.0]).view(1, 1, 1, 8).to(DEV)
    rows = torch.tensor([[5]], device=DEV)
    expected = {
        0.3: [True, False, False, False, False, True, False, False],  # forced 0.375 already >= 0.3
        0.5: [True, True, False, False, False, True, False, False],  # 0.375 < 0.5 keeps block 1, the lower tie
        0.625: [True, True, False, False, False, True, False, False],  # kept mass exactly 0.625: not below
        0.7: [True, True, True, False, False, True, False, False],  # block 2 crosses 0.7 and is kept
        0.95: [True, True, True, True, False, True, False, False],  # 0.875 < 0.95 keeps block 3; 1.0 stops
    }
    for threshold, row in expected.items():
        assert _select_triton(mass, rows, threshold)[0, 0, 0].tolist() == row, threshold
        assert select_blocks(mass, rows, threshold)[0, 0, 0].tolist() == row, threshold


def test_selection_writes_into_a_strided_out_and_takes_strided_mass():
    g = torch.Generator().manual_seed(1)
    mass = torch.rand(2, 12, 3, 10, generator=g).to(DEV).transpose(1, 2)  # (2, 3, 12, 10), strided
    row_block = (torch.arange(12)[None, :] + torch.tensor([[0], [2]])).to(DEV)
    layout = torch.ones(2, 3, 20, 10, dtype=torch.bool, device=DEV)
    out = layout[:, :, 4:16]
    _select_triton(mass, row_block, 0.7, out=out, max_row_block=int(row_block.max()))
    assert torch.equal(layout[:, :, 4:16], select_blocks(mass, row_block, 0.7))
    assert layout[:, :, :4].all() and layout[:, :, 16:].all()  # untouched outside the slice


# -- the mode ------------------------------------------------------------------------------------


LAYOUT_CONFIGS = [
    {"block_size": 16, "stride": 4, "threshold": 0.6},
    {"block_size": 16, "stride": 4, "threshold": 0.9, "chunk_size": 32},
    {"block_size": 32, "stride": 8, "threshold": 0.8, "head_aggregation": "kv_group"},
]


@pytest.mark.parametrize("config", LAYOUT_CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_build_layout_triton_equals_torch(config):
    q, k, _, seq = make_inputs((2, 4, 2, 170, 170, 16), kv_lens=[170, 123], seed=7)
    q, k = q.to(DEV), k.to(DEV)
    seq = SeqInfo(seq.q_start.to(DEV), seq.kv_len.to(DEV), seq.q_len, seq.kv_capacity)
    torch_layout = make_mode("xattention", {**config, "estimator": "torch"}).build_layout(q, k, seq)
    mode = make_mode("xattention", {**config, "estimator": "triton"})
    assert mode.planning_backend(q) == "triton"
    triton_layout = mode.build_layout(q, k, seq)
    assert triton_layout.blocks.shape == torch_layout.blocks.shape
    assert torch.equal(triton_layout.blocks, torch_layout.blocks)


def test_build_layout_decode_and_chunked_prefill():
    for seq in (_seq([169, 122], [170, 123], 1, 170), _seq([41, 7], [170, 123], 90, 170)):
        q, k = _inputs(seq, 4, 2, 16, torch.float32, seed=8)
        cfg = {"block_size": 16, "stride": 4, "threshold": 0.7, "decode": "sparse"}
        a = make_mode("xattention", {**cfg, "estimator": "torch"}).build_layout(q, k, seq)
        b = make_mode("xattention", {**cfg, "estimator": "triton"}).build_layout(q, k, seq, scale=None)
        assert torch.equal(a.blocks, b.blocks)


def test_estimator_default_and_backend_choice(monkeypatch):
    assert XAttentionConfig().estimator == "auto"
    q = torch.zeros(1, 2, 32, 16)
    assert make_mode("xattention", {"estimator": "torch"}).planning_backend(q) == "torch"
    # auto never runs the interpreter on a CPU: the conformance suite and CPU runs keep the torch path
    assert make_mode("xattention", {}).planning_backend(q) == "torch"
    monkeypatch.setattr(kernels_module, "triton_unavailable", lambda device: "no triton in this test")
    assert make_mode("xattention", {}).planning_backend(q) == "torch"
    with pytest.raises(BackendUnavailableError, match=r"sparse_mode\.estimator.*no triton in this test"):
        make_mode("xattention", {"estimator": "triton"}).planning_backend(q)
    with pytest.raises(BackendUnavailableError, match=r"estimator = 'triton' \(elastic.sparse_mode.estimator"):
        make_mode("xattention", {"estimator": "triton", "block_size": 16, "stride": 4}).build_layout(
            q, q, SeqInfo.dense(1, 32, 32)
        )


def test_pinned_triton_refuses_unsupported_dtype():
    q = torch.zeros(1, 2, 32, 16, dtype=torch.float64, device=DEV)
    mode = make_mode("xattention", {"estimator": "triton", "block_size": 16, "stride": 4})
    with pytest.raises(BackendUnavailableError, match="float64"):
        mode.planning_backend(q)
    assert make_mode("xattention", {"block_size": 16, "stride": 4}).planning_backend(q) == "torch"


def test_patterns_backend_argument_is_checked():
    seq = SeqInfo.dense(1, 32, 32)
    q = torch.zeros(1, 2, 32, 16)
    with pytest.raises(ValueError, match="backend must be 'torch' or 'triton'"):
        antidiagonal_mass(q, q, seq, block_size=16, stride=4, backend="cuda")  # type: ignore[arg-type]


# -- GPU, long sequences -------------------------------------------------------------------------


def _ambiguous(mass, row_block, threshold, rel=1e-5):
    """Bool like ``mass``: candidate blocks whose keep decision depends on float32 rounding (their
    float64 cumulative mass before them lies within ``rel * total`` of ``threshold * total``), in
    the selectors' own order (descending float32 mass, ties to the lower index)."""
    kb = torch.arange(mass.shape[-1], device=mass.device)
    diag = row_block[:, None, :, None]
    allowed = kb <= diag
    forced = allowed & ((kb == 0) | (kb == diag))
    candidate = (allowed & ~forced).expand(mass.shape)  # per head, as the masses
    m64 = torch.where(allowed, mass, 0).double()
    total = m64.sum(-1, keepdim=True)
    forced_mass = torch.where(forced, m64, 0).sum(-1, keepdim=True)
    values = torch.where(candidate, mass, -1.0)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    contrib = torch.where(candidate, m64, 0).gather(-1, order)
    before = forced_mass + contrib.cumsum(-1) - contrib
    near = (before - threshold * total).abs() <= rel * total
    return torch.zeros_like(candidate).scatter_(-1, order, near) & candidate


@pytest.mark.parametrize("head_aggregation", ["query", "kv_group"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_32k_mass_and_selection(head_aggregation):
    torch.manual_seed(0)
    n, hq, hkv, d, bs, s, tau = 32768, 32, 8, 128, 64, 16, 0.9
    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    seq = SeqInfo.dense(1, n, n, "cuda")
    got = _triton_mass(q, k, seq, block_size=bs, stride=s)
    ref = antidiagonal_mass(q, k, seq, block_size=bs, stride=s)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-7)
    if head_aggregation == "kv_group":
        got = xa.reduce_groups(got, hkv, "sum")
    rows = seq.query_block_positions(bs)
    tri_sel = _select_triton(got, rows, tau)
    torch_sel = select_blocks(got, rows, tau)
    differ = tri_sel != torch_sel
    assert not (differ & ~_ambiguous(got, rows, tau)).any(), "selections differ away from a rounding tie"
    assert differ.sum().item() <= 1e-5 * differ.numel()
    # the whole layout: differences only where the two masses order near-equal blocks differently
    cfg = {"block_size": bs, "stride": s, "threshold": tau, "head_aggregation": head_aggregation}
    a = make_mode("xattention", {**cfg, "estimator": "torch"}).build_layout(q, k, seq).blocks
    b = make_mode("xattention", {**cfg, "estimator": "triton"}).build_layout(q, k, seq).blocks
    causal = a.shape[-1] * (a.shape[-1] + 1) // 2 * a.shape[1]
    assert (a != b).sum().item() <= 1e-4 * causal


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_padded_chunked_batch():
    """Batch 2, unaligned chunked prefill with different kv_len, at a few thousand tokens."""
    seq = SeqInfo(torch.tensor([1000, 37], device="cuda"), torch.tensor([6000, 4100], device="cuda"), 4200, 6000)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 8, 4200, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(2, 2, 6000, 128, device="cuda", generator=g).bfloat16()
    got = _triton_mass(q, k, seq, block_size=64, stride=16, chunk_size=1024)
    ref = antidiagonal_mass(q, k, seq, block_size=64, stride=16, chunk_size=1024)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-7)
    for dtype in (torch.float32, torch.float16):
        got = _triton_mass(q.to(dtype), k.to(dtype), seq, block_size=64, stride=16, chunk_size=1024)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


def test_shared_memory_budget_shrinks_the_estimators_tiles(monkeypatch):
    """A GPU's per-block shared-memory limit lowers the budget; the estimator's default tiles then
    shrink to fit it: 128 x 128 x 3 stages of bf16 rows of 128 need (128 + 128) * 128 * 2 * 3 =
    192 KB, so a 164 KB limit (A100: 140 KB after the reserve) halves the key tile, then the query
    tile (each step halves the wider one, the key tile on a tie; stages go only at the floor)."""
    from elasticfw.kernels import xattention_estimate as xe

    budget = kernels_module.shared_memory_budget
    assert budget(torch.device("cpu"), 200 * 1024) == 200 * 1024  # the interpreter: the cap
    for optin, expected in ((232448, 200 * 1024), (167936, 167936 - 24 * 1024), (None, 200 * 1024)):
        monkeypatch.setattr(kernels_module, "_shared_memory_optin", lambda index, optin=optin: optin)
        assert budget(torch.device("cuda", 0), 200 * 1024) == expected, optin
    assert xe._tiles(2, 128, 4, None, None, 200 * 1024) == (128, 128, 3)
    # (128 + 64) * 128 * 2 * 3 = 144 KB > 140 KB, (64 + 64) * 768 = 96 KB fits
    assert xe._tiles(2, 128, 4, None, None, 167936 - 24 * 1024) == (64, 64, 3)
    assert xe._tiles(2, 128, 4, None, None, 64 * 1024) == (32, 32, 3)  # (32 + 32) * 768 = 48 KB
    assert xe._tiles(2, 128, 4, None, None, 20 * 1024) == (16, 16, 2)  # at the floor: (16 + 16) * 512 = 16 KB
    assert xe._tiles(2, 128, 4, 128, 128, 64 * 1024) == (128, 128, 3)  # explicit tiles are kept
