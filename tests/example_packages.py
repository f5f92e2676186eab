"""The tutorials' example plugin packages (docs/examples/*) in CI, one way for all.

A package is laid out as an installed distribution (no network, no build: its one module plus a
dist-info with the entry points of its pyproject.toml, :func:`foundation_helpers.make_distribution`),
then `elasticfw plugins` must list its mode and its own tests must pass in a subprocess that
finds the plugin through its entry point only.
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


def run_with(site: Path, args: list[str], *, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """``args`` in a subprocess with ``site`` first on PYTHONPATH (no bytecode written)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def install_example(example: Path, site: Path) -> Path:
    """``example``'s package as an installed distribution under ``site`` (returned)."""
    project = tomllib.loads((example / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (package_dir,) = [p for p in (example / "src").iterdir() if (p / "__init__.py").exists()]
    modules = sorted(p.name for p in package_dir.glob("*.py"))
    assert modules == ["__init__.py"], f"the example package must stay one module, found {modules}"
    source = (package_dir / "__init__.py").read_text(encoding="utf-8")
    return make_distribution(site, package_dir.name, project["name"], source, project["entry-points"]["elasticfw"])


def listed_modes(site: Path, cwd: Path) -> dict[str, str]:
    """``elasticfw plugins --kind sparse_mode``'s rows of plugins from other distributions, by name."""
    script = Path(sys.executable).parent / "elasticfw"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "elasticfw.cli"]
    result = run_with(site, [*command, "plugins", "--kind", "sparse_mode"], cwd=cwd)
    assert result.returncode == 0, result.stderr
    return {line.split()[0]: line for line in result.stdout.splitlines() if " from " in line}


def run_example_tests(example: Path, site: Path, tmp_path: Path, *, at_least: int, no_skips: bool) -> str:
    """The package's own tests on a copy without its sources (so the plugin comes from ``site``
    through its entry point); they must pass, ``at_least`` of them, with nothing skipped when
    ``no_skips``. Returns pytest's output."""
    work = tmp_path / example.name
    shutil.copytree(example, work, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build", ".pytest_cache"))
    shutil.rmtree(work / "src")
    result = run_with(site, [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"], cwd=work)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    passed = re.search(r"(\d+) passed", output)
    assert passed is not None and int(passed.group(1)) >= at_least, output
    if no_skips:
        assert not re.search(r"\d+ (skipped|xfailed|deselected)", output), f"the example's tests must not skip:\n{output}"
    return output
