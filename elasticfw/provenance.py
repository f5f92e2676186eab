"""Where a measurement came from: date, commit, versions, machine. Every JSON under results/
carries this block."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except ImportError:
        return None
    return str(getattr(mod, "__version__", "unknown"))


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 4 MiB pieces (model files, adapters)."""
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def git_commit() -> dict[str, Any]:
    """``$ELASTICFW_COMMIT`` when set (copies of the repository whose ``.git`` is missing or stale, e.g.
    on a lent GPU machine), else HEAD of the checkout this module lives in (and whether the tree
    differs from it)."""
    root = Path(__file__).resolve().parents[1]

    def git(*cmd: str) -> str:
        out = subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip()

    env = os.environ.get("ELASTICFW_COMMIT")
    if env:
        return {"git_commit": env, "git_dirty": None}
    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            raise subprocess.SubprocessError("not the elasticfw checkout")
        return {"git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": env, "git_dirty": None}


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **git_commit(),
        "elasticfw_commit_env": os.environ.get("ELASTICFW_COMMIT"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "device": str(device),
        "host": platform.node(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
        env["capability"] = list(torch.cuda.get_device_capability(device))
    else:
        env["gpu"] = None
        env["cpu"] = platform.processor() or platform.machine()
        env["threads"] = torch.get_num_threads()
    env["plugins"] = plugin_distributions()
    return env


def plugin_distributions() -> dict[str, str | None]:
    """Every distribution that registered plugins in this process, with its installed version
    (``None`` for in-process registrations), so a result says which plugin code produced it."""
    from importlib import metadata

    from elasticfw.registry import get_registry

    out: dict[str, str | None] = {}
    for entry in get_registry().entries():
        if entry.origin in out:
            continue
        try:
            out[entry.origin] = metadata.version(entry.origin)
        except metadata.PackageNotFoundError:
            out[entry.origin] = None
    return dict(sorted(out.items()))
