"""The ``elasticfw`` command line: plugins, recipe validate/show/schema, and its error contract.

Most tests call ``main([...])`` in-process; one runs the installed console script in a fresh
interpreter that finds a third-party entry point through ``PYTHONPATH`` alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from foundation_helpers import (
    DEMO_DIST,
    DEMO_PACKAGE,
    forget_modules,
    make_demo_distribution,
    make_distribution,
)

from elasticfw import registry as registry_module
from elasticfw.cli import main

GOOD = "description: a test recipe\neval:\n  task: {name: passkey, num_samples: 2}\n"
BAD = "elastic:\n  sparse_mode: {name: streaming, sink_tokens: -1}\n"


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    path = tmp_path / "good.yaml"
    path.write_text(GOOD, encoding="utf-8")
    return path


def assert_one_paragraph_error(err: str) -> None:
    assert err.startswith("elasticfw: error: "), err
    assert "Traceback" not in err and "\n\n" not in err.strip(), err


# -- plugins -------------------------------------------------------------------------------------


def test_plugins_lists_builtins_with_origin(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for kind in ("sparse_mode", "executor", "router", "backbone", "task", "model"):
        assert f"\n{kind} (" in f"\n{out}"
    lines = {line.split()[0]: line for line in out.splitlines() if " from " in line}
    for name in ("full", "streaming", "reference", "mlp", "fixed", "llama", "passkey", "smollm2-135m"):
        assert "from elasticfw " in lines[name], lines.get(name)
    assert "sink_tokens=128" in out  # config defaults are shown


def test_plugins_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_name = {(r["kind"], r["name"]): r for r in rows}
    streaming = by_name["sparse_mode", "streaming"]
    assert streaming["origin"] == "elasticfw" and streaming["entry_point"] == "builtin_modes"
    assert streaming["config"]["sink_tokens"] == 128
    assert "llama" in by_name["backbone", "llama"]["model_types"]
    from elasticfw.registry import get_registry

    want = get_registry().entry("sparse_mode", "streaming").config_class.model_fields["sink_tokens"].description
    assert want and streaming["descriptions"]["sink_tokens"] == want


def test_plugins_verbose_shows_each_fields_description(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--kind", "sparse_mode", "-v"]) == 0
    out = capsys.readouterr().out
    assert "      sink_tokens = 128  — Initial tokens every query sees (attention sinks)." in out


def test_plugins_one_kind(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--kind", "router"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("router (") and "streaming" not in out and "mlp" in out


def test_plugins_unknown_kind(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--kind", "sparse_modes"]) == 2
    err = capsys.readouterr().err
    assert_one_paragraph_error(err)
    assert "did you mean 'sparse_mode'?" in err


def test_broken_plugin_is_an_error_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    make_distribution(tmp_path, "elasticfw_cli_broken", "elasticfw-cli-broken", "import no_such_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry_module, "_registry", None)  # restored after the test
    assert main(["plugins"]) == 2
    err = capsys.readouterr().err
    assert_one_paragraph_error(err)
    assert "'elasticfw-cli-broken'" in err and "no_such_module_xyz" in err


# -- recipe validate / show / schema -------------------------------------------------------------


def test_validate_ok(recipe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe", "validate", str(recipe), "elastic.sparse_mode.sink_tokens=64"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("ok") and str(recipe) in captured.out
    assert captured.err == ""


@pytest.mark.parametrize(
    ("text", "overrides", "path"),
    [
        pytest.param(BAD, [], "elastic.sparse_mode.sink_tokens = -1", id="invalid-value"),
        pytest.param(GOOD, ["eval.task.num_sampels=3"], "eval.task.num_sampels", id="bad-override-key"),
        pytest.param(GOOD, ["eval.batch_size"], "eval.batch_size", id="override-without-equals"),
        pytest.param("a: [1,\n", [], "line 2", id="yaml-syntax"),
    ],
)
def test_validate_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, overrides: list[str], path: str
) -> None:
    file = tmp_path / "r.yaml"
    file.write_text(text, encoding="utf-8")
    assert main(["recipe", "validate", str(file), *overrides]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_paragraph_error(captured.err)
    assert path in captured.err


def test_validate_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe", "validate", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert_one_paragraph_error(err)
    assert "does not exist" in err


def test_show_prints_the_resolved_recipe_with_defaults(
    recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["recipe", "show", str(recipe), "elastic.router={name: fixed, assign: all_sparse}"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["description"] == "a test recipe"
    assert shown["eval"]["task"] == {**shown["eval"]["task"], "name": "passkey", "num_samples": 2}
    assert shown["eval"]["task"]["context_tokens"] == 1500  # defaults filled in
    assert shown["eval"]["batch_size"] == 1
    assert shown["elastic"]["router"] == {"name": "fixed", "assign": "all_sparse", "heads": [], "head_modes": [],
                                          "default_mode": 0}
    assert shown["elastic"]["executor"]["name"] == "reference"
    assert shown["model"]["name"] == "smollm2-135m"
    # what `show` prints is itself a recipe that resolves to the same thing
    again = tmp_path / "shown.yaml"
    again.write_text(yaml.safe_dump(shown), encoding="utf-8")
    assert main(["recipe", "show", str(again)]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == shown


def test_show_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "r.yaml"
    file.write_text(BAD, encoding="utf-8")
    assert main(["recipe", "show", str(file)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_paragraph_error(captured.err)


def test_schema_is_json_with_the_plugin_sections(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"model", "elastic", "eval", "compare"} <= set(schema["properties"])
    defs = schema["$defs"]
    for config in ("StreamingConfig", "FullConfig", "FixedConfig", "MLPRouterConfig", "PasskeyConfig"):
        assert config in defs, sorted(defs)
    assert defs["StreamingConfig"]["additionalProperties"] is False
    assert "description" in defs["StreamingConfig"]["properties"]["sink_tokens"]
    sparse = defs["ElasticSection"]["properties"]["sparse_mode"]
    assert sparse["discriminator"]["propertyName"] == "name"
    assert "streaming" in sparse["discriminator"]["mapping"]


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["recipe"])
    assert info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


# -- real processes ------------------------------------------------------------------------------


def _run(args: list[str], *, cwd: Path, extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)


def _elasticfw_command() -> list[str]:
    """The installed console script (a smoke test of it), else ``python -m elasticfw.cli``."""
    script = Path(sys.executable).parent / "elasticfw"
    return [str(script)] if script.exists() else [sys.executable, "-m", "elasticfw.cli"]


def test_third_party_entry_point_appears_without_changing_elasticfw(tmp_path: Path) -> None:
    site = make_demo_distribution(tmp_path / "site")
    work = tmp_path / "work"
    work.mkdir()
    listed = _run([*_elasticfw_command(), "plugins", "--kind", "sparse_mode"], cwd=work, extra_path=site)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line for line in listed.stdout.splitlines() if " from " in line}
    assert f"from {DEMO_DIST}" in rows["demo_mode"] and "Demo mode from a throwaway package." in rows["demo_mode"]
    assert "from elasticfw " in rows["streaming"]


def test_third_party_section_in_a_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    site = make_demo_distribution(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(registry_module, "_registry", None)  # restored after the test
    try:
        good = tmp_path / "demo.yaml"
        good.write_text("elastic:\n  sparse_mode: {name: demo_mode, width: 5}\n", encoding="utf-8")
        assert main(["recipe", "validate", str(good)]) == 0
        assert main(["recipe", "show", str(good)]) == 0
        shown = yaml.safe_load(capsys.readouterr().out.split("\n", 1)[1])  # after validate's "ok" line
        assert shown["elastic"]["sparse_mode"] == {"name": "demo_mode", "block_size": 64, "width": 5}
        assert main(["recipe", "validate", str(good), "elastic.sparse_mode.widht=5"]) == 2
        err = capsys.readouterr().err
        assert_one_paragraph_error(err)
        assert "elastic.sparse_mode.widht: unknown key; did you mean 'width'?" in err
    finally:
        forget_modules(DEMO_PACKAGE)
