"""Helpers for the registry / recipe / CLI tests: throwaway plugin distributions on disk.

A "distribution" here is what pip would leave in site-packages: the package directory plus a
``<name>-<version>.dist-info/`` folder with ``METADATA`` and ``entry_points.txt``. Putting its
parent directory on ``sys.path`` (or ``PYTHONPATH``) makes ``importlib.metadata`` see its entry
points, exactly as for an installed package.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

DEMO_PACKAGE = "elasticfw_demo_plugin"
DEMO_DIST = "elasticfw-demo-plugin"
DEMO_ENTRY_POINT = "demo"

DEMO_PLUGIN_SOURCE = '''
"""A throwaway third-party elasticfw plugin: one attention mode."""

from typing import Literal

from pydantic import Field

from elasticfw import hookimpl
from elasticfw.attention.layout import causal_layout
from elasticfw.attention.mode import AttentionMode, ModeConfig


class DemoConfig(ModeConfig):
    name: Literal["demo_mode"] = "demo_mode"
    block_size: int = Field(64, ge=16, description="Block size of the layout.")
    width: int = Field(3, ge=1, description="A parameter only this plugin has.")


class DemoMode(AttentionMode):
    """Demo mode from a throwaway package."""

    name = "demo_mode"
    config_class = DemoConfig

    def build_layout(self, q, k, seq):
        return causal_layout(seq, self.block_size)


@hookimpl
def elasticfw_register_sparse_modes(register):
    register(DemoMode)
'''


def make_distribution(
    root: Path, package: str, dist: str, source: str, entry_points: dict[str, str] | None = None
) -> Path:
    """Write ``package/__init__.py`` (``source``) and its dist-info under ``root``; return ``root``.

    ``entry_points`` maps entry-point names of the ``elasticfw`` group to their values
    (default: ``{"demo": package}``).
    """
    (root / package).mkdir(parents=True)
    (root / package / "__init__.py").write_text(textwrap.dedent(source), encoding="utf-8")
    info = root / f"{package}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n", encoding="utf-8")
    eps = entry_points if entry_points is not None else {DEMO_ENTRY_POINT: package}
    lines = "".join(f"{name} = {value}\n" for name, value in eps.items())
    (info / "entry_points.txt").write_text(f"[elasticfw]\n{lines}", encoding="utf-8")
    return root


def make_demo_distribution(root: Path) -> Path:
    """The demo mode plugin as an installed-looking distribution under ``root``."""
    return make_distribution(root, DEMO_PACKAGE, DEMO_DIST, DEMO_PLUGIN_SOURCE)


def forget_modules(prefix: str) -> None:
    """Drop ``prefix`` and its submodules from ``sys.modules`` (undo a test's import)."""
    for name in [m for m in sys.modules if m == prefix or m.startswith(prefix + ".")]:
        del sys.modules[name]
