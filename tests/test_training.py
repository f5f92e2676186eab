"""Router training: the objective against the paper's formula and hand cases, the data pipeline
against independent computations, and the trainer's guarantees (frozen backbone, resume, NaN stop)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from training_helpers import TINY_ELASTIC, ByteTokenizer, tiny_train_recipe, training_registry

from elasticfw.errors import CheckpointError, RecipeError, TrainingError, UnsupportedInputError
from elasticfw.model.checkpoint import load_adapter
from elasticfw.model.loading import make_elastic
from elasticfw.recipe import validate_recipe_data
from elasticfw.testing.models import FAMILIES, tiny_model
from elasticfw.training import trainer as trainer_module
from elasticfw.training.data import TrainItem, collate, shard, step_slots
from elasticfw.training.logs import read_metrics
from elasticfw.training.objective import Lagrangian, answer_cross_entropy, constraint_gap
from elasticfw.training.run import build_mixture, run_training
from elasticfw.training.trainer import cosine_with_warmup, train_router


@pytest.fixture(scope="module")
def registry():
    return training_registry()


def _recipe(registry, tmp_path, **train):
    return validate_recipe_data(tiny_train_recipe(tmp_path, **train), registry=registry)


def _setup(registry, tmp_path, family="llama", router=None, **train):
    data = tiny_train_recipe(tmp_path, **train)
    if router is not None:
        data["elastic"] = {**TINY_ELASTIC, "router": router}
    recipe = validate_recipe_data(data, registry=registry)
    model, tok = tiny_model(family), ByteTokenizer()
    mixture = build_mixture(recipe, tok, model, registry)
    elastic = make_elastic(model, tok, recipe.elastic, registry=registry)
    return recipe, model, mixture, elastic


# -- the objective -----------------------------------------------------------------------------
def test_penalty_is_eq8_with_hand_values():
    lag = Lagrangian([0.7, (0.2, 0.4)])
    with torch.no_grad():
        lag.lambda1.copy_(torch.tensor([0.5, -1.0]))
        lag.lambda2.copy_(torch.tensor([2.0, 3.0]))
    msr = torch.tensor([0.4, 0.9, 0.3, 0.5])
    task = torch.tensor([0, 0, 1, 1])
    # d = msr - t: -0.3, 0.2; inside [0.2, 0.4]: 0; above: 0.5 - 0.4 = 0.1
    expected = [0.5 * -0.3 + 2 * 0.09, 0.5 * 0.2 + 2 * 0.04, 0.0, -1.0 * 0.1 + 3 * 0.01]
    assert lag.penalty(msr, task).tolist() == pytest.approx(expected, abs=1e-6)
    assert constraint_gap(torch.tensor([0.1]), torch.tensor([0.2]), torch.tensor([0.4])).item() == pytest.approx(-0.1)


@pytest.mark.parametrize("msr,direction", [(0.3, -1), (0.95, +1), (0.75, 0)])
def test_lambda_ascent_pushes_msr_toward_its_target(msr, direction):
    """One ascent step: λ1 moves with d = MSR − t, and the penalty's slope in MSR then pushes
    MSR toward the interval [0.7, 0.8] (below: slope < 0 so minimising raises MSR)."""
    lag = Lagrangian([(0.7, 0.8)], init=0.0)
    opt = torch.optim.Adam(lag.parameters(), lr=0.1, maximize=True)
    m = torch.tensor([msr], requires_grad=True)
    lag.penalty(m, torch.tensor([0])).sum().backward()
    opt.step()
    assert math.copysign(1, lag.lambda1.item()) == direction or (direction == 0 and lag.lambda1.item() == 0)
    m2 = torch.tensor([msr], requires_grad=True)
    lag.penalty(m2, torch.tensor([0])).sum().backward()
    slope = m2.grad.item()
    if direction == 0:
        assert slope == 0 and lag.lambda2.item() == 0
    else:
        assert math.copysign(1, slope) == direction  # gradient descent on MSR moves it against the slope
        assert lag.lambda2.item() > 0  # d^2 > 0: lambda2 only grows


def test_cosine_warmup_schedule_hand_values():
    assert cosine_with_warmup(0, 10, 0.2) == pytest.approx(0.5)
    assert cosine_with_warmup(1, 10, 0.2) == pytest.approx(1.0)
    assert cosine_with_warmup(2, 10, 0.2) == pytest.approx(1.0)
    assert cosine_with_warmup(6, 10, 0.2) == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert cosine_with_warmup(0, 4, 0.0) == pytest.approx(1.0)


# -- data ----------------------------------------------------------------------------------------
def test_collate_labels_match_an_unpadded_forward():
    """CE on target tokens from the left-padded batch with logits_to_keep equals the CE of each
    sample computed alone, from all logits, at the positions read off by hand."""
    model = tiny_model("llama")
    items = [TrainItem([5, 6, 7, 8, 9, 10], [11, 12], 0), TrainItem([20, 21, 22], [23, 24, 25], 1)]
    batch = collate(items, pad_id=0)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=batch.keep)
    got = answer_cross_entropy(out.logits, batch.labels)
    want = 0.0
    for it in items:
        seq = torch.tensor([it.prompt + it.target])
        logp = torch.log_softmax(model(input_ids=seq).logits[0].float(), -1)
        p = len(it.prompt)
        want += -sum(logp[p - 1 + i, tok].item() for i, tok in enumerate(it.target))
    assert got.item() == pytest.approx(want, rel=1e-4)
    assert batch.route_lengths.tolist() == [6, 3] and batch.tokens == 8 + 6


def test_step_slots_deterministic_and_sharded(registry, tmp_path):
    recipe, _, mixture, _ = _setup(registry, tmp_path)
    a = step_slots(mixture, 3, 8, seed=1)
    assert a == step_slots(mixture, 3, 8, seed=1)
    assert a != step_slots(mixture, 4, 8, seed=1)
    assert shard(a, 0, 2) + shard(a, 1, 2) == a
    with pytest.raises(UnsupportedInputError):
        shard(a[:7], 0, 2)


def test_router_sees_the_prompt_only(registry, tmp_path):
    """With route_lengths = prompt length, decisions on prompt+target equal decisions on the prompt alone."""
    _, _, mixture, elastic = _setup(registry, tmp_path)
    it = mixture[0].items[0]
    elastic.eval()
    with torch.no_grad():
        elastic(input_ids=torch.tensor([it.prompt]))
        alone = elastic.routing.prob_sparse.clone()
        elastic.runtime.route_lengths = torch.tensor([len(it.prompt)])
        elastic(input_ids=torch.tensor([it.prompt + it.target * 20]))
        routed = elastic.routing.prob_sparse.clone()
        elastic.runtime.route_lengths = None
        elastic(input_ids=torch.tensor([it.prompt + it.target * 20]))
        unrestricted = elastic.routing.prob_sparse.clone()
    assert torch.allclose(alone, routed, atol=1e-6)
    assert not torch.allclose(alone, unrestricted, atol=1e-6)  # the tail would have changed them


# -- the trainer -----------------------------------------------------------------------------------
def test_straight_through_gradient_reaches_the_router_only(registry, tmp_path):
    _, model, mixture, elastic = _setup(registry, tmp_path)
    batch = collate([mixture[0].items[0], mixture[1].items[0]], 0)
    elastic.train()
    elastic.runtime.route_lengths = batch.route_lengths
    out = elastic(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=batch.keep)
    answer_cross_entropy(out.logits, batch.labels).backward()  # the LM loss alone
    grads = [p.grad for p in elastic.router.parameters()]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_two_steps_on_every_family_keep_the_backbone_bit_identical(registry, tmp_path, family):
    _, model, mixture, elastic = _setup(registry, tmp_path, family=family, steps=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    router_before = {k: v.clone() for k, v in elastic.router.state_dict().items()}
    result = train_router(elastic, mixture, _recipe(registry, tmp_path, steps=2).train, tmp_path, seed=0, pad_id=0,
                          progress=False, check_frozen=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert any(not torch.equal(v, router_before[k]) for k, v in elastic.router.state_dict().items())
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert (result.adapter_dir / "elastic_adapter.safetensors").is_file() and (tmp_path / "msr.png").is_file()


@pytest.mark.parametrize("router", [{"name": "mlp", "pool_tokens": 8}, {"name": "static"}])
def test_trained_adapter_loads_and_routes_like_the_trained_router(registry, tmp_path, router):
    recipe, model, mixture, elastic = _setup(registry, tmp_path, router=router, steps=2)
    train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    ids = torch.tensor([mixture[0].items[0].prompt])
    with torch.no_grad():
        elastic(input_ids=ids)
        want = elastic.routing.prob_sparse.clone()
    elastic.unwrap()
    loaded = load_adapter(model, tmp_path / "adapter", registry=registry)
    with torch.no_grad():
        loaded(input_ids=ids)
    assert torch.equal(loaded.routing.prob_sparse, want)


def test_logged_temperature_follows_the_papers_schedule(registry, tmp_path):
    recipe, _, mixture, elastic = _setup(registry, tmp_path, steps=4)
    train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    cfg = elastic.router.config
    for row in read_metrics(tmp_path):
        p = (row["step"] - 1) / 4 * cfg.tau_units  # progress at the start of the step
        assert row["tau"] == pytest.approx(max(cfg.tau_min, cfg.tau_init * math.exp(-cfg.tau_rate * p)))


def test_lambda_moves_with_the_constraint_gap_in_training(registry, tmp_path):
    """Target 1.0 (MSR always below) drives λ1 down; target 0.0 (MSR always above) drives it up."""
    data = tiny_train_recipe(tmp_path, steps=3, lambda_lr=0.05)
    data["train"]["tasks"][0]["target"] = 1.0
    data["train"]["tasks"][1]["target"] = 0.0
    recipe = validate_recipe_data(data, registry=registry)
    model, tok = tiny_model("llama"), ByteTokenizer()
    mixture = build_mixture(recipe, tok, model, registry)
    elastic = make_elastic(model, tok, recipe.elastic, registry=registry)
    train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    last = read_metrics(tmp_path)[-1]
    assert last["lambda1"]["recall"] < 0 < last["lambda1"]["repeat"]
    assert last["gap"]["recall"] < 0 < last["gap"]["repeat"]


def _losses(rows):
    return [(r["step"], r["lm_loss"], r["reg_loss"], r["msr"], r["lambda1"]) for r in rows]


def test_resume_reproduces_the_uninterrupted_run(registry, tmp_path, monkeypatch):
    recipe, _, mixture, elastic = _setup(registry, tmp_path / "a", steps=4)
    train_router(elastic, mixture, recipe.train, tmp_path / "a", seed=0, pad_id=0, progress=False)
    want = _losses(read_metrics(tmp_path / "a"))
    want_state = {k: v.clone() for k, v in elastic.router.state_dict().items()}

    recipe, _, mixture, elastic = _setup(registry, tmp_path / "b", steps=4)
    real = trainer_module._row
    calls = {"n": 0}

    def crash_after_step_3(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # killed during step 3, after the checkpoint of step 2
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "_row", crash_after_step_3)
    with pytest.raises(KeyboardInterrupt):
        train_router(elastic, mixture, recipe.train, tmp_path / "b", seed=0, pad_id=0, progress=False)
    monkeypatch.setattr(trainer_module, "_row", real)
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text().strip() == "step-000002"
    # a fresh process: a new model and router, restored from the checkpoint
    recipe, _, mixture, elastic = _setup(registry, tmp_path / "b", steps=4)
    train_router(elastic, mixture, recipe.train, tmp_path / "b", seed=0, pad_id=0, progress=False, resume=True)
    assert _losses(read_metrics(tmp_path / "b")) == want
    assert all(torch.equal(v, want_state[k]) for k, v in elastic.router.state_dict().items())


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(registry, tmp_path, monkeypatch):
    recipe, _, mixture, elastic = _setup(registry, tmp_path, steps=4)
    real = trainer_module.answer_cross_entropy
    calls = {"n": 0}

    def nan_in_step_3(logits, labels):
        calls["n"] += 1
        value = real(logits, labels)
        return value * float("nan") if calls["n"] > 4 else value  # 2 micro-batches per step

    monkeypatch.setattr(trainer_module, "answer_cross_entropy", nan_in_step_3)
    with pytest.raises(TrainingError, match=r"step 2: the loss is not finite .*step-000002"):
        train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    latest = tmp_path / "checkpoints" / "latest"
    assert latest.read_text().strip() == "step-000002"
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert not (tmp_path / "adapter").exists()


def test_untrainable_router_and_bad_batches_are_refused(registry, tmp_path):
    recipe, _, mixture, elastic = _setup(registry, tmp_path, router={"name": "fixed", "assign": "all_sparse"})
    with pytest.raises(UnsupportedInputError, match="elastic.router.name = 'fixed' has no trainable parameters"):
        train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    with pytest.raises(RecipeError, match=r"batch_size \(6\) must be a multiple of micro_batch_size \(4\)"):
        _recipe(registry, tmp_path, batch_size=6, micro_batch_size=4)
    with pytest.raises(RecipeError, match=r"train.tasks.0.target.*\[0, 1\]"):
        data = tiny_train_recipe(tmp_path)
        data["train"]["tasks"][0]["target"] = 1.5
        validate_recipe_data(data, registry=registry)


def test_run_training_trains_baselines_evaluates_and_refuses_to_overwrite(registry, tmp_path):
    data = tiny_train_recipe(tmp_path / "run", steps=2, evaluate=True, baselines=[{"router": {"name": "static"}}])
    recipe = validate_recipe_data(data, registry=registry)
    summary = run_training(recipe, registry=registry, progress=False)
    assert set(summary["routers"]) == {"mlp", "static"} and summary["modes"] == "full-streaming"
    for router in ("mlp", "static"):
        tasks = summary["routers"][router]["tasks"]
        assert set(tasks) == {"recall", "repeat"}
        assert tasks["recall"]["category"] == "sensitive" and tasks["repeat"]["category"] == "robust"
        for row in tasks.values():
            assert row["samples"] == 4 and 0 <= row["msr"] <= 1 and row["full_accuracy"] is not None
            # the MSR reported is the mean over the held-back samples' own routing
            assert row["msr"] == pytest.approx(
                sum(s["msr"] for s in summary["details"][router][next(k for k, v in tasks.items() if v is row)]["per_sample"]) / 4
            )
        # spread and routing, recomputed from the per-sample rows
        for name, row in tasks.items():
            samples = summary["details"][router][name]["per_sample"]
            msrs = [s["msr"] for s in samples]
            mean = sum(msrs) / len(msrs)
            assert row["msr_std"] == pytest.approx((sum((m - mean) ** 2 for m in msrs) / len(msrs)) ** 0.5)
            assert (row["msr_min"], row["msr_max"]) == (min(msrs), max(msrs))
            share = summary["routers"][router]["routing"]["sparse_share"][name]
            grids = [s["decisions"] for s in samples]
            assert share == [[pytest.approx(sum(g[i][j] for g in grids) / len(grids)) for j in range(len(grids[0][0]))]
                             for i in range(len(grids[0]))]
        assert (tmp_path / "run" / router / "routing.png").is_file()
    static = summary["routers"]["static"]["routing"]
    assert static["adaptive_samples"] == 0.0 and static["task_dependent_heads"] == []  # input-independent
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["routers"].keys() == summary["routers"].keys()
    with pytest.raises(TrainingError, match="already holds a run; pass --resume"):
        run_training(recipe, registry=registry, progress=False)
    # resume of a finished run keeps both routers and re-evaluates
    again = run_training(recipe, registry=registry, progress=False, resume=True)
    assert again["routers"]["mlp"]["tasks"]["recall"]["msr"] == summary["routers"]["mlp"]["tasks"]["recall"]["msr"]


def test_context_window_guard(registry, tmp_path):
    data = tiny_train_recipe(tmp_path)
    data["train"]["tasks"][0]["task"]["context_tokens"] = 2000  # the tiny model's window is 1024
    recipe = validate_recipe_data(data, registry=registry)
    with pytest.raises(UnsupportedInputError, match=r"task 'recall'.*context window is 1024 tokens"):
        build_mixture(recipe, ByteTokenizer(), tiny_model("llama"), registry)


def test_output_dir_checks(registry, tmp_path):
    (tmp_path / "file").write_text("x")
    recipe = _recipe(registry, tmp_path / "file")
    with pytest.raises(TrainingError, match="exists and is not a folder"):
        run_training(recipe, registry=registry, progress=False)
    recipe = _recipe(registry, tmp_path / "empty")
    with pytest.raises(TrainingError, match="holds no run to resume"):
        run_training(recipe, registry=registry, progress=False, resume=True)


def test_checkpoint_write_is_atomic_on_crash(registry, tmp_path, monkeypatch):
    """A crash while writing checkpoint 4 leaves 'latest' at the complete checkpoint 2."""
    recipe, _, mixture, elastic = _setup(registry, tmp_path, steps=4)
    from elasticfw.training import state

    real = state.save_file
    calls = {"n": 0}

    def crash_second(tensors, path):
        calls["n"] += 1
        if calls["n"] >= 3:  # adapter + state of checkpoint 2 pass; checkpoint 4 dies
            raise OSError("disk full")
        return real(tensors, path)

    monkeypatch.setattr(state, "save_file", crash_second)
    monkeypatch.setattr("elasticfw.model.adapter_files.save_file", crash_second)
    with pytest.raises(OSError):
        train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert (tmp_path / "checkpoints" / "step-000002" / "trainer_state.json").is_file()
    assert not (tmp_path / "checkpoints" / "step-000004").exists()


def test_training_mix_gradient_is_sparse_minus_retrieval_output(registry):
    """In the training forward, d O / d r = O_sparse − O_retrieval per KV-head group, with both
    outputs built independently: SDPA with a hand-made causal mask and a hand-made streaming
    window (token-exact: key j visible to i iff j <= i and (j < sink or j > i − local))."""
    from elasticfw.routing.base import RouterDecision

    sink, local = 3, 5
    section = validate_recipe_data({"elastic": {
        **TINY_ELASTIC,
        "sparse_mode": {"name": "streaming", "sink_tokens": sink, "local_tokens": local, "block_size": 16,
                        "granularity": "token"},
        "executor": {"name": "reference"},
    }}, registry=registry).elastic
    from elasticfw.model.elastic import ElasticModel

    elastic = ElasticModel(tiny_model("llama"), section, registry=registry).train()
    runtime = elastic.runtime
    torch.manual_seed(0)
    b, hq, hkv, s, d = 2, 6, 2, 24, 16
    q, k, v = torch.randn(b, hq, s, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    r = torch.tensor([[0.0, 1.0], [1.0, 0.0]], requires_grad=True)
    elastic.router.decide = lambda layer, keys, seq: RouterDecision(r, r)  # type: ignore[method-assign]
    out = runtime.attend(0, q, k, v, None, scale=d**-0.5, sliding_window=None)
    g = torch.randn_like(out)
    (out * g).sum().backward()

    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    causal = j <= i
    stream = causal & ((j < sink) | (j > i - local))
    kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    o_full = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=causal, scale=d**-0.5)
    o_stream = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=stream, scale=d**-0.5)
    per_q_head = (g * (o_stream - o_full)).sum((-1, -2))  # (b, hq)
    want = per_q_head.view(b, hkv, hq // hkv).sum(-1)
    assert torch.allclose(r.grad, want, atol=1e-4)
    # and the forward value is the routed mode of each group, exactly
    mask = r.detach().repeat_interleave(hq // hkv, 1)[:, :, None, None]
    assert torch.allclose(out.detach(), mask * o_stream + (1 - mask) * o_full, atol=1e-5)


def test_compare_runs_a_trained_adapter_like_the_trained_model(registry, tmp_path):
    """A compare variant naming the adapter routes each held-out prompt exactly as the trained
    elastic model did before it was saved."""
    from elasticfw.eval.rows import read_rows
    from elasticfw.eval.sweep import run_sweep

    recipe, model, mixture, elastic = _setup(registry, tmp_path / "run", steps=2)
    train_router(elastic, mixture, recipe.train, tmp_path / "run", seed=0, pad_id=0, progress=False)
    from training_helpers import RecallConfig, RecallTask

    samples = RecallTask(RecallConfig(num_samples=3)).samples(ByteTokenizer(), seed=0, split="eval")
    want = []
    with torch.no_grad():
        for s in samples:
            elastic(input_ids=torch.tensor([s.input_ids]))
            want.append(float(elastic.routing.msr[0]))
    data = tiny_train_recipe(tmp_path / "unused")
    data.pop("train")
    data["eval"] = {"task": {"name": "recall", "num_samples": 3}, "max_new_tokens": 2}
    data["compare"] = [{"label": "trained", "adapter": str(tmp_path / "run" / "adapter")}]
    out = run_sweep(validate_recipe_data(data, registry=registry), output=str(tmp_path / "sweep"), registry=registry,
                    progress=False, report=False)
    got = [row["msr"] for row in read_rows(out / "rows.jsonl")[0]]
    assert got == pytest.approx(want, abs=1e-6)
    bad = dict(data, compare=[{"label": "x", "adapter": str(tmp_path)}])
    with pytest.raises(RecipeError, match=r"compare.0.adapter = .*not an adapter folder"):
        validate_recipe_data(bad, registry=registry)


def test_resume_from_a_damaged_checkpoint_is_a_checkpoint_error(registry, tmp_path):
    recipe, _, mixture, elastic = _setup(registry, tmp_path, steps=2)
    train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    latest = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text().strip()
    for name in ("trainer_state.safetensors", "elastic_adapter.safetensors"):
        path = latest / name
        original = path.read_bytes()
        path.write_bytes(original[: len(original) // 2])  # a disk that filled up mid-write
        recipe, _, mixture, elastic = _setup(registry, tmp_path, steps=2)
        with pytest.raises(CheckpointError, match=rf"{name}: not a readable safetensors file"):
            train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False, resume=True)
        elastic.unwrap()
        path.write_bytes(original)


def test_resume_refuses_a_changed_schedule_and_tolerates_a_torn_metrics_line(registry, tmp_path):
    recipe, _, mixture, elastic = _setup(registry, tmp_path, steps=2)
    train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lm_lo')  # a write cut short by a crash
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    recipe, _, mixture, elastic = _setup(registry, tmp_path, steps=4)
    with pytest.raises(CheckpointError, match=r"trained with steps=2, the recipe now has 4"):
        train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False, resume=True)
    with pytest.raises(RecipeError, match=r"baselines.0.label"):
        validate_recipe_data(tiny_train_recipe(tmp_path, baselines=[{"label": "../x", "router": {"name": "static"}}]),
                             registry=registry)


def test_a_backbone_changed_in_place_during_training_is_reported(registry, tmp_path, monkeypatch):
    recipe, model, mixture, elastic = _setup(registry, tmp_path, steps=2)
    real = trainer_module._row

    def tamper(*args, **kwargs):
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)  # a bug that writes into the frozen weights
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "_row", tamper)
    with pytest.raises(TrainingError, match="the frozen backbone changed during training"):
        train_router(elastic, mixture, recipe.train, tmp_path, seed=0, pad_id=0, progress=False)
