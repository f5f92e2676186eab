"""What the attention input checks cost on a GPU: prefill and decode of an elastic model with the
checks as shipped vs patched out, in the same process.

    python tools/validation_overhead.py --out results/bench/validation-overhead/validation_overhead_h200.json

The model is SmolLM2-135M's shape (30 layers, 9 query / 3 KV heads, d=64) with random weights
(no download), FA-SSA with a random MLP router on the `sdpa` executor, bf16, batch 1. Every
attention call runs ``Executor.check_inputs`` (shapes, devices, the layout's grid: one host read
for the grid) and every ``SeqInfo`` checks its values (one host read); "unchecked" replaces both
with no-ops. Ratios are checked / unchecked from interleaved repetitions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


@contextmanager
def unchecked() -> Any:
    import elasticfw.attention.executor as executor_module
    import elasticfw.attention.mode as mode_module
    from elasticfw.attention.seq import SeqInfo

    saved = (executor_module.check_attention_inputs, mode_module.check_attention_inputs, SeqInfo.__post_init__)
    executor_module.check_attention_inputs = lambda *a, **k: None  # type: ignore[assignment]
    mode_module.check_attention_inputs = lambda *a, **k: None  # type: ignore[assignment]
    SeqInfo.__post_init__ = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        executor_module.check_attention_inputs, mode_module.check_attention_inputs, SeqInfo.__post_init__ = saved


def timed(fn: Any) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; choose another --out")
    from transformers import LlamaConfig, LlamaForCausalLM

    from elasticfw.atomic import atomic_write_text
    from elasticfw.model.loading import make_elastic
    from elasticfw.provenance import environment
    from elasticfw.recipe import validate_recipe_data

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=32768)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    section = validate_recipe_data({"elastic": {
        "retrieval_mode": {"name": "full", "block_size": 64},
        "sparse_mode": {"name": "streaming", "sink_tokens": 64, "local_tokens": 256, "block_size": 64},
        "executor": {"name": "sdpa"}, "router": {"name": "mlp"}}}).elastic
    elastic = make_elastic(model, None, section)
    rows = []
    with torch.no_grad():
        for length in args.lengths:
            ids = torch.randint(0, cfg.vocab_size, (1, length), device="cuda")
            mask = torch.ones_like(ids)

            def prefill(ids: torch.Tensor = ids, mask: torch.Tensor = mask) -> None:
                elastic(input_ids=ids, attention_mask=mask)

            def generate(ids: torch.Tensor = ids, mask: torch.Tensor = mask) -> None:
                elastic.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.decode_steps,
                                 min_new_tokens=args.decode_steps, do_sample=False, pad_token_id=0)

            prefill(), generate()  # warm-up (both variants share kernels)
            times: dict[str, dict[str, list[float]]] = {"checked": {"prefill": [], "generate": []},
                                                        "unchecked": {"prefill": [], "generate": []}}
            for _ in range(args.reps):
                for variant in ("checked", "unchecked"):
                    if variant == "unchecked":
                        with unchecked():
                            times[variant]["prefill"].append(timed(prefill))
                            times[variant]["generate"].append(timed(generate))
                    else:
                        times[variant]["prefill"].append(timed(prefill))
                        times[variant]["generate"].append(timed(generate))
            row: dict[str, Any] = {"length": length, "decode_steps": args.decode_steps}
            for variant, t in times.items():
                p, g = statistics.median(t["prefill"]), statistics.median(t["generate"])
                row[variant] = {"prefill_ms": 1e3 * p, "decode_step_ms": 1e3 * (g - p) / args.decode_steps}
            row["prefill_ratio"] = row["checked"]["prefill_ms"] / row["unchecked"]["prefill_ms"]
            row["decode_step_ratio"] = row["checked"]["decode_step_ms"] / row["unchecked"]["decode_step_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = {"benchmark": "tools/validation_overhead.py", "environment": environment(torch.device("cuda")),
              "model": "SmolLM2-135M shape, random weights, bf16, FA-SSA, mlp router (random), sdpa executor",
              "reps": args.reps, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
