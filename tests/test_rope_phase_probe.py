"""``scripts/rope_phase_probe.py``: moving the last pooling window's keys to other positions.

Independent definition: the same prompt run with its position ids shifted, so that its last
window really sits at the reference positions (a rotary model's keys before the rotation do not
depend on absolute position): its keys there are what the moved keys must be.
"""

from __future__ import annotations

import torch

from elasticfw.model.elastic import ElasticModel
from elasticfw.recipe import validate_recipe_data
from elasticfw.testing.models import tiny_model
from tests.file_modules import load_script

probe = load_script("rope_phase_probe")

MODES = {
    "retrieval_mode": {"name": "full", "block_size": 16},
    "sparse_mode": {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16},
}


def routed_keys(model, ids: torch.Tensor, offset: int) -> dict[int, torch.Tensor]:
    section = validate_recipe_data({"elastic": {**MODES, "router": {"name": "fixed", "assign": "all_retrieval"}}})
    elastic = ElasticModel(model, section.elastic)
    seen, decide = {}, elastic.router.decide

    def spy(layer, keys, seq):
        seen[layer] = keys.detach().clone()
        return decide(layer, keys, seq)

    elastic.router.decide = spy
    with torch.no_grad():
        elastic(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None] + offset)
    elastic.unwrap()
    return seen


def test_moved_window_equals_the_keys_at_the_reference_positions():
    model = tiny_model("llama")
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(2))
    window, reference = 8, 100
    plain = routed_keys(model, ids, 0)
    shifted = routed_keys(model, ids, reference - 40)  # the last window at reference - 8 .. reference - 1
    for layer, keys in plain.items():
        moved = probe.move_last_window(keys, model.model.rotary_emb, window, reference)
        assert torch.allclose(moved[:, :, -window:], shifted[layer][:, :, -window:], atol=1e-4, rtol=1e-4)
        assert torch.equal(moved[:, :, :-window], keys[:, :, :-window])
        assert not torch.allclose(keys[:, :, -window:], shifted[layer][:, :, -window:], atol=1e-2)
    # moving to the prompt's own length changes nothing
    layer = next(iter(plain))
    same = probe.move_last_window(plain[layer], model.model.rotary_emb, window, 40)
    assert torch.allclose(same, plain[layer], atol=1e-5)


def test_a_router_of_unrotated_keys_is_probed_as_is_only():
    def router(pool_keys):
        section = validate_recipe_data({"elastic": {**MODES, "router": {"name": "mlp", "pool_keys": pool_keys}}})
        return ElasticModel(tiny_model("llama"), section.elastic).router

    assert probe.probe_variants(router("rotated")) == (False, True)
    assert probe.probe_variants(router("unrotated")) == (False,)
