"""From transformers' padded tensors to elasticfw's canonical coordinates and back.

Left-padded samples are rolled so that every sample's real keys start at index 0 (see
:mod:`elasticfw.attention.seq`); queries are rolled so that row 0 is a real token whenever the
queries cover the padding (prefill). The inverse roll restores transformers' layout. Right
padding needs no roll. A mask with holes (not one contiguous run of real tokens per sample) is
rejected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import UnsupportedInputError
from elasticfw.model.bridge import KeyPaddingInfo


@dataclass
class Canonical:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seq: SeqInfo
    restore: Callable[[torch.Tensor], torch.Tensor]  # (B, H, Sq, D) canonical -> transformers rows
    first_chunk: bool  # the queries start at the sequence's first token (prefill)
    #: the coordinates this call used (:class:`Padding`): pass them to the next :func:`canonicalize`
    #: of the same forward, whose layers share one ``info``
    padding: Padding | None = None

    def keys_like(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (B, H, Sk, ...) in transformers' key layout moved as the keys were (each sample's real
        keys to index 0)."""
        if self.padding is None or self.padding.info is None:
            return t
        return _roll_rows(t, self.padding.starts)


@dataclass(frozen=True)
class Padding:
    """The canonical coordinates of one forward's layers: what a :class:`KeyPaddingInfo`'s mask says,
    read from the device once (each sample's first real key and query roll, on the host), or nothing
    padded (``info`` None, no roll); and the :class:`SeqInfo` every layer of the forward shares."""

    info: KeyPaddingInfo | None
    starts: list[int]
    q_shift: list[int]
    seq: SeqInfo
    query_index: int

    def fits(self, info: KeyPaddingInfo | None, query_index: int, batch: int, sq: int, sk: int,
             device: torch.device) -> bool:
        """Whether a layer with these arguments has these coordinates: the same mask information
        object (``None`` for an unpadded layer) and the same shapes, query index and device."""
        seq = self.seq
        return (
            self.info is info
            and self.query_index == query_index
            and (seq.batch, seq.q_len, seq.kv_capacity) == (batch, sq, sk)
            and seq.device == device
        )


def _roll_rows(t: torch.Tensor, shifts: list[int]) -> torch.Tensor:
    """Roll each sample of (B, H, S, D) left by shifts[b] along S."""
    if not any(shifts):
        return t
    return torch.stack([row.roll(-s, dims=1) if s else row for row, s in zip(t, shifts)])


def read_padding(info: KeyPaddingInfo, batch: int, sq: int, sk: int, device: torch.device) -> Padding:
    """Check ``info.key_mask`` (one contiguous run of real tokens per sample) and read where each
    sample's keys and queries start (two device reads)."""
    assert info.key_mask is not None
    mask = info.key_mask.to(device)
    if mask.shape != (batch, sk):
        raise UnsupportedInputError(f"padding mask of shape {tuple(mask.shape)} does not fit keys ({batch}, {sk})")
    counts = mask.sum(-1)
    first = torch.where(counts > 0, mask.to(torch.int8).argmax(-1), torch.zeros_like(counts))
    idx = torch.arange(sk, device=device)[None, :]
    contiguous = mask == ((idx >= first[:, None]) & (idx < (first + counts)[:, None]))
    if not bool(contiguous.all()):
        raise UnsupportedInputError(
            "attention_mask must mark one contiguous run of real tokens per sample (left or right padding); "
            "masks with holes are not supported"
        )
    starts = [int(s) for s in first.tolist()]
    query_index = info.query_index
    q_shift = [min(max(0, s - query_index), sq) for s in starts]
    q_start = torch.tensor(
        [max(query_index + r - s, 0) for r, s in zip(q_shift, starts)], dtype=torch.long, device=device
    )
    # counts lie in [0, sk] and q_start was computed on the host from the checked mask
    return Padding(info, starts, q_shift, SeqInfo.trusted(q_start, counts.to(torch.long), sq, sk), query_index)


def canonicalize(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: KeyPaddingInfo | None, padding: Padding | None = None
) -> Canonical:
    """``q``, ``k``, ``v`` in canonical coordinates. ``padding``: an earlier call's
    :attr:`Canonical.padding`, reused when it fits this call (:meth:`Padding.fits`: the layers of one
    forward share their mask information), so that only a forward's first layer reads the mask from
    the device or builds the :class:`SeqInfo`."""
    batch, _, sq, _ = q.shape
    sk = k.shape[2]
    query_index = info.query_index if info is not None else sk - sq
    if query_index < 0 or query_index + sq > sk:
        raise UnsupportedInputError(
            f"queries at key index {query_index}..{query_index + sq} do not fit {sk} keys"
        )
    device = q.device
    if info is not None and info.key_mask is None:
        info = None  # nothing padded: the coordinates depend on the shapes and the query index alone
    if padding is None or not padding.fits(info, query_index, batch, sq, sk, device):
        if info is None:
            # valid by construction from the host integers checked above: no device read
            seq = SeqInfo.dense(batch, sq, sk, device) if query_index == sk - sq else SeqInfo.trusted(
                torch.full((batch,), query_index, dtype=torch.long, device=device),
                torch.full((batch,), sk, dtype=torch.long, device=device),
                sq,
                sk,
                keys_unpadded=True,
            )
            padding = Padding(None, [], [], seq, query_index)
        else:
            padding = read_padding(info, batch, sq, sk, device)
    if info is None:
        return Canonical(q, k, v, padding.seq, lambda out: out, query_index == 0, padding)
    q_shift = padding.q_shift
    k_c, v_c = _roll_rows(k, padding.starts), _roll_rows(v, padding.starts)
    q_c = _roll_rows(q, q_shift)

    def restore(out: torch.Tensor) -> torch.Tensor:
        return _roll_rows(out, [-s for s in q_shift]) if any(q_shift) else out

    return Canonical(q_c, k_c, v_c, padding.seq, restore, query_index == 0, padding)
