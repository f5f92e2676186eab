"""Boundary cases that mutation testing showed no other test pins (core and built-in plugins).

Each test checks specified behaviour against an answer worked out independently of the code
under test: a hand count, the mode's token-level definition in ``tests/mode_definitions`` or a
ranking written out by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mode_definitions.xattention import token_reference as xattention_reference
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401  (transformers' ~3 s lazy import at collection)

from elasticfw.attention.flex_mask import dense_kernel_mask, tile_masks, to_block_mask
from elasticfw.attention.layout import BlockLayout, causal_layout, computed_pairs, dense_mask, with_window
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import UnsupportedInputError
from elasticfw.eval.task import Sample
from elasticfw.model.checkpoint import WEIGHTS, load_adapter, save_adapter
from elasticfw.model.elastic import ElasticModel
from elasticfw.recipe import validate_recipe_data
from elasticfw.registry import get_registry
from elasticfw.testing.models import tiny_model
from elasticfw.testing.modes import make_inputs, make_mode, real_rows

# -- flex_mask: the padded lengths are raised to whole kernel tiles ---------------------------------


def test_block_mask_padded_lengths_are_raised_to_a_multiple_of_the_kernel_block():
    # 20 queries at positions 0..19 over 20 keys, kernel block 16: 2 tiles are needed; a bucket of
    # 100 rows / 70 keys asks for more, rounded up to whole tiles: ceil(100/16)*16 = 112, ceil(70/16)*16 = 80
    seq = SeqInfo(torch.tensor([0]), torch.tensor([20]), 20, 20)
    fm = to_block_mask(causal_layout(seq, 16), seq, 1, q_padded_len=100, kv_padded_len=70)
    assert fm.kernel_block_size == 16
    assert fm.q_padded_len == 112 and fm.kv_padded_len == 80
    assert fm.block_mask.seq_lengths == (112, 80)
    partial, full = tile_masks(fm.block_mask)
    assert partial.shape[2:] == (7, 5)  # 112 / 16 query tiles, 80 / 16 key tiles
    # only the two real query tiles compute anything, and only the causal key tiles
    assert not (partial | full)[..., 2:, :].any() and not (partial | full)[..., 2:].any()
    q = torch.randn(1, 1, 20, 4)
    assert fm.pad_queries(q).shape == (1, 1, 112, 4) and torch.equal(fm.unpad_rows(fm.pad_queries(q)), q)
    # what the kernel computes on the real rows: exactly the causal pairs (j <= i)
    kernel = fm.unpad_rows(dense_kernel_mask(fm, 1))[0, 0, :, :20]
    assert torch.equal(kernel, torch.ones(20, 20, dtype=torch.bool).tril())
    # a bucket smaller than what the tiles need never shrinks them: 2 tiles of 16 = 32
    small = to_block_mask(causal_layout(seq, 16), seq, 1, q_padded_len=5, kv_padded_len=5)
    assert (small.q_padded_len, small.kv_padded_len) == (32, 32)


# -- XAttention: kv_group aggregation over several query chunks -------------------------------------


def test_xattention_kv_group_over_several_chunks_matches_the_definition():
    # chunk_size = block_size: every query block is its own chunk (chunks t0 = 0, 1, 2, ...), with
    # GQA groups of 2 summed before selection; the layout must still be the token definition's
    q, k, _, seq = make_inputs((2, 4, 2, 70, 70, 16), kv_lens=[70, 45], seed=5)
    config = {"block_size": 16, "stride": 4, "threshold": 0.6, "head_aggregation": "kv_group", "chunk_size": 16}
    mode = make_mode("xattention", config)
    layout = mode.build_layout(q, k, seq)
    assert layout.num_heads == 2 and layout.blocks.shape[2] == 5  # one layout per KV head, 5 query blocks
    mask = dense_mask(layout, seq, num_heads=4)
    expected = xattention_reference(q, k, seq, mode.config)
    rows = real_rows(seq).expand_as(mask)
    assert torch.equal(mask & rows, expected & rows)
    # the threshold really dropped blocks: not the dense causal pattern
    causal = torch.ones(70, 70, dtype=torch.bool).tril() & (torch.arange(70) < seq.kv_len[:, None, None, None])
    assert ((causal & rows) & ~mask).any()


# -- retrieval_score: its ranking lives in the adapter's JSON, not in its tensors -------------------


def test_retrieval_score_adapter_without_tensors_loads_and_routes_by_the_saved_scores(tmp_path):
    registry = get_registry()
    section = validate_recipe_data(
        {
            "elastic": {
                "retrieval_mode": {"name": "full", "block_size": 16},
                "sparse_mode": {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16},
                "executor": {"name": "sdpa"},
                "router": {"name": "retrieval_score", "target_msr": 0.5},
            }
        },
        registry=registry,
    ).elastic
    model = tiny_model("llama")
    elastic = ElasticModel(model, section, registry=registry, base_model_name="org/base-a")
    heads = elastic.heads
    layers, hkv, group = heads.num_routed, heads.num_kv_heads, heads.num_q_heads // heads.num_kv_heads
    # per-KV-head scores, distinct, each query head of a group carrying its KV head's score
    kv_scores = torch.arange(layers * hkv, dtype=torch.float32).view(layers, hkv).flip(0) * 0.125 + 0.25
    kv_scores[0, 0] = 100.0  # layer 0, KV head 0: the most retrieval-like head of all
    elastic.router.set_scores(kv_scores.repeat_interleave(group, dim=1))
    save_adapter(elastic, tmp_path / "a")
    elastic.unwrap()
    # a training-free router has no tensors: the adapter's weights file is empty (adapters written
    # by earlier versions look exactly like this one, so it must load)
    save_file({}, str(tmp_path / "a" / WEIGHTS))
    assert load_file(str(tmp_path / "a" / WEIGHTS)) == {}

    loaded = load_adapter(model, tmp_path / "a", registry=registry)
    # by hand: floor((1 - 0.5) * L * Hkv) highest-scoring (layer, KV head) pairs stay on the retrieval
    # mode (0), the others go sparse (1)
    keep = (layers * hkv) // 2
    ranked = sorted(range(layers * hkv), key=lambda i: -float(kv_scores.flatten()[i]))
    want = torch.ones(layers * hkv)
    want[ranked[:keep]] = 0.0
    want = want.view(layers, hkv)
    assert want[0, 0] == 0.0
    keys = torch.zeros(2, hkv, 8, heads.head_dim)
    seq = SeqInfo.dense(2, 8, 8)
    for layer in range(layers):
        decision = loaded.router.decide(layer, keys, seq)
        assert torch.equal(decision.sparse, want[layer][None].expand(2, hkv)), layer


# -- with_window: only the blocks the window cuts are partial ---------------------------------------


def test_with_window_marks_partial_exactly_the_blocks_the_window_cuts():
    # 80 tokens, blocks of 16 (5 tiles), window 40: key j is visible to position p iff p - j < 40.
    # By hand, for tile t (positions 16t..16t+15) and key block j (keys 16j..16j+15), j <= t:
    #   reachable iff the closest pair is in the window: 16(t-j) - 15 < 40, i.e. t - j <= 3;
    #   wholly inside iff the farthest pair is:          16(t-j) + 15 < 40, i.e. t - j <= 1.
    # So t - j in {0, 1} are whole blocks (no token mask needed), {2, 3} are cut, 4 is dropped.
    seq = SeqInfo.dense(1, 80, 80)
    layout = with_window(causal_layout(seq, 16), seq, 40)
    t, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
    want_blocks = (j <= t) & (t - j <= 3)
    want_partial = (t - j >= 2) & (t - j <= 3)
    assert torch.equal(layout.blocks[0, 0], want_blocks)
    assert torch.equal(layout.partial_blocks()[0, 0], want_partial)
    # a partial block is always a computed block
    assert layout.partial is not None and not bool((layout.partial & ~layout.blocks).any())
    # the token-level view is the window's definition
    p, k = torch.arange(80)[:, None], torch.arange(80)[None, :]
    assert torch.equal(dense_mask(layout, seq, num_heads=1)[0, 0], (k <= p) & (p - k < 40))
    # what kernels make of it: the strictly-below-diagonal blocks wholly inside (t - j == 1) are
    # full FlexAttention tiles (mask_mod skipped); the cut ones and the diagonal are partial
    partial_tiles, full_tiles = tile_masks(to_block_mask(layout, seq, 1).block_mask)
    assert torch.equal(full_tiles[0, 0], t - j == 1)
    assert torch.equal(partial_tiles[0, 0], (t == j) | want_partial)


# -- streaming, token granularity: a window that does not reach the sink ----------------------------


def test_streaming_token_granularity_without_sink_over_several_windows_matches_the_definition():
    # DuoAttention's rule with no sink: key j visible to position p iff j <= p and j > p - local.
    # 96 tokens, local 32, blocks of 16: the window is 2 blocks wide, the sequence 6 blocks long,
    # so the first key block falls out of the window (which the conformance configs never see: their
    # sink always holds block 0, or their window covers the whole sequence)
    q, k, _, seq = make_inputs((1, 2, 2, 96, 96, 8), seed=3)
    mode = make_mode("streaming", {"block_size": 16, "sink_tokens": 0, "local_tokens": 32, "granularity": "token"})
    layout = mode.build_layout(q, k, seq)
    p, j = torch.arange(96)[:, None], torch.arange(96)[None, :]
    want = (j <= p) & (j > p - 32)
    mask = dense_mask(layout, seq, num_heads=2)
    assert torch.equal(mask[0, 0], want) and torch.equal(mask[0, 1], want)
    # tile 2 (positions 32..47) still sees keys 1..15 of block 0 (p = 32 sees j > 0)
    assert bool(want[32, 1:16].all()) and bool(layout.blocks[0, 0, 2, 0])
    # blocks by hand: tile t computes block b iff one of its pairs is visible: some p in
    # 16t..16t+15 and j in 16b..16b+15 with j <= p and j > p - 32, i.e. b <= t and 16b + 15 > 16t - 32,
    # i.e. t - b <= 2; nothing further back is computed
    t, b = torch.arange(6)[:, None], torch.arange(6)[None, :]
    assert torch.equal(layout.blocks[0, 0], (b <= t) & (t - b <= 2))
    # of those, only the diagonal's neighbour (t - b == 1: farthest pair 31 apart) lies wholly inside
    # the window; the diagonal is inside too; t - b == 2 is cut
    assert torch.equal(layout.partial_blocks()[0, 0], (t - b == 2))


# -- retrieval_score: probing a model whose sliding-window layers are not routed ---------------------


def test_retrieval_score_measure_scores_only_the_routed_layers_of_a_model_with_native_window_layers():
    # tiny gemma3: layers 0 and 2 use a sliding window and stay native (not routed), layers 1 and 3
    # are routed; the probe must score exactly those two, each against transformers' own eager
    # attention weights (Eq. 9: the last token's attention mass on the needle span)
    model = tiny_model("gemma3")
    g = torch.Generator().manual_seed(4)
    probes = [Sample(torch.randint(3, 250, (n,), generator=g).tolist(), "", span) for n, span in ((50, (10, 16)), (37, (3, 7)))]
    expected = torch.zeros(2, 6)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for s in probes:
            att = model(input_ids=torch.tensor([s.input_ids]), output_attentions=True).attentions
            for row, layer in enumerate((1, 3)):
                expected[row] += att[layer][0, :, -1, s.needle_span[0] : s.needle_span[1]].sum(-1) / len(probes)
    model.set_attn_implementation("sdpa")
    section = validate_recipe_data({"elastic": {"router": {"name": "retrieval_score", "target_msr": 0.5}}}).elastic
    elastic = ElasticModel(model, section)
    assert elastic.heads.routed_layers == (1, 3)
    measured = elastic.router.measure(elastic, probes)
    assert measured.shape == (2, 6)
    assert torch.allclose(measured, expected, atol=1e-5)
    # ranking by hand: mean over each KV head's 3 query heads, keep floor(0.5 * 4) = 2 on full attention
    elastic.router.set_scores(measured)
    kv = expected.view(2, 2, 3).mean(-1).flatten()
    want = torch.ones(4)
    want[sorted(range(4), key=lambda i: -float(kv[i]))[:2]] = 0.0
    assert torch.equal(elastic.router.table, want.view(2, 2))


# -- computed_pairs: more token-masked blocks than one evaluation chunk holds -----------------------


def test_computed_pairs_counts_every_partial_block_past_the_first_chunk():
    # 1024 tokens in blocks of 16 (64 tiles), every causal block token-masked (no ``partial`` given:
    # all of them may drop pairs), 2 heads: 2 * 64 * 65 / 2 = 4160 partial blocks, more than the
    # 4096 evaluated at a time. Head h keeps key j for position p iff (p - j) % (h + 2) == 0.
    seq = SeqInfo.dense(1, 1024, 1024)
    causal = causal_layout(seq, 16).blocks.expand(1, 2, 64, 64)

    def token_mask(b, h, q, k):  # type: ignore[no-untyped-def]
        return (q - k) % (h + 2) == 0

    layout = BlockLayout(causal, 16, token_mask)
    assert int(layout.partial_blocks().sum()) == 4160
    # by hand: position p sees j = p, p - m, p - 2m, ..., 0-or-more: p // m + 1 keys (m = h + 2)
    want = [sum(p // m + 1 for p in range(1024)) for m in (2, 3)]
    assert computed_pairs(layout, seq).tolist() == [want]


@pytest.mark.parametrize("window", [33, 40, 47, 48])
def test_with_window_keeps_exactly_the_blocks_with_a_visible_pair(window):
    """Brute force over tokens: key block j of tile t is computed iff some (p, k) with p in the tile,
    k in the block, k <= p and p - k < window exists. Windows of 2 * bs + 1 (one pair reaches the
    block), just below and at a block multiple."""
    bs, n = 16, 96
    seq = SeqInfo.dense(1, n, n)
    layout = with_window(causal_layout(seq, bs), seq, window)
    p, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = (k <= p) & (p - k < window)
    want = visible.view(n // bs, bs, n // bs, bs).any(3).any(1)
    assert torch.equal(layout.blocks[0, 0], want)
    # partial: the window (not causality, which kernels apply anyway) hides some causal pair of the block
    cut = ((k <= p) & ~visible).view(n // bs, bs, n // bs, bs).any(3).any(1)
    assert torch.equal(layout.partial_blocks()[0, 0], want & cut)


def test_a_failed_save_whose_folder_is_already_gone_raises_its_own_error(tmp_path, monkeypatch):
    """The cleanup of an interrupted adapter save must not replace the error that interrupted it
    (here the write removed its own temporary folder before failing: the cleanup finds nothing)."""
    import shutil

    import elasticfw.model.adapter_files as adapter_files

    section = validate_recipe_data(
        {"elastic": {"retrieval_mode": {"name": "full", "block_size": 16},
                     "sparse_mode": {"name": "streaming", "sink_tokens": 16, "local_tokens": 32, "block_size": 16},
                     "router": {"name": "mlp"}}}
    ).elastic
    elastic = ElasticModel(tiny_model("llama"), section)

    def failing_save(state, path):
        shutil.rmtree(Path(path).parent)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(adapter_files, "save_file", failing_save)
    with pytest.raises(OSError, match="No space left"):
        save_adapter(elastic, tmp_path / "a")
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []


def test_seqinfo_names_the_first_offending_sample():
    # samples 1 and 3 are invalid (kv_len above the capacity): the message is about sample 1
    with pytest.raises(UnsupportedInputError, match=r"SeqInfo: sample 1 has q_start 0 and kv_len 9"):
        SeqInfo(torch.zeros(4, dtype=torch.long), torch.tensor([4, 9, 4, 10]), 4, 8)
