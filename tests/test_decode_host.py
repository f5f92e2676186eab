"""Decode steps spend little host time: no device read in elasticfw's code once a sequence is routed,
and the compact KV cache writes and reads its stores through slices where it can.

On a GPU a decode step is host-bound (a few microseconds of GPU work per operation), and every
read of a device value on the host (``.item()``, ``bool(t)``, ``.cpu()``, ``.tolist()``) waits for
every queued kernel. These tests count such reads made from elasticfw's own code during decode
steps (transformers' own are not counted), and check every fast path against an answer computed
another way: the reference executor (plain PyTorch over the per-head layout), the full KV cache
(the executor over the streaming layout, where the compact cache uses its slots), or the hand
formula.
"""

from __future__ import annotations

import contextlib
import json
import traceback
from pathlib import Path

import pytest
import torch
from file_modules import load_script
from torch.utils._python_dispatch import TorchDispatchMode

import elasticfw
import elasticfw.kernels.decode_attention as decode_module
import elasticfw_plugins
import elasticfw_plugins.executors.split as split_module
from elasticfw.attention.seq import SeqInfo
from elasticfw.model.elastic import ElasticModel
from elasticfw.model.kv_cache import _head_span
from elasticfw.recipe import validate_recipe_data
from elasticfw.routing.base import RouterDecision
from elasticfw.testing.models import padded_batch, tiny_model

OWN_CODE = (str(Path(elasticfw.__file__).parent), str(Path(elasticfw_plugins.__file__).parent))
FULL = {"name": "full", "block_size": 16}
MIXED = {"name": "fixed", "assign": "sparse_heads", "heads": [[0, 1], [1, 0], [3, 0], [3, 1]]}
ALL_SPARSE = {"name": "fixed", "assign": "all_sparse"}


def streaming(granularity: str, sink: int = 16, local: int = 32) -> dict:
    return {"name": "streaming", "sink_tokens": sink, "local_tokens": local, "block_size": 16,
            "granularity": granularity}


def section(router: dict, *, executor: dict | None = None, kv_cache: str = "full", sparse: dict | None = None):
    return validate_recipe_data({"elastic": {
        "retrieval_mode": FULL, "sparse_mode": sparse or streaming("block"), "router": router,
        "executor": executor or {"name": "split"}, "kv_cache": kv_cache,
    }}).elastic


class OwnDeviceReads(TorchDispatchMode):
    """Records every read of a tensor value on the host made from elasticfw's code (its stack),
    except while ``paused`` (a Triton kernel run by the interpreter reads its arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.paused = False
        self.active = False  # inside `with mode:` (the decode steps), not during the prefill

    def __enter__(self):  # type: ignore[no-untyped-def]
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        self.active = False
        return super().__exit__(*exc)

    def record(self, what: str) -> None:
        if not self.active or self.paused:
            return
        stack = traceback.extract_stack()[:-2]
        own = [f for f in stack if f.filename.startswith(OWN_CODE)]
        if own:
            self.reads.append(f"{what} at {own[-1].filename}:{own[-1].lineno}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.record("item/bool")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def device_reads(monkeypatch):
    """An :class:`OwnDeviceReads` to enter around a step; ``.cpu()`` and ``.tolist()`` count too (on a
    CPU tensor they dispatch nothing, on a CUDA tensor they wait for the GPU)."""
    mode = OwnDeviceReads()
    for name in ("cpu", "tolist"):
        real = getattr(torch.Tensor, name)

        def counting(self, *args, _real=real, _name=name, **kwargs):
            mode.record(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    real_kernel = decode_module.decode_attention

    def paused_kernel(*args, **kwargs):
        mode.paused = True
        try:
            return real_kernel(*args, **kwargs)
        finally:
            mode.paused = False

    monkeypatch.setattr(decode_module, "decode_attention", paused_kernel)
    return mode


def decode_logits(elastic: ElasticModel, ids: torch.Tensor, tokens: torch.Tensor, *, cache=None, reads=None):
    """Logits of the prefill's last row and of one decode step per column of ``tokens`` (no
    padding, no attention mask); ``reads`` (an :class:`OwnDeviceReads`) is entered around the steps."""
    with torch.no_grad():
        out = elastic(input_ids=ids, cache=cache, use_cache=True)
        cache = out.past_key_values
        logits = [out.logits[:, -1:]]
        for i in range(tokens.shape[1]):
            if reads is not None:
                with reads:
                    step = elastic(input_ids=tokens[:, i : i + 1], cache=cache, use_cache=True)
            else:
                step = elastic(input_ids=tokens[:, i : i + 1], cache=cache, use_cache=True)
            logits.append(step.logits)
    return torch.cat(logits, dim=1)


def inputs(batch: int = 2, length: int = 40, steps: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (batch, length), generator=g), torch.randint(3, 250, (batch, steps), generator=g)


# -- SeqInfo ---------------------------------------------------------------------------------------


def test_a_dense_seq_counts_its_query_blocks_on_the_host(monkeypatch):
    """Queries at the last q_len of kv_len positions span blocks (kv_len - q_len) // bs .. (kv_len - 1) // bs."""
    cases = [(b, q, n, bs) for b in (1, 3) for q, n in ((1, 1), (1, 200), (5, 9), (16, 64), (17, 64), (64, 64))
             for bs in (1, 16, 64, 128)]

    def no_read(self):
        raise AssertionError("SeqInfo.num_query_blocks read the device")

    monkeypatch.setattr(torch.Tensor, "item", no_read)
    for batch, q_len, kv_len, bs in cases:
        expected = (kv_len - 1) // bs - (kv_len - q_len) // bs + 1
        assert SeqInfo.dense(batch, q_len, kv_len).num_query_blocks(bs) == expected, (batch, q_len, kv_len, bs)
    monkeypatch.undo()
    assert SeqInfo.from_lengths(torch.tensor([9, 4]), 1, 9).num_query_blocks(4) == 1  # one query each
    padded = SeqInfo.from_lengths(torch.tensor([9, 4]), 5, 9)  # not dense: read once, from q_start
    assert padded.num_query_blocks(4) == 2  # sample 0: positions 4..8 -> blocks 1..2


# -- the full KV cache: routing held from the prefill -------------------------------------------------


@pytest.mark.skipif(split_module.triton_unavailable(torch.device("cpu")) is not None,
                    reason="needs Triton's interpreter")
@pytest.mark.parametrize("router", [MIXED, ALL_SPARSE], ids=["mixed", "all_sparse"])
def test_decode_steps_read_nothing_from_the_device(router, device_reads):
    """A routed model's decode steps with the full cache (split executor, the decode kernel) read no
    device value in elasticfw's code: the prefill's routing is kept on the host with its decision.
    The logits equal the reference executor's (plain PyTorch over the combined layout)."""
    ids, tokens = inputs(length=80)
    fast = ElasticModel(tiny_model("llama"), section(router, executor={"name": "split", "decode_sparse": "kernel"}))
    got = decode_logits(fast, ids, tokens, reads=device_reads)
    assert device_reads.reads == []
    ref = ElasticModel(tiny_model("llama"), section(router, executor={"name": "reference"}))
    assert torch.allclose(got, decode_logits(ref, ids, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(split_module.triton_unavailable(torch.device("cpu")) is not None,
                    reason="needs Triton's interpreter")
def test_a_padded_batch_reads_its_mask_once_per_step(device_reads):
    """Left-padded prompts: each decode step reads the padding mask from the device once per forward
    (whether anything is padded, in the mask function; then the contiguity check and the starts, in
    the first layer only), not in each of the 4 layers; the logits equal the reference executor's."""
    ids, mask = padded_batch([80, 64], side="left", seed=5)
    tokens = torch.randint(3, 250, (2, 4), generator=torch.Generator().manual_seed(6))

    def run(elastic, reads=None):
        step_mask, out = mask, []
        with torch.no_grad():
            res = elastic(input_ids=ids, attention_mask=step_mask, use_cache=True)
            cache = res.past_key_values
            for i in range(tokens.shape[1]):
                step_mask = torch.cat([step_mask, torch.ones(2, 1, dtype=step_mask.dtype)], dim=1)
                before = len(reads.reads) if reads is not None else 0
                with reads if reads is not None else contextlib.nullcontext():
                    out.append(elastic(input_ids=tokens[:, i : i + 1], attention_mask=step_mask, cache=cache,
                                       use_cache=True).logits)
                if reads is not None:
                    step = reads.reads[before:]
                    where = sorted(Path(r.split(" at ")[1].split(":")[0]).name for r in step)
                    assert where == ["bridge.py", "canonical.py", "canonical.py"], step
        return torch.cat(out, dim=1)

    fast = ElasticModel(tiny_model("llama"), section(MIXED, executor={"name": "split", "decode_sparse": "kernel"}))
    got = run(fast, device_reads)
    ref = ElasticModel(tiny_model("llama"), section(MIXED, executor={"name": "reference"}))
    assert torch.allclose(got, run(ref), atol=1e-4, rtol=1e-4)


def test_a_new_prefill_routes_by_its_own_decision():
    """The host copy of the routing belongs to one decision: a second sequence routed differently on
    the same model decodes with its own routing (a copy kept per layer alone would reuse the first)."""
    ids, tokens = inputs(batch=1, length=80)  # past sink 16 + window 32: streaming differs from full
    elastic = ElasticModel(tiny_model("llama"), section(ALL_SPARSE))
    tables = [torch.ones(1, 4, 2), torch.zeros(1, 4, 2)]  # every head sparse, then every head full

    def routed_by(table):
        def decide(layer: int, keys: torch.Tensor, seq: SeqInfo) -> RouterDecision:
            return RouterDecision(sparse=table[:, layer], prob_sparse=table[:, layer])
        return decide

    got = []
    for table in tables:
        elastic.router.decide = routed_by(table)  # type: ignore[method-assign]
        got.append(decode_logits(elastic, ids, tokens))
    for table, logits in zip(tables, got):
        ref = ElasticModel(tiny_model("llama"), section(ALL_SPARSE, executor={"name": "reference"}))
        ref.router.decide = routed_by(table)  # type: ignore[method-assign]
        assert torch.allclose(logits, decode_logits(ref, ids, tokens), atol=1e-4, rtol=1e-4)
    assert (got[0] - got[1]).abs().max() > 1e-2  # the two routings differ visibly


# -- the compact KV cache: slices, host positions, no mask once the ring is full -----------------------


def test_head_span_by_hand():
    pairs = torch.tensor
    assert _head_span(pairs([[0, 1], [0, 2], [1, 1], [1, 2]]), 2) == (1, 3)
    assert _head_span(pairs([[0, 0]]), 1) == (0, 1)
    assert _head_span(pairs([[0, 1], [0, 2], [1, 1]]), 2) is None  # sample 1 lacks head 2
    assert _head_span(pairs([[0, 0], [0, 2]]), 1) is None  # not a contiguous range
    assert _head_span(pairs([[1, 0], [1, 1]]), 2) is None  # sample 0 has none
    assert _head_span(pairs([[0, 0], [1, 0]]), 3) is None  # sample 2 has none


@pytest.mark.parametrize("router", [MIXED, ALL_SPARSE], ids=["mixed", "all_sparse"])
@pytest.mark.parametrize("sparse", [streaming("token", sink=5, local=21), streaming("block"),
                                    streaming("token", sink=0, local=37)], ids=["token", "block", "token-no-sink"])
def test_compact_decode_of_equal_lengths_equals_the_full_cache(router, sparse):
    """Prompts of one length (positions known on the host: slice writes, store views), decoding
    across the moment the sink and ring fill (from then on, token windows run without a mask). Every
    step's logits equal the full cache's, where the executor reads the streaming layout; a mask
    dropped one step early (an empty ring slot read) or a ring slot one off would not."""
    capacity = sparse["sink_tokens"] + sparse["local_tokens"]
    ids, tokens = inputs(length=capacity - 4, steps=8)
    full = ElasticModel(tiny_model("llama"), section(router, sparse=sparse))
    compact = ElasticModel(tiny_model("llama"), section(router, sparse=sparse, kv_cache="compact"))
    want = decode_logits(full, ids, tokens)
    got = decode_logits(compact, ids, tokens, cache=compact.make_kv_cache())
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_compact_decode_reads_nothing_from_the_device(device_reads):
    """Equal lengths, stores of whole head ranges: a compact decode step reads no device value in
    elasticfw's code (the dense heads through SDPA on the CPU)."""
    ids, tokens = inputs(length=60, steps=3)
    compact = ElasticModel(tiny_model("llama"), section(MIXED, kv_cache="compact"))
    decode_logits(compact, ids, tokens, cache=compact.make_kv_cache(), reads=device_reads)
    assert device_reads.reads == []


# -- the timing tool --------------------------------------------------------------------------------


@pytest.mark.skipif(split_module.triton_unavailable(torch.device("cpu")) is not None,
                    reason="needs Triton's interpreter")
def test_decode_host_timing_tool_writes_its_figures(tmp_path):
    """``scripts/decode_host_timing.py`` (run on a GPU by a session) runs every piece and writes one
    row of host and host+GPU microseconds per piece with the environment; bad sizes are refused."""

    tool = load_script("decode_host_timing")
    out = tmp_path / "host.json"
    assert tool.main(["--device", "cpu", "--tokens", "64", "--calls", "1", "--warmup", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["us"]) == {"dense sdpa", "decode_attention", "split attend_routed", "torch.empty x5"}
    for row in report["us"].values():
        assert 0 < row["host_us"] <= row["with_gpu_us"]
    assert report["environment"]["device"] == "cpu" and report["tokens"] == 64
    with pytest.raises(SystemExit):
        tool.main(["--device", "cpu", "--calls", "0"])
    with pytest.raises(SystemExit):
        tool.main(["--device", "cpu", "--blocks", "0"])


def test_decode_host_timing_tool_refuses_a_cpu_without_the_interpreter(monkeypatch, capsys):
    """``--no-launch`` on a CPU still runs the kernel's host code, which asks for Triton on the
    device: without ``TRITON_INTERPRET=1`` the tool says so before timing (it used to fail mid-run)."""

    tool = load_script("decode_host_timing")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit):
        tool.main(["--device", "cpu", "--no-launch", "--tokens", "64", "--calls", "1"])
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


@pytest.mark.skipif(split_module.triton_unavailable(torch.device("cpu")) is not None,
                    reason="needs Triton's interpreter")
def test_decode_host_timing_tool_times_the_kernel_at_each_split_count(tmp_path, monkeypatch):
    """``--splits N ...`` adds one piece per N that calls the decode kernel with ``splits=N`` (and
    the default piece with none); a count below 1 is refused before anything runs."""

    from elasticfw.kernels import decode_attention as da

    tool = load_script("decode_host_timing")
    seen = []
    real = da.decode_attention

    def recording(*a, **kw):
        seen.append(kw.get("splits"))
        return real(*a, **kw)

    monkeypatch.setattr(da, "decode_attention", recording)
    out = tmp_path / "host.json"
    assert tool.main(["--device", "cpu", "--tokens", "256", "--calls", "1", "--warmup", "0", "--no-launch",
                      "--splits", "1", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"decode_attention splits=1", "decode_attention splits=3", "decode_attention"} <= set(report["us"])
    assert {None, 1, 3} == set(seen) and seen.count(1) == seen.count(3) == 1
    with pytest.raises(SystemExit):
        tool.main(["--device", "cpu", "--splits", "0"])


@pytest.mark.skipif(split_module.triton_unavailable(torch.device("cpu")) is not None,
                    reason="needs Triton's interpreter")
def test_decode_host_timing_no_launch_times_the_host_code_and_restores_the_kernels(tmp_path, monkeypatch):
    """``--no-launch`` runs every piece with the decode kernel's two launches replaced by no-ops (none
    of them reaches the real kernels), reports blocks' median and fastest host times, and puts the
    real kernels back afterwards, also when a piece raises."""

    from elasticfw.kernels import decode_attention as da

    tool = load_script("decode_host_timing")
    real = da._decode_split_kernel, da._merge_kernel
    out = tmp_path / "host.json"
    launched = []
    monkeypatch.setattr(type(real[0]), "run", lambda self, *a, **kw: launched.append(self))
    args = ["--device", "cpu", "--tokens", "64", "--calls", "2", "--blocks", "3", "--warmup", "0", "--no-launch"]
    assert tool.main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["no_launch"] is True and launched == []
    for row in report["us"].values():
        assert 0 < row["host_us_min"] <= row["host_us"] <= row["with_gpu_us"]
    assert (da._decode_split_kernel, da._merge_kernel) == real
    monkeypatch.setattr(tool, "_run", lambda *a: (_ for _ in ()).throw(RuntimeError("piece failed")))
    with pytest.raises(RuntimeError, match="piece failed"):
        tool.main(args)
    assert (da._decode_split_kernel, da._merge_kernel) == real
