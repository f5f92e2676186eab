"""Where the real tokens are in a (possibly padded) batch, in elasticfw's canonical coordinates.

Canonical coordinates (what modes, layouts and executors see):

* Keys of sample ``b`` are *start-aligned*: key index ``j`` is the ``j``-th real token of that
  sample, and keys ``j >= kv_len[b]`` are padding. (The transformers bridge rolls left-padded
  samples into this form and back, so left and right padding look the same here.)
* Query row ``i`` of sample ``b`` sits at position ``q_start[b] + i`` (a key index). A full
  prefill has ``q_start == 0``; a decode step or a chunked prefill against a cache has
  ``q_start == kv_len - q_len``. Rows whose position is ``>= kv_len[b]`` are padding rows: their
  output is finite but meaningless.
* Causality is ``j <= position``. Block ``n`` of size ``bs`` covers positions / key indices
  ``[n*bs, (n+1)*bs)``, for queries and keys alike, so a block layout's query-block ``t`` of
  sample ``b`` is position block ``q_start[b] // bs + t``.

:func:`check_qkv` checks q, k and v against a ``SeqInfo`` (:meth:`SeqInfo.check` uses it; the rest
of the input checks, built on it, are in :mod:`elasticfw.attention.inputs`).
"""

from __future__ import annotations

import numbers
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from elasticfw.errors import UnsupportedInputError

#: set while :meth:`SeqInfo.trusted` constructs: skip the value check (a device-to-host read)
_TRUSTED: ContextVar[bool] = ContextVar("elasticfw_seqinfo_trusted", default=False)


@dataclass(frozen=True)
class SeqInfo:
    """Per-sample query offset and key length of a batch, in canonical coordinates."""

    q_start: torch.Tensor  # (B,) int64
    kv_len: torch.Tensor  # (B,) int64
    q_len: int
    kv_capacity: int
    #: derived integers already read from the device (per block size), so that the many callers of
    #: :meth:`num_query_blocks` in one attention call cost one host read, not one each
    _memo: dict[tuple[str, int], int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("q_start", "kv_len"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.long:
                shown = f"of shape {tuple(t.shape)}, dtype {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)[:80]
                raise UnsupportedInputError(
                    f"SeqInfo: q_start and kv_len must both be (batch,) int64 tensors, got {name} {shown}"
                )
        if self.kv_len.shape != self.q_start.shape or self.kv_len.device != self.q_start.device:
            raise UnsupportedInputError(
                f"SeqInfo: q_start and kv_len must both be (batch,) tensors on one device, got "
                f"{tuple(self.q_start.shape)} on {self.q_start.device} and {tuple(self.kv_len.shape)} on "
                f"{self.kv_len.device}"
            )
        for name in ("q_len", "kv_capacity"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise UnsupportedInputError(f"SeqInfo: {name} must be a non-negative int, got {value!r}")
        if self.q_start.device.type == "meta" or _TRUSTED.get():
            return  # no values to check, or valid by construction (see `trusted`)
        # one host read for all value checks (canonical coordinates, see the module docstring)
        q_end = self.q_start + self.q_len
        bad = (self.q_start < 0) | (self.kv_len < 0) | (self.kv_len > self.kv_capacity) | (q_end > self.kv_capacity)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise UnsupportedInputError(
                f"SeqInfo: sample {b} has q_start {int(self.q_start[b])} and kv_len {int(self.kv_len[b])} with "
                f"q_len {self.q_len} and kv_capacity {self.kv_capacity}; expected 0 <= kv_len <= kv_capacity, "
                "q_start >= 0 and q_start + q_len <= kv_capacity (queries are positions among the keys)"
            )

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def trusted(
        cls, q_start: torch.Tensor, kv_len: torch.Tensor, q_len: int, kv_capacity: int, *, keys_unpadded: bool | None = None
    ) -> SeqInfo:
        """Construct without the value check, which reads the device (a synchronisation per call
        that costs decode steps on a GPU): for callers whose values are valid by construction,
        computed from integers they checked on the host. Types, shapes and devices are still checked.
        ``keys_unpadded``, when the caller knows it, is what :meth:`keys_unpadded` will answer
        without reading the device."""
        token = _TRUSTED.set(True)
        try:
            seq = cls(q_start, kv_len, q_len, kv_capacity)
        finally:
            _TRUSTED.reset(token)
        if keys_unpadded is not None:
            seq._memo[("keys_unpadded", 0)] = int(keys_unpadded)
        return seq

    @classmethod
    def dense(cls, batch: int, q_len: int, kv_len: int, device: torch.device | str = "cpu") -> SeqInfo:
        """No padding; queries are the last ``q_len`` positions of ``kv_len`` keys."""
        if q_len > kv_len:
            raise UnsupportedInputError(f"q_len ({q_len}) cannot exceed kv_len ({kv_len})")
        if min(batch, q_len, kv_len) < 0:
            raise UnsupportedInputError(f"SeqInfo.dense: batch ({batch}), q_len ({q_len}) and kv_len ({kv_len}) "
                                        "must be non-negative")
        q_start = torch.full((batch,), kv_len - q_len, dtype=torch.long, device=device)
        lens = torch.full((batch,), kv_len, dtype=torch.long, device=device)
        seq = cls.trusted(q_start, lens, q_len, kv_len, keys_unpadded=True)
        seq._memo[("dense", 0)] = 1
        return seq

    @classmethod
    def from_lengths(
        cls, kv_len: torch.Tensor, q_len: int, kv_capacity: int, q_start: torch.Tensor | None = None
    ) -> SeqInfo:
        """Right-padded batch of ``kv_len`` real keys; queries end where each sample ends
        unless ``q_start`` says otherwise (clamped at 0 when ``q_len`` exceeds a sample's length).
        Negative lengths are refused, like the direct constructor does."""
        kv_len = torch.as_tensor(kv_len).to(torch.long)
        if q_start is None:
            q_start = (kv_len - q_len).clamp_min(0)
        return cls(q_start.to(torch.long), kv_len, q_len, kv_capacity)

    # -- derived quantities ------------------------------------------------------------
    @property
    def batch(self) -> int:
        return int(self.q_start.shape[0])

    @property
    def device(self) -> torch.device:
        return self.q_start.device

    def query_positions(self) -> torch.Tensor:
        """(B, q_len) int64 position of every query row."""
        rows = torch.arange(self.q_len, device=self.device)
        return self.q_start[:, None] + rows[None, :]

    def query_valid(self) -> torch.Tensor:
        """(B, q_len) bool: rows that are real tokens (position < kv_len)."""
        return self.query_positions() < self.kv_len[:, None]

    def key_valid(self) -> torch.Tensor:
        """(B, kv_capacity) bool."""
        return torch.arange(self.kv_capacity, device=self.device)[None, :] < self.kv_len[:, None]

    def q_block_start(self, block_size: int) -> torch.Tensor:
        """(B,) position block of query-block row 0."""
        return torch.div(self.q_start, block_size, rounding_mode="floor")

    def num_query_blocks(self, block_size: int) -> int:
        """Rows of a block layout: enough position blocks to cover every sample's queries."""
        key = ("query_blocks", block_size)
        if key not in self._memo and ("dense", 0) in self._memo:  # every q_start is kv_capacity - q_len
            offset = (self.kv_capacity - self.q_len) % block_size
            self._memo[key] = (offset + self.q_len + block_size - 1) // block_size if self.batch else 0
        if key not in self._memo and self.q_len == 1:  # one query per sample: one block, wherever it sits
            self._memo[key] = 1 if self.batch else 0
        if key not in self._memo:  # one device read per SeqInfo and block size
            first = self.q_start % block_size
            self._memo[key] = (
                int(((first + self.q_len + block_size - 1) // block_size).max().item()) if self.batch else 0
            )
        return self._memo[key]

    def keys_unpadded(self) -> bool:
        """Whether every sample's keys fill the capacity (``kv_len == kv_capacity``): no key padding.
        Read from the device once per instance (routers of every layer share the forward's SeqInfo)."""
        key = ("keys_unpadded", 0)
        if key not in self._memo:
            self._memo[key] = int(bool(self.kv_len.eq(self.kv_capacity).all()))
        return bool(self._memo[key])

    def host_signature(self) -> tuple | None:
        """A hashable description of every value of this SeqInfo, known without reading the device,
        or ``None``. Built by :meth:`dense` (no padding, the queries the last ``q_len`` positions):
        ``("dense", batch, q_len, kv_capacity, device)``. Two SeqInfos with the same signature hold
        the same values, so what depends only on them (a streaming layout, its BlockMask) can be
        reused between the layers of a forward."""
        if ("dense", 0) not in self._memo:
            return None
        return ("dense", self.batch, self.q_len, self.kv_capacity, str(self.device))

    def num_key_blocks(self, block_size: int) -> int:
        return (self.kv_capacity + block_size - 1) // block_size

    def query_block_positions(self, block_size: int) -> torch.Tensor:
        """(B, NQB) int64 position-block index of every layout row."""
        nqb = self.num_query_blocks(block_size)
        return self.q_block_start(block_size)[:, None] + torch.arange(nqb, device=self.device)[None, :]

    def causal_pairs(self) -> torch.Tensor:
        """(B,) int64 number of causal (query, key) pairs over real query rows."""
        pos = self.query_positions()
        valid = self.query_valid()
        return torch.where(valid, pos + 1, torch.zeros_like(pos)).sum(-1)

    def check(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Raise if ``q`` (B,Hq,Sq,D) / ``k`` (B,Hkv,Sk,D) do not fit this SeqInfo
        (see :func:`check_qkv`)."""
        check_qkv(q, k, None, self, context="SeqInfo.check")


# -- the check of q, k and v against a SeqInfo (re-exported by elasticfw.attention.inputs) ----------
def describe(t: Any) -> str:
    """``shape (..), device .., dtype ..`` of a tensor, or the type and repr of anything else."""
    if isinstance(t, torch.Tensor):
        return f"shape {tuple(t.shape)}, device {t.device}, dtype {t.dtype}"
    text = repr(t)
    return f"a {type(t).__name__}: {text[:80] + '...' if len(text) > 80 else text}"


def _fail(context: str, name: str, value: Any, expected: str) -> UnsupportedInputError:
    return UnsupportedInputError(f"{context}: argument {name!r} ({describe(value)}) {expected}")


def _check_tensor(context: str, name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(context, name, t, "must be a torch.Tensor of shape (batch, heads, seq, head_dim)")
    if t.layout != torch.strided:
        raise _fail(context, name, t, f"must be a dense (strided) tensor, not {t.layout}")
    if t.dim() != 4:
        raise _fail(context, name, t, f"must be 4-D (batch, heads, seq, head_dim), got {t.dim()}-D")
    if not t.dtype.is_floating_point:
        raise _fail(context, name, t, "must have a floating-point dtype")
    return t


def check_qkv(q: Any, k: Any, v: Any | None, seq: Any, *, context: str = "attention") -> None:
    """Raise :class:`UnsupportedInputError` unless q (B, Hq, Sq, D), start-aligned k and v
    (B, Hkv, Sk, D) and ``seq`` describe one non-empty attention call on one device.

    ``v`` may be ``None`` (layout construction sees only q and k).
    """
    q = _check_tensor(context, "q", q)
    k = _check_tensor(context, "k", k)
    if v is not None:
        v = _check_tensor(context, "v", v)
    if not isinstance(seq, SeqInfo):
        raise _fail(context, "seq", seq, "must be an elasticfw.attention.seq.SeqInfo")

    batch, hq, sq, dim = q.shape
    if min(q.shape) == 0:
        raise _fail(context, "q", q, "must be non-empty: batch, query heads, query rows and head_dim all >= 1")
    if min(k.shape) == 0:
        raise _fail(context, "k", k, "must be non-empty: batch, kv heads, keys and head_dim all >= 1")
    for name, t in (("k", k), ("v", v)):
        if t is None:
            continue
        if t.device != q.device:
            raise _fail(context, name, t, f"must be on the device of q ({q.device})")
        if t.dtype != q.dtype:
            raise _fail(context, name, t, f"must have the dtype of q ({q.dtype})")
    if v is not None and v.shape != k.shape:
        raise _fail(context, "v", v, f"must have the shape of k {tuple(k.shape)}")
    if k.shape[0] != batch:
        raise _fail(context, "k", k, f"must have the batch size of q ({batch})")
    if k.shape[3] != dim:
        raise _fail(context, "k", k, f"must have the head_dim of q ({dim})")
    if hq % k.shape[1] != 0:
        expected = f"must have a number of KV heads ({k.shape[1]}) that divides the query heads of q ({hq}) (GQA)"
        raise _fail(context, "k", k, expected)

    if seq.device != q.device:
        raise UnsupportedInputError(
            f"{context}: argument 'seq' (q_start and kv_len on device {seq.device}) must be on the device of q "
            f"({q.device})"
        )
    if seq.batch != batch or seq.q_len != sq or seq.kv_capacity != k.shape[2]:
        raise UnsupportedInputError(
            f"{context}: argument 'seq' (batch {seq.batch}, q_len {seq.q_len}, kv_capacity {seq.kv_capacity}) "
            f"must match q ({describe(q)}) and k ({describe(k)}): batch {batch}, q_len {sq}, "
            f"kv_capacity {k.shape[2]}"
        )
