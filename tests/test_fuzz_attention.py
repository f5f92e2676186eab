"""Fuzzing the attention core: random valid calls agree across executors, random invalid calls
raise :class:`~elasticfw.errors.UnsupportedInputError` naming the argument.

Valid calls: batch 1-3, key lengths 1-96, queries the last 1..Sk positions (prefill, chunked
prefill, decode), Hkv 1-3 with GQA groups 1-3, head_dim 8 or 16, random left padding per sample
(canonicalised as the transformers bridge does, so a sample may be all padding), two random
registered modes with small configs and a random per-KV-head routing between them (combined per
head with ``select_heads`` as the runtime's single launch does, side branches merged by
log-sum-exp), float32 and bfloat16. Each executor configuration — ``reference`` and ``sdpa`` with
small query chunks, ``flex`` emulated with several kernel block sizes, ``flex`` eager — must
agree with the ``reference`` executor on the real query rows, and the reference with a plain
float64 masked softmax over :func:`~elasticfw.attention.layout.dense_mask`.

Invalid calls start from a valid one and break one thing (a non-4-D or empty tensor, a k/v on
another device or of another dtype, head counts that do not divide, a NaN scale, a layout over
another grid, ...). Every entry point — each executor's ``attend`` and each mode's ``attend`` —
must raise UnsupportedInputError whose message names the broken argument, and nothing else.

Reproducible: derandomized, no example database. ``ELASTICFW_FUZZ_EXAMPLES=500`` for a longer hunt.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from mode_definitions import all_definitions
from pydantic import ValidationError

from elasticfw.attention.executor import Executor
from elasticfw.attention.layout import BlockLayout, causal_layout, dense_mask, rescale, select_heads
from elasticfw.attention.mode import AttentionMode, AttentionOutput, attend_routed
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import UnsupportedInputError
from elasticfw.model.bridge import KeyPaddingInfo
from elasticfw.model.canonical import canonicalize
from elasticfw.registry import get_registry
from elasticfw.testing.modes import rel_rms

_EXAMPLES = int(os.environ.get("ELASTICFW_FUZZ_EXAMPLES", "0"))
settings.register_profile(
    "elasticfw-fuzz-attention",
    deadline=None,  # CPU time varies on shared CI machines; the examples are small
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
)
FUZZ = settings.get_profile("elasticfw-fuzz-attention")

#: relative RMS error against the float32 reference on the same (rounded) inputs
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
#: absolute error of the float32 reference against the float64 masked softmax
REFERENCE_ATOL = 2e-5

MODE_NAMES = get_registry().names("sparse_mode")
SMALL_CONFIGS = {name: definition["small_config"] for name, definition in all_definitions().items()}


def fuzz(examples: int) -> settings:
    """The profile with ``examples`` examples (``ELASTICFW_FUZZ_EXAMPLES`` overrides)."""
    return settings(FUZZ, max_examples=_EXAMPLES or examples)


# ---------------------------------------------------------------------------------------------
# executors under test
# ---------------------------------------------------------------------------------------------


def executor(name: str, **config: Any) -> Executor:
    entry = get_registry().entry("executor", name)
    return entry.cls(entry.config_class.model_validate({"name": name, **config}))  # type: ignore[union-attr]


#: (id, config) of every executor configuration compared with the reference
EXECUTORS: list[tuple[str, str, dict[str, Any]]] = [
    ("sdpa", "sdpa", {}),
    ("sdpa-chunk7", "sdpa", {"query_chunk": 7}),
    ("reference-chunk5", "reference", {"query_chunk": 5}),
    ("flex", "flex", {}),
    ("flex-kb8-chunk16", "flex", {"kernel_block_size": 8, "emulation_query_chunk": 16}),
    ("flex-kb32", "flex", {"kernel_block_size": 32}),
    ("flex-kb128", "flex", {"kernel_block_size": 128}),
    ("flex-eager", "flex", {"implementation": "eager"}),
]


def available_executors() -> list[tuple[str, Executor]]:
    out = []
    for ident, name, config in EXECUTORS:
        if name in get_registry().names("executor") and get_registry().get("executor", name).is_available():
            out.append((ident, executor(name, **config)))
    return out


# ---------------------------------------------------------------------------------------------
# valid calls
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seq: SeqInfo
    scale: float
    groups: int

    @property
    def hq(self) -> int:
        return self.q.shape[1]


@st.composite
def cases(draw: st.DrawFn, dtype: torch.dtype = torch.float32) -> Case:
    batch = draw(st.integers(1, 3), label="batch")
    hkv = draw(st.integers(1, 3), label="kv heads")
    groups = draw(st.integers(1, 3), label="groups")
    dim = draw(st.sampled_from([8, 16]), label="head_dim")
    sk = draw(st.integers(1, 96), label="keys")
    sq = draw(st.one_of(st.just(sk), st.just(1), st.integers(1, sk)), label="queries")
    padding = draw(
        st.lists(st.one_of(st.just(0), st.integers(0, sk)), min_size=batch, max_size=batch), label="left padding"
    )
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hkv * groups, sq, dim, generator=g)
    k = torch.randn(batch, hkv, sk, dim, generator=g)
    v = torch.randn(batch, hkv, sk, dim, generator=g)
    # a few strong keys, so that data-dependent modes make real choices
    direction = torch.randn(dim, generator=g)
    k[:, :, torch.randint(0, sk, (max(1, sk // 16),), generator=g)] += 2.0 * direction
    q += 0.5 * direction
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    mask = torch.arange(sk)[None, :] >= torch.tensor(padding)[:, None]
    info = KeyPaddingInfo(mask if any(padding) else None, sk - sq, sq, sk)
    can = canonicalize(q, k, v, info)
    return Case(can.q, can.k, can.v, can.seq, dim**-0.5, groups)


def make_mode(name: str, block_size: int, extra: dict[str, Any]) -> AttentionMode | None:
    entry = get_registry().entry("sparse_mode", name)
    config = {**SMALL_CONFIGS.get(name, {}), "block_size": block_size, **extra}
    try:
        return entry.cls(entry.config_class.model_validate({"name": name, **config}))  # type: ignore[union-attr]
    except ValidationError:
        return None  # e.g. a mode block size its other settings do not allow


@st.composite
def modes(draw: st.DrawFn) -> AttentionMode:
    name = draw(st.sampled_from(MODE_NAMES), label="mode")
    block_size = draw(st.sampled_from([16, 32]), label="block size")
    extra = {"compression_branch": draw(st.booleans(), label="nsa compression")} if name == "nsa" else {}
    if "decode" in get_registry().entry("sparse_mode", name).config_class.model_fields:  # type: ignore[union-attr]
        extra["decode"] = draw(st.sampled_from(["full", "sparse"]), label="decode")
    mode = make_mode(name, block_size, extra)
    if mode is None:
        mode = make_mode(name, 16, {})
    assert mode is not None, f"the small config of {name!r} does not validate"
    return mode


def routed_attention(
    case: Case, ex: Executor, retrieval: AttentionMode, sparse: AttentionMode, hard: torch.Tensor,
    layouts: tuple[BlockLayout, BlockLayout], need_lse: bool = True,
) -> AttentionOutput:
    """Every head in its routed mode, in one executor call (ElasticRuntime's single launch)."""
    return attend_routed(case.q, case.k, case.v, case.seq, ex, retrieval=retrieval, sparse=sparse, hard=hard,
                         layouts=layouts, scale=case.scale, need_lse=need_lse)


def masked_softmax(case: Case, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain float64 attention over a (B, Hq, Sq, Sk) mask; rows without keys: out 0, lse -inf."""
    k = case.k.double().repeat_interleave(case.groups, 1)
    v = case.v.double().repeat_interleave(case.groups, 1)
    scores = (case.q.double() @ k.transpose(-1, -2)) * case.scale
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, -1)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return probs @ v, lse


def check_agreement(
    case: Case, retrieval: AttentionMode, sparse: AttentionMode, hard_kv: torch.Tensor, need_lse: bool
) -> None:
    seq, hq = case.seq, case.hq
    hard = hard_kv.repeat_interleave(case.groups, dim=1)  # (B, Hq): KV-group granularity, as routers decide
    with torch.no_grad():
        layouts = (retrieval.build_layout(case.q, case.k, seq), sparse.build_layout(case.q, case.k, seq))
        rows = seq.query_valid()[:, None, :].expand(-1, hq, -1)  # real query rows
        reference = executor("reference")
        # the reference against a plain masked softmax over its dense mask (layout part only)
        bs = min(layouts[0].block_size, layouts[1].block_size)
        combined = select_heads(hard, rescale(layouts[1], seq, bs), rescale(layouts[0], seq, bs))
        ref_plain = reference.attend(case.q.float(), case.k.float(), case.v.float(), combined, seq, scale=case.scale)
        expected, expected_lse = masked_softmax(case, dense_mask(combined, seq, num_heads=hq))
        err = (ref_plain.out.double() - expected).abs()[rows]
        assert err.numel() == 0 or float(err.max()) < REFERENCE_ATOL, f"reference vs masked softmax: {float(err.max()):.2e}"
        assert ref_plain.lse is not None
        lse, lse_exp = ref_plain.lse.double()[rows], expected_lse[rows]
        assert torch.equal(torch.isfinite(lse), torch.isfinite(lse_exp)), "rows without keys differ"
        finite = torch.isfinite(lse)
        assert torch.allclose(lse[finite], lse_exp[finite], atol=REFERENCE_ATOL, rtol=1e-6)

        # every executor configuration against the reference, routed modes and side branches included
        f32 = replace(case, q=case.q.float(), k=case.k.float(), v=case.v.float())
        want = routed_attention(f32, reference, retrieval, sparse, hard, layouts)
        tol = TOLERANCE[case.q.dtype]
        for ident, ex in available_executors():
            if case.q.dtype not in ex.supported_dtypes:
                continue
            got = routed_attention(case, ex, retrieval, sparse, hard, layouts, need_lse)
            assert got.out.dtype == case.q.dtype and got.out.shape == case.q.shape, ident
            assert torch.isfinite(got.out).all(), f"{ident}: non-finite output"
            if bool(rows.any()):
                err_rel = rel_rms(got.out.float()[rows], want.out[rows])
                assert err_rel < tol, f"{ident} vs reference: rel RMS {err_rel:.2e} >= {tol:.0e}"
            if got.lse is not None and want.lse is not None:
                a, b = got.lse[rows], want.lse[rows]
                assert torch.equal(torch.isfinite(a), torch.isfinite(b)), f"{ident}: rows without keys differ"
                ok = torch.isfinite(b)
                assert torch.allclose(a[ok], b[ok], atol=10 * tol, rtol=tol), f"{ident}: lse differs"


@fuzz(60)
@given(case=cases(), retrieval=modes(), sparse=modes(), data=st.data())
def test_executors_agree_float32(case: Case, retrieval: AttentionMode, sparse: AttentionMode, data: st.DataObject) -> None:
    hard = data.draw(_routing(case), label="routing")
    event(f"{retrieval.name}/{sparse.name}")
    check_agreement(case, retrieval, sparse, hard, data.draw(st.booleans(), label="need_lse"))


@fuzz(20)
@given(case=cases(dtype=torch.bfloat16), retrieval=modes(), sparse=modes(), data=st.data())
def test_executors_agree_bfloat16(case: Case, retrieval: AttentionMode, sparse: AttentionMode, data: st.DataObject) -> None:
    hard = data.draw(_routing(case), label="routing")
    check_agreement(case, retrieval, sparse, hard, data.draw(st.booleans(), label="need_lse"))


def _routing(case: Case) -> st.SearchStrategy[torch.Tensor]:
    batch, hkv = case.k.shape[0], case.k.shape[1]
    return st.one_of(
        st.sampled_from([False, True]).map(lambda x: torch.full((batch, hkv), x)),
        st.lists(st.booleans(), min_size=batch * hkv, max_size=batch * hkv).map(
            lambda bits: torch.tensor(bits).reshape(batch, hkv)
        ),
    )


# ---------------------------------------------------------------------------------------------
# invalid calls
# ---------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One attention call's arguments, and the argument names its error may give."""

    q: Any
    k: Any
    v: Any
    seq: Any
    scale: Any
    layout: Any
    names: tuple[str, ...]
    #: only executors refuse it (a dtype no executor supports; a mode alone may compute in it)
    executor_only: bool = False


def _seq_like(seq: SeqInfo, *, batch: int | None = None, q_len: int | None = None, capacity: int | None = None) -> SeqInfo:
    batch = seq.batch if batch is None else batch
    capacity = seq.kv_capacity if capacity is None else capacity
    q_len = seq.q_len if q_len is None else q_len
    return SeqInfo.dense(batch, q_len, capacity)


def _other_dtype(dtype: torch.dtype, draw: st.DrawFn) -> torch.dtype:
    return draw(st.sampled_from([d for d in (torch.float64, torch.float16, torch.bfloat16, torch.float32) if d != dtype]))


def _corrupt(name: str, c: Case, draw: st.DrawFn) -> Call:
    """``c`` with one thing broken; building it may raise (an invalid SeqInfo)."""
    q, k, v, seq = c.q, c.k, c.v, c.seq
    layout = causal_layout(seq, 16)
    batch, hq, sq, dim = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    call = Call(q, k, v, seq, c.scale, layout, ())
    if name == "q not 4-D":
        return replace(call, q=draw(st.sampled_from([q[0], q[None], q[0, 0], q.reshape(-1)])), names=("q",))
    if name == "k not 4-D":
        return replace(call, k=draw(st.sampled_from([k[0], k[None], k.reshape(-1)])), names=("k",))
    if name == "v not 4-D":
        return replace(call, v=draw(st.sampled_from([v[0], v[None], v[0, 0]])), names=("v",))
    if name == "batch 0":
        return replace(call, q=q[:0], k=k[:0], v=v[:0], seq=_seq_like(seq, batch=0), names=("q",))
    if name == "no queries":
        return replace(call, q=q[:, :, :0], seq=_seq_like(seq, q_len=0), names=("q",))
    if name == "no keys":
        empty = _seq_like(seq, q_len=0, capacity=0)
        return replace(call, q=q[:, :, :0], k=k[:, :, :0], v=v[:, :, :0], seq=empty, names=("q", "k"))
    if name == "head_dim 0":
        return replace(call, q=q[..., :0], k=k[..., :0], v=v[..., :0], names=("q",))
    if name == "no heads":
        return replace(call, q=q[:, :0], names=("q",))
    if name == "k, v on another device":
        which = draw(st.sampled_from(["k", "v", "kv"]))
        return replace(
            call, k=k.to("meta") if "k" in which else k, v=v.to("meta") if "v" in which else v, names=(which[0],)
        )
    if name == "seq on another device":
        meta = SeqInfo(seq.q_start.to("meta"), seq.kv_len.to("meta"), seq.q_len, seq.kv_capacity)
        return replace(call, seq=meta, names=("seq",))
    if name == "k, v dtype differs":
        dtype = _other_dtype(q.dtype, draw)
        which = draw(st.sampled_from(["k", "v", "kv"]))
        return replace(
            call, k=k.to(dtype) if "k" in which else k, v=v.to(dtype) if "v" in which else v, names=(which[0],)
        )
    if name == "unsupported dtype":
        dtype = draw(st.sampled_from([torch.float64, torch.int64, torch.int8, torch.bool, torch.complex64]))
        return replace(
            call, q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), names=("q",), executor_only=dtype.is_floating_point
        )
    if name == "heads do not divide":
        heads = draw(st.sampled_from([h for h in range(2, hq + 2) if hq % h]))
        return replace(call, k=k[:, :1].expand(-1, heads, -1, -1), v=v[:, :1].expand(-1, heads, -1, -1), names=("k",))
    if name == "v shape differs":
        bad = draw(st.sampled_from(["dim", "len", "heads"]))
        if bad == "dim":
            other = torch.zeros(batch, hkv, sk, dim + 1)
        elif bad == "len":
            other = torch.zeros(batch, hkv, sk + 1, dim)
        else:
            other = torch.zeros(batch, hkv + 1, sk, dim)
        return replace(call, v=other.to(v.dtype), names=("v",))
    if name == "k head_dim differs":
        return replace(call, k=torch.zeros(batch, hkv, sk, dim * 2), v=torch.zeros(batch, hkv, sk, dim * 2), names=("k",))
    if name == "k batch differs":
        return replace(call, k=torch.cat([k, k]), v=torch.cat([v, v]), names=("k",))
    if name == "seq batch differs":
        return replace(call, seq=_seq_like(seq, batch=batch + draw(st.sampled_from([-1, 1])) or 2), names=("seq",))
    if name == "seq q_len differs":
        other = draw(st.sampled_from([n for n in range(0, sk + 1) if n != sq]))
        return replace(call, seq=_seq_like(seq, q_len=other), names=("seq",))
    if name == "seq capacity differs":
        return replace(call, seq=_seq_like(seq, capacity=sk + draw(st.integers(1, 20))), names=("seq",))
    if name == "seq not a SeqInfo":
        return replace(call, seq=draw(st.sampled_from([None, (seq.q_start, seq.kv_len), "seq"])), names=("seq",))
    if name == "seq values":
        bad = draw(st.sampled_from(["negative q_start", "kv_len > capacity", "q past capacity", "negative kv_len"]))
        q_start, kv_len = seq.q_start.clone(), seq.kv_len.clone()
        b = draw(st.integers(0, batch - 1))
        if bad == "negative q_start":
            q_start[b] = -1
        elif bad == "kv_len > capacity":
            kv_len[b] = sk + 1
        elif bad == "q past capacity":
            q_start[b] = sk - sq + 1
        else:
            kv_len[b] = -1
        return replace(call, seq=SeqInfo(q_start, kv_len, sq, sk), names=("SeqInfo",))
    if name == "seq dtype":
        dtype = draw(st.sampled_from([torch.float32, torch.int32, torch.bool]))
        return replace(call, seq=SeqInfo(seq.q_start.to(dtype), seq.kv_len, sq, sk), names=("SeqInfo",))
    if name == "bad scale":
        scale = draw(
            st.sampled_from(
                [math.nan, math.inf, -math.inf, 0.0, -0.125, 10**400, None, "0.125", True, torch.tensor(0.125), 1j]
            )
        )
        return replace(call, scale=scale, names=("scale",))
    if name == "layout grid":
        blocks = layout.blocks
        bad = draw(st.sampled_from(["rows", "cols"]))
        shape = list(blocks.shape)
        shape[2 if bad == "rows" else 3] += 1
        return replace(call, layout=BlockLayout(torch.ones(shape, dtype=torch.bool), 16), names=("layout",))
    if name == "layout heads":
        heads = draw(st.sampled_from([h for h in range(2, hq + 2) if h not in (1, hkv, hq)]))
        blocks = layout.blocks.expand(-1, heads, -1, -1)
        return replace(call, layout=BlockLayout(blocks, 16), names=("layout",))
    if name == "layout batch":
        blocks = torch.ones(batch + 1, *layout.blocks.shape[1:], dtype=torch.bool)
        return replace(call, layout=BlockLayout(blocks, 16), names=("layout",))
    if name == "layout of another seq":
        other = _seq_like(seq, capacity=sk + 16)  # one key block more
        return replace(call, layout=causal_layout(other, 16), names=("layout",))
    if name == "layout not a layout":
        return replace(call, layout=draw(st.sampled_from([None, layout.blocks, "causal"])), names=("layout",))
    if name == "q not a tensor":
        return replace(call, q=draw(st.sampled_from([q.tolist(), q.numpy(), None])), names=("q",))
    if name == "q sparse":
        return replace(call, q=q.to_sparse(), names=("q",))
    raise AssertionError(f"unknown corruption {name!r}")


CORRUPTIONS = [
    "q not 4-D", "k not 4-D", "v not 4-D", "batch 0", "no queries", "no keys", "head_dim 0", "no heads",
    "k, v on another device", "seq on another device", "k, v dtype differs", "unsupported dtype",
    "heads do not divide", "v shape differs", "k head_dim differs", "k batch differs", "seq batch differs",
    "seq q_len differs", "seq capacity differs", "seq not a SeqInfo", "seq values", "seq dtype", "bad scale",
    "layout grid", "layout heads", "layout batch", "layout of another seq", "layout not a layout", "q not a tensor",
    "q sparse",
]  # fmt: skip
#: corruptions of the layout: a mode's attend builds its own layout unless one is passed
LAYOUT_CORRUPTIONS = {name for name in CORRUPTIONS if name.startswith("layout")}


def entry_points(call: Call, corruption: str) -> list[tuple[str, Callable[[], Any]]]:
    """Every public way into attention with ``call``'s arguments."""
    points: list[tuple[str, Callable[[], Any]]] = []
    for ident, ex in available_executors():
        points.append((f"{ident}.attend", lambda ex=ex: ex.attend(call.q, call.k, call.v, call.layout, call.seq, scale=call.scale)))
    base = executor("reference")
    for name in MODE_NAMES:
        mode = make_mode(name, 16, {"compression_branch": True} if name == "nsa" else {})
        assert mode is not None
        layout = call.layout if corruption in LAYOUT_CORRUPTIONS else None
        if layout is not None or corruption not in LAYOUT_CORRUPTIONS:
            points.append(
                (f"mode {name}.attend", lambda m=mode, lay=layout: m.attend(call.q, call.k, call.v, call.seq, base, scale=call.scale, layout=lay))
            )
        overridden = type(mode).side_branch is not AttentionMode.side_branch
        if overridden and corruption not in LAYOUT_CORRUPTIONS and not call.executor_only:
            points.append((f"mode {name}.side_branch", lambda m=mode: m.side_branch(call.q, call.k, call.v, call.seq, scale=call.scale)))
    return points


def assert_names(exc: UnsupportedInputError, names: tuple[str, ...], where: str) -> None:
    message = str(exc)
    assert any(f"'{n}'" in message or message.startswith(f"{n}:") for n in names), (
        f"{where}: the error names none of {names}: {message}"
    )


def _applicable(corruption: str, c: Case) -> bool:
    hq, hkv = c.q.shape[1], c.k.shape[1]
    if corruption == "layout heads":
        return any(h not in (1, hkv, hq) for h in range(2, hq + 2))
    if corruption == "heads do not divide":
        return any(hq % h for h in range(2, hq + 2))
    return True


def check_invalid(case: Case, corruption: str, draw: st.DrawFn) -> None:
    if not _applicable(corruption, case):
        event("not applicable")
        return
    event(corruption)
    try:
        call = _corrupt(corruption, case, draw)
    except UnsupportedInputError as exc:  # an invalid SeqInfo is refused when it is built
        assert_names(exc, ("SeqInfo",), corruption)
        return
    assert call.names != ("SeqInfo",), f"{corruption}: SeqInfo accepted invalid values"
    for where, attend in entry_points(call, corruption):
        with pytest.raises(UnsupportedInputError) as info:
            attend()
        assert_names(info.value, call.names, f"{corruption} through {where}")


@fuzz(120)
@given(case=cases(), corruption=st.sampled_from(CORRUPTIONS), data=st.data())
def test_invalid_inputs_raise_unsupported_input_error(case: Case, corruption: str, data: st.DataObject) -> None:
    check_invalid(case, corruption, data.draw)


def _fixed_case() -> Case:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = torch.randn(2, 2, 20, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g)
    return Case(q, k, v, SeqInfo.from_lengths(torch.tensor([20, 12]), 5, 20), 8**-0.5, 2)


@pytest.mark.parametrize("corruption", CORRUPTIONS)
@settings(FUZZ, max_examples=3)
@given(data=st.data())
def test_each_corruption_on_a_fixed_case(corruption: str, data: st.DataObject) -> None:
    """Every corruption at least once (the fuzzer above picks them at random)."""
    check_invalid(_fixed_case(), corruption, data.draw)
