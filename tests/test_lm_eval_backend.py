"""The lm-evaluation-harness backend on a tiny random Llama with an offline BPE tokenizer.

Independent definitions: a second, unwrapped copy of the same model (same seed, same weights)
gives the reference log-likelihoods (log-softmax summed over the continuation tokens, one
unpadded sequence at a time), greedy generations (``model.generate`` on one unpadded prompt,
cut at the first stop sequence), and multiple-choice accuracy (arg max of those
log-likelihoods); the routing means are checked against the elastic model run on each sequence
alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from elasticfw.errors import UnsupportedInputError
from elasticfw.eval import lm_eval_backend
from elasticfw.model.elastic import ElasticModel
from elasticfw.model.loading import resolve_device
from elasticfw.recipe import validate_recipe_data
from elasticfw.testing.models import tiny_model

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

VOCAB = 320
CORPUS = [
    "Question: what is the capital of France? Answer: Paris. The quick brown fox jumps over the lazy dog.",
    "Read the following text and answer briefly. The cat sat on the mat, and the dog sat on the log.",
] * 20
MODES = {
    "retrieval_mode": {"name": "full", "block_size": 16},
    "sparse_mode": {"name": "streaming", "sink_tokens": 16, "local_tokens": 16, "block_size": 16},
    "executor": {"name": "sdpa"},
}
FULL = {"name": "fixed", "assign": "all_retrieval"}
MIXED = {"name": "fixed", "assign": "sparse_heads", "heads": [[0, 0], [2, 1], [3, 0]]}


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def section(router: dict[str, Any]) -> Any:
    return validate_recipe_data({"elastic": {**MODES, "router": router}}).elastic


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="module")
def plain() -> Any:
    return tiny_model("llama", vocab_size=VOCAB)


def elastic_model(router: dict[str, Any] = FULL) -> ElasticModel:
    return ElasticModel(tiny_model("llama", vocab_size=VOCAB), section(router))


@pytest.fixture(scope="module")
def lm(tok: PreTrainedTokenizerFast) -> Any:
    return lm_eval_backend.register().from_model(elastic_model(), tok, batch_size=3)


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tok.encode(text))


def reference_logprob(model: Any, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """log p(continuation | context) from one unpadded forward of the plain model."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    rows = logp[len(context) - 1 : len(context) + len(continuation) - 1]
    target = torch.tensor(continuation)
    return float(rows[torch.arange(len(continuation)), target].sum()), bool((rows.argmax(-1) == target).all())


def split_pair(tok: PreTrainedTokenizerFast, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's documented rule: trailing spaces of the context move to the continuation; the
    continuation is what the whole text adds to the context's tokens; an empty context is BOS."""
    if not context:
        return [tok.bos_token_id], encode(tok, continuation)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    ctx = encode(tok, context)
    return ctx, encode(tok, context + continuation)[len(ctx) :]


def requests(kind: str, args: list[tuple[Any, ...]]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]  # type: ignore[arg-type]


def greedy(model: Any, tok: PreTrainedTokenizerFast, prompt: str, n: int) -> str:
    ids = torch.tensor([encode(tok, prompt)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return str(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


PAIRS = [
    ("Question: what is the capital of France? Answer:", " Paris."),
    ("The quick brown fox jumps over the ", "lazy dog"),  # trailing space moves to the continuation
    ("", "The cat sat on the mat."),  # empty context: BOS
    ("Read the following text and answer briefly. " * 6 + "The dog", " sat on the log, and the cat sat on the mat."),
    ("a", "b"),
]


# -- scoring ---------------------------------------------------------------------------------------


def test_loglikelihood_equals_a_plain_forward(lm: Any, plain: Any, tok: PreTrainedTokenizerFast) -> None:
    # one continuation that greedy decoding does produce: is_greedy must say so
    ctx = "The cat sat on the"
    ctx_ids = encode(tok, ctx)
    with torch.no_grad():
        nxt = int(plain(input_ids=torch.tensor([ctx_ids])).logits[0, -1].argmax())
    pairs = [*PAIRS, (ctx, str(tok.decode([nxt])))]
    assert split_pair(tok, *pairs[-1])[1] == [nxt]
    got = lm.loglikelihood(requests("loglikelihood", pairs))
    for (context, continuation), (logprob, is_greedy) in zip(pairs, got):
        want, want_greedy = reference_logprob(plain, *split_pair(tok, context, continuation))
        assert logprob == pytest.approx(want, abs=1e-4), (context, continuation)
        assert is_greedy == want_greedy
    assert got[-1][1] is True and not all(g for _, g in got)
    one_by_one = lm_eval_backend.register().from_model(lm.elastic, tok, batch_size=1)
    assert [r[0] for r in one_by_one.loglikelihood(requests("loglikelihood", pairs))] == pytest.approx(
        [r[0] for r in got], abs=1e-5
    )


def test_rolling_loglikelihood_in_windows(lm: Any, plain: Any, tok: PreTrainedTokenizerFast) -> None:
    text = " ".join(CORPUS[:2])
    tokens = encode(tok, text)
    assert len(tokens) > 60
    whole = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    assert whole[0] == pytest.approx(reference_logprob(plain, [tok.bos_token_id], tokens)[0], abs=2e-4)
    # windows of m tokens: tokens [0, m) after BOS, then chunks [s, s + m) each fed the m tokens
    # before its end (the last chunk keeps a full window of context)
    m = 24
    small = lm_eval_backend.register().from_model(lm.elastic, tok, batch_size=2, max_length=m)
    want = reference_logprob(plain, [tok.bos_token_id], tokens[:m])[0]
    start = m
    while start < len(tokens):
        end = min(start + m, len(tokens))
        window = tokens[max(end - m - 1, 0) : end]
        context_len = len(window) - (end - start)
        want += reference_logprob(plain, window[:context_len], window[context_len:])[0]
        start = end
    assert small.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))[0] == pytest.approx(want, abs=2e-4)


# -- generation ------------------------------------------------------------------------------------


def test_generate_until_equals_greedy_generate(lm: Any, plain: Any, tok: PreTrainedTokenizerFast) -> None:
    prompts = [c for c, _ in PAIRS if c] + ["The"]
    free = [greedy(plain, tok, p, 12) for p in prompts]
    assert all(len(text) >= 6 for text in free)
    stops = [[text[3:5]] for text in free[:2]] + [["\n\n"]] * (len(prompts) - 2)  # two prompts really stop
    args = [(p, {"until": stop, "max_gen_toks": 12, "do_sample": False}) for p, stop in zip(prompts, stops)]
    got = lm.generate_until(requests("generate_until", args))
    for text, stop, out in zip(free, stops, got):
        assert out == text.split(stop[0])[0]
    assert len(got[0]) <= 3 and len(got[1]) <= 3  # cut at their stop sequence
    lengths = lm.generate_until(requests("generate_until", [(prompts[0], {"until": ["\n\n"], "max_gen_toks": 4})]))
    assert lengths == [greedy(plain, tok, prompts[0], 4).split("\n\n")[0]]


def test_prompts_beyond_the_context_window_are_refused(lm: Any, tok: PreTrainedTokenizerFast) -> None:
    short = lm_eval_backend.register().from_model(lm.elastic, tok, max_length=20)
    long_context = "The quick brown fox jumps over the lazy dog. " * 3
    assert len(encode(tok, long_context)) > 20
    with pytest.raises(UnsupportedInputError, match=r"needs \d+ tokens .*context window is 20 tokens"):
        short.loglikelihood(requests("loglikelihood", [(long_context, " x")]))
    prompt = "The quick brown fox"  # fits, but not with 32 generated tokens
    with pytest.raises(UnsupportedInputError, match=r"prompt \+ 32 generated, but the model's context window is 20"):
        short.generate_until(requests("generate_until", [(prompt, {"until": ["."], "max_gen_toks": 32})]))
    with pytest.raises(UnsupportedInputError, match="exceeds the model's context window"):
        lm_eval_backend.register().from_model(lm.elastic, tok, max_length=4096)


def test_routing_is_collected_per_request_type(tok: PreTrainedTokenizerFast) -> None:
    elastic = elastic_model(MIXED)
    lm = lm_eval_backend.register().from_model(elastic, tok, batch_size=2)
    lm.loglikelihood(requests("loglikelihood", PAIRS))
    lm.generate_until(requests("generate_until", [(c, {"until": ["."], "max_gen_toks": 3}) for c, _ in PAIRS[:2]]))
    # the same sequences run alone through the elastic model
    esr = []
    for context, continuation in PAIRS:
        ctx, cont = split_pair(tok, context, continuation)
        with torch.no_grad():
            elastic(input_ids=torch.tensor([(ctx + cont)[:-1]]))
        esr.append(float(elastic.routing.esr[0]))
    info = lm.get_model_info()
    stats = info["elasticfw_routing"]
    assert stats["loglikelihood"]["sequences"] == len(PAIRS) and stats["generate_until"]["sequences"] == 2
    assert stats["loglikelihood"]["msr"] == pytest.approx(3 / 8)  # 3 of 4 layers x 2 KV heads sparse
    assert stats["loglikelihood"]["esr"] == pytest.approx(sum(esr) / len(esr), abs=1e-6)
    assert len(set(esr)) > 1 and stats["all"]["sequences"] == len(PAIRS) + 2
    assert "elasticfw" in info and "generate_until" in lm.routing_stats.table()
    full = lm_eval_backend.register().from_model(elastic_model(FULL), tok)
    full.loglikelihood(requests("loglikelihood", PAIRS[:2]))
    assert full.get_model_info()["elasticfw_routing"]["loglikelihood"]["esr"] == 0.0


# -- lm-eval itself --------------------------------------------------------------------------------


@pytest.fixture
def task_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    mc = [{"question": q, "choices": ["Paris", "the lazy dog", "on the mat"], "label": i % 3}
          for i, q in enumerate(["What is the capital of France?", "Who jumps?", "Where did the cat sit?", "And?"])]
    gen = [{"prompt": p, "target": "x"} for p in ("The quick brown", "Question: what is", "The cat sat")]
    (tasks / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    (tasks / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gen))
    (tasks / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: \"{{label}}\"\ndoc_to_choice: \"{{choices}}\"\nmetric_list:\n  - metric: acc\n"
    )
    (tasks / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'gen.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{target}}\"\n"
        "generation_kwargs:\n  until: [\".\"]\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return tasks


def expected_mc_accuracy(plain: Any, tok: PreTrainedTokenizerFast, docs: Path) -> float:
    right = 0
    rows = [json.loads(line) for line in docs.read_text().splitlines()]
    for r in rows:
        context = f"Question: {r['question']}\nAnswer:"
        scores = [reference_logprob(plain, *split_pair(tok, context, " " + c))[0] for c in r["choices"]]
        right += int(max(range(len(scores)), key=scores.__getitem__) == r["label"])
    return right / len(rows)


def test_simple_evaluate_with_a_local_task(plain: Any, tok: PreTrainedTokenizerFast, task_dir: Path) -> None:
    from lm_eval.tasks import TaskManager

    lm = lm_eval_backend.register().from_model(elastic_model(), tok, batch_size=2)
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    results = lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc", "tiny_gen"], task_manager=manager, log_samples=True)
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(expected_mc_accuracy(plain, tok, task_dir / "mc.jsonl"))
    for sample in results["samples"]["tiny_gen"]:
        prompt = sample["doc"]["prompt"]
        assert sample["resps"][0][0] == greedy(plain, tok, prompt, 6).split(".")[0]
    routing = results["config"]["elasticfw_routing"]
    assert routing["generate_until"]["sequences"] == 3 and routing["loglikelihood"]["sequences"] == 4 * 3


def test_recipe_adapter_and_command_line(tmp_path: Path, tok: PreTrainedTokenizerFast, plain: Any, task_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import functools

    import lm_eval.tasks

    checkpoint = tmp_path / "tiny"
    tiny_model("llama", vocab_size=VOCAB).save_pretrained(checkpoint)
    tok.save_pretrained(checkpoint)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({"model": {"name": str(checkpoint), "device": "cpu"},
                                  "elastic": {**MODES, "router": FULL}}))
    cls = lm_eval_backend.register()
    from_recipe = cls(recipe=str(recipe), batch_size="2")
    pair = requests("loglikelihood", [PAIRS[0]])
    assert from_recipe.loglikelihood(pair)[0][0] == pytest.approx(
        reference_logprob(plain, *split_pair(tok, *PAIRS[0]))[0], abs=1e-4)
    sparse = cls(recipe=str(recipe), overrides=["elastic.router.assign=all_sparse"])
    sparse.loglikelihood(pair)
    assert sparse.get_model_info()["elasticfw_routing"]["loglikelihood"]["msr"] == 1.0
    # a trained adapter brings its own elastic section
    adapter_model = ElasticModel(tiny_model("llama", vocab_size=VOCAB), section({"name": "mlp", "pool_tokens": 4}))
    adapter_model.save_adapter(str(tmp_path / "adapter"))
    with_adapter = cls(recipe=str(recipe), adapter=str(tmp_path / "adapter"))
    assert with_adapter.elastic.router.name == "mlp" and with_adapter.get_model_info()["elasticfw"]["adapter"]
    with pytest.raises(UnsupportedInputError, match="the adapter carries its own elastic section"):
        cls(recipe=str(recipe), adapter=str(tmp_path / "adapter"), overrides=["elastic.router.assign=all_sparse"])
    with pytest.raises(UnsupportedInputError, match="pretrained: not understood by the elasticfw backend"):
        cls(recipe=str(recipe), pretrained="gpt2")
    with pytest.raises(UnsupportedInputError, match="needs model_args recipe=PATH"):
        cls()
    # the command line: our options anywhere, everything else to `lm-eval run` (the task index is
    # limited to the test's tasks to keep this fast; lm-eval's CLI itself is unchanged)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                        functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    out = tmp_path / "out"
    code = lm_eval_backend.main(["--tasks", "tiny_mc", "--recipe", str(recipe), "--include_path", str(task_dir),
                                 "--elastic-override", "elastic.router.assign=all_sparse", "--output_path", str(out),
                                 "--batch_size", "2"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "tiny_mc" in printed and "elasticfw routing" in printed and "loglikelihood" in printed
    (saved,) = out.rglob("results_*.json")
    config = json.loads(saved.read_text())["config"]
    assert config["elasticfw_routing"]["loglikelihood"]["msr"] == 1.0 and config["model"] == "elasticfw"
    assert lm_eval_backend.main(["--recipe", str(recipe), "--model", "hf", "--tasks", "tiny_mc"]) == 2
    assert "sets --model elasticfw itself" in capsys.readouterr().err


def test_cli_wiring_takes_lm_eval_arguments_after_a_separator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="elasticfw")
    lm_eval_backend.add_cli(parser.add_subparsers(dest="command", required=True))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("{}")
    args = parser.parse_args(["lm-eval", "--recipe", str(recipe), "--elastic-override", "seed=3", "--", "--tasks", "t",
                              "--limit", "2"])
    seen: dict[str, Any] = {}
    monkeypatch.setattr(lm_eval_backend, "run_lm_eval", lambda recipe, **kw: seen.update(recipe=recipe, **kw) or 0)
    assert args.func(args) == 0
    assert seen["overrides"] == ["seed=3"]
    argv = lm_eval_backend.lm_eval_argv(seen["recipe"], seen["adapter"], seen["overrides"], seen["lm_eval_args"])
    assert argv[:4] == ["run", "--model", "elasticfw", "--model_args"]
    # lm-eval would pass its default device (cuda:0) to the model: the recipe's goes instead
    assert argv[5:] == ["--tasks", "t", "--limit", "2", "--device", str(resolve_device("auto"))]
    assert json.loads(argv[4]) == {"recipe": str(recipe.resolve()), "overrides": ["seed=3"]}
    explicit = lm_eval_backend.lm_eval_argv(str(recipe), None, [], ["run", "--device=cpu", "--tasks", "t"])
    assert explicit[5:] == ["--device=cpu", "--tasks", "t"] and json.loads(explicit[4]) == {"recipe": str(recipe.resolve())}


def test_importing_the_backend_module_does_not_import_lm_eval_or_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, elasticfw.eval.lm_eval_backend as m; "
            "assert not {'lm_eval', 'torch'} & set(sys.modules), sorted({'lm_eval', 'torch'} & set(sys.modules)); "
            "print(m.MODEL_NAME)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "elasticfw", done.stderr


def test_choices_are_scored_under_their_contexts_routing(tok: PreTrainedTokenizerFast) -> None:
    """The router decides on the context alone, as generation routes a prompt: every choice of a
    question is scored under one routing, never one that saw the candidate answer. The answer it
    must equal: a model with a fixed router holding the context's own decisions."""
    torch.manual_seed(0)
    elastic = ElasticModel(tiny_model("llama", vocab_size=VOCAB),
                           section({"name": "mlp", "pool_tokens": 2, "kernel": "eager"}))
    context = "Question: what is the capital of France? Answer:"
    choices = [" Paris.", " the lazy dog sat on the log, and the cat sat on the mat."]
    ctx = split_pair(tok, context, choices[0])[0]
    with torch.no_grad():  # KV head 0 of every layer just sparse on the context: an answer seen tips it
        elastic(input_ids=torch.tensor([ctx]))
        for i, layer in enumerate(elastic.router.layers):
            logits = elastic.runtime.decisions[i].logits[0, 0].float()
            layer.router_mlp[-1].bias[1] -= float(logits[1] - logits[0]) - 1e-4
        elastic(input_ids=torch.tensor([ctx]))
    decisions = elastic.routing.decisions[0].clone()  # (layers, KV heads) of the context alone
    lm = lm_eval_backend.register().from_model(elastic, tok, batch_size=2)
    got = lm.loglikelihood(requests("loglikelihood", [(context, c) for c in choices]))
    # the candidate answers alone would route otherwise (else this test could not fail)
    with torch.no_grad():
        elastic(input_ids=torch.tensor([(ctx + split_pair(tok, context, choices[1])[1])[:-1]]))
    assert not torch.equal(elastic.routing.decisions[0], decisions)
    heads = [[layer, h] for layer in range(decisions.shape[0]) for h in range(decisions.shape[1])
             if decisions[layer, h]]
    fixed = ElasticModel(elastic.unwrap(), section({"name": "fixed", "assign": "sparse_heads", "heads": heads}
                                                   if heads else FULL))
    for choice, (logprob, is_greedy) in zip(choices, got):
        want, want_greedy = reference_logprob(fixed, *split_pair(tok, context, choice))
        assert logprob == pytest.approx(want, abs=1e-4)
        assert is_greedy == want_greedy
