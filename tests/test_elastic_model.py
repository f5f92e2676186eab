"""Elastic models on tiny random configs of every supported family (issue: elastic model).

Independent definitions: the unmodified transformers model (full routing must equal it), the
same sequences run one by one (padding), generation without a cache (cache), and hand-mixed
outputs of the two modes (training forward).
"""

from __future__ import annotations

import pytest
import torch

from elasticfw.errors import CheckpointError, ElasticError, UnsupportedInputError
from elasticfw.model.checkpoint import load_adapter
from elasticfw.model.elastic import ElasticModel
from elasticfw.recipe import validate_recipe_data
from elasticfw.testing.models import FAMILIES, tiny_config, tiny_model

MODES = {
    "retrieval_mode": {"name": "full", "block_size": 16},
    "sparse_mode": {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16},
}


def elastic_section(router: dict, **extra):
    return validate_recipe_data({"elastic": {**MODES, "router": router, **extra}}).elastic


def batch(lengths: list[int], side: str, seed: int = 1) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, 250, (n,), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, sl], mask[i, sl] = s, 1
    return seqs, ids, mask


MIXED = {"name": "fixed", "assign": "sparse_heads", "heads": [[1, 0], [3, 1], [3, 0]]}


@pytest.mark.parametrize("family", FAMILIES)
def test_full_routing_equals_unmodified_model(family):
    model = tiny_model(family)
    _, ids, mask = batch([90, 57], "left")
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        elastic = ElasticModel(model, elastic_section({"name": "fixed", "assign": "all_retrieval"}))
        got = elastic(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    real = mask.bool()
    assert torch.allclose(got[real], expected[real], atol=2e-5, rtol=1e-4)
    assert elastic.routing.msr.tolist() == [0.0, 0.0]
    base = elastic.unwrap()
    assert base.config._attn_implementation != "elasticfw"
    with torch.no_grad():
        again = base(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert torch.allclose(again[real], expected[real], atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_one_by_one(family, side):
    elastic = ElasticModel(tiny_model(family), elastic_section(MIXED))
    seqs, ids, mask = batch([90, 61, 33], side)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        out = elastic(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        batched_esr = elastic.routing.esr
        for i, s in enumerate(seqs):
            alone = elastic(input_ids=s[None]).logits[0]
            row = out[i, -len(s) :] if side == "left" else out[i, : len(s)]
            assert torch.allclose(row, alone, atol=2e-5, rtol=1e-4), f"sample {i}"
            assert torch.isclose(batched_esr[i], elastic.routing.esr[0], atol=1e-6)


@pytest.mark.parametrize("router", [{"name": "mlp", "pool_tokens": 8}, MIXED], ids=["mlp", "mixed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_cache_equals_without(family, router):
    torch.manual_seed(0)
    elastic = ElasticModel(tiny_model(family), elastic_section(router))
    _, ids, mask = batch([70, 45], "left", seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = elastic.generate(use_cache=True, **kwargs)
        decisions = elastic.routing.decisions.clone()
        uncached = elastic.generate(use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    assert torch.equal(decisions, elastic.routing.decisions)
    assert bool(decisions.any())  # the sparse mode really runs in these generations
    if router is MIXED:  # and both modes run in one launch
        assert not bool(decisions.all())


def test_mixed_routing_actually_differs_from_full():
    """The tiny models are sharp enough that a sparse head changes the logits (tests are not vacuous)."""
    model = tiny_model("llama")
    _, ids, _ = batch([120], "right")
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        elastic = ElasticModel(model, elastic_section({"name": "fixed", "assign": "all_sparse"}))
        got = elastic(input_ids=ids).logits
    assert (got - expected).abs().max() > 1e-3
    assert elastic.routing.msr.tolist() == [1.0]
    assert float(elastic.routing.esr[0]) > 0.2


@pytest.mark.parametrize("router", [{"name": "mlp", "pool_tokens": 8}, {"name": "static"}])
def test_optimizer_step_changes_router_only(router):
    model = tiny_model("qwen3")
    elastic = ElasticModel(model, elastic_section(router)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    router_before = [p.detach().clone() for p in elastic.trainable_parameters()]
    opt = torch.optim.AdamW(elastic.trainable_parameters(), lr=1e-2)
    _, ids, mask = batch([80, 50], "left")
    out = elastic(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    (out.loss + elastic.msr().mean()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in elastic.trainable_parameters())
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert any(not torch.equal(a, b) for a, b in zip(router_before, elastic.trainable_parameters()))
    assert not model.training


def test_training_forward_mixes_both_modes():
    """With a learnable router in train mode, O = r*O_sparse + (1-r)*O_full per KV-head group."""
    torch.manual_seed(0)
    model = tiny_model("llama", num_hidden_layers=1)
    elastic = ElasticModel(model, elastic_section({"name": "static", "init_sparse_prob": 0.5})).train()
    with torch.no_grad():  # KV head 0 clearly sparse, head 1 clearly full (Gumbel noise cannot flip 20 nats)
        elastic.router.logits[0, :, 0] = 0.0
        elastic.router.logits[0, :, 1] = torch.tensor([20.0, -20.0])
    seen = {}
    elastic.runtime.observers.append(lambda layer, can, scale: seen.update(q=can.q, k=can.k, v=can.v, scale=scale))
    attn = model.model.layers[0].self_attn
    hook = attn.o_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("mixed", a[0].detach()))
    _, ids, _ = batch([64], "right")
    torch.manual_seed(5)
    elastic(input_ids=ids)
    hook.remove()
    r = elastic.runtime.decisions[0].sparse.detach()[0]  # (Hkv,) hard 0/1
    assert r.tolist() == [1.0, 0.0]
    # independent: plain SDPA with a causal mask and a hand-built streaming mask (sink 16, local 32, block 16)
    q, k, v = seen["q"], seen["k"].repeat_interleave(3, 1), seen["v"].repeat_interleave(3, 1)
    i, j = torch.arange(64)[:, None], torch.arange(64)[None, :]
    causal = j <= i
    stream = causal & ((j // 16 < 1) | (j // 16 > i // 16 - 2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    full = sdpa(q, k, v, attn_mask=causal, scale=seen["scale"])
    sparse = sdpa(q, k, v, attn_mask=stream, scale=seen["scale"])
    rq = r.repeat_interleave(3)[None, :, None, None]
    expected = (rq * sparse + (1 - rq) * full).transpose(1, 2).reshape(1, 64, -1)
    assert torch.allclose(seen["mixed"], expected, atol=1e-5)


@pytest.mark.parametrize(
    "router",
    [{"name": "mlp", "pool_tokens": 8}, {"name": "mlp", "pool_tokens": 8, "pool_keys": "unrotated"}, {"name": "static"},
     MIXED],
)
def test_save_load_round_trip(tmp_path, router):
    torch.manual_seed(0)
    model = tiny_model("mistral")
    elastic = ElasticModel(model, elastic_section(router), base_model_name="tiny-mistral")
    with torch.no_grad():  # perturb so the saved router is not the default init
        for p in elastic.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.5)
    _, ids, mask = batch([60, 40], "left")
    with torch.no_grad():
        expected = elastic(input_ids=ids, attention_mask=mask).logits
    decisions = elastic.routing.decisions.clone()
    elastic.save_adapter(tmp_path / "adapter")
    base = elastic.unwrap()
    loaded = load_adapter(base, tmp_path / "adapter")
    with torch.no_grad():
        got = loaded(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(decisions, loaded.routing.decisions)
    assert torch.allclose(got, expected, atol=1e-6)
    assert loaded.router.reads_unrotated_keys == (router.get("pool_keys") == "unrotated")
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert files == ["elastic_adapter.safetensors", "elastic_config.json"]


def test_loading_onto_other_architecture_is_an_error(tmp_path):
    elastic = ElasticModel(tiny_model("llama"), elastic_section({"name": "mlp", "pool_tokens": 8}))
    elastic.save_adapter(tmp_path / "a")
    with pytest.raises(CheckpointError, match="'llama'.*given model is 'qwen2'"):
        load_adapter(tiny_model("qwen2"), tmp_path / "a")
    with pytest.raises(CheckpointError, match="num_kv_heads is 2 but the given model has 3"):
        load_adapter(tiny_model("llama", num_key_value_heads=3), tmp_path / "a")
    with pytest.raises(CheckpointError, match="not an elasticfw adapter"):
        load_adapter(tiny_model("llama"), tmp_path / "missing")


def test_unsupported_architecture_is_a_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64))
    with pytest.raises(UnsupportedInputError, match="model_type 'gpt2'.*supported model types: gemma3"):
        ElasticModel(model, elastic_section(MIXED))


def test_wrapping_twice_and_holes_in_mask_are_errors():
    model = tiny_model("llama")
    elastic = ElasticModel(model, elastic_section(MIXED))
    with pytest.raises(ElasticError, match="already elastic"):
        ElasticModel(model, elastic_section(MIXED))
    ids = torch.randint(3, 250, (1, 40))
    mask = torch.ones_like(ids)
    mask[0, 10] = 0
    with pytest.raises(UnsupportedInputError, match="contiguous run"):
        elastic(input_ids=ids, attention_mask=mask)


def test_gemma3_sliding_layers_keep_their_window_and_are_not_routed():
    model = tiny_model("gemma3")
    elastic = ElasticModel(model, elastic_section({"name": "fixed", "assign": "all_sparse"}))
    assert elastic.heads.routed_layers == (1, 3)
    _, ids, _ = batch([100], "right")
    with torch.no_grad():
        elastic(input_ids=ids)
    report = elastic.routing
    assert report.decisions.shape == (1, 2, 2)
    # sliding layers (window 24) computed exactly their window: per head sum_p min(p+1, 24)
    expected = sum(min(p + 1, 24) for p in range(100))
    computed = elastic.runtime.records[0].computed
    assert computed.tolist() == [[expected] * 6]
    routed = ElasticModel(elastic.unwrap(), elastic_section(MIXED, route_sliding_window_layers=True))
    assert routed.heads.routed_layers == (0, 1, 2, 3)


def test_routing_report_statistics():
    """MSR, all-layer ESR and last-layer ESR from the per-layer records, checked by hand."""
    model = tiny_model("llama")
    elastic = ElasticModel(model, elastic_section(MIXED))
    _, ids, _ = batch([96], "right")
    with torch.no_grad():
        elastic(input_ids=ids)
    report = elastic.routing
    # 3 of the 4 layers x 2 KV heads are sparse: (1,0), (3,0), (3,1)
    assert report.msr.tolist() == [3 / 8]
    causal = sum(p + 1 for p in range(96))
    streaming = sum(
        sum(1 for j in range(p + 1) if j // 16 < 1 or j // 16 > p // 16 - 2) for p in range(96)
    )
    sparse_esr = 1 - streaming / causal
    # layer 3: all 6 query heads sparse; layer 1: 3 of 6; layers 0, 2: none
    assert report.esr_last_layer.item() == pytest.approx(sparse_esr, abs=1e-6)
    assert report.esr.item() == pytest.approx(sparse_esr * (6 + 3) / 24, abs=1e-6)


def test_tiny_config_families_are_what_they_claim():
    assert tiny_config("gemma3").model_type == "gemma3_text"
    assert {tiny_config(f).model_type for f in FAMILIES} == {"llama", "qwen2", "qwen3", "mistral", "gemma3_text"}


def test_masks_beyond_causal_padding_are_refused():
    """Bidirectional overlays and packed sequences would be silently computed causally: refuse them."""
    model = tiny_model("gemma3", use_bidirectional_attention=True)
    elastic = ElasticModel(model, elastic_section(MIXED))
    with pytest.raises(UnsupportedInputError, match="not plain causal"):
        elastic(input_ids=torch.randint(3, 250, (1, 30)))
    packed = ElasticModel(tiny_model("llama"), elastic_section(MIXED))
    pos = torch.cat([torch.arange(20), torch.arange(15)])[None]
    with pytest.raises(UnsupportedInputError, match="packed sequences"):
        packed(input_ids=torch.randint(3, 250, (1, 35)), position_ids=pos)
    with pytest.raises(UnsupportedInputError, match="not plain causal"):  # straight into the backbone
        packed.base(input_ids=torch.randint(3, 250, (1, 35)), position_ids=pos, use_cache=False)


def test_static_cache_is_refused():
    elastic = ElasticModel(tiny_model("llama"), elastic_section(MIXED))
    with pytest.raises(UnsupportedInputError, match="cache_implementation='static'"):
        elastic.generate(input_ids=torch.randint(3, 250, (1, 20)), max_new_tokens=2, cache_implementation="static")


def test_two_adapters_claiming_one_model_type_is_an_error():
    from elasticfw import hookimpl
    from elasticfw.model.elastic import resolve_adapter
    from elasticfw.registry import load_registry
    from elasticfw_plugins.backbones.llama import LlamaAdapter

    class OtherLlama(LlamaAdapter):
        """A second adapter for llama."""

        name = "other_llama"

    class Plugin:
        @hookimpl
        def elasticfw_register_backbones(self, register):
            register(OtherLlama)

    registry = load_registry(extra_plugins=[("test", Plugin())])
    with pytest.raises(UnsupportedInputError, match="claimed by two backbone adapters, 'llama' and 'other_llama'"):
        resolve_adapter(tiny_config("llama"), registry)


def test_cuda_device_without_cuda_is_a_clear_error():
    from elasticfw.errors import BackendUnavailableError
    from elasticfw.model.loading import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(BackendUnavailableError, match="model.device = 'cuda'"):
        resolve_device("cuda")


def _prompt_dependent_model() -> tuple[ElasticModel, torch.Tensor, torch.Tensor]:
    """An MLP-routed model and two prompts it routes differently."""
    torch.manual_seed(0)
    elastic = ElasticModel(tiny_model("llama"), elastic_section({"name": "mlp", "pool_tokens": 8, "kernel": "eager"}))
    with torch.no_grad():
        for layer in elastic.router.layers:
            layer.router_mlp[-1].weight.normal_(0, 3.0)
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        x, y = torch.randint(3, 250, (1, 80), generator=g), torch.randint(3, 250, (1, 80), generator=g)
        with torch.no_grad():
            elastic(input_ids=x)
            dx = elastic.routing.decisions.clone()
            elastic(input_ids=y)
        if not torch.equal(dx, elastic.routing.decisions):
            return elastic, x, y
    raise AssertionError("no two prompts routed differently")


def test_a_decode_step_keeps_its_own_caches_routing():
    """Decisions belong to the cache a prompt filled: a step on X's cache after a prefill of Y (several
    conversations, a scoring pass between steps) routes by X. The answer it must equal is built without a
    cache: generate re-running X and its next token under X's held decision."""
    from transformers import DynamicCache

    elastic, x, y = _prompt_dependent_model()
    with torch.no_grad():
        cx = DynamicCache()
        token = elastic(input_ids=x, past_key_values=cx, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        x_decisions = elastic.routing.decisions.clone()
        elastic(input_ids=y, past_key_values=DynamicCache(), use_cache=True)
        assert not torch.equal(x_decisions, elastic.routing.decisions)
        step = elastic(input_ids=token, past_key_values=cx, use_cache=True).logits[:, -1]
        reference = elastic.generate(
            input_ids=x, use_cache=False, max_new_tokens=2, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )
    assert torch.equal(reference.sequences[:, -2:-1], token)
    assert torch.allclose(step, reference.logits[1], atol=2e-5, rtol=1e-4)


def test_a_continuation_on_a_cache_this_model_did_not_fill_is_an_error():
    from transformers import DynamicCache

    elastic, x, y = _prompt_dependent_model()
    foreign = DynamicCache()
    with torch.no_grad():
        elastic.unwrap()(input_ids=x, use_cache=True, **{elastic.cache_argument: foreign})
    elastic = ElasticModel(elastic.base, elastic_section({"name": "mlp", "pool_tokens": 8, "kernel": "eager"}))
    with torch.no_grad():
        elastic(input_ids=y)  # decisions of another prompt exist, but not of this cache's
        with pytest.raises(ElasticError, match="without the routing decision of its prefill"):
            elastic(input_ids=x[:, :1], past_key_values=foreign, use_cache=True)


def test_a_second_generate_turn_on_the_same_cache_keeps_the_first_turns_routing():
    """Multi-turn generation: the cache of turn 1, given to turn 2, keeps turn 1's routing; turn 2's
    tokens equal those of one uncached generate over the whole conversation under the held decision."""
    from transformers import DynamicCache

    elastic, x, y = _prompt_dependent_model()
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cache = DynamicCache()
        first = elastic.generate(input_ids=x, past_key_values=cache, max_new_tokens=4, **kwargs)
        turn1 = {layer: d.sparse.clone() for layer, d in elastic.runtime.decisions.items()}
        elastic(input_ids=y)  # another prompt in between
        follow = torch.cat([first, y[:, :5]], dim=1)
        second = elastic.generate(input_ids=follow, past_key_values=cache, max_new_tokens=4, **kwargs)
        assert {layer: d.sparse for layer, d in elastic.runtime.decisions.items()}.keys() == turn1.keys()
        assert all(torch.equal(d.sparse, turn1[layer]) for layer, d in elastic.runtime.decisions.items())
        whole = elastic.generate(input_ids=x, use_cache=False, max_new_tokens=4, **kwargs)
        assert torch.equal(whole, first)
    # the uncached reference of turn 2: re-run every step under turn 1's decision, as generate holds it
    runtime = elastic.runtime
    runtime.decisions = dict(elastic._cache_decisions[cache][0])
    runtime.hold_decisions = True
    try:
        with torch.no_grad():
            ids = follow
            for _ in range(4):
                ids = torch.cat([ids, elastic.base(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    finally:
        runtime.hold_decisions = False
    assert torch.equal(second, ids)


def _generate_reference(elastic: ElasticModel, ids: torch.Tensor) -> torch.Tensor:
    """The logits of ``ids``' next token from an uncached generate (re-runs the sequence under the
    decision held from its first forward)."""
    out = elastic.generate(input_ids=ids, use_cache=False, max_new_tokens=1, do_sample=False, pad_token_id=0,
                           output_logits=True, return_dict_in_generate=True)
    return out.logits[0]


@pytest.mark.parametrize("how", ["positional", "tuple"])
def test_a_cache_given_positionally_or_returned_in_a_tuple_keeps_its_routing(how):
    """A cache passed positionally, or created by the model and returned inside a tuple
    (``return_dict=False``), is recognised: the decode step on it after another prompt's forward
    routes by its own prompt (vs an uncached re-run of prompt and token under the held decision)."""
    from transformers import DynamicCache

    elastic, x, y = _prompt_dependent_model()
    name = elastic.cache_argument
    with torch.no_grad():
        if how == "positional":
            cx = DynamicCache()
            logits = elastic(x, None, None, cx, use_cache=True).logits
        else:
            logits, cx = elastic(input_ids=x, use_cache=True, return_dict=False)[:2]
        token = logits[:, -1:].argmax(-1)
        elastic(input_ids=y, use_cache=True, **{name: DynamicCache()})
        if how == "positional":
            step = elastic(token, None, None, cx, use_cache=True).logits[:, -1]
        else:
            step = elastic(input_ids=token, use_cache=True, return_dict=False, **{name: cx})[0][:, -1]
        reference = _generate_reference(elastic, torch.cat([x, token], dim=1))
    assert torch.allclose(step, reference, atol=2e-5, rtol=1e-4)


def test_a_reset_cache_routes_its_new_prompt_afresh_and_reports_each_turns_routing():
    """generate on a cache emptied with reset() decides on the new prompt (it reused the old
    prompt's routing); after a second turn on a kept cache, ``routing`` reports turn 1's prefill."""
    from transformers import DynamicCache

    elastic, x, y = _prompt_dependent_model()
    kwargs = dict(do_sample=False, pad_token_id=0, max_new_tokens=3)
    with torch.no_grad():
        elastic(input_ids=y)
        y_decisions = elastic.routing.decisions.clone()
        cache = DynamicCache()
        first = elastic.generate(input_ids=x, past_key_values=cache, **kwargs)
        x_decisions = elastic.routing.decisions.clone()
        assert not torch.equal(x_decisions, y_decisions)
        elastic.generate(input_ids=torch.cat([first, y[:, :4]], dim=1), past_key_values=cache, **kwargs)
        assert torch.equal(elastic.routing.decisions, x_decisions)  # turn 2 reports turn 1's routing
        cache.reset()
        again = elastic.generate(input_ids=y, past_key_values=cache, **kwargs)
        assert torch.equal(elastic.routing.decisions, y_decisions)
        fresh = elastic.generate(input_ids=y, past_key_values=DynamicCache(), **kwargs)
    assert torch.equal(again, fresh)
