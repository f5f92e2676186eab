"""The recipe schema: pydantic models with ``extra="forbid"``, built from the registry.

Plugin sections (``elastic.sparse_mode``, ``elastic.router``, ``eval.task`` ...) are
discriminated unions on ``name`` of the config classes that registered plugins declare, so a
third-party mode's parameters are validated exactly like a built-in's, and an error points at
``elastic.sparse_mode.sink_tokens``, not at a stack trace.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from elasticfw.errors import suggest
from elasticfw.recipe.sections import (  # PLUGIN_FIELDS also importable from here
    PLUGIN_FIELDS,
    TWO_MODE_FIELDS,
    merge_sections,
)
from elasticfw.recipe.sweep_section import SweepSettings
from elasticfw.recipe.train_checks import check_train_objective
from elasticfw.recipe.train_section import (
    Target,
    TrainSettings,
    TrainTaskBase,
    check_cost_target,
    check_share_targets,
    check_target,
)
from elasticfw.registry import Registry, get_registry

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+|mps)$")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")

PaddingSide = Literal["left", "right"]
Category = Literal["sensitive", "robust"]
_LABEL = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"  # also a folder name in run folders: no '/', no '..' prefix


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelSection(Section):
    """Which causal LM to load and how."""

    name: str = Field(
        default="smollm2-135m",
        description="A registered short name (see `elasticfw plugins`), a local directory, or a hub id org/name.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Weights and activations dtype."
    )
    device: str = Field(default="auto", description="auto (cuda if available, else cpu), cpu, cuda or cuda:N.")
    revision: str | None = Field(default=None, description="Hub revision (hub ids only).")

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"expected auto, cpu, cuda, cuda:N or mps, got {value!r}")
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str, info: ValidationInfo) -> str:
        if not value.strip():
            raise ValueError("a model is required: a registered short name (e.g. smollm2-135m), a local folder or a hub id")
        registry: Registry = (info.context or {}).get("registry") or get_registry()
        if ("model", value) in registry or _HUB_ID.match(value) or _path_exists(value):
            return value
        known = registry.names("model")
        raise ValueError(
            f"{value!r} is not a registered model name ({suggest(value, known)}registered: {', '.join(known)}), "
            "an existing local path, or a hub id of the form org/name"
        )


def _path_exists(value: str) -> bool:
    """Whether ``value`` names an existing path (a name the OS cannot even look up does not)."""
    try:
        return Path(value).expanduser().exists()
    except (OSError, ValueError):  # file name too long, NUL byte, ...
        return False


def _base_elastic_fields(registry: Registry) -> dict[str, Any]:
    modes = registry.config_union("sparse_mode")
    full_default = _default_config(registry, "sparse_mode", "full")
    sparse_default = _default_config(registry, "sparse_mode", "streaming")
    return {
        "retrieval_mode": (modes, Field(full_default, description="Mode of heads routed to retrieval (FA).")),
        "sparse_mode": (modes, Field(sparse_default, description="Mode of heads routed to sparse (SA).")),
        "modes": (
            list[modes] | None,  # type: ignore[valid-type]
            Field(
                None,
                description="K >= 2 modes, in order (mode 0 first: the retrieval mode), instead of retrieval_mode and "
                "sparse_mode. Two modes are exactly retrieval_mode, sparse_mode. With three or more, retrieval_mode "
                "and sparse_mode read as the first and the last mode. See docs/how-to/route-among-modes.md.",
            ),
        ),
        "router": (
            registry.config_union("router"),
            Field(_default_config(registry, "router", "mlp"), description="Which router assigns heads."),
        ),
        "executor": (
            registry.config_union("executor"),
            Field(_default_config(registry, "executor", "reference"), description="Attention backend."),
        ),
        "route_sliding_window_layers": (
            bool,
            Field(
                False,
                description="Also route layers the backbone runs with a sliding window (their window is kept "
                "under every mode). Off: those layers run their native windowed attention.",
            ),
        ),
        "kv_cache": (
            Literal["full", "compact"],
            Field(
                "full",
                description="KV cache of `generate`. `full`: every head keeps every key (transformers' dynamic "
                "cache). `compact`: after the prefill, heads routed to a mode that declares what it reads at "
                "decode (streaming: sink + local window) keep only that; greedy output is unchanged. Beam "
                "search and assisted decoding need `full`.",
            ),
        ),
    }


def _default_config(registry: Registry, kind: str, name: str) -> Any:
    if (kind, name) in registry:
        return registry.entry(kind, name).config_class()  # type: ignore[misc]
    return ...  # required when the default plugin is not installed


class ElasticBase(Section):
    """What every ``elastic`` section has beside its fields: the mode list, however it was written.

    A section written with ``modes:`` of two entries is stored as ``retrieval_mode`` and
    ``sparse_mode`` (``modes`` is then ``None``): it is the same section as the two-mode recipe, and
    runs bit-identically. With three or more, ``modes`` holds them and a dump writes ``modes`` only."""

    def mode_configs(self) -> list[Any]:
        """The K >= 2 mode configs in routing order (mode 0 first)."""
        modes = getattr(self, "modes", None)
        return list(modes) if modes else [getattr(self, "retrieval_mode"), getattr(self, "sparse_mode")]  # noqa: B009

    @property
    def num_modes(self) -> int:
        """K, the number of modes heads are routed among."""
        return len(self.mode_configs())

    def modes_label(self) -> str:
        """The paper's configuration name, e.g. ``full-streaming`` (``full-xattention-streaming`` for K = 3)."""
        return "-".join(m.name for m in self.mode_configs())

    @model_validator(mode="wrap")
    @classmethod
    def _modes(cls, data: Any, handler: Any) -> Any:
        from_modes = isinstance(data, dict) and data.get("modes") is not None
        section = handler(_normalise_modes(data))
        _check_modes(section, from_modes)
        return _stored_modes(section)

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        data = handler(self)
        if isinstance(data, dict) and data.get("modes"):  # K >= 3: the list is the section's modes
            for key in TWO_MODE_FIELDS:
                data.pop(key, None)
        return data


def _normalise_modes(data: Any) -> Any:
    """Check the form of ``modes:`` before its entries are validated (at least two, not beside
    ``retrieval_mode``/``sparse_mode``)."""
    if not isinstance(data, dict) or data.get("modes") is None:
        return data
    modes = data["modes"]
    given = [k for k in TWO_MODE_FIELDS if k in data]
    if given:
        raise ValueError(
            f"modes and {' and '.join(given)} are both given: give either the mode list `modes` (K >= 2 modes) or "
            "retrieval_mode and sparse_mode (two modes), not both (in a file that inherits the other form, set "
            "modes: null)"
        )
    if not isinstance(modes, list) or len(modes) < 2:
        shown = f"{len(modes)} entr{'y' if len(modes) == 1 else 'ies'}" if isinstance(modes, list) else repr(modes)
        raise ValueError(f"modes = {shown}: expected a list of at least 2 mode sections (K >= 2), e.g. "
                         "[{name: full}, {name: streaming}]")
    return data


def _stored_modes(section: Any) -> Any:
    """A section validated from ``modes:`` in its stored form (the list's entries validated, and
    their errors located, in the list)."""
    modes = section.modes
    if modes is None:
        return section
    update = {"retrieval_mode": modes[0], "sparse_mode": modes[-1]}
    return section.model_copy(update={**update, "modes": None} if len(modes) == 2 else update)


def _mode_paths(section: Any, from_modes: bool) -> list[str]:
    if from_modes:
        return [f"modes.{i}" for i in range(section.num_modes)]
    return ["retrieval_mode", "sparse_mode"]


def _check_modes(section: Any, from_modes: bool) -> None:
    """Distinct modes in a ``modes`` list, block sizes that divide one another, each a size the
    executor takes."""
    configs, paths = section.mode_configs(), _mode_paths(section, from_modes)
    # (retrieval_mode and sparse_mode may be the same mode: the fixed router's all-full baseline)
    for j, b in enumerate(configs if from_modes else []):
        for i in range(j):
            if configs[i] == b:
                raise ValueError(
                    f"{paths[i]} and {paths[j]} are the same mode ({b.name}, same parameters): each mode may appear "
                    "once; drop one, or give the two different parameters"
                )
    sized: list[tuple[str, int]] = []
    for p, c in zip(paths, configs):
        size = getattr(c, "block_size", None)
        if size:
            sized.append((p, int(size)))
    for j, (pb, b) in enumerate(sized):
        for pa, a in sized[:j]:
            if max(a, b) % min(a, b):
                raise ValueError(
                    f"{pa}.block_size={a} and {pb}.block_size={b} must divide one another so the modes' layouts "
                    "can run in one launch"
                )
    for size in sorted({s for _, s in sized}):
        section.executor.check_layout_block_size(size)


@functools.lru_cache(maxsize=8)
def _build_models(registry_id: int, revision: int) -> type[BaseModel]:  # revision: cache key only
    registry = _REGISTRIES[registry_id]
    # The sections are built at run time, which the checker cannot follow: create_model's annotations
    # reject pydantic's own decorator proxies in __validators__ [dict-item] and unions of run-time-built
    # classes as field types [arg-type]. Those lines carry error-coded ignores.
    elastic = create_model(
        "ElasticSection",
        __base__=ElasticBase,
        __doc__="How heads are routed and run: the paper's {retrieval mode}-{sparse mode} configuration.",
        **_base_elastic_fields(registry),
    )
    evaluation = create_model(
        "EvalSection",
        __base__=Section,
        __doc__="Evaluation: a task and how to run it.",
        task=(registry.config_union("task"), Field(..., description="The task plugin and its parameters.")),
        batch_size=(int, Field(1, ge=1, description="Samples per forward pass (padded batch).")),
        max_new_tokens=(int, Field(12, ge=1, le=4096, description="Greedy tokens generated per sample.")),
        padding_side=(PaddingSide, Field("left", description="Where a batch is padded.")),
    )
    variant = create_model(
        "CompareVariant",
        __base__=Section,
        __doc__="One row of a comparison: a label and the elastic section it runs with.",
        label=(str, Field(..., min_length=1, description="Row label in the report.")),
        elastic=(elastic, Field(..., description="The variant's elastic section (merged onto the recipe's).")),
        adapter=(
            str | None,
            Field(None, description="A trained adapter folder (`elasticfw train` writes <run>/<router>/adapter): the "
                  "variant runs it, with the elastic section stored in it (this variant's `elastic` is then unused)."),
        ),
        __validators__={"_adapter": field_validator("adapter")(_check_adapter_dir)},  # type: ignore[dict-item]
    )
    train_task = create_model(
        "TrainTask",
        __base__=TrainTaskBase,
        __doc__="One task of the training mixture, with its sparsity target.",
        __validators__={"_target": field_validator("target")(_check_target),  # type: ignore[dict-item]
                        "_cost_target": field_validator("cost_target")(_check_cost_target),  # type: ignore[dict-item]
                        "_share_targets": field_validator("share_targets")(_check_share_targets)},  # type: ignore[dict-item]
        task=(registry.config_union("task"), Field(..., description="The task plugin; its num_samples is the training pool.")),
        label=(str | None, Field(None, min_length=1, max_length=100, pattern=_LABEL,
                                 description="Name in logs and summaries (default: the task's name).")),
        category=(
            Category | None,
            Field(None, description="sensitive or robust (default: the task's own); picks the default target."),
        ),
        target=(
            Target | None,
            Field(None, description="Sparsity target t in [0, 1], or an interval [t_lo, t_hi] (default: train.targets[category])."),
        ),
        cost_target=(
            Target | None,
            Field(None, description="With train.constraint: cost, its expected-cost target (a relative cost, full "
                  "attention = 1), or an interval [lo, hi] (default: train.cost_targets[category])."),
        ),
        share_targets=(
            dict[str, Target] | None,
            Field(None, description="Its per-mode share targets, {mode: share of heads or [lo, hi]}, in place of "
                  "train.share_targets[category] (default: those; {} frees this task's shares)."),
        ),
        weight=(float, Field(1.0, gt=0, le=1e6, description="Relative frequency of this task in the mixture.")),
        eval_samples=(int, Field(20, ge=0, le=1_000_000, description="Held-back samples (eval split) for the evaluation after training.")),
    )
    baseline = create_model(
        "TrainBaseline",
        __base__=Section,
        __doc__="A router trained after the main one with the same settings and evaluated on the same samples.",
        label=(str | None, Field(None, min_length=1, max_length=100, pattern=_LABEL,
                                 description="Name in the summary and its folder in the run (default: the router's name).")),
        router=(registry.config_union("router"), Field(..., description="The router to train.")),
        router_lr=(
            float | None,
            Field(None, gt=0, le=10, description="Its own peak learning rate (default: train.router_lr); e.g. "
                  "DuoAttention trains per-head gates at 0.02."),
        ),
    )
    train = create_model(
        "TrainSection",
        __base__=TrainSettings,
        __doc__="Router training (`elasticfw train`).",
        __validators__={"_labels": model_validator(mode="after")(_check_train_labels)},  # type: ignore[dict-item]
        tasks=(list[train_task], Field(..., min_length=1, description="The task mixture.")),  # type: ignore[valid-type]
        baselines=(
            list[baseline],  # type: ignore[valid-type]
            Field(default_factory=list, description="Routers trained and evaluated beside the recipe's (e.g. static)."),
        ),
    )
    sweep_task = create_model(
        "SweepTask",
        __base__=Section,
        __doc__="One task of a comparison sweep.",
        task=(registry.config_union("task"), Field(..., description="The task plugin and its parameters.")),
        label=(str | None, Field(None, min_length=1, max_length=100, pattern=_LABEL,
                                 description="Name in the table (default: the task's name).")),
        category=(Category | None, Field(None, description="sensitive or robust (default: the task's own).")),
    )
    sweep = create_model(
        "SweepSection",
        __base__=SweepSettings,
        __doc__="A comparison sweep (`elasticfw compare`): the compare variants x these tasks x lengths x seeds.",
        tasks=(  # type: ignore[arg-type]
            list[sweep_task] | None,  # type: ignore[valid-type]
            Field(None, min_length=1, description="The tasks (default: the recipe's eval.task)."),
        ),
    )
    recipe = create_model(
        "Recipe",
        __base__=Section,
        __doc__="An elasticfw recipe.",
        description=(str, Field("", description="What this recipe is for.")),
        seed=(int, Field(0, ge=0, le=2**32 - 1,
                         description="Seed of every random choice (samples, router init, Gumbel noise).")),
        model=(ModelSection, Field(ModelSection(), description="The backbone.")),
        elastic=(elastic, Field(elastic(), description="Routing and attention modes.")),  # type: ignore[call-arg]
        eval=(  # type: ignore[arg-type]
            evaluation | None,
            Field(None, description="Evaluation settings (`elasticfw eval`)."),
        ),
        compare=(  # type: ignore[arg-type]
            list[variant] | None,  # type: ignore[valid-type]
            Field(None, description="Variants run on the same samples (`elasticfw compare`)."),
        ),
        train=(  # type: ignore[arg-type]
            train | None,
            Field(None, description="Router training (`elasticfw train`)."),
        ),
        sweep=(  # type: ignore[arg-type]
            sweep | None,
            Field(None, description="What `elasticfw compare` sweeps: tasks, lengths, seeds, timing, run folder."),
        ),
        output_dir=(str | None, Field(None, description="Folder of the run folders of `elasticfw eval` "
                                      "(<output_dir>/eval) and of a compare without sweep: (default: runs).")),
        __validators__={
            "_variants": model_validator(mode="before")(merge_variants),  # type: ignore[dict-item]
            "_sweep": model_validator(mode="after")(check_sweep),  # type: ignore[dict-item]
            "_objective": model_validator(mode="after")(check_train_objective),  # type: ignore[dict-item]
        },
    )
    return recipe


def _check_adapter_dir(value: str | None) -> str | None:
    if value is not None and not (Path(value).expanduser() / "elastic_config.json").is_file():
        raise ValueError(f"{value!r} is not an adapter folder (no elastic_config.json in it)")
    return value


def _check_target(value: Any) -> Any:
    return check_target(value)


def _check_cost_target(value: Any) -> Any:
    return check_cost_target(value)


def _check_share_targets(value: Any) -> Any:
    return check_share_targets(value)


def _check_train_labels(section: Any) -> Any:
    labels = [t.label or t.task.name for t in section.tasks]
    dupes = sorted({label for label in labels if labels.count(label) > 1})
    if dupes:
        raise ValueError(
            f"two training tasks are both called {dupes[0]!r}; give each entry a distinct `label` "
            "(e.g. the same task at two lengths)"
        )
    names = [b.label or b.router.name for b in section.baselines]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"two baselines are both called {dupes[0]!r}; give each a distinct `label`")
    if "full" in names:
        raise ValueError("a baseline may not be called 'full': the summary reserves it for full attention")
    return section


def sweep_task_entries(recipe: Any) -> list[tuple[str, Any, str | None]]:
    """(label, task config, category override) of every task a recipe's sweep runs: ``sweep.tasks``,
    or the ``eval.task`` when the recipe has no sweep tasks (none: no task at all)."""
    entries = recipe.sweep.tasks if recipe.sweep is not None and recipe.sweep.tasks else None
    if entries is not None:
        return [(e.label or e.task.name, e.task, e.category) for e in entries]
    return [] if recipe.eval is None else [(recipe.eval.task.name, recipe.eval.task, None)]


def task_at_length(config: Any, length: int | None) -> Any:
    """A task config with ``context_tokens`` set to ``length`` (validated like the recipe's)."""
    if length is None:
        return config
    return type(config).model_validate({**config.model_dump(), "context_tokens": length})


def check_sweep(recipe: Any) -> Any:
    """Cross-section checks of ``compare`` and ``sweep``: labels, the reference, cells, lengths."""
    variants = [v.label for v in recipe.compare or []]
    dupes = sorted({v for v in variants if variants.count(v) > 1})
    if dupes:
        raise ValueError(f"compare: two variants are both labelled {dupes[0]!r}; labels name rows and must differ")
    sweep = recipe.sweep
    if sweep is None:
        return recipe
    tasks = sweep_task_entries(recipe)
    if not tasks:
        raise ValueError("sweep.tasks: none given and the recipe has no eval.task to fall back on")
    labels = [label for label, _, _ in tasks]
    dupes = sorted({t for t in labels if labels.count(t) > 1})
    if dupes:
        raise ValueError(f"sweep.tasks: two tasks are both labelled {dupes[0]!r}; give each a distinct `label`")
    if variants and sweep.reference is not None and sweep.reference not in variants:
        raise ValueError(f"sweep.reference = {sweep.reference!r}: not a compare label ({suggest(sweep.reference, variants)}"
                         f"labels: {', '.join(variants)})")
    if sweep.padding_side == "right" and sweep.batch_size > 1:
        raise ValueError("sweep.padding_side = 'right' with batch_size > 1: a decoder-only model would generate "
                         "after the padding of shorter prompts; use left padding")
    seen: dict[tuple[str, str, int | None, int], int] = {}
    for i, cell in enumerate(sweep.cells or []):
        key = (cell.variant, cell.task, cell.length, recipe.seed if cell.seed is None else cell.seed)
        if key in seen:
            raise ValueError(f"sweep.cells.{i} repeats sweep.cells.{seen[key]} ({cell.variant}, {cell.task}, "
                             f"length {cell.length}, seed {key[3]}): each cell runs once")
        seen[key] = i
        if variants and cell.variant not in variants:
            raise ValueError(f"sweep.cells.{i}.variant = {cell.variant!r}: not a compare label "
                             f"({suggest(cell.variant, variants)}labels: {', '.join(variants)})")
        if cell.task not in labels:
            raise ValueError(f"sweep.cells.{i}.task = {cell.task!r}: not a sweep task label "
                             f"({suggest(cell.task, labels)}labels: {', '.join(labels)})")
    wanted = {(label, length) for label, _, _ in tasks for length in sweep.lengths or [None]}
    wanted |= {(c.task, c.length) for c in sweep.cells or []}
    configs = {label: config for label, config, _ in tasks}
    for label, length in sorted(wanted, key=lambda x: (x[0], x[1] or 0)):
        if length is None:
            continue
        config = configs[label]
        if "context_tokens" not in type(config).model_fields:
            raise ValueError(f"sweep.lengths: task {label!r} ({config.name}) has no context_tokens field, so it has "
                             "no length to sweep; sweep it in a recipe without lengths, or use sweep.cells")
        try:
            task_at_length(config, length)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            raise ValueError(f"sweep.lengths: {length} is not a valid context_tokens for task {label!r}: "
                             f"{first['msg']}") from None
    return recipe


def merge_variants(data: Any) -> Any:
    """Each ``compare[i].elastic`` is merged onto the recipe's ``elastic`` before validation. A
    plugin section of the variant that names its plugin (``router: {name: fixed, ...}``) is taken
    whole: it does not inherit the recipe's keys for that plugin, which the user did not write
    there. One without ``name`` changes keys of the recipe's section."""
    if not isinstance(data, dict) or not isinstance(data.get("compare"), list):
        return data
    base = data.get("elastic") or {}
    merged = []
    for item in data["compare"]:
        if isinstance(item, dict) and isinstance(item.get("elastic", {}), dict):
            own = item.get("elastic") or {}
            named = {k for k, v in own.items() if k in PLUGIN_FIELDS and isinstance(v, dict) and "name" in v}
            trimmed = {k: v for k, v in base.items() if k not in named} if isinstance(base, dict) else base
            item = {**item, "elastic": merge_sections(trimmed, own)}
        merged.append(item)
    return {**data, "compare": merged}


_REGISTRIES: dict[int, Registry] = {}


def recipe_defaults(registry: Registry | None = None) -> dict[str, Any]:
    """The recipe every field of which is its default, as plain data (empty if some section has
    no default because its default plugin is not installed)."""
    registry = registry or get_registry()
    try:
        return recipe_model(registry).model_validate({}, context={"registry": registry}).model_dump(mode="json")
    except ValidationError:
        return {}


def recipe_model(registry: Registry | None = None) -> type[BaseModel]:
    """The pydantic ``Recipe`` class for a registry (the process-wide one by default)."""
    registry = registry or get_registry()
    _REGISTRIES[id(registry)] = registry
    return _build_models(id(registry), registry.revision)
