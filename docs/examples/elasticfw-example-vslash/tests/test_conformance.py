"""elasticfw's conformance suite, run on the vertical-slash mode.

``vertical_slash_reference`` is the mode's definition written from the module docstring alone,
with loops in float64: it never calls the plugin or elasticfw's building blocks. The suite
compares the layout, the outputs, the reported sparsity and every executor against it.
"""

import torch

from elasticfw.testing.modes import ModeConformance


def _keep(scores, budget, forced, candidates):
    """Indices kept: the forced ones, then the best other candidates (ties: lower index) up to budget."""
    keep = set(forced)
    others = sorted((i for i in candidates if i not in keep), key=lambda i: (-scores[i], i))
    return keep | set(others[: max(budget - len(keep), 0)])


def vertical_slash_reference(q, k, seq, config, scale=None):
    """(B, Hq, Sq, Sk) bool: key j visible to the query at position p, causality included."""
    batch, hq, sq, dim = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = dim**-0.5 if scale is None else scale
    out = torch.zeros(batch, hq, sq, sk, dtype=torch.bool)
    for b in range(batch):
        q_start, kv_len = int(seq.q_start[b]), int(seq.kv_len[b])
        real_rows = [i for i in range(sq) if q_start + i < kv_len]
        rows = real_rows[-config.last_queries :]
        for g in range(hkv):
            per_head = []
            for h in range(g * group, (g + 1) * group):
                probs = torch.zeros(len(rows), sk, dtype=torch.float64)
                for r, i in enumerate(rows):
                    p = q_start + i
                    logits = (k[b, g, : p + 1].double() @ q[b, h, i].double()) * scale
                    probs[r, : p + 1] = torch.softmax(logits, dim=0)
                per_head.append(probs)
            stacked = torch.stack(per_head)
            probs = stacked.mean(0) if config.head_reduce == "mean" else stacked.amax(0)
            vertical = probs.sum(0).tolist()
            slash = [0.0] * sk
            for r, i in enumerate(rows):
                p = q_start + i
                for j in range(p + 1):
                    slash[p - j] += float(probs[r, j])
            real = range(kv_len)
            columns = _keep(vertical, config.vertical_size, range(min(config.sink_columns, kv_len)), real)
            diagonals = _keep(slash, config.slash_size, range(min(config.local_diagonals, kv_len)), real)
            col = torch.zeros(sk, dtype=torch.bool)
            col[sorted(columns)] = True
            diag = torch.zeros(sk, dtype=torch.bool)
            diag[sorted(diagonals)] = True
            for i in range(sq):
                p = q_start + i
                keys = torch.arange(sk)
                seen = (keys <= p) & (col | diag[(p - keys).clamp(0, sk - 1)])
                out[b, g * group : (g + 1) * group, i] = seen
    return out


class TestVerticalSlash(ModeConformance):
    mode_name = "vertical_slash"
    small_config = {"block_size": 16, "last_queries": 8, "vertical_size": 6, "slash_size": 6,
                    "sink_columns": 2, "local_diagonals": 3}
    dense_config = {"block_size": 16, "slash_size": 1000}  # every diagonal: every causal pair
    causality = "prompt"  # the last queries choose the lines for the whole prompt
    token_reference = staticmethod(vertical_slash_reference)


class TestVerticalSlashMax(TestVerticalSlash):
    small_config = {**TestVerticalSlash.small_config, "head_reduce": "max", "last_queries": 3}
