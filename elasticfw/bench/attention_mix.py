"""The attention benchmark's K-way layer (``--mix``): the KV heads of one layer split among several
modes, e.g. ``--mix full=1 xattention=3 streaming=4`` on 8 KV heads (1/8 full, 3/8 XAttention, 4/8
streaming), run the way the runtime runs a K-mode layer at inference
(:func:`~elasticfw.attention.mode.attend_modes`: one executor call over the per-head combination of
the modes' layouts), and each mode's group of heads alone (the sum of its parts).

Rows per executor ``E`` other than ``flex``, all with the modes' layouts prebuilt (as the
``E:hybrid(...)`` rows):

* ``check:E:mix(...)``: the mixed call's output against every group's heads run alone through the
  reference executor, at the timed length (an independent path: sliced heads, one layout each);
* ``E:mix-part:<mode>``: the group's heads alone (q, k, v sliced to them, the layout built on them);
* ``E:mix(...)``: the mixed call; it records ``parts_ms_sum`` and ``ratio_vs_parts`` (its time over
  the sum of the parts' times).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from elasticfw.attention.layout import BlockLayout
from elasticfw.attention.mode import AttentionMode, attend_modes
from elasticfw.attention.seq import SeqInfo
from elasticfw.bench.attention_setup import inner_flex
from elasticfw.bench.timing import Recorder, make_executor, time_ms

__all__ = ["mix_groups", "mix_index", "mix_label", "mix_rows"]


def mix_groups(items: list[str], kv_heads: int) -> list[tuple[str, int]]:
    """``["full=1", "xattention=3", "streaming=4"]`` -> ``[("full", 1), ...]``: KV heads per mode, in
    routing order, summing to ``kv_heads``."""
    groups: list[tuple[str, int]] = []
    for item in items:
        name, sep, raw = item.partition("=")
        if not (sep and name and raw.isdigit() and int(raw) > 0):
            raise SystemExit(f"--mix {item!r}: expected MODE=KV_HEADS with a positive count, e.g. full=1")
        if any(name == seen for seen, _ in groups):
            raise SystemExit(f"--mix names mode {name!r} twice")
        groups.append((name, int(raw)))
    if len(groups) < 2:
        raise SystemExit(f"--mix {' '.join(items)}: name at least two modes")
    total = sum(n for _, n in groups)
    if total != kv_heads:
        raise SystemExit(f"--mix {' '.join(items)}: the counts sum to {total} KV heads, --kv-heads is {kv_heads}")
    return groups


def mix_label(groups: list[tuple[str, int]], kv_heads: int) -> str:
    return "mix(" + ",".join(f"{name}={n}/{kv_heads}" for name, n in groups) + ")"


def mix_index(groups: list[tuple[str, int]], batch: int, q_heads: int, kv_heads: int,
              device: torch.device) -> torch.Tensor:
    """(B, Hq) int64: each query head's position in ``groups``, KV heads assigned in order."""
    per_kv = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, (_, n) in enumerate(groups)])
    return per_kv.repeat_interleave(q_heads // kv_heads)[None, :].expand(batch, q_heads).to(device)


def mix_rows(
    S: int,
    args: argparse.Namespace,
    rec: Recorder,
    device: torch.device,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    seq: SeqInfo,
    layouts: dict[str, tuple[AttentionMode, BlockLayout]],
    finish: Any,
) -> None:
    """The ``--mix`` rows of length ``S`` (module docstring); ``layouts`` are the modes' prebuilt
    layouts of this length, ``finish(row, ms, dense=False)`` the benchmark's row completion (ms and
    the ratio to the baseline)."""
    from elasticfw.testing.modes import TOLERANCE, rel_rms

    q0, k0, v0 = qkv
    hq, hkv, D = q0.shape[1], k0.shape[1], q0.shape[-1]
    group = hq // hkv
    scale = D**-0.5
    groups = mix_groups(args.mix, hkv)
    missing = [name for name, _ in groups if name not in layouts]
    if missing:
        raise SystemExit(f"--mix names {missing}, not among the benchmarked modes {sorted(layouts)} (see --modes)")
    label = mix_label(groups, hkv)
    modes = [layouts[name][0] for name, _ in groups]
    full_layouts = [layouts[name][1] for name, _ in groups]
    index = mix_index(groups, q0.shape[0], hq, hkv, device)
    index_host = index.cpu()
    spans, start = [], 0
    for _, n in groups:
        spans.append((start, start + n))
        start += n
    reference = make_executor("reference")

    def part_inputs(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BlockLayout]:
        a, b = spans[i]
        q, k, v = q0[:, a * group:b * group], k0[:, a:b], v0[:, a:b]
        with torch.no_grad():
            layout = modes[i].build_layout(q, k, seq)
        return q, k, v, layout

    for ex_name in [n for n in args.executors if n != "flex"]:
        executor = make_executor(ex_name, **inner_flex(ex_name, args))

        def mixed(executor: Any = executor) -> torch.Tensor:
            return attend_modes(q0, k0, v0, seq, executor, modes=modes, index=index, layouts=full_layouts,
                                scale=scale, index_host=index_host).out

        def check_body(row: dict[str, Any], mixed: Any = mixed, ex_name: str = ex_name) -> None:
            with torch.no_grad():
                out = mixed().float()
                errors = {}
                for i, (name, _) in enumerate(groups):
                    q, k, v, layout = part_inputs(i)
                    ref = modes[i].attend(q.float(), k.float(), v.float(), seq, reference, scale=scale,
                                          layout=layout).out
                    a, b = spans[i]
                    errors[name] = rel_rms(out[:, a * group:b * group], ref.float())
            tol = TOLERANCE[q0.dtype]
            row["out_rel_rms"], row["tolerance"] = errors, tol
            bad = [f"{name} heads rel RMS {e:.2e}" for name, e in errors.items() if not e < tol]
            if bad:
                raise AssertionError(f"{ex_name} {label} vs each group alone (reference): " + ", ".join(bad))

        rec.run({"seq": S, "name": f"check:{ex_name}:{label}", "kind": "check"}, check_body)
        parts: list[float | None] = []
        for i, (name, _) in enumerate(groups):

            def part_body(row: dict[str, Any], i: int = i, executor: Any = executor) -> None:
                q, k, v, layout = part_inputs(i)
                row["kv_heads"] = groups[i][1]

                def fn() -> None:
                    with torch.no_grad():
                        modes[i].attend(q, k, v, seq, executor, scale=scale, layout=layout)

                finish(row, time_ms(fn, device, args), dense=False)

            row = rec.run({"seq": S, "name": f"{ex_name}:mix-part:{name}", "kind": "fwd"}, part_body)
            parts.append(row.get("ms"))

        def mix_body(row: dict[str, Any], mixed: Any = mixed, parts: list[float | None] = parts) -> None:
            def fn() -> None:
                with torch.no_grad():
                    mixed()

            finish(row, time_ms(fn, device, args), dense=False)
            row["kv_heads"] = dict(groups)
            if all(p is not None for p in parts):
                row["parts_ms_sum"] = sum(p for p in parts if p is not None)
                row["ratio_vs_parts"] = row["ms"] / row["parts_ms_sum"]

        rec.run({"seq": S, "name": f"{ex_name}:{label}", "kind": "fwd"}, mix_body)
