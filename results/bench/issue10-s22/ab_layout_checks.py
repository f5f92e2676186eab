"""In-process A/B of the split executor's routed decode call's host time: layouts checked once per
step geometry (new) vs at every call (old behaviour, emulated by a check at every call)."""
import os, sys, time, json, statistics
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, "tools")
import decode_host_timing as t
from elasticfw.kernels import decode_attention as dm
dm._decode_split_kernel = dm._merge_kernel = t._NoLaunch()
import torch
from dataclasses import replace
from elasticfw.attention.seq import SeqInfo
from elasticfw.attention.inputs import check_layout
from elasticfw.registry import get_registry
torch.set_num_threads(1)
dev = torch.device("cpu")
S = 2048
q = torch.randn(1, 32, 1, 128); k = torch.randn(1, 8, S, 128); v = torch.randn(1, 8, S, 128)
seq = SeqInfo.dense(1, 1, S, dev)
reg = get_registry()
def mode(n, **c): return reg.make("sparse_mode", reg.entry("sparse_mode", n).config_class(**c))
lr = replace(mode("full", block_size=64).build_layout(q, k, seq), reusable=True)
ls = replace(mode("streaming", sink_tokens=128, local_tokens=2048, block_size=64).build_layout(q, k, seq), reusable=True)
hard = torch.zeros(1, 32, dtype=torch.bool); hard[:, 4:] = True
def make():
    return reg.make("executor", reg.entry("executor", "split").config_class(decode_sparse="kernel"))
new, old = make(), make()
def every_call(layouts, q, k, seq):
    for layout in layouts:
        check_layout(layout, q, k, seq, context="executor 'split'")
old._check_layouts = every_call
calls = {"new": lambda: new.attend_routed(q, k, v, seq, hard=hard, layouts=(lr, ls), scale=0.088, need_lse=False),
         "old": lambda: old.attend_routed(q, k, v, seq, hard=hard, layouts=(lr, ls), scale=0.088, need_lse=False)}
for f in calls.values():
    for _ in range(200): f()
res = {n: [] for n in calls}
for b in range(int(sys.argv[1]) if len(sys.argv) > 1 else 30):
    for n, f in (calls.items() if b % 2 == 0 else reversed(list(calls.items()))):
        t0 = time.perf_counter()
        for _ in range(300): f()
        res[n].append(1e6 * (time.perf_counter() - t0) / 300)
out = {n: {"median_us": statistics.median(x), "min_us": min(x), "blocks": len(x)} for n, x in res.items()}
print(json.dumps(out, indent=1))
if len(sys.argv) > 2:
    json.dump({"what": __doc__, "command": "python results/bench/issue10-s22/ab_layout_checks.py 60 FILE", "commit": "c15b2a7", "blocks_of_300_calls_us": res, "summary": out, "tokens": S,
               "torch": torch.__version__, "threads": 1}, open(sys.argv[2], "w"), indent=1)
