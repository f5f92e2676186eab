"""Exception types. Every error elasticfw raises on purpose derives from :class:`ElasticError`.

Messages are written for the person who ran the command: they name the thing that is wrong
(recipe field path, plugin name, tensor argument), the value that was given and what was
expected, in one paragraph.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ElasticError(Exception):
    """Base class of every error elasticfw raises deliberately."""


class PluginError(ElasticError):
    """A plugin could not be loaded or registered."""


class PluginLoadError(PluginError):
    """An entry point of the ``elasticfw`` group failed to import."""


class DuplicatePluginError(PluginError):
    """Two plugins registered the same name for the same kind."""


class InvalidPluginError(PluginError):
    """A registered object does not follow the plugin contract of its kind."""


class UnknownPluginError(PluginError, KeyError):
    """A name was asked for that no plugin of that kind registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RecipeError(ElasticError):
    """A recipe could not be loaded, merged, overridden or validated."""


class UnsupportedInputError(ElasticError, ValueError):
    """Tensors or model features outside what a mode, executor or adapter supports."""


class BackendUnavailableError(ElasticError, RuntimeError):
    """A backend a recipe pins (an executor, a kernel) is not usable on this machine."""


class CheckpointError(ElasticError):
    """An adapter checkpoint is missing, malformed, or does not fit the base model."""


class TrainingError(ElasticError):
    """Training cannot go on (a non-finite loss, a run folder in the way, a mismatched resume)."""


def suggest(name: str, choices: Iterable[str]) -> str:
    """Return a "did you mean" phrase for ``name`` among ``choices`` (empty if none is close)."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""
