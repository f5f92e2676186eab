"""Routing diagnostics during training: how decided the router is, what it decides per task, and
which loss moves it.

A router whose decisions all sit at P(sparse) = 0 or 1 has stopped learning: the straight-through
gradient through ``softmax((z + g) / tau)`` vanishes once the logits are far outside the Gumbel
noise's scale, and the Lagrangian pressure per task can no longer move it. These numbers show
that state while it happens:

- the *decision margin* ``|P(sparse) - 0.5|`` of every (sample, layer, KV head), with P from the
  noise-free logits, as a histogram (quantiles, the saturated share above 0.49 and the share
  within 0.05 of the boundary);
- P(sparse) per task and (layer, KV head): the routing heat map while it forms;
- the gradient norm per router part, split into the LM loss's share and the penalties' shares.

Everything is a sum or a histogram, so data-parallel processes add theirs up.
"""

from __future__ import annotations

from typing import Any

import torch

#: margins above this are "saturated" (P below 0.01 or above 0.99)
SATURATED = 0.49
#: margins below this are "near the boundary"
NEAR = 0.05
#: histogram bins of the margin over [0, 0.5]
BINS = 100


def decision_probabilities(elastic: Any) -> torch.Tensor | None:
    """(B, L_routed, Hkv) noise-free P(sparse) of the last forward (softmax of each decision's
    logits; a router without logits: its ``prob_sparse``), detached; ``None`` before a forward."""
    rows = []
    for layer in elastic.heads.routed_layers:
        decision = elastic.runtime.decisions.get(layer)
        if decision is None:
            return None
        if decision.logits is not None:
            rows.append(torch.softmax(decision.logits.detach().float(), dim=-1)[..., 1])
        else:
            rows.append(decision.prob_sparse.detach().float())
    return torch.stack(rows, dim=1)


def logit_spread(elastic: Any) -> torch.Tensor | None:
    """(B,) the mean over layers and KV heads of the variance of each decision's logits across
    modes, *with* its gradient ((z_sparse - z_full)^2 / 4 for two modes); ``None`` when the router
    gives no logits."""
    values = []
    for layer in elastic.heads.routed_layers:
        decision = elastic.runtime.decisions.get(layer)
        if decision is None or decision.logits is None:
            return None
        z = decision.logits.float()
        values.append(((z - z.mean(-1, keepdim=True)) ** 2).mean(-1))  # (B, H)
    return torch.stack(values, dim=1).mean((1, 2))


def margin_histogram(prob: torch.Tensor) -> torch.Tensor:
    """(BINS,) counts of ``|prob - 0.5|`` over [0, 0.5]."""
    margin = (prob.detach().float() - 0.5).abs().clamp(0, 0.5).flatten()
    return torch.histc(margin, bins=BINS, min=0.0, max=0.5).double()


def margin_summary(hist: torch.Tensor) -> dict[str, float | None]:
    """Quantiles (p10, p50, p90) of the margin, and the shares saturated and near the boundary,
    from a :func:`margin_histogram` (a quantile is its bin's upper edge: 0.005 resolution)."""
    total = float(hist.sum())
    if total == 0:
        return {"p10": None, "p50": None, "p90": None, "saturated": None, "near_boundary": None}
    cdf = hist.cumsum(0) / total
    edges = torch.linspace(0.5 / BINS, 0.5, BINS, dtype=torch.float64)

    def quantile(q: float) -> float:
        return float(edges[int(torch.searchsorted(cdf, torch.tensor(q, dtype=cdf.dtype)).clamp(max=BINS - 1))])

    width = 0.5 / BINS
    return {
        "p10": quantile(0.1),
        "p50": quantile(0.5),
        "p90": quantile(0.9),
        "saturated": float(hist[int(round(SATURATED / width)):].sum()) / total,
        "near_boundary": float(hist[: int(round(NEAR / width))].sum()) / total,
    }


class StepRouting:
    """One step's routing statistics, summed over its micro-batches (and processes)."""

    def __init__(self, tasks: int, layers: int, heads: int, device: torch.device) -> None:
        self.tasks, self.layers, self.heads = tasks, layers, heads
        # per task: P(sparse) sums (L*H) and the sample count; then the margin histogram
        self.stats = torch.zeros(tasks * (layers * heads + 1) + BINS, dtype=torch.float64, device=device)

    def add(self, prob: torch.Tensor, task: torch.Tensor) -> None:
        """``prob`` (B, L, H) noise-free P(sparse), ``task`` (B,) task indices."""
        width = self.layers * self.heads
        sums = self.stats[: self.tasks * width].view(self.tasks, width)
        sums.index_add_(0, task.to(sums.device), prob.reshape(prob.shape[0], width).double().to(sums.device))
        counts = self.stats[self.tasks * width : self.tasks * (width + 1)]
        counts.index_add_(0, task.to(counts.device), torch.ones(prob.shape[0], dtype=torch.float64, device=counts.device))
        self.stats[self.tasks * (width + 1) :] += margin_histogram(prob).to(self.stats.device)

    def row(self, labels: list[str]) -> dict[str, Any]:
        """``margins`` (see :func:`margin_summary`) and ``p_sparse``: per task, the mean P(sparse)
        as an L x H list (``None`` for a task without samples this step)."""
        width = self.layers * self.heads
        sums = self.stats[: self.tasks * width].view(self.tasks, self.layers, self.heads)
        counts = self.stats[self.tasks * width : self.tasks * (width + 1)]
        p_sparse = {
            label: ((sums[k] / counts[k]).round(decimals=4).tolist() if counts[k] > 0 else None)
            for k, label in enumerate(labels)
        }
        return {"margins": margin_summary(self.stats[self.tasks * (width + 1) :].cpu()), "p_sparse": p_sparse}


def group_norms(groups: dict[str, list[torch.nn.Parameter]], grads: dict[int, torch.Tensor]) -> dict[str, float]:
    """The L2 norm of ``grads`` (keyed by ``id(parameter)``) over each group's parameters."""
    out = {}
    for name, params in groups.items():
        sq = [grads[id(p)].double().pow(2).sum() for p in params if id(p) in grads]
        out[name] = float(torch.stack(sq).sum().sqrt()) if sq else 0.0
    return out


class GradientSplit:
    """The router's gradient split by loss term over one step's micro-batches: call :meth:`add`
    with each term but the LM loss before the backward pass of the whole loss, then :meth:`row`
    with the accumulated total; the LM loss's share is the total minus the other terms."""

    def __init__(self, groups: dict[str, list[torch.nn.Parameter]]) -> None:
        self.groups = groups
        self.params = [p for ps in groups.values() for p in ps]
        self.terms: dict[str, dict[int, torch.Tensor]] = {}

    def add(self, name: str, term: torch.Tensor) -> None:
        if not term.requires_grad:
            return
        grads = torch.autograd.grad(term, self.params, retain_graph=True, allow_unused=True)
        acc = self.terms.setdefault(name, {})
        for p, g in zip(self.params, grads):
            if g is not None:
                acc[id(p)] = acc[id(p)] + g if id(p) in acc else g.detach().clone()

    def reduce(self, average: Any) -> None:
        """Replace every accumulated term's gradient by ``average`` of it (e.g. an all-reduce divided
        by the processes), so that the terms and the data-parallel total are in the same units."""
        for acc in self.terms.values():  # every parameter, in one order on every process
            for p in self.params:
                g = acc.get(id(p))
                acc[id(p)] = average(torch.zeros_like(p) if g is None else g)

    def row(self) -> dict[str, dict[str, float]]:
        """{group: {"total", "lm", <term>...}} gradient norms (before clipping)."""
        total = {id(p): p.grad.detach() for p in self.params if p.grad is not None}
        lm = dict(total)
        for acc in self.terms.values():
            for key, g in acc.items():
                lm[key] = lm[key] - g if key in lm else -g
        parts = {"total": group_norms(self.groups, total), "lm": group_norms(self.groups, lm)}
        parts.update({name: group_norms(self.groups, acc) for name, acc in self.terms.items()})
        return {group: {part: norms[group] for part, norms in parts.items()} for group in self.groups}
