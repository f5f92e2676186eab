"""How input-adaptive each method's routing is, from the per-sample decisions of a sweep.

The paper's claim is that the router assigns heads *per input*: more full attention on
retrieval, less on robust tasks. For each variant whose rows carry decisions this module reports

* ``retrieval_heads[category]`` — mean number of KV heads routed to the retrieval mode per sample;
* ``adaptive_samples`` — the fraction of samples whose assignment differs anywhere from the
  variant's most common one (per head: the majority decision; 0 for a static assignment);
* ``task_dependent_heads`` — heads whose retrieval frequency differs by more than
  ``threshold`` between the two task categories;
* ``msr_by_task[task]`` — the per-sample MSR's mean and standard deviation over the task's samples
  (a spread of 0 everywhere is a static assignment in disguise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CATEGORIES = ("sensitive", "robust")


@dataclass(frozen=True)
class RoutingSummary:
    variant: str
    samples: int
    heads: int  # routed (layer, KV head) pairs
    retrieval_heads: dict[str, float] = field(default_factory=dict)
    adaptive_samples: float = 0.0
    task_dependent_heads: list[tuple[int, int, float, float]] = field(default_factory=list)  # (layer, head, sens, rob)
    msr_by_task: dict[str, tuple[float, float]] = field(default_factory=dict)  # task: (mean, std)


def routing_summaries(
    rows: Sequence[dict[str, Any]], variants: Sequence[str], *, threshold: float = 0.1
) -> list[RoutingSummary]:
    """One summary per variant (in ``variants`` order) whose rows have decisions."""
    out = []
    for variant in variants:
        own = [r for r in rows if r["variant"] == variant and r.get("decisions")]
        if not own:
            continue
        grids = [r["decisions"] for r in own]
        layers, width = len(grids[0]), len(grids[0][0])
        heads = layers * width
        flat = [[d for layer in g for d in layer] for g in grids]
        if any(len(f) != heads for f in flat):
            continue  # rows of different layouts (a changed model): nothing comparable to summarise
        majority = [2 * sum(f[h] for f in flat) > len(flat) for h in range(heads)]
        adaptive = sum(any(bool(f[h]) != majority[h] for h in range(heads)) for f in flat) / len(flat)
        retrieval: dict[str, float] = {}
        frequency: dict[str, list[float]] = {}
        for category in CATEGORIES:
            members = [f for f, r in zip(flat, own) if r["category"] == category]
            if members:
                retrieval[category] = sum(heads - sum(f) for f in members) / len(members)
                frequency[category] = [sum(1 - f[h] for f in members) / len(members) for h in range(heads)]
        dependent = []
        if len(frequency) == 2:
            sens, rob = frequency["sensitive"], frequency["robust"]
            for h in range(heads):
                if abs(sens[h] - rob[h]) > threshold:
                    dependent.append((own[0]["routed_layers"][h // width] if own[0].get("routed_layers") else h // width,
                                      h % width, sens[h], rob[h]))
        by_task: dict[str, tuple[float, float]] = {}
        for task in dict.fromkeys(r.get("task") for r in own if r.get("msr") is not None):
            values = [float(r["msr"]) for r in own if r.get("task") == task and r.get("msr") is not None]
            mean = sum(values) / len(values)
            by_task[str(task)] = (mean, (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5)
        out.append(RoutingSummary(variant, len(own), heads, retrieval, adaptive, dependent, by_task))
    return out


def routing_markdown(summaries: Sequence[RoutingSummary]) -> str:
    """The "Routing" section of ``table.md``."""
    if not summaries:
        return ""
    lines = [
        "## Routing: how input-adaptive is each method?",
        "",
        "retrieval heads = mean KV heads per sample in the retrieval mode (e.g. full attention), of all routed heads; "
        "adaptive samples = fraction of samples whose assignment differs anywhere from the method's majority "
        "assignment; task-dependent heads = heads whose retrieval frequency differs by more than 0.1 between "
        "sensitive and robust tasks (layer/head: sensitive vs robust).",
        "",
        "| variant | heads | retrieval heads, sensitive | robust | adaptive samples | task-dependent heads |",
        "|:--|--:|--:|--:|--:|:--|",
    ]
    for s in summaries:
        dependent = ", ".join(f"L{layer}/H{head}: {a:.2f} vs {b:.2f}" for layer, head, a, b in s.task_dependent_heads[:6])
        more = len(s.task_dependent_heads) - 6
        dependent += f", +{more} more" if more > 0 else ""
        cells = [
            s.variant.replace("|", "\\|"), str(s.heads),
            *(f"{s.retrieval_heads[c]:.1f}" if c in s.retrieval_heads else "—" for c in CATEGORIES),
            f"{s.adaptive_samples:.2f}", dependent or "none",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    spread = [s for s in summaries if s.msr_by_task]
    if spread:
        lines += ["", "Per-task MSR, mean ± standard deviation over samples:", "",
                  "| variant | " + " | ".join(["task: MSR"]) + " |", "|:--|:--|"]
        for s in spread:
            text = ", ".join(f"{t}: {m:.3f} ± {d:.3f}" for t, (m, d) in s.msr_by_task.items())
            lines.append(f"| {s.variant.replace('|', chr(92) + '|')} | {text} |")
    return "\n".join(lines) + "\n"
