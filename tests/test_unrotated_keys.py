"""A router that pools keys before the rotary embedding (``router.pool_keys: unrotated``).

Independent definitions: transformers' own ``apply_rotary_pos_emb`` (what :func:`unrotate` must
invert) and the pre-rotary keys read by a forward hook on the module that makes them (``k_norm``
where the family has one, else ``k_proj``), which the router must receive, sample by sample, in its
start-aligned layout. The property the option exists for: the same prompt at shifted absolute
positions (which leaves the LM's attention unchanged) pools to the same vectors, where the keys as
attention sees them do not.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticfw.errors import UnsupportedInputError
from elasticfw.model.elastic import ElasticModel
from elasticfw.model.rotary import RotaryCapture, unrotate
from elasticfw.recipe import validate_recipe_data
from elasticfw.testing.models import tiny_model
from elasticfw_plugins.routers.mlp import boundary_pool

MODES = {
    "retrieval_mode": {"name": "full", "block_size": 16},
    "sparse_mode": {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16},
}


def elastic_section(pool_keys: str):
    router = {"name": "mlp", "pool_tokens": 8, "pool_keys": pool_keys, "kernel": "eager"}
    return validate_recipe_data({"elastic": {**MODES, "router": router}}).elastic


def spy_keys(elastic: ElasticModel) -> dict[int, torch.Tensor]:
    """The keys the router's ``decide`` gets, per routed layer (a copy)."""
    seen: dict[int, torch.Tensor] = {}
    decide = elastic.router.decide

    def spy(layer, keys, seq):
        seen[layer] = keys.detach().clone()
        return decide(layer, keys, seq)

    elastic.router.decide = spy  # type: ignore[method-assign]
    return seen


def pre_rotary_keys(model: nn.Module) -> tuple[dict[int, torch.Tensor], list]:
    """(B, Hkv, T, D) keys before the rotary embedding per layer, from hooks on ``k_norm`` / ``k_proj``."""
    got: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        source = attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj

        def hook(module, args, out, i=i, attn=attn):
            if out.dim() == 4 and out.shape[1] == attn.config.num_key_value_heads:  # normed after the transpose
                got[i] = out.detach().clone()
            else:  # (B, T, Hkv * D) or (B, T, Hkv, D)
                b, t = out.shape[0], out.shape[1]
                got[i] = out.reshape(b, t, -1, attn.head_dim).transpose(1, 2).detach().clone()

        handles.append(source.register_forward_hook(hook))
    return got, handles


def test_unrotate_inverts_transformers_rotary_embedding():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 40, 16, generator=g)
    angles = torch.rand(2, 40, 8, generator=g) * 50
    for scale in (1.0, 1.7):  # an embedding that scales its rotation (attention_scaling) too
        cos = torch.cat([angles.cos(), angles.cos()], -1) * scale
        sin = torch.cat([angles.sin(), angles.sin()], -1) * scale
        _, rotated = apply_rotary_pos_emb(keys, keys, cos, sin)
        assert not torch.allclose(rotated, keys * scale, atol=1e-2)
        assert torch.allclose(unrotate(rotated, cos, sin), keys, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_router_gets_the_keys_before_the_rotary_embedding(family):
    model = tiny_model(family)
    elastic = ElasticModel(model, elastic_section("unrotated"))
    seen = spy_keys(elastic)
    pre, handles = pre_rotary_keys(model)
    lengths = [70, 45]
    ids = torch.zeros(2, 70, dtype=torch.long)
    mask = torch.zeros_like(ids)
    g = torch.Generator().manual_seed(3)
    for b, n in enumerate(lengths):  # left padding: the router's keys are rolled to start at 0
        ids[b, 70 - n :], mask[b, 70 - n :] = torch.randint(3, 250, (n,), generator=g), 1
    with torch.no_grad():
        elastic(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    for handle in handles:
        handle.remove()
    assert seen, "no routed layer"
    for position, layer in enumerate(elastic.heads.routed_layers):
        for b, n in enumerate(lengths):
            got = seen[position][b, :, :n]
            want = pre[layer][b, :, 70 - n :]
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (family, layer, b)
    elastic.unwrap()
    assert not any(module._forward_pre_hooks for module in elastic.adapter.attention_modules(model))


@pytest.mark.parametrize("pool_keys, invariant", [("unrotated", True), ("rotated", False)])
def test_pooled_keys_do_not_move_with_absolute_position(pool_keys, invariant):
    """One prompt at positions 0.. and at 300..: the LM's attention is the same (rotary scores depend
    on relative positions only); the unrotated pooled keys are too, the rotated ones are not."""
    model = tiny_model("llama")
    elastic = ElasticModel(model, elastic_section(pool_keys))
    seen = spy_keys(elastic)
    ids = torch.randint(3, 250, (1, 60), generator=torch.Generator().manual_seed(5))
    pooled, logits = [], []
    for offset in (0, 300):
        with torch.no_grad():
            out = elastic(input_ids=ids, position_ids=torch.arange(60)[None] + offset)
        logits.append(out.logits)
        seq = elastic.runtime.padding_memo.seq
        pooled.append(torch.stack([boundary_pool(seen[i], seq, 8) for i in sorted(seen)]))
    # the premise: the model's output is the same at both offsets
    assert torch.allclose(logits[0], logits[1], atol=1e-3, rtol=1e-3)
    gap = (pooled[0] - pooled[1]).abs().max().item()
    if invariant:
        assert gap < 1e-4, gap
    else:
        assert gap > 0.1, gap
    elastic.unwrap()


def test_missing_rotary_embedding_is_refused_by_name():
    module = nn.Linear(4, 4)
    capture = RotaryCapture([module])
    module(torch.zeros(1, 4))
    with pytest.raises(UnsupportedInputError, match="pool_keys"):
        capture.pair(0)
    capture.remove()
    with pytest.raises(UnsupportedInputError, match="partial rotary"):
        unrotate(torch.zeros(1, 2, 5, 16), torch.zeros(1, 5, 8), torch.zeros(1, 5, 8))
