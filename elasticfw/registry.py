"""Typed plugin registries, filled through pluggy from the ``elasticfw`` entry-point group.

Built-in plugins (``elasticfw_plugins``) arrive exactly like third-party ones: through
``importlib.metadata`` entry points. A plugin that fails to import is a loud
:class:`~elasticfw.errors.PluginLoadError` naming the entry point and its distribution; a
duplicate name raises :class:`~elasticfw.errors.DuplicatePluginError`; an unknown name raises
:class:`~elasticfw.errors.UnknownPluginError` listing what exists with a "did you mean".
"""

from __future__ import annotations

import importlib
import math
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pluggy
from pydantic import BaseModel, ConfigDict, Field, model_validator

from elasticfw import hookspecs
from elasticfw.errors import (
    DuplicatePluginError,
    InvalidPluginError,
    PluginError,
    PluginLoadError,
    UnknownPluginError,
    suggest,
)

ENTRY_POINT_GROUP = "elasticfw"
SNAKE = r"[a-z][a-z0-9_]*"


class PluginConfig(BaseModel):
    """Base of every plugin's recipe section: unknown keys are errors, values are validated.

    Subclasses declare ``name: Literal["their_name"] = "their_name"`` and their parameters
    with ``Field(description=...)``; the description is the single source of their docs.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @model_validator(mode="after")
    def _bounded_numbers(self) -> PluginConfig:
        """No plugin parameter is infinite, NaN, or an integer beyond 32 bits: such values pass the
        field's own bounds (``gt=0`` accepts inf) and fail much later, deep in a kernel."""
        for field_name in type(self).model_fields:
            for value in _numbers(getattr(self, field_name)):
                if isinstance(value, float) and not math.isfinite(value):
                    raise ValueError(f"{field_name} = {value!r}: must be a finite number")
                if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LIMIT:
                    raise ValueError(f"{field_name} = {_short(value)}: out of range (at most {INT_LIMIT} in magnitude)")
        return self


#: the largest integer a plugin parameter may hold (int32): token counts, block sizes, seeds ...
INT_LIMIT = 2**31 - 1


def _numbers(value: Any) -> Iterator[Any]:
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _numbers(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:10]}...{text[-4:]} ({len(text)} digits)"


@dataclass(frozen=True)
class KindSpec:
    """What a kind of plugin must look like."""

    kind: str
    hook: str
    base: str  # "module:Class" of the base class, imported lazily
    needs_config: bool = True
    name_pattern: str = SNAKE
    summary: str = ""

    def base_class(self) -> type:
        module, _, attr = self.base.partition(":")
        return getattr(importlib.import_module(module), attr)


KINDS: dict[str, KindSpec] = {
    spec.kind: spec
    for spec in (
        KindSpec(
            "sparse_mode",
            "elasticfw_register_sparse_modes",
            "elasticfw.attention.mode:AttentionMode",
            summary="attention modes (full and sparse)",
        ),
        KindSpec(
            "executor",
            "elasticfw_register_executors",
            "elasticfw.attention.executor:Executor",
            summary="attention executors (run per-head block layouts)",
        ),
        KindSpec(
            "router",
            "elasticfw_register_routers",
            "elasticfw.routing.base:Router",
            summary="attention routers",
        ),
        KindSpec(
            "backbone",
            "elasticfw_register_backbones",
            "elasticfw.model.adapter:BackboneAdapter",
            needs_config=False,
            summary="backbone adapters for Hugging Face model families",
        ),
        KindSpec(
            "task",
            "elasticfw_register_tasks",
            "elasticfw.eval.task:Task",
            summary="evaluation tasks",
        ),
        KindSpec(
            "model",
            "elasticfw_register_models",
            "elasticfw.model.sources:ModelSource",
            needs_config=False,
            name_pattern=r"[a-z0-9][a-z0-9_.\-]*",
            summary="short model names usable in recipes",
        ),
    )
}


@dataclass(frozen=True)
class PluginEntry:
    """One registered plugin class and where it came from."""

    kind: str
    name: str
    cls: type
    origin: str  # distribution (package) name, or "<runtime>" for in-process registration
    entry_point: str

    @property
    def config_class(self) -> type[PluginConfig] | None:
        return getattr(self.cls, "config_class", None)

    @property
    def summary(self) -> str:
        doc = (self.cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""


@dataclass
class Registry:
    """Name → plugin class, per kind. Build it with :func:`load_registry`."""

    _entries: dict[str, dict[str, PluginEntry]] = field(
        default_factory=lambda: {kind: {} for kind in KINDS}
    )
    #: bumped by every registration; the recipe schema built from this registry is cached per revision
    revision: int = 0

    # -- registration -------------------------------------------------------------------
    def register(self, kind: str, cls: type, *, origin: str = "<runtime>", entry_point: str = "") -> None:
        spec = _kind_spec(kind)
        name = getattr(cls, "name", None)
        where = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)
        if not isinstance(cls, type):
            raise InvalidPluginError(f"{kind} plugin {where} from {origin!r} must be a class, not an instance")
        if not isinstance(name, str) or not re.fullmatch(spec.name_pattern, name):
            raise InvalidPluginError(
                f"{kind} plugin {where} from {origin!r} has name {name!r}; expected a string matching "
                f"{spec.name_pattern!r} (the same string is the recipe's `name:`)"
            )
        base = spec.base_class()
        if not issubclass(cls, base):
            raise InvalidPluginError(
                f"{kind} plugin {name!r} ({where}) from {origin!r} must subclass "
                f"{base.__module__}.{base.__qualname__}"
            )
        if spec.needs_config:
            _check_config_class(kind, name, cls, origin)
        existing = self._entries[kind].get(name)
        if existing is not None:
            raise DuplicatePluginError(
                f"{kind} name {name!r} is registered twice: by {existing.origin!r} "
                f"({existing.cls.__module__}.{existing.cls.__qualname__}) and by {origin!r} ({where}); "
                "plugin names must be unique per kind — rename one of them"
            )
        self._entries[kind][name] = PluginEntry(kind, name, cls, origin, entry_point)
        self.revision += 1

    # -- lookup -------------------------------------------------------------------------
    def get(self, kind: str, name: str) -> type:
        return self.entry(kind, name).cls

    def entry(self, kind: str, name: str) -> PluginEntry:
        entries = self._entries[_kind_spec(kind).kind]
        if name not in entries:
            raise UnknownPluginError(unknown_name_message(kind, name, entries))
        return entries[name]

    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[_kind_spec(kind).kind])

    def entries(self, kind: str | None = None) -> Iterator[PluginEntry]:
        kinds = [kind] if kind is not None else list(KINDS)
        for k in kinds:
            for name in sorted(self._entries[k]):
                yield self._entries[k][name]

    def __contains__(self, key: tuple[str, str]) -> bool:
        kind, name = key
        return name in self._entries.get(kind, {})

    def config_union(self, kind: str) -> Any:
        """The discriminated union (on ``name``) of the config classes of ``kind``."""
        classes = [e.config_class for e in self.entries(kind) if e.config_class is not None]
        if not classes:
            raise UnknownPluginError(f"no {kind} plugin is registered; cannot build its recipe section")
        if len(classes) == 1:
            return classes[0]
        return Annotated[Union[tuple(classes)], Field(discriminator="name")]

    def make(self, kind: str, config: PluginConfig, **kwargs: Any) -> Any:
        """Instantiate the plugin ``config.name`` of ``kind`` with its validated config."""
        cls = self.get(kind, config.name)  # type: ignore[attr-defined]
        return cls(config, **kwargs)


def unknown_name_message(kind: str, name: str, known: Iterable[str]) -> str:
    known = sorted(known)
    listed = ", ".join(known) if known else "(none registered)"
    return (f"unknown {kind} {name!r}; {suggest(str(name), known)}registered {kind} names: {listed} (a plugin from "
            "a package that is not installed here? install it; `elasticfw plugins` lists what is)")


def _kind_spec(kind: str) -> KindSpec:
    if kind not in KINDS:
        raise UnknownPluginError(unknown_name_message("plugin kind", kind, KINDS))
    return KINDS[kind]


def _check_config_class(kind: str, name: str, cls: type, origin: str) -> None:
    config_class = getattr(cls, "config_class", None)
    if not (isinstance(config_class, type) and issubclass(config_class, PluginConfig)):
        raise InvalidPluginError(
            f"{kind} plugin {name!r} from {origin!r} needs a `config_class` subclassing "
            "elasticfw.registry.PluginConfig"
        )
    field_info = config_class.model_fields.get("name")
    annotation = field_info.annotation if field_info is not None else None
    if get_origin(annotation) is not Literal or get_args(annotation) != (name,):
        raise InvalidPluginError(
            f"{kind} plugin {name!r} from {origin!r}: {config_class.__qualname__}.name must be "
            f"declared as `name: Literal[{name!r}] = {name!r}`, found {annotation!r}"
        )


# ---------------------------------------------------------------------------------------
# Loading through pluggy and entry points
# ---------------------------------------------------------------------------------------


def _plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def _iter_entry_points() -> list[metadata.EntryPoint]:
    eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    # The same distribution can be visible twice (e.g. editable install + source tree on
    # sys.path); keep the first occurrence of each (name, value).
    seen: set[tuple[str, str]] = set()
    unique = []
    for ep in eps:
        key = (ep.name, ep.value)
        if key not in seen:
            seen.add(key)
            unique.append(ep)
    return unique


#: comma-separated distribution names whose elasticfw plugins are not loaded (a broken third-party
#: package need not block commands that do not use it)
DISABLE_ENV = "ELASTICFW_DISABLE_PLUGINS"


def _disabled_distributions() -> set[str]:
    import os

    return {d.strip() for d in os.environ.get(DISABLE_ENV, "").split(",") if d.strip()}


def _raised_at(exc: BaseException) -> str:
    """`` (raised at file.py:LINE in func)``: where the plugin's own code failed (CLI errors print
    no traceback)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" (raised at {last.filename}:{last.lineno} in {last.name})"


def load_registry(
    *, entry_points: bool = True, extra_plugins: Iterable[tuple[str, object]] = ()
) -> Registry:
    """Load every plugin and return a fresh :class:`Registry`.

    ``extra_plugins`` are ``(origin, plugin_object)`` pairs registered after the entry points
    (tests and notebooks use this; packages should declare an entry point). Registration hooks
    run in load order (entry points, then extras), so a duplicate name is reported against
    the plugin that registered it first.
    """
    pm = _plugin_manager()
    origins: dict[str, tuple[str, str]] = {}
    if entry_points:
        for ep in _iter_entry_points():
            dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
            where = f"elasticfw plugin entry point {ep.name!r} = {ep.value!r} from distribution {dist!r}"
            if dist in _disabled_distributions():
                continue
            try:
                module = ep.load()
            except Exception as exc:  # re-raised with the plugin named
                raise PluginLoadError(
                    f"{where} failed to import: {type(exc).__name__}: {exc}{_raised_at(exc)}. Fix or uninstall "
                    f"{dist!r}; elasticfw does not skip broken plugins silently (to run without it, set "
                    f"{DISABLE_ENV}={dist})"
                ) from exc
            plugin_name = f"{dist}:{ep.name}"
            if pm.is_registered(module):
                continue
            _register_plugin(pm, module, plugin_name, where)
            origins[plugin_name] = (dist, ep.name)
    for i, (origin, obj) in enumerate(extra_plugins):
        if pm.is_registered(obj):
            raise DuplicatePluginError(
                f"plugin {obj!r} from {origin!r} is already registered (through its entry point or given twice); "
                "register each plugin object once"
            )
        plugin_name = f"{origin}:extra{i}"
        _register_plugin(pm, obj, plugin_name, f"elasticfw plugin {obj!r} from {origin!r}")
        origins[plugin_name] = (origin, "")

    registry = Registry()
    for spec in KINDS.values():
        caller = getattr(pm.hook, spec.hook)
        # Call each implementation with a register bound to its plugin, so every entry
        # records the distribution it came from.
        for impl in caller.get_hookimpls():
            origin, ep_name = origins.get(impl.plugin_name, (impl.plugin_name, ""))

            def register(cls: type, _kind: str = spec.kind, _o: str = origin, _e: str = ep_name) -> None:
                registry.register(_kind, cls, origin=_o, entry_point=_e)

            try:
                impl.function(register=register)
            except PluginError:
                raise
            except Exception as exc:  # re-raised with the plugin named
                raise PluginLoadError(
                    f"{spec.hook} of elasticfw plugin {impl.plugin_name!r} (distribution {origin!r}) "
                    f"failed: {type(exc).__name__}: {exc}"
                ) from exc
    return registry


def _register_plugin(pm: pluggy.PluginManager, plugin: object, plugin_name: str, where: str) -> None:
    """Register with pluggy; a misspelled hook or a wrong hook signature is an InvalidPluginError."""
    try:
        pm.register(plugin, name=plugin_name)
    except pluggy.PluginValidationError as exc:
        raise InvalidPluginError(f"{where}: {' '.join(str(exc).split())}") from None
    hooks = {spec.hook for spec in KINDS.values()}
    for hook_name in dir(plugin):
        if hook_name not in hooks and pm.parse_hookimpl_opts(plugin, hook_name) is not None:
            raise InvalidPluginError(
                f"{where} implements unknown hook {hook_name!r}; {suggest(hook_name, hooks)}"
                f"elasticfw hooks: {', '.join(sorted(hooks))}"
            )


_lock = threading.Lock()
_registry: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, loaded on first use."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = load_registry()
        return _registry


def set_registry(registry: Registry | None) -> None:
    """Replace (or with ``None``, reset) the process-wide registry; for tests and notebooks."""
    global _registry
    with _lock:
        _registry = registry
