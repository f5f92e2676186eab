"""A task's samples as a cached :class:`datasets.Dataset`.

>>> ds = task_dataset(task, tokenizer, seed=0, split="train")   # built once, then loaded
>>> samples = samples_from_dataset(ds)                          # the very same Sample objects

The first call runs ``task.samples(tokenizer, seed=..., split=...)`` and stores the samples as
an Arrow dataset under ``$ELASTICFW_CACHE/datasets/`` (default ``~/.cache/elasticfw``); later
calls with the same inputs load it. The directory name carries a fingerprint (sha256) of
everything the samples depend on: the task name and its config (JSON), the tokenizer
(``name_or_path``, vocabulary size, a hash of its vocabulary and of its chat template), the seed,
the split and the elasticfw version. A task reading external data may add what identifies that
data through an optional ``data_fingerprint()`` method returning JSON-able data (the built-in
``dataset`` task hashes its local files), so an edited file never hits a stale cache.

Columns: ``input_ids`` (int64 list), ``answer``, ``answers`` (string list), ``target``
(nullable string), ``needle_span`` (``[]`` for none, else ``[start, end]``), ``needle_spans``
(list of ``[start, end]``) and ``meta`` (JSON text; a meta that does not survive JSON
unchanged, e.g. holding a tuple, is refused so the round trip stays exact).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from elasticfw.errors import UnsupportedInputError
from elasticfw.eval.task import Sample, Split, Task, check_split

FINGERPRINT_FILE = "elasticfw_fingerprint.json"


def cache_root() -> Path:
    """``$ELASTICFW_CACHE/datasets`` (default ``~/.cache/elasticfw/datasets``)."""
    base = Path(os.environ.get("ELASTICFW_CACHE", Path.home() / ".cache" / "elasticfw")).expanduser()
    return base / "datasets"


def _sha256(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """What identifies a tokenizer: name_or_path, vocabulary size, hashes of vocab and chat template."""
    vocab = tokenizer.get_vocab()
    template = getattr(tokenizer, "chat_template", None)
    return {
        "name_or_path": str(getattr(tokenizer, "name_or_path", "") or ""),
        "vocab_size": len(vocab),
        "vocab_sha256": _sha256(sorted(vocab.items(), key=lambda kv: kv[1])),
        "chat_template_sha256": _sha256(template) if template else None,
    }


def fingerprint_inputs(task: Task, tokenizer: Any, *, seed: int, split: str) -> dict[str, Any]:
    """Everything the cached samples depend on, as JSON-able data."""
    from elasticfw import __version__

    inputs: dict[str, Any] = {
        "task": task.name,
        "code": _code_fingerprint(type(task)),
        "config": task.config.model_dump(mode="json"),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "seed": seed,
        "split": split,
        "elasticfw": __version__,
    }
    data_fingerprint = getattr(task, "data_fingerprint", None)
    if callable(data_fingerprint):
        inputs["data"] = data_fingerprint()
    return inputs


def _code_fingerprint(cls: type) -> str | None:
    """sha256 of the source file of the task's module: a changed generator never hits a stale cache."""
    import inspect

    try:
        source = inspect.getsourcefile(cls)
    except TypeError:  # built in, no source file
        return None
    if source is None or not Path(source).is_file():
        return None
    return hashlib.sha256(Path(source).read_bytes()).hexdigest()


def dataset_fingerprint(task: Task, tokenizer: Any, *, seed: int, split: str) -> str:
    """sha256 of :func:`fingerprint_inputs`."""
    return _sha256(fingerprint_inputs(task, tokenizer, seed=seed, split=split))


def _features() -> Any:
    from datasets import Features, List, Value

    return Features(
        {
            "input_ids": List(Value("int64")),
            "answer": Value("string"),
            "answers": List(Value("string")),
            "target": Value("string"),
            "needle_span": List(Value("int64")),
            "needle_spans": List(List(Value("int64"))),
            "meta": Value("string"),
        }
    )


def _meta_json(meta: dict[str, Any], index: int) -> str:
    try:
        text = json.dumps(meta, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise UnsupportedInputError(f"sample {index}: meta is not JSON-serialisable ({exc})") from None
    if json.loads(text) != meta:
        changed = [repr(k) for k in meta if not isinstance(k, str) or json.loads(json.dumps(meta[k])) != meta[k]]
        raise UnsupportedInputError(
            f"sample {index}: meta does not survive JSON unchanged (keys {changed or list(meta)}); use str keys, "
            "lists instead of tuples and finite numbers"
        )
    return text


def _span(span: Any, index: int) -> list[int]:
    if span is None:
        return []
    if len(span) != 2:
        raise UnsupportedInputError(f"sample {index}: a needle span must be (start, end), got {span!r}")
    return [int(span[0]), int(span[1])]


def samples_to_dataset(samples: list[Sample]) -> Any:
    """A :class:`datasets.Dataset` with one row per sample (see the module docstring)."""
    from datasets import Dataset

    columns: dict[str, list[Any]] = {name: [] for name in _features()}
    for i, s in enumerate(samples):
        columns["input_ids"].append([int(t) for t in s.input_ids])
        columns["answer"].append(s.answer)
        columns["answers"].append(list(s.answers))
        columns["target"].append(s.target)
        columns["needle_span"].append(_span(s.needle_span, i))
        columns["needle_spans"].append([_span(span, i) for span in s.needle_spans])
        columns["meta"].append(_meta_json(s.meta, i))
    return Dataset.from_dict(columns, features=_features())


def samples_from_dataset(ds: Any) -> list[Sample]:
    """The samples stored by :func:`samples_to_dataset` / :func:`task_dataset`."""
    missing = [name for name in _features() if name not in ds.column_names]
    if missing:
        raise UnsupportedInputError(
            f"not a dataset of elasticfw samples: columns {missing} are missing (has {ds.column_names})"
        )
    out = []
    for row in ds:
        span = row["needle_span"]
        out.append(
            Sample(
                input_ids=list(row["input_ids"]),
                answer=row["answer"],
                needle_span=(span[0], span[1]) if span else None,
                meta=json.loads(row["meta"]),
                target=row["target"],
                answers=tuple(row["answers"]),
                needle_spans=tuple((s[0], s[1]) for s in row["needle_spans"]),
            )
        )
    return out


def task_dataset(
    task: Task,
    tokenizer: Any,
    *,
    seed: int,
    split: Split = "eval",
    cache_dir: str | Path | None = None,
    refresh: bool = False,
) -> Any:
    """The samples of ``task`` for (``seed``, ``split``) as a :class:`datasets.Dataset`, built once
    and cached under ``cache_dir`` (default :func:`cache_root`); ``refresh`` rebuilds it."""
    from datasets import load_from_disk

    check_split(split)
    inputs = fingerprint_inputs(task, tokenizer, seed=seed, split=split)
    digest = _sha256(inputs)
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    path = root / f"{task.name}-{split}-{digest[:20]}"
    if path.is_dir() and not refresh:
        stored = json.loads((path / FINGERPRINT_FILE).read_text(encoding="utf-8")) if (path / FINGERPRINT_FILE).is_file() else None
        if stored is not None and stored.get("sha256") == digest:
            return load_from_disk(str(path))
    samples = task.samples(tokenizer, seed=seed, split=split)
    ds = samples_to_dataset(samples)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=root))
    try:
        ds.save_to_disk(str(tmp))
        (tmp / FINGERPRINT_FILE).write_text(json.dumps({"sha256": digest, "inputs": inputs}, indent=2), encoding="utf-8")
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)  # readers see the whole dataset or none of it
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return load_from_disk(str(path))
