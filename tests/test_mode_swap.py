"""scripts/mode_swap.py: the assignment read from a summary's sparse shares, and its variant syntax."""

from __future__ import annotations

import pytest

from tests.file_modules import load_script

swap = load_script("mode_swap")


def _summary(share: list[list[float]]) -> dict:
    return {"routers": {"mlp": {"routing": {"sparse_share": {"passkey": share}}}}}


def test_sparse_heads_maps_rows_to_routed_layers() -> None:
    # rows are routed layers 1 and 3 (layer 0 and 2 not routed); heads with share 1 are sparse
    share = [[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
    assert swap.sparse_heads(_summary(share), "mlp", "passkey", [1, 3]) == [[1, 0], [1, 2], [3, 2]]


def test_sparse_heads_refuses_a_routing_that_differs_between_samples() -> None:
    with pytest.raises(SystemExit, match=r"1 heads are routed sparse on some samples only \(e.g. row 1, head 1: share 0.250\)"):
        swap.sparse_heads(_summary([[1.0, 0.0], [0.0, 0.25]]), "mlp", "passkey", [0, 1])


def test_sparse_heads_names_what_is_missing() -> None:
    with pytest.raises(SystemExit, match="routers.static.routing.sparse_share.passkey"):
        swap.sparse_heads(_summary([[1.0]]), "static", "passkey", [0])
    with pytest.raises(SystemExit, match="2 rows, expected one per routed layer \\(3\\)"):
        swap.sparse_heads(_summary([[1.0], [0.0]]), "mlp", "passkey", [0, 1, 2])


def test_parse_variant() -> None:
    assert swap.parse_variant("as trained|") == ("as trained", {})
    label, modes = swap.parse_variant("xa|retrieval_mode={name: xattention, threshold: 0.95}; sparse_mode={name: full}")
    assert label == "xa"
    assert modes == {"retrieval_mode": {"name": "xattention", "threshold": 0.95}, "sparse_mode": {"name": "full"}}
    for bad, msg in [("no label", "expected 'LABEL"), ("x|router={name: mlp}", "SLOT=YAML with SLOT one of"),
                     ("x|sparse_mode=[1, 2]", "should be a mode section with a name")]:
        with pytest.raises(SystemExit, match=msg):
            swap.parse_variant(bad)
