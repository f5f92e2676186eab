"""The structured benchmark inputs: sinks, locality and recurring topics, as documented."""

from __future__ import annotations

import math

import pytest
import torch

from elasticfw.attention.layout import esr
from elasticfw.attention.seq import SeqInfo
from elasticfw.bench.inputs import InputStructure, describe, random_qkv, structured_qkv
from elasticfw.testing.modes import make_mode


def _scores(q, k):
    """Scaled causal scores of query head 0 against KV head 0, (S, S) float64."""
    s = q[0, 0].double() @ k[0, 0].double().T / math.sqrt(q.shape[-1])
    n = s.shape[0]
    return s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)


def test_shapes_determinism_and_gqa_sharing():
    q, k, v = structured_qkv(2, 6, 2, 300, 32, seed=3)
    assert q.shape == (2, 6, 300, 32) and k.shape == v.shape == (2, 2, 300, 32)
    q2, k2, _ = structured_qkv(2, 6, 2, 300, 32, seed=3)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    assert not torch.equal(q, structured_qkv(2, 6, 2, 300, 32, seed=4)[0])
    # query heads of one GQA group share the group's structure: closer to each other than to another group
    same = (q[:, 0] - q[:, 1]).pow(2).mean()
    other = (q[:, 0] - q[:, 3]).pow(2).mean()
    assert same < 0.5 * other


def test_sinks_locality_and_topics_in_the_attention_scores():
    st = InputStructure(segment_tokens=256, topics=2)
    q, k, _ = structured_qkv(1, 1, 1, 2048, 64, structure=st, seed=0)
    s = _scores(q, k)
    rows = torch.arange(1536, 2048)
    # the sink keys score about sink_logit above other far keys
    far = s[rows, 8:512]
    sink_gap = s[rows, : st.sink_tokens].mean() - far[torch.isfinite(far)].mean()
    assert st.sink_logit - 3 < sink_gap < st.sink_logit + 3
    # locality (topics off): the last 16 keys score about local_logit * (1 - mean cos) above keys
    # ~1000 tokens back; over Llama-3's frequencies that mean is about 0.5 at 1000 tokens
    q_l, k_l, _ = structured_qkv(1, 1, 1, 2048, 64, structure=InputStructure(topic_logit=0.0), seed=0)
    s_l = _scores(q_l, k_l)
    near = torch.stack([s_l[r, r - 16 : r + 1].mean() for r in rows])
    back = torch.stack([s_l[r, r - 1016 : r - 1000].mean() for r in rows])
    inv_freq = 500000.0 ** (-torch.arange(0, 62, 2, dtype=torch.float64) / 64)  # 31 free pairs (not the sink's)
    kernel = torch.stack([torch.cos(d * inv_freq).mean() for d in range(1017)])  # mean cos over the pairs
    # the content vector's norm is spread over 62 of the 64 coordinates: ~31/31 pairs, so the gap is
    # local_logit * (mean kernel near - mean kernel back), up to the noise
    expected = 6.0 * (kernel[0:17].mean() - kernel[1000:1017].mean())
    assert abs(float((near - back).mean()) - float(expected)) < 0.4
    assert expected > 1.5
    # recurring topics: far keys of the query's own topic outscore far keys of the other topic
    q_r, k_r, _ = structured_qkv(1, 1, 1, 2048, 64, structure=InputStructure(segment_tokens=256, topics=2,
                                                                             local_logit=0.0, sink_tokens=0), seed=0)
    s_r = _scores(q_r, k_r)
    seg = torch.arange(2048) // 256
    same_topic, other_topic = [], []
    topic_vec = k_r[0, 0].reshape(8, 256, 64).mean(1)  # per-segment mean key ~ its topic direction
    sim = topic_vec @ topic_vec.T
    for r in rows:
        earlier = seg < seg[r] - 1
        same = earlier & (sim[seg[r]][seg] > 0.5 * sim[seg[r], seg[r]])
        if same.any() and (earlier & ~same).any():
            same_topic.append(s_r[r, same].mean())
            other_topic.append(s_r[r, earlier & ~same].mean())
    assert same_topic and (torch.stack(same_topic) - torch.stack(other_topic)).mean() > 2.0


def test_a_data_dependent_mode_skips_more_on_structured_than_on_random_inputs():
    xa = make_mode("xattention", {"block_size": 32, "stride": 8, "chunk_size": 512})
    seq = SeqInfo.dense(1, 2048, 2048)
    structured = structured_qkv(1, 2, 1, 2048, 64, seed=0)
    gaussian = random_qkv(1, 2, 1, 2048, 64, generator=torch.Generator().manual_seed(0))
    sparse = [float(esr(xa.build_layout(q, k, seq), seq, 2).mean()) for q, k, _ in (structured, gaussian)]
    assert sparse[0] > sparse[1] + 0.3


def test_bad_shapes_are_refused_and_the_json_description():
    with pytest.raises(ValueError, match="even"):
        structured_qkv(1, 2, 1, 16, 7)
    with pytest.raises(ValueError, match="multiple"):
        structured_qkv(1, 3, 2, 16, 8)
    assert describe(None)["kind"] == "random"
    d = describe(InputStructure())
    assert d["kind"] == "structured" and d["sink_logit"] == InputStructure().sink_logit
