"""The KV-cache argument's name differs across transformers 5.x (``past_key_values`` in 5.17,
``cache`` later): elasticfw takes either and passes the installed one's."""

from __future__ import annotations

import inspect

import pytest

from elasticfw.errors import UnsupportedInputError
from elasticfw.model.elastic import cache_argument, with_cache_argument


class _Old:
    def forward(self, input_ids=None, past_key_values=None, use_cache=None): ...


class _New:
    def forward(self, input_ids=None, cache=None, use_cache=None): ...


class _Neither:
    def forward(self, input_ids=None): ...


def test_the_name_is_read_from_the_signature():
    assert cache_argument(_Old()) == "past_key_values"  # type: ignore[arg-type]
    assert cache_argument(_New()) == "cache"  # type: ignore[arg-type]
    with pytest.raises(UnsupportedInputError, match="takes none of"):
        cache_argument(_Neither())  # type: ignore[arg-type]


def test_the_installed_transformers_takes_the_name_found():
    from transformers import LlamaForCausalLM

    assert cache_argument(LlamaForCausalLM) in inspect.signature(LlamaForCausalLM.forward).parameters  # type: ignore[arg-type]


@pytest.mark.parametrize("target", ["cache", "past_key_values"])
def test_either_name_reaches_the_target(target):
    other = "past_key_values" if target == "cache" else "cache"
    marker = object()
    assert with_cache_argument({other: marker, "x": 1}, target) == {target: marker, "x": 1}
    assert with_cache_argument({target: marker}, target) == {target: marker}
    assert with_cache_argument({other: None, "x": 1}, target) == {"x": 1}  # a None under the other name is dropped
    with pytest.raises(UnsupportedInputError, match="both"):
        with_cache_argument({target: marker, other: object()}, target)
