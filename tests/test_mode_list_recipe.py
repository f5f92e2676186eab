"""The ``elastic.modes`` list: K >= 2 modes in one recipe field.

Independent definitions: the two-mode recipe written with ``retrieval_mode``/``sparse_mode``
(a two-entry list must be that section and run bit-identically), and the hand-written rules of
the field (at least two modes, no mode twice, block sizes that divide one another, not both forms).
"""

from __future__ import annotations

import pytest
import torch

from elasticfw.errors import RecipeError
from elasticfw.model.elastic import ElasticModel
from elasticfw.recipe import load_recipe, validate_recipe_data
from elasticfw.testing.models import tiny_model

FULL = {"name": "full", "block_size": 16}
STREAM = {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16}
MOBA = {"name": "moba", "block_size": 16, "moba_block_size": 32, "top_k": 2}


def elastic(**section):
    return validate_recipe_data({"elastic": section}).elastic


def test_two_modes_are_the_retrieval_and_sparse_fields():
    listed = elastic(modes=[FULL, STREAM])
    named = elastic(retrieval_mode=FULL, sparse_mode=STREAM)
    assert listed == named
    assert listed.modes is None and listed.num_modes == 2
    assert listed.model_dump(mode="json") == named.model_dump(mode="json")
    assert [m.name for m in listed.mode_configs()] == ["full", "streaming"]


def test_three_modes_keep_their_order_and_round_trip_through_a_dump():
    section = elastic(modes=[FULL, MOBA, STREAM])
    assert section.num_modes == 3 and section.modes_label() == "full-moba-streaming"
    assert [m.name for m in section.mode_configs()] == ["full", "moba", "streaming"]
    assert (section.retrieval_mode.name, section.sparse_mode.name) == ("full", "streaming")
    dumped = section.model_dump(mode="json")
    assert "retrieval_mode" not in dumped and "sparse_mode" not in dumped
    assert [m["name"] for m in dumped["modes"]] == ["full", "moba", "streaming"]
    assert validate_recipe_data({"elastic": dumped}).elastic == section


@pytest.mark.parametrize(
    ("section", "needles"),
    [
        ({"modes": [FULL]}, ["elastic", "modes = 1 entry", "at least 2"]),
        ({"modes": []}, ["modes = 0 entries", "at least 2"]),
        ({"modes": "full"}, ["modes = 'full'", "a list of at least 2"]),
        ({"modes": [FULL, STREAM, FULL]}, ["modes.0 and modes.2 are the same mode (full"]),
        ({"modes": [FULL, FULL]}, ["modes.0 and modes.1 are the same mode (full"]),
        ({"modes": [FULL, STREAM], "sparse_mode": STREAM}, ["modes and sparse_mode are both given"]),
        ({"modes": [FULL, STREAM], "retrieval_mode": FULL, "sparse_mode": STREAM},
         ["modes and retrieval_mode and sparse_mode are both given"]),
        ({"modes": [FULL, MOBA, {**STREAM, "block_size": 24, "sink_tokens": 24, "local_tokens": 48}]},
         ["modes.0.block_size=16 and modes.2.block_size=24 must divide one another"]),
        ({"modes": [FULL, {"name": "nope"}]}, ["elastic.modes.1"]),
    ],
)
def test_wrong_mode_lists_are_named_errors(section, needles):
    with pytest.raises(RecipeError) as info:
        elastic(**section)
    for needle in needles:
        assert needle in str(info.value)


def test_a_mode_list_replaces_the_two_mode_fields_of_a_base_file(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("elastic:\n  retrieval_mode: {name: full, block_size: 16}\n"
                    "  sparse_mode: {name: streaming, sink_tokens: 16, local_tokens: 32, block_size: 16}\n")
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {base.name}\nelastic:\n  modes:\n    - {{name: full, block_size: 16}}\n"
                     "    - {name: moba, block_size: 16, moba_block_size: 32, top_k: 2}\n"
                     "    - {name: streaming, sink_tokens: 16, local_tokens: 32, block_size: 16}\n")
    recipe = load_recipe(child)
    assert recipe.elastic.modes_label() == "full-moba-streaming"
    # the other way round the user must clear the list: a silent fallback would drop a mode
    with pytest.raises(RecipeError, match="modes and sparse_mode are both given"):
        load_recipe(child, ["elastic.sparse_mode.sink_tokens=32"])
    cleared = load_recipe(child, ["elastic.modes=null", "elastic.sparse_mode.sink_tokens=64"]).elastic
    assert cleared.num_modes == 2 and cleared.sparse_mode.sink_tokens == 64  # on the default streaming section


@pytest.mark.parametrize("router", [{"name": "mlp", "pool_tokens": 8}, {"name": "static"},
                                    {"name": "fixed", "assign": "sparse_heads", "heads": [[0, 1], [1, 0]]}])
def test_a_two_mode_list_runs_bit_identically_to_the_two_mode_recipe(router):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 250, (2, 96), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    outs = []
    for section in ({"modes": [FULL, STREAM]}, {"retrieval_mode": FULL, "sparse_mode": STREAM}):
        torch.manual_seed(0)
        model = tiny_model("llama")
        model_elastic = ElasticModel(model, elastic(router=router, **section))
        with torch.no_grad():
            for p in model_elastic.trainable_parameters():  # a router that is not its initial state
                p.add_(torch.randn_like(p))
            logits = model_elastic(input_ids=ids, attention_mask=mask).logits
        outs.append((logits, model_elastic.routing.decisions))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    assert outs[0][1].any() and not outs[0][1].all()  # both modes ran (the comparison is not vacuous)
