"""The compact KV cache's byte count of a routed layer before its prefill is compacted: the dense
keys and values transformers' update stored there, counted by hand."""

from __future__ import annotations

import torch

from elasticfw.model.elastic import ElasticModel
from elasticfw.model.kv_cache import ElasticKVLayer
from elasticfw.recipe import validate_recipe_data
from elasticfw.testing.models import tiny_model


def test_a_layer_not_yet_compacted_counts_its_dense_keys_and_values() -> None:
    section = {"retrieval_mode": {"name": "full", "block_size": 16},
               "sparse_mode": {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16},
               "router": {"name": "fixed", "assign": "all_sparse"}, "kv_cache": "compact"}
    elastic = ElasticModel(tiny_model("llama"), validate_recipe_data({"elastic": section}).elastic)
    layer = elastic.make_kv_cache().layers[0]
    assert isinstance(layer, ElasticKVLayer) and not layer.compacted and layer.nbytes == 0
    keys = torch.zeros(2, 2, 5, 16)  # (B, Hkv, S, D) float32: 2 * 2 * 5 * 16 * 4 = 1,280 bytes
    layer.update(keys, torch.zeros(2, 2, 5, 8, dtype=torch.float16))  # values: 2 * 2 * 5 * 8 * 2 = 320 bytes
    assert layer.nbytes == 1280 + 320
