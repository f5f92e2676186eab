"""The data-dependent tutorial's example plugin (docs/examples/elasticfw-example-vslash) in CI.

As tests/test_docs.py does for the contributor tutorial's package: the package is laid out as an
installed distribution (no network, no build: its module plus a dist-info with its entry points,
tests/foundation_helpers.py), `elasticfw plugins` must list its mode, and the package's own tests
(the exported conformance suite and a hand-computed selection) must pass in a subprocess, with
nothing skipped, finding the plugin through its entry point only.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from foundation_helpers import make_distribution

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "elasticfw-example-vslash"


def _run(args: list[str], *, cwd: Path, site: Path, timeout: int = 900):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example package as an installed distribution: put the returned folder on PYTHONPATH."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    package_dir = EXAMPLE / "src" / "elasticfw_example_vslash"
    modules = sorted(p.name for p in package_dir.glob("*.py"))
    assert modules == ["__init__.py"], f"the example package must stay one module, found {modules}"
    source = (package_dir / "__init__.py").read_text(encoding="utf-8")
    return make_distribution(
        tmp_path_factory.mktemp("site"), package_dir.name, project["name"], source,
        project["entry-points"]["elasticfw"],
    )


def test_example_vslash_is_listed(example_site: Path, tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "elasticfw"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "elasticfw.cli"]
    result = _run([*command, "plugins", "--kind", "sparse_mode"], cwd=tmp_path, site=example_site)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if " from " in line}
    assert "vertical_slash" in rows, result.stdout
    assert "from elasticfw-example-vslash" in rows["vertical_slash"], rows["vertical_slash"]


def test_example_vslash_passes_its_tests_without_skips(example_site: Path, tmp_path: Path) -> None:
    work = tmp_path / "elasticfw-example-vslash"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build", ".pytest_cache"))
    shutil.rmtree(work / "src")  # the tests must find the plugin through its entry point only
    result = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"], cwd=work, site=example_site)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    passed = re.search(r"(\d+) passed", output)
    assert passed is not None and int(passed.group(1)) >= 30, output
    assert not re.search(r"\d+ (skipped|xfailed|deselected)", output), f"the example's tests must not skip:\n{output}"
