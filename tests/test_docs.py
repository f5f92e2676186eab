"""The documentation is checked against the code.

* The generated reference pages (docs/reference/plugins.md, recipe-schema.md) equal what
  docs/generate_reference.py produces now: regenerate them when this fails.
* The fenced ```python test blocks of the quickstart run, in order, as one script; its copy of
  the demo recipe equals the shipped file.
* The recipes of the recipe how-to (```yaml file=NAME blocks) validate, and those it shows from
  recipes/ equal the shipped files.
* Relative links between the pages point at files and anchors that exist.
* The site builds with `mkdocs build --strict` (MkDocs Material, mkdocstrings) and every page is
  in its nav.
* The contributor tutorial's example plugin (docs/examples/elasticfw-example-mode) is installed
  as a distribution (no network, no build: its package and a dist-info with its entry points,
  laid out by tests/foundation_helpers.py), listed by `elasticfw plugins`, and passes its own
  conformance tests, run by pytest in a subprocess.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from example_packages import install_example, listed_modes, run_example_tests
from file_modules import load_file

from elasticfw.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLE = DOCS / "examples" / "elasticfw-example-mode"
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.S | re.M)


def fenced_blocks(path: Path, info: str) -> list[str]:
    """Bodies of the fenced blocks of ``path`` whose info string matches the regex ``info``."""
    text = path.read_text(encoding="utf-8")
    return [m.group("body") for m in FENCE.finditer(text) if re.fullmatch(info, m.group("info").strip())]


def run(args: list[str], *, cwd: Path, pythonpath: Path | None = None, timeout: int = 180):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


# -- generated reference -------------------------------------------------------------------------


def _generator():
    return load_file(DOCS / "generate_reference.py", "generate_reference")


def test_reference_pages_are_up_to_date() -> None:
    stale = []
    for path, expected in _generator().render().items():
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current != expected:
            diff = difflib.unified_diff(current.splitlines(), expected.splitlines(), "committed", "generated", lineterm="")
            stale.append(f"{path.relative_to(ROOT)}:\n" + "\n".join(list(diff)[:30]))
    assert not stale, "reference pages are out of date; run `python docs/generate_reference.py`\n" + "\n".join(stale)


# -- tutorials and how-to snippets ----------------------------------------------------------------


def test_quickstart_blocks_run(tmp_path: Path) -> None:
    blocks = fenced_blocks(DOCS / "tutorials" / "quickstart.md", r"python test")
    assert len(blocks) >= 4, "the quickstart's runnable blocks (```python test) are missing"
    script = tmp_path / "quickstart.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    result = run([sys.executable, str(script)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_quickstart_shows_the_shipped_demo_recipe() -> None:
    demo = (ROOT / "elasticfw" / "recipes" / "demo.yaml").read_text(encoding="utf-8")
    blocks = fenced_blocks(DOCS / "tutorials" / "quickstart.md", r"yaml")
    assert demo in blocks, "the quickstart's copy of elasticfw/recipes/demo.yaml differs from the file"


def test_recipe_howto_recipes_validate(tmp_path: Path) -> None:
    """```yaml file=NAME blocks: a NAME under recipes/ must equal the shipped file; all validate."""
    files = []
    for m in FENCE.finditer((DOCS / "how-to" / "write-a-recipe.md").read_text(encoding="utf-8")):
        named = re.fullmatch(r"yaml file=(\S+)", m.group("info").strip())
        if named is None:
            continue
        name, body = named.group(1), m.group("body")
        if name.startswith("recipes/"):
            assert body == (ROOT / name).read_text(encoding="utf-8"), f"the how-to's copy of {name} differs"
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
        files.append(path)
    assert len(files) >= 3, "the recipe how-to's recipes (```yaml file=NAME) are missing"
    for path in files:
        load_recipe(path)


# -- links ---------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _without_code(text: str) -> str:
    return FENCE.sub("", text)


def _anchors(page: Path) -> set[str]:
    """Explicit ``<a id>`` anchors and GitHub's slugs of the page's headings."""
    text = page.read_text(encoding="utf-8")
    ids = set(re.findall(r'<a id="([^"]+)"></a>', text))
    for heading in re.findall(r"^#+ (.*)$", _without_code(text), flags=re.M):
        ids.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return ids


def test_relative_links_resolve() -> None:
    broken = []
    for page in sorted(DOCS.rglob("*.md")):
        for target in LINK.findall(_without_code(page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path) if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such anchor)")
    assert not broken, "\n".join(broken)


# -- the contributor tutorial's example plugin --------------------------------------------------


@pytest.fixture(scope="module")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example package as an installed distribution: put the returned folder on PYTHONPATH."""
    return install_example(EXAMPLE, tmp_path_factory.mktemp("site"))


def test_example_plugin_is_listed(example_site: Path, tmp_path: Path) -> None:
    rows = listed_modes(example_site, tmp_path)
    assert "strided" in rows, rows
    assert "from elasticfw-example-mode" in rows["strided"], rows["strided"]


def test_example_plugin_passes_its_conformance_tests(example_site: Path, tmp_path: Path) -> None:
    run_example_tests(EXAMPLE, example_site, tmp_path, at_least=10, no_skips=False)


# -- the documentation site ------------------------------------------------------------------------


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict` (the `docs` extra, installed by `make setup`): every page in the nav,
    no broken link or anchor, every `::: module` of the docstring reference renders."""
    result = run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                  "-d", str(tmp_path / "site")], cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    api = (tmp_path / "site" / "reference" / "docstrings" / "index.html").read_text(encoding="utf-8")
    for name in ("elasticfw.eval.sweep.run_sweep", "elasticfw.report.stats.wilson_interval", "ElasticModel"):
        assert name in api, name
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert not [p for p in sorted(pages) if p not in nav], "pages missing from the mkdocs.yml nav"
