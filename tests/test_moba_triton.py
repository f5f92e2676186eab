"""MoBA's fused Triton planner (``elasticfw.kernels.moba_select``) against the torch path and a
brute force.

* ``selected`` / ``union`` / ``common`` against (a) the torch path (``select_blocks`` over
  ``gate_scores``, then ``tile_union``) and (b) a float64 brute force written here from
  ``plugins/modes/moba.py``'s docstring (per row: the current block plus the ``top_k - 1`` best
  earlier whole blocks, sorted by (-gate, index); per tile: any / every real row). On integer
  valued inputs every gate is exact in float32 (means of whole blocks are multiples of
  1 / moba_block_size, a power of two), so all three must agree exactly, exact ties included; on
  random inputs they may differ only at near-ties of the float64 gates.
* Prefill, padding, queries ending at each sample's end, chunked prefill from unaligned
  ``q_start``, decode, GQA groups 1/2/4, head dims 32/48/64/96, three dtypes, ``top_k`` 1 and
  above the candidates, NMB not a power of two and above the 16-block launch width, tiles not a
  power of two, strided queries, row and head-dim chunking.
* ``build_layout`` with ``planner: triton`` against ``planner: torch`` (blocks, partial blocks,
  token mask on every pair) and the backend switch.

Without CUDA the kernel runs under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``), so shapes are small. The test marked ``gpu`` runs at 32K.
"""

from __future__ import annotations

import pytest
import torch

import elasticfw.kernels as kernels_module

pytest.importorskip("triton")

from elasticfw.attention.layout import dense_mask
from elasticfw.attention.pattern_layouts import tile_union
from elasticfw.attention.patterns import gate_scores, mean_pool_keys
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError
from elasticfw.kernels import triton_unavailable
from elasticfw.testing.modes import make_mode
from elasticfw_plugins.modes.moba import MobaConfig, select_blocks

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.skipif(
    triton_unavailable(DEV) is not None, reason=f"Triton kernels cannot run here: {triton_unavailable(DEV)}"
)


def _kernel(q, k, seq, moba, top_k, bs):
    from elasticfw.kernels.moba_select import moba_token_selection_triton

    means = mean_pool_keys(k, seq, moba)
    return moba_token_selection_triton(q, means, seq, moba_block_size=moba, top_k=top_k, block_size=bs)


def _torch_path(q, k, seq, moba, top_k, bs):
    """The reference: the torch planner's selection (padding rows select nothing) and tile_union."""
    means = mean_pool_keys(k, seq, moba)
    batch, hq, _, _ = q.shape
    current = torch.div(seq.query_positions(), moba, rounding_mode="floor").clamp(0, means.shape[2] - 1)
    selected = select_blocks(gate_scores(q, means), current[:, None].expand(batch, hq, -1), top_k)
    selected &= seq.query_valid()[:, None, :, None]
    union, common, _ = tile_union(selected, seq, bs)
    return selected, union, common


def _brute(q, k, seq, moba, top_k, bs):
    """From the definition, in float64: (selected, union, common, gates)."""
    q64, k64 = q.double().cpu(), k.double().cpu()
    batch, hq, sq, _ = q.shape
    group = hq // k.shape[1]
    nmb = -(-seq.kv_capacity // moba)
    nqb = seq.num_query_blocks(bs)
    selected = torch.zeros(batch, hq, sq, nmb, dtype=torch.bool)
    union = torch.zeros(batch, hq, nqb, nmb, dtype=torch.bool)
    common = torch.zeros_like(union)
    gates_out = torch.zeros(batch, hq, sq, nmb, dtype=torch.float64)
    for b in range(batch):
        q_start, kv_len = int(seq.q_start[b]), int(seq.kv_len[b])
        first_tile = q_start // bs
        for h in range(hq):
            keys = k64[b, h // group]
            whole = kv_len // moba  # candidates are whole blocks of real keys
            means = torch.stack([keys[n * moba : (n + 1) * moba].mean(0) for n in range(whole)]) if whole else None
            gates = q64[b, h] @ means.T if means is not None else torch.zeros(sq, 0, dtype=torch.float64)
            gates_out[b, h, :, : gates.shape[1]] = gates
            tiles: dict[int, list[int]] = {}
            for i in range(sq):
                pos = q_start + i
                if pos >= kv_len:
                    continue  # a padding row selects nothing
                current = pos // moba
                ranked = sorted(((float(gates[i, n]), n) for n in range(current)), key=lambda s: (-s[0], s[1]))
                for n in [current] + [n for _, n in ranked[: top_k - 1]]:
                    selected[b, h, i, n] = True
                tiles.setdefault(pos // bs - first_tile, []).append(i)
            for t, rows in tiles.items():
                union[b, h, t] = selected[b, h, rows].any(0)
                common[b, h, t] = selected[b, h, rows].all(0)
    return selected, union, common, gates_out


def _inputs(seq, hq, hkv, dim, dtype, *, seed=0, integer=True, low=-3, high=4):
    g = torch.Generator().manual_seed(seed)
    shape_q, shape_k = (seq.batch, hq, seq.q_len, dim), (seq.batch, hkv, seq.kv_capacity, dim)
    if integer:  # gates exact in float32: no rounding can reorder two blocks
        q = torch.randint(low, high, shape_q, generator=g).float()
        k = torch.randint(low, high, shape_k, generator=g).float()
    else:
        q, k = torch.randn(shape_q, generator=g), torch.randn(shape_k, generator=g)
    return q.to(dtype), k.to(dtype)


def _assert_same(got, want, what):
    for name, a, b in zip(("selected", "union", "common"), got, want):
        assert a.dtype == torch.bool and a.shape == b.shape, (what, name, a.dtype, a.shape, b.shape)
        differ = a.cpu() != b.cpu()
        assert not differ.any(), f"{what}: {name} differs at {differ.nonzero()[:5].tolist()}"


def _assert_same_up_to_near_ties(got, want, gates, rel=1e-5):
    """Rows of two selections differ only in blocks whose float64 gates are within ``rel`` (of the
    row's largest gate) of each other, and select as many blocks."""
    got, want, gates = got.cpu(), want.cpu(), gates.cpu()
    differ = got != want
    rows = differ.any(-1)
    if not rows.any():
        return
    assert torch.equal(got.sum(-1), want.sum(-1))
    g, d = gates[rows], differ[rows]
    spread = torch.where(d, g, -torch.inf).amax(-1) - torch.where(d, g, torch.inf).amin(-1)
    scale = g.abs().amax(-1).clamp_min(1e-30)
    assert (spread <= rel * scale).all(), f"selections differ away from a near-tie: {(spread / scale).max()}"


CASES = {
    # name: (seq, hq, hkv, dim, dtype, moba, bs, top_k)
    "prefill": (lambda: SeqInfo.dense(2, 200, 200), 4, 2, 32, torch.float32, 32, 16, 3),
    "right_padding": (lambda: SeqInfo.from_lengths(torch.tensor([200, 137]), 200, 200), 4, 4, 64, torch.bfloat16, 32, 16, 3),
    # queries the last tokens of each sample (a left-padded batch, rolled to canonical form)
    "left_padding": (lambda: SeqInfo.from_lengths(torch.tensor([200, 137]), 100, 200), 4, 1, 48, torch.float16, 32, 16, 4),
    "chunked_unaligned": (lambda: SeqInfo(torch.tensor([37, 5]), torch.tensor([200, 60]), 90, 200), 4, 2, 96, torch.float32, 32, 16, 3),
    "decode": (lambda: SeqInfo.from_lengths(torch.tensor([200, 137]), 1, 200), 4, 1, 64, torch.bfloat16, 32, 16, 3),
    "decode_one_block": (lambda: SeqInfo.dense(2, 1, 20), 2, 1, 32, torch.float32, 32, 16, 3),
    "top_k_1": (lambda: SeqInfo.from_lengths(torch.tensor([200, 150]), 200, 200), 4, 2, 32, torch.float32, 32, 16, 1),
    "top_k_above_candidates": (lambda: SeqInfo.from_lengths(torch.tensor([200, 137]), 200, 200), 4, 2, 32, torch.float16, 32, 16, 20),
    # 32 MoBA blocks: launches of 16 then 32 blocks; batch samples at different offsets
    "many_blocks": (lambda: SeqInfo(torch.tensor([0, 50]), torch.tensor([512, 450]), 400, 512), 2, 1, 32, torch.bfloat16, 16, 16, 5),
    "many_blocks_decode": (lambda: SeqInfo.from_lengths(torch.tensor([512, 300]), 1, 512), 2, 2, 32, torch.float32, 16, 16, 6),
    # layout tiles of 12 (not a power of two) and of 1 (many tiles per program)
    "tile_12": (lambda: SeqInfo(torch.tensor([7, 0]), torch.tensor([150, 131]), 140, 150), 2, 1, 32, torch.float32, 36, 12, 3),
    "tile_1": (lambda: SeqInfo.from_lengths(torch.tensor([70, 45]), 70, 70), 2, 2, 32, torch.float32, 8, 1, 3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_torch_path_and_brute_force(name):
    make_seq, hq, hkv, dim, dtype, moba, bs, top_k = CASES[name]
    seq = make_seq()
    q, k = _inputs(seq, hq, hkv, dim, dtype, seed=len(name))
    got = _kernel(q.to(DEV), k.to(DEV), _on(seq, DEV), moba, top_k, bs)
    _assert_same(got, _torch_path(q, k, seq, moba, top_k, bs), f"{name} vs torch")
    _assert_same(got, _brute(q, k, seq, moba, top_k, bs)[:3], f"{name} vs brute force")


def _on(seq, device):
    return SeqInfo(seq.q_start.to(device), seq.kv_len.to(device), seq.q_len, seq.kv_capacity)


def test_many_exact_ties():
    # entries in {0, 1}: the gates take few values, so most rows choose among equal gates
    seq = SeqInfo(torch.tensor([0, 21]), torch.tensor([256, 240]), 200, 256)
    q, k = _inputs(seq, 4, 2, 32, torch.float32, seed=3, low=0, high=2)
    for top_k in (2, 4):
        got = _kernel(q, k, seq, 16, top_k, 16)
        _assert_same(got, _brute(q, k, seq, 16, top_k, 16)[:3], f"top_k {top_k} vs brute force")
        _assert_same(got, _torch_path(q, k, seq, 16, top_k, 16), f"top_k {top_k} vs torch")


def test_equal_means_select_the_lower_block():
    # blocks 0, 1, 2 and 4 hold identical keys (equal means, so equal gates for every query)
    g = torch.Generator().manual_seed(5)
    block = torch.randn(1, 2, 16, 32, generator=g)
    k = torch.cat([block, block, block, torch.randn(1, 2, 16, 32, generator=g), block, block], dim=2)
    q = torch.randn(1, 4, 96, 32, generator=g)
    seq = SeqInfo.dense(1, 96, 96)
    means = mean_pool_keys(k, seq, 16)
    assert torch.equal(means[:, :, 0], means[:, :, 4])
    for top_k, rows, kept in ((2, slice(48, 64), [0, 3]), (3, slice(48, 64), [0, 1, 3]), (2, slice(80, 96), None)):
        selected, _, _ = _kernel(q, k, seq, 16, top_k, 16)
        chosen = selected[0, :, rows]
        if kept is not None:  # block 3: candidates 0, 1, 2 tie
            expected = torch.zeros(6, dtype=torch.bool)
            expected[kept] = True
            assert torch.equal(chosen, expected.expand_as(chosen))
        else:  # block 5: the best of the tied 0, 1, 2, 4 is never 1, 2 or 4 when 0 scores as high
            best_is_tied = chosen[..., 0] | chosen[..., 3]
            assert best_is_tied.all() and not chosen[..., [1, 2, 4]].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_random_inputs_agree_up_to_near_ties(dtype):
    seq = SeqInfo(torch.tensor([0, 33]), torch.tensor([320, 300]), 250, 320)
    q, k = _inputs(seq, 4, 2, 64, dtype, seed=9, integer=False)
    got = _kernel(q, k, seq, 32, 4, 16)
    ref = _torch_path(q, k, seq, 32, 4, 16)
    brute = _brute(q, k, seq, 32, 4, 16)
    _assert_same_up_to_near_ties(got[0], ref[0], brute[3])
    _assert_same_up_to_near_ties(got[0], brute[0], brute[3])
    # the pooling is exact: union and common are tile_union of the kernel's own selection
    _assert_same(got, (got[0], *tile_union(got[0], seq, 16)[:2]), "pooling")


def test_strided_queries_and_row_and_dim_chunks(monkeypatch):
    import elasticfw.kernels.moba_select as kernel_module

    seq = SeqInfo(torch.tensor([3, 64]), torch.tensor([256, 200]), 150, 256)
    q, k = _inputs(seq, 4, 2, 48, torch.float32, seed=4)
    want = _torch_path(q, k, seq, 64, 3, 64)
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, Hq, Sq, D) view of (B, Sq, Hq, D)
    assert not strided.is_contiguous()
    _assert_same(_kernel(strided, k, seq, 64, 3, 64), want, "strided queries")
    # 16 row slots per step (tiles of 64 rows in 4 steps) and head-dim chunks of 16 (3 of them)
    monkeypatch.setattr(kernel_module, "ROWS_X_BLOCKS", 16 * 16)
    monkeypatch.setattr(kernel_module, "MEANS_PER_CHUNK", 16 * 16)
    _assert_same(_kernel(strided, k, seq, 64, 3, 64), want, "row and head-dim chunks")


def test_empty_calls():
    seq = SeqInfo.dense(1, 0, 40)
    q, k = torch.zeros(1, 2, 0, 32), torch.zeros(1, 1, 40, 32)
    got = _kernel(q, k, seq, 16, 3, 16)
    assert got[0].shape == (1, 2, 0, 3)
    _assert_same(got, (got[0], *tile_union(got[0], seq, 16)[:2]), "no query rows")
    assert not got[1].any() and not got[2].any()


# -- the mode: planner switch and layouts --------------------------------------------------------


def _all_pairs_token_mask(layout, seq, heads):
    b = torch.arange(seq.batch)[:, None, None, None]
    h = torch.arange(heads)[None, :, None, None]
    pos = seq.query_positions()[:, None, :, None]
    kv = torch.arange(seq.kv_capacity)[None, None, None, :]
    return layout.token_mask(b, h, pos, kv)


@pytest.mark.parametrize(
    "make_seq",
    [
        lambda: SeqInfo.from_lengths(torch.tensor([160, 97]), 160, 160),
        lambda: SeqInfo(torch.tensor([37, 5]), torch.tensor([160, 60]), 90, 160),
    ],
    ids=["padded", "chunked"],
)
def test_build_layout_triton_planner_equals_torch(make_seq):
    seq = make_seq()
    q, k = _inputs(seq, 4, 2, 32, torch.bfloat16, seed=6)
    cfg = {"moba_block_size": 32, "top_k": 3, "block_size": 16}
    a = make_mode("moba", {**cfg, "planner": "torch"}).build_layout(q, k, seq)
    b = make_mode("moba", {**cfg, "planner": "triton"}).build_layout(q, k, seq)
    assert torch.equal(a.blocks, b.blocks)
    assert torch.equal(a.partial_blocks(), b.partial_blocks())
    assert a.partial_blocks().any() and (a.blocks & ~a.partial_blocks()).any()
    assert torch.equal(_all_pairs_token_mask(a, seq, 4), _all_pairs_token_mask(b, seq, 4))
    assert torch.equal(dense_mask(a, seq, num_heads=4), dense_mask(b, seq, num_heads=4))


def test_planner_default_and_backend_choice(monkeypatch):
    import elasticfw.kernels.moba_select as kernel_module

    assert MobaConfig().planner == "auto"
    q = torch.zeros(1, 2, 32, 16)
    assert make_mode("moba", {"planner": "torch"}).planning_backend(q, 4) == "torch"
    # auto never runs the interpreter on a CPU: the conformance suite and CPU runs keep the torch path
    assert make_mode("moba", {}).planning_backend(q, 4) == "torch"
    assert make_mode("moba", {"planner": "triton"}).planning_backend(q, 4) == "triton"
    monkeypatch.setattr(kernel_module, "unsupported", lambda q, num_blocks: "not in this test")
    assert make_mode("moba", {}).planning_backend(q, 4) == "torch"
    with pytest.raises(BackendUnavailableError, match=r"moba\.planner.*not in this test|not in this test.*moba\.planner"):
        make_mode("moba", {"planner": "triton"}).planning_backend(q, 4)
    cfg = {"planner": "triton", "moba_block_size": 16, "block_size": 16}
    with pytest.raises(BackendUnavailableError, match=r"planner = 'triton' \(elastic.sparse_mode.planner"):
        make_mode("moba", cfg).build_layout(q, q[:, :1], SeqInfo.dense(1, 32, 32))
    # granularity block always plans in torch: a pinned triton planner does not get in its way
    make_mode("moba", {**cfg, "query_granularity": "block"}).build_layout(q, q[:, :1], SeqInfo.dense(1, 32, 32))
    monkeypatch.setattr(kernels_module, "triton_unavailable", lambda device: "no triton in this test")
    with pytest.raises(BackendUnavailableError, match=r"moba\.planner.*no triton in this test|no triton.*moba\.planner"):
        make_mode("moba", {"planner": "triton"}).planning_backend(q, 4)


def test_unsupported_reasons():
    from elasticfw.kernels.moba_select import MAX_BLOCKS, unsupported

    q = torch.zeros(1, 2, 32, 16, device=DEV)
    assert unsupported(q, num_blocks=MAX_BLOCKS) is None
    assert "float64" in unsupported(q.double(), num_blocks=4)
    assert str(MAX_BLOCKS) in unsupported(q, num_blocks=MAX_BLOCKS + 1)
    with pytest.raises(BackendUnavailableError, match="float64"):
        make_mode("moba", {"planner": "triton"}).planning_backend(q.double(), 4)
    assert make_mode("moba", {}).planning_backend(q.double(), 4) == "torch"


# -- GPU, long sequences -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_32k_default_config():
    torch.manual_seed(0)
    n, hq, hkv, d = 32768, 32, 8, 128
    cfg = MobaConfig()
    moba, top_k, bs = cfg.moba_block_size, cfg.top_k, cfg.block_size
    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    seq = SeqInfo.dense(1, n, n, "cuda")
    got = _kernel(q, k, seq, moba, top_k, bs)
    ref = _torch_path(q, k, seq, moba, top_k, bs)
    means = mean_pool_keys(k, seq, moba).double()
    gates64 = torch.einsum("bkgrd,bknd->bkgrn", q.double().view(1, hkv, hq // hkv, n, d), means).reshape(1, hq, n, -1)
    _assert_same_up_to_near_ties(got[0], ref[0], gates64)
    assert (got[0] != ref[0]).any(-1).sum().item() <= 1e-5 * hq * n
    _assert_same(got, (got[0], *tile_union(got[0], seq, bs)[:2]), "pooling")
    a = make_mode("moba", {"planner": "torch"}).build_layout(q, k, seq)
    b = make_mode("moba", {"planner": "triton"}).build_layout(q, k, seq)
    assert (a.blocks != b.blocks).sum().item() <= 1e-4 * a.blocks.sum().item()
