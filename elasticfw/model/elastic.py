"""Elastic models: a frozen Hugging Face causal LM plus a router, entered through transformers'
attention interface.

>>> elastic = ElasticModel(hf_model, recipe.elastic)        # turn a loaded model elastic
>>> out = elastic(input_ids=ids, attention_mask=mask)       # any forward / generate works
>>> elastic.routing.msr, elastic.routing.esr                # per-sample statistics
>>> base = elastic.unwrap()                                 # and back
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elasticfw.attention.mode import ModeCosts
from elasticfw.errors import ElasticError, UnsupportedInputError
from elasticfw.model.adapter import BackboneAdapter
from elasticfw.model.adapter_files import save_adapter
from elasticfw.model.bridge import BINDING_ATTR, IMPLEMENTATION, register_implementation
from elasticfw.model.rotary import RotaryCapture
from elasticfw.model.runtime import ElasticRuntime, LayerBinding
from elasticfw.registry import Registry, get_registry
from elasticfw.routing.base import HeadLayout, Router


def resolve_adapter(config: Any, registry: Registry | None = None) -> BackboneAdapter:
    """The backbone adapter serving ``config.model_type`` (clear error if none does)."""
    registry = registry or get_registry()
    model_type = getattr(config, "model_type", None)
    supported: dict[str, str] = {}
    for entry in registry.entries("backbone"):
        for mt in entry.cls.model_types:  # type: ignore[attr-defined]
            if mt in supported:
                raise UnsupportedInputError(
                    f"model_type {mt!r} is claimed by two backbone adapters, {supported[mt]!r} and {entry.name!r}; "
                    "uninstall or fix one of the plugins"
                )
            supported[mt] = entry.name
    if model_type not in supported:
        raise UnsupportedInputError(
            f"no backbone adapter serves model_type {model_type!r}; supported model types: "
            f"{', '.join(sorted(supported))}. Write a backbone plugin (see docs/how-to/add-a-backbone.md)"
        )
    return registry.get("backbone", supported[model_type])()


#: the two names transformers 5.x has given the KV-cache argument of ``forward`` and ``generate``
CACHE_ARGUMENTS = ("cache", "past_key_values")


def cache_argument(model: nn.Module) -> str:
    """The name under which ``model.forward`` takes its KV cache in the installed transformers:
    ``past_key_values`` (5.17 and earlier 5.x) or ``cache`` (later 5.x)."""
    params = inspect.signature(model.forward).parameters
    for name in CACHE_ARGUMENTS:
        if name in params:
            return name
    raise UnsupportedInputError(
        f"{type(model).__name__}.forward takes none of {CACHE_ARGUMENTS}: elasticfw cannot pass it a KV cache"
    )


def with_cache_argument(kwargs: dict[str, Any], name: str) -> dict[str, Any]:
    """``kwargs`` with a cache given under either name moved to ``name`` (both given: an error), so
    code written for one transformers version runs with the other."""
    other = next(n for n in CACHE_ARGUMENTS if n != name)
    if kwargs.get(other) is None:
        kwargs.pop(other, None)
        return kwargs
    if kwargs.get(name) is not None:
        raise UnsupportedInputError(f"a KV cache was given both as {name}= and as {other}=; give one")
    kwargs = dict(kwargs)
    kwargs[name] = kwargs.pop(other)
    return kwargs


def _is_cache(obj: Any) -> bool:
    """Whether ``obj`` is a transformers KV cache (any :class:`transformers.Cache`)."""
    from transformers.cache_utils import Cache

    return isinstance(obj, Cache)


def _cached_tokens(cache: Any) -> int | None:
    """Tokens ``cache`` holds (``None``: it cannot say)."""
    length = getattr(cache, "get_seq_length", None)
    if length is None:
        return None
    try:
        return int(length())
    except (TypeError, ValueError, IndexError):  # a cache without layers yet, or another API
        return None


@dataclass(frozen=True)
class RoutingReport:
    """Routing and sparsity of the last prefill, per sample.

    ``decisions`` (B, L_routed, Hkv) bool (True = sparse mode); ``msr`` (B,) model sparsity
    ratio; ``esr`` (B,) all-layer effective sparsity ratio (fraction of causal pairs not
    computed over every layer and head — what cost follows); ``esr_last_layer`` (B,) the paper's
    Eq. 5 (mean pruning ratio over the last layer's heads); ``layer_esr`` (B, L, Hq).
    """

    decisions: torch.Tensor
    prob_sparse: torch.Tensor
    msr: torch.Tensor
    esr: torch.Tensor
    esr_last_layer: torch.Tensor
    layer_esr: torch.Tensor
    routed_layers: tuple[int, ...]
    #: K >= 3 modes: (B, L_routed, Hkv) int64, each head's mode (``decisions``: not mode 0); else ``None``
    mode_index: torch.Tensor | None = None
    num_modes: int = 2

    def mode_shares(self) -> torch.Tensor:
        """(B, K) float64: each sample's share of routed (layer, KV head) in each mode."""
        if self.mode_index is None:
            sparse = self.decisions.double().mean((1, 2))
            return torch.stack([1 - sparse, sparse], dim=-1)
        one_hot = torch.nn.functional.one_hot(self.mode_index.long().cpu(), self.num_modes)
        return one_hot.double().mean((1, 2))

    def as_dict(self) -> dict[str, Any]:
        return {
            "msr": self.msr.tolist(),
            "esr": self.esr.tolist(),
            "esr_last_layer": self.esr_last_layer.tolist(),
            "routed_layers": list(self.routed_layers),
            "decisions": self.decisions.int().tolist(),
            **({"modes": self.mode_index.tolist()} if self.mode_index is not None else {}),
        }


class ElasticModel(nn.Module):
    """A causal LM whose attention heads are routed between a retrieval and a sparse mode.

    The backbone's parameters are frozen (``requires_grad=False``) and stay in eval mode;
    ``train()`` / ``eval()`` switch the router only. ``trainable_parameters()`` are the router's.
    """

    def __init__(
        self,
        model: Any,  # a transformers causal LM (PreTrainedModel), used through its duck-typed API
        elastic: Any,
        *,
        registry: Registry | None = None,
        base_model_name: str | None = None,
    ) -> None:
        super().__init__()
        registry = registry or get_registry()
        if getattr(model, "_elasticfw_wrapped", False):
            raise ElasticError("this model is already elastic; unwrap() it first")
        self.adapter = resolve_adapter(model.config, registry)
        self.adapter.check_supported(model.config)
        num_layers, hq, hkv, head_dim = self.adapter.head_layout(model.config)
        windows = [self.adapter.sliding_window(model, i) for i in range(num_layers)]
        routed = tuple(
            i for i in range(num_layers) if windows[i] is None or elastic.route_sliding_window_layers
        )
        if not routed:
            raise UnsupportedInputError(
                "every layer of this model uses a sliding window and elastic.route_sliding_window_layers is "
                "false: nothing to route; set it to true"
            )
        self.elastic_config = elastic
        self.base_model_name = base_model_name or getattr(model.config, "_name_or_path", None) or ""
        # K >= 2 modes, in routing order (a section built elsewhere than the recipe schema: its two fields)
        configs = elastic.mode_configs() if hasattr(elastic, "mode_configs") else [elastic.retrieval_mode, elastic.sparse_mode]
        self.heads = HeadLayout(routed, hkv, hq, head_dim, num_modes=len(configs))
        self.base = model
        #: the name of the backbone's KV-cache argument in the installed transformers
        self.cache_argument = cache_argument(model)
        self.router: Router = registry.make("router", elastic.router, heads=self.heads)
        device = next(model.parameters()).device
        self.router.to(device)
        modes = [registry.make("sparse_mode", config) for config in configs]
        #: each mode's relative cost at a prefill length (what the expected cost weighs mode shares with)
        self.costs = ModeCosts(modes)
        self.runtime = ElasticRuntime(
            retrieval_mode=modes[0],
            sparse_mode=modes[-1],
            modes=modes if len(modes) > 2 else None,
            executor=registry.make("executor", elastic.executor),
            router=self.router,
            routed={layer: i for i, layer in enumerate(routed)},
            num_layers=num_layers,
            num_q_heads=hq,
            num_kv_heads=hkv,
        )
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()
        register_implementation()
        self._previous_impl = model.config._attn_implementation
        for i, module in enumerate(self.adapter.attention_modules(model)):
            setattr(module, BINDING_ATTR, LayerBinding(self.runtime, i))
        if self.router.reads_unrotated_keys:
            self.runtime.rotary = RotaryCapture(list(self.adapter.attention_modules(model)))
        model.set_attn_implementation(IMPLEMENTATION)
        if model.config._attn_implementation != IMPLEMENTATION:
            self.unwrap()
            raise UnsupportedInputError(
                f"{type(model).__name__} did not accept attn_implementation={IMPLEMENTATION!r} (it does not use "
                "transformers' attention interface); elasticfw cannot enter it"
            )
        model._elasticfw_wrapped = True
        self.router.eval()
        #: each KV cache this model filled -> the routing decisions of its prefill and that prefill's
        #: statistics (see :meth:`forward`)
        self._cache_decisions: weakref.WeakKeyDictionary[Any, tuple[dict[int, Any], dict[int, Any]]] = (
            weakref.WeakKeyDictionary()
        )

    # -- nn.Module behaviour ------------------------------------------------------------------
    def train(self, mode: bool = True) -> ElasticModel:
        """Switch the router (only) between training and inference behaviour."""
        self.training = mode
        self.router.train(mode)
        return self

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.router.parameters() if p.requires_grad]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The backbone's forward. The KV cache may be given as ``cache=`` or ``past_key_values=``
        whichever transformers version is installed (:func:`with_cache_argument`), or positionally."""
        self._check_packed(kwargs)
        kwargs = with_cache_argument(kwargs, self.cache_argument)
        given = kwargs.get(self.cache_argument)
        if given is None and args:  # a cache passed positionally
            given = next((a for a in args if _is_cache(a)), None)
        if given is not None:
            self._enter_cache(given)
        out = self.base(*args, **kwargs)
        self._leave_cache(given, out)
        return out

    def _enter_cache(self, cache: Any) -> None:
        """Route the coming forward with the decisions ``cache``'s prefill made, and report that
        prefill's routing statistics (none for a cache this model has not filled, or one emptied
        since: a continuation chunk on it is then an error, a prefill decides afresh). Decisions are
        kept per cache, so a decode step on one cache after a forward on another (several
        conversations, a scoring pass between steps) keeps its own prompt's routing."""
        try:
            kept = self._cache_decisions.get(cache)
        except TypeError as exc:  # not weakly referenceable / hashable
            raise UnsupportedInputError(
                f"elasticfw keeps each KV cache's routing beside it, which needs a cache object that can be weakly "
                f"referenced; {type(cache).__name__} cannot ({exc})"
            ) from exc
        if kept is not None and _cached_tokens(cache) == 0:  # reset() or cropped to nothing: a new prompt
            kept = None
        self.runtime.decisions = dict(kept[0]) if kept is not None else {}
        if kept is not None:
            self.runtime.records = dict(kept[1])

    def _leave_cache(self, given: Any, out: Any) -> None:
        """Keep the decisions the forward made (or reused), and its prefill's statistics, beside the
        cache it filled (given, or returned: as ``past_key_values`` or, with ``return_dict=False``,
        an element of the tuple)."""
        if not self.runtime.decisions:
            return
        if isinstance(out, tuple):
            returned = next((o for o in out if _is_cache(o)), None)
        else:
            returned = getattr(out, "past_key_values", None)
        kept = (dict(self.runtime.decisions), dict(self.runtime.records))
        for cache in (given, returned):
            if cache is not None:
                self._cache_decisions[cache] = kept

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``generate`` of the backbone; routing is decided on the prompt and kept for every step
        (with or without a KV cache). With ``elastic.kv_cache: compact`` and no cache given, the
        call runs with a fresh :class:`~elasticfw.model.kv_cache.ElasticKVCache` (sparse heads keep
        only what their mode reads at decode)."""
        self._check_packed(kwargs)
        kwargs = with_cache_argument(kwargs, self.cache_argument)
        config = getattr(self.base, "generation_config", None)
        cache_impl = kwargs.get("cache_implementation") or getattr(config, "cache_implementation", None)
        if cache_impl not in (None, "dynamic"):
            raise UnsupportedInputError(
                f"cache_implementation={cache_impl!r} is not supported by elasticfw; use the default dynamic cache"
            )
        given = kwargs.get(self.cache_argument)
        use_cache = kwargs.get("use_cache", getattr(config, "use_cache", True))
        if getattr(self.elastic_config, "kv_cache", "full") == "compact" and given is None and use_cache is not False:
            beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
            assisted = any(kwargs.get(k) is not None for k in ("assistant_model", "prompt_lookup_num_tokens"))
            if beams > 1 or assisted:
                raise UnsupportedInputError(
                    "elastic.kv_cache=compact supports greedy decoding and sampling; beam search and assisted "
                    "decoding need the evicted keys back: use elastic.kv_cache=full"
                )
            kwargs[self.cache_argument] = self.make_kv_cache()
        cache = kwargs.get(self.cache_argument)
        self.runtime.decisions = {}
        self.runtime.records = {}
        if cache is not None:  # a cache this model filled (an earlier turn) keeps its prompt's routing
            self._enter_cache(cache)
        self.runtime.hold_decisions = True
        try:
            out = self.base.generate(*args, **kwargs)
        finally:
            self.runtime.hold_decisions = False
        self._leave_cache(cache, out)
        return out

    def make_kv_cache(self, **options: Any) -> Any:
        """A fresh compact KV cache for this model (:class:`~elasticfw.model.kv_cache.ElasticKVCache`;
        ``options`` are its keyword arguments), for ``generate(cache=...)`` or a forward: each head keeps
        what its mode (among two, or the ``elastic.modes``) reads at decode."""
        from elasticfw.model.kv_cache import ElasticKVCache

        return ElasticKVCache(self, **options)

    @staticmethod
    def _check_packed(kwargs: dict[str, Any]) -> None:
        pos = kwargs.get("position_ids")
        if pos is not None and kwargs.get("attention_mask") is None and pos.dim() == 2 and pos.shape[1] > 1:
            if bool((pos[:, 1:] < pos[:, :-1]).any()):
                raise UnsupportedInputError(
                    "packed sequences (position_ids restarting inside a row) are not supported; pad the batch "
                    "and pass attention_mask instead"
                )

    def msr(self) -> torch.Tensor:
        """(B,) model sparsity ratio of the last forward, *differentiable* in training (it carries the
        straight-through gradient of the router's decisions) — the quantity the Lagrangian
        objective constrains. :attr:`routing` holds the detached statistics."""
        decisions = [self.runtime.decisions[i].sparse for i in self.heads.routed_layers if i in self.runtime.decisions]
        if len(decisions) != self.heads.num_routed:
            raise ElasticError("no forward pass has run yet: the MSR is not available")
        return torch.stack(decisions, dim=1).float().mean((1, 2))

    @property
    def modes(self) -> list[Any]:
        """The K attention modes in routing order (mode 0 first)."""
        runtime = self.runtime
        return list(runtime.modes) if runtime.modes is not None else [runtime.retrieval_mode, runtime.sparse_mode]

    def mode_shares(self) -> torch.Tensor:
        """(B, K) share of the routed (layer, KV head) in each mode in the last forward, *differentiable*
        in training like :meth:`msr` (the mean of the decisions' straight-through one-hot rows: the
        forward value is the hard routing, the gradient the router's relaxed probabilities').
        For two modes, column 1 is :meth:`msr`."""
        decisions = [self.runtime.decisions[i] for i in self.heads.routed_layers if i in self.runtime.decisions]
        if len(decisions) != self.heads.num_routed:
            raise ElasticError("no forward pass has run yet: the mode shares are not available")
        return torch.stack([d.one_hot() for d in decisions], dim=1).float().mean((1, 2))

    def expected_cost(self, lengths: list[int]) -> torch.Tensor:
        """(B,) expected relative cost of the last forward, differentiable like :meth:`mode_shares`: the
        mean over routed (layer, KV head) of ``sum_k m_k cost_k``, with ``cost_k`` mode k's cost at the
        sample's prefill length ``lengths[b]`` (:attr:`costs`) — the quantity ``train.constraint: cost``
        constrains."""
        shares = self.mode_shares()
        return (shares * self.costs.table(lengths).to(shares.device, shares.dtype)).sum(-1)

    def set_progress(self, progress: float) -> None:
        """Training progress in [0, 1] (drives the router's temperature schedule)."""
        self.router.set_progress(progress)

    def unwrap(self) -> nn.Module:
        """Restore and return the plain backbone (its parameters' ``requires_grad`` stays False)."""
        model = self.base
        for module in self.adapter.attention_modules(model):
            if hasattr(module, BINDING_ATTR):
                delattr(module, BINDING_ATTR)
        if self.runtime.rotary is not None:
            self.runtime.rotary.remove()
            self.runtime.rotary = None
        model.set_attn_implementation(self._previous_impl)
        model._elasticfw_wrapped = False
        return model

    # -- statistics --------------------------------------------------------------------------------
    @property
    def routing(self) -> RoutingReport:
        records = self.runtime.records
        if not records:
            raise ElasticError("no forward pass has run yet: routing statistics are not available")
        layers = sorted(records)
        routed = [i for i in layers if records[i].sparse is not None]
        decisions = torch.stack([records[i].sparse for i in routed], dim=1)  # type: ignore[misc]
        probs = torch.stack([records[i].prob_sparse for i in routed], dim=1)  # type: ignore[misc]
        causal = records[layers[0]].causal.double().clamp_min(1)
        computed = torch.stack([records[i].computed for i in layers], dim=1).double()  # (B, L, Hq)
        layer_esr = 1 - computed / causal[:, None, None]
        index = [m for m in (records[i].mode_index for i in routed) if m is not None]
        return RoutingReport(
            decisions=decisions,
            prob_sparse=probs,
            msr=decisions.float().mean((1, 2)),
            esr=layer_esr.mean((1, 2)).float(),
            esr_last_layer=layer_esr[:, -1].mean(-1).float(),
            layer_esr=layer_esr.float(),
            routed_layers=tuple(routed),
            mode_index=torch.stack(index, dim=1) if index and len(index) == len(routed) else None,
            num_modes=self.heads.num_modes,
        )

    # -- adapters on disk ------------------------------------------------------------------------
    def save_adapter(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write the router as an adapter folder (see :func:`elasticfw.model.adapter_files.save_adapter`)."""
        return save_adapter(self, path, overwrite=overwrite)
