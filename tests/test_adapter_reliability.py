"""Adapters are transactional and fail clearly (issue: reliability).

Independent expectations: a failed load leaves the plain model computing bit-identical logits
(measured before the attempt), with its attention implementation and ``requires_grad`` flags as
they were; each kind of broken adapter gives a CheckpointError naming the file and the fault;
a refused or interrupted save leaves the previous adapter byte for byte and no temporary folder;
every built-in router's full state (tensors and extra state) survives save -> load.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from training_helpers import TINY_ELASTIC, training_registry

from elasticfw.errors import CheckpointError, ElasticError
from elasticfw.model import adapter_files
from elasticfw.model.checkpoint import CONFIG, WEIGHTS, load_adapter, save_adapter
from elasticfw.model.elastic import ElasticModel
from elasticfw.recipe import validate_recipe_data
from elasticfw.testing.models import tiny_model

MLP = {"name": "mlp", "pool_tokens": 8}
IDS = torch.randint(3, 250, (2, 40), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def registry():
    return training_registry()


def section(registry, router):
    return validate_recipe_data({"elastic": {**TINY_ELASTIC, "router": router}}, registry=registry).elastic


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def trained(registry, router=MLP, name="org/base-a", **model_overrides):
    """(plain model, elastic wrapping it) with the router's parameters moved off their init."""
    model = tiny_model("llama", **model_overrides)
    elastic = ElasticModel(model, section(registry, router), registry=registry, base_model_name=name)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in elastic.router.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return model, elastic


@pytest.fixture
def saved(registry, tmp_path):
    """An adapter folder, the plain model it came from (unwrapped) and the elastic logits it gives."""
    model, elastic = trained(registry)
    want = logits(elastic)
    folder = save_adapter(elastic, tmp_path / "adapter")
    elastic.unwrap()
    return model, folder, want


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def rewrite_weights(folder: Path, edit) -> None:
    state = load_file(str(folder / WEIGHTS))
    save_file(edit(dict(state)), str(folder / WEIGHTS))


def rewrite_config(folder: Path, edit) -> None:
    meta = json.loads((folder / CONFIG).read_text())
    edit(meta)
    (folder / CONFIG).write_text(json.dumps(meta))


def first(state):
    return sorted(state)[0]


def _truncate_half(folder):
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[: len(data) // 2])


def _truncate_tail(folder):
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[:-16])


def _empty(folder):
    (folder / WEIGHTS).write_bytes(b"")


def _random_bytes(folder):
    (folder / WEIGHTS).write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1),
                                                 dtype=torch.uint8).numpy().tobytes())


def _rename(folder):
    def edit(state):
        name = first(state)
        state["renamed.weight"] = state.pop(name)
        return state
    rewrite_weights(folder, edit)


def _shape(folder):
    def edit(state):
        state[first(state)] = torch.zeros(3, 5)
        return state
    rewrite_weights(folder, edit)


def _extra_tensor(folder):
    rewrite_weights(folder, lambda state: {**state, "stray": torch.zeros(2)})


def _int_tensor(folder):
    def edit(state):
        name = first(state)
        state[name] = torch.zeros(state[name].shape, dtype=torch.int64)
        return state
    rewrite_weights(folder, edit)


def _nan(folder):
    def edit(state):
        t = state[first(state)].clone()
        t.view(-1)[3] = math.nan
        state[first(state)] = t
        return state
    rewrite_weights(folder, edit)


def _inf(folder):
    def edit(state):
        name = sorted(state)[-1]
        t = state[name].clone()
        t.view(-1)[0] = -math.inf
        state[name] = t
        return state
    rewrite_weights(folder, edit)


def _no_weights(folder):
    (folder / WEIGHTS).unlink()


def _missing_key(folder):
    rewrite_config(folder, lambda meta: meta.pop("head_dim"))


def _wrong_type(folder):
    rewrite_config(folder, lambda meta: meta.update(num_q_heads="6", routed_layers=[0, "1"]))


def _not_json(folder):
    (folder / CONFIG).write_text('{"format_version": 1, "model_type": ')


def _binary_json(folder):
    (folder / CONFIG).write_bytes(b"\xff\xfe\x00garbage")


def _json_list(folder):
    (folder / CONFIG).write_text("[1, 2, 3]")


def _bad_section(folder):
    rewrite_config(folder, lambda meta: meta["elastic"]["router"].update(name="mpl"))


def _routed_layers(folder):
    rewrite_config(folder, lambda meta: meta.update(routed_layers=[0, 1, 2]))


def _router_state_nan(folder):
    rewrite_config(folder, lambda meta: meta.update(router_state={"scores": [[math.nan]]}))


CORRUPTIONS = {
    # fault: (corrupt the adapter folder, pattern the message must match; {w} / {c}: weights / config path)
    "truncated header": (_truncate_half, r"{w}: not a readable safetensors file: the file is truncated"),
    "truncated data": (_truncate_tail, r"{w}: not a readable safetensors file: the file is truncated"),
    "empty file": (_empty, r"{w}: not a readable safetensors file: the file is truncated"),
    "random bytes": (_random_bytes, r"{w}: not a readable safetensors file: the file is not in safetensors format"),
    "tensor renamed": (_rename, r"{w}: does not fit router 'mlp' .*missing tensors \['layers\.0\..*'\]; "
                                r"unexpected tensors \['renamed\.weight'\]"),
    "extra tensor": (_extra_tensor, r"{w}: does not fit router 'mlp' .*: unexpected tensors \['stray'\]$"),
    "wrong shape": (_shape, r"{w}: tensors do not fit router 'mlp' .*layers\.0\.\S+: expected \([\d, ]+\), "
                            r"got \(3, 5\)"),
    "integer tensor": (_int_tensor, r"{w}: tensors do not fit .*expected a torch\.float32 tensor, got torch\.int64"),
    "NaN weights": (_nan, r"{w}: refusing an adapter whose weights hold NaN or Inf: 'layers\.0\.\S+' "
                          r"\(1 NaN, 0 Inf of \d+ values\)"),
    "Inf weights": (_inf, r"{w}: refusing .*NaN or Inf: '\S+' \(0 NaN, 1 Inf of \d+ values\)"),
    "weights missing": (_no_weights, r"elastic_adapter\.safetensors is missing"),
    "JSON missing a key": (_missing_key, r"{c}: not a valid adapter config: missing keys \['head_dim'\]"),
    "JSON wrong types": (_wrong_type, r"{c}: not a valid adapter config: 'num_q_heads' must be an integer, got a "
                                      r"string \(\"6\"\); 'routed_layers' must be a list of integers"),
    "JSON not JSON": (_not_json, r"{c}: not valid JSON \(Expecting value at line 1"),
    "JSON not text": (_binary_json, r"{c}: not valid JSON \(the file is not UTF-8 text\)"),
    "JSON not an object": (_json_list, r"{c}: expected a JSON object, got list"),
    "elastic section invalid": (_bad_section, r"{c}: its 'elastic' section is not valid here:\n  - router\.name = 'mpl': .*did you mean 'mlp'"),
    "routed layers differ": (_routed_layers, r"routes layers \[0, 1, 2\] but this model routes \[0, 1, 2, 3\]"),
    "router state NaN": (_router_state_nan, r"{c}: refusing an adapter whose router state holds NaN or Inf: "
                                            r"router_state\['scores'\]\[0\]\[0\] = nan"),
}


@pytest.mark.parametrize("fault", list(CORRUPTIONS))
def test_a_broken_adapter_is_refused_and_leaves_the_model_as_it_was(registry, saved, tmp_path, fault):
    model, folder, want = saved
    corrupt, pattern = CORRUPTIONS[fault]
    broken = tmp_path / "broken"
    broken.mkdir()
    for name, data in snapshot(folder).items():
        (broken / name).write_bytes(data)
    corrupt(broken)
    for p in list(model.parameters())[::3]:  # a mix of flags: wrapping sets them all False
        p.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    impl = model.config._attn_implementation
    params = {k: v.clone() for k, v in model.state_dict().items()}
    plain = logits(model)

    regex = pattern.format(w=_re(broken / WEIGHTS), c=_re(broken / CONFIG))
    with pytest.raises(CheckpointError, match=regex):
        load_adapter(model, broken, registry=registry)

    assert not getattr(model, "_elasticfw_wrapped", False)
    assert model.config._attn_implementation == impl
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    assert torch.equal(logits(model), plain)
    # the retry with a good adapter works, and routes as the saved router did
    loaded = load_adapter(model, folder, registry=registry)
    assert torch.equal(logits(loaded), want)


def _re(path: Path) -> str:
    import re

    return re.escape(str(path))


def test_a_failed_load_restores_train_mode_too(registry, saved, tmp_path):
    model, folder, _ = saved
    _routed_layers(folder)  # fails after the model was wrapped
    model.train()
    with pytest.raises(CheckpointError):
        load_adapter(model, folder, registry=registry)
    assert all(m.training for m in model.modules())


def test_loading_onto_an_elastic_model_leaves_that_wrapping_alone(registry, saved):
    model, folder, want = saved
    elastic = load_adapter(model, folder, registry=registry)
    with pytest.raises(ElasticError, match="already elastic"):
        load_adapter(model, folder, registry=registry)
    assert model._elasticfw_wrapped and torch.equal(logits(elastic), want)


def test_missing_folder_and_missing_config(registry, tmp_path):
    with pytest.raises(CheckpointError, match="is not an elasticfw adapter: no such folder"):
        load_adapter(tiny_model("llama"), tmp_path / "nowhere", registry=registry)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="is not an elasticfw adapter: elastic_config.json is missing"):
        load_adapter(tiny_model("llama"), tmp_path / "empty", registry=registry)


# -- the base model ----------------------------------------------------------------------------
def test_an_adapter_for_another_base_model_is_refused_unless_told(registry, saved):
    model, folder, want = saved
    with pytest.raises(CheckpointError, match=r"trained on base model 'org/base-a' but is being loaded onto "
                                              r"'org/base-b'.*strict_base_model=False .*under the name 'org/base-a'"):
        load_adapter(model, folder, registry=registry, base_model="org/base-b")
    assert not getattr(model, "_elasticfw_wrapped", False)
    loaded = load_adapter(model, folder, registry=registry, base_model="org/base-b", strict_base_model=False)
    assert torch.equal(logits(loaded), want)
    loaded.unwrap()
    same = load_adapter(model, folder, registry=registry, base_model="org/base-a/")  # a trailing slash is the same
    assert same.base_model_name == "org/base-a"
    same.unwrap()
    load_adapter(model, folder, registry=registry).unwrap()  # no name given: not checked


def test_either_name_of_the_model_matches(registry, tmp_path):
    """A model known as a recipe's short name and as transformers' _name_or_path matches an adapter
    that recorded either."""
    model, elastic = trained(registry, name="short-name")
    model.config._name_or_path = "Org/Real-Model"
    save_adapter(elastic, tmp_path / "a")
    elastic.unwrap()
    assert json.loads((tmp_path / "a" / CONFIG).read_text())["base_model_name_or_path"] == "Org/Real-Model"
    load_adapter(model, tmp_path / "a", registry=registry, base_model="Org/Real-Model").unwrap()
    load_adapter(model, tmp_path / "a", registry=registry, base_model="short-name").unwrap()
    other = tiny_model("llama")
    other.config._name_or_path = "Org/Other-Model"
    with pytest.raises(CheckpointError, match="'short-name' but is being loaded onto 'Org/Other-Model'"):
        load_adapter(other, tmp_path / "a", registry=registry, base_model="Org/Other-Model")


def test_an_adapter_that_recorded_no_base_model_is_not_checked(registry, tmp_path):
    model, elastic = trained(registry, name="")
    save_adapter(elastic, tmp_path / "a")
    elastic.unwrap()
    load_adapter(model, tmp_path / "a", registry=registry, base_model="anything").unwrap()


# -- saving ------------------------------------------------------------------------------------
def test_save_refuses_to_overwrite_and_keeps_the_old_adapter(registry, saved, tmp_path):
    model, folder, want = saved
    before = snapshot(folder)
    _, other = trained(registry, name="org/base-a", seed=1)
    with torch.no_grad():
        for p in other.router.parameters():
            p.mul_(-1.0)
    with pytest.raises(CheckpointError, match=rf"cannot save an adapter to '{_re(folder)}': .*not empty "
                                              r".*pass overwrite=True"):
        save_adapter(other, folder)
    with pytest.raises(CheckpointError, match="pass overwrite=True"):
        other.save_adapter(str(folder))
    assert snapshot(folder) == before
    assert other.save_adapter(folder, overwrite=True) == folder
    assert snapshot(folder) != before and sorted(snapshot(folder)) == [WEIGHTS, CONFIG]
    assert torch.equal(load_file(str(folder / WEIGHTS))["layers.0.router_mlp.0.weight"],
                       other.router.state_dict()["layers.0.router_mlp.0.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_save_never_deletes_or_mixes_with_foreign_files(registry, tmp_path):
    _, elastic = trained(registry)
    mixed = tmp_path / "notes"
    mixed.mkdir()
    (mixed / "README.md").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(CheckpointError, match=r"notes.*'README\.md'"):
            save_adapter(elastic, mixed, overwrite=overwrite)
    assert sorted(p.name for p in mixed.iterdir()) == ["README.md"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a folder"):
        save_adapter(elastic, tmp_path / "file", overwrite=True)
    (tmp_path / "empty").mkdir()
    save_adapter(elastic, tmp_path / "empty")  # an empty folder is filled
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == [WEIGHTS, CONFIG]


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("where", ["weights", "config"])
@pytest.mark.parametrize("existing", [True, False])
def test_an_interrupted_save_leaves_the_old_adapter_and_no_temp_folder(registry, saved, tmp_path, monkeypatch,
                                                                       where, existing):
    _, folder, _ = saved
    target = folder if existing else tmp_path / "new"
    before = snapshot(folder)
    _, elastic = trained(registry, seed=2)

    def half_written_weights(state, filename, *args, **kwargs):
        Path(filename).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")  # a partial file, then the crash
        raise Interrupted("disk full")

    def failing_config(path, text):
        Path(path).write_text(text[: len(text) // 2])
        raise Interrupted("killed")

    if where == "weights":
        monkeypatch.setattr(adapter_files, "save_file", half_written_weights)
    else:
        monkeypatch.setattr(adapter_files, "atomic_write_text", failing_config)
    with pytest.raises(Interrupted):
        save_adapter(elastic, target, overwrite=True)
    assert snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no temporary sibling, no half folder


def test_save_refuses_non_finite_router_tensors(registry, tmp_path):
    _, elastic = trained(registry)
    with torch.no_grad():
        next(iter(elastic.router.parameters())).view(-1)[0] = math.nan
    with pytest.raises(CheckpointError, match=r"refusing to save adapter .*NaN or Inf: 'layers\.0\.\S+' \(1 NaN"):
        save_adapter(elastic, tmp_path / "a")
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []


# -- every router's full state -----------------------------------------------------------------
ROUTERS = {
    "mlp": MLP,
    "static": {"name": "static"},
    "fixed": {"name": "fixed", "assign": "sparse_heads", "heads": [[0, 1], [2, 0], [3, 1]]},
    "retrieval_score": {"name": "retrieval_score", "target_msr": 0.5},
}


@pytest.mark.parametrize("router", list(ROUTERS))
def test_save_load_round_trips_every_routers_full_state(registry, tmp_path, router):
    # 14 query heads over 2 KV heads: groups of 7, where a mean of 7 copies of a float32 value is
    # often not that value (a score stored per KV head must not be re-aggregated on load)
    model, elastic = trained(registry, ROUTERS[router], num_attention_heads=14, num_key_value_heads=2)
    if router == "retrieval_score":
        g = torch.Generator().manual_seed(5)
        elastic.router.set_scores(torch.rand(4, 14, generator=g) * torch.exp(torch.randn(4, 14, generator=g) * 3))
    want = logits(elastic)
    report = elastic.routing
    tensors = {k: v.clone() for k, v in elastic.router.state_dict(keep_vars=False).items()}
    buffers = {k: v.clone() for k, v in elastic.router.named_buffers()}
    extra = json.loads(json.dumps(elastic.router.extra_state()))
    scores = getattr(elastic.router, "scores", None)
    save_adapter(elastic, tmp_path / "a")
    elastic.unwrap()

    loaded = load_adapter(model, tmp_path / "a", registry=registry)
    assert loaded.router.name == router and loaded.elastic_config == elastic.elastic_config
    got = loaded.router.state_dict()
    assert sorted(got) == sorted(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
    assert all(torch.equal(dict(loaded.router.named_buffers())[k], v) for k, v in buffers.items())
    assert loaded.router.extra_state() == extra
    if scores is not None:
        assert torch.equal(loaded.router.scores, scores)
    assert torch.equal(logits(loaded), want)
    assert torch.equal(loaded.routing.decisions, report.decisions)
    assert torch.equal(loaded.routing.prob_sparse, report.prob_sparse)
    if router in ("mlp", "static"):
        assert len(tensors) > 0
    if router == "retrieval_score":
        assert 0 < int(buffers["table"].sum()) < buffers["table"].numel()


def test_retrieval_score_state_that_does_not_fit_is_refused(registry, tmp_path):
    model, elastic = trained(registry, ROUTERS["retrieval_score"])
    elastic.router.set_scores(torch.rand(4, 6, generator=torch.Generator().manual_seed(0)))
    save_adapter(elastic, tmp_path / "a")
    elastic.unwrap()
    rewrite_config(tmp_path / "a", lambda meta: meta["router_state"].update(scores=[[0.1, 0.2]]))
    with pytest.raises(CheckpointError, match=r"'router_state' does not fit router 'retrieval_score': .*shape "
                                              r"\(1, 2\), expected \(4, 2\)"):
        load_adapter(model, tmp_path / "a", registry=registry)
    assert not getattr(model, "_elasticfw_wrapped", False)
