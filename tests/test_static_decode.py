"""Static decoding (fixed-shape steps, replayed from a CUDA graph on CUDA; eager on the CPU).

Independent definitions: transformers' greedy ``generate`` on the full dynamic cache under the
same routing (token equality; the elastic runtime's layouts and executor, not the static path's
masked softmax), ``F.scaled_dot_product_attention`` over the visible keys gathered by hand, and
slot masks written out by hand from sink, window and position.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from elasticfw.attention.mode import DecodeKeep
from elasticfw.errors import ElasticError, UnsupportedInputError
from elasticfw.model.elastic import ElasticModel
from elasticfw.model.static_decode import StaticDecoder, StaticStep, decode_attention_masked, static_greedy
from elasticfw.recipe import validate_recipe_data
from elasticfw.routing.base import RouterDecision
from elasticfw.testing.models import FAMILIES, padded_batch, tiny_model

SINK, LOCAL, BS = 16, 32, 16
FULL = {"name": "full", "block_size": BS}
ALL_SPARSE = {"name": "fixed", "assign": "all_sparse"}
ALL_FULL = {"name": "fixed", "assign": "all_retrieval"}
MIXED = {"name": "fixed", "assign": "sparse_heads", "heads": [[1, 0], [3, 1], [3, 0]]}
#: families whose tiny models have no natively windowed layer (gemma3's alternate: refused below)
UNWINDOWED = [f for f in FAMILIES if f != "gemma3"]


def section(router: dict, kv_cache: str, granularity: str = "block", retrieval: dict | None = None):
    sparse = {"name": "streaming", "sink_tokens": SINK, "local_tokens": LOCAL, "block_size": BS,
              "granularity": granularity}
    data = {"retrieval_mode": retrieval or FULL, "sparse_mode": sparse, "router": router, "kv_cache": kv_cache}
    return validate_recipe_data({"elastic": data}).elastic


def prompt(batch: int = 2, length: int = 70, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


def reference(family: str, router: dict, ids: torch.Tensor, new: int, **kw) -> torch.Tensor:
    """Greedy tokens of transformers' generate with the full cache (no end-of-sequence stop)."""
    elastic = ElasticModel(tiny_model(family), section(router, "full", **kw))
    elastic.base.generation_config.eos_token_id = None
    with torch.no_grad():
        out = elastic.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
    return out[:, ids.shape[1]:]


# -- greedy tokens equal generate's ---------------------------------------------------------------
@pytest.mark.parametrize("family", UNWINDOWED)
@pytest.mark.parametrize("router", [ALL_SPARSE, MIXED, ALL_FULL], ids=["all_streaming", "mixed", "all_full"])
def test_static_greedy_equals_generate(family, router):
    # 70 prompt tokens + 40 new: the streaming heads' rings (32 slots) wrap several times
    ids = prompt()
    expected = reference(family, router, ids, 40)
    got = static_greedy(ElasticModel(tiny_model(family), section(router, "compact")), ids, 40, graph=False)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_token_and_block_windows(granularity):
    ids = prompt(batch=3, length=37, seed=5)  # shorter than sink + local: the ring fills during decode
    expected = reference("llama", MIXED, ids, 30, granularity=granularity)
    elastic = ElasticModel(tiny_model("llama"), section(MIXED, "compact", granularity))
    assert torch.equal(static_greedy(elastic, ids, 30, graph=False), expected)


def test_three_modes():
    """K = 3: full, MoBA decoding every key (``decode: full``) and streaming, per (layer, head)."""
    modes = [FULL, {"name": "moba", "moba_block_size": BS, "top_k": 2, "block_size": BS, "decode": "full"},
             {"name": "streaming", "sink_tokens": 4, "local_tokens": 12, "block_size": BS, "granularity": "token"}]
    router = {"name": "fixed", "assign": "mode_heads", "head_modes": [[0, 0, 1], [0, 1, 2], [1, 1, 2], [3, 0, 1]]}
    ids = prompt(batch=2, length=50, seed=9)
    out = {}
    for kv_cache in ("full", "compact"):
        section_ = validate_recipe_data({"elastic": {"modes": modes, "kv_cache": kv_cache, "router": router}}).elastic
        elastic = ElasticModel(tiny_model("llama"), section_)
        elastic.base.generation_config.eos_token_id = None
        with torch.no_grad():
            if kv_cache == "full":
                out[kv_cache] = elastic.generate(input_ids=ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                                 pad_token_id=0, eos_token_id=None)[:, 50:]
            else:
                out[kv_cache] = static_greedy(elastic, ids, 24, graph=False)
    assert torch.equal(out["compact"], out["full"])


@pytest.mark.parametrize("router", [ALL_SPARSE, MIXED, ALL_FULL], ids=["all_streaming", "mixed", "all_full"])
def test_a_left_padded_batch_of_different_lengths(router):
    """Samples of 70, 41 and 23 real tokens: each decodes at its own positions, as generate does."""
    ids, mask = padded_batch([70, 41, 23], side="left", seed=4)
    full = ElasticModel(tiny_model("llama"), section(router, "full"))
    full.base.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = full.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:]
    elastic = ElasticModel(tiny_model("llama"), section(router, "compact"))
    got = static_greedy(elastic, ids, 40, attention_mask=mask, graph=False)
    assert torch.equal(got, expected)


def test_per_sample_routing():
    """Each sample routes its own heads (the stores gather rows): sample 0 streams layer 1's head 0,
    sample 1 layer 3's heads."""
    table = torch.zeros(2, 4, 2, dtype=torch.bool)
    table[0, 1, 0] = True
    table[1, 3] = True

    def decide(layer: int, keys: torch.Tensor, seq) -> RouterDecision:
        sparse = table[: keys.shape[0], layer].float()
        return RouterDecision(sparse=sparse, prob_sparse=sparse)

    ids, mask = padded_batch([66, 50], side="left", seed=6)
    tokens = {}
    for kv_cache in ("full", "compact"):
        elastic = ElasticModel(tiny_model("llama"), section(ALL_SPARSE, kv_cache))
        elastic.router.decide = decide  # type: ignore[method-assign]
        elastic.base.generation_config.eos_token_id = None
        with torch.no_grad():
            if kv_cache == "full":
                tokens[kv_cache] = elastic.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30,
                                                    min_new_tokens=30, do_sample=False, pad_token_id=0,
                                                    eos_token_id=None)[:, ids.shape[1]:]
            else:
                cache = elastic.make_kv_cache()
                tokens[kv_cache] = static_greedy(elastic, ids, 30, attention_mask=mask, graph=False, cache=cache)
                assert any(store.span is None for store in cache.layers[1].stores)  # rows gathered, not sliced
    assert torch.equal(tokens["compact"], tokens["full"])


def test_the_cache_goes_on_after_close():
    """Static steps, close(), then ordinary generate on the same cache: the host lengths moved on."""
    ids = prompt(batch=2, length=60, seed=7)
    expected = reference("llama", MIXED, ids, 20)
    elastic = ElasticModel(tiny_model("llama"), section(MIXED, "compact"))
    cache = elastic.make_kv_cache()
    with torch.no_grad():
        out = elastic(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        first = out.logits[:, -1:].argmax(-1)
        with StaticDecoder(elastic, cache, first, max_new_tokens=9, graph=False) as decoder:
            middle = decoder.run()
        assert cache.get_seq_length() == 60 + 9
        so_far = torch.cat([ids, first, middle], dim=1)
        elastic.base.generation_config.eos_token_id = None
        rest = elastic.generate(input_ids=so_far, cache=cache, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                                pad_token_id=0, eos_token_id=None)[:, so_far.shape[1]:]
    assert torch.equal(torch.cat([first, middle, rest], dim=1), expected)
    # a chunk of several tokens reads the slots' recorded positions (the frozen steps wrote them):
    # its logits against one forward of the whole sequence without a cache
    extra = torch.randint(3, 100, (2, 4), generator=torch.Generator().manual_seed(8))
    whole = torch.cat([so_far, rest, extra], dim=1)
    with torch.no_grad():
        assert cache.get_seq_length() == whole.shape[1] - 5  # generate does not feed its last token
        chunk = elastic(input_ids=whole[:, -5:], cache=cache, use_cache=True).logits
        plain = ElasticModel(tiny_model("llama"), section(MIXED, "full"))(input_ids=whole).logits[:, -5:]
    torch.testing.assert_close(chunk, plain, rtol=1e-4, atol=1e-5)


# -- the step's attention and masks by other means ------------------------------------------------
@pytest.mark.parametrize("slots", [48, 1030, 2048])
def test_masked_decode_attention_against_sdpa_over_the_visible_keys(slots):
    g = torch.Generator().manual_seed(slots)
    n, group, d = 3, 4, 16
    q, k, v = (torch.randn(n, r, d, generator=g) for r in (group, slots, slots))
    visible = torch.rand(n, slots, generator=g) < 0.3
    visible[:, 0] = True
    got = decode_attention_masked(q, k, v, visible, scale=0.3)
    for i in range(n):
        keys, values = k[i, visible[i]], v[i, visible[i]]
        want = F.scaled_dot_product_attention(q[i][None], keys[None], values[None], scale=0.3)[0]
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6)


def test_static_masks_by_hand():
    position = torch.tensor([8, 3])  # two samples of different lengths
    masks = StaticStep(position)
    keep = DecodeKeep(sink_tokens=2, local_tokens=4, granularity=2)
    masks.register(None, 12)
    masks.register(keep, 6)
    masks.refresh()
    # full store: slots 0..p hold positions 0..p, all read
    assert masks.get(None, 12).tolist() == [[True] * 9 + [False] * 3, [True] * 4 + [False] * 8]
    # compact store after 9 tokens: slots 0, 1 the sink; ring slot r holds the latest 2 + r + 4m <= 8:
    # 6, 7, 8, 5; the window of whole 2-blocks starts at (8 // 2 + 1) * 2 - 4 = 6, so 5 is not read.
    # After 4 tokens: the sink, then 2, 3 in ring slots 0, 1 and two empty slots
    assert masks.get(keep, 6).tolist() == [[True, True, True, True, True, False],
                                           [True, True, True, True, False, False]]
    position.add_(1)  # the next step, in place (as a replayed graph sees it)
    masks.refresh()
    assert masks.get(None, 12).tolist() == [[True] * 10 + [False] * 2, [True] * 5 + [False] * 7]
    # ring: 6, 7, 8, 9, window start (9 // 2 + 1) * 2 - 4 = 6; and 2, 3, 4 with start (4 // 2 + 1) * 2 - 4 = 2
    assert masks.get(keep, 6).tolist() == [[True] * 6, [True, True, True, True, True, False]]


# -- what it refuses, by name ---------------------------------------------------------------------
def prefilled(family: str = "llama", router: dict = MIXED, ids: torch.Tensor | None = None, **kw):
    elastic = ElasticModel(tiny_model(family), section(router, "compact", **kw))
    cache = elastic.make_kv_cache()
    ids = prompt() if ids is None else ids
    with torch.no_grad():
        out = elastic(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return elastic, cache, out.logits[:, -1:].argmax(-1)


def test_refusals():
    elastic, cache, first = prefilled("gemma3")
    with pytest.raises(UnsupportedInputError, match="layer 0's cache is .*grows every step"):
        StaticDecoder(elastic, cache, first, max_new_tokens=4, graph=False)

    elastic = ElasticModel(tiny_model("llama"), section(MIXED, "compact"))
    with pytest.raises(UnsupportedInputError, match="not been compacted"):
        StaticDecoder(elastic, elastic.make_kv_cache(), first, max_new_tokens=4, graph=False)

    elastic, cache, first = prefilled()
    with pytest.raises(UnsupportedInputError, match=r"token must be \(batch, 1\) int64"):
        StaticDecoder(elastic, cache, first.float(), max_new_tokens=4, graph=False)
    with pytest.raises(UnsupportedInputError, match="CUDA graphs need a CUDA device"):
        StaticDecoder(elastic, cache, first, max_new_tokens=4, graph=True)
    decoder = StaticDecoder(elastic, cache, first, max_new_tokens=2, graph=False)
    decoder.run()
    with pytest.raises(ElasticError, match="all 2 reserved steps have run"):
        decoder.step()
    decoder.close()
    with pytest.raises(ElasticError, match="closed"):
        decoder.step()


def test_a_mode_that_selects_keys_at_decode_is_refused_and_nothing_stays_frozen():
    xattention = {"name": "xattention", "block_size": BS, "stride": 4, "threshold": 0.9, "decode": "sparse"}
    # layer 0 every head streaming (it can freeze), later layers XAttention selecting at decode
    layer0 = {"name": "fixed", "assign": "sparse_heads", "heads": [[0, 0], [0, 1]]}
    elastic, cache, first = prefilled(router=layer0, retrieval=xattention)
    with pytest.raises(UnsupportedInputError, match=r"mode 'xattention' \(layer 1\) selects past keys by content"):
        StaticDecoder(elastic, cache, first, max_new_tokens=4, graph=False)
    assert all(layer.static is None for layer in cache.layers)
    with torch.no_grad():  # the cache still decodes the ordinary way
        out = elastic(input_ids=first, cache=cache, use_cache=True)
    assert out.logits.shape[:2] == (2, 1) and cache.get_seq_length() == 71


# -- the CUDA graph ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("router", [ALL_SPARSE, MIXED, ALL_FULL], ids=["all_streaming", "mixed", "all_full"])
def test_replayed_graph_equals_generate_on_cuda(router):
    """Eager warm-up steps, a capture, then replays: the tokens of generate on the same GPU, for a
    left-padded batch (300 and 257 real tokens)."""
    ids, mask = (t.cuda() for t in padded_batch([300, 257], side="left", seed=11))
    model = tiny_model("llama").cuda()
    full = ElasticModel(model, section(router, "full"))
    full.base.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = full.generate(input_ids=ids, attention_mask=mask, max_new_tokens=48, min_new_tokens=48,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:]
    full.unwrap()
    elastic = ElasticModel(model, section(router, "compact"))
    cache = elastic.make_kv_cache()
    with torch.no_grad():
        out = elastic(input_ids=ids, attention_mask=mask, position_ids=(mask.long().cumsum(-1) - 1).clamp_min(0),
                      cache=cache, use_cache=True, logits_to_keep=1)
        first = out.logits[:, -1:].argmax(-1)
        with StaticDecoder(elastic, cache, first, max_new_tokens=47) as decoder:
            rest = decoder.run()
            assert decoder.graph is not None  # captured, and replayed for 45 of the 47 steps
    assert torch.equal(torch.cat([first, rest], dim=1), expected)


# -- what a captured graph needs, checked on the CPU ----------------------------------------------
class _Recorder(TorchDispatchMode):
    """Every operator a step dispatches, with its arguments' shapes, dtypes and plain values; an
    operator that reads a tensor's value on the host, or makes a tensor of host data (whose value a
    captured graph would keep), fails at once."""

    HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                  torch.ops.aten.equal.default, torch.ops.aten.masked_select.default,
                  torch.ops.aten.lift_fresh.default}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.HOST_READS:
            raise AssertionError(f"{func} reads the device on the host inside a static step")

        def describe(x):
            if isinstance(x, torch.Tensor):
                return ("T", tuple(x.shape), x.dtype)
            if isinstance(x, (list, tuple)):
                return tuple(describe(y) for y in x)
            return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device)) else type(x)

        self.calls.append((str(func), describe(args), describe(tuple(sorted(kwargs.items())))))
        return func(*args, **kwargs)


@pytest.mark.parametrize("router", [MIXED, ALL_FULL], ids=["mixed", "all_full"])
def test_a_frozen_step_is_replayable(router):
    """What replaying one captured step relies on: consecutive steps dispatch the same operators
    with the same shapes and the same plain (host) arguments — a position, slot or length baked in
    as a host number would differ — and none reads a tensor's value on the host (an ``item()``, a
    boolean index or ``nonzero``, which a CUDA graph cannot capture) or makes a tensor of host
    data (``torch.tensor(position)``, which a graph would replay with the captured value)."""
    ids, mask = padded_batch([70, 52], side="left", seed=12)
    elastic = ElasticModel(tiny_model("llama"), section(router, "compact"))
    cache = elastic.make_kv_cache()
    with torch.no_grad():
        out = elastic(input_ids=ids, attention_mask=mask, position_ids=(mask.long().cumsum(-1) - 1).clamp_min(0),
                      cache=cache, use_cache=True, logits_to_keep=1)
        decoder = StaticDecoder(elastic, cache, out.logits[:, -1:].argmax(-1), max_new_tokens=40, graph=False)
        decoder.run(30)  # the rings of 32 slots wrap between the recorded steps
        steps = []
        for _ in range(2):
            with _Recorder() as recorder:
                decoder._step()
            steps.append(recorder.calls)
    assert len(steps[0]) > 50 and steps[0] == steps[1]
