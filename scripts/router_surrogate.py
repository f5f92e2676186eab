"""Offline study of the MLP router's optimisation on the default model's real pooled keys.

`collect` prefills training prompts of a recipe's tasks through an adapter (or a fresh router)
and saves the router's input, the pooled keys (N, layers, KV heads, head dim), with each prompt's
task. `train` then trains fresh MLP routers on those vectors alone, with the plugin's own modules,
the trainer's optimiser and schedule, its Lagrangian and the Gumbel straight-through estimator,
and a surrogate LM loss: on sensitive prompts, each head of a given set kept full costs nothing
and each of them sparse costs `--ce`. Each grid entry (JSON keyword arguments of `run`) prints
the held-out MSR per task.

    python scripts/router_surrogate.py collect results/train/smollm2-fa-ssa/mlp/adapter \
        recipes/train/smollm2-fa-ssa.yaml --per-task 48 --out pooled.pt
    python scripts/router_surrogate.py train pooled.pt '[{}, {"norm": "center"}, {"ste": "linear"}]'

`--retrieval-heads` (a JSON (layers x heads) 0/1 list, 1 = must stay full on sensitive prompts)
defaults to the heads that the adapter used for `collect` keeps full on average.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from torch.nn import functional as F

from elasticfw.routing.gumbel import (
    TemperatureSchedule,
    gumbel_noise,
    gumbel_softmax_sparse_prob,
    straight_through,
)
from elasticfw.training.objective import Lagrangian
from elasticfw.training.trainer import cosine_with_warmup


def collect(adapter: str, recipe_path: str, per_task: int, out: str, context_tokens: int | None = None) -> None:
    from elasticfw.model.checkpoint import load_adapter
    from elasticfw.model.loading import load_model
    from elasticfw.model.rotary import unrotate
    from elasticfw.recipe import load_recipe
    from elasticfw.registry import get_registry
    from elasticfw.training.data import collate
    from elasticfw.training.run import build_mixture
    from elasticfw_plugins.routers.mlp import boundary_pool

    recipe, registry = load_recipe(recipe_path), get_registry()
    if context_tokens is not None:  # every task at another prompt length
        tasks = [e.model_copy(update={"task": e.task.model_copy(update={"context_tokens": context_tokens})})
                 for e in recipe.train.tasks]
        recipe = recipe.model_copy(update={"train": recipe.train.model_copy(update={"tasks": tasks})})
    model, tok = load_model(recipe.model, registry=registry)
    rotary = model.model.rotary_emb
    mixture = build_mixture(recipe, tok, model, registry)
    elastic = load_adapter(model, adapter, registry=registry, base_model=recipe.model.name)
    router, seen = elastic.router, {}
    decide = router.decide

    def spy(layer, keys, seq):  # the router's own pooling of exactly the keys it decides on
        seen[layer] = boundary_pool(keys, seq, router.config.pool_tokens).detach().float().cpu()
        # and of the same keys with the rotary embedding undone (start-aligned key j sits at position j)
        cos, sin = rotary(keys, torch.arange(keys.shape[2], device=keys.device)[None])
        plain = unrotate(keys, cos, sin)
        seen[("unrotated", layer)] = boundary_pool(plain, seq, router.config.pool_tokens).detach().float().cpu()
        decision = decide(layer, keys, seq)
        seen[("logits", layer)] = decision.logits.detach().float().cpu()
        return decision

    router.decide = spy
    elastic.eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    pooled, unrotated, logits, task = [], [], [], []
    layers = elastic.heads.num_routed
    for t in mixture:
        for i in range(0, per_task, 8):
            batch = collate(t.items[i : min(i + 8, per_task)], pad)
            elastic.runtime.route_lengths = batch.route_lengths
            with torch.no_grad():
                elastic(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=1,
                        position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp_min(0), use_cache=False)
            pooled.append(torch.stack([seen[j] for j in range(layers)], 1))
            unrotated.append(torch.stack([seen[("unrotated", j)] for j in range(layers)], 1))
            logits.append(torch.stack([seen[("logits", j)] for j in range(layers)], 1))
            task.append(batch.task)
    torch.save({"pooled": torch.cat(pooled), "pooled_unrotated": torch.cat(unrotated),
                "logits": torch.cat(logits), "task": torch.cat(task),
                "labels": [t.label for t in mixture], "targets": [t.target for t in mixture],
                "categories": [t.category for t in mixture]}, out)


def run(data: dict, retrieval: torch.Tensor, *, steps=150, batch=32, lr=1e-3, lam_lr=2e-2, norm="none",
        ste="sigmoid", tau_units=2.0, init=0.5, logit_reg=0.0, task_lr_mult=1.0, ce=0.5, seed=0, wd=0.1,
        keys="rotated", tests: dict[str, dict] | None = None) -> dict:
    from elasticfw_plugins.routers.mlp import _LayerRouter

    field = {"rotated": "pooled", "unrotated": "pooled_unrotated"}[keys]
    pooled, task = data[field], data["task"]
    n, layers, heads, dim = pooled.shape
    sensitive = torch.tensor([c == "sensitive" for c in data["categories"]], dtype=torch.float32)
    index = torch.arange(n)
    train_idx, test_idx = index[index % 4 != 0], index[index % 4 == 0]
    torch.manual_seed(seed)
    nets = torch.nn.ModuleList(_LayerRouter(dim, 4) for _ in range(layers))
    with torch.no_grad():
        for net in nets:
            torch.nn.init.normal_(net.router_mlp[-1].weight, std=0.02)
            net.router_mlp[-1].bias.copy_(torch.tensor([0.0, math.log(init / (1 - init))]))
    groups = [{"params": [p for m in nets for p in m.task_mlp.parameters()], "lr": lr * task_lr_mult},
              {"params": [p for m in nets for p in m.router_mlp.parameters()], "lr": lr}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), weight_decay=wd)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_with_warmup(s, steps, 0.1))
    lag = Lagrangian(data["targets"])
    lag_opt = torch.optim.Adam(lag.parameters(), lr=lam_lr, maximize=True)
    temperature = TemperatureSchedule(1.0, 0.3, 0.6, tau_units)
    gen = torch.Generator().manual_seed(seed)
    mean, scale = pooled[train_idx].mean(0), pooled[train_idx].std(0).mean(-1, keepdim=True) + 1e-6

    def features(x):
        return {"none": x, "layer": F.layer_norm(x, (dim,)), "center": (x - mean) / scale}[norm]

    def forward(x):
        return torch.stack([nets[j](x[:, j]) for j in range(layers)], 1)

    for step in range(steps):
        b = train_idx[torch.randint(len(train_idx), (batch,), generator=gen)]
        z = forward(features(pooled[b]))
        tau = temperature(step / steps)
        noise = gumbel_noise(z.shape, device="cpu", generator=gen)
        if ste == "sigmoid":  # the paper's, as the plugin trains
            hard = straight_through(gumbel_softmax_sparse_prob(z, tau, noise=True, gumbel=noise))
        else:  # "linear": forward the hard Gumbel decision, backward a constant slope 1 / (4 tau)
            diff = z[..., 1] - z[..., 0]
            slope = diff / (4 * tau)
            hard = ((diff + noise[..., 1] - noise[..., 0]) > 0).float() + slope - slope.detach()
        loss_ce = (sensitive[task[b]][:, None, None] * retrieval[None] * hard).sum((1, 2)) * ce
        loss = loss_ce.mean() + lag.penalty(hard.mean((1, 2)), task[b]).mean()
        if logit_reg:
            loss = loss + logit_reg * ((z[..., 1] - z[..., 0]) ** 2).mean()
        opt.zero_grad()
        lag_opt.zero_grad()
        loss.backward()
        opt.step()
        lag_opt.step()
        sched.step()
    def held_out(x: torch.Tensor, t: torch.Tensor) -> tuple[dict, dict, torch.Tensor]:
        with torch.no_grad():
            z = forward(features(x))
        diff = z[..., 1] - z[..., 0]
        msr = (diff > 0).float().mean((1, 2))
        return ({label: round(float(msr[t == k].mean()), 3) for k, label in enumerate(data["labels"])},
                {label: round(float(msr[t == k].std()), 3) for k, label in enumerate(data["labels"])}, diff)

    msr, std, diff = held_out(pooled[test_idx], task[test_idx])
    result = {"msr": msr, "msr_std": std, "median_abs_logit_diff": round(float(diff.abs().median()), 2),
              "lambda1": [round(v, 2) for v in lag.lambda1.tolist()]}
    for name, other in (tests or {}).items():  # every prompt of another collection (other lengths)
        msr, std, _ = held_out(other[field], other["task"])
        result[f"msr@{name}"], result[f"msr_std@{name}"] = msr, std
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("adapter")
    c.add_argument("recipe")
    c.add_argument("--per-task", type=int, default=48)
    c.add_argument("--out", required=True)
    c.add_argument("--context-tokens", type=int, help="every task's prompts at this length (default: the recipe's)")
    t = sub.add_parser("train")
    t.add_argument("pooled")
    t.add_argument("grid", help="a JSON list of keyword-argument objects for run()")
    t.add_argument("--test", nargs="*", default=[], help="collections (other lengths) to report held-out MSR on too")
    t.add_argument("--retrieval-heads", help="JSON (layers x heads) 0/1: heads that must stay full on sensitive prompts")
    args = ap.parse_args()
    if args.cmd == "collect":
        collect(args.adapter, args.recipe, args.per_task, args.out, args.context_tokens)
        return
    data = torch.load(args.pooled, weights_only=True)
    tests = {path: torch.load(path, weights_only=True) for path in args.test}
    if args.retrieval_heads:
        retrieval = torch.tensor(json.loads(args.retrieval_heads), dtype=torch.float32)
    else:
        retrieval = ((data["logits"][..., 1] - data["logits"][..., 0]).mean(0) < 0).float()
    for kwargs in json.loads(args.grid):
        print(json.dumps({"config": kwargs, **run(data, retrieval, tests=tests, **kwargs)}), flush=True)


if __name__ == "__main__":
    main()
