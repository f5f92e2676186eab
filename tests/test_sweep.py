"""`elasticfw compare` as a sweep: rows per sample, resume, failures, the run folder, the recipe
section, and two processes giving the rows of one."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sweep_helpers import tiny_sweep_recipe
from training_helpers import (
    ByteTokenizer,
    RecallConfig,
    RecallTask,
    RepeatConfig,
    RepeatTask,
    training_registry,
)

from elasticfw.errors import RecipeError
from elasticfw.eval import sweep as sweep_module
from elasticfw.eval.rows import read_rows, row_key
from elasticfw.eval.sweep import SweepError, run_sweep
from elasticfw.recipe import validate_recipe_data
from elasticfw.testing.models import tiny_model

WORKER = Path(__file__).parent / "sweep_worker.py"
#: per-sample results that do not depend on timing
STABLE = ("score", "msr", "esr", "completion", "decisions", "tokens", "answer", "category", "metric")


@pytest.fixture(scope="module")
def registry():
    return training_registry()


def _sweep(registry, out, *, report=False, **kw):
    recipe = validate_recipe_data(tiny_sweep_recipe(out, **kw.pop("sweep", {})), registry=registry)
    return run_sweep(recipe, registry=registry, progress=False, report=report, **kw)


def _rows(out: Path) -> dict[tuple, dict]:
    rows, torn = read_rows(out / "rows.jsonl")
    assert not torn
    keyed = {row_key(r): r for r in rows}
    assert len(keyed) == len(rows), "a sample was written twice"
    return keyed


def _stable(rows: dict[tuple, dict]) -> dict[tuple, dict]:
    return {k: {f: r[f] for f in STABLE} for k, r in rows.items()}


def _plain_greedy(model, ids: list[int], new_tokens: int) -> str:
    """Greedy decoding of the unmodified backbone, step by step without a cache: the reference."""
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = model(input_ids=seq).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    return ByteTokenizer().decode(seq[0, len(ids) :].tolist())


@pytest.fixture(scope="module")
def finished(registry, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "run"
    _sweep(registry, out)
    return out


def test_every_cell_and_sample_is_a_row_with_its_routing_and_timing(finished):
    rows = _rows(finished)
    # 3 variants x 2 tasks x 2 lengths x 1 seed x 3 samples
    assert len(rows) == 36
    assert {k[:4] for k in rows} == {(v, t, n, 0) for v in ("full", "stream", "mlp") for t in ("recall", "rep")
                                     for n in (40, 72)}
    cfg = tiny_model("llama").config
    for (variant, task, length, _, _), r in rows.items():
        assert r["category"] == ("sensitive" if task == "recall" else "robust")
        assert len(r["decisions"]) == cfg.num_hidden_layers == len(r["routed_layers"])
        assert all(len(layer) == cfg.num_key_value_heads for layer in r["decisions"])
        flat = [d for layer in r["decisions"] for d in layer]
        assert r["msr"] == pytest.approx(sum(flat) / len(flat))
        if variant == "full":
            assert set(flat) == {0} and r["esr"] == 0
        if variant == "stream":
            # a 16-sink + 32-local window covers all 39 tokens at length 40: nothing is skipped there
            assert set(flat) == {1} and (r["esr"] > 0) == (length == 72)
        assert r["tokens"] == length - 1  # the synthetic tasks write context_tokens - 1 bytes
        # the prefill is the first forward of generate(); the decode steps come after it
        assert 0 < r["prefill_seconds"] <= r["batch_prefill_seconds"] < r["generate_seconds"]
        assert r["attempt"] == 0
        assert r["batch_tokens"] == r["batch_size"] * (length - 1)
    # batches of 2 then 1 (batch_size 2, 3 samples): equal lengths share a batch's prefill time equally
    a, b, c = (rows[("mlp", "recall", 72, 0, i)] for i in range(3))
    assert a["batch_prefill_seconds"] == b["batch_prefill_seconds"] and (a["batch_size"], c["batch_size"]) == (2, 1)
    assert a["prefill_seconds"] == pytest.approx(a["batch_prefill_seconds"] / 2)
    assert c["prefill_seconds"] == pytest.approx(c["batch_prefill_seconds"])


def test_full_attention_rows_match_the_plain_backbone(finished):
    """The `full` variant's completions and scores equal greedy decoding of the unmodified model."""
    rows = _rows(finished)
    model, tok = tiny_model("llama"), ByteTokenizer()
    for length in (40, 72):
        for label, task in (("recall", RecallTask(RecallConfig(num_samples=3, context_tokens=length))),
                            ("rep", RepeatTask(RepeatConfig(num_samples=3, context_tokens=length)))):
            for i, sample in enumerate(task.samples(tok, seed=0, split="eval")):
                row = rows[("full", label, length, 0, i)]
                want = _plain_greedy(model, sample.input_ids, task.max_new_tokens)
                assert row["completion"] == want
                assert row["score"] == task.score(sample, want)
                assert row["answer"] == sample.answer


def test_resume_after_a_kill_recomputes_nothing_and_loses_nothing(registry, finished, tmp_path, monkeypatch):
    calls: list[int] = []
    real = sweep_module.generate_batch

    def killed_after(n):
        def fake(*args, **kwargs):
            if len(calls) == n:
                raise KeyboardInterrupt  # like a kill: nothing catches it
            calls.append(len(args[3]))
            return real(*args, **kwargs)
        return fake

    out = tmp_path / "run"
    monkeypatch.setattr(sweep_module, "generate_batch", killed_after(7))
    with pytest.raises(KeyboardInterrupt):
        _sweep(registry, out)
    written = sum(calls)
    assert len(_rows(out)) == written == 11  # 2+1 per full-variant cell: 3 cells, then one batch of 2
    with (out / "rows.jsonl").open("a") as f:
        f.write('{"variant": "mlp", "task": "re')  # the kill cut a write short
    calls.clear()
    monkeypatch.setattr(sweep_module, "generate_batch", killed_after(10**6))
    _sweep(registry, out, resume=True)
    assert sum(calls) == 36 - written  # only the missing samples
    assert _stable(_rows(out)) == _stable(_rows(finished))  # the same rows as an uninterrupted sweep
    calls.clear()
    _sweep(registry, out, resume=True)
    assert calls == []  # a finished sweep resumes to nothing
    meta = json.loads((out / "sweep.json").read_text())
    assert [a["processes"] for a in meta["attempts"]] == [1, 1, 1] and meta["attempts"][1]["environment"]["device"] == "cpu"
    assert {r["attempt"] for r in _rows(out).values()} == {0, 1}  # the third attempt had nothing to do


def test_a_failing_variant_leaves_the_other_rows_and_fails_at_the_end(registry, finished, tmp_path, monkeypatch):
    real = sweep_module.generate_batch

    def fails_for_stream(elastic, *args, **kwargs):
        if elastic.elastic_config.router.assign == "all_sparse":
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(elastic, *args, **kwargs)

    def build_fails_for_mlp(variant, *args, **kwargs):
        if variant.label == "mlp":
            raise ValueError("router weights missing (simulated)")
        return real_build(variant, *args, **kwargs)

    real_build = sweep_module._build
    out = tmp_path / "run"
    monkeypatch.setattr(sweep_module, "generate_batch", fails_for_stream)
    monkeypatch.setattr(sweep_module, "_build", build_fails_for_mlp)
    with pytest.raises(SweepError, match=r"5 failure\(s\).*stream/recall@40.*failures.jsonl"):
        _sweep(registry, out)
    rows = _rows(out)
    assert {k[0] for k in rows} == {"full"} and len(rows) == 12
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert [(f["variant"], f["task"], f["length"]) for f in failures] == [
        ("stream", "recall", 40), ("stream", "recall", 72), ("stream", "rep", 40), ("stream", "rep", 72),
        ("mlp", None, None)]
    assert "simulated" in failures[0]["error"] and "Traceback" in failures[0]["traceback"]
    # a stopped sweep: the first failure ends it
    monkeypatch.setattr(sweep_module, "generate_batch", fails_for_stream)
    with pytest.raises(SweepError, match=r"1 failure\(s\)"):
        _sweep(registry, tmp_path / "stop", sweep={"on_error": "stop"})
    # fixed, the resumed sweep computes the rest and forgets the old failures
    monkeypatch.setattr(sweep_module, "generate_batch", real)
    monkeypatch.setattr(sweep_module, "_build", real_build)
    _sweep(registry, out, resume=True)
    assert _stable(_rows(out)) == _stable(_rows(finished))
    assert not (out / "failures.jsonl").exists()


def test_a_router_that_fails_to_prepare_leaves_the_model_unwrapped(registry, monkeypatch):
    from elasticfw.model.loading import make_elastic

    model, tok = tiny_model("llama"), ByteTokenizer()
    recipe = validate_recipe_data(tiny_sweep_recipe("unused"), registry=registry)
    router_cls = registry.get("router", "mlp")

    def broken(self, *a, **k):
        raise ValueError("calibration failed")

    monkeypatch.setattr(router_cls, "prepare", broken)
    with pytest.raises(ValueError, match="calibration failed"):
        make_elastic(model, tok, recipe.compare[2].elastic, registry=registry)
    assert not getattr(model, "_elasticfw_wrapped", False)
    make_elastic(model, tok, recipe.compare[0].elastic, registry=registry).unwrap()  # usable again


def test_the_run_folder_is_checked_before_any_work(registry, finished, tmp_path, monkeypatch):
    monkeypatch.setattr(sweep_module, "load_model", lambda *a, **k: pytest.fail("no model may be loaded"))
    with pytest.raises(SweepError, match=r"already holds a sweep; pass --resume.*--overwrite"):
        _sweep(registry, finished)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(SweepError, match=r"holds files a sweep did not write \(notes.txt\)"):
        _sweep(registry, foreign, overwrite=True)
    assert (foreign / "notes.txt").read_text() == "mine"
    with pytest.raises(SweepError, match=r"--resume.*holds no sweep"):
        _sweep(registry, tmp_path / "empty", resume=True)
    with pytest.raises(SweepError, match="exclude one another"):
        _sweep(registry, tmp_path / "x", resume=True, overwrite=True)
    # a resumed sweep whose variant changed under the same label would mix two methods in one row set
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy)
    data = tiny_sweep_recipe(copy)
    data["compare"][1]["elastic"]["sparse_mode"] = {"name": "streaming", "sink_tokens": 16, "local_tokens": 16,
                                                    "block_size": 16}
    before = (copy / "rows.jsonl").read_bytes()
    with pytest.raises(SweepError, match=r"changed the variant 'stream'"):
        run_sweep(validate_recipe_data(data, registry=registry), registry=registry, resume=True, report=False)
    with pytest.raises(SweepError, match=r"changed the generation settings"):
        _sweep(registry, copy, resume=True, sweep={"batch_size": 3})
    with pytest.raises(SweepError, match=r"changed the task 'rep'"):
        _sweep(registry, copy, resume=True, sweep={"tasks": [{"task": {"name": "recall", "num_samples": 3}},
                                                             {"task": {"name": "repeat", "num_samples": 4},
                                                              "label": "rep"}]})
    assert (copy / "rows.jsonl").read_bytes() == before
    # a kill during an atomic write leaves a temporary file: still a sweep folder, and it is cleaned
    (copy / ".table.md.tmp-123").write_text("half")
    monkeypatch.undo()
    _sweep(registry, copy, resume=True)
    assert not (copy / ".table.md.tmp-123").exists()


def test_overwrite_and_explicit_cells_with_warmup(registry, finished, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "sweep.json").write_text("{}")
    (out / "rows.jsonl").write_text('{"stale": 1}\n')
    _sweep(registry, out, overwrite=True, report=True,
           sweep={"cells": [{"variant": "stream", "task": "rep", "length": 40}], "warmup": True})
    rows = _rows(out)
    # the warm-up generate writes no row and changes no result
    assert {k[:4] for k in rows} == {("stream", "rep", 40, 0)} and len(rows) == 3
    assert _stable(rows) == {k: v for k, v in _stable(_rows(finished)).items() if k in rows}
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["lengths"] == [40] and meta["seeds"] == [0]  # the cells', not the grid's
    assert "Context length 72" not in (out / "table.md").read_text()


def test_a_row_that_lost_its_newline_is_mended_before_appending(finished, tmp_path):
    from elasticfw.eval.rows import repair_rows
    from elasticfw.jsonl import append_jsonl

    path = tmp_path / "rows.jsonl"
    rows = list(_rows(finished).values())[:3]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + json.dumps(rows[2]))  # no final newline
    assert repair_rows(path) == rows
    append_jsonl(path, [rows[0]])
    assert read_rows(path) == ([*rows, rows[0]], False)


def test_a_cell_whose_samples_cannot_be_built_fails_alone(registry, finished, tmp_path):
    # 2000-byte prompts do not fit the tiny model's 1024-token window: those cells fail, the others run
    out = tmp_path / "run"
    with pytest.raises(SweepError, match=r"3 failure\(s\).*full/recall@2000"):
        _sweep(registry, out, sweep={"lengths": [40, 2000], "tasks": [{"task": {"name": "recall", "num_samples": 3}}]})
    rows = _rows(out)
    assert {k[:3] for k in rows} == {(v, "recall", 40) for v in ("full", "stream", "mlp")}
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert {(f["variant"], f["length"]) for f in failures} == {(v, 2000) for v in ("full", "stream", "mlp")}
    assert "context window is 1024 tokens" in failures[0]["error"]


def test_adapter_variants_are_described_by_the_adapter(registry, finished, tmp_path):
    """An adapter runs its own elastic section: sweep.json says so, and a retrained adapter under the
    same label is refused on resume."""
    from elasticfw.model.loading import make_elastic

    model, tok = tiny_model("llama"), ByteTokenizer()
    recipe = validate_recipe_data(tiny_sweep_recipe("unused"), registry=registry)
    section = recipe.elastic.model_copy(update={
        "sparse_mode": recipe.elastic.sparse_mode.model_copy(update={"local_tokens": 16})})
    elastic = make_elastic(model, tok, section, registry=registry, seed=1)
    elastic.save_adapter(str(tmp_path / "adapter"))
    elastic.unwrap()
    data = tiny_sweep_recipe(tmp_path / "run", cells=[{"variant": "trained", "task": "recall", "length": 40}])
    data["compare"].append({"label": "trained", "adapter": str(tmp_path / "adapter")})
    _sweep_data = validate_recipe_data(data, registry=registry)
    run_sweep(_sweep_data, registry=registry, progress=False, report=False)
    meta = json.loads((tmp_path / "run" / "sweep.json").read_text())
    spec = meta["definition"]["variants"]["trained"]
    assert spec["elastic"]["sparse_mode"]["local_tokens"] == 16 and len(spec["adapter_sha256"]) == 64
    make_elastic(model, tok, section, registry=registry, seed=2).save_adapter(str(tmp_path / "adapter"),
                                                                              overwrite=True)  # retrained
    with pytest.raises(SweepError, match=r"changed the variant 'trained'"):
        run_sweep(validate_recipe_data(data, registry=registry), registry=registry, progress=False, report=False,
                  resume=True)


def test_a_resume_that_adds_a_variant_keeps_the_reference_and_the_rows(registry, tmp_path):
    out = tmp_path / "run"
    cells = [{"variant": "stream", "task": "rep", "length": 40}, {"variant": "full", "task": "rep", "length": 40}]
    data = tiny_sweep_recipe(out, cells=cells)
    data["compare"] = data["compare"][1:]  # stream first: the default reference is the first variant
    data["compare"].append({"label": "full", "elastic": {"router": {"name": "fixed", "assign": "all_retrieval"}}})
    data["compare"].pop(1)  # no mlp
    run_sweep(validate_recipe_data(data, registry=registry), registry=registry, progress=False, report=False)
    before = _rows(out)
    data["compare"].insert(0, {"label": "mlp", "elastic": {}})
    data["sweep"]["cells"].append({"variant": "mlp", "task": "rep", "length": 40})
    run_sweep(validate_recipe_data(data, registry=registry), registry=registry, progress=False, report=False,
              resume=True)
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["reference"] == "stream"  # not the new first variant
    assert [v["label"] for v in meta["variants"]] == ["mlp", "stream", "full"]
    after = _rows(out)
    assert {k: after[k] for k in before} == before and {k[0] for k in after} == {"mlp", "stream", "full"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"reference": "ful"}, r"sweep.reference = 'ful': not a compare label \(did you mean 'full'\?"),
        ({"cells": [{"variant": "full", "task": "recal"}]}, r"sweep.cells.0.task = 'recal': not a sweep task label"),
        ({"cells": [{"variant": "dense", "task": "rep"}]}, r"sweep.cells.0.variant = 'dense'"),
        ({"lengths": [8]}, r"sweep.lengths: 8 is not a valid context_tokens for task 'recall'"),
        ({"lengths": [40, 40]}, r"sweep.lengths.*lists 40 twice"),
        ({"tasks": [{"task": {"name": "recall"}}, {"task": {"name": "recall"}}]}, r"both labelled 'recall'"),
        ({"batch_size": 0}, r"sweep.batch_size = 0"),
        ({"padding_side": "right"}, r"sweep.padding_side = 'right' with batch_size > 1"),
        ({"cells": [{"variant": "full", "task": "rep", "length": 40},
                    {"variant": "full", "task": "rep", "length": 40, "seed": 0}]},
         r"sweep.cells.1 repeats sweep.cells.0 \(full, rep, length 40, seed 0\)"),
    ],
)
def test_bad_sweep_sections_fail_at_validation_naming_the_field(registry, change, message):
    with pytest.raises(RecipeError, match=message):
        validate_recipe_data(tiny_sweep_recipe("x", **change), registry=registry)


def test_lengths_need_tasks_with_a_context_length(registry):
    data = tiny_sweep_recipe("x", tasks=[{"task": {"name": "fixed_prompt"}, "label": "const"}])
    with pytest.raises(RecipeError, match=r"task 'const' \(fixed_prompt\) has no context_tokens"):
        validate_recipe_data(data, registry=registry)
    data = tiny_sweep_recipe("x")
    data["compare"].append(dict(data["compare"][0]))
    with pytest.raises(RecipeError, match=r"compare: two variants are both labelled 'full'"):
        validate_recipe_data(data, registry=registry)
    data = tiny_sweep_recipe("x")
    data.pop("compare")  # valid for `elasticfw eval` (the recipe's own section), not for `compare`
    with pytest.raises(RecipeError, match=r"compare: the recipe has no `compare:` list"):
        run_sweep(validate_recipe_data(data, registry=registry), registry=registry)


def test_a_recipe_without_sweep_runs_its_eval_task(registry, tmp_path):
    data = tiny_sweep_recipe(tmp_path)
    data.pop("sweep")
    data["eval"] = {"task": {"name": "recall", "num_samples": 2, "context_tokens": 40}, "batch_size": 2}
    run_sweep(validate_recipe_data(data, registry=registry), output=str(tmp_path / "run"), registry=registry,
              progress=False, report=False)
    rows = _rows(tmp_path / "run")
    assert {k[:4] for k in rows} == {(v, "recall", None, 0) for v in ("full", "stream", "mlp")}


@pytest.mark.slow
def test_two_processes_write_the_rows_of_one(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for cmd in ([sys.executable, str(WORKER), str(one)],
                [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                 f"--master_port={port}", str(WORKER), str(two)]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    a, b = _rows(one), _rows(two)
    assert len(a) == 36 and _stable(a) == _stable(b)
    # batches are cut by sample index, whatever the number of processes: the same batch sizes
    assert {k: r["batch_size"] for k, r in a.items()} == {k: r["batch_size"] for k, r in b.items()}
    # rank 0 wrote every row in sample order within each cell
    order = [row_key(r) for r in read_rows(two / "rows.jsonl")[0]]
    assert order == sorted(order, key=lambda k: (["full", "stream", "mlp"].index(k[0]), ["recall", "rep"].index(k[1]),
                                                 k[2], k[3], k[4]))
    assert json.loads((two / "sweep.json").read_text())["attempts"][0]["processes"] == 2
