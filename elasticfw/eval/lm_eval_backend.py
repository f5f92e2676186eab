"""The lm-evaluation-harness backend: any lm-eval task on an elastic model, with its routing.

    elasticfw lm-eval --recipe R [--adapter DIR] [--elastic-override KEY=VALUE ...] <lm-eval args>
    lm_eval --model elasticfw --model_args recipe=R,adapter=DIR ...   # after register()

:func:`register` defines ``ElasticLM`` (a ``lm_eval.api.model.TemplateLM``) and registers it as
``"elasticfw"`` (reading ``ElasticLM`` from this module does the same). It is built from
``model_args`` (``recipe``, ``adapter``, ``overrides``, ``batch_size``, ``max_length``,
``max_gen_toks``, ``device``) or from a model in memory (``ElasticLM.from_model``). Requests run in
padded batches; one that does not fit the context window is refused
(:class:`~elasticfw.errors.UnsupportedInputError`), never cut. Every prefill's routing (MSR, ESR) is
recorded and reported in ``results["config"]["elasticfw_routing"]``. Importing this module imports
neither lm-eval nor torch. Details: ``docs/explanation/design-notes.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticfw.errors import BackendUnavailableError, ElasticError, RecipeError, UnsupportedInputError

if TYPE_CHECKING:
    import torch

MODEL_NAME = "elasticfw"
REQUEST_TYPES = ("loglikelihood", "loglikelihood_rolling", "generate_until")
MODEL_ARGS = ("recipe", "adapter", "overrides", "batch_size", "max_length", "max_gen_toks", "device", "max_batch_size")


class RoutingStats:
    """MSR / ESR of every sequence the elastic model prefilled, per lm-eval request type."""

    def __init__(self) -> None:
        self.rows: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in REQUEST_TYPES}

    def add(self, kind: str, routing: Any, rows: int) -> None:
        for i in range(rows):
            self.rows[kind].append(
                (float(routing.msr[i]), float(routing.esr[i]), float(routing.esr_last_layer[i]))
            )

    def summary(self) -> dict[str, dict[str, float]]:
        """{request type: {sequences, msr, esr, esr_last_layer}} (means), plus ``all``."""
        out: dict[str, dict[str, float]] = {}
        everything = [row for kind in REQUEST_TYPES for row in self.rows[kind]]
        for kind, rows in [*((k, self.rows[k]) for k in REQUEST_TYPES), ("all", everything)]:
            if rows:
                n = len(rows)
                out[kind] = {
                    "sequences": n,
                    "msr": sum(r[0] for r in rows) / n,
                    "esr": sum(r[1] for r in rows) / n,
                    "esr_last_layer": sum(r[2] for r in rows) / n,
                }
        return out

    def table(self) -> str:
        head = f"{'request type':<24} {'sequences':>9} {'MSR':>6} {'ESR':>6} {'ESR(last)':>9}"
        lines = [head, "-" * len(head)]
        for kind, s in self.summary().items():
            lines.append(
                f"{kind:<24} {int(s['sequences']):>9d} {s['msr']:>6.3f} {s['esr']:>6.3f} {s['esr_last_layer']:>9.3f}"
            )
        return "\n".join(lines)


def _int_arg(name: str, value: Any, *, low: int = 1) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number < low or (isinstance(value, float) and value != number):
        raise UnsupportedInputError(f"lm-eval model_args {name}={value!r}: expected an integer >= {low}")
    return number


def _overrides(value: Any) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise UnsupportedInputError(f"lm-eval model_args overrides={value!r}: expected a list of dotted.key=value strings")


class ElasticLMBase:
    """An elastic model as an lm-eval language model (lm-eval model name ``"elasticfw"``).

    The lm-eval class is ``ElasticLM`` = this class + ``lm_eval.api.model.TemplateLM``
    (:func:`register`); lm-eval's TemplateLM tokenises (context, continuation) pairs exactly as
    its Hugging Face backend does, this class scores and generates.
    """

    backend = "causal"
    cache_hook: Any  # set by lm_eval.api.model.LM.__init__

    if TYPE_CHECKING:  # provided by lm_eval.api.model.TemplateLM (tokenises, then calls _loglikelihood_tokens)
        def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]: ...

    def __init__(
        self,
        recipe: str | None = None,
        adapter: str | None = None,
        overrides: Any = None,
        batch_size: Any = 1,
        max_length: Any = None,
        max_gen_toks: Any = 256,
        device: str | None = None,
        max_batch_size: Any = None,
        *,
        elastic: Any = None,
        tokenizer: Any = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        global _LAST_BACKEND
        if unknown:
            raise UnsupportedInputError(
                f"lm-eval model_args {', '.join(sorted(unknown))}: not understood by the elasticfw backend; it "
                f"takes {', '.join(MODEL_ARGS)}"
            )
        if str(batch_size).startswith("auto") or max_batch_size is not None:
            raise UnsupportedInputError(
                "lm-eval --batch_size auto (and --max_batch_size, which only applies to it) is not supported by "
                "elasticfw; give an integer batch size"
            )
        self._batch_size = _int_arg("batch_size", batch_size)
        self._max_gen_toks = _int_arg("max_gen_toks", max_gen_toks)
        self.routing_stats = RoutingStats()
        self.info: dict[str, Any] = {}
        if elastic is None:
            if recipe is None:
                raise UnsupportedInputError(
                    "the elasticfw lm-eval backend needs model_args recipe=PATH (an elasticfw recipe), or, in "
                    "Python, ElasticLM.from_model(elastic_model, tokenizer)"
                )
            elastic, tokenizer = self._load(str(recipe), adapter, _overrides(overrides), device)
        else:
            if tokenizer is None:
                raise UnsupportedInputError("ElasticLM.from_model needs the model's tokenizer")
            from elasticfw.model.elastic import ElasticModel

            if not isinstance(elastic, ElasticModel):
                raise UnsupportedInputError(
                    f"ElasticLM.from_model needs an elastic model (elasticfw.model.loading.make_elastic), got "
                    f"{type(elastic).__name__}"
                )
            self.info = {"base_model": getattr(elastic, "base_model_name", None), "in_memory": True}
        self.elastic = elastic
        self.tokenizer = tokenizer
        self._device = next(elastic.base.parameters()).device
        import torch

        wanted = torch.device(device) if device is not None else None
        if wanted is not None and (wanted.type != self._device.type or wanted.index not in (None, self._device.index)):
            raise UnsupportedInputError(
                f"lm-eval --device {device}: the model is on {self._device}; choose the device in the recipe "
                "(model.device) or move the model before wrapping it"
            )
        from elasticfw.eval.task import context_window

        window = context_window(elastic.base)
        if max_length is None:
            if window is None:
                raise UnsupportedInputError(
                    "the model's config declares no max_position_embeddings: give model_args max_length=N"
                )
            self._max_length = window
        else:
            self._max_length = _int_arg("max_length", max_length, low=2)
            if window is not None and self._max_length > window:
                raise UnsupportedInputError(
                    f"lm-eval model_args max_length={self._max_length} exceeds the model's context window "
                    f"({window} tokens, max_position_embeddings)"
                )
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self._pad_id is None:
            raise UnsupportedInputError("the tokenizer has neither a pad nor an eos token; batches cannot be padded")
        _LAST_BACKEND = self

    @classmethod
    def from_model(cls, elastic: Any, tokenizer: Any, **kwargs: Any) -> Any:
        """The backend over an elastic model already in memory (``batch_size``, ``max_length``,
        ``max_gen_toks`` as in ``model_args``)."""
        return cls(elastic=elastic, tokenizer=tokenizer, **kwargs)

    def _load(self, recipe_path: str, adapter: str | None, overrides: list[str], device: str | None) -> tuple[Any, Any]:
        from elasticfw.model.loading import load_model, make_elastic
        from elasticfw.recipe import load_recipe
        from elasticfw.registry import get_registry

        registry = get_registry()
        if device is not None:
            overrides = [*overrides, f"model.device={device}"]
        if adapter is not None and any(o.startswith("elastic.") for o in overrides):
            raise UnsupportedInputError(
                f"--elastic-override {[o for o in overrides if o.startswith('elastic.')]} with adapter={adapter!r}: "
                "the adapter carries its own elastic section (elastic_config.json); drop the elastic.* overrides"
            )
        recipe = load_recipe(recipe_path, overrides, registry=registry)
        model, tokenizer = load_model(recipe.model, registry=registry)
        if adapter is not None:
            from elasticfw.model.checkpoint import load_adapter

            elastic = load_adapter(model, adapter, registry=registry, base_model=recipe.model.name)
        else:
            elastic = make_elastic(model, tokenizer, recipe.elastic, registry=registry,
                                   base_model_name=recipe.model.name, seed=recipe.seed)
        self.info = {"recipe": recipe_path, "adapter": adapter, "overrides": overrides, "base_model": recipe.model.name,
                     "elastic": elastic.elastic_config.model_dump(mode="json")}
        return elastic, tokenizer

    # -- what lm-eval asks of a model ----------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or "elasticfw").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string`` (the tokenizer's own special-token rule unless told; never a
        second BOS when the text already starts with it)."""
        options: dict[str, Any] = {}
        if add_special_tokens is not None:
            options["add_special_tokens"] = add_special_tokens
        elif self.tokenizer.bos_token and string.startswith(self.tokenizer.bos_token):
            options["add_special_tokens"] = False
        return list(self.tokenizer.encode(string, **options))

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
            )
        )

    def get_model_info(self) -> dict[str, Any]:
        """Added by lm-eval to ``results["config"]`` after the run: the routing means per request type."""
        from elasticfw import __version__

        return {"elasticfw": {**self.info, "version": __version__}, "elasticfw_routing": self.routing_stats.summary()}

    # -- scoring -------------------------------------------------------------------------------
    def _forward(self, rows: list[list[int]], kind: str, route_lengths: list[int] | None = None) -> torch.Tensor:
        """Logits (B, T, V) of a right-padded batch; records the batch's routing. ``route_lengths``:
        each row's leading tokens the router decides on (``None``: all of them)."""
        import torch

        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        runtime = self.elastic.runtime
        if route_lengths is not None:
            runtime.route_lengths = torch.tensor(route_lengths, dtype=torch.long, device=self._device)
        try:
            with torch.no_grad():
                logits = self.elastic(input_ids=ids.to(self._device), attention_mask=mask.to(self._device),
                                      use_cache=False).logits
        finally:
            runtime.route_lengths = None
        self.routing_stats.add(kind, self.elastic.routing, len(rows))
        return logits

    def _too_long(self, need: int, what: str, text: str | None) -> UnsupportedInputError:
        shown = f" (prompt starting {text[:60]!r})" if text else ""
        return UnsupportedInputError(
            f"an lm-eval request needs {need} tokens{shown}: {what}, but the model's context window is "
            f"{self._max_length} tokens (max_length); elasticfw refuses rather than cutting the prompt's left end. "
            "Use a task with shorter prompts, fewer few-shot examples or fewer generated tokens"
        )

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
        kind: str = "loglikelihood", **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding yields it) for
        each (key, context tokens, continuation tokens)."""
        import torch

        results: list[tuple[float, bool] | None] = [None] * len(requests)
        todo = []
        for i, (key, context, continuation) in enumerate(requests):
            if not continuation:
                results[i] = (0.0, True)
                continue
            need = len(context) + len(continuation) - 1  # the last token is predicted, never fed
            if need > self._max_length:
                text = key[0] if isinstance(key, tuple) and key and isinstance(key[0], str) else None
                raise self._too_long(need, f"{len(context)} context + {len(continuation)} continuation - 1", text)
            todo.append(i)
        todo.sort(key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))  # similar lengths share a batch
        for first in range(0, len(todo), self._batch_size):
            chunk = todo[first : first + self._batch_size]
            rows = [(requests[i][1] + requests[i][2])[:-1] for i in chunk]
            # a choice is scored under its context's routing, as generation would route that prompt:
            # the router never sees the candidate answers, so every choice of a question is scored
            # under one routing (a rolling window's "context" is a token or two: it routes on all)
            routes = [len(requests[i][1]) for i in chunk] if kind == "loglikelihood" else None
            logits = self._forward(rows, kind, routes)
            for row, i in enumerate(chunk):
                key, _, continuation = requests[i]
                end = len(rows[row])
                # position t predicts token t + 1: the last len(continuation) real positions score it
                scored = torch.log_softmax(logits[row, end - len(continuation) : end].float(), dim=-1)
                target = torch.tensor(continuation, device=scored.device)
                total = float(scored.gather(-1, target[:, None]).sum())
                greedy = bool((scored.argmax(-1) == target).all())
                results[i] = (total, greedy)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, (total, greedy))
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise ElasticError(f"internal error: loglikelihood requests {missing} were not scored")
        return [r for r in results if r is not None]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts, in lm-eval's disjoint rolling windows of ``max_length``
        tokens (the first conditioned on the prefix token)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows: list[tuple[Any, list[int], list[int]]] = []
        owner: list[int] = []
        for n, request in enumerate(requests):
            (text,) = request.args
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length, context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owner.append(n)
        scores = self._loglikelihood_tokens(windows, kind="loglikelihood_rolling")
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, scores):
            totals[n] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generation ------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Generate (greedy unless the request samples) until a stop sequence, EOS or
        ``max_gen_toks``; the text is cut before the first stop sequence."""
        from lm_eval.models.utils import (
            handle_stop_sequences,
            normalize_gen_kwargs,
            postprocess_generated_text,
        )
        from lm_eval.models.utils_hf import stop_sequences_criteria

        results: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        encoded = []
        for i, request in enumerate(requests):
            context, gen_kwargs = request.args
            if not isinstance(gen_kwargs, dict):
                raise UnsupportedInputError(f"generate_until: generation kwargs must be a dict, got {gen_kwargs!r}")
            encoded.append(self.tok_encode(context))
            groups.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        for members in groups.values():
            kwargs: dict[str, Any] = dict(normalize_gen_kwargs(dict(requests[members[0]].args[1]), self._max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = int(kwargs.pop("max_gen_toks"))
            if "max_length" in kwargs:
                raise UnsupportedInputError("generate_until: use max_gen_toks, not max_length, in generation kwargs")
            if not kwargs.get("do_sample"):
                kwargs.pop("temperature", None)
            for i in members:
                if len(encoded[i]) + max_new > self._max_length:
                    raise self._too_long(len(encoded[i]) + max_new, f"{len(encoded[i])} prompt + {max_new} generated",
                                         requests[i].args[0])
            members = sorted(members, key=lambda i: -len(encoded[i]))
            for first in range(0, len(members), self._batch_size):
                chunk = members[first : first + self._batch_size]
                texts = self._generate([encoded[i] for i in chunk], until, max_new, kwargs, stop_sequences_criteria)
                for i, text in zip(chunk, texts):
                    results[i] = postprocess_generated_text(text, until, None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
        return results

    def _generate(self, prompts: list[list[int]], until: list[str], max_new: int, kwargs: dict[str, Any],
                  criteria: Any) -> list[str]:
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        with torch.no_grad():
            out = self.elastic.generate(
                input_ids=ids.to(self._device), attention_mask=mask.to(self._device), max_new_tokens=max_new,
                stopping_criteria=criteria(self.tokenizer, until, width, len(prompts)), pad_token_id=self._pad_id,
                **kwargs,
            )
        self.routing_stats.add("generate_until", self.elastic.routing, len(prompts))
        return [self.tok_decode(out[i, width:].tolist()) for i in range(len(prompts))]


_CLASS: type[ElasticLMBase] | None = None
_LAST_BACKEND: ElasticLMBase | None = None


def register() -> type[ElasticLMBase]:
    """Define ``ElasticLM`` (``ElasticLMBase`` + lm-eval's ``TemplateLM``) and register it with
    lm-eval as ``"elasticfw"``; idempotent."""
    global _CLASS
    if _CLASS is None:
        try:
            from lm_eval.api.model import TemplateLM
            from lm_eval.api.registry import register_model
        except ModuleNotFoundError as exc:
            raise BackendUnavailableError(
                f"the lm-eval backend needs lm-evaluation-harness ({exc}); pip install 'elasticfw[lmeval]'"
            ) from None
        cls: type[ElasticLMBase] = type(
            "ElasticLM", (ElasticLMBase, TemplateLM), {"__module__": __name__, "__doc__": ElasticLMBase.__doc__}
        )
        _CLASS = register_model(MODEL_NAME)(cls)
    return _CLASS


def __getattr__(name: str) -> Any:
    if name == "ElasticLM":
        return register()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def last_backend() -> ElasticLMBase | None:
    """The backend built most recently in this process (the CLI prints its routing)."""
    return _LAST_BACKEND


# -- command line ---------------------------------------------------------------------------------

USAGE = """\
Runs lm-evaluation-harness on the recipe's elastic model: lm-eval's own arguments (after `--`)
go to `lm-eval run` unchanged, with --model elasticfw --model_args {recipe, adapter, overrides}
filled in. Routing means (MSR, ESR per request type) are printed after lm-eval's table and stored
in the results JSON under config.elasticfw_routing.

  elasticfw lm-eval --recipe recipes/quickstart.yaml -- --tasks hellaswag --limit 20 --batch_size 4
"""


def lm_eval_argv(recipe: str, adapter: str | None, overrides: Sequence[str], lm_eval_args: Sequence[str]) -> list[str]:
    """The ``lm-eval`` command line (without the program name) that runs ``recipe``."""
    args = [a for a in lm_eval_args if a != "--"]  # the separator of `elasticfw lm-eval ... -- <lm-eval args>`
    if args[:1] == ["run"]:
        args = args[1:]
    for flag in ("--model", "-M"):
        if flag in args or any(a.startswith(flag + "=") for a in args):
            raise UnsupportedInputError(f"lm-eval argument {flag}: elasticfw lm-eval sets --model {MODEL_NAME} itself")
    if not Path(recipe).expanduser().is_file():
        raise RecipeError(f"--recipe {recipe!r}: no such file")
    model_args: dict[str, Any] = {"recipe": str(Path(recipe).expanduser().resolve())}
    if adapter is not None:
        model_args["adapter"] = str(Path(adapter).expanduser().resolve())
    if overrides:
        model_args["overrides"] = list(overrides)
    if not any(a == "--device" or a.startswith("--device=") for a in args):
        # lm-eval would send its own default (cuda:0) to the model: send the recipe's device instead
        from elasticfw.model.loading import resolve_device
        from elasticfw.recipe import load_recipe

        args += ["--device", str(resolve_device(load_recipe(recipe, list(overrides)).model.device))]
    return ["run", "--model", MODEL_NAME, "--model_args", json.dumps(model_args), *args]


def run_lm_eval(recipe: str, *, adapter: str | None = None, overrides: Sequence[str] = (),
                lm_eval_args: Sequence[str] = ()) -> int:
    """``lm-eval run`` through its own command line, with the elasticfw model; prints the routing."""
    argv = lm_eval_argv(recipe, adapter, overrides, lm_eval_args)
    register()
    from lm_eval.__main__ import cli_evaluate

    global _LAST_BACKEND
    _LAST_BACKEND = None
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    backend = last_backend()
    if backend is not None and backend.routing_stats.summary():
        print("\nelasticfw routing (mean per sequence):\n" + backend.routing_stats.table(), flush=True)
    return 0


def _cmd_lm_eval(args: argparse.Namespace) -> int:
    return run_lm_eval(args.recipe, adapter=args.adapter, overrides=args.elastic_override,
                       lm_eval_args=args.lm_eval_args)


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, help="elasticfw recipe: its model and elastic sections")
    parser.add_argument("--adapter", help="trained adapter directory (its elastic section replaces the recipe's)")
    parser.add_argument("--elastic-override", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe override, dotted.key=value (repeatable), e.g. elastic.sparse_mode.sink_tokens=64")


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``lm-eval`` to the ``elasticfw`` subcommands. lm-eval's own arguments follow ``--``
    (or ``run``); :func:`main` also takes them without a separator."""
    p = subparsers.add_parser(
        "lm-eval", help="run lm-evaluation-harness tasks on the recipe's elastic model",
        description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_options(p)
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval run arguments (after --)")
    p.set_defaults(func=_cmd_lm_eval)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``elasticfw lm-eval`` arguments (without the subcommand): ours anywhere, the rest to lm-eval."""
    parser = argparse.ArgumentParser(prog="elasticfw lm-eval", description=USAGE, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_options(parser)
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return run_lm_eval(args.recipe, adapter=args.adapter, overrides=args.elastic_override, lm_eval_args=rest)
    except ElasticError as exc:
        print(f"elasticfw: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
