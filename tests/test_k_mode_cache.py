"""The compact KV cache among K = 3 modes: each head keeps what its own mode reads at decode
(streaming: its sink and ring; full and MoBA: every key), and greedy generation through it equals
generation without any cache (every step a prefill of the whole sequence under the same routing)."""

from __future__ import annotations

import torch

from elasticfw.model.elastic import ElasticModel
from elasticfw.recipe import validate_recipe_data
from elasticfw.testing.models import padded_batch, tiny_model

SINK, LOCAL = 4, 12
MODES = [
    {"name": "full", "block_size": 16},
    {"name": "moba", "moba_block_size": 16, "top_k": 2, "block_size": 16, "query_granularity": "token",
     "decode": "sparse"},
    {"name": "streaming", "sink_tokens": SINK, "local_tokens": LOCAL, "block_size": 16, "granularity": "token"},
]
# (layer, KV head, mode): layer 0 = moba | streaming, layer 1 = full | streaming, per the fixed router
HEAD_MODES = [[0, 0, 1], [0, 1, 2], [1, 1, 2]]


def elastic_model(kv_cache: str = "full") -> ElasticModel:
    section = validate_recipe_data({"elastic": {
        "modes": MODES, "kv_cache": kv_cache,
        "router": {"name": "fixed", "assign": "mode_heads", "head_modes": HEAD_MODES},
    }}).elastic
    return ElasticModel(tiny_model("llama", num_hidden_layers=2), section)


def stored(n: int) -> int:
    """Keys a streaming head keeps of n tokens, by hand: the first SINK, then the last LOCAL of the rest."""
    return min(n, SINK) + min(max(n - SINK, 0), LOCAL)


def test_greedy_generation_through_the_compact_cache_equals_no_cache():
    lengths = [40, 29]
    ids, mask = padded_batch(lengths, side="left", seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    elastic = elastic_model()
    cache = elastic.make_kv_cache()
    with torch.no_grad():
        compact = elastic.generate(cache=cache, **kwargs)
        uncached = elastic.generate(use_cache=False, **kwargs)
    assert torch.equal(compact, uncached)
    # every (sample, head) keeps what its mode reads: the prompt and the 5 tokens fed back
    for b, n in enumerate(lengths):
        n += 6 - 1
        assert cache.kept_tokens(0)[b].tolist() == [n, stored(n)]  # moba keeps every key
        assert cache.kept_tokens(1)[b].tolist() == [n, stored(n)]


def test_the_recipe_option_builds_the_compact_cache_and_it_holds_less():
    ids, mask = padded_batch([48, 48], side="left", seed=5)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    compact_model, full_model = elastic_model("compact"), elastic_model("full")
    full_model.load_state_dict(compact_model.state_dict())
    with torch.no_grad():
        tokens = compact_model.generate(**kwargs)
        cache = compact_model.make_kv_cache()
        compact_model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        assert torch.equal(tokens, full_model.generate(**kwargs))
    # 2 layers x 2 samples: one KV head keeps 48 keys, the streaming one SINK + LOCAL (keys, values fp32,
    # head dim 16; its int32 positions besides); the full stores reserve growth slots beyond the 48
    head_dim = 16
    streaming_bytes = 2 * 2 * (SINK + LOCAL) * (2 * head_dim * 4 + 4)
    assert cache.nbytes > streaming_bytes
    dense = 2 * 2 * 2 * 48 * 2 * head_dim * 4
    assert cache.kept_tokens(0).tolist() == [[48, SINK + LOCAL]] * 2
    assert cache.nbytes - streaming_bytes >= 2 * 2 * 48 * 2 * head_dim * 4  # the full and moba heads: every key
    assert streaming_bytes < dense / 4
