"""Every registered attention mode through the exported conformance suite.

The classes are generated from the registry: a new built-in mode is tested the moment it
registers, and fails until it gets an independent token-level definition in
tests/mode_definitions/<name>.py. Modes of other distributions (a tutorial's example package
installed into the same environment) are their authors' to test with the exported suite: they
are left out here, so installing one does not turn elasticfw's own suite red.
"""

from __future__ import annotations

from mode_definitions import all_definitions

from elasticfw.registry import get_registry
from elasticfw.testing.modes import ModeConformance

_DEFINITIONS = all_definitions()
_BUILTIN = sorted(e.name for e in get_registry().entries("sparse_mode") if e.origin == "elasticfw")


def _suite(name: str) -> type:
    definition = dict(_DEFINITIONS.get(name, {}))
    ref = definition.pop("token_reference", None)
    attrs = {"mode_name": name, **definition, "token_reference": staticmethod(ref) if ref else None}
    return type(f"TestMode_{name}", (ModeConformance,), attrs)


for _name in _BUILTIN:
    globals()[f"TestMode_{_name}"] = _suite(_name)


def test_every_registered_mode_has_a_definition():
    assert _BUILTIN, "no built-in sparse modes registered (is elasticfw installed?)"
    missing = sorted(set(_BUILTIN) - set(_DEFINITIONS))
    assert not missing, f"modes without an independent definition in tests/mode_definitions/: {missing}"
