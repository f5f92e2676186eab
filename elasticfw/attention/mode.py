"""The contract of an attention mode plugin (full attention, streaming, XAttention, MoBA, ...).

A mode builds a layout and runs it with an :class:`~elasticfw.attention.executor.Executor`, so this
module builds on the executor's contract. What an attention call returns
(:class:`~elasticfw.attention.output.AttentionOutput`, :func:`~elasticfw.attention.output.merge_lse`)
and the routed heads' combined layout (:func:`~elasticfw.attention.layout.routed_layout`) are
defined below both and importable from here too.
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import Field, model_serializer

from elasticfw.attention.executor import Executor
from elasticfw.attention.inputs import check_attention_inputs
from elasticfw.attention.layout import BlockLayout
from elasticfw.attention.layout import routed_layout as routed_layout  # re-exported
from elasticfw.attention.output import AttentionOutput, merge_lse
from elasticfw.attention.seq import SeqInfo
from elasticfw.errors import UnsupportedInputError
from elasticfw.registry import PluginConfig


@dataclass(frozen=True)
class DecodeKeep:
    """The keys a mode can still read once the prefill is over: what a compact KV cache keeps.

    A key at position ``j`` is readable by the query at position ``p`` iff ``j <= p`` and
    (``j < sink_tokens`` or ``j >= window_start(p)``), with
    ``window_start(p) = (p // granularity + 1) * granularity - local_tokens``: a token-exact
    window of the last ``local_tokens`` positions when ``granularity`` is 1, a window of whole
    ``granularity``-token blocks (the query's own block counted in it) otherwise. The window
    start never decreases with ``p``, so a key outside the sink that falls before it is never read
    again and can be evicted; at most ``local_tokens`` window keys are readable at once, so a ring
    buffer of ``local_tokens`` slots beside ``sink_tokens`` sink slots holds them.

    A mode that returns one from :meth:`AttentionMode.decode_keep` promises that, for every query
    position at or after the prefill, its layout (and side branch) read *exactly* these keys:
    a compact head's decode attention is then a plain softmax over its kept keys, with no layout.
    """

    sink_tokens: int
    local_tokens: int
    granularity: int = 1

    def __post_init__(self) -> None:
        if self.sink_tokens < 0 or self.local_tokens < 1 or self.granularity < 1:
            raise ValueError(
                f"DecodeKeep needs sink_tokens >= 0, local_tokens >= 1 and granularity >= 1; got "
                f"sink_tokens={self.sink_tokens}, local_tokens={self.local_tokens}, granularity={self.granularity}"
            )
        if self.local_tokens % self.granularity:
            raise ValueError(
                f"DecodeKeep: local_tokens={self.local_tokens} must be a multiple of granularity={self.granularity} "
                "(the window is made of whole blocks)"
            )

    @property
    def capacity(self) -> int:
        """Slots per (sample, KV head): the sink plus a ring of ``local_tokens``."""
        return self.sink_tokens + self.local_tokens

    def window_start(self, position: torch.Tensor) -> torch.Tensor:
        """First window position readable by the query at ``position`` (elementwise)."""
        g = self.granularity
        return (torch.div(position, g, rounding_mode="floor") + 1) * g - self.local_tokens

    def visible(self, key_position: torch.Tensor, query_position: torch.Tensor) -> torch.Tensor:
        """Whether the key at ``key_position`` is read by the query at ``query_position``
        (broadcasting; negative key positions mark empty slots and are never visible)."""
        return (
            (key_position >= 0)
            & (key_position <= query_position)
            & ((key_position < self.sink_tokens) | (key_position >= self.window_start(query_position)))
        )

    def density(self, length: int) -> float:
        """Fraction of the ``length * (length + 1) / 2`` causal pairs of a prefill of ``length`` tokens
        that these keys cover (each query position ``p`` reads :meth:`visible` keys)."""
        p = torch.arange(length, dtype=torch.float64)
        sink = p.clamp(max=self.sink_tokens - 1) + 1 if self.sink_tokens else torch.zeros_like(p)
        start = self.window_start(torch.arange(length)).to(torch.float64).clamp(min=self.sink_tokens)
        return causal_density(sink + (p + 1 - start).clamp(min=0))

    def stored(self, length: int) -> int:
        """Keys a compact cache holds for a sequence of ``length`` tokens: the sink and the ring."""
        return min(length, self.sink_tokens) + min(max(length - self.sink_tokens, 0), self.local_tokens)


def causal_density(keys_per_query: torch.Tensor) -> float:
    """``keys_per_query`` (L,): keys read by the query at each position 0..L-1 of a prefill, as a
    fraction of the L(L+1)/2 causal pairs of dense attention (what :meth:`AttentionMode.cost`
    returns)."""
    length = keys_per_query.shape[0]
    if length < 1:
        raise ValueError("causal_density needs at least one query position")
    return float(keys_per_query.to(torch.float64).sum()) / (length * (length + 1) / 2)


#: marks a method already wrapped by :meth:`AttentionMode.__init_subclass__`
_CHECKED = "__elasticfw_checked__"


class ModeConfig(PluginConfig):
    """Base of every mode's recipe section."""

    cost: float | None = Field(
        default=None,
        ge=0,
        le=100,
        description="Relative cost of this mode: the fraction of dense causal attention work it does (full "
        "attention = 1). Unset: the mode's own estimate for the sequence length (AttentionMode.cost); set it, e.g. "
        "from a measured ESR (cost = 1 - ESR), to override that estimate.",
    )

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        """An unset ``cost`` is left out of dumps: a section that does not set it reads as before."""
        data = handler(self)
        if isinstance(data, dict) and data.get("cost", 0) is None:
            del data["cost"]
        return data


class AttentionMode(ABC):
    """An attention mode: turns (q, k) into the block layout it computes.

    Subclasses set ``name`` and ``config_class`` (a :class:`ModeConfig` with
    ``name: Literal[name]``; its defaults are the paper's, with the source in the docstring),
    implement :meth:`build_layout`, and may add a :meth:`side_branch` (an extra attention merged
    by log-sum-exp, e.g. NSA's compressed keys). Layout construction runs without gradients.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[ModeConfig]]
    #: ``False`` promises that :meth:`build_layout` depends only on ``seq`` and the config (never on
    #: the values of ``q``/``k`` or the scale), so one layout may serve every layer of a forward
    #: whose :meth:`SeqInfo.host_signature` is the same, and an executor may keep what it derived
    #: from it (a BlockMask). Data-dependent modes keep the default ``True``.
    layout_depends_on_inputs: ClassVar[bool] = True

    def __init__(self, config: ModeConfig | None = None) -> None:
        self.config = config if config is not None else self.config_class()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Wrap a subclass's ``side_branch`` so that its inputs are checked
        (:mod:`elasticfw.attention.inputs`) before the mode's own code runs. ``build_layout`` is
        not wrapped: modes whose layout depends only on ``seq`` (streaming, full) are called with
        placeholder tensors; :meth:`attend` checks the inputs before it builds a layout."""
        super().__init_subclass__(**kwargs)
        build = cls.__dict__.get("build_layout")
        if build is not None and "scale" not in inspect.signature(build).parameters:  # written before `scale`

            @functools.wraps(build)
            def build_without_scale(
                self: AttentionMode, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, *, scale: float | None = None
            ) -> BlockLayout:
                return build(self, q, k, seq)

            cls.build_layout = build_without_scale  # type: ignore[method-assign]
        side = cls.__dict__.get("side_branch")
        if side is not None and not getattr(side, _CHECKED, False):

            @functools.wraps(side)
            def checked_side(
                self: AttentionMode, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqInfo, *, scale: float
            ) -> AttentionOutput | None:
                check_attention_inputs(q, k, v, seq, scale=scale, context=f"mode {self.name!r}")
                return side(self, q, k, v, seq, scale=scale)

            setattr(checked_side, _CHECKED, True)
            cls.side_branch = checked_side  # type: ignore[method-assign]

    @property
    def block_size(self) -> int:
        """Block size of the layouts this mode builds (its config's ``block_size``)."""
        return int(getattr(self.config, "block_size"))  # noqa: B009 - every mode config has it

    @abstractmethod
    def build_layout(
        self, q: torch.Tensor, k: torch.Tensor, seq: SeqInfo, *, scale: float | None = None
    ) -> BlockLayout:
        """Layout for q (B, Hq, Sq, D) against start-aligned keys k (B, Hkv, Sk, D).

        The result has 1, Hkv or Hq heads and ``self.block_size`` blocks. ``scale`` is the call's
        attention scale (``None``: ``head_dim ** -0.5``), for estimators that score with a softmax
        (Gemma 3 scales by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``). A mode
        whose ``build_layout`` takes no ``scale`` keeps working: it is called without it.
        """

    def dense_at(self, seq: SeqInfo) -> bool:
        """Whether this mode computes every causal pair of ``seq`` whatever q and k: full attention at
        these lengths (default ``False``). A mode answering ``True`` promises that
        :meth:`build_layout` then returns a ``dense_causal`` layout
        (:func:`~elasticfw.attention.layout.causal_layout`); the runtime builds that layout once per
        :meth:`SeqInfo.host_signature` for every layer of a forward, and a routed layer whose two
        modes are both dense runs as one dense call. Examples: MoBA when ``top_k`` covers every key
        block, streaming when sink and window cover every key, XAttention and MoBA at a decode step
        (``q_len`` 1) under ``decode: full`` (they prune the prefill only, as upstream). A side
        branch is not part of the layout: it is still merged where the mode has one."""
        return False

    def cost(self, length: int) -> float:
        """Relative cost of this mode on a prefill of ``length`` tokens: the fraction of dense causal
        attention work it does (full attention 1.0). The recipe's ``cost`` when set (e.g. ``1 - ESR``
        measured on the task), else :meth:`expected_density`."""
        if length < 1:
            raise ValueError(f"mode {self.name!r}: cost needs a sequence length >= 1, got {length}")
        given = getattr(self.config, "cost", None)
        return float(given) if given is not None else float(self.expected_density(length))

    def expected_density(self, length: int) -> float:
        """The mode's own estimate of its relative cost at ``length`` tokens: the fraction of the causal
        (query, key) pairs its layout computes (plus a side branch's keys, where it has one). Modes whose
        count is a function of the config (full, streaming, MoBA's per-token selection) compute it
        exactly; data-dependent ones give an estimate and say so. Default 1.0: a mode that does not say
        counts as dense, so a cost constraint never favours it by mistake."""
        return 1.0

    def side_branch(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SeqInfo, *, scale: float
    ) -> AttentionOutput | None:
        """Optional extra attention merged with the layout's by log-sum-exp (default: none)."""
        return None

    def decode_keep(self) -> DecodeKeep | None:
        """The keys this mode can still read at decode, or ``None`` (default) when any past key may
        be read again (full attention, and modes that select past blocks by content: XAttention,
        MoBA, NSA). A compact KV cache (``elastic.kv_cache: compact``) keeps only the declared keys
        of the heads routed to this mode, for the rest of the sequence. The declaration must be
        exact for every query position at or after the prefill (see :class:`DecodeKeep`);
        ``tests/test_kv_cache.py`` checks every registered mode that opts in against its
        :meth:`build_layout` at decode positions.
        """
        return None

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq: SeqInfo,
        executor: Executor,
        *,
        scale: float,
        layout: BlockLayout | None = None,
    ) -> AttentionOutput:
        """Run this mode for every head of q with ``executor`` (layout built if not given).

        The inputs are checked against ``executor`` (:meth:`Executor.check_inputs`) before the
        layout is built, so an unsupported call fails before any mode or kernel code runs (the
        layout is checked by ``executor.attend``)."""
        executor.check_inputs(q, k, v, seq, scale=scale)
        if layout is None:
            with torch.no_grad():
                layout = self.build_layout(q, k, seq, scale=scale)
        extra = self.side_branch(q, k, v, seq, scale=scale)
        result = executor.attend(q, k, v, layout, seq, scale=scale, need_lse=extra is not None)
        return merge_lse(result, extra) if extra is not None else result

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"


def attend_routed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq: SeqInfo,
    executor: Executor,
    *,
    retrieval: AttentionMode,
    sparse: AttentionMode,
    hard: torch.Tensor,
    layouts: tuple[BlockLayout, BlockLayout],
    scale: float,
    need_lse: bool = False,
    hard_host: torch.Tensor | None = None,
) -> AttentionOutput:
    """Every query head in its routed mode: ``hard`` (B, Hq) True sends a head to ``sparse``, else
    to ``retrieval``; ``layouts`` are their (retrieval, sparse) layouts. The executor runs them
    (:meth:`~elasticfw.attention.executor.Executor.attend_routed`; by default one launch over
    :func:`routed_layout`, the per-head combination at the smaller block size); a mode's side
    branch (NSA's compressed keys) is merged into its own heads by log-sum-exp. ``hard_host``:
    ``hard`` on the CPU when the caller has it, passed on to an executor that takes it
    (:attr:`~elasticfw.attention.executor.Executor.takes_host_routing`)."""
    # each mode's side branch with the heads it joins (``~hard`` only where the retrieval mode has one:
    # a decode step's host time is its cost, and most modes have none)
    extras = [(extra, hard if to_sparse else ~hard) for extra, to_sparse in
              ((sparse.side_branch(q, k, v, seq, scale=scale), True),
               (retrieval.side_branch(q, k, v, seq, scale=scale), False)) if extra is not None]
    need_lse = need_lse or bool(extras)
    lay_r, lay_s = layouts
    if hard.shape != q.shape[:2]:
        raise UnsupportedInputError(
            f"attend_routed: hard must be (batch, query heads) = {tuple(q.shape[:2])}, got {tuple(hard.shape)}"
        )
    if lay_r.dense_causal and lay_s.dense_causal:  # both modes full at these lengths: the same pairs
        result = executor.attend(q, k, v, lay_r, seq, scale=scale, need_lse=need_lse)
    else:  # the executor decides how to launch the two head groups (default: one launch over routed_layout)
        host = {"hard_host": hard_host} if hard_host is not None and executor.takes_host_routing else {}
        result = executor.attend_routed(q, k, v, seq, hard=hard, layouts=layouts, scale=scale, need_lse=need_lse,
                                        **host)
    for extra, heads in extras:
        merged = merge_lse(result, extra)
        # merge_lse raised unless result.lse was set, and it always returns an lse
        assert merged.lse is not None and result.lse is not None
        result = AttentionOutput(
            torch.where(heads[:, :, None, None], merged.out, result.out),
            torch.where(heads[:, :, None], merged.lse, result.lse),
        )
    return result


def attend_modes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq: SeqInfo,
    executor: Executor,
    *,
    modes: list[AttentionMode],
    index: torch.Tensor,
    layouts: list[BlockLayout],
    scale: float,
    index_host: torch.Tensor | None = None,
) -> AttentionOutput:
    """Every query head in its mode among K: ``index`` (B, Hq) int64 is each head's position in
    ``modes`` (whose layouts are ``layouts``). One executor call over the per-head combination of the
    layouts of the modes some head is in (:func:`routed_layout` folded over them, at the smallest
    block size); where some heads' layouts are dense causal and others not (and the block sizes
    agree), that call is :meth:`Executor.attend_routed` with the dense heads as its first group, so an
    executor may run them through a dense kernel. A mode's side branch is merged into its own heads
    by log-sum-exp. ``index_host``:
    ``index`` on the CPU, when the caller has it (otherwise it is read once from the device)."""
    if index.shape != q.shape[:2]:
        raise UnsupportedInputError(
            f"attend_modes: index must be (batch, query heads) = {tuple(q.shape[:2])}, got {tuple(index.shape)}"
        )
    if len(layouts) != len(modes):
        raise UnsupportedInputError(f"attend_modes: {len(modes)} modes but {len(layouts)} layouts")
    on_host = index_host if index_host is not None else index.cpu()
    present = sorted(int(i) for i in on_host.unique())
    if not present or present[0] < 0 or present[-1] >= len(modes):
        raise UnsupportedInputError(f"attend_modes: mode indices {present} outside [0, {len(modes)})")
    extras = []
    for i in present:
        extra = modes[i].side_branch(q, k, v, seq, scale=scale)
        if extra is not None:
            extras.append((extra, index == i))
    dense = [i for i in present if layouts[i].dense_causal]
    sparse = [i for i in present if not layouts[i].dense_causal]
    if dense and sparse and len({layouts[i].block_size for i in present}) == 1:
        # the dense heads apart from the others: an executor that runs dense causal heads through a
        # dense kernel (``split``) does so; by default the same one launch over the combined layout
        rest = layouts[sparse[0]]
        for i in sparse[1:]:
            rest = routed_layout(index == i, (rest, layouts[i]), seq)
        chosen = torch.tensor(sparse, device=index.device)
        hard = torch.isin(index, chosen)
        host = {"hard_host": torch.isin(on_host, chosen.cpu())} if executor.takes_host_routing else {}
        result = executor.attend_routed(
            q, k, v, seq, hard=hard, layouts=(layouts[dense[0]], rest), scale=scale, need_lse=bool(extras), **host
        )
    else:
        layout = layouts[present[0]]
        if sparse:  # (all dense: the same pairs, one dense call)
            for i in present[1:]:
                layout = routed_layout(index == i, (layout, layouts[i]), seq)
        result = executor.attend(q, k, v, layout, seq, scale=scale, need_lse=bool(extras))
    for extra, heads in extras:
        merged = merge_lse(result, extra)
        assert merged.lse is not None and result.lse is not None  # merge_lse raised unless both were set
        result = AttentionOutput(
            torch.where(heads[:, :, None, None], merged.out, result.out),
            torch.where(heads[:, :, None], merged.lse, result.lse),
        )
    return result



class ModeCosts:
    """The relative cost (:meth:`AttentionMode.cost`) of each of K modes, in routing order, at the
    prefill lengths asked for; each length's costs are computed once. What the expected cost of a
    routing weighs its mode shares with: ``sum_k share_k * cost_k``."""

    def __init__(self, modes: list[AttentionMode]) -> None:
        self.modes = list(modes)
        self._rows: dict[int, tuple[float, ...]] = {}

    def at(self, length: int) -> tuple[float, ...]:
        """The K modes' costs on a prefill of ``length`` tokens."""
        row = self._rows.get(length)
        if row is None:
            row = self._rows[length] = tuple(float(m.cost(length)) for m in self.modes)
        return row

    def table(self, lengths: list[int]) -> torch.Tensor:
        """(B, K) float64 on the CPU: row b holds the modes' costs at ``lengths[b]``."""
        return torch.tensor([self.at(int(n)) for n in lengths], dtype=torch.float64).reshape(len(lengths), len(self.modes))

    def bounds(self, lengths: list[int]) -> tuple[float, float]:
        """(cheapest, dearest): the smallest and the largest cost of any mode at any of ``lengths``,
        the range an expected cost can take on them."""
        rows = [self.at(int(n)) for n in lengths]
        return min(min(r) for r in rows), max(max(r) for r in rows)
