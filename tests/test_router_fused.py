"""The ``mlp`` router's fused inference kernel against an independent float64 definition.

The definition below is written from the router's parameters alone: the mean of the first and
last N keys in float64, then explicit Linear and SiLU arithmetic, rounded to the weights' dtype
wherever the eager path holds a tensor of that dtype (the pooled vector, each linear's and each
SiLU's output, the logits). On the CPU the kernel runs under Triton's interpreter (tests/conftest.py
sets ``TRITON_INTERPRET=1`` without CUDA), so shapes stay small; on a machine with CUDA the same
tests run the compiled kernel on CUDA tensors (``DEVICE``).
"""

from __future__ import annotations

import copy
import io
import json
import pickle

import pytest
import torch

pytest.importorskip("triton")

from elasticfw.attention.seq import SeqInfo
from elasticfw.bench import router as router_bench
from elasticfw.errors import BackendUnavailableError, UnsupportedInputError
from elasticfw.routing.base import HeadLayout, RouterDecision
from elasticfw_plugins.routers import mlp_fused
from elasticfw_plugins.routers.mlp import MLPRouter, MLPRouterConfig

FP32 = {"logits": 1e-5, "prob": 1e-5}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the kernel runs: compiled, or interpreted


def dense(batch: int, sk: int) -> SeqInfo:
    return SeqInfo.dense(batch, sk, sk, DEVICE)


def make_router(dim: int, heads: int, pool: int, kernel: str = "triton", seed: int = 0,
                dtype: torch.dtype = torch.float32, device: str = DEVICE) -> MLPRouter:
    torch.manual_seed(seed)
    router = MLPRouter(MLPRouterConfig(pool_tokens=pool, kernel=kernel), HeadLayout((0, 1), heads, heads, dim))
    with torch.no_grad():  # spread the decisions: the initial last layer gives P(sparse) close to 0.5
        for layer in router.layers:
            layer.router_mlp[-1].weight.normal_(0.0, 0.5)
    return router.to(device=device, dtype=dtype).eval()


def make_keys(batch: int, heads: int, sk: int, dim: int, **kw) -> torch.Tensor:
    """Random keys with a per-(sample, head) offset, so that the pooled vectors and the decisions
    differ between rows."""
    kw.setdefault("device", DEVICE)
    return torch.randn(batch, heads, sk, dim, **kw) + 2 * torch.randn(batch, heads, 1, dim, **kw)


def same_weights(router: MLPRouter, kernel: str) -> MLPRouter:
    heads = router.heads
    other = MLPRouter(router.config.model_copy(update={"kernel": kernel}), heads)
    other.load_state_dict(router.state_dict())
    return other.to(next(router.parameters())).eval()


@torch.no_grad()
def definition(router: MLPRouter, layer: int, keys: torch.Tensor, starts: list[list[int]],
               standardize: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple:
    """float64 (hard, prob, logits) of routed layer ``layer``; ``starts[b]`` lists the key positions
    pooled for sample b (the first and last N real tokens); ``standardize``: (mean (H, D), scale
    (H, 1)) applied to the pooled vectors first."""
    module = router.layers[layer]
    wdtype = module.task_mlp[0].weight.dtype

    def rnd(t: torch.Tensor) -> torch.Tensor:  # a tensor the eager path holds in the weights' dtype
        return t.to(wdtype).double()

    def linear(x: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
        return rnd(x @ lin.weight.double().T + lin.bias.double())

    def silu(x: torch.Tensor) -> torch.Tensor:
        return rnd(x / (1.0 + torch.exp(-x)))

    pooled = torch.stack([keys[b][:, starts[b]].double().mean(1) for b in range(keys.shape[0])])  # (B, H, D)
    if standardize is not None:
        pooled = (pooled - standardize[0].double()) / standardize[1].double()
    t1, _, t2 = module.task_mlp
    r1, _, r2, _, r3 = module.router_mlp
    h = linear(silu(linear(rnd(pooled), t1)), t2)
    logits = linear(silu(linear(silu(linear(h, r1)), r2)), r3)
    prob = torch.softmax(logits, -1)[..., 1]
    return (prob > 0.5).double(), prob, logits


def ends(sk: int, n: int, batch: int, lengths: list[int] | None = None) -> list[list[int]]:
    out = []
    for b in range(batch):
        length = sk if lengths is None else lengths[b]
        out.append(sorted(set(range(min(n, length))) | set(range(max(length - n, 0), length))))
    return out


def check(got: RouterDecision, want: tuple, tol: dict[str, float]) -> None:
    hard, prob, logits = want
    assert got.logits is not None
    assert got.sparse.dtype == torch.float32 and got.prob_sparse.dtype == torch.float32
    assert got.sparse.shape == hard.shape and got.logits.shape == logits.shape
    assert torch.allclose(got.logits.double(), logits, atol=tol["logits"], rtol=tol["logits"])
    assert torch.allclose(got.prob_sparse.double(), prob, atol=tol["prob"], rtol=0)
    decided = (logits[..., 1] - logits[..., 0]).abs() > 2 * tol["logits"]  # clear of a tie
    assert decided.float().mean() >= 0.5
    assert torch.equal(got.sparse.double()[decided], hard[decided])
    assert set(got.sparse.unique().tolist()) <= {0.0, 1.0}


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the calls of the fused entry points (still running them)."""
    calls = {"fused_decide": 0, "fused_mlp": 0}
    for name in calls:
        original = getattr(mlp_fused, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(mlp_fused, name, counted)
    return calls


@pytest.mark.parametrize(
    ("batch", "heads", "dim", "sk", "pool"),
    [(1, 1, 32, 256, 100), (2, 3, 64, 300, 20), (1, 8, 128, 256, 100), (2, 3, 96, 300, 16)],
)
def test_fused_matches_the_float64_definition(batch, heads, dim, sk, pool, spy):
    router = make_router(dim, heads, pool)
    keys = make_keys(batch, heads, sk, dim)
    got = router.decide(1, keys, dense(batch, sk))
    assert spy == {"fused_decide": 1, "fused_mlp": 0}
    check(got, definition(router, 1, keys, ends(sk, pool, batch)), FP32)
    assert got.logits is not None and got.logits.dtype == torch.float32


def test_fused_kernel_reads_the_standardised_input(spy):
    """input_norm: standardize: the eager pooling, the running statistics, then the fused MLPs."""
    torch.manual_seed(3)
    router = MLPRouter(MLPRouterConfig(pool_tokens=20, kernel="triton", input_norm="standardize"),
                       HeadLayout((0, 1), 3, 3, 64))
    with torch.no_grad():
        for layer in router.layers:
            layer.router_mlp[-1].weight.normal_(0.0, 0.5)
    router.train()
    router.input_stats.update(1, torch.randn(6, 3, 64) * 3 + 1)
    router = router.to(DEVICE).eval()
    keys = make_keys(2, 3, 300, 64)
    got = router.decide(1, keys, dense(2, 300))
    assert spy == {"fused_decide": 0, "fused_mlp": 1}
    stats = (router.input_stats.mean[1], router.input_stats.scale(1))
    check(got, definition(router, 1, keys, ends(300, 20, 2), standardize=stats), FP32)


def test_a_router_copies_and_pickles_after_a_fused_decision(spy):
    """The fused path keeps no unpicklable state on the router (it once held the kernel module as
    an attribute): after a fused decision the router deep-copies, pickles and saves, and the copy
    decides through the kernel as the float64 definition does."""
    router = make_router(32, 2, 20)
    keys = make_keys(1, 2, 64, 32)
    router.decide(0, keys, dense(1, 64))
    clone = copy.deepcopy(router)
    restored = pickle.loads(pickle.dumps(router))
    torch.save(router.state_dict(), io.BytesIO())
    torch.save(router, io.BytesIO())
    for other in (clone, restored):
        check(other.decide(0, keys, dense(1, 64)), definition(router, 0, keys, ends(64, 20, 1)), FP32)
    assert spy == {"fused_decide": 3, "fused_mlp": 0}


def test_fused_reads_strided_keys(spy):
    """A (B, S, H, D) buffer seen as (B, H, S, D) with a head and a sequence offset, and a slice
    of a longer contiguous buffer along the sequence."""
    router = make_router(64, 3, 20, seed=1)
    buf = make_keys(2, 5, 330, 64).transpose(1, 2).contiguous()
    views = (buf.transpose(1, 2)[:, 1:4, 10:310], make_keys(2, 3, 400, 64)[:, :, 37:337])
    for keys in views:
        assert not keys.is_contiguous()
        got = router.decide(0, keys, dense(2, 300))
        check(got, definition(router, 0, keys, ends(300, 20, 2)), FP32)
    assert spy["fused_decide"] == 2


def test_bf16_keys_pool_in_float32_and_match_eager():
    router = make_router(64, 2, 50, seed=2)
    keys = (make_keys(1, 2, 256, 64) * 3 + 1).to(torch.bfloat16)
    seq = dense(1, 256)
    got = router.decide(0, keys, seq)
    check(got, definition(router, 0, keys, ends(256, 50, 1)), FP32)
    eager = same_weights(router, "eager").decide(0, keys, seq)
    assert torch.allclose(got.logits, eager.logits, atol=1e-5, rtol=1e-5)  # type: ignore[arg-type]
    assert torch.equal(got.sparse, eager.sparse)


def test_bf16_weights_round_like_the_eager_path():
    router = make_router(64, 3, 20, seed=3, dtype=torch.bfloat16)
    keys = make_keys(2, 3, 300, 64).to(torch.bfloat16)
    seq = dense(2, 300)
    got = router.decide(1, keys, seq)
    assert got.logits is not None and got.logits.dtype == torch.bfloat16
    # bf16 intermediates: an ulp (2^-8 relative) here and there, in other places than the definition's
    check(got, definition(router, 1, keys, ends(300, 20, 2)), {"logits": 3e-2, "prob": 1e-2})
    eager = same_weights(router, "eager").decide(1, keys, seq)
    assert torch.allclose(got.logits.float(), eager.logits.float(), atol=3e-2, rtol=3e-2)  # type: ignore[union-attr]
    # P(sparse) is the softmax of the returned (bf16) logits, in float32, as in the eager path
    assert torch.allclose(got.prob_sparse, torch.softmax(got.logits.float(), -1)[..., 1], atol=1e-6, rtol=0)


def test_a_tie_goes_to_the_retrieval_mode():
    router = make_router(32, 3, 8, seed=4)
    last = router.layers[0].router_mlp[-1]
    with torch.no_grad():  # both logits computed from the same weights: equal for every input
        last.weight[1] = last.weight[0]
        last.bias[1] = last.bias[0]
    got = router.decide(0, make_keys(2, 3, 64, 32), dense(2, 64))
    assert got.logits is not None and torch.equal(got.logits[..., 0], got.logits[..., 1])
    assert torch.equal(got.prob_sparse.cpu(), torch.full((2, 3), 0.5))
    assert torch.equal(got.sparse.cpu(), torch.zeros(2, 3))
    with torch.no_grad():
        last.bias[1] += 1e-3  # a small lead: sparse
    assert torch.equal(router.decide(0, make_keys(2, 3, 64, 32), dense(2, 64)).sparse.cpu(), torch.ones(2, 3))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_key_gives_a_zero_or_one_decision_on_both_paths(bad):
    """P(sparse) is NaN where a pooled key is not finite; the decision must still be 0 or 1 (NaN is not
    above 0.5: the retrieval mode), the same on the eager path as in the kernel (``prob > 0.5``)."""
    keys = make_keys(1, 2, 16, 16)
    keys[0, 0, 0, 0] = bad
    got = {}
    for kernel in ("eager", "triton"):
        router = make_router(16, 2, 4, kernel=kernel)
        with torch.no_grad():
            got[kernel] = router.decide(0, keys, dense(1, 16))
    for decision in got.values():
        assert torch.isnan(decision.prob_sparse[0, 0])
        assert decision.sparse[0, 0].item() == 0.0
    assert torch.equal(got["eager"].sparse.cpu(), got["triton"].sparse.cpu())


def test_pinned_kernel_pools_padded_and_short_inputs_eagerly(spy):
    router = make_router(32, 2, 8, seed=5)
    keys = make_keys(2, 2, 40, 32)
    padded = SeqInfo.from_lengths(torch.tensor([40, 29], device=DEVICE), 40, 40)
    check(router.decide(0, keys, padded), definition(router, 0, keys, ends(40, 8, 2, [40, 29])), FP32)
    short = make_keys(2, 2, 12, 32)  # Sk < 2 x pool_tokens: the windows overlap
    check(router.decide(0, short, dense(2, 12)), definition(router, 0, short, ends(12, 8, 2)), FP32)
    assert spy == {"fused_decide": 0, "fused_mlp": 2}


def test_fused_decide_refuses_keys_shorter_than_two_pools():
    """Called directly, the kernel's entry refuses keys it cannot pool on its fast path (fewer than
    2 x pool_tokens of them, or not 4-D) with the named error; exactly 2 x pool_tokens keys (the two
    windows meet) it pools like the definition."""
    router = make_router(32, 2, 8, seed=5)
    params = router.layers[0].kernel_params()
    with pytest.raises(UnsupportedInputError, match=r"Sk >= 2 x pool_tokens = 16, got shape \(1, 2, 15, 32\)"):
        mlp_fused.fused_decide(params, make_keys(1, 2, 15, 32), 8)
    with pytest.raises(UnsupportedInputError, match=r"got shape \(2, 40, 32\)"):
        mlp_fused.fused_decide(params, make_keys(1, 2, 40, 32)[0], 8)
    keys = make_keys(2, 2, 16, 32)
    hard, prob, logits = mlp_fused.fused_decide(params, keys, 8)
    check(RouterDecision(sparse=hard, prob_sparse=prob, logits=logits), definition(router, 0, keys, ends(16, 8, 2)),
          FP32)


def test_auto_and_eager_keep_the_eager_path_on_cpu(spy, monkeypatch):
    """auto fuses for CUDA keys only: on the CPU it is eager, interpreter or not."""
    keys, seq = torch.randn(1, 2, 40, 32), SeqInfo.dense(1, 40, 40)
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        for kernel in ("auto", "eager"):
            router = make_router(32, 2, 8, kernel=kernel, seed=6, device="cpu")
            with torch.no_grad():
                d = router.decide(0, keys, seq)
            assert d.logits is not None and d.logits.grad_fn is None
    assert spy == {"fused_decide": 0, "fused_mlp": 0}
    assert MLPRouterConfig().kernel == "auto"
    with pytest.raises(ValueError, match="kernel"):
        MLPRouterConfig(kernel="cuda")  # type: ignore[arg-type]


def test_pinned_kernel_without_a_usable_triton_names_the_field(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    router = make_router(32, 2, 8, seed=7, device="cpu")
    with pytest.raises(BackendUnavailableError, match=r"elastic\.router\.kernel = 'triton'.*not on cpu"):
        router.decide(0, torch.randn(1, 2, 40, 32), SeqInfo.dense(1, 40, 40))
    with torch.no_grad():  # unsupported weights on a usable Triton: named too
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        router.layers[0].task_mlp[0].weight.data = router.layers[0].task_mlp[0].weight.data.double()
        with pytest.raises(BackendUnavailableError, match="share one dtype"):
            router.decide(0, torch.randn(1, 2, 40, 32), SeqInfo.dense(1, 40, 40))


def test_training_always_runs_eager_and_gradients_flow(spy):
    router = make_router(32, 2, 8, seed=8).train()
    d = router.decide(0, make_keys(2, 2, 40, 32), dense(2, 40))
    assert d.sparse.requires_grad
    d.prob_sparse.sum().backward()
    grads = [p.grad for p in router.layers[0].parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)  # type: ignore[union-attr]
    assert spy == {"fused_decide": 0, "fused_mlp": 0}


def test_router_bench_times_both_paths_or_says_why_not(tmp_path, monkeypatch):
    tiny = ["--seq", "64", "--layers", "1", "--reps", "1", "--kv-heads", "2", "--head-dim", "32", "--dtype", "fp32"]
    out = tmp_path / "router.json"
    assert router_bench.main([*tiny, "--device", DEVICE, "--out", str(out)]) == 0  # CUDA or the interpreter: timed
    row = json.loads(out.read_text())["rows"][0]
    assert row["eager_per_layer_ms"] > 0 and row["fused_per_layer_ms"] > 0 and row["fused_unavailable"] is None
    assert row["fused_decisions_equal"] and row["fused_max_abs_logit_diff"] < 1e-5
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert router_bench.main([*tiny, "--device", "cpu", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    row = data["rows"][0]
    assert row["router_per_layer_ms"] > 0 and row["eager_per_layer_ms"] > 0 and row["fused_per_layer_ms"] is None
    assert "TRITON_INTERPRET" in row["fused_unavailable"] and data["fused_unavailable"] == row["fused_unavailable"]


def test_router_bench_reads_each_decision_to_the_host_as_the_runtime_does(tmp_path, monkeypatch):
    """The runtime reads every layer's decision to the host at inference (a synchronisation on a
    GPU), so the router figure times one read per decide; ``decide_only_per_layer_ms`` none."""
    monkeypatch.setattr(router_bench, "_time", lambda fn, device, reps, warmup=5: (fn(), 1.0)[1])
    reads: list[int] = []
    real_cpu = torch.Tensor.cpu
    real_decide = MLPRouter.decide
    decides: list[int] = []

    def decide(self, *a, **k):
        decision = real_decide(self, *a, **k)
        decides.append(1)
        return RouterDecision(SpyTensor(decision.sparse), decision.prob_sparse, decision.logits)

    class SpyTensor(torch.Tensor):
        def cpu(self, *a, **k):
            reads.append(1)
            return real_cpu(self, *a, **k)

    monkeypatch.setattr(MLPRouter, "decide", decide)
    out = tmp_path / "router.json"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # eager only: two timed functions (with and without reads)
    assert router_bench.main(["--seq", "64", "--layers", "3", "--reps", "1", "--kv-heads", "2", "--head-dim", "32",
                              "--dtype", "fp32", "--device", "cpu", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["timed"] == router_bench.TIMED
    # default router (3 decides, 3 reads), decide only (3, 0), eager variant (3, 3)
    assert len(decides) == 9 and len(reads) == 6
    assert data["rows"][0]["decide_only_per_layer_ms"] == pytest.approx(1 / 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_at_a_realistic_shape(spy):
    """Llama-3.1-8B's shape: B=1, 8 KV heads, head dim 128, 131072 bf16 keys, as a contiguous
    tensor and as transformers' (B, S, H, D) transposed view."""
    sk, pool = 131072, 100
    router = make_router(128, 8, pool, kernel="triton", device="cuda")
    seq = SeqInfo.dense(1, sk, sk, torch.device("cuda"))
    contiguous = make_keys(1, 8, sk, 128, device="cuda").to(torch.bfloat16)
    bshd = make_keys(1, 8, sk, 128, device="cuda").to(torch.bfloat16).transpose(1, 2).contiguous()
    transposed = bshd.transpose(1, 2)  # (B, H, S, D) view of a (B, S, H, D) buffer
    eager = same_weights(router, "eager")
    for keys in (contiguous, transposed):
        got = router.decide(1, keys, seq)
        check(got, definition(router, 1, keys, ends(sk, pool, 1)), FP32)
        want = eager.decide(1, keys, seq)
        assert torch.allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5)  # type: ignore[arg-type]
        assert torch.equal(got.sparse, want.sparse)
    assert spy["fused_decide"] == 2
    # bf16 weights
    half = make_router(128, 8, pool, kernel="triton", device="cuda", dtype=torch.bfloat16)
    check(half.decide(0, transposed, seq), definition(half, 0, transposed, ends(sk, pool, 1)),
          {"logits": 3e-2, "prob": 1e-2})
    # auto: fused where autograd does not record, eager where it does
    auto = same_weights(router, "auto")
    with torch.no_grad():
        auto.decide(0, contiguous, seq)
    assert spy["fused_decide"] == 4
    assert auto.decide(0, contiguous, seq).logits.grad_fn is not None  # type: ignore[union-attr]
    assert spy["fused_decide"] == 4
