"""scripts/mode_swap.py: the assignment read from a summary's sparse shares, and its variant syntax."""

from __future__ import annotations

import pytest

from tests.file_modules import load_script

swap = load_script("mode_swap")


def _summary(share: list[list[float]]) -> dict:
    return {"routers": {"mlp": {"routing": {"sparse_share": {"passkey": share}}}}}


def test_sparse_heads_maps_rows_to_routed_layers() -> None:
    # rows are routed layers 1 and 3 (layer 0 and 2 not routed); heads with share 1 are sparse
    share = [[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
    assert swap.sparse_heads(_summary(share), "mlp", "passkey", [1, 3]) == [[1, 0], [1, 2], [3, 2]]


def test_sparse_heads_refuses_a_routing_that_differs_between_samples() -> None:
    with pytest.raises(SystemExit, match=r"1 heads are routed sparse on some samples only \(e.g. row 1, head 1: share 0.250\)"):
        swap.sparse_heads(_summary([[1.0, 0.0], [0.0, 0.25]]), "mlp", "passkey", [0, 1])


def test_sparse_heads_names_what_is_missing() -> None:
    with pytest.raises(SystemExit, match="routers.static.routing.sparse_share.passkey"):
        swap.sparse_heads(_summary([[1.0]]), "static", "passkey", [0])
    with pytest.raises(SystemExit, match="2 rows, expected one per routed layer \\(3\\)"):
        swap.sparse_heads(_summary([[1.0], [0.0]]), "mlp", "passkey", [0, 1, 2])


def test_parse_variant() -> None:
    assert swap.parse_variant("as trained|") == ("as trained", {})
    label, modes = swap.parse_variant("xa|retrieval_mode={name: xattention, threshold: 0.95}; sparse_mode={name: full}")
    assert label == "xa"
    assert modes == {"retrieval_mode": {"name": "xattention", "threshold": 0.95}, "sparse_mode": {"name": "full"}}
    for bad, msg in [("no label", "expected 'LABEL"), ("x|router={name: mlp}", "SLOT=YAML with SLOT one of"),
                     ("x|sparse_mode=[1, 2]", "should be a mode section with a name")]:
        with pytest.raises(SystemExit, match=msg):
            swap.parse_variant(bad)


def test_adapter_with_modes_keeps_the_router_and_swaps_the_mode(tmp_path) -> None:
    """The swapped copy keeps the router (its weights; the first routed layer, whose keys no mode has
    touched yet, decides as before) and runs the new mode: with full attention in the sparse slot the
    output is the unmodified model's (an independent definition of "the mode was swapped")."""
    import torch

    from elasticfw.model.checkpoint import load_adapter
    from elasticfw.model.elastic import ElasticModel
    from elasticfw.recipe import validate_recipe_data
    from elasticfw.testing.models import tiny_model

    modes = {"retrieval_mode": {"name": "full", "block_size": 16},
             "sparse_mode": {"name": "streaming", "sink_tokens": 16, "local_tokens": 16, "block_size": 16}}
    section = validate_recipe_data({"elastic": {**modes, "router": {"name": "mlp", "pool_tokens": 8}}}).elastic
    model = tiny_model("llama")
    ids = torch.randint(3, 250, (2, 80), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    elastic = ElasticModel(model, section, base_model_name="tiny")
    with torch.no_grad():
        for p in elastic.trainable_parameters():
            p.add_(torch.randn_like(p))
        routed = elastic(input_ids=ids).logits
    decisions = elastic.routing.decisions.clone()
    elastic.save_adapter(tmp_path / "a")
    elastic.unwrap()
    assert decisions.any(), "some head must be sparse for the swap to matter"
    assert not torch.allclose(routed, plain, atol=1e-3)
    copy = swap.adapter_with_modes(tmp_path / "a", {"sparse_mode": {"name": "full", "block_size": 16}}, tmp_path / "b")
    loaded = load_adapter(model, copy)
    with torch.no_grad():
        swapped = loaded(input_ids=ids).logits
    assert torch.equal(loaded.routing.decisions[:, 0], decisions[:, 0])
    kept = {k: v for k, v in elastic.router.state_dict().items()}
    assert all(torch.equal(v, kept[k]) for k, v in loaded.router.state_dict().items())
    assert torch.allclose(swapped, plain, atol=1e-4)
    loaded.unwrap()
