"""NSA's Triton block-importance kernels against the torch reference and against loops.

* ``nsa_block_importance_triton`` (``elasticfw.kernels.nsa_importance``) against
  ``NSAAttention.block_importance`` with ``scorer: torch`` (the reference) and against a float64
  brute force written here from the mode's definition (compressed keys as window means, softmax over
  each row's valid windows, window-to-block overlap in tokens / stride, summed per tile and GQA
  group): prefill, padding, chunked prefill, decode, GQA groups, head dims, dtypes, scale, block /
  kernel / stride geometries, rows without a valid window, tile sizes, strided inputs.
* ``build_layout`` with ``scorer: triton`` against ``scorer: torch``, and the backend switch.

Without CUDA the kernels run under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``), so shapes are small. The test marked ``gpu`` runs them at 32K.
"""

from __future__ import annotations

import math

import pytest
import torch

import elasticfw.kernels as kernels_module

pytest.importorskip("triton")

from elasticfw.attention.patterns import window_means
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import triton_unavailable
from elasticfw.testing.modes import make_mode
from elasticfw_plugins.modes.nsa import NSAConfig

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.skipif(
    triton_unavailable(DEV) is not None, reason=f"Triton kernels cannot run here: {triton_unavailable(DEV)}"
)


def _triton(q, k, seq, bs, kernel, stride, scale=None, **kw):
    from elasticfw.kernels.nsa_importance import nsa_block_importance_triton

    return nsa_block_importance_triton(q, k, seq, block_size=bs, kernel=kernel, stride=stride, scale=scale, **kw)


def _mode(bs, kernel, stride, scorer, **extra):
    """The mode scoring the float32 window means (``score_keys: float32``, what the kernel function
    computes with its default split) unless ``extra`` says otherwise."""
    cfg = {"block_size": bs, "compress_kernel": kernel, "compress_stride": stride, "scorer": scorer,
           "score_keys": "float32"}
    cfg.setdefault("top_n", 3)
    return make_mode("nsa", {**cfg, "init_blocks": 1, "local_blocks": 1, "window": 0, **extra})


def _reference(q, k, seq, bs, kernel, stride, scale=None):
    return _mode(bs, kernel, stride, "torch").block_importance(q, k, seq, scale)


# -- brute force ---------------------------------------------------------------------------------


def _brute(q, k, seq, bs, kernel, stride, scale=None, keys_dtype=None):
    """(B, Hkv, NQB, NKB) float64 from the definition, one query row at a time. ``keys_dtype``: the
    compressed keys are the float32 window means rounded to it (``score_keys: input``)."""
    rounded = None
    if keys_dtype is not None:  # the means as float32 computes them, then as keys_dtype holds them
        rounded = window_means(k.float().cpu(), kernel, stride).to(keys_dtype).double()
    q, k = q.double().cpu(), k.double().cpu()
    batch, hq, q_len, dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    nkb = -(-seq.kv_capacity // bs)
    nqb = seq.num_query_blocks(bs)
    out = torch.zeros(batch, hkv, nqb, nkb, dtype=torch.float64)
    for b in range(batch):
        q_start, kv_len = int(seq.q_start[b]), int(seq.kv_len[b])
        windows = [m for m in range(seq.kv_capacity) if m * stride + kernel <= kv_len]
        if not windows:
            continue
        comp = torch.stack([k[b, :, m * stride : m * stride + kernel].mean(1) for m in windows], 1)  # (Hkv, M, D)
        if rounded is not None:
            comp = rounded[b, :, : len(windows)]
        # weight[m, n]: tokens window m shares with block n, over the stride
        weight = torch.zeros(len(windows), nkb, dtype=torch.float64)
        for m in windows:
            for n in range(nkb):
                shared = min(m * stride + kernel, (n + 1) * bs) - max(m * stride, n * bs)
                weight[m, n] = max(shared, 0) / stride
        for i in range(q_len):
            pos = q_start + i
            if pos >= kv_len:
                continue  # a padding row
            valid = sum(1 for m in windows if m * stride + kernel <= min(pos + 1, kv_len))
            if valid == 0:
                continue  # no window ends at or before this row
            rows = q[b, :, i].view(hkv, group, dim)
            probs = torch.softmax(torch.einsum("hgd,hmd->hgm", rows, comp[:, :valid]) * scale, dim=-1)
            tile = pos // bs - q_start // bs
            out[b, :, tile] += probs.sum(1) @ weight[:valid]
    return out


def _seq(q_start, kv_len, q_len, cap):
    return SeqInfo(torch.tensor(q_start, device=DEV), torch.tensor(kv_len, device=DEV), q_len, cap)


def _inputs(seq, hq, hkv, dim, dtype, seed=0):
    """Random q/k with a few strong keys (peaked softmaxes); padding rows and keys hold garbage."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq.batch, hq, seq.q_len, dim, generator=g)
    k = torch.randn(seq.batch, hkv, seq.kv_capacity, dim, generator=g)
    k[:, :, :: max(1, seq.kv_capacity // 9)] += 2.0 * q.mean((0, 1, 2))
    for b in range(seq.batch):
        kv_len, q_start = int(seq.kv_len[b]), int(seq.q_start[b])
        k[b, :, kv_len:] = 300.0
        q[b, :, max(0, kv_len - q_start) :] = -300.0
    return q.to(DEV, dtype), k.to(DEV, dtype)


# name: (SeqInfo factory, Hq, Hkv, head_dim, block, kernel, stride, dtype, scale, tile overrides)
F32 = torch.float32
CASES = {
    "prefill": (lambda: SeqInfo.dense(1, 197, 197, DEV), 4, 2, 32, 16, 8, 4, F32, None, {}),
    # the paper's geometry (block 64, kernel 32, stride 16), head dim 64, GQA 4: one tile per program
    "paper_geometry": (lambda: SeqInfo.dense(1, 300, 300, DEV), 4, 1, 64, 64, 32, 16, F32, None, {}),
    # 16 windows (4 key blocks) per step: the spill of a step's last block is carried into the next
    "paper_geometry_steps": (
        lambda: SeqInfo.dense(1, 300, 300, DEV), 4, 2, 32, 64, 32, 16, torch.bfloat16, None, {"block_n": 16}
    ),
    "right_padded": (lambda: _seq([0, 0], [170, 101], 170, 170), 4, 2, 32, 16, 8, 4, F32, None, {}),
    # a left-padded batch in canonical coordinates: queries end where each sample ends, unaligned starts
    "left_padded": (lambda: _seq([112, 53], [160, 101], 48, 160), 4, 2, 32, 16, 8, 4, F32, None, {}),
    # chunked prefill: unaligned q_start, sample 1's last rows past its kv_len (padding rows)
    "chunked": (lambda: _seq([37, 50], [150, 90], 60, 150), 4, 2, 32, 32, 16, 8, F32, None, {}),
    "decode": (lambda: _seq([149, 96], [150, 97], 1, 150), 4, 1, 32, 16, 8, 4, F32, None, {}),
    "gqa1": (lambda: _seq([0], [130], 130, 130), 2, 2, 32, 16, 8, 4, F32, None, {}),
    "gqa3_dim48": (lambda: _seq([0], [130], 130, 130), 6, 2, 48, 16, 8, 4, F32, None, {}),
    "gqa4_dim64": (lambda: _seq([9], [140], 131, 140), 4, 1, 64, 16, 8, 4, F32, None, {}),
    "scale": (lambda: _seq([21], [140], 119, 140), 2, 1, 32, 16, 8, 4, F32, 0.37, {}),
    "bf16": (lambda: _seq([0, 0], [160, 120], 160, 160), 4, 2, 32, 32, 16, 8, torch.bfloat16, None, {}),
    "fp16": (lambda: _seq([13], [150], 137, 150), 4, 2, 64, 16, 8, 4, torch.float16, None, {}),
    "kernel_eq_stride": (lambda: _seq([0], [150], 150, 150), 2, 1, 32, 16, 8, 8, F32, None, {}),
    # a window spans up to three blocks (kernel 32 over blocks of 16): spill of two blocks
    "long_kernel": (lambda: _seq([0], [150], 150, 150), 2, 1, 32, 16, 32, 4, F32, None, {"block_n": 16}),
    # block / stride = 3 (padded to 4 windows per block), block 24 padded to 32 positions
    "block24": (lambda: _seq([5, 40], [150, 100], 90, 150), 2, 1, 32, 24, 16, 8, F32, None, {}),
    # no row sees a window: rows 0..5 with kernel 8 (position + 1 < kernel)
    "no_valid_window": (lambda: _seq([0], [40], 6, 40), 2, 1, 32, 16, 8, 4, F32, None, {}),
    # steps whose every window every row sees (run without the causal mask) before the causal edge:
    # with padding rows past a sample's kv_len, GQA 3 (a padded head per chunk), head dim 48 (padded)
    "full_steps_padded_rows": (
        lambda: _seq([0, 0], [300, 230], 300, 300), 6, 2, 48, 16, 8, 4, F32, None, {"block_n": 16}
    ),
    # ... with padding members in each block (block / stride = 3) and whole unmasked key loads (bf16)
    "full_steps_block24": (lambda: _seq([0], [300], 300, 300), 2, 1, 32, 24, 16, 8, F32, None, {"block_n": 16}),
    "full_steps_bf16": (
        lambda: SeqInfo.dense(1, 600, 600, DEV), 4, 2, 32, 64, 32, 16, torch.bfloat16, None, {"block_n": 16}
    ),
    # 16 rows and 16 windows per program: several head chunks, steps and carries
    "small_tiles": (
        lambda: _seq([0, 17], [190, 160], 150, 190), 4, 1, 32, 16, 8, 4, F32, None, {"block_m": 16, "block_n": 16}
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_importance_matches_reference_and_brute_force(name):
    make_seq, hq, hkv, dim, bs, kernel, stride, dtype, scale, tiles = CASES[name]
    seq = make_seq()
    q, k = _inputs(seq, hq, hkv, dim, dtype)
    got = _triton(q, k, seq, bs, kernel, stride, scale, **tiles)
    ref = _reference(q, k, seq, bs, kernel, stride, scale)
    assert got.shape == ref.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    brute = _brute(q, k, seq, bs, kernel, stride, scale)
    torch.testing.assert_close(got.cpu().double(), brute, rtol=1e-5, atol=1e-5)
    # every real row with a valid window gives each head a total of kernel / stride
    usable = seq.query_valid() & (seq.query_positions() + 1 >= kernel)
    totals = got.sum((2, 3)).cpu()
    expected = usable.sum(1).cpu()[:, None].double() * (hq // hkv) * (kernel // stride)
    torch.testing.assert_close(totals.double(), expected.expand_as(totals), rtol=1e-5, atol=1e-4)


def test_no_windows_at_all():
    """Keys shorter than one window: all zeros, of the layout's shape."""
    seq = SeqInfo.dense(1, 6, 6, DEV)
    q, k = _inputs(seq, 2, 1, 32, F32)
    got = _triton(q, k, seq, 16, 8, 4)
    assert got.shape == (1, 1, 1, 1) and not got.any()


@pytest.mark.parametrize(("split", "rtol"), [(1, 2e-2), (3, 1e-5)])
def test_split_terms(split, rtol):
    """One bfloat16 term of the compressed keys is coarse; three are as good as float32."""
    seq = _seq([0], [130], 130, 130)
    q, k = _inputs(seq, 2, 1, 32, torch.bfloat16, seed=2)
    got = _triton(q, k, seq, 16, 8, 4, split=split)
    torch.testing.assert_close(got, _reference(q, k, seq, 16, 8, 4), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_score_keys_input_rounds_the_compressed_keys(dtype):
    """``score_keys: input``: both scorers score the window means rounded to the inputs' dtype, as a
    float64 brute force over those rounded means does (hard tolerance). For 16-bit inputs that moves
    the importances away from the float32 means' (by about 1e-3 here); float32 inputs score the same
    either way."""
    seq = _seq([0, 9], [180, 140], 171, 180)
    bs, kernel, stride = 32, 16, 8
    q, k = _inputs(seq, 4, 2, 32, dtype, seed=4)
    cfg = {"score_keys": "input"}
    by_triton = _mode(bs, kernel, stride, "triton", **cfg).block_importance(q, k, seq)
    by_torch = _mode(bs, kernel, stride, "torch", **cfg).block_importance(q, k, seq)
    torch.testing.assert_close(by_triton, by_torch, rtol=1e-5, atol=1e-5)
    brute = _brute(q, k, seq, bs, kernel, stride, keys_dtype=dtype)
    torch.testing.assert_close(by_torch.cpu().double(), brute, rtol=1e-5, atol=1e-5)
    exact = _reference(q, k, seq, bs, kernel, stride)  # score_keys: float32
    if dtype == torch.float32:
        torch.testing.assert_close(by_torch, exact, rtol=0, atol=0)
        torch.testing.assert_close(by_triton, _triton(q, k, seq, bs, kernel, stride), rtol=0, atol=0)
    else:
        moved = ((by_torch - exact).abs() / exact.abs().clamp_min(1e-3)).max().item()
        assert 1e-5 < moved < 5e-2


def test_strided_inputs_are_read_in_place():
    """q and k in (B, S, H, D) memory, seen as (B, H, S, D) views: the same importances."""
    seq = _seq([0, 0], [150, 111], 150, 150)
    q, k = _inputs(seq, 4, 2, 32, F32, seed=4)
    qt, kt = q.transpose(1, 2).contiguous().transpose(1, 2), k.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous() and not kt.is_contiguous()
    got = _triton(qt, kt, seq, 16, 8, 4)
    torch.testing.assert_close(got, _triton(q, k, seq, 16, 8, 4), rtol=0, atol=0)


def test_unsupported_inputs_are_named():
    from elasticfw.kernels.nsa_importance import unsupported

    q = torch.zeros(1, 2, 32, 16, dtype=torch.float64, device=DEV)
    assert "float64" in unsupported(q, block_size=16, kernel=8, stride=4)
    q = torch.zeros(1, 2, 32, 16, device=DEV)
    assert "above" in unsupported(q, block_size=512, kernel=32, stride=16)
    assert unsupported(q, block_size=16, kernel=8, stride=4) is None
    with pytest.raises(BackendUnavailableError, match="float64"):
        _triton(q.double(), q.double(), SeqInfo.dense(1, 32, 32, DEV), 16, 8, 4)
    # sizes below 1 are wrong arguments, named (a ZeroDivisionError, a RuntimeError or "backend
    # cannot run" before)
    for block_size, kernel in ((0, 8), (-16, 8), (16, 0), (16, -4)):
        with pytest.raises(ValueError, match="positive multiples of compress_stride=4"):
            _triton(q, q, SeqInfo.dense(1, 32, 32, DEV), block_size, kernel, 4)


# -- the mode ------------------------------------------------------------------------------------


LAYOUT_CONFIGS = [
    {"block_size": 16, "compress_kernel": 8, "compress_stride": 4, "top_n": 5},
    {"block_size": 32, "compress_kernel": 16, "compress_stride": 8, "top_n": 3, "window": 40, "local_blocks": 2},
]


@pytest.mark.parametrize("config", LAYOUT_CONFIGS, ids=["b16", "b32-window"])
def test_build_layout_triton_equals_torch(config):
    seq = _seq([0, 30], [200, 170], 170, 200)
    q, k = _inputs(seq, 4, 2, 32, F32, seed=9)
    torch_mode = make_mode("nsa", {**config, "scorer": "torch"})
    triton_mode = make_mode("nsa", {**config, "scorer": "triton"})
    assert triton_mode.scoring_backend(q, k) == "triton"
    a, b = torch_mode.block_importance(q, k, seq), triton_mode.block_importance(q, k, seq)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # no near-tie among the ranked candidates, so the float32 differences cannot flip a choice
    gaps = a.sort(-1).values.diff(dim=-1)
    assert not ((gaps > 0) & (gaps < 1e-4)).any()
    la, lb = torch_mode.build_layout(q, k, seq), triton_mode.build_layout(q, k, seq)
    assert torch.equal(la.blocks, lb.blocks)


def test_token_granularity_keeps_the_torch_path(monkeypatch):
    from elasticfw.kernels import nsa_importance

    def refuse(*args, **kwargs):
        raise AssertionError("token granularity must not run the block kernel")

    monkeypatch.setattr(nsa_importance, "nsa_block_importance_triton", refuse)
    seq = SeqInfo.dense(1, 72, 72, DEV)  # 5 key blocks: top_n 3 scores (at least 5 would select every block)
    q, k = _inputs(seq, 2, 1, 16, F32)
    cfg = {"block_size": 16, "compress_kernel": 8, "compress_stride": 4, "top_n": 3, "query_granularity": "token"}
    a = make_mode("nsa", {**cfg, "scorer": "triton"}).build_layout(q, k, seq)
    b = make_mode("nsa", {**cfg, "scorer": "torch"}).build_layout(q, k, seq)
    assert torch.equal(a.blocks, b.blocks)


def test_scorer_default_and_backend_choice(monkeypatch):
    assert NSAConfig().scorer == "auto"
    q = torch.zeros(1, 2, 32, 16)
    assert _mode(16, 8, 4, "torch").scoring_backend(q, q) == "torch"
    # auto never runs the interpreter on a CPU: the conformance suite and CPU runs keep the torch path
    assert _mode(16, 8, 4, "auto").scoring_backend(q, q) == "torch"
    assert make_mode("nsa", {}).scoring_backend(q, q) == "torch"
    if DEV.type == "cpu":  # the interpreter is on (tests/conftest.py): a pinned triton runs it
        assert _mode(16, 8, 4, "triton").scoring_backend(q, q) == "triton"
    monkeypatch.setattr(kernels_module, "triton_unavailable", lambda device: "no triton in this test")
    assert _mode(16, 8, 4, "auto").scoring_backend(q, q) == "torch"
    with pytest.raises(BackendUnavailableError, match=r"nsa\.scorer = 'triton'.*no triton in this test"):
        _mode(16, 8, 4, "triton").scoring_backend(q, q)
    with pytest.raises(BackendUnavailableError, match=r"nsa\.scorer.*sparse_mode\.scorer"):
        _mode(16, 8, 4, "triton").build_layout(q, q, SeqInfo.dense(1, 32, 32))


def test_pinned_triton_names_an_unsupported_input(monkeypatch):
    from elasticfw.kernels import nsa_importance

    q = torch.zeros(1, 2, 32, 16, dtype=torch.float64, device=DEV)
    with pytest.raises(BackendUnavailableError, match=r"nsa\.scorer.*float64"):
        _mode(16, 8, 4, "triton").scoring_backend(q, q)
    assert _mode(16, 8, 4, "auto").scoring_backend(q, q) == "torch"
    monkeypatch.setattr(nsa_importance, "unsupported", lambda q, **kw: "a planted reason")
    q = torch.zeros(1, 2, 32, 16, device=DEV)
    with pytest.raises(BackendUnavailableError, match=r"nsa\.scorer.*a planted reason"):
        _mode(16, 8, 4, "triton").block_importance(q, q, SeqInfo.dense(1, 32, 32, DEV))


# -- GPU, long sequences -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("score_keys", ["input", "float32"])
def test_gpu_32k_importance_and_layout(score_keys):
    """32K, bf16, Llama-8B heads (32 query / 8 KV, d 128), the paper's block / kernel / stride;
    the compressed keys rounded to bfloat16 (the default: one term) or in float32 (two terms)."""
    torch.manual_seed(0)
    n, hq, hkv, d = 32768, 32, 8, 128
    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    seq = SeqInfo.dense(1, n, n, "cuda")
    torch_mode = make_mode("nsa", {"scorer": "torch", "score_keys": score_keys})
    triton_mode = make_mode("nsa", {"scorer": "auto", "score_keys": score_keys})
    assert triton_mode.scoring_backend(q, k) == "triton"
    with torch.no_grad():
        ref = torch_mode.block_importance(q, k, seq)
        got = triton_mode.block_importance(q, k, seq)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
        a = torch_mode.build_layout(q, k, seq).blocks
        b = triton_mode.build_layout(q, k, seq).blocks
    # differences only where two near-equal importances are ranked differently
    causal = a.shape[-1] * (a.shape[-1] + 1) // 2 * a.shape[1]
    assert (a != b).sum().item() <= 1e-4 * causal
