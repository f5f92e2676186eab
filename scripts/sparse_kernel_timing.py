"""Where the Triton sparse-attention kernels spend their time, per mode, on a CUDA device.

    python scripts/sparse_kernel_timing.py --json results/bench/NAME/kernel_timing.json      # 128K, Llama-3.1-8B shape
    python scripts/sparse_kernel_timing.py --tokens 32768 --modes moba --profile

For each mode's default layout on the attention benchmark's structured q/k (XAttention, NSA,
streaming: block layouts; MoBA: per-token row selection), prints the median of ``--repeats``
CUDA-event-timed calls against one dense causal cuDNN SDPA layer:

* ``chunk share of the causal layer`` — the key chunks the kernel's tiles visit against those of
  the full causal layer (its expected time as a share of its density-1 time);
* ``plan`` — the block-sparse kernel's work lists alone (``plan_work``), and ``kernel`` — the
  kernel with those lists given (what a reusable layout costs per layer), and ``call`` — both;
* for a row selection without a window (per-token MoBA): ``gather plan`` (``gather_plan``) and
  ``gather call`` (``gathered_selection_attention``), with the key chunks each tile visits against
  the keys each row sees, in chunks (``chunk_ratio``: how much the tile union costs);
* with ``--tiles BM,BN,WARPS,STAGES ...`` the kernel under those launch configurations, and with
  ``--gather-tiles ...`` the gathered call under those;
* with ``--triton-work-lists`` the ``plan``, ``kernel`` and ``call`` rows use torch's work lists
  (:func:`~elasticfw.kernels.work_lists.work_lists`), and ``plan, triton lists`` and
  ``call, triton lists`` rows time those built by the Triton kernel of
  :mod:`elasticfw.kernels.work_lists` (``TRITON_WORK_LISTS``, the default), with whether its lists
  equal torch's; without it every row uses the default builder;
* with ``--compact-lists`` the ``plan, compact`` and ``kernel, compact`` rows: the compact work
  lists (one flat list and a start offset per tile, ``plan_work(compact=True)``, by the default
  builder) and the kernel over them, with both forms' sizes in the notes;
* with ``--options TMA,REVERSE[,GROUP] ...`` (each 0 or 1: ``USE_TMA``, ``REVERSE_TILES`` and
  ``GROUP_HEADS``, default 1, of the kernel module), the kernel under each option set and each
  tile configuration (the defaults and
  ``--tiles``) on the density benchmark's random block layouts of 128-token blocks at densities
  1 and 0.5 (``option ...`` rows), its output's largest difference from the first set's
  (``max_abs_diff`` in the notes).

``--profile`` prints a ``torch.profiler`` table of each call (the GPU kernels and torch ops of the
lists). ``--json FILE`` also writes the figures with the environment.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from xattention_planning_timing import (  # the script's folder is sys.path[0]
    add_shape_arguments,
    dense_layer,
    structured_layer,
    timed,
)

from elasticfw.provenance import environment
from elasticfw.testing.modes import make_mode


def _tiles(spec: str):  # type: ignore[no-untyped-def]
    from elasticfw.kernels.block_sparse_attention import Tiles

    bm, bn, warps, stages = (int(x) for x in spec.split(","))
    return Tiles(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)


def _option_values(option: str) -> tuple[bool, bool, bool]:
    """``TMA,REVERSE[,GROUP]`` (each 0 or 1; GROUP defaults to 1) as the kernel module's switches."""
    values = [bool(int(x)) for x in option.split(",")]
    if len(values) not in (2, 3):
        raise SystemExit(f"--options {option!r}: expected TMA,REVERSE[,GROUP], each 0 or 1")
    return values[0], values[1], values[2] if len(values) == 3 else True


def _option_sweep(args, q, k, v, seq, scale, results, notes) -> None:  # type: ignore[no-untyped-def]
    """The ``--options`` rows (module docstring)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from elasticfw.bench.density import random_block_layout
    from elasticfw.kernels import block_sparse_attention as bsa
    from elasticfw.kernels import work_lists as wl

    saved = bsa.USE_TMA, bsa.REVERSE_TILES, bsa.GROUP_HEADS
    tiles = [bsa.DEFAULT_TILES] + [_tiles(spec) for spec in args.tiles]
    for density in (1.0, 0.5):
        layout = random_block_layout(seq, q.shape[1], 128, density)
        first = None
        for option in args.options:
            bsa.USE_TMA, bsa.REVERSE_TILES, bsa.GROUP_HEADS = _option_values(option)
            for t in tiles:
                label = f"option {option} tiles {t.block_m},{t.block_n},{t.num_warps},{t.num_stages} @{density}"
                plan = wl.plan_work(bsa.layout_selection(layout), seq, t)  # type: ignore[arg-type]
                try:
                    call = lambda t=t, w=plan, lay=layout: bsa.block_layout_attention(  # noqa: E731
                        q, k, v, lay, seq, scale=scale, tiles=t, plan=w)
                    results[label] = timed(call, args.repeats)
                    out = call()[0].float()
                except (CompilationError, OutOfResources, RuntimeError) as exc:  # report it, go on
                    print(f"{label}: {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                first = out if first is None else first
                notes[f"{label}: max_abs_diff"] = (out - first).abs().max().item()
                print(f"{label}: {results[label]:.2f} ms", flush=True)
        del layout
    bsa.USE_TMA, bsa.REVERSE_TILES, bsa.GROUP_HEADS = saved
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(p)
    p.add_argument("--modes", nargs="+", default=["xattention", "nsa", "moba", "streaming"])
    p.add_argument("--tiles", nargs="*", default=[], metavar="BM,BN,WARPS,STAGES")
    p.add_argument("--gather-tiles", nargs="*", default=[], metavar="BM,BN,WARPS,STAGES")
    p.add_argument("--options", nargs="*", default=[], metavar="TMA,REVERSE[,GROUP]")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--triton-work-lists", action="store_true",
                   help="also the plan and the call with the work lists built by elasticfw.kernels.work_lists")
    p.add_argument("--compact-lists", action="store_true",
                   help="also the plan and the kernel with the compact work lists (plan_work(compact=True))")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    q, k, v, seq = structured_layer(args)
    n, hq, hkv, d = args.tokens, args.query_heads, args.kv_heads, args.head_dim
    dense = dense_layer(q, k, v)
    scale = d**-0.5
    from elasticfw.kernels import block_sparse_attention as bsa
    from elasticfw.kernels import gather_attention as ga
    from elasticfw.kernels import work_lists as wl

    results: dict[str, float] = {}
    notes: dict[str, float] = {}
    profiles = []
    default_lists = wl.TRITON_WORK_LISTS  # the module default (the Triton builder)
    with torch.no_grad():
        results["dense cuDNN SDPA layer"] = timed(dense, args.repeats)
        if args.options:
            _option_sweep(args, q, k, v, seq, scale, results, notes)
        for name in args.modes:
            layout = make_mode(name, {}).build_layout(q, k, seq)
            reason = bsa.unsupported_layout(layout)
            if reason is not None:
                print(f"{name}: not a layout the kernel takes ({reason})")
                continue
            selection = bsa.layout_selection(layout)
            assert selection is not None
            # the plan / kernel / call rows: torch's lists when comparing builders, else the default builder
            wl.TRITON_WORK_LISTS = default_lists and not args.triton_work_lists
            plan = wl.plan_work(selection, seq)
            # the key chunks the tiles visit, against those of the full causal layer: the kernel's time
            # at this layout should be about this share of its time at density 1 (``--options`` rows)
            tile_end = torch.clamp(torch.arange(1, plan.clean_count.shape[-1] + 1) * plan.block_m, max=n)
            causal = int(((tile_end + plan.block_n - 1) // plan.block_n).sum()) * hq
            visits = int((plan.clean_count + plan.masked_count).sum()) * (hq // selection.selected.shape[1])
            notes[f"{name}: chunk share of the causal layer"] = visits / causal
            results[f"{name}: plan"] = timed(lambda s=selection: wl.plan_work(s, seq), args.repeats)
            results[f"{name}: kernel"] = timed(
                lambda s=selection, w=plan: bsa.row_selection_attention(q, k, v, s, seq, scale=scale, plan=w),
                args.repeats)
            results[f"{name}: call"] = timed(
                lambda s=selection: bsa.row_selection_attention(q, k, v, s, seq, scale=scale), args.repeats)
            calls = [(f"{name} tiles", lambda s=selection: bsa.row_selection_attention(q, k, v, s, seq, scale=scale))]
            if args.triton_work_lists:  # the same plan and call with the lists built by the Triton kernel
                triton_plan = wl.WorkPlan(*wl.work_lists_triton(selection, seq, plan.block_m, plan.block_n),
                                          plan.block_m, plan.block_n)
                same = all(torch.equal(a, b) for a, b in zip(
                    (plan.clean, plan.clean_count, plan.masked, plan.masked_count),
                    (triton_plan.clean, triton_plan.clean_count, triton_plan.masked, triton_plan.masked_count)))
                notes[f"{name}: triton work lists equal torch's"] = float(same)
                wl.TRITON_WORK_LISTS = True
                try:
                    results[f"{name}: plan, triton lists"] = timed(lambda s=selection: wl.plan_work(s, seq),
                                                                   args.repeats)
                    results[f"{name}: call, triton lists"] = timed(
                        lambda s=selection: bsa.row_selection_attention(q, k, v, s, seq, scale=scale), args.repeats)
                finally:
                    wl.TRITON_WORK_LISTS = False
            if args.compact_lists:  # the compact form (one flat list, a start per tile) and the kernel over it
                saved_lists, wl.TRITON_WORK_LISTS = wl.TRITON_WORK_LISTS, default_lists  # the default builder
                try:
                    compact = wl.plan_work(selection, seq, compact=True)
                    notes[f"{name}: dense lists, MB"] = wl.dense_list_bytes(
                        selection, seq, plan.block_m, plan.block_n) / 1e6
                    notes[f"{name}: compact lists, MB"] = (
                        compact.clean.numel() * 4 + compact.clean_count.numel() * 16) / 1e6
                    results[f"{name}: plan, compact"] = timed(
                        lambda s=selection: wl.plan_work(s, seq, compact=True), args.repeats)
                    results[f"{name}: kernel, compact"] = timed(
                        lambda s=selection, w=compact: bsa.row_selection_attention(q, k, v, s, seq, scale=scale,
                                                                                   plan=w), args.repeats)
                    del compact
                finally:
                    wl.TRITON_WORK_LISTS = saved_lists
            for spec in args.tiles:
                tiles = _tiles(spec)
                results[f"{name}: call, tiles {spec}"] = timed(
                    lambda s=selection, t=tiles: bsa.row_selection_attention(q, k, v, s, seq, scale=scale, tiles=t),
                    args.repeats)
            if ga.unsupported_selection(selection) is None:
                # the keys each row sees: of every selected group, the part at or before the row
                starts = torch.arange(selection.selected.shape[-1], device=q.device) * selection.group_size
                seen = (torch.arange(n, device=q.device)[:, None] + 1 - starts[None, :]).clamp(0, selection.group_size)
                keys = torch.einsum("bhsg,sg->bhs", selection.selected.float(), seen.float())
                per_row = keys.mean().item() / plan.block_n
                per_tile = (plan.clean_count + plan.masked_count).float().mean().item()
                notes[f"{name}: key chunks per tile (union)"] = per_tile
                notes[f"{name}: key chunks per row (selected)"] = per_row
                notes[f"{name}: chunk_ratio"] = per_tile / per_row
                results[f"{name}: gather plan"] = timed(
                    lambda s=selection: ga.gather_plan(s, 1, ga.DEFAULT_TILES.block_m), args.repeats)
                results[f"{name}: gather call"] = timed(
                    lambda s=selection: ga.gathered_selection_attention(q, k, v, s, seq, scale=scale), args.repeats)
                calls.append((f"{name} gather",
                              lambda s=selection: ga.gathered_selection_attention(q, k, v, s, seq, scale=scale)))
                for spec in args.gather_tiles:
                    results[f"{name}: gather call, tiles {spec}"] = timed(
                        lambda s=selection, t=_tiles(spec): ga.gathered_selection_attention(
                            q, k, v, s, seq, scale=scale, tiles=t), args.repeats)
            if args.profile:
                from torch.profiler import ProfilerActivity, profile

                for label, fn in calls:
                    fn()
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                        fn()
                        torch.cuda.synchronize()
                    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
                    print(f"-- profile: {label}\n{table}")
                    profiles.append({"call": label, "table": table})
            del layout, selection, plan
            torch.cuda.empty_cache()
    wl.TRITON_WORK_LISTS = default_lists  # the module default back for whoever imported it
    base = results["dense cuDNN SDPA layer"]
    print(f"{torch.cuda.get_device_name()}: B=1, {n} tokens, Hq={hq}, Hkv={hkv}, d={d}, bf16, structured inputs")
    for name, ms in results.items():
        print(f"{name:44s} {ms:9.2f} ms  {ms / base:6.3f}x dense")
    for name, value in notes.items():
        print(f"{name}: {value:.3g}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"benchmark": "sparse_kernel_timing", "environment": environment(q.device), "tokens": n,
                  "ms": results, "ratio_vs_dense": {k_: ms / base for k_, ms in results.items()}, "notes": notes,
                  "profiles": profiles}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
