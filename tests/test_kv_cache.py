"""The compact KV cache: sparse heads keep only what their mode reads at decode.

Independent definitions: greedy generation with transformers' full dynamic cache under the same
routing (token equality), the mode's own ``build_layout`` at decode positions (what a declared
``DecodeKeep`` must equal), and kept-token counts written out by hand from sink, window and
lengths.
"""

from __future__ import annotations

import pytest
import torch

from elasticfw.attention.layout import dense_mask
from elasticfw.attention.mode import AttentionMode, DecodeKeep
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import ElasticError, UnsupportedInputError
from elasticfw.model.elastic import ElasticModel
from elasticfw.model.kv_cache import DecodeMasks, ElasticKVCache, ElasticKVLayer
from elasticfw.recipe import validate_recipe_data
from elasticfw.registry import get_registry
from elasticfw.routing.base import RouterDecision
from elasticfw.testing.models import FAMILIES, padded_batch, tiny_model

SINK, LOCAL, BS = 16, 32, 16
FULL = {"name": "full", "block_size": BS}


def streaming(granularity: str = "block", sink: int = SINK, local: int = LOCAL) -> dict:
    return {"name": "streaming", "sink_tokens": sink, "local_tokens": local, "block_size": BS, "granularity": granularity}


MIXED = {"name": "fixed", "assign": "sparse_heads", "heads": [[1, 0], [3, 1], [3, 0]]}
ALL_SPARSE = {"name": "fixed", "assign": "all_sparse"}


def section(router: dict, kv_cache: str = "full", sparse: dict | None = None, retrieval: dict | None = None):
    data = {"retrieval_mode": retrieval or FULL, "sparse_mode": sparse or streaming(), "router": router,
            "kv_cache": kv_cache}
    return validate_recipe_data({"elastic": data}).elastic


def left_padded(lengths: list[int], seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return padded_batch(lengths, side="left", seed=seed)

def per_sample_router(elastic: ElasticModel, table: torch.Tensor) -> None:
    """Route sample b, routed layer l, KV head h to sparse iff ``table[b, l, h]`` (differs per sample)."""

    def decide(layer: int, keys: torch.Tensor, seq: SeqInfo) -> RouterDecision:
        sparse = table[: keys.shape[0], layer].float()
        return RouterDecision(sparse=sparse, prob_sparse=sparse)

    elastic.router.decide = decide  # type: ignore[method-assign]


def generate_both(family: str, router: dict, lengths: list[int], *, new: int = 24, table=None, **modes):
    """Greedy tokens with the full cache and with the compact one (same routing), and the compact cache."""
    ids, mask = left_padded(lengths)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    outs = []
    for kv_cache in ("full", "compact"):
        elastic = ElasticModel(tiny_model(family), section(router, kv_cache, **modes))
        if table is not None:
            per_sample_router(elastic, table)
        with torch.no_grad():
            out = elastic.generate(return_dict_in_generate=True, **kwargs)
        outs.append(out)
    full, compact = outs
    cache = compact.past_key_values
    assert isinstance(cache, ElasticKVCache)  # kv_cache: compact made generate use one
    assert not isinstance(full.past_key_values, ElasticKVCache)
    return full.sequences, compact.sequences, cache, mask


def expected_kept(length: int, sink: int = SINK, local: int = LOCAL) -> int:
    """By hand: the first `sink` tokens, then at most the last `local` of the rest."""
    return min(length, sink) + min(max(length - sink, 0), local)


# -- greedy generation is unchanged ---------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("router", [ALL_SPARSE, MIXED], ids=["all_streaming", "mixed"])
def test_greedy_generation_equals_full_cache(family, router):
    """Left-padded prompts longer than sink + window (evicted at prefill), shorter (evicted during
    decode) and shorter than the sink; 24 new tokens wrap the ring."""
    lengths = [70, 45, 10]
    full, compact, cache, mask = generate_both(family, router, lengths)
    assert torch.equal(full, compact)
    layers = cache.elastic_layers()
    assert layers and all(layer.compacted for layer in layers.values())
    final = [n + 24 - 1 for n in lengths]  # the last generated token is never fed back
    for i, layer in layers.items():
        kept = layer.kept_tokens()
        for b, n in enumerate(final):
            for h in range(kept.shape[1]):
                sparse = router is ALL_SPARSE or [i, h] in MIXED["heads"]
                assert int(kept[b, h]) == (expected_kept(n) if sparse else n), (i, b, h)


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_token_and_block_windows(granularity):
    """Block granularity reads a window of whole blocks (between local - bs + 1 and local tokens):
    keeping only the last `local` tokens without the block rule, or the wrong window start, changes
    the tokens. Sink and window are not block multiples in the token case."""
    sparse = streaming(granularity) if granularity == "block" else streaming("token", sink=5, local=21)
    full, compact, _, _ = generate_both("llama", ALL_SPARSE, [70, 33], new=48, sparse=sparse)
    assert torch.equal(full, compact)


def test_per_sample_routing_with_padding():
    """Routing differs per sample: compacting sample 1's heads for sample 0's decisions (or rolling
    the wrong sample's padding) changes the tokens and the kept counts."""
    table = torch.zeros(2, 4, 2, dtype=torch.bool)  # (B, routed layers, Hkv)
    table[0, 0, 1] = table[0, 2, 0] = table[0, 3] = True
    table[1, 1, 0] = table[1, 2, 1] = True
    lengths = [64, 80]
    full, compact, cache, _ = generate_both("llama", MIXED, lengths, table=table)
    assert torch.equal(full, compact)
    for i, layer in cache.elastic_layers().items():
        kept = layer.kept_tokens()
        for b, n in enumerate(lengths):
            n = n + 24 - 1
            expected = [expected_kept(n) if table[b, i, h] else n for h in range(2)]
            assert kept[b].tolist() == expected, (i, b)


def test_content_selecting_retrieval_mode_keeps_its_cache():
    """XA-SSA: XAttention declares nothing (under ``decode: sparse`` it may select any past block),
    so its heads keep every key and run XAttention over their store at decode; streaming heads are
    compacted."""
    xa = {"name": "xattention", "block_size": BS, "stride": 4, "threshold": 0.5, "decode": "sparse"}
    full, compact, cache, _ = generate_both("llama", MIXED, [70, 45], retrieval=xa)
    assert torch.equal(full, compact)
    assert int(cache.kept_tokens(1)[0, 1]) == 70 + 23  # a retrieval head of a routed layer


def test_sparse_mode_without_declaration_is_not_compacted():
    """FA-XA: neither mode declares a keep set, so nothing is evicted (and output is unchanged)."""
    xa = {"name": "xattention", "block_size": BS, "stride": 4, "threshold": 0.5}
    full, compact, cache, _ = generate_both("llama", ALL_SPARSE, [50], new=8, sparse=xa)
    assert torch.equal(full, compact)
    for layer in cache.elastic_layers().values():
        assert layer.kept_tokens().tolist() == [[57, 57]]


@pytest.mark.parametrize(("lengths", "router"), [([70, 52], ALL_SPARSE), ([70, 70], MIXED)],
                         ids=["padded", "equal_lengths"])
def test_chunks_after_the_prefill(lengths, router):
    """Several tokens in one step after the prefill (chunked continuation): earlier queries of the
    chunk still read the window keys that later tokens overwrite in the ring. Equal lengths: the
    new tokens' positions come from host integers."""
    ids, mask = left_padded(lengths, seed=5)
    more = torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = []
    for kv_cache in ("full", "compact"):
        elastic = ElasticModel(tiny_model("qwen2"), section(router, kv_cache))
        cache = elastic.make_kv_cache() if kv_cache == "compact" else None
        with torch.no_grad():
            first = elastic(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
            cache = first.past_key_values
            mask2 = torch.cat([mask, torch.ones_like(more)], dim=1)
            second = elastic(input_ids=more, attention_mask=mask2, cache=cache, use_cache=True)
        logits.append(second.logits)
        if kv_cache == "compact" and router is ALL_SPARSE:
            assert int(cache.kept_tokens(0)[0, 0]) == expected_kept(70 + 9)
    assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("router", [ALL_SPARSE, MIXED], ids=["all_streaming", "mixed"])
@pytest.mark.parametrize("granularity", ["block", "token"])
def test_a_batch_of_equal_lengths_generates_as_the_full_cache(router, granularity):
    """Samples of one length: the new tokens' positions are host integers, written in place into
    the stores, and the compact stores' mask is built once per step for every layer. 48 new tokens
    wrap the ring; the block window drops between 0 and bs - 1 of its oldest slots."""
    sparse = streaming(granularity) if granularity == "block" else streaming("token", sink=5, local=21)
    full, compact, _, _ = generate_both("llama", router, [70, 70, 70], new=48, sparse=sparse)
    assert torch.equal(full, compact)


@pytest.mark.parametrize("granularity", [1, 4])
def test_the_steps_shared_mask_by_hand(granularity):
    """DecodeMasks against the slots written out by hand: slot s < sink holds s; ring slot r holds the
    latest position j <= p with j >= sink and (j - sink) % local == r; the query at p reads j iff
    j <= p and (j < sink or j >= (p // g + 1) * g - local)."""
    sink, local = 4, 8
    keep = DecodeKeep(sink, local, granularity)
    masks = DecodeMasks()
    for slots in (6, 12):  # a store not yet grown to its capacity, and a full one
        for p in range(0, 40):
            held = []
            for s in range(slots):
                if s < sink:
                    held.append(s if s <= p else -1)
                else:
                    ring = [j for j in range(sink, p + 1) if (j - sink) % local == s - sink]
                    held.append(ring[-1] if ring else -1)
            start = (p // granularity + 1) * granularity - local
            want = [j >= 0 and j <= p and (j < sink or j >= start) for j in held]
            got = masks.visible(keep, p, slots, torch.device("cpu"))
            assert got.shape == (1, 1, 1, slots)
            assert got.flatten().tolist() == want, (slots, p)


def decode_logits(elastic: ElasticModel, cache, steps: int = 12) -> torch.Tensor:
    """Logits of a left-padded prefill then ``steps`` single-token decode steps (fixed tokens)."""
    ids, mask = left_padded([70, 41], seed=7)
    tokens = torch.randint(3, 250, (2, steps), generator=torch.Generator().manual_seed(2))
    out = []
    with torch.no_grad():
        res = elastic(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        cache = res.past_key_values
        for i in range(steps):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            out.append(elastic(input_ids=tokens[:, i : i + 1], attention_mask=mask, cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("granularity", ["block", "token"])
def test_a_wrong_declaration_is_caught(granularity, monkeypatch):
    """The equality checks are not vacuous: a window one token (token granularity) or one block
    rule (block granularity) off changes the decode logits, the correct one does not."""
    from elasticfw_plugins.modes.streaming import StreamingAttention

    sparse = streaming(granularity)
    ref = decode_logits(ElasticModel(tiny_model("llama"), section(ALL_SPARSE, sparse=sparse)), None)
    right = ElasticModel(tiny_model("llama"), section(ALL_SPARSE, sparse=sparse))
    assert torch.allclose(decode_logits(right, right.make_kv_cache()), ref, atol=1e-5, rtol=1e-4)
    wrong = DecodeKeep(SINK, LOCAL + 1) if granularity == "token" else DecodeKeep(SINK, LOCAL)
    monkeypatch.setattr(StreamingAttention, "decode_keep", lambda self: wrong)
    mutant = ElasticModel(tiny_model("llama"), section(ALL_SPARSE, sparse=sparse))
    assert (decode_logits(mutant, mutant.make_kv_cache()) - ref).abs().max() > 1e-3


# -- size -------------------------------------------------------------------------------------------


def test_bytes_are_the_kept_slots():
    """All heads streaming, prompts at least sink + window long: each (sample, KV head) holds exactly
    sink + local slots of keys, values and positions, whatever the padding."""
    ids, mask = left_padded([70, 55])
    elastic = ElasticModel(tiny_model("llama"), section(ALL_SPARSE, "compact"))
    cache = elastic.make_kv_cache()
    with torch.no_grad():
        elastic(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    head_dim = 16
    per_pair = (SINK + LOCAL) * (2 * head_dim * 4 + 4)  # fp32 keys + values, int32 position
    assert cache.nbytes == 4 * 2 * 2 * per_pair  # layers x samples x KV heads
    dense = 4 * 2 * 2 * 70 * 2 * head_dim * 4  # transformers' cache: padded width, every head
    assert cache.nbytes < dense
    assert cache.get_seq_length() == 70


def test_full_store_grows_in_chunks_without_losing_keys():
    """A full store smaller than the generation reallocates (growth 4 tokens) and keeps every key."""
    ids, mask = left_padded([30, 21])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = ElasticModel(tiny_model("mistral"), section(MIXED, "full"))
    elastic = ElasticModel(tiny_model("mistral"), section(MIXED, "full"))
    cache = ElasticKVCache(elastic, growth_tokens=4)
    with torch.no_grad():
        assert torch.equal(ref.generate(**kwargs), elastic.generate(cache=cache, **kwargs))
    assert cache.kept_tokens(0).tolist() == [[41, 41], [32, 32]]


# -- the contract -----------------------------------------------------------------------------------


def _decode_keep_cases():
    registry = get_registry()
    cases = []
    for entry in registry.entries("sparse_mode"):
        cases.append(pytest.param(entry.name, {}, id=f"{entry.name}-default"))
    for cfg in ({"granularity": "token", "sink_tokens": 5, "local_tokens": 21, "block_size": 16},
                {"granularity": "token", "sink_tokens": 0, "local_tokens": 1, "block_size": 16},
                {"granularity": "block", "sink_tokens": 32, "local_tokens": 64, "block_size": 32},
                {"granularity": "block", "sink_tokens": 0, "local_tokens": 16, "block_size": 16}):
        cases.append(pytest.param("streaming", cfg, id=f"streaming-{cfg['granularity']}-{cfg['sink_tokens']}"))
    return cases


@pytest.mark.parametrize(("name", "overrides"), _decode_keep_cases())
def test_declared_keep_is_exactly_what_the_layout_reads(name, overrides):
    """For every registered mode that declares a keep set: at each decode position p (one query
    after p keys), the layout's pairs equal DecodeKeep.visible — no key read that the cache
    dropped, no key kept that is never read."""
    registry = get_registry()
    entry = registry.entry("sparse_mode", name)
    mode: AttentionMode = registry.make("sparse_mode", entry.config_class(**overrides))  # type: ignore[misc]
    keep = mode.decode_keep()
    if keep is None:
        pytest.skip(f"{name} keeps every key (no declaration)")
    capacity = 300
    q = torch.randn(1, 2, 1, 8)
    k = torch.randn(1, 2, capacity, 8)
    keys = torch.arange(capacity)
    for p in range(0, capacity):
        seq = SeqInfo.from_lengths(torch.tensor([p + 1]), 1, capacity)
        layout = mode.build_layout(q, k, seq)
        read = dense_mask(layout, seq, num_heads=2)[0, :, 0]  # (H, Sk)
        expected = keep.visible(keys, torch.tensor(p))
        assert torch.equal(read, expected.expand_as(read)), f"{name} {overrides} at position {p}"
        assert int(expected.sum()) <= keep.capacity


def test_streaming_declares_its_window_and_full_declares_nothing():
    registry = get_registry()
    cls = registry.entry("sparse_mode", "streaming").config_class
    assert cls is not None
    block = registry.make("sparse_mode", cls(sink_tokens=128, local_tokens=2048, block_size=64))
    assert block.decode_keep() == DecodeKeep(128, 2048, 64)
    token = registry.make("sparse_mode", cls(granularity="token", sink_tokens=4, local_tokens=10, block_size=16))
    assert token.decode_keep() == DecodeKeep(4, 10, 1)
    full = registry.entry("sparse_mode", "full").config_class
    assert full is not None
    assert registry.make("sparse_mode", full()).decode_keep() is None


def test_decode_keep_hand_values():
    keep = DecodeKeep(4, 8, 4)  # block-granular window of 2 blocks of 4
    # position 13 sits in block 3: window = blocks 2..3 = positions 8..13, plus the sink 0..3
    got = keep.visible(torch.arange(20), torch.tensor(13)).nonzero().flatten().tolist()
    assert got == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13]
    token = DecodeKeep(2, 3)
    assert token.visible(torch.arange(10), torch.tensor(7)).nonzero().flatten().tolist() == [0, 1, 5, 6, 7]
    assert [DecodeKeep(16, 32).stored(n) for n in (0, 10, 16, 40, 48, 200)] == [0, 10, 16, 40, 48, 48]
    with pytest.raises(ValueError, match="multiple of granularity"):
        DecodeKeep(0, 10, 4)
    with pytest.raises(ValueError, match="local_tokens >= 1"):
        DecodeKeep(0, 0)


# -- what the compact cache refuses -----------------------------------------------------------------


def test_beam_search_and_training_are_refused():
    ids, mask = left_padded([40])
    elastic = ElasticModel(tiny_model("llama"), section(MIXED, "compact"))
    with pytest.raises(UnsupportedInputError, match="beam search"):
        elastic.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, num_beams=2, pad_token_id=0)
    cache = elastic.make_kv_cache()
    with torch.no_grad():
        elastic(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    with pytest.raises(UnsupportedInputError, match="crop"):
        cache.crop(-1)
    with pytest.raises(UnsupportedInputError, match="beam search"):
        cache.reorder_cache(torch.tensor([0]))
    learned = ElasticModel(tiny_model("llama"), section({"name": "mlp", "pool_tokens": 8}, "compact"))
    learned.train()
    with pytest.raises(UnsupportedInputError, match="router is training"):
        learned(input_ids=ids, attention_mask=mask, cache=learned.make_kv_cache(), use_cache=True)


def test_layers_kept_dense_and_errors():
    """Gemma 3's sliding-window layers are not routed: transformers' own layers serve them."""
    elastic = ElasticModel(tiny_model("gemma3"), section(MIXED, "compact"))
    cache = elastic.make_kv_cache()
    assert sorted(cache.elastic_layers()) == [1, 3]
    with pytest.raises(ElasticError, match="not compacted by this cache"):
        cache.kept_tokens(0)
    with pytest.raises(ElasticError, match="has not been compacted"):
        cache.kept_tokens(1)
    assert isinstance(cache.layers[1], ElasticKVLayer)


def test_a_decode_mask_other_than_the_prefills_extended_is_refused():
    """The compact cache holds each sample's real tokens as the prefill's mask said; a decode step
    whose mask says otherwise would be read differently by the full cache, so it is refused (it was
    silently ignored): a key of sample 1 masked after the prefill (the full cache then drops it:
    other logits), no mask after a padded prefill (the full cache reads every key as real), a
    right-padded prompt (a hole once tokens follow). The prefill's mask extended by ones runs, and
    its logits equal the full cache's (the independent answer)."""
    ids, mask = left_padded([30, 20], seed=3)
    token = torch.tensor([[7], [9]])
    ones = torch.ones(2, 1, dtype=mask.dtype)

    def step(kv_cache, prompt_mask, step_mask, inputs=ids):
        elastic = ElasticModel(tiny_model("llama"), section(MIXED, kv_cache))
        cache = elastic.make_kv_cache() if kv_cache == "compact" else None
        with torch.no_grad():
            cache = elastic(input_ids=inputs, attention_mask=prompt_mask, cache=cache, use_cache=True).past_key_values
            return elastic(input_ids=token, attention_mask=step_mask, cache=cache, use_cache=True).logits

    extended = torch.cat([mask, ones], dim=1)
    torch.testing.assert_close(step("compact", mask, extended), step("full", mask, extended), rtol=1e-4, atol=1e-5)
    changed = extended.clone()
    changed[1, 10] = 0  # sample 1's first real token, dropped after the prefill: still one run of real tokens
    assert not torch.allclose(step("full", mask, changed)[1], step("full", mask, extended)[1], atol=1e-3)
    with pytest.raises(UnsupportedInputError, match="mask of the prefill extended by ones"):
        step("compact", mask, changed)
    with pytest.raises(UnsupportedInputError, match=r"no attention mask .* real tokens of 31"):
        step("compact", mask, None)
    right_ids, right_mask = padded_batch([30, 20], side="right", seed=3)
    with pytest.raises(UnsupportedInputError, match="mask of the prefill extended by ones"):
        step("compact", right_mask, torch.cat([right_mask, ones], dim=1), inputs=right_ids)


def test_a_prefill_under_inference_mode_then_a_step_outside_it_is_named():
    """The stores made under torch.inference_mode cannot be written outside it: a named error, not
    torch's; every step under it runs and equals the full cache's logits."""
    ids, mask = left_padded([40, 25], seed=4)
    token = torch.tensor([[5], [6]])
    step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    logits = {}
    for kv_cache in ("full", "compact"):
        elastic = ElasticModel(tiny_model("llama"), section(MIXED, kv_cache))
        cache = elastic.make_kv_cache() if kv_cache == "compact" else None
        with torch.inference_mode():
            cache = elastic(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).past_key_values
            logits[kv_cache] = elastic(input_ids=token, attention_mask=step_mask, cache=cache, use_cache=True).logits
        if kv_cache == "compact":
            with torch.no_grad(), pytest.raises(UnsupportedInputError, match="inference_mode"):
                elastic(input_ids=token, attention_mask=torch.cat([step_mask, step_mask[:, :1]], dim=1), cache=cache,
                        use_cache=True)
    torch.testing.assert_close(logits["compact"], logits["full"], rtol=1e-4, atol=1e-5)
