"""Routing among K = 3 modes end to end: each head in its mode at inference, the one-hot mix in
training, gradients to every mode's logit, and a K = 3 adapter saved and loaded.

Independent definitions: each mode's token-exact mask (tests/mode_definitions: full, MoBA per
token, streaming token window) applied by plain SDPA to the layer's own q, k, v, one mode at a
time, never through the runtime; the head's output must be its own mode's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from mode_definitions.common import causal
from mode_definitions.moba import token_reference as moba_mask
from mode_definitions.streaming import token_reference as streaming_mask

from elasticfw.errors import RecipeError
from elasticfw.model.checkpoint import load_adapter
from elasticfw.model.elastic import ElasticModel
from elasticfw.recipe import load_recipe_dict, validate_recipe_data
from elasticfw.routing.base import RouterDecision
from elasticfw.testing.models import padded_batch, tiny_model

MODES = [
    {"name": "full", "block_size": 16},
    {"name": "moba", "moba_block_size": 16, "top_k": 2, "block_size": 16, "query_granularity": "token"},
    {"name": "streaming", "sink_tokens": 4, "local_tokens": 12, "block_size": 16, "granularity": "token"},
]
MASKS = [lambda q, k, seq, config: causal(seq, q.shape[1]), moba_mask, streaming_mask]


def section(router: dict, modes=MODES, **extra):
    return validate_recipe_data({"elastic": {"modes": modes, "router": router, **extra}}).elastic


def capture(elastic: ElasticModel, model) -> dict:
    """Each layer's canonical q, k, v, seq and scale (observer) and its attention output (o_proj input)."""
    seen: dict = {"can": {}, "out": {}}
    elastic.runtime.observers.append(lambda layer, can, scale: seen["can"].__setitem__(layer, (can, scale)))
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.o_proj.register_forward_hook(
            lambda m, a, o, i=i: seen["out"].__setitem__(i, a[0].detach())
        )
    return seen


def mode_outputs(can, scale, configs) -> list[torch.Tensor]:
    """(B, Hq, S, D) each mode's attention for every head: its mask by SDPA, one mode at a time."""
    group = can.q.shape[1] // can.k.shape[1]
    k, v = can.k.repeat_interleave(group, 1), can.v.repeat_interleave(group, 1)
    outs = []
    for mask_of, config in zip(MASKS, configs):
        mask = mask_of(can.q, can.k, can.seq, config) & can.seq.key_valid()[:, None, None, :]
        mask = mask | ~mask.any(-1, keepdim=True)  # padding rows (not compared): avoid NaN
        outs.append(torch.nn.functional.scaled_dot_product_attention(can.q, k, v, attn_mask=mask, scale=scale))
    return outs


def per_sample_routing(elastic: ElasticModel, table: torch.Tensor) -> None:
    """Route by ``table`` (B, routed layers, Hkv) of mode indices: a router whose decisions differ per sample."""

    def decide(layer, keys, seq):
        one_hot = torch.nn.functional.one_hot(table[:, layer], 3).float()
        return RouterDecision.of_modes(one_hot, one_hot)

    elastic.router.decide = decide  # type: ignore[method-assign]


@pytest.mark.parametrize("side,executor", [("left", "reference"), ("right", "reference"), ("left", "sdpa")])
def test_each_head_at_inference_is_its_own_mode_alone(side, executor):
    model = tiny_model("llama", num_hidden_layers=2)
    elastic = ElasticModel(model, section({"name": "fixed"}, executor={"name": executor}))
    # per sample and layer every mode present, the assignment different between the samples
    table = torch.tensor([[[1, 2], [2, 0]], [[2, 0], [1, 2]], [[0, 1], [0, 0]]])
    per_sample_routing(elastic, table)
    seen = capture(elastic, model)
    lengths = [70, 45, 58]
    ids, mask = padded_batch(lengths, side=side, seed=1)
    with torch.no_grad():
        elastic(input_ids=ids, attention_mask=mask)
    configs = elastic.elastic_config.mode_configs()
    group = 3
    for layer in range(2):
        can, scale = seen["can"][layer]
        outs = torch.stack(mode_outputs(can, scale, configs))  # (K, B, Hq, S, D)
        got = seen["out"][layer].view(3, ids.shape[1], 6, 16).transpose(1, 2)  # (B, Hq, S, D), model rows
        for b, n in enumerate(lengths):
            rows = slice(ids.shape[1] - n, None) if side == "left" else slice(0, n)
            for h in range(6):
                m = int(table[b, layer, h // group])
                assert torch.allclose(got[b, h, rows], outs[m, b, h, :n], atol=1e-5), (layer, b, h, m)
        assert elastic.runtime.records[layer].mode_index.tolist() == table[:, layer].tolist()
    # the modes differ on these inputs (the comparison is not vacuous)
    can, scale = seen["can"][0]
    outs = mode_outputs(can, scale, configs)
    for i in range(3):
        for j in range(i):
            assert (outs[i][0, :, :70] - outs[j][0, :, :70]).abs().max() > 1e-3
    # MSR of K modes: the share of heads not in mode 0
    assert elastic.routing.msr.tolist() == pytest.approx([0.75, 0.75, 0.25])


def test_the_mlp_router_routes_per_sample_at_inference_like_the_reference():
    torch.manual_seed(0)
    model = tiny_model("qwen3", num_hidden_layers=2)
    elastic = ElasticModel(model, section({"name": "mlp", "pool_tokens": 8}))
    with torch.no_grad():
        for p in elastic.trainable_parameters():
            p.add_(torch.randn_like(p) * 2.0)
    seen = capture(elastic, model)
    lengths = [64, 40]
    ids, mask = padded_batch(lengths, side="left", seed=4)
    with torch.no_grad():
        elastic(input_ids=ids, attention_mask=mask)
    configs = elastic.elastic_config.mode_configs()
    used = set()
    for layer in range(2):
        index = elastic.runtime.records[layer].mode_index  # (B, Hkv), the router's own decision
        used |= set(index.flatten().tolist())
        can, scale = seen["can"][layer]
        outs = torch.stack(mode_outputs(can, scale, configs))
        hq, d = can.q.shape[1], can.q.shape[-1]
        got = seen["out"][layer].view(2, ids.shape[1], hq, d).transpose(1, 2)
        for b, n in enumerate(lengths):
            for h in range(hq):
                m = int(index[b, h // (hq // index.shape[1])])
                assert torch.allclose(got[b, h, ids.shape[1] - n:], outs[m, b, h, :n], atol=1e-5)
    assert len(used) >= 2


def test_training_mixes_every_mode_with_the_one_hot_and_every_logit_gets_a_gradient():
    torch.manual_seed(0)
    model = tiny_model("llama", num_hidden_layers=2)
    elastic = ElasticModel(model, section({"name": "mlp", "pool_tokens": 8})).train()
    seen = capture(elastic, model)
    ids, mask = padded_batch([64, 48], side="right", seed=2)
    out = elastic(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    configs = elastic.elastic_config.mode_configs()
    for layer in range(2):
        one_hot = elastic.runtime.decisions[layer].modes.detach()  # (B, Hkv, 3)
        can, scale = seen["can"][layer]
        with torch.no_grad():
            outs = torch.stack(mode_outputs(can, scale, configs))  # (K, B, Hq, S, D)
        w = one_hot.repeat_interleave(3, dim=1).permute(2, 0, 1)[..., None, None]
        expected = (w * outs).sum(0)
        got = seen["out"][layer].view(2, 64, 6, 16).transpose(1, 2)
        for b, n in enumerate([64, 48]):
            assert torch.allclose(got[b, :, :n], expected[b, :, :n], atol=1e-5)
        last = elastic.router.layers[layer].router_mlp[-1]
        assert (last.bias.grad.abs() > 0).all(), last.bias.grad  # each mode's logit
        assert (last.weight.grad.abs().sum(1) > 0).all()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("router", [{"name": "mlp", "pool_tokens": 8}, {"name": "static"},
                                    {"name": "fixed", "assign": "mode_heads", "head_modes": [[0, 1, 2], [2, 0, 1]]}])
def test_save_load_round_trip_of_a_three_mode_adapter(tmp_path, router):
    torch.manual_seed(0)
    model = tiny_model("mistral")
    elastic = ElasticModel(model, section(router), base_model_name="tiny-mistral")
    with torch.no_grad():
        for p in elastic.trainable_parameters():
            p.add_(torch.randn_like(p) * 2.0)
    ids, mask = padded_batch([60, 40], side="left", seed=1)
    with torch.no_grad():
        expected = elastic(input_ids=ids, attention_mask=mask).logits
    index = torch.stack([elastic.runtime.records[i].mode_index for i in sorted(elastic.runtime.records)])
    elastic.save_adapter(tmp_path / "adapter")
    loaded = load_adapter(elastic.unwrap(), tmp_path / "adapter")
    assert loaded.elastic_config.modes_label() == "full-moba-streaming" and loaded.heads.num_modes == 3
    with torch.no_grad():
        got = loaded(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, expected)
    assert torch.equal(index, torch.stack([loaded.runtime.records[i].mode_index for i in sorted(loaded.runtime.records)]))


def test_a_training_recipe_with_three_modes_needs_the_cost_constraint():
    """The MSR targets alone are refused for three modes; cost targets make the recipe valid
    (tests/test_cost_objective.py trains it)."""
    data = load_recipe_dict("recipes/train/smollm2-fa-ssa.yaml")
    data["elastic"] = {k: v for k, v in data["elastic"].items() if k not in ("retrieval_mode", "sparse_mode")}
    data["elastic"]["modes"] = [{"name": "full"}, {"name": "moba", "moba_block_size": 256},
                                {"name": "streaming", "sink_tokens": 64, "local_tokens": 256}]
    with pytest.raises(RecipeError, match="train.constraint = 'msr' with 3 modes in elastic.modes"):
        validate_recipe_data(data)
    data["train"] = {**data["train"], "constraint": "cost", "cost_targets": {"sensitive": 0.7, "robust": 0.55}}
    assert validate_recipe_data(data).train.constraint == "cost"
    data["elastic"]["modes"] = data["elastic"]["modes"][::2]
    data["train"] = {k: v for k, v in data["train"].items() if k not in ("constraint", "cost_targets")}
    assert validate_recipe_data(data).elastic.num_modes == 2


def test_the_how_to_recipes_validate():
    """The YAML of docs/how-to/route-among-modes.md: the mode list, and a mode with its own cost."""
    text = (Path(__file__).parent.parent / "docs" / "how-to" / "route-among-modes.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    listed = validate_recipe_data(yaml.safe_load(blocks[0])).elastic
    assert listed.modes_label() == "full-moba-streaming" and listed.router.name == "mlp"
    mode = yaml.safe_load("modes:\n" + blocks[1])["modes"][0]
    costed = validate_recipe_data({"elastic": {"modes": [{"name": "full"}, mode]}}).elastic
    assert costed.sparse_mode.name == "xattention" and costed.sparse_mode.cost == 0.35  # two modes: the pair


def test_generate_with_cache_equals_without_among_three_modes():
    """Decode steps reuse each sample's prefill routing among the three modes (uncached: every step is a
    prefill of the whole sequence under the decision generate holds). MoBA with ``decode: sparse``: a
    decode step then selects as that token's prefill row does (``decode: full`` reads every key)."""
    model = tiny_model("llama", num_hidden_layers=2)
    router = {"name": "fixed", "assign": "mode_heads", "head_modes": [[0, 0, 1], [0, 1, 2], [1, 1, 2]]}
    modes = [MODES[0], {**MODES[1], "decode": "sparse"}, MODES[2]]
    elastic = ElasticModel(model, section(router, modes=modes))
    ids, mask = padded_batch([70, 45], side="left", seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = elastic.generate(use_cache=True, **kwargs)
        uncached = elastic.generate(use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    assert elastic.runtime.records[0].mode_index.tolist() == [[1, 2], [1, 2]]


def test_split_runs_the_full_heads_of_a_three_mode_layer_through_its_dense_kernel(monkeypatch):
    """``split`` takes a K-mode layer's dense causal heads apart (``attend_modes`` hands them to
    ``attend_routed`` as the first group): its dense kernel sees exactly the full KV head's query
    heads, and every head still equals its own mode alone (the masks by SDPA)."""
    model = tiny_model("llama", num_hidden_layers=2)
    router = {"name": "fixed", "assign": "mode_heads", "head_modes": [[0, 1, 2], [1, 0, 1], [1, 1, 2]]}
    elastic = ElasticModel(model, section(router, executor={"name": "split"}))
    executor = elastic.runtime.executor
    dense_heads: list[int] = []
    real_dense = type(executor).dense

    def dense(self, q, k, v, **kw):
        dense_heads.append(q.shape[1])
        return real_dense(self, q, k, v, **kw)

    monkeypatch.setattr(type(executor), "dense", dense)
    seen = capture(elastic, model)
    ids, mask = padded_batch([64, 64], seed=4)
    with torch.no_grad():
        elastic(input_ids=ids, attention_mask=mask)
    assert dense_heads == [3]  # layer 0: KV head 0 full (3 query heads); layer 1 has no full head
    configs = elastic.elastic_config.mode_configs()
    for layer, modes in enumerate([[0, 2], [1, 2]]):
        can, scale = seen["can"][layer]
        outs = mode_outputs(can, scale, configs)
        got = seen["out"][layer].view(2, 64, 6, 16).transpose(1, 2)
        for h in range(6):
            assert torch.allclose(got[:, h], outs[modes[h // 3]][:, h], atol=1e-5), (layer, h)
