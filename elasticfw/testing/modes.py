"""Conformance suite for attention-mode plugins — run it on your own plugin.

A plugin package tests its mode by subclassing :class:`ModeConformance` in a pytest module::

    from elasticfw.testing.modes import ModeConformance

    class TestMyMode(ModeConformance):
        mode_name = "my_mode"                       # registered name
        small_config = {"block_size": 16, ...}      # sized for sequences of ~100-300 tokens
        dense_config = {"block_size": 16, "keep": "everything"}  # settings that keep every pair

        @staticmethod
        def token_reference(q, k, seq, config):     # independent token-level definition
            ...                                     # -> (B, Hq, Sq, Sk) bool, causality included

        @staticmethod                               # optional, for modes with a side branch
        def side_reference(q, k, v, seq, config):   # its extra keys, values and visibility
            ...                                     # -> (B, Hkv, M, D), (B, Hkv, M, D), (B, Hq, Sq, M)

Every check compares against an independent definition (causal SDPA, the author's token-level
reference, a dense mask's counts, the reference executor), at the default attention scale and
others (:data:`SCALES`); subclass once per configuration to test several. ``causality`` declares
what a mode's selection may look at: ``"token"`` (nothing after the row), ``"block"`` (nothing
after the row's query block) or ``"prompt"`` (the whole prompt; checked with the layout fixed).
The checks and the levels in full: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import pytest
import torch

from elasticfw.attention.layout import BlockLayout, computed_pairs, dense_mask, esr
from elasticfw.attention.mode import AttentionMode
from elasticfw.attention.seq import SeqInfo
from elasticfw.registry import get_registry

#: (batch, query heads, kv heads, q_len, kv_len, head_dim): GQA groups 1, 3, 4; lengths that
#: are not block multiples; q_len < kv_len (chunked prefill and decode against a cache).
SHAPES: list[tuple[int, int, int, int, int, int]] = [
    (2, 3, 3, 160, 160, 16),
    (2, 6, 2, 203, 203, 16),
    (1, 8, 2, 97, 250, 16),
    (2, 3, 1, 1, 181, 16),
]
#: relative-RMS tolerance of a non-reference executor against the reference, per dtype
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
#: largest absolute difference (natural log) of a non-reference executor's log-sum-exp from the
#: reference's, per input dtype. Both see the same input values and accumulate scores in float32,
#: so the input dtype hardly matters: measured ~1e-6 for sdpa/flex on CPU and for the compiled
#: flex kernel in bf16 on an H200 (results/bench/flex-check/flex_check_h200.json)
LSE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-3, torch.float16: 1e-3}
#: the causality levels a test class may declare (module docstring), strictest first
CAUSALITY_LEVELS: tuple[str, ...] = ("token", "block", "prompt")
#: attention scales the output checks run with, as functions of head_dim: the default and two
#: that are not (one below it, one above)
SCALES: dict[str, Callable[[int], float]] = {
    "default": lambda d: d**-0.5,
    "0.37": lambda d: 0.37,
    "1.7/sqrt(d)": lambda d: 1.7 * d**-0.5,
}



def reference_mask(token_reference: Any, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, config: Any, *,
                   scale: float) -> torch.Tensor:
    """``token_reference(q, k, seq, config)``, given ``scale=`` when it accepts one: a mode whose
    selection scores with a softmax (XAttention, NSA) depends on the call's attention scale, and
    its definition must take it to be checked at non-default scales."""
    import inspect

    if "scale" in inspect.signature(token_reference).parameters:
        return token_reference(q, k, seq, config, scale=scale)
    return token_reference(q, k, seq, config)

def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """sqrt(mean((a-b)^2)) / sqrt(mean(b^2)) in float64 (fla's comparison)."""
    a64, b64 = a.double(), b.double()
    denom = b64.pow(2).mean().sqrt().clamp_min(1e-12)
    return float(((a64 - b64).pow(2).mean().sqrt() / denom).detach())


def make_inputs(
    shape: tuple[int, int, int, int, int, int],
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    kv_lens: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SeqInfo]:
    """Random q/k/v with structure (a few strong keys) so data-dependent modes make real choices."""
    batch, hq, hkv, sq, sk, dim = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, sq, dim, generator=g)
    k = torch.randn(batch, hkv, sk, dim, generator=g)
    v = torch.randn(batch, hkv, sk, dim, generator=g)
    # plant "needles": a few keys aligned with a shared direction, queries leaning to it
    direction = torch.randn(dim, generator=g)
    idx = torch.randint(0, sk, (max(1, sk // 40),), generator=g)
    k[:, :, idx] += 2.0 * direction
    q += 0.5 * direction
    lens = torch.tensor(kv_lens if kv_lens is not None else [sk] * batch)
    seq = SeqInfo.from_lengths(lens, sq, sk)
    cast: dict[str, Any] = dict(dtype=dtype, device=device)
    return q.to(**cast), k.to(**cast), v.to(**cast), SeqInfo(
        seq.q_start.to(device), seq.kv_len.to(device), sq, sk
    )


def make_mode(name: str, overrides: dict[str, Any]) -> AttentionMode:
    entry = get_registry().entry("sparse_mode", name)
    config = entry.config_class.model_validate({"name": name, **overrides})  # type: ignore[union-attr]
    return entry.cls(config)


def reference_executor() -> Any:
    return get_registry().get("executor", "reference")()


def layout_mask(mode: AttentionMode, q, k, seq) -> tuple[BlockLayout, torch.Tensor]:
    with torch.no_grad():
        layout = mode.build_layout(q, k, seq)
    return layout, dense_mask(layout, seq, num_heads=q.shape[1])


def real_rows(seq: SeqInfo) -> torch.Tensor:
    """(B, 1, Sq, 1) bool: rows that are real tokens."""
    return seq.query_valid()[:, None, :, None]


def lse_mismatch(lse: torch.Tensor, expected: torch.Tensor, seq: SeqInfo) -> tuple[int, float]:
    """(rows where one is infinite and the other not, or either is NaN; largest absolute
    difference of the rows finite in both) over real rows of two (B, Hq, Sq) log-sum-exps."""
    rows = seq.query_valid()[:, None, :].expand_as(lse)
    a, b = lse.detach()[rows].double(), expected.detach()[rows].double()
    inf_mismatch = int(((torch.isinf(a) != torch.isinf(b)) | torch.isnan(a) | torch.isnan(b)).sum())
    fin = torch.isfinite(a) & torch.isfinite(b)
    return inf_mismatch, float((a[fin] - b[fin]).abs().max()) if bool(fin.any()) else 0.0


class ModeConformance:
    """Behaviour every attention mode must have. Subclass it; see the module docstring."""

    mode_name: ClassVar[str]
    small_config: ClassVar[dict[str, Any]] = {}
    dense_config: ClassVar[dict[str, Any] | None] = None
    #: what a row's output may depend on (see "Causality levels" in the module docstring):
    #: ``"token"``, ``"block"`` or ``"prompt"``; ``None`` follows ``token_causal``
    causality: ClassVar[Literal["token", "block", "prompt"] | None] = None
    #: the older switch, used when ``causality`` is None: output of row t depends on no token
    #: after t (``"token"``); otherwise on no token after the end of t's block (``"block"``)
    token_causal: ClassVar[bool] = False
    token_reference: ClassVar[Callable[..., torch.Tensor] | None] = None
    #: modes with a side branch (merged by log-sum-exp): ``(q, k, v, seq, config) -> (k_extra,
    #: v_extra, visible)``, its extra keys and values (B, Hkv, M, D) and which query sees which
    #: (B, Hq, Sq, M) bool, written independently; the output check then covers the merge.
    #: Without it, the output check skips modes with a side branch.
    side_reference: ClassVar[Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None] = None

    def mode(self, **extra: Any) -> AttentionMode:
        return make_mode(self.mode_name, {**self.small_config, **extra})

    # -- layout against the independent token-level definition ----------------------------
    @pytest.mark.parametrize("shape", SHAPES)
    def test_layout_matches_token_definition(self, shape):
        if type(self).token_reference is None:
            pytest.fail(f"mode {self.mode_name!r} has no independent token-level definition (token_reference)")
        mode = self.mode()
        q, k, v, seq = make_inputs(shape)
        _, mask = layout_mask(mode, q, k, seq)
        expected = type(self).token_reference(q, k, seq, mode.config)
        rows = real_rows(seq).expand_as(mask)
        assert expected.shape == mask.shape, (expected.shape, mask.shape)
        diff = (mask != expected) & rows
        assert not diff.any(), f"{int(diff.sum())} (row, key) pairs differ from the token definition"

    @pytest.mark.parametrize("shape", SHAPES[:3])
    def test_reference_output_matches_token_definition(self, shape):
        if type(self).token_reference is None:
            pytest.skip("no token definition (reported by test_layout_matches_token_definition)")
        mode = self.mode()
        q, k, v, seq = make_inputs(shape)
        dim = q.shape[-1]
        side = mode.side_branch(q, k, v, seq, scale=dim**-0.5) is not None
        side_reference = type(self).side_reference
        if side and side_reference is None:
            pytest.skip("mode has a side branch and the test class gives no side_reference for it")
        group = q.shape[1] // k.shape[1]
        ex = reference_executor()
        for name, scale_of in SCALES.items():
            scale = scale_of(dim)
            # the definition at this scale (a selection that scores with a softmax depends on it)
            mask = reference_mask(type(self).token_reference, q, k, seq, mode.config, scale=scale)
            keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            if side:
                k_extra, v_extra, visible = side_reference(q, k, v, seq, mode.config)
                keys = torch.cat([keys, k_extra.repeat_interleave(group, 1)], 2)
                values = torch.cat([values, v_extra.repeat_interleave(group, 1)], 2)
                mask = torch.cat([mask, visible], -1)
            result = mode.attend(q, k, v, seq, ex, scale=scale)
            expected, expected_lse = _masked_attention_lse(q, keys, values, mask, scale)
            rows = real_rows(seq).expand_as(result.out)
            err = float((result.out[rows].double() - expected[rows].double()).abs().max())
            assert torch.allclose(result.out[rows], expected[rows], atol=1e-5, rtol=1e-5), (
                f"scale {name}: reference output differs from the token definition by {err:.2e}"
            )
            assert result.lse is not None, "the reference executor always returns the log-sum-exp"
            inf_mismatch, lse_err = lse_mismatch(result.lse, expected_lse, seq)
            assert inf_mismatch == 0, f"scale {name}: {inf_mismatch} log-sum-exp rows differ in being -inf (or are NaN)"
            assert lse_err < 1e-4, f"scale {name}: reference log-sum-exp differs from the definition by {lse_err:.2e}"

    # -- causality ----------------------------------------------------------------------------
    def causality_level(self) -> str:
        """The declared level: ``causality``, or ``token_causal`` translated when it is None."""
        level = type(self).causality
        if level is None:
            return "token" if self.token_causal else "block"
        if level not in CAUSALITY_LEVELS:
            raise ValueError(
                f"{type(self).__name__}.causality must be one of {', '.join(map(repr, CAUSALITY_LEVELS))}, "
                f"got {level!r}"
            )
        return level

    @pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2]])
    def test_causality(self, shape):
        level = self.causality_level()
        mode = self.mode()
        q, k, v, seq = make_inputs(shape)
        bs = mode.block_size
        sq, sk = q.shape[2], k.shape[2]
        offset = sk - sq  # position of row 0 (no padding in these shapes)
        cut_pos = offset + sq // 2
        if level == "block":
            cut_pos = (cut_pos // bs + 1) * bs  # first position of the next block
        if cut_pos >= sk:
            pytest.skip("shape too short for this block size")
        g = torch.Generator().manual_seed(7)
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[:, :, cut_pos - offset :] = torch.randn(q2[:, :, cut_pos - offset :].shape, generator=g)
        k2[:, :, cut_pos:] = torch.randn(k2[:, :, cut_pos:].shape, generator=g) * 3
        v2[:, :, cut_pos:] = torch.randn(v2[:, :, cut_pos:].shape, generator=g)
        ex = reference_executor()
        scale = q.shape[-1] ** -0.5
        before = slice(0, cut_pos - offset)
        if level != "prompt":
            a = mode.attend(q, k, v, seq, ex, scale=scale).out[:, :, before]
            b = mode.attend(q2, k2, v2, seq, ex, scale=scale).out[:, :, before]
            assert torch.allclose(a, b, atol=1e-6), (
                f"causality {level!r}: outputs before the cut changed when only later tokens changed"
            )
            return
        with torch.no_grad():
            layouts = {
                "original": mode.build_layout(q, k, seq, scale=scale),
                "changed": mode.build_layout(q2, k2, seq, scale=scale),
            }
        for name, layout in layouts.items():
            a = mode.attend(q, k, v, seq, ex, scale=scale, layout=layout).out[:, :, before]
            b = mode.attend(q2, k2, v2, seq, ex, scale=scale, layout=layout).out[:, :, before]
            assert torch.allclose(a, b, atol=1e-6), (
                f"causality 'prompt': with the layout selected from the {name} inputs, outputs before the cut "
                "changed when only later tokens changed (a row read a key after its position)"
            )

    # -- padding --------------------------------------------------------------------------------
    def test_padding_invariance(self):
        """A short sample padded into a batch gives the same real-row outputs as alone."""
        mode = self.mode()
        q, k, v, seq = make_inputs((2, 6, 2, 203, 203, 16), kv_lens=[203, 150])
        short = SeqInfo.dense(1, 150, 150)
        ex = reference_executor()
        scale = 16**-0.5
        batched = mode.attend(q, k, v, seq, ex, scale=scale).out[1:, :, :150]
        alone = mode.attend(q[1:, :, :150], k[1:, :, :150], v[1:, :, :150], short, ex, scale=scale).out
        assert torch.allclose(batched, alone, atol=1e-6)
        # garbage in the padding never changes real rows
        k2, v2 = k.clone(), v.clone()
        k2[1, :, 150:] = 1e3
        v2[1, :, 150:] = -1e4
        again = mode.attend(q, k2, v2, seq, ex, scale=scale).out[1:, :, :150]
        assert torch.allclose(again, alone, atol=1e-6)

    # -- dense limit -----------------------------------------------------------------------
    @pytest.mark.parametrize("shape", SHAPES[1:3])
    def test_dense_limit_equals_causal_sdpa(self, shape):
        if self.dense_config is None:
            pytest.fail(f"mode {self.mode_name!r}: dense_config (settings that keep every pair) is not given")
        mode = make_mode(self.mode_name, dict(self.dense_config))
        q, k, v, seq = make_inputs(shape)
        scale = SCALES["0.37"](q.shape[-1])
        out = mode.attend(q, k, v, seq, reference_executor(), scale=scale).out
        group = q.shape[1] // k.shape[1]
        sq, sk = q.shape[2], k.shape[2]
        mask = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask, scale=scale
        )
        assert torch.allclose(out, expected, atol=2e-5, rtol=1e-5)

    # -- reported sparsity -----------------------------------------------------------------
    @pytest.mark.parametrize("shape", SHAPES)
    def test_density_matches_reported_esr(self, shape):
        mode = self.mode()
        q, k, v, seq = make_inputs(shape, kv_lens=None)
        layout, mask = layout_mask(mode, q, k, seq)
        hq = q.shape[1]
        counted = (mask & real_rows(seq)).sum((-1, -2))
        assert torch.equal(computed_pairs(layout, seq, hq), counted)
        if type(self).token_reference is not None:
            ref = type(self).token_reference(q, k, seq, mode.config) & real_rows(seq)
            true_esr = 1 - ref.sum((-1, -2)).double() / seq.causal_pairs()[:, None].double()
            assert torch.allclose(esr(layout, seq, hq).double(), true_esr, atol=1e-6)

    # -- executors --------------------------------------------------------------------------
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
    def test_executors_match_reference(self, dtype):
        registry = get_registry()
        others = [n for n in registry.names("executor") if n != "reference" and registry.get("executor", n).is_available()]
        if not others:
            pytest.skip("no other executor available")
        mode = self.mode()
        for name in others:
            executor = registry.get("executor", name)()
            for shape, scale_name in ((SHAPES[1], "0.37"), (SHAPES[2], "1.7/sqrt(d)")):
                q, k, v, seq = make_inputs(shape, dtype=dtype, kv_lens=None)
                scale = SCALES[scale_name](q.shape[-1])
                _check_executor(mode, executor, reference_executor(), q, k, v, seq, dtype, scale=scale)


def _check_executor(mode, executor, reference, q, k, v, seq, dtype, *, scale: float | None = None) -> None:
    """``executor`` against ``reference`` on ``mode``'s layout: outputs (side branch merged), the
    executor's own log-sum-exp, the merged one when the mode has a side branch, and q/k/v
    gradients (through the log-sum-exp too when there is a side branch)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    with torch.no_grad():
        layout = mode.build_layout(q, k, seq)
    outs, grads, lses, merged = [], [], [], []
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(q.shape, generator=g).to(dtype)
    for ex, (qq, kk, vv) in ((executor, (q, k, v)), (reference, (q.float(), k.float(), v.float()))):
        with torch.no_grad():
            lses.append(ex.attend(qq, kk, vv, layout, seq, scale=scale, need_lse=True).lse)
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (qq, kk, vv))
        result = mode.attend(qq, kk, vv, seq, ex, scale=scale, layout=layout)
        result.out.backward(dout.to(result.out.dtype))
        outs.append(result.out.float())
        merged.append(result.lse)
        grads.append([t.grad.float() for t in (qq, kk, vv)])
    tol = TOLERANCE[dtype]
    assert rel_rms(outs[0], outs[1]) < tol, f"{executor.name} output: rel RMS {rel_rms(outs[0], outs[1]):.2e} >= {tol}"
    lse_tol = LSE_TOLERANCE[dtype]
    checks = [("log-sum-exp", lses)]
    if merged[0] is not None and merged[1] is not None:
        checks.append(("merged log-sum-exp (side branch)", merged))
    for what, (got, want) in checks:
        assert got is not None, f"{executor.name} returned no log-sum-exp with need_lse=True"
        assert got.shape == want.shape, f"{executor.name} {what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        inf_mismatch, err = lse_mismatch(got, want, seq)
        assert inf_mismatch == 0, f"{executor.name} {what}: {inf_mismatch} rows differ in being -inf (or are NaN)"
        assert err < lse_tol, f"{executor.name} {what}: max abs difference {err:.2e} >= {lse_tol}"
    for name, a, b in zip("qkv", grads[0], grads[1]):
        err = rel_rms(a, b)
        assert err < 3 * tol, f"{executor.name} d{name}: rel RMS {err:.2e} >= {3 * tol}"


def _masked_attention_lse(q, k, v, mask, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over the pairs ``mask`` allows, in float64: (out in q's dtype, lse float64);
    rows that see nothing give 0 and -inf. ``k``/``v`` have q's heads (GQA already expanded)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.matmul(probs, v.double()).to(q.dtype), torch.logsumexp(scores, -1)


def _masked_attention(q, k, v, mask, scale: float | None = None) -> torch.Tensor:
    return _masked_attention_lse(q, k, v, mask, scale)[0]
