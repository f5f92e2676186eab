"""Every registered attention mode through the exported conformance suite.

The classes are generated from the registry: a new mode plugin is tested the moment it
registers, and fails until it gets an independent token-level definition in
tests/mode_definitions/<name>.py.
"""

from __future__ import annotations

from mode_definitions import all_definitions

from elasticfw.registry import get_registry
from elasticfw.testing.modes import ModeConformance

_DEFINITIONS = all_definitions()


def _suite(name: str) -> type:
    definition = dict(_DEFINITIONS.get(name, {}))
    ref = definition.pop("token_reference", None)
    attrs = {"mode_name": name, **definition, "token_reference": staticmethod(ref) if ref else None}
    return type(f"TestMode_{name}", (ModeConformance,), attrs)


for _name in get_registry().names("sparse_mode"):
    globals()[f"TestMode_{_name}"] = _suite(_name)


def test_every_registered_mode_has_a_definition():
    missing = sorted(set(get_registry().names("sparse_mode")) - set(_DEFINITIONS))
    assert not missing, f"modes without an independent definition in tests/mode_definitions/: {missing}"
