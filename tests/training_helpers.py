"""A byte-level tokenizer and two synthetic tasks for training tests on tiny random models.

``recall`` is sparsity-sensitive by construction (the answer is a token written near the start,
far outside a streaming window); ``repeat`` is robust (the answer repeats the token just before
the question).
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import Field

from elasticfw.eval.task import Sample, Split, Task, TaskConfig


class ByteTokenizer:
    """ids = UTF-8 bytes (a tiny model's 256-token vocabulary); 0 pads, 2 ends."""

    pad_token_id = 0
    eos_token_id = 2
    chat_template = None
    name_or_path = "byte-tokenizer"

    def __call__(self, text: str, add_special_tokens: bool = False, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": [b if b > 2 else 3 for b in text.encode("utf-8")]}

    def get_vocab(self) -> dict[str, int]:
        return {f"<{i}>": i for i in range(256)}

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        return bytes(i for i in ids if i > 2 or not skip_special_tokens).decode("utf-8", errors="replace")


class _SynthConfig(TaskConfig):
    context_tokens: int = Field(96, ge=16, le=4096, description="Prompt length in tokens (bytes).")


class RecallConfig(_SynthConfig):
    name: Literal["recall"] = "recall"


class RepeatConfig(_SynthConfig):
    name: Literal["repeat"] = "repeat"


class _Synth(Task):
    default_max_new_tokens = 2
    config: _SynthConfig

    def _sample(self, rng: random.Random) -> Sample:
        raise NotImplementedError

    def samples(self, tokenizer: Any, *, seed: int, split: Split = "eval") -> list[Sample]:
        rng = random.Random(f"{self.name}-{split}-{seed}")
        return [self._sample(rng) for _ in range(self.config.num_samples)]

    def score(self, sample: Sample, completion: str) -> float:
        return float(completion[:1] == sample.answer)


class RecallTask(_Synth):
    """key letter at the start, filler, then '?': answer the key."""

    name = "recall"
    config_class = RecallConfig
    category = "sensitive"

    def _sample(self, rng: random.Random) -> Sample:
        key = rng.choice("ABCDEFGH")
        filler = "".join(rng.choice("abcdefgh") for _ in range(self.config.context_tokens - 4))
        text = f"{key}:{filler}?"
        return Sample(list(text.encode()), key, (0, 1), target=key, answers=(key,), needle_spans=((0, 1),))


class RepeatTask(_Synth):
    """filler, then a letter and '=': answer the letter again."""

    name = "repeat"
    config_class = RepeatConfig
    category = "robust"

    def _sample(self, rng: random.Random) -> Sample:
        key = rng.choice("ABCDEFGH")
        filler = "".join(rng.choice("abcdefgh") for _ in range(self.config.context_tokens - 3))
        text = f"{filler}{key}="
        return Sample(list(text.encode()), key, target=key, answers=(key,))


class FixedPromptConfig(TaskConfig):
    name: Literal["fixed_prompt"] = "fixed_prompt"


class FixedPromptTask(Task):
    """One fixed prompt, no length to vary (a task without ``context_tokens``)."""

    name = "fixed_prompt"
    config_class = FixedPromptConfig

    def samples(self, tokenizer: Any, *, seed: int, split: Split = "eval") -> list[Sample]:
        return [Sample(list(b"A:abcdefgh?"), "A") for _ in range(self.config.num_samples)]

    def score(self, sample: Sample, completion: str) -> float:
        return float(completion[:1] == sample.answer)


class TinySource:
    """Model source plugin ``tiny-llama``: a tiny random Llama with the byte tokenizer."""

    name = "tiny-llama"

    def load(self, *, dtype: Any, device: Any) -> tuple[Any, Any]:
        from elasticfw.testing.models import tiny_model

        return tiny_model("llama", dtype=dtype).to(device), ByteTokenizer()

    def describe(self) -> str:
        return "tiny random llama (tests)"


class _Plugin:
    from elasticfw import hookimpl

    @staticmethod
    @hookimpl
    def elasticfw_register_tasks(register: Any) -> None:
        register(RecallTask)
        register(RepeatTask)
        register(FixedPromptTask)

    @staticmethod
    @hookimpl
    def elasticfw_register_models(register: Any) -> None:
        from elasticfw.model.sources import ModelSource

        register(type("TinyLlamaSource", (TinySource, ModelSource), {}))


def training_registry() -> Any:
    """The installed plugins plus the synthetic tasks and the tiny model source."""
    from elasticfw.registry import load_registry

    return load_registry(extra_plugins=[("tests.training_helpers", _Plugin)])


#: a small FA-SSA elastic section for tiny models (the tasks' answers lie outside the window)
TINY_ELASTIC: dict[str, Any] = {
    "retrieval_mode": {"name": "full", "block_size": 16},
    "sparse_mode": {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16},
    "executor": {"name": "sdpa"},
    "router": {"name": "mlp", "pool_tokens": 8},
}


#: three modes for the tiny models (48-token prompts); moba's and streaming's costs given in the recipe
THREE_MODES: list[dict[str, Any]] = [
    {"name": "full", "block_size": 16},
    {"name": "moba", "moba_block_size": 16, "top_k": 2, "block_size": 16, "cost": 0.5},
    {"name": "streaming", "sink_tokens": 16, "local_tokens": 16, "block_size": 16, "cost": 0.2},
]


def three_mode_train_recipe(tmp_dir: Any, cost_targets: dict[str, Any], router: dict[str, Any] | None = None,
                            context_tokens: int = 48, **train: Any) -> dict[str, Any]:
    """:func:`tiny_train_recipe` among :data:`THREE_MODES` under ``train.constraint: cost``, with
    prompts of ``context_tokens`` and static gates unless ``router`` is given."""
    data = tiny_train_recipe(tmp_dir, constraint="cost", **train)
    data["train"]["cost_targets"] = cost_targets
    for entry in data["train"]["tasks"]:
        entry["task"]["context_tokens"] = context_tokens
    data["elastic"] = {"modes": THREE_MODES, "executor": {"name": "sdpa"}, "router": router or {"name": "static"}}
    return data


def tiny_train_recipe(tmp_dir: Any, **train: Any) -> dict[str, Any]:
    """Recipe data: tiny model, both synthetic tasks, a few steps."""
    settings = {
        "tasks": [
            {"task": {"name": "recall", "num_samples": 16}, "eval_samples": 4},
            {"task": {"name": "repeat", "num_samples": 16}, "eval_samples": 4},
        ],
        "steps": 4,
        "batch_size": 4,
        "micro_batch_size": 2,
        "checkpoint_every": 2,
        "output_dir": str(tmp_dir),
        "evaluate": False,
    }
    settings.update(train)
    return {"model": {"name": "tiny-llama", "device": "cpu"}, "elastic": TINY_ELASTIC, "train": settings}


def route_items(elastic: Any, items: list[Any]) -> None:
    """One no-grad forward of training items (``task.items``) as the trainer collates them, routing
    each prompt by its own length; the routing is then in ``elastic.runtime.decisions`` and
    ``elastic.routing``."""
    import torch

    from elasticfw.training.data import collate

    batch = collate(items, 0)
    elastic.runtime.route_lengths = batch.route_lengths
    try:
        with torch.no_grad():
            elastic(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp_min(0), use_cache=False)
    finally:
        elastic.runtime.route_lengths = None


def tiny_training_setup(registry: Any, data: dict[str, Any], model: Any = None) -> tuple[Any, list[Any], Any]:
    """(recipe, task mixture, elastic model) of recipe ``data`` on a tiny Llama (or ``model``) with the
    byte tokenizer, ready for ``train_router``."""
    from elasticfw.model.loading import make_elastic
    from elasticfw.recipe import validate_recipe_data
    from elasticfw.testing.models import tiny_model
    from elasticfw.training.run import build_mixture

    recipe = validate_recipe_data(data, registry=registry)
    model, tok = model or tiny_model("llama"), ByteTokenizer()
    mixture = build_mixture(recipe, tok, model, registry)
    return recipe, mixture, make_elastic(model, tok, recipe.elastic, registry=registry)
