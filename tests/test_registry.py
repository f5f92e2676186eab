"""The plugin registry: built-ins through entry points, third-party entry points, and loud errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from foundation_helpers import (
    DEMO_DIST,
    DEMO_ENTRY_POINT,
    DEMO_PACKAGE,
    forget_modules,
    make_demo_distribution,
    make_distribution,
)
from pydantic import BaseModel, Field

from elasticfw import hookimpl
from elasticfw.attention.layout import BlockLayout, causal_layout
from elasticfw.attention.mode import AttentionMode, ModeConfig
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import (
    DuplicatePluginError,
    InvalidPluginError,
    PluginError,
    PluginLoadError,
    RecipeError,
    UnknownPluginError,
)
from elasticfw.model.adapter import BackboneAdapter
from elasticfw.recipe import recipe_model, validate_recipe_data
from elasticfw.registry import KINDS, PluginConfig, Registry, get_registry, load_registry, set_registry

BUILTINS = {
    "sparse_mode": {"full", "streaming"},
    "executor": {"reference"},
    "router": {"fixed", "mlp", "static"},
    "backbone": {"llama", "qwen2"},
    "task": {"passkey"},
    "model": {"smollm2-135m"},
}


# -- tiny plugin classes -------------------------------------------------------------------------


class ToyConfig(ModeConfig):
    name: Literal["toy"] = "toy"
    block_size: int = Field(64, ge=16, description="Block size.")


class ToyMode(AttentionMode):
    """A toy mode."""

    name = "toy"
    config_class = ToyConfig

    def build_layout(self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo) -> BlockLayout:
        return causal_layout(seq, self.block_size)


class FakeStreamingConfig(ModeConfig):
    name: Literal["streaming"] = "streaming"


class FakeStreaming(ToyMode):
    """Claims a built-in's name."""

    name = "streaming"
    config_class = FakeStreamingConfig  # type: ignore[assignment]


class NoName(AttentionMode):
    config_class = ToyConfig

    def build_layout(self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo) -> BlockLayout:
        raise NotImplementedError


class BadName(ToyMode):
    name = "Bad-Name"


class IntName(ToyMode):
    name = 3  # type: ignore[assignment]


class NotAMode:
    name = "toy"
    config_class = ToyConfig


class NoConfig(ToyMode):
    config_class = None  # type: ignore[assignment]


class PlainModelConfig(BaseModel):
    name: Literal["toy"] = "toy"


class ConfigNotPluginConfig(ToyMode):
    config_class = PlainModelConfig  # type: ignore[assignment]


class StrNameConfig(ModeConfig):
    name: str = "toy"


class ConfigNameNotLiteral(ToyMode):
    config_class = StrNameConfig  # type: ignore[assignment]


class OtherNameConfig(ModeConfig):
    name: Literal["other"] = "other"


class ConfigNameMismatch(ToyMode):
    config_class = OtherNameConfig  # type: ignore[assignment]


class ToyBackbone(BackboneAdapter):
    """A backbone adapter needs no config class."""

    name = "toy_backbone"
    model_types = ("toy",)


class Plugin:
    """A plugin object registering ``classes`` as sparse modes."""

    def __init__(self, *classes: type) -> None:
        self.classes = classes

    @hookimpl
    def elasticfw_register_sparse_modes(self, register: Any) -> None:
        for cls in self.classes:
            register(cls)


# -- built-ins -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def builtin_registry() -> Registry:
    return load_registry()


def test_builtins_arrive_through_entry_points_with_their_origin(builtin_registry: Registry) -> None:
    for kind, names in BUILTINS.items():
        assert names <= set(builtin_registry.names(kind)), kind
        for name in names:
            entry = builtin_registry.entry(kind, name)
            assert entry.origin == "elasticfw"
            assert entry.entry_point.startswith("builtin_")
            assert entry.kind == kind and entry.name == name
            assert entry.summary  # first docstring line, shown by `elasticfw plugins`


def test_builtin_configs_follow_the_contract(builtin_registry: Registry) -> None:
    for kind, spec in KINDS.items():
        assert builtin_registry.names(kind) == sorted(builtin_registry.names(kind))
        for entry in builtin_registry.entries(kind):
            assert issubclass(entry.cls, spec.base_class())
            if spec.needs_config:
                assert entry.config_class is not None and entry.config_class().name == entry.name


def test_get_registry_is_cached_and_resettable() -> None:
    first = get_registry()
    assert get_registry() is first
    custom = Registry()
    try:
        set_registry(custom)
        assert get_registry() is custom
    finally:
        set_registry(first)
    assert get_registry() is first


# -- lookup errors -------------------------------------------------------------------------------


def test_unknown_name_lists_what_exists_and_suggests(builtin_registry: Registry) -> None:
    with pytest.raises(UnknownPluginError) as info:
        builtin_registry.get("sparse_mode", "streamin")
    msg = str(info.value)
    assert "unknown sparse_mode 'streamin'" in msg
    assert "did you mean 'streaming'?" in msg
    assert "full" in msg and "streaming" in msg
    assert isinstance(info.value, KeyError)  # usable where a mapping lookup is expected
    assert not msg.startswith('"')  # KeyError's quoting is undone


def test_unknown_name_without_a_near_miss_still_lists(builtin_registry: Registry) -> None:
    with pytest.raises(UnknownPluginError) as info:
        builtin_registry.get("router", "zzzzzz")
    assert "did you mean" not in str(info.value)
    assert "fixed" in str(info.value) and "mlp" in str(info.value)


def test_unknown_kind(builtin_registry: Registry) -> None:
    with pytest.raises(UnknownPluginError, match="did you mean 'sparse_mode'"):
        builtin_registry.names("sparse_modes")


# -- registration contract -----------------------------------------------------------------------


def test_runtime_registration_and_make() -> None:
    registry = Registry()
    registry.register("sparse_mode", ToyMode)
    entry = registry.entry("sparse_mode", "toy")
    assert entry.origin == "<runtime>" and entry.cls is ToyMode
    assert ("sparse_mode", "toy") in registry and ("sparse_mode", "nope") not in registry
    mode = registry.make("sparse_mode", ToyConfig(block_size=32))
    assert isinstance(mode, ToyMode) and mode.block_size == 32


def test_backbones_need_no_config_class_and_model_names_may_have_dashes() -> None:
    registry = Registry()
    registry.register("backbone", ToyBackbone)
    assert registry.names("backbone") == ["toy_backbone"]
    source_base = KINDS["model"].base_class()
    dashed = type("Dashed", (source_base,), {"name": "tiny-lm-1.5b", "__abstractmethods__": frozenset()})
    registry.register("model", dashed)
    assert registry.names("model") == ["tiny-lm-1.5b"]


@pytest.mark.parametrize(
    ("cls", "phrase"),
    [
        pytest.param(NoName, "has name None", id="no-name"),
        pytest.param(BadName, "has name 'Bad-Name'", id="bad-name"),
        pytest.param(IntName, "has name 3", id="int-name"),
        pytest.param(NotAMode, "must subclass elasticfw.attention.mode.AttentionMode", id="wrong-base"),
        pytest.param(ToyMode(), "must be a class, not an instance", id="instance"),
        pytest.param(NoConfig, "needs a `config_class` subclassing", id="no-config-class"),
        pytest.param(ConfigNotPluginConfig, "needs a `config_class` subclassing", id="config-not-pluginconfig"),
        pytest.param(ConfigNameNotLiteral, "name: Literal['toy'] = 'toy'", id="config-name-str"),
        pytest.param(ConfigNameMismatch, "found typing.Literal['other']", id="config-name-mismatch"),
    ],
)
def test_contract_violations_are_invalid_plugin_errors(cls: Any, phrase: str) -> None:
    with pytest.raises(InvalidPluginError) as info:
        Registry().register("sparse_mode", cls, origin="some-dist")
    msg = str(info.value)
    assert phrase in msg
    assert "sparse_mode plugin" in msg and "'some-dist'" in msg


def test_duplicate_name_names_both_origins() -> None:
    with pytest.raises(DuplicatePluginError) as info:
        load_registry(extra_plugins=[("other-dist", Plugin(FakeStreaming))])
    msg = str(info.value)
    assert "sparse_mode name 'streaming' is registered twice" in msg
    # the first registration (the built-in) is named first, the newcomer second
    assert msg.index("'elasticfw'") < msg.index("'other-dist'")
    assert "StreamingAttention" in msg and "FakeStreaming" in msg


def test_duplicate_within_one_registry() -> None:
    registry = Registry()
    registry.register("sparse_mode", ToyMode, origin="dist-a")
    with pytest.raises(DuplicatePluginError, match="by 'dist-a' .* and by 'dist-b'"):
        registry.register("sparse_mode", ToyMode, origin="dist-b")


def test_extra_plugins_register_with_their_origin() -> None:
    registry = load_registry(extra_plugins=[("notebook", Plugin(ToyMode))])
    assert registry.entry("sparse_mode", "toy").origin == "notebook"
    assert registry.entry("sparse_mode", "streaming").origin == "elasticfw"


def test_misspelled_hook_is_loud() -> None:
    class Typo:
        @hookimpl
        def elasticfw_register_sparse_mode(self, register: Any) -> None:
            register(ToyMode)

    with pytest.raises(InvalidPluginError) as info:
        load_registry(entry_points=False, extra_plugins=[("typo-dist", Typo())])
    msg = str(info.value)
    assert "unknown hook 'elasticfw_register_sparse_mode'" in msg
    assert "did you mean 'elasticfw_register_sparse_modes'?" in msg and "'typo-dist'" in msg


def test_wrong_hook_signature_is_loud() -> None:
    class WrongArgs:
        @hookimpl
        def elasticfw_register_sparse_modes(self, reg: Any) -> None:
            reg(ToyMode)

    with pytest.raises(InvalidPluginError, match="'reg'.*hookspec|hookspec.*'reg'"):
        load_registry(entry_points=False, extra_plugins=[("args-dist", WrongArgs())])


def test_failing_registration_hook_is_a_plugin_load_error() -> None:
    class Failing:
        @hookimpl
        def elasticfw_register_tasks(self, register: Any) -> None:
            raise RuntimeError("lazy import of a kernel failed")

    with pytest.raises(PluginLoadError) as info:
        load_registry(entry_points=False, extra_plugins=[("failing-dist", Failing())])
    msg = str(info.value)
    assert "elasticfw_register_tasks" in msg and "failing-dist" in msg
    assert "RuntimeError: lazy import of a kernel failed" in msg


def test_config_union() -> None:
    registry = Registry()
    with pytest.raises(UnknownPluginError, match="no sparse_mode plugin is registered"):
        registry.config_union("sparse_mode")
    registry.register("sparse_mode", ToyMode)
    assert registry.config_union("sparse_mode") is ToyConfig


def test_schema_follows_registrations_on_the_same_registry() -> None:
    registry = load_registry()
    before = recipe_model(registry)
    with pytest.raises(RecipeError, match="unknown sparse_mode 'toy'"):
        validate_recipe_data({"elastic": {"sparse_mode": {"name": "toy"}}}, registry=registry)
    registry.register("sparse_mode", ToyMode)
    assert recipe_model(registry) is not before
    recipe = validate_recipe_data({"elastic": {"sparse_mode": {"name": "toy"}}}, registry=registry)
    assert recipe.elastic.sparse_mode.name == "toy"


# -- third-party distributions through entry points (in-process) ---------------------------------


@pytest.fixture
def on_sys_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for throwaway distributions; their modules are forgotten after."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))  # also invalidates importlib(.metadata) caches
    yield root
    for package in [p.name for p in root.iterdir() if p.is_dir() and not p.name.endswith(".dist-info")]:
        forget_modules(package)


def test_third_party_entry_point_is_loaded_with_its_distribution(on_sys_path: Path) -> None:
    make_demo_distribution(on_sys_path)
    registry = load_registry()
    entry = registry.entry("sparse_mode", "demo_mode")
    assert entry.origin == DEMO_DIST
    assert entry.entry_point == DEMO_ENTRY_POINT
    assert entry.cls.__module__ == DEMO_PACKAGE
    assert registry.entry("sparse_mode", "streaming").origin == "elasticfw"  # built-ins unchanged


def test_third_party_config_is_validated_by_its_own_class(on_sys_path: Path) -> None:
    make_demo_distribution(on_sys_path)
    registry = load_registry()
    recipe = validate_recipe_data(
        {"elastic": {"sparse_mode": {"name": "demo_mode", "width": 5}}}, registry=registry
    )
    assert recipe.elastic.sparse_mode.width == 5
    assert type(recipe.elastic.sparse_mode).__module__ == DEMO_PACKAGE
    with pytest.raises(RecipeError) as info:
        validate_recipe_data({"elastic": {"sparse_mode": {"name": "demo_mode", "widht": 5}}}, registry=registry)
    assert "elastic.sparse_mode.widht: unknown key; did you mean 'width'?" in str(info.value)
    with pytest.raises(RecipeError, match=r"elastic\.sparse_mode\.width = 0: .*greater than or equal to 1"):
        validate_recipe_data({"elastic": {"sparse_mode": {"name": "demo_mode", "width": 0}}}, registry=registry)


def test_entry_point_that_fails_to_import(on_sys_path: Path) -> None:
    make_distribution(
        on_sys_path,
        "elasticfw_broken_plugin",
        "elasticfw-broken-plugin",
        "raise ImportError('needs a kernel that is not installed')\n",
        {"broken": "elasticfw_broken_plugin"},
    )
    with pytest.raises(PluginLoadError) as info:
        load_registry()
    msg = str(info.value)
    assert "entry point 'broken' = 'elasticfw_broken_plugin'" in msg
    assert "distribution 'elasticfw-broken-plugin'" in msg
    assert "ImportError: needs a kernel that is not installed" in msg
    assert isinstance(info.value, PluginError)
    # where its own code failed (the CLI prints no traceback), and how to go on without it
    assert f"raised at {on_sys_path / 'elasticfw_broken_plugin' / '__init__.py'}:1 in <module>" in msg
    assert "set ELASTICFW_DISABLE_PLUGINS=elasticfw-broken-plugin" in msg


def test_a_disabled_distribution_is_not_loaded(on_sys_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_distribution(
        on_sys_path,
        "elasticfw_broken_plugin",
        "elasticfw-broken-plugin",
        "raise ImportError('needs a kernel that is not installed')\n",
        {"broken": "elasticfw_broken_plugin"},
    )
    monkeypatch.setenv("ELASTICFW_DISABLE_PLUGINS", " elasticfw-broken-plugin ,other")
    registry = load_registry()
    assert "streaming" in registry.names("sparse_mode")  # the built-ins still load
    monkeypatch.setenv("ELASTICFW_DISABLE_PLUGINS", "elasticfw")
    with pytest.raises(PluginLoadError):  # the broken one is back
        load_registry()


def test_results_record_the_plugin_distributions() -> None:
    from importlib import metadata

    from elasticfw.provenance import environment

    plugins = environment(torch.device("cpu"))["plugins"]
    assert plugins["elasticfw"] == metadata.version("elasticfw")


def test_an_unknown_plugin_name_hints_at_an_uninstalled_package() -> None:
    with pytest.raises(RecipeError, match=r"unknown sparse_mode 'minference'.*a plugin from a package that is not "
                                          r"installed here\? install it"):
        validate_recipe_data({"elastic": {"sparse_mode": {"name": "minference"}}})


def test_entry_point_naming_a_missing_module(on_sys_path: Path) -> None:
    make_distribution(
        on_sys_path,
        "elasticfw_typo_plugin",
        "elasticfw-typo-plugin",
        "",
        {"typo": "elasticfw_typo_plugn.modes"},
    )
    with pytest.raises(PluginLoadError, match="'typo' = 'elasticfw_typo_plugn.modes'.*ModuleNotFoundError"):
        load_registry()


def test_third_party_duplicate_of_a_builtin(on_sys_path: Path) -> None:
    source = """
        from typing import Literal
        from elasticfw import hookimpl
        from elasticfw.attention.mode import ModeConfig
        from elasticfw_plugins.modes.full import FullAttention

        class Cfg(ModeConfig):
            name: Literal["full"] = "full"

        class MyFull(FullAttention):
            config_class = Cfg

        @hookimpl
        def elasticfw_register_sparse_modes(register):
            register(MyFull)
    """
    make_distribution(on_sys_path, "elasticfw_dup_plugin", "elasticfw-dup-plugin", source)
    with pytest.raises(DuplicatePluginError) as info:
        load_registry()
    assert "'elasticfw'" in str(info.value) and "'elasticfw-dup-plugin'" in str(info.value)


def test_plugin_config_base_forbids_extra_keys() -> None:
    assert PluginConfig.model_config["extra"] == "forbid"
    assert ToyConfig.model_config["frozen"] is True
