"""The data-dependent tutorial's example plugin (docs/examples/elasticfw-example-vslash) in CI.

As tests/test_docs.py does for the contributor tutorial's package: the package is laid out as an
installed distribution (no network, no build: its module plus a dist-info with its entry points,
tests/foundation_helpers.py), `elasticfw plugins` must list its mode, and the package's own tests
(the exported conformance suite and a hand-computed selection) must pass in a subprocess, with
nothing skipped, finding the plugin through its entry point only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from example_packages import install_example, listed_modes, run_example_tests

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "elasticfw-example-vslash"


@pytest.fixture(scope="module")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example package as an installed distribution: put the returned folder on PYTHONPATH."""
    return install_example(EXAMPLE, tmp_path_factory.mktemp("site"))


def test_example_vslash_is_listed(example_site: Path, tmp_path: Path) -> None:
    rows = listed_modes(example_site, tmp_path)
    assert "vertical_slash" in rows, rows
    assert "from elasticfw-example-vslash" in rows["vertical_slash"], rows["vertical_slash"]


def test_example_vslash_passes_its_tests_without_skips(example_site: Path, tmp_path: Path) -> None:
    run_example_tests(EXAMPLE, example_site, tmp_path, at_least=30, no_skips=True)
