"""A routed prefill reads the routing from the device at most once per layer, and never when the
router knows its decision on the host (input-independent routers give ``RouterDecision.host``).

On a GPU every read of a device value on the host (``.cpu()``, ``.item()``, ``bool(t)``) and every
copy of a host-built tensor to the device waits for the queued kernels, so a prefill that reads the
routing of each layer several times leaves the GPU idle between layers. These tests watch the
decision's device tensor (a tensor subclass that records host reads of itself and of everything
computed from it) and the split executor's index builds, and check the logits against the reference
executor (plain PyTorch over the per-head layout).
"""

from __future__ import annotations

import traceback

import pytest
import torch

import elasticfw_plugins.executors.split as split_module
from elasticfw.model.elastic import ElasticModel
from elasticfw.recipe import validate_recipe_data
from elasticfw.routing.base import RouterDecision
from elasticfw.testing.models import tiny_model

MIXED = {"name": "fixed", "assign": "sparse_heads", "heads": [[0, 1], [1, 0], [3, 0], [3, 1]]}
HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


class Watched(torch.Tensor):
    """A decision tensor that records each host read of itself or of a tensor computed from it;
    ``.cpu()`` returns a plain tensor (what is read from the host copy afterwards is not a device read)."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        result = super().__torch_function__(func, types, args, kwargs or {})
        if name in HOST_READS:
            frames = [f for f in traceback.extract_stack()[:-1] if "elasticfw" in f.filename]
            cls.reads.append(f"{name} at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else name)
            if isinstance(result, Watched):
                result = result.as_subclass(torch.Tensor)
        return result


def section(router: dict, executor: dict):
    return validate_recipe_data({"elastic": {
        "retrieval_mode": {"name": "full", "block_size": 16},
        "sparse_mode": {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16,
                        "granularity": "block"},
        "router": router, "executor": executor,
    }}).elastic


def watched(elastic: ElasticModel) -> None:
    real = elastic.router.decide

    def decide(layer, keys, seq):  # type: ignore[no-untyped-def]
        d = real(layer, keys, seq)
        return RouterDecision(d.sparse.as_subclass(Watched), d.prob_sparse, d.logits, d.host)

    elastic.router.decide = decide  # type: ignore[method-assign]


def logits(elastic: ElasticModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return elastic(input_ids=ids, use_cache=False).logits


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(3, 250, (2, 96), generator=torch.Generator().manual_seed(4))


def test_an_input_independent_router_prefills_without_reading_its_routing(ids):
    """The fixed router gives its decisions on the host: the runtime and the split executor (its
    flex path, the CUDA one) read none of the routing from the device; the layers that split
    (dense heads through SDPA, the rest through the sparse path) still compute the reference's logits."""
    fast = ElasticModel(tiny_model("llama"), section(MIXED, {"name": "split", "sparse": "flex"}))
    watched(fast)
    Watched.reads.clear()
    got = logits(fast, ids)
    assert Watched.reads == []
    ref = ElasticModel(tiny_model("llama"), section(MIXED, {"name": "reference"}))
    assert torch.allclose(got, logits(ref, ids), atol=1e-4, rtol=1e-4)


def test_a_learned_routing_is_read_once_per_layer(ids):
    """Without a host copy (a router computing on the device) each layer reads its routing once: the
    runtime's read, which the split executor reuses (``hard_host``) instead of reading it again."""
    fast = ElasticModel(tiny_model("llama"), section(MIXED, {"name": "split", "sparse": "flex"}))
    real = fast.router.decide

    def device_only(layer, keys, seq):  # type: ignore[no-untyped-def]
        decision = real(layer, keys, seq)
        return RouterDecision(decision.sparse, decision.prob_sparse)  # the same decision without its host copy

    fast.router.decide = device_only  # type: ignore[method-assign]
    watched(fast)
    Watched.reads.clear()
    got = logits(fast, ids)
    assert [r.split(" at ")[1].split(":")[0] for r in Watched.reads] == ["runtime.py"] * 4, Watched.reads
    assert all(r.startswith("cpu ") for r in Watched.reads)
    ref = ElasticModel(tiny_model("llama"), section(MIXED, {"name": "reference"}))
    assert torch.allclose(got, logits(ref, ids), atol=1e-4, rtol=1e-4)


def test_the_split_executor_builds_each_head_index_once(ids, monkeypatch):
    """The dense heads' index (where their rows are written into the sparse launch's output) is
    built on the device once per routing pattern, not in every layer and forward; a gather of
    heads that are not one range goes through the same cache."""
    built = []
    real_tensor = torch.tensor

    def counting(data, *args, **kwargs):  # type: ignore[no-untyped-def]
        if "device" in kwargs and traceback.extract_stack()[-2].filename == split_module.__file__:
            built.append(list(data))
        return real_tensor(data, *args, **kwargs)

    monkeypatch.setattr(split_module.torch, "tensor", counting)
    # KV head 1 of layers 0 and 1 dense: query heads 3-5 (6 query heads, groups of 3)
    heads = {"name": "fixed", "assign": "sparse_heads", "heads": [[0, 0], [1, 0]]}
    fast = ElasticModel(tiny_model("llama"), section(heads, {"name": "split", "sparse": "flex"}))
    first = logits(fast, ids)
    assert built == [[3, 4, 5]]  # layers 0 and 1 share the pattern
    again = logits(fast, ids)
    assert built == [[3, 4, 5]] and torch.equal(first, again)
    ex = fast.runtime.executor
    t = torch.arange(2 * 6 * 3 * 1, dtype=torch.float32).view(2, 6, 3, 1)
    assert torch.equal(ex._take_heads(t, [1, 4]), t[:, [1, 4]])  # not a range: the cached index
    assert torch.equal(ex._take_heads(t, [1, 4]), t[:, [1, 4]]) and built == [[3, 4, 5], [1, 4]]
    view = ex._take_heads(t, [2, 3, 4])  # a range: a view, no index built
    assert view.data_ptr() == t[:, 2:].data_ptr() and torch.equal(view, t[:, 2:5]) and len(built) == 2
    ref = ElasticModel(tiny_model("llama"), section(heads, {"name": "reference"}))
    assert torch.allclose(first, logits(ref, ids), atol=1e-4, rtol=1e-4)


def test_a_host_copy_must_match_the_decision():
    sparse = torch.ones(2, 3)
    with pytest.raises(ValueError, match="CPU tensor of sparse's shape"):
        RouterDecision(sparse, sparse, host=torch.ones(3, 2))
    decision = RouterDecision.constant(torch.tensor([0.0, 1.0]), 2, torch.device("cpu"), host_row=torch.tensor([0.0, 1.0]))
    assert decision.host is not None and torch.equal(decision.host, decision.sparse)


def test_host_copies_follow_the_table(monkeypatch):
    """A router's CPU copy of its table is taken once and taken again after an in-place edit or a
    change of dtype (at every call for a tensor made under inference mode, which has no version);
    the decisions' ``host`` equals their ``sparse``, for a router built under inference mode too."""
    from elasticfw.registry import get_registry
    from elasticfw.routing.base import HeadLayout, HostCopy

    copy, reads = HostCopy(), []
    table = torch.zeros(2, 3)
    real = torch.Tensor.cpu

    def counting(self, *a, **kw):  # type: ignore[no-untyped-def]
        reads.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "cpu", counting)
    first = copy(table)
    assert copy(table) is first and len(reads) == 1
    table[1, 2] = 1.0  # in place: a new copy
    assert copy(table)[1, 2] == 1.0 and len(reads) == 2
    assert copy(table.double()).dtype == torch.float64 and len(reads) == 3
    with torch.inference_mode():  # no version counter: read at every call, so always current
        frozen = torch.zeros(2, 3)
        assert copy(frozen).sum() == 0 and len(reads) == 4
        frozen[0, 0] = 2.0
        assert copy(frozen)[0, 0] == 2.0 and len(reads) == 5
    monkeypatch.undo()
    entry = get_registry().entry("router", "fixed")
    router = entry.cls(entry.config_class(assign="sparse_heads", heads=[(1, 2)]), HeadLayout((0, 1), 3, 6, 8))
    decision = router.decide(1, torch.zeros(2, 3, 5, 8), None)
    assert decision.host is not None and torch.equal(decision.host, decision.sparse)
    assert decision.host.tolist() == [[0.0, 0.0, 1.0]] * 2
    with torch.no_grad():
        router.table[1, 0] = 1.0
    assert router.decide(1, torch.zeros(1, 3, 5, 8), None).host.tolist() == [[1.0, 0.0, 1.0]]
    with torch.inference_mode():
        router = entry.cls(entry.config_class(assign="sparse_heads", heads=[(1, 2)]), HeadLayout((0, 1), 3, 6, 8))
        decision = router.decide(1, torch.zeros(2, 3, 5, 8), None)
        assert decision.host is not None and decision.host.tolist() == [[0.0, 0.0, 1.0]] * 2
