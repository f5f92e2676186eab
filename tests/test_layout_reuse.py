"""One layout and one BlockMask for every layer of a forward, for modes that depend only on ``seq``.

Streaming and full attention build their layout from the sequence lengths alone
(``layout_depends_on_inputs = False``): the runtime hands the same layout object to every layer of
a forward whose :meth:`SeqInfo.host_signature` is the same, and the flex executor (directly, or
as the split executor's sparse path) converts it to a BlockMask once. These tests count the
conversions and check the outputs against the reference executor (plain PyTorch, its own masks):
a cache keyed wrongly (stale shape, another head selection) would give wrong logits.
"""

from __future__ import annotations

import pytest
import torch

import elasticfw_plugins.executors.flex as flex_module
from elasticfw.attention.seq import SeqInfo
from elasticfw.model.elastic import ElasticModel
from elasticfw.recipe import validate_recipe_data
from elasticfw.testing.models import tiny_model

STREAMING = {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16}


def _section(executor: dict, router: dict, sparse: dict | None = None):
    return validate_recipe_data({"elastic": {
        "retrieval_mode": {"name": "full", "block_size": 16},
        "sparse_mode": sparse or STREAMING,
        "executor": executor,
        "router": router,
    }}).elastic


def _logits(model, section, ids):
    elastic = ElasticModel(model, section)
    try:
        with torch.no_grad():
            return elastic(input_ids=ids).logits, elastic
    finally:
        elastic.unwrap()


@pytest.fixture
def conversions(monkeypatch):
    calls: list[int] = []
    real = flex_module.to_block_mask

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(flex_module, "to_block_mask", counting)
    return calls


def test_host_signature_only_for_values_known_on_the_host():
    assert SeqInfo.dense(2, 5, 9).host_signature() == ("dense", 2, 5, 9, "cpu")
    assert SeqInfo.dense(2, 5, 9).host_signature() != SeqInfo.dense(2, 5, 10).host_signature()
    assert SeqInfo.from_lengths(torch.tensor([9, 9]), 5, 9).host_signature() is None
    assert SeqInfo.trusted(torch.tensor([4]), torch.tensor([9]), 5, 9).host_signature() is None


ROUTERS = {
    "all-sparse": {"name": "fixed", "assign": "all_sparse"},
    # KV head 0 of every layer full, KV head 1 streaming: the split executor's restricted mask
    "mixed": {"name": "fixed", "assign": "retrieval_heads", "heads": [[i, 0] for i in range(4)]},
    "mixed-other": {"name": "fixed", "assign": "retrieval_heads", "heads": [[i, 1] for i in range(4)]},
}


@pytest.mark.parametrize(
    ("executor", "router"),
    [({"name": "flex"}, "all-sparse"), ({"name": "split", "sparse": "flex"}, "all-sparse"),
     ({"name": "split", "sparse": "flex"}, "mixed")],
)
def test_one_conversion_for_all_layers_and_forwards_of_a_shape(conversions, executor, router):
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (2, 100), generator=g)
    shorter = ids[:, :77]
    expected = _logits(model, _section({"name": "reference"}, ROUTERS[router]), ids)[0]
    expected_short = _logits(model, _section({"name": "reference"}, ROUTERS[router]), shorter)[0]
    elastic = ElasticModel(model, _section(executor, ROUTERS[router]))
    with torch.no_grad():
        first = elastic(input_ids=ids).logits
        assert len(conversions) == 1  # 4 routed layers, one BlockMask
        second = elastic(input_ids=ids).logits
        assert len(conversions) == 1  # the same shape again: nothing converted
        short = elastic(input_ids=shorter).logits
        assert len(conversions) == 2  # a new length: its own mask
    elastic.unwrap()
    for got, want in ((first, expected), (second, expected), (short, expected_short)):
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4)


def test_another_head_selection_is_converted_again_and_stays_exact(conversions):
    """The split executor's restricted mask depends on which heads are dense: two routings of the
    same shape through one runtime (same layout object, same executor) must not share it."""
    model = tiny_model("llama")
    ids = torch.randint(3, 250, (1, 96), generator=torch.Generator().manual_seed(1))
    other = ElasticModel(model, _section({"name": "split", "sparse": "flex"}, ROUTERS["mixed-other"]))
    other_router = other.runtime.router
    other.unwrap()
    elastic = ElasticModel(model, _section({"name": "split", "sparse": "flex"}, ROUTERS["mixed"]))
    with torch.no_grad():
        a = elastic(input_ids=ids).logits
        assert len(conversions) == 1
        elastic.runtime.router = other_router  # the other KV head of every layer full
        b = elastic(input_ids=ids).logits
        assert len(conversions) == 2
    elastic.unwrap()
    for got, router in ((a, "mixed"), (b, "mixed-other")):
        want = _logits(model, _section({"name": "reference"}, ROUTERS[router]), ids)[0]
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(a, b, atol=1e-3)  # the two routings differ, so a shared mask would show


def test_padded_batches_and_data_dependent_modes_are_not_cached(conversions):
    model = tiny_model("llama")
    ids = torch.randint(3, 250, (2, 80), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :20] = 0  # left padding: the SeqInfo is read from the mask, no host signature
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    section = _section({"name": "flex"}, ROUTERS["all-sparse"])
    elastic = ElasticModel(model, section)
    with torch.no_grad():
        elastic(input_ids=ids, attention_mask=mask, position_ids=pos)
    elastic.unwrap()
    assert len(conversions) == 4  # one per routed layer
    xattention = {"name": "xattention", "block_size": 16, "stride": 4, "threshold": 0.5, "chunk_size": 64}
    elastic = ElasticModel(model, _section({"name": "flex"}, ROUTERS["all-sparse"], sparse=xattention))
    with torch.no_grad():
        elastic(input_ids=ids)
        elastic(input_ids=ids)
    elastic.unwrap()
    assert len(conversions) == 4 + 8  # its layout follows q and k: every layer, every forward


def test_a_mode_dense_at_the_length_is_built_once_and_runs_as_the_plain_model(monkeypatch):
    """FA-MoBA on a prompt MoBA's top_k covers (dense_at): its layout is built once per forward, not
    per layer, every routed layer is one dense call, and the logits are the unmodified model's.
    Past that length (top_k below the blocks) it is built at every layer again."""
    from elasticfw_plugins.modes.moba import MobaAttention

    builds: list[int] = []
    real = MobaAttention.build_layout
    monkeypatch.setattr(MobaAttention, "build_layout", lambda self, *a, **kw: builds.append(1) or real(self, *a, **kw))
    model = tiny_model("llama")
    ids = torch.randint(3, 250, (2, 96), generator=torch.Generator().manual_seed(3))
    moba = {"name": "moba", "moba_block_size": 32, "top_k": 3, "block_size": 16}
    elastic = ElasticModel(model, _section({"name": "split"}, ROUTERS["mixed"], sparse=moba))
    try:
        with torch.no_grad():
            got = elastic(input_ids=ids).logits
            assert len(builds) == 1  # 4 routed layers, one layout
            elastic(input_ids=ids[:, :97 - 32])
            assert len(builds) == 2  # a new length: its own
            elastic(input_ids=torch.cat([ids, ids[:, :1]], 1))  # 97 keys: 4 MoBA blocks > top_k
            assert len(builds) == 2 + 4
    finally:
        elastic.unwrap()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4)
