"""The ``split`` executor: dense causal heads through dense SDPA, the others through the sparse path.

The conformance suite (tests/test_mode_conformance.py) already compares it with the reference on
every mode through ``attend``; here: the routed split (``attend_routed``) against the reference
executor and against plain masked attention written here, forward and gradients, with the
fallbacks (samples routed differently, a GQA group split, decode, log-sum-exp asked for), which
path each call takes (a dense call does no mask work), what is copied, and the gathered CPU
path's cost following the layout.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import elasticfw_plugins.executors.gathered as gathered_module
import elasticfw_plugins.executors.split as split_module
from elasticfw.attention.executor import Executor, ExecutorConfig
from elasticfw.attention.layout import causal_layout
from elasticfw.attention.mode import AttentionOutput, attend_routed, routed_layout
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import BackendUnavailableError, UnsupportedInputError
from elasticfw.recipe import validate_recipe_data
from elasticfw.registry import get_registry
from elasticfw.testing.modes import TOLERANCE, make_inputs, make_mode, rel_rms
from elasticfw_plugins.executors.gathered import decode_dropped_keys, decode_key_bias
from elasticfw_plugins.executors.split import (
    SplitConfig,
    SplitExecutor,
    _sdpa_backends,
    _sdpa_context,
)

FULL = make_mode("full", {"block_size": 16})
STREAM = {
    g: make_mode("streaming", {"block_size": 16, "sink_tokens": 16, "local_tokens": 32, "granularity": g})
    for g in ("block", "token")
}


def _hard(kv: list[int], batch: int, hq: int) -> torch.Tensor:
    row = torch.tensor(kv, dtype=torch.bool).repeat_interleave(hq // len(kv))
    return row[None].expand(batch, hq).clone()


def _count_calls(monkeypatch, owner, name: str) -> list[int]:
    """Replace ``owner.name`` by a wrapper that appends 1 to the returned list at each call."""
    calls: list[int] = []
    real = getattr(owner, name)

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(owner, name, counting)
    return calls


def _masked(q, k, v, seq, hard, granularity, scale):
    """Independent answer: float64 softmax over a mask written from the streaming definition
    (sink + local window at block or token granularity) for sparse heads and causality for the rest."""
    batch, hq, sq, _ = q.shape
    group = hq // k.shape[1]
    pos = seq.q_start[:, None] + torch.arange(sq)[None, :]  # (B, Sq)
    key = torch.arange(k.shape[2])
    causal = key[None, None, :] <= pos[:, :, None]  # (B, Sq, Sk)
    if granularity == "token":
        stream = causal & ((key[None, None, :] < 16) | (key[None, None, :] > pos[:, :, None] - 32))
    else:
        qb, kb = pos[:, :, None] // 16, key[None, None, :] // 16
        stream = causal & ((kb < 1) | (kb > qb - 2))
    mask = torch.where(hard[:, :, None, None], stream[:, None], causal[:, None])
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = (q.double() @ kk.transpose(-1, -2) * scale).masked_fill(~mask, -math.inf)
    return (torch.softmax(scores, -1).nan_to_num(0.0) @ vv).to(q.dtype)


def _run(executor, q, k, v, seq, hard, granularity, scale, dout=None):
    lr, ls = (m.build_layout(q, k, seq) for m in (FULL, STREAM[granularity]))
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    res = attend_routed(q, k, v, seq, executor, retrieval=FULL, sparse=STREAM[granularity], hard=hard,
                        layouts=(lr, ls), scale=scale)
    if dout is not None:
        res.out.backward(dout)
    return res.out.detach(), [t.grad for t in (q, k, v)] if dout is not None else None


ROUTINGS = {
    "first-full": [0, 1, 1, 1],  # dense KV heads a contiguous range: views
    "scattered": [1, 0, 1, 0],  # dense KV heads 1 and 3: a gather
    "last-full": [1, 1, 1, 0],
    "all-full": [0, 0, 0, 0],
    "all-sparse": [1, 1, 1, 1],
}


@pytest.mark.parametrize("sparse", ["gathered", "flex"])  # flex: its CPU emulation, the GPU path's block lists
@pytest.mark.parametrize("granularity", ["block", "token"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_routed_split_matches_reference_and_masked_attention(routing, granularity, sparse):
    shape = (2, 8, 4, 90, 90, 16)
    q, k, v, seq = make_inputs(shape, kv_lens=[90, 61])  # right padding: kv_len < capacity
    hard = _hard(ROUTINGS[routing], 2, 8)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)) * seq.query_valid()[:, None, :, None]
    split = SplitExecutor(SplitConfig(sparse=sparse))
    assert split.split_heads(q, k, seq, hard, (FULL.build_layout(q, k, seq), STREAM[granularity].build_layout(q, k, seq)), False) is not None
    out, grads = _run(split, q, k, v, seq, hard, granularity, 0.37, dout)
    rout, rgrads = _run(get_registry().get("executor", "reference")(), q, k, v, seq, hard, granularity, 0.37, dout)
    rows = seq.query_valid()[:, None, :, None].expand_as(out)
    assert rel_rms(out[rows], rout[rows]) < TOLERANCE[torch.float32]
    want = _masked(q, k, v, seq, hard, granularity, 0.37)
    assert rel_rms(out[rows], want[rows]) < TOLERANCE[torch.float32]
    for g, rg in zip(grads, rgrads):
        assert rel_rms(g, rg) < 3 * TOLERANCE[torch.float32]


@pytest.mark.parametrize("sparse", ["gathered", "flex"])
@pytest.mark.parametrize("routing", ["first-full", "scattered"])
def test_routed_split_at_inference_writes_the_dense_rows_in_place_exactly(routing, sparse):
    """Without autograd the dense heads' rows are written into the sparse launch's output in place;
    the result is still the masked-attention definition."""
    q, k, v, seq = make_inputs((2, 8, 4, 90, 90, 16), kv_lens=[90, 61])
    hard = _hard(ROUTINGS[routing], 2, 8)
    layouts = tuple(m.build_layout(q, k, seq) for m in (FULL, STREAM["block"]))
    with torch.no_grad():
        out = attend_routed(q, k, v, seq, SplitExecutor(SplitConfig(sparse=sparse)), retrieval=FULL,
                            sparse=STREAM["block"], hard=hard, layouts=layouts, scale=0.37).out
    rows = seq.query_valid()[:, None, :, None].expand_as(out)
    want = _masked(q, k, v, seq, hard, "block", 0.37)
    assert rel_rms(out[rows], want[rows]) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_routed_split_half_precision(dtype):
    q, k, v, seq = make_inputs((1, 8, 2, 120, 120, 16), dtype=dtype)
    hard = _hard([0, 1], 1, 8)
    out, _ = _run(SplitExecutor(), q, k, v, seq, hard, "token", 0.25)
    want = _masked(q.float(), k.float(), v.float(), seq, hard, "token", 0.25)
    assert out.dtype == dtype and rel_rms(out.float(), want.float()) < TOLERANCE[dtype]


class _Spy:
    """Records which path of a SplitExecutor ran (dense calls, sparse calls with their layouts)."""

    def __init__(self, executor: SplitExecutor, monkeypatch) -> None:
        self.dense: list[tuple[int, int]] = []
        self.sparse: list = []
        real_dense, real_sparse = executor.dense, executor.sparse

        def dense(q, k, v, *, scale, causal=True):
            self.dense.append((q.shape[1], k.shape[1]))
            self.dense_kv = (k, v)
            self.causal = causal
            return real_dense(q, k, v, scale=scale, causal=causal)

        def sparse(q, k, v, layout, seq, *, scale, need_lse):
            self.sparse.append(layout)
            return real_sparse(q, k, v, layout, seq, scale=scale, need_lse=need_lse)

        monkeypatch.setattr(executor, "dense", dense)
        monkeypatch.setattr(executor, "sparse", sparse)


def test_a_dense_causal_prefill_is_one_dense_call_without_mask_work(monkeypatch):
    q, k, v, seq = make_inputs((2, 6, 2, 100, 100, 16), kv_lens=[100, 77])
    ex = SplitExecutor()
    spy = _Spy(ex, monkeypatch)
    monkeypatch.setattr(split_module, "select_heads", lambda *a: pytest.fail("layout work on a dense call"))
    res = ex.attend(q, k, v, causal_layout(seq, 16), seq, scale=0.3, need_lse=False)
    assert spy.dense == [(6, 2)] and spy.sparse == [] and res.lse is None
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    assert torch.equal(res.out, want)
    # all heads routed full: the same single dense call
    ls = STREAM["block"].build_layout(q, k, seq)
    attend_routed(q, k, v, seq, ex, retrieval=FULL, sparse=STREAM["block"], hard=_hard([0, 0], 2, 6),
                  layouts=(causal_layout(seq, 16), ls), scale=0.3)
    assert spy.dense == [(6, 2), (6, 2)] and spy.sparse == []


def test_contiguous_dense_heads_are_views_and_scattered_ones_are_gathered(monkeypatch):
    q, k, v, seq = make_inputs((1, 8, 4, 64, 64, 16))
    layouts = (FULL.build_layout(q, k, seq), STREAM["block"].build_layout(q, k, seq))
    ex = SplitExecutor()
    spy = _Spy(ex, monkeypatch)
    ex.attend_routed(q, k, v, seq, hard=_hard([0, 0, 1, 1], 1, 8), layouts=layouts, scale=0.25, need_lse=False)
    kd, vd = spy.dense_kv
    assert kd._base is k and vd._base is v  # views of heads 0-1, no copy
    ex.attend_routed(q, k, v, seq, hard=_hard([0, 1, 0, 1], 1, 8), layouts=layouts, scale=0.25, need_lse=False)
    kd, _ = spy.dense_kv
    assert kd._base is None and torch.equal(kd, k[:, [0, 2]])  # a gather of the dense group only
    assert spy.dense == [(4, 2), (4, 2)]
    # the sparse launch always sees every head (one kernel shape) with the dense heads' rows empty
    for layout, dense_q in zip(spy.sparse, ([0, 1, 2, 3], [0, 1, 4, 5])):
        assert layout.blocks.shape[1] == 8
        assert not bool(layout.blocks[:, dense_q].any()) and bool(layout.blocks[:, 2].any() or layout.blocks[:, 7].any())
    assert torch.equal(ex._take_heads(k, [1, 2, 3]), k[:, 1:4]) and ex._take_heads(k, [1, 2, 3])._base is k


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("different-routing", "samples routed differently"),
        ("split-group", "a GQA group split between the layouts"),
        ("decode", "a padded decode step (the keys' lengths are not known on the host)"),
        ("lse", "log-sum-exp asked for"),
    ],
)
def test_fallbacks_run_one_launch_and_stay_exact(case, why, monkeypatch):
    if case == "decode":
        q, k, v, seq = make_inputs((2, 8, 2, 1, 80, 16), kv_lens=[80, 53])
    else:
        q, k, v, seq = make_inputs((2, 8, 2, 70, 70, 16))
    hard = _hard([0, 1], 2, 8)
    if case == "different-routing":
        hard[1] = ~hard[1]
    if case == "split-group":
        hard[:, 0] = True  # query head 0 sparse, the rest of its group full
    layouts = (FULL.build_layout(q, k, seq), STREAM["token"].build_layout(q, k, seq))
    ex = SplitExecutor()
    assert ex.split_heads(q, k, seq, hard, layouts, case == "lse") is None, why
    spy = _Spy(ex, monkeypatch)
    got = ex.attend_routed(q, k, v, seq, hard=hard, layouts=layouts, scale=0.3, need_lse=case == "lse")
    assert spy.dense == [] and len(spy.sparse) == 1  # one launch over the combined layout
    ref = get_registry().get("executor", "reference")()
    want = ref.attend(q, k, v, routed_layout(hard, layouts, seq), seq, scale=0.3)
    rows = seq.query_valid()[:, None, :, None].expand_as(got.out)
    assert rel_rms(got.out[rows], want.out[rows]) < TOLERANCE[torch.float32]
    if case == "lse":
        assert got.lse is not None
        fin = torch.isfinite(want.lse) & seq.query_valid()[:, None, :]
        assert torch.allclose(got.lse[fin], want.lse[fin], atol=1e-4)


@pytest.mark.parametrize("granularity", ["block", "token"])
@pytest.mark.parametrize("routing", ["first-full", "scattered", "all-full", "all-sparse"])
def test_a_decode_step_splits_reads_only_the_window_and_stays_exact(routing, granularity, monkeypatch):
    """One query per sample at the last of 200 positions, no padding (a host-known SeqInfo), with
    the one-call masked form switched off (``MASKED_DECODE_PAIRS`` 0, as past its bound): the full
    heads are one unmasked dense call, the streaming heads a gathered call over the sink and window
    only (never a padded FlexAttention tile, whatever the device), against the reference executor
    and the float64 masked attention written above."""
    monkeypatch.setattr(gathered_module, "MASKED_DECODE_PAIRS", 0)
    q, k, v, _ = make_inputs((2, 8, 4, 1, 200, 16))
    seq = SeqInfo.dense(2, 1, 200)
    hard = _hard(ROUTINGS[routing], 2, 8)
    layouts = (FULL.build_layout(q, k, seq), STREAM[granularity].build_layout(q, k, seq))
    ex = SplitExecutor(SplitConfig(sparse="flex"))  # decode_sparse (auto: gathered on a CPU) wins over `sparse`
    assert ex.sparse_path(q.device, seq) == "gathered"
    widths: list[int] = []
    unmasked: list[bool] = []
    real = F.scaled_dot_product_attention

    def counting(qq, kk, vv, **kw):
        widths.append(kk.shape[2])
        unmasked.append(kw.get("attn_mask") is None)
        return real(qq, kk, vv, **kw)

    spy = _Spy(ex, monkeypatch)
    monkeypatch.setattr(split_module.F, "scaled_dot_product_attention", counting)
    got = ex.attend_routed(q, k, v, seq, hard=hard, layouts=layouts, scale=0.3, need_lse=False).out
    monkeypatch.undo()
    n_dense = sum(1 for x in ROUTINGS[routing] if x == 0)
    assert len(spy.dense) == (1 if n_dense else 0) and (not n_dense or spy.causal is False)
    sparse_calls = [w for w in widths if w < 200]
    if n_dense < 4:
        # sink block + the local window's blocks (16 + 32 tokens, blocks of 16, the query's block partial)
        assert sparse_calls and max(sparse_calls) <= 16 + 32 + 16
        # block granularity: one pattern for every head at a host-dense step, the blocks' keys
        # without a mask; token granularity keeps its token mask
        assert all(u for u, w in zip(unmasked, widths) if w < 200) == (granularity == "block")
    want = _masked(q, k, v, seq, hard, granularity, 0.3)
    assert rel_rms(got, want) < TOLERANCE[torch.float32]
    ref = get_registry().get("executor", "reference")()
    assert rel_rms(got, ref.attend(q, k, v, routed_layout(hard, layouts, seq), seq, scale=0.3).out) < 1e-5


@pytest.mark.parametrize("routing", ["first-full", "scattered", "last-full"])
def test_a_small_decode_step_is_one_masked_call(routing, monkeypatch):
    """Below ``MASKED_DECODE_PAIRS`` a routed host-dense decode step (block-granular streaming) is
    one SDPA call over every head and all 200 keys with an additive mask, no dense or gathered
    call, against the float64 masked attention written above and the reference executor. Its
    bound: one pair fewer than the step drops takes the two calls."""
    q, k, v, _ = make_inputs((2, 8, 4, 1, 200, 16), seed=3)
    seq = SeqInfo.dense(2, 1, 200)
    hard = _hard(ROUTINGS[routing], 2, 8)
    layouts = (FULL.build_layout(q, k, seq), STREAM["block"].build_layout(q, k, seq))
    ex = SplitExecutor(SplitConfig())
    calls: list[tuple[int, bool]] = []
    real = F.scaled_dot_product_attention

    def counting(qq, kk, vv, **kw):
        calls.append((kk.shape[2], kw.get("attn_mask") is not None))
        return real(qq, kk, vv, **kw)

    spy = _Spy(ex, monkeypatch)
    monkeypatch.setattr(split_module.F, "scaled_dot_product_attention", counting)
    got = ex.attend_routed(q, k, v, seq, hard=hard, layouts=layouts, scale=0.3, need_lse=False).out
    assert calls == [(200, True)] and spy.dense == [] and spy.sparse == []
    want = _masked(q, k, v, seq, hard, "block", 0.3)
    assert rel_rms(got, want) < TOLERANCE[torch.float32]
    ref = get_registry().get("executor", "reference")()
    assert rel_rms(got, ref.attend(q, k, v, routed_layout(hard, layouts, seq), seq, scale=0.3).out) < 1e-5
    # the step keeps the sink block and two window blocks, the last holding positions 192-199 only:
    # it drops 200 - (16 + 16 + 8) = 160 keys per sparse head
    pairs = 2 * int(hard.sum(1)[0]) * 160
    for bound, one_call in ((pairs, True), (pairs - 1, False)):
        monkeypatch.setattr(gathered_module, "MASKED_DECODE_PAIRS", bound)
        calls.clear()
        again = ex.attend_routed(q, k, v, seq, hard=hard, layouts=layouts, scale=0.3, need_lse=False).out
        assert (calls == [(200, True)]) == one_call, calls
        assert rel_rms(again, want) < TOLERANCE[torch.float32]


def test_decode_key_bias_definition():
    """The additive mask of a decode row, written by hand: kept blocks 0, dropped ``-inf``, the
    last block cut at the capacity; per-head layouts keep their heads; the keys dropped counted
    with the last block's real keys only (head 0 keeps 4 + 2 of 14, head 1 4 + 4 + 2); a head
    keeping no block, a token mask or several rows give ``None``."""
    from elasticfw.attention.layout import BlockLayout

    blocks = torch.tensor([[1, 0, 0, 1], [0, 1, 1, 1]], dtype=torch.bool)[None, :, None, :]  # (1, 2, 1, 4)
    bias = decode_key_bias(BlockLayout(blocks, 4), 14, torch.float32)
    inf = -math.inf
    assert bias.shape == (1, 2, 1, 14)
    assert bias[0, 0, 0].tolist() == [0.0] * 4 + [inf] * 8 + [0.0] * 2
    assert bias[0, 1, 0].tolist() == [inf] * 4 + [0.0] * 10
    assert decode_dropped_keys(BlockLayout(blocks, 4), 14) == 14 - 6
    assert decode_dropped_keys(BlockLayout(blocks, 4), 16) == 16 - 8  # the last block whole
    assert decode_dropped_keys(BlockLayout(blocks[:, 1:], 4), 13) == 13 - 9
    empty = blocks.clone()
    empty[0, 1] = False
    assert decode_key_bias(BlockLayout(empty, 4), 14, torch.float32) is None
    assert decode_dropped_keys(BlockLayout(empty, 4), 14) is None
    token = BlockLayout(blocks, 4, lambda b, h, qp, kp: kp >= 0)
    assert decode_key_bias(token, 14, torch.float32) is None and decode_dropped_keys(token, 14) is None
    rows = BlockLayout(blocks.expand(1, 2, 2, 4), 4)
    assert decode_key_bias(rows, 14, torch.float32) is None and decode_dropped_keys(rows, 14) is None


def test_a_decode_step_past_the_bound_builds_no_mask(monkeypatch):
    """A routed step whose dropped pairs exceed ``MASKED_DECODE_PAIRS`` takes the two calls without
    building the additive mask (its size is the whole key capacity per head), also when a later
    layer of the same step asks again; a step within the bound builds it once for all its layers."""
    q, k, v, _ = make_inputs((2, 8, 4, 1, 200, 16), seed=5)
    seq = SeqInfo.dense(2, 1, 200)
    hard = _hard(ROUTINGS["first-full"], 2, 8)
    layouts = tuple(dataclasses.replace(m.build_layout(q, k, seq), reusable=True) for m in (FULL, STREAM["block"]))
    ex = SplitExecutor(SplitConfig())
    built = _count_calls(monkeypatch, split_module, "decode_key_bias")
    want = _masked(q, k, v, seq, hard, "block", 0.3)
    monkeypatch.setattr(gathered_module, "MASKED_DECODE_PAIRS", 0)
    for _ in range(3):
        got = ex.attend_routed(q, k, v, seq, hard=hard, layouts=layouts, scale=0.3, need_lse=False).out
        assert rel_rms(got, want) < TOLERANCE[torch.float32]
    assert built == []
    monkeypatch.setattr(gathered_module, "MASKED_DECODE_PAIRS", 10**6)
    for _ in range(3):
        got = ex.attend_routed(q, k, v, seq, hard=hard, layouts=layouts, scale=0.3, need_lse=False).out
        assert rel_rms(got, want) < TOLERANCE[torch.float32]
    assert built == [1]


@pytest.mark.skipif(split_module.triton_unavailable(torch.device("cpu")) is not None,
                    reason="needs Triton's interpreter")
@pytest.mark.parametrize("routing", ["first-full", "scattered", "all-full", "all-sparse"])
def test_a_decode_step_through_the_decode_kernel_is_one_launch(routing, monkeypatch):
    """``decode_sparse: kernel``: a routed decode step (samples at different positions, one routed
    differently) is one decode-kernel launch, no SDPA call and no device read of the routing,
    against the float64 masked attention written above and the reference executor. A token-mask
    layout (token-granular streaming) cannot be a selection: named, under the pinned kernel."""
    import elasticfw.kernels.decode_attention as dec

    q, k, v, _ = make_inputs((2, 8, 4, 1, 200, 16))
    seq = SeqInfo(torch.tensor([199, 150]), torch.tensor([200, 151]), 1, 200)
    k[1, :, 151:] = float("nan")  # sample 1's unwritten cache
    v[1, :, 151:] = float("nan")
    hard = _hard(ROUTINGS[routing], 2, 8)
    hard[1] = ~hard[1]
    layouts = (FULL.build_layout(q, k, seq), STREAM["block"].build_layout(q, k, seq))
    ex = SplitExecutor(SplitConfig(decode_sparse="kernel"))
    def no_sdpa(*args, **kw):
        raise AssertionError("SDPA called")

    def no_read(self):
        raise AssertionError("the routing was read on the host")

    launches = _count_calls(monkeypatch, dec, "decode_attention")
    monkeypatch.setattr(split_module.F, "scaled_dot_product_attention", no_sdpa)
    monkeypatch.setattr(torch.Tensor, "cpu", no_read)
    got = ex.attend_routed(q, k, v, seq, hard=hard, layouts=layouts, scale=0.3, need_lse=True)
    monkeypatch.undo()
    assert launches == [1] and got.lse is not None and not got.out.isnan().any()
    want = _masked(q, k.nan_to_num(), v.nan_to_num(), seq, hard, "block", 0.3)
    assert rel_rms(got.out, want) < 1e-5
    ref = get_registry().get("executor", "reference")()
    expected = ref.attend(q, k.nan_to_num(), v.nan_to_num(), routed_layout(hard, layouts, seq), seq, scale=0.3)
    assert rel_rms(got.out, expected.out) < 1e-5
    assert torch.allclose(got.lse, expected.lse, atol=1e-4)
    token = (FULL.build_layout(q, k, seq), STREAM["token"].build_layout(q, k, seq))
    with pytest.raises(BackendUnavailableError, match="decode_sparse 'kernel'.*token mask"):
        ex.attend_routed(q, k, v, seq, hard=hard, layouts=token, scale=0.3)
    auto = SplitExecutor(SplitConfig(decode_sparse="auto"))  # on a CPU: the gathered path, same answer
    assert rel_rms(auto.attend_routed(q, k.nan_to_num(), v.nan_to_num(), seq, hard=hard, layouts=layouts,
                                      scale=0.3).out, want) < 1e-5


def _three_layers_of_a_step(ex: SplitExecutor, seq: SeqInfo):
    """Three layers of one routed decode step (B 1, Hq 8, Hkv 4, 200 keys, head dim 16; the first KV
    head full, the others block streaming) over the same reusable layout objects, as the runtime
    hands them, each output against the float64 masked attention. Returns ``(q, k, v, hard, the
    layouts, the reusable ones)``."""
    q, k, v, _ = make_inputs((1, 8, 4, 1, 200, 16))
    hard = _hard(ROUTINGS["first-full"], 1, 8)
    plain = (FULL.build_layout(q, k, seq), STREAM["block"].build_layout(q, k, seq))
    shared = tuple(dataclasses.replace(layout, reusable=True) for layout in plain)
    want = _masked(q, k, v, seq, hard, "block", 0.3)
    for _ in range(3):
        got = ex.attend_routed(q, k, v, seq, hard=hard, layouts=shared, scale=0.3, need_lse=False)
        assert rel_rms(got.out, want) < 1e-5
    return q, k, v, hard, plain, shared


@pytest.mark.skipif(split_module.triton_unavailable(torch.device("cpu")) is not None,
                    reason="needs Triton's interpreter")
def test_the_decode_kernel_verdict_is_asked_once_per_step_layouts_and_query_kind(monkeypatch):
    """The decode kernel's verdict (can it run these layouts for this q?) is kept per reusable
    layout objects and q's dtype and head shape: the layers of a step ask once; a new layout object,
    a layout not marked reusable, or a q of another head dim asks again (head dim 272 is past the
    kernel's 256: the pinned kernel names it instead of running on the head dim 16 verdict)."""
    seq = SeqInfo(torch.tensor([199]), torch.tensor([200]), 1, 200)
    ex = SplitExecutor(SplitConfig(decode_sparse="kernel"))
    asked = _count_calls(monkeypatch, split_module, "_decode_kernel_reason")
    q, k, v, hard, plain, shared = _three_layers_of_a_step(ex, seq)
    assert len(asked) == 1
    ex.attend_routed(q, k, v, seq, hard=hard, layouts=plain, scale=0.3, need_lse=False)
    ex.attend_routed(q, k, v, seq, hard=hard, layouts=plain, scale=0.3, need_lse=False)
    assert len(asked) == 3  # not reusable: asked at every call
    fresh = tuple(dataclasses.replace(layout, reusable=True) for layout in plain)  # the next step's layouts
    ex.attend_routed(q, k, v, seq, hard=hard, layouts=fresh, scale=0.3, need_lse=False)
    assert len(asked) == 4
    with pytest.raises(UnsupportedInputError, match="4-D"):  # checked as the executor checks, not a key error
        ex.attend_routed(q[:, :, 0], k, v, seq, hard=hard, layouts=shared, scale=0.3)
    assert len(asked) == 5  # a q of another rank is never looked up
    wide = [t.repeat(1, 1, 1, 17) for t in (q, k, v)]  # head dim 272
    with pytest.raises(BackendUnavailableError, match="decode_sparse 'kernel'.*head_dim 272"):
        ex.attend_routed(*wide, seq, hard=hard, layouts=shared, scale=0.3)
    assert len(asked) == 6


@pytest.mark.parametrize("decode_sparse", ["kernel", "gathered"])
def test_a_steps_layouts_are_checked_once_per_call_geometry(decode_sparse, monkeypatch):
    """A routed decode step's reusable layouts are checked once for the layers of a step (the
    checks read only shapes): three layers check each layout once, against the float64 masked
    attention. The same layout objects over a longer cache (their block grid no longer fits) or
    another batch are checked again and refused, naming the layout; a layout not marked reusable
    is checked at every call."""
    if decode_sparse == "kernel" and split_module.triton_unavailable(torch.device("cpu")) is not None:
        pytest.skip("needs Triton's interpreter")
    cpu = torch.device("cpu")
    seq = SeqInfo.dense(1, 1, 200, cpu)  # known on the host: the gathered path splits the heads
    ex = SplitExecutor(SplitConfig(decode_sparse=decode_sparse))
    checked = _count_calls(monkeypatch, split_module, "check_layout")
    q, k, v, hard, plain, shared = _three_layers_of_a_step(ex, seq)
    assert len(checked) == 2
    want = _masked(q, k, v, seq, hard, "block", 0.3)
    q2, k2, v2, _ = make_inputs((1, 8, 4, 1, 264, 16))  # the next step's cache, 64 keys (4 blocks) longer
    longer = SeqInfo.dense(1, 1, 264, cpu)
    with pytest.raises(UnsupportedInputError, match="argument 'layout'.*key blocks"):
        ex.attend_routed(q2, k2, v2, longer, hard=hard, layouts=shared, scale=0.3, need_lse=False)
    # layouts of two samples: checked at a batch of 2, then the same objects at a batch of 3
    per_sample = tuple(dataclasses.replace(layout, blocks=layout.blocks.expand(2, -1, -1, -1).clone())
                       for layout in shared)
    two, three = ([t.expand(n, -1, -1, -1) for t in (q, k, v)] for n in (2, 3))
    got = ex.attend_routed(*two, SeqInfo.dense(2, 1, 200, cpu), hard=hard.expand(2, -1), layouts=per_sample,
                           scale=0.3, need_lse=False)
    assert rel_rms(got.out, want.expand(2, -1, -1, -1)) < 1e-5
    with pytest.raises(UnsupportedInputError, match="argument 'layout'.*a batch of 1 or 3"):
        ex.attend_routed(*three, SeqInfo.dense(3, 1, 200, cpu), hard=hard.expand(3, -1), layouts=per_sample,
                         scale=0.3, need_lse=False)
    before = len(checked)
    for _ in range(2):
        ex.attend_routed(q, k, v, seq, hard=hard, layouts=plain, scale=0.3, need_lse=False)
    assert len(checked) == before + 4  # not reusable: both layouts at every call


def test_the_gathered_path_computes_only_the_key_blocks_a_chunk_uses(monkeypatch):
    """Streaming at 1,024 tokens (sink 64, local 128, blocks of 64): each 128-row chunk attends to
    at most sink + local + chunk keys, not to every earlier key as the sdpa executor does."""
    mode = make_mode("streaming", {"block_size": 64, "sink_tokens": 64, "local_tokens": 128})
    q, k, v, seq = make_inputs((1, 4, 2, 1024, 1024, 16))
    layout = mode.build_layout(q, k, seq)
    widths = []
    real = F.scaled_dot_product_attention

    def counting(qq, kk, vv, **kw):
        widths.append(kk.shape[2])
        return real(qq, kk, vv, **kw)

    monkeypatch.setattr(split_module.F, "scaled_dot_product_attention", counting)
    ex = SplitExecutor(SplitConfig(query_chunk=128))
    out = ex.attend(q, k, v, layout, seq, scale=0.25, need_lse=False).out
    assert len(widths) == 1024 // 128 and max(widths) <= 64 + 128 + 128
    monkeypatch.undo()
    want = get_registry().get("executor", "reference")().attend(q, k, v, layout, seq, scale=0.25).out
    assert rel_rms(out, want) < TOLERANCE[torch.float32]


def test_gathered_path_rows_without_keys_give_zero_and_minus_inf():
    q, k, v, seq = make_inputs((1, 2, 1, 40, 40, 8))
    from elasticfw.attention.layout import BlockLayout

    blocks = torch.zeros(1, 1, 3, 3, dtype=torch.bool)
    blocks[0, 0, 2, 0] = True  # only the last row block computes key block 0
    res = SplitExecutor().attend(q, k, v, BlockLayout(blocks, 16), seq, scale=0.3, need_lse=True)
    assert torch.equal(res.out[:, :, :32], torch.zeros_like(res.out[:, :, :32]))
    assert bool(torch.isneginf(res.lse[:, :, :32]).all()) and bool(torch.isfinite(res.lse[:, :, 32:]).all())


def test_gathered_path_rows_whose_blocks_all_lie_ahead_see_nothing():
    """A row block that selects only a key block after its rows (never causal for them) sees no key:
    zero output and ``-inf`` log-sum-exp, as the reference executor gives; the next row block, which
    selects the same key block as its diagonal, attends it causally."""
    from elasticfw.attention.layout import BlockLayout

    q, k, v, seq = make_inputs((2, 2, 1, 40, 40, 8))
    blocks = torch.zeros(1, 1, 3, 3, dtype=torch.bool)
    blocks[0, 0, 0, 1] = True  # rows 0-15: only keys 16-31, all ahead of them
    blocks[0, 0, 1, 1] = blocks[0, 0, 2, :] = True
    layout = BlockLayout(blocks, 16)
    real = F.scaled_dot_product_attention
    masks = []

    def keeping(qq, kk, vv, attn_mask=None, **kw):  # SDPA never gets a row without a key (NaN on CUDA)
        masks.append(bool((attn_mask == 0).any(-1).all()))  # now: the next chunk reuses the buffer
        return real(qq, kk, vv, attn_mask=attn_mask, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", keeping)
        got = SplitExecutor(SplitConfig(query_chunk=32)).attend(q, k, v, layout, seq, scale=0.3, need_lse=True)
    assert masks and all(masks)
    want = get_registry().get("executor", "reference")().attend(q, k, v, layout, seq, scale=0.3)
    assert torch.equal(got.out[:, :, :16], torch.zeros_like(got.out[:, :, :16]))
    assert bool(torch.isneginf(got.lse[:, :, :16]).all()) and bool(torch.isfinite(got.lse[:, :, 16:]).all())
    assert rel_rms(got.out, want.out) < TOLERANCE[torch.float32]
    torch.testing.assert_close(got.lse[:, :, 16:], want.lse[:, :, 16:], rtol=1e-5, atol=1e-4)


def test_gathered_path_mask_buffer_is_reused_and_stays_exact(monkeypatch):
    """At inference the additive masks of every chunk, layer and call share one buffer (grown when
    a chunk needs more); calls of other shapes and dtypes through the same executor, one after the
    other, still meet the reference; a call that records autograd gets a mask of its own."""
    from elasticfw_plugins.executors.gathered import MaskBuffer

    holder = MaskBuffer()
    a = holder.take((2, 3), torch.float32, torch.device("cpu"), True)
    b = holder.take((5,), torch.float32, torch.device("cpu"), True)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and b.shape == (5,)
    c = holder.take((4, 4), torch.float32, torch.device("cpu"), True)  # more than held: a larger buffer
    assert c.shape == (4, 4) and holder._buffer.numel() == 16 and c.data_ptr() == holder._buffer.data_ptr()
    d = holder.take((2, 2), torch.float32, torch.device("cpu"), False)  # no reuse: a tensor of its own
    assert d.untyped_storage().data_ptr() != holder._buffer.untyped_storage().data_ptr()
    ex = SplitExecutor(SplitConfig(query_chunk=48))
    ref = get_registry().get("executor", "reference")()
    stream = make_mode("streaming", {"block_size": 16, "sink_tokens": 16, "local_tokens": 32})
    buffers, storages = [], []
    real = F.scaled_dot_product_attention

    def recording(qq, kk, vv, attn_mask=None, **kw):
        storages.append(attn_mask.untyped_storage().data_ptr())
        return real(qq, kk, vv, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    for shape, dtype in [((1, 4, 2, 160, 160, 16), torch.float32), ((2, 2, 1, 203, 203, 8), torch.float32),
                         ((1, 4, 2, 96, 96, 16), torch.float32), ((1, 4, 2, 160, 160, 16), torch.bfloat16)]:
        q, k, v, seq = make_inputs(shape, dtype=dtype)
        layout = stream.build_layout(q, k, seq)
        with torch.no_grad():
            got = ex.attend(q, k, v, layout, seq, scale=0.25, need_lse=False).out
            want = ref.attend(q, k, v, layout, seq, scale=0.25).out
        assert rel_rms(got, want) < TOLERANCE[dtype]
        buffers.append(ex._mask_buffer._buffer)
        assert buffers[-1].untyped_storage().data_ptr() in storages  # the chunks' masks in the buffer
        storages.clear()
    assert buffers[0] is not None and buffers[2] is buffers[1]  # the smaller call reused the buffer
    assert buffers[3].dtype == torch.bfloat16  # another dtype: a buffer of its own
    q, k, v, seq = make_inputs((1, 4, 2, 96, 96, 16))
    q.requires_grad_(True)
    out = ex.attend(q, k, v, stream.build_layout(q, k, seq), seq, scale=0.25, need_lse=False).out
    assert ex._mask_buffer._buffer is buffers[3]  # autograd: a new mask, the buffer untouched
    assert storages and buffers[3].untyped_storage().data_ptr() not in storages
    out.sum().backward()
    q2 = q.detach().requires_grad_(True)
    ref.attend(q2, k, v, stream.build_layout(q2, k, seq), seq, scale=0.25).out.sum().backward()
    torch.testing.assert_close(q.grad, q2.grad, rtol=1e-4, atol=1e-5)


def test_cuda_choices_on_a_cpu():
    """The CUDA-only branches, as far as a CPU runs them: backend names, the priority context and
    the sparse path chosen per device."""
    from torch.nn.attention import SDPBackend

    assert _sdpa_backends("auto")[0] == SDPBackend.CUDNN_ATTENTION and len(_sdpa_backends("auto")) == 4
    assert _sdpa_backends("flash") == [SDPBackend.FLASH_ATTENTION]
    q, k, v, _ = make_inputs((1, 4, 2, 32, 32, 16))
    with _sdpa_context(_sdpa_backends("auto")):  # on a CPU the listed backends include one that runs
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    ex = SplitExecutor()
    assert ex.sparse_path(torch.device("cuda")) == "flex" and ex.sparse_path(torch.device("cpu")) == "gathered"
    assert SplitExecutor(SplitConfig(sparse="gathered")).sparse_path(torch.device("cuda")) == "gathered"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailableError, match="flash-attn"):
            SplitExecutor._flash_attn(q, k, v, 0.25)


def test_recipe_section_and_block_size_check():
    elastic = validate_recipe_data({"elastic": {
        "retrieval_mode": {"name": "full", "block_size": 64},
        "sparse_mode": {"name": "streaming", "block_size": 64},
        "executor": {"name": "split", "dense_backend": "cudnn", "flex": {"kernel_block_size": 128}},
        "router": {"name": "fixed"},
    }}).elastic
    assert elastic.executor.flex.kernel_block_size == 128
    with pytest.raises(ValueError, match="kernel_block_size"):
        SplitConfig(flex={"kernel_block_size": 96}).check_layout_block_size(64)
    SplitConfig(sparse="gathered", flex={"kernel_block_size": 96}).check_layout_block_size(64)


def test_an_executor_without_the_hook_runs_routed_heads_in_one_launch():
    """Third-party executors written before ``attend_routed`` existed keep working."""
    calls = []

    class OneLaunch(Executor):
        name = "one_launch_test"
        config_class = ExecutorConfig

        def attend(self, q, k, v, layout, seq, *, scale, need_lse=True):
            calls.append(layout)
            return get_registry().get("executor", "reference")().attend(q, k, v, layout, seq, scale=scale)

    q, k, v, seq = make_inputs((1, 4, 2, 50, 50, 8))
    hard = _hard([0, 1], 1, 4)
    layouts = (FULL.build_layout(q, k, seq), STREAM["block"].build_layout(q, k, seq))
    res = OneLaunch().attend_routed(q, k, v, seq, hard=hard, layouts=layouts, scale=0.3, need_lse=False)
    assert len(calls) == 1 and torch.equal(calls[0].blocks, routed_layout(hard, layouts, seq).blocks)
    assert isinstance(res, AttentionOutput)


def test_split_heads_refuses_a_wrong_routing_shape():
    q, k, v, seq = make_inputs((1, 4, 2, 20, 20, 8))
    layouts = (FULL.build_layout(q, k, seq), STREAM["block"].build_layout(q, k, seq))
    from elasticfw.errors import UnsupportedInputError

    with pytest.raises(UnsupportedInputError, match="hard must be"):
        SplitExecutor().split_heads(q, k, seq, torch.zeros(1, 2, dtype=torch.bool), layouts, False)
    assert SeqInfo.dense(1, 20, 20) is not None


def test_attention_bench_times_and_checks_split(tmp_path):
    """The GPU command's attention step on a CPU: split entries (alone and routed) and its routed
    correctness rows against the reference, on a streaming config that is sparse at 192 tokens."""
    import json

    from elasticfw.bench import attention as bench

    out = tmp_path / "a.json"
    rc = bench.main(["--device", "cpu", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "fp32",
                     "--cpu-warmup", "0", "--cpu-iters", "1", "--seq", "192", "--check-seq", "192", "--no-backward",
                     "--modes", "full", "streaming", "--set", "streaming.sink_tokens=16",
                     "--set", "streaming.local_tokens=32", "--set", "streaming.block_size=16",
                     "--executors", "flex", "split", "--msr", "0.5", "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0, data["failures"]
    rows = {r["name"]: r for r in data["results"]}
    for name in ("split:full", "split:streaming", "split:hybrid(full+streaming,msr=0.5)"):
        assert rows[name]["ms"] > 0 and rows[name]["ratio_vs_sdpa_math"] > 0
    for label in ("alone", "routed_first_full", "routed_scattered"):
        assert rows[f"check:split:streaming:{label}"]["out_rel_rms"] < 2e-5


def test_a_decode_step_over_per_sample_blocks_is_not_shared():
    """The shared decode form (one unmasked SDPA over the step's blocks) needs one pattern for every
    sample: a 1-head layout whose samples read different blocks at a host-dense step must keep each
    sample's own blocks (against the reference executor and a hand-sliced SDPA per sample)."""
    from elasticfw.attention.layout import BlockLayout

    q, k, v, _ = make_inputs((2, 4, 2, 1, 160, 16))
    seq = SeqInfo.dense(2, 1, 160)
    blocks = torch.zeros(2, 1, 1, 10, dtype=torch.bool)  # 3 of 10 blocks read: not the one-row form
    blocks[0, 0, 0, [0, 9]] = True  # sample 0: keys 0-15 and 144-159
    blocks[1, 0, 0, [2, 9]] = True  # sample 1: keys 32-47 and 144-159
    layout = BlockLayout(blocks, 16)
    got = SplitExecutor().attend(q, k, v, layout, seq, scale=0.3, need_lse=False).out
    ref = get_registry().get("executor", "reference")().attend(q, k, v, layout, seq, scale=0.3).out
    assert rel_rms(got, ref) < 1e-5
    for b, keys in ((0, [*range(16), *range(144, 160)]), (1, [*range(32, 48), *range(144, 160)])):
        kk, vv = (t[b : b + 1, :, keys].repeat_interleave(2, 1) for t in (k, v))
        want = F.scaled_dot_product_attention(q[b : b + 1], kk, vv, scale=0.3)
        assert rel_rms(got[b : b + 1], want) < TOLERANCE[torch.float32]


def test_split_heads_decides_once_per_routing_value_and_again_after_any_write():
    """The split decision is kept per routing *value*: the same routing again (the same tensor or an
    equal new one) gives the very same answer object (no new decision); a write in place, whether
    it bumps the tensor's version or not (through ``.numpy()``), a new and right one; and another
    retrieval/sparse order its own."""
    q, k, v, seq = make_inputs((1, 4, 2, 20, 100, 8))
    seq = SeqInfo.dense(1, 1, 100)
    q = q[:, :, :1]
    layouts = (FULL.build_layout(q, k, seq), STREAM["block"].build_layout(q, k, seq))
    assert not layouts[1].dense_causal
    ex = SplitExecutor()
    host = _hard([0, 1], 1, 4)  # KV head 0 full: query heads 0, 1 dense
    first = ex.split_heads(q, k, seq, host, layouts, False, hard_host=host)
    assert first == ([0, 1], [0])
    assert ex.split_heads(q, k, seq, host, layouts, False, hard_host=host) is first
    again = host.clone()
    assert ex.split_heads(q, k, seq, again, layouts, False, hard_host=again) is first
    host[0] = ~host[0]  # in place: KV head 1 full now
    assert ex.split_heads(q, k, seq, host, layouts, False, hard_host=host) == ([2, 3], [1])
    version = host._version
    host.numpy()[0] = ~host.numpy()[0]  # in place without a version bump: KV head 0 full again
    assert host._version == version
    assert ex.split_heads(q, k, seq, host, layouts, False, hard_host=host) == ([0, 1], [0])
    swapped = (layouts[1], layouts[0])  # the sparse layout first: hard's True heads are the dense ones
    assert ex.split_heads(q, k, seq, host, swapped, False, hard_host=host) == ([2, 3], [1])
    with pytest.raises(UnsupportedInputError, match="hard_host must be on the CPU"):
        ex.split_heads(q, k, seq, host, layouts, False, hard_host=host.to("meta"))


def test_a_routed_call_under_inference_mode_splits_and_stays_exact():
    """Tensors made under ``torch.inference_mode()`` have no version counter: a routed call there
    (routing made there too, as a model's forward makes it) splits its heads and meets the float64
    definition, twice (the second call reuses the decision)."""
    shape = (1, 8, 4, 90, 90, 16)
    q, k, v, seq = make_inputs(shape)
    ex = SplitExecutor(SplitConfig(sparse="gathered"))
    want = _masked(q, k, v, seq, _hard(ROUTINGS["scattered"], 1, 8), "block", 0.37)
    with torch.inference_mode():
        hard = _hard(ROUTINGS["scattered"], 1, 8)
        layouts = tuple(m.build_layout(q, k, seq) for m in (FULL, STREAM["block"]))
        assert ex.split_heads(q, k, seq, hard, layouts, False, hard_host=hard) == ([2, 3, 6, 7], [1, 3])
        for _ in range(2):
            out = attend_routed(q, k, v, seq, ex, retrieval=FULL, sparse=STREAM["block"], hard=hard,
                                layouts=layouts, scale=0.37, hard_host=hard.clone()).out
            assert rel_rms(out, want) < TOLERANCE[torch.float32]


def test_the_sdpa_backend_context_asks_torch_for_set_priority_once(monkeypatch):
    """``inspect.signature`` costs about 10 us of host time; a decode step's dense layers each open
    the backend context, so whether torch takes ``set_priority`` is asked once per process."""
    import inspect

    from torch.nn.attention import SDPBackend

    from elasticfw_plugins.executors import split

    calls = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda f, *a, **k: (calls.append(f), real(f, *a, **k))[1])
    split._sdpa_takes_priority.cache_clear()
    q = torch.randn(1, 2, 3, 8)
    for _ in range(3):
        with split._sdpa_context([SDPBackend.MATH]):
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert len(calls) == 1
    weights = torch.softmax((q @ q.transpose(-1, -2)) / 8**0.5 + torch.full((3, 3), float("-inf")).triu(1), -1)
    torch.testing.assert_close(out, weights @ q)
