"""RULER variable tracking (Hsieh et al., 2024, arXiv 2404.06654, §3.2 "multi-hop tracing").

Chains of assignments are hidden in prose: ``VAR QWERT = 12345.`` then ``VAR ASDFG = VAR QWERT.``
and so on, ``num_hops`` times; other chains with other values distract. The model must list every
variable that ends up holding the asked value. Scored with RULER's ``string_match_all`` (the
fraction of those variables named in the completion). Names and values are partitioned between
the ``train`` and ``eval`` splits by a stable hash, like the haystack paragraphs.
"""

from __future__ import annotations

import random
import string
from typing import ClassVar, Literal

from pydantic import Field

from elasticfw.eval.corpus import draw_for_split
from elasticfw.eval.task import Split
from elasticfw_plugins.tasks.ruler import CorpusConfig, Draft, RulerTask, number

INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text."
FIRST = "VAR {name} = {value}."
HOP = "VAR {name} = VAR {previous}."
QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
NAME_LETTERS = 5


def variable_name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(NAME_LETTERS))


class VariableTrackingConfig(CorpusConfig):
    name: Literal["variable_tracking"] = "variable_tracking"
    prefix_fields: ClassVar[frozenset[str]] = frozenset({"count", "value"})

    num_chains: int = Field(1, ge=1, le=16, description="Chains of assignments; one is asked for, the others distract.")
    num_hops: int = Field(4, ge=1, le=32, description="Assignments copying a variable per chain (the chain has num_hops+1 variables).")
    value_digits: int = Field(5, ge=4, le=12, description="Digits of each chain's value (haystack text never holds 4+ digit runs).")
    answer_prefix: str = Field(
        "According to the chain(s) of variable assignment in the text above, {count} variables are assigned "
        "the value {value}, they are:", max_length=1000,
        description="Assistant text placed before generation; {value} is the asked value, {count} the number of answers.",
    )

    def fixed_texts(self) -> list[str]:
        value = "9" * self.value_digits
        statements = [FIRST.format(name="QWERT", value=value)] + [HOP.format(name="QWERT", previous="ASDFG")] * self.num_hops
        prefix = self.answer_prefix.replace("{count}", str(self.num_hops + 1)).replace("{value}", value)
        return [INTRO, QUESTION.format(value=value), prefix, *statements * self.num_chains]

    def needles_phrase(self) -> str:
        return f"{self.num_chains} chain(s) of {self.num_hops + 1} assignments"


class VariableTrackingTask(RulerTask):
    """RULER variable_tracking: follow chains of VAR X = VAR Y assignments; list every variable holding a value."""

    name = "variable_tracking"
    config_class = VariableTrackingConfig
    config: VariableTrackingConfig
    default_max_new_tokens = 36

    @property
    def max_new_tokens(self) -> int:
        configured = self.config.max_new_tokens
        return configured if configured is not None else 6 * (self.config.num_hops + 1) + 6

    def draft(self, rng: random.Random, split: Split, depth: float | None) -> Draft:
        cfg = self.config
        names: set[str] = set()
        values: set[str] = set()
        chains: list[tuple[str, list[str]]] = []
        for _ in range(cfg.num_chains):
            value = draw_for_split(rng, number(cfg.value_digits), split, values)
            chains.append((value, [draw_for_split(rng, variable_name, split, names) for _ in range(cfg.num_hops + 1)]))
        statements: list[list[tuple[float, str]]] = []
        for value, chain in chains:
            depths = sorted(rng.uniform(cfg.depth_min, cfg.depth_max) for _ in chain)
            texts = [FIRST.format(name=chain[0], value=value)]
            texts += [HOP.format(name=name, previous=previous) for previous, name in zip(chain, chain[1:])]
            statements.append(list(zip(depths, texts)))
        value, chain = chains[0]
        return Draft(
            INTRO,
            [item for chain_statements in statements for item in chain_statements],
            QUESTION.format(value=value),
            {"value": value, "count": str(len(chain))},
            tuple(chain),
            " " + ", ".join(chain) + ".",
            [text for _, text in statements[0]],
            [text for chain_statements in statements[1:] for _, text in chain_statements],
            meta={"value": value, "depths": [d for d, _ in statements[0]],
                  "distractor_values": [v for v, _ in chains[1:]]},
        )
