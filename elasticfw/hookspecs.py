"""Every extension point of elasticfw, in one place.

A plugin is a module (or any object) with functions decorated by :data:`hookimpl` whose names
match the hooks below. It reaches elasticfw through the ``elasticfw`` entry-point group, exactly
as the built-in plugins do::

    # pyproject.toml of a third-party package
    [project.entry-points.elasticfw]
    my_modes = "my_package.modes"

    # my_package/modes.py
    from elasticfw import hookimpl

    @hookimpl
    def elasticfw_register_sparse_modes(register):
        register(MyMode)

Every hook here is a *registration hook*: it receives a ``register`` callable and calls it once
per class it contributes. The registry checks the class against the contract of its kind (a
``name`` that is a snake_case string, a pydantic ``config_class`` whose ``name`` field is
``Literal[name]``, the kind's base class), records the distribution it came from, refuses a
duplicate name and, when something asks for an unknown name, lists what exists and suggests the
closest. The same snake_case string is the registry key, the plugin module's stem and the
recipe's ``name:``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "elasticfw"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[type[Any]], None]


@hookspec
def elasticfw_register_sparse_modes(register: Register) -> None:
    """Register attention modes: subclasses of :class:`elasticfw.attention.mode.AttentionMode`.

    A mode decides, per (batch, query head, query block), which key blocks a head computes,
    returning a :class:`elasticfw.attention.layout.BlockLayout` (optionally refined by a token
    mask, optionally with a side branch merged by log-sum-exp). Full attention is a mode like
    any other. Every registered mode is run through :mod:`elasticfw.testing.modes`, the
    conformance suite, by elasticfw's own tests.
    """


@hookspec
def elasticfw_register_executors(register: Register) -> None:
    """Register attention executors: subclasses of :class:`elasticfw.attention.executor.Executor`.

    An executor runs attention for all heads of a layer given one per-head block layout (one
    launch where the backend allows it) and returns the output and its log-sum-exp. It declares
    ``is_available()``; a recipe that pins an unavailable executor is an error, never a silent
    fallback.
    """


@hookspec
def elasticfw_register_routers(register: Register) -> None:
    """Register attention routers: subclasses of :class:`elasticfw.routing.base.Router`.

    A router decides, per input and per (layer, KV head), between the retrieval mode and the
    sparse mode. Learnable routers are ``torch.nn.Module`` s; their parameters are the only
    ones an elastic model trains and saves.
    """


@hookspec
def elasticfw_register_backbones(register: Register) -> None:
    """Register backbone adapters: subclasses of :class:`elasticfw.model.adapter.BackboneAdapter`.

    An adapter maps what differs between Hugging Face model families (which ``model_type`` s
    it serves, where the attention modules are, the head layout, sliding-window layers,
    features it cannot support). It never copies modeling code.
    """


@hookspec
def elasticfw_register_tasks(register: Register) -> None:
    """Register evaluation / training tasks: subclasses of :class:`elasticfw.eval.task.Task`.

    A task builds prompts with known answers (and, for needle tasks, the token span of the
    needle, used by retrieval-score calibration) and scores a generation.
    """


@hookspec
def elasticfw_register_models(register: Register) -> None:
    """Register model sources: subclasses of :class:`elasticfw.model.sources.ModelSource`.

    A model source resolves a short name used in recipes (``model: {name: smollm2-135m}``) to
    a loaded Hugging Face causal LM and tokenizer. Hub ids and local paths need no source.
    """
