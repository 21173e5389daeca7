"""MoE routing as the frameworks configure it: capacity factor, dropless, a stated imbalance.

One home for the token-copy counts an MoE layer moves and computes on one rank per
micro-batch; the all-to-all sizes (:mod:`meshplan.comm.collectives`), the routed experts'
activations (:mod:`meshplan.memory.workingset`), the expert GEMMs (:func:`meshplan.compute.shapes.layer_gemms`)
and the search's all-to-all column (:mod:`meshplan.search.timing`) all read it.

Inputs (``[training]``): ``moe_capacity_factor`` f (Megatron-LM ``--moe-expert-capacity-factor``,
the Switch Transformer's capacity factor, Fedus et al. 2021, 2.2), ``moe_dropless``
(Megatron-LM without a capacity factor, torchtitan's default: every copy is computed), and
``moe_hottest_expert_share`` p, the share of all token copies the busiest expert gets
(unset: balanced, ``1 / experts``), the same on every rank.

With ``T`` distinct tokens a rank routes and dispatches (:func:`routed_tokens`: ``b * s/cp / tp``
under Megatron-LM, whose etp ranks then all-gather what they received; ``b * s/cp * etp/tp`` under
torch), ``k = top_k``, ``E`` experts, ``n = E / ep`` local experts:

- **capacity** (dropping): ``C = ceil(f * T * k / E)`` copies per expert per source rank,
  computed from the static shape, so it is the same on every rank (a rank sizing its own
  buffer from its routed counts would send an all-to-all of a different size than its peers
  expect and hang). The dispatch buffer is ``E x C`` rows, empty slots padded, so every rank
  sends and receives ``E * C`` rows and each local expert's GEMM has ``ep * C`` rows,
  whatever the routing; the hottest expert drops ``max(0, ceil(p T k) - C)`` copies per rank.
- **capacity without padding** (``RoutingOptions.padded`` false: Megatron-LM's flex dispatcher
  with the deepep backend, ``training.moe_dispatcher = "deepep"``, whose TransformerConfig refuses
  ``--moe-pad-expert-input-to-capacity``; NVIDIA/Megatron-LM d98e8a6 ``transformer_config.py``
  lines 1754-1761): the router drops the same copies over the same ``C`` per expert per source rank
  (``moe_utils.apply_router_token_dropping``, called by ``router.py`` line 794 on the rank's own
  tokens) and ``_DeepepManager.setup_metadata`` masks them (index -1), so only the kept copies
  travel: each expert keeps ``min(its copies, C)``: the hottest ``min(ceil(p T k), C)``, each other
  ``min(ceil((1 - p) T k / (E - 1)), C)``; the rank sends their sum (``send_rows``) and each local
  expert's GEMM has ``ep`` times its kept copies.
- **dropless**: no padding, nothing dropped; the hottest expert receives ``ep * p * T * k``
  rows, each other expert ``ep * (1 - p) * T * k / (E - 1)``; the rank holding the hottest
  expert receives ``ep * T * k * (p + (n - 1)(1 - p)/(E - 1))`` rows (balanced: ``T * k``),
  and its all-to-all and GEMMs set the layer's time (every rank waits for it). Balanced
  (no share stated) this is the expected load of uniform routing, ``T * k / ep`` rows per
  peer: the balanced case, which a real router's per-step counts scatter around. Frameworks
  first exchange the per-expert counts (torchtitan's ``AllToAllTokenDispatcher._token_count_exchange``,
  an all-to-all of ``E`` int64 per rank; Megatron-LM's ``MoEAlltoAllTokenDispatcher.preprocess``,
  an all-gather of them over ep x etp; forward only), which the collective table lists and the
  step times before each dispatch (:func:`meshplan.comm.ep_rows._count_rows`).

>>> r = routing(RoutingOptions(capacity_factor=1.25), tokens=4096, top_k=2, experts=8, ep=4)
>>> r.capacity, r.recv_rows, r.hot_expert_rows, r.dropped
(1280, 10240, 5120, 0)
>>> d = routing(RoutingOptions(dropless=True, hottest_share=0.4), tokens=3000, top_k=2, experts=4, ep=2)
>>> d.recv_rows, d.hot_expert_rows, d.other_expert_rows  # 2 x 0.4 x 6000; 2 x 0.6/3 x 6000
(7200, 4800, 2400)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class RoutingOptions:
    """The stated routing of a run (module docstring); defaults: capacity factor 1, dropping,
    balanced."""

    capacity_factor: float = 1.0
    dropless: bool = False
    hottest_share: Optional[float] = None
    padded: bool = True

    @staticmethod
    def of(training) -> "RoutingOptions":
        """From a :class:`~meshplan.spec.training.TrainingSpec`: a capacity factor given means
        dropping with it; ``moe_dropless`` given is that choice (false: capacity factor 1);
        neither given is the engine's own default, dropless under either framework
        (:attr:`~meshplan.spec.training.TrainingSpec.moe_routing` cites torchtitan and Megatron-LM).

        >>> from meshplan.spec.training import TrainingSpec
        >>> t = lambda **kw: RoutingOptions.of(TrainingSpec(global_batch=8, seq_len=16, **kw))
        >>> t().dropless, t(framework="megatron").dropless, t(moe_capacity_factor=1.25).capacity_factor
        (True, True, 1.25)
        >>> t(moe_dropless=False)
        RoutingOptions(capacity_factor=1.0, dropless=False, hottest_share=None, padded=True)
        >>> t(moe_capacity_factor=1.25, framework="megatron", moe_dispatcher="deepep").padded
        False
        """
        factor, dropless = training.moe_routing  # the one rule: TrainingSpec.moe_routing
        return RoutingOptions(factor, dropless, training.moe_hottest_expert_share,
                              padded=training.moe_dispatcher != "deepep")


@dataclass(frozen=True)
class Routing:
    """Token copies of one MoE layer on the busiest rank per micro-batch (module docstring):
    ``tokens`` T routed, ``copies`` T k, ``capacity`` C (None dropless), ``send_rows`` the
    rank's dispatch buffer, ``recv_rows`` the busiest rank's received rows (the all-to-all
    size in rows), ``hot_expert_rows`` and ``other_expert_rows`` the GEMM rows of its hottest
    and other local experts, ``dropped`` copies dropped per rank at the hottest expert."""

    tokens: int
    copies: int
    capacity: Optional[int]
    send_rows: int
    recv_rows: int
    hot_expert_rows: int
    other_expert_rows: int
    dropped: int
    share: float

    def describe(self, opts: RoutingOptions, top_k: int, experts: int, ep: int, origin: str = "") -> str:
        """One line with the arithmetic, for the plan's notes; ``origin``: how T follows from the
        mesh (e.g. ``4096 local tokens x etp 1 / tp 2``), written before T's value."""
        t_is = f"T = {origin} = " if origin else "T = "
        bal = "balanced" if opts.hottest_share is None else f"hottest expert {self.share:.3g} of the copies"
        if self.capacity is None:
            load = (f"the expected load of uniform routing, T x top_k / ep = {self.copies / ep:g} rows per peer "
                    f"(the balanced case: a real router's counts vary per step)" if opts.hottest_share is None
                    else f"what the busiest ep rank receives, {self.recv_rows} rows (its hottest expert "
                         f"{self.hot_expert_rows})")
            return (f"MoE dropless ({bal}): tokens per rank {t_is}{self.tokens}, copies T x top_k {top_k} = "
                    f"{self.copies}; all-to-alls sized by {load}; per-expert counts exchanged before each "
                    f"dispatch ({experts} int64 per rank, timed before it)")
        if not opts.padded:
            return (f"MoE capacity = ceil({opts.capacity_factor:g} x T {self.tokens} x top_k {top_k} / experts "
                    f"{experts}) = {self.capacity} copies per expert per source rank, tokens per rank {t_is}"
                    f"{self.tokens}; no padding (deepep): {self.send_rows} of the {self.copies} copies kept and "
                    f"sent ({bal}), {self.copies - self.send_rows} dropped per rank per layer")
        return ((f"MoE tokens per rank {t_is}{self.tokens}; " if origin else "")
                + f"MoE capacity = ceil({opts.capacity_factor:g} x T {self.tokens} x top_k {top_k} / experts "
                f"{experts}) = {self.capacity} copies per expert, the same on every ep rank (static shape); "
                f"dispatch buffer {experts} x {self.capacity} = {self.send_rows} rows, {ep * self.capacity} per "
                f"local expert; {bal}: {self.dropped} copies dropped per rank per layer")


def routed_tokens(tokens, tp, etp, framework: str = "torch"):
    """(T, g) of one MoE layer on one rank: ``T`` the tokens it routes and dispatches over ep (the
    all-to-all carries :func:`routing` of them), ``g`` the etp ranks whose received rows each expert
    GEMM takes (the rows of :func:`routing` times ``g``). ``tokens``: the micro-batch's ``b * s/cp``;
    ints or numpy arrays (the search's columns) alike.

    - Megatron-LM (``MoEAlltoAllTokenDispatcher``, NVIDIA/Megatron-LM d98e8a6
      ``megatron/core/transformer/moe/token_dispatcher.py``): each rank routes its own sequence-parallel
      shard ``b * s/cp / tp`` (the MoE layer's input under SP, which ``moe_layer.py``:636-640 requires at
      tp > 1), all-to-alls it over the ep group (:705-724, ``self.ep_group``), then at etp > 1 all-gathers
      what it received over the etp group (``dispatch_postprocess``, :741-751, ``self.tp_group`` =
      ``pg_collection.expt_tp``, :86) and reduce-scatters the experts' output there before the combine
      (``combine_preprocess``, :824-833): ``(b s/cp / tp, etp)``.
    - torch (torchtitan b5bcd76, :data:`meshplan.spec.axes.moe_tp.TORCH_ETP`): with ep > 1 (etp 1) the tp
      ranks split the tokens, ``b s/cp / tp``; at ep 1 with etp = tp every tp rank takes all of them
      (its MoE input all-gathered over tp before routing): ``(b s/cp x etp / tp, 1)``.

    The newcomer trial's Mixtral-8x22B, 4096 local tokens at tp 2, etp 2: Megatron-LM dispatches
    2048 per rank (2048 x top-2 x 6144 x 2 B = 50,331,648 B per all-to-all) and gathers 2 ranks' rows:

    >>> routed_tokens(4096, 2, 2, "megatron"), routed_tokens(4096, 2, 1, "megatron"), routed_tokens(4096, 2, 2)
    ((2048, 2), (2048, 1), (4096, 1))
    >>> import numpy as np
    >>> [x.tolist() for x in routed_tokens(np.array([4096, 4096]), np.array([2, 4]), np.array([2, 1]), "megatron")]
    [[2048, 1024], [2, 1]]
    """
    megatron = framework == "megatron"
    routed = np.maximum(tokens * (1 if megatron else etp) // tp, 1)
    gathered = etp if megatron else etp * 0 + 1
    return (int(routed), int(gathered)) if np.ndim(routed) == 0 else (routed, gathered)


def _ceil(x):
    """``ceil`` that ignores float noise of products such as 2 x 0.4 x 6000 = 4800.000000000001."""
    return np.ceil(np.round(x, 6))


def expert_capacity(tokens: int, top_k: int, experts: int, factor: float = 1.0) -> int:
    """Token copies one expert takes from the ``tokens`` tokens one rank routes:
    ``ceil(factor * tokens * top_k / experts)`` (expert capacity of the Switch Transformer,
    Fedus et al. 2021, section 2.2, with top_k copies per token). The runtime MoE
    (:mod:`meshplan.runtime.execution.moe`) drops copies beyond it and pads the rest, so its
    dispatch buffer is always ``experts x capacity`` tokens.

    >>> expert_capacity(64, 2, 8), expert_capacity(10, 2, 8), expert_capacity(10, 2, 8, 1.5)
    (16, 3, 4)
    """
    return int(_ceil(factor * tokens * top_k / experts))


def balance_note(model, training) -> Optional[str]:
    """The routing an MoE plan assumes, in one note that ``plan``, ``step``, ``search`` and
    ``memory`` each print once (newcomer trial 26 #4: none said routing was balanced): unset
    ``training.moe_hottest_expert_share`` is the balanced share 1 / experts on every rank, which
    sizes the ep all-to-alls, the expert GEMMs and the routed-expert activations; None for a
    dense ``model``.

    >>> from meshplan.spec.training import TrainingSpec
    >>> from meshplan.catalog import model
    >>> print(balance_note(model("mixtral-8x7b"), TrainingSpec(global_batch=8, seq_len=16)))
    MoE routing assumed balanced: each of the 8 experts gets 1/8 of the token copies on every rank, which sizes the ep all-to-alls, the expert GEMMs and the routed-expert activations (a real router's per-step counts scatter around it); set training.moe_hottest_expert_share (the busiest expert's share, 1/8 to 1) to plan a skewed one
    >>> print(balance_note(model("mixtral-8x7b"), TrainingSpec(global_batch=8, seq_len=16, moe_hottest_expert_share=0.3)))
    MoE routing as stated: the busiest expert gets 0.3 of the token copies on every rank (training.moe_hottest_expert_share; unset: balanced, 1/8), which sizes the ep all-to-alls, the expert GEMMs and the routed-expert activations
    >>> balance_note(model("llama3-8b"), TrainingSpec(global_batch=8, seq_len=16)) is None
    True
    """
    if not model.is_moe:
        return None
    sized = "the ep all-to-alls, the expert GEMMs and the routed-expert activations"
    e, p = model.experts, training.moe_hottest_expert_share
    if p is None:
        return (f"MoE routing assumed balanced: each of the {e} experts gets 1/{e} of the token copies on every rank, "
                f"which sizes {sized} (a real router's per-step counts scatter around it); set "
                f"training.moe_hottest_expert_share (the busiest expert's share, 1/{e} to 1) to plan a skewed one")
    return (f"MoE routing as stated: the busiest expert gets {p:g} of the token copies on every rank "
            f"(training.moe_hottest_expert_share; unset: balanced, 1/{e}), which sizes {sized}")


def hottest_share(opts: RoutingOptions, experts: int) -> float:
    """The stated share of the busiest expert, or ``1 / experts`` (balanced)."""
    return 1.0 / experts if opts.hottest_share is None else opts.hottest_share


def planned_imbalance(opts: RoutingOptions, experts: int, ep: int) -> tuple[float, float]:
    """(max / mean token copies per expert, max / mean per ep rank) of the planned dropless
    routing (module docstring), what ``meshplan validate`` sets the router's measured counts
    against: the hottest expert's ``p T k`` over the mean ``T k / E``, ``p E``; the busiest rank's
    ``T k (p + (n - 1)(1 - p)/(E - 1))`` per source rank over the mean ``T k / ep``. Balanced
    (no share stated): 1 and 1.

    >>> planned_imbalance(RoutingOptions(dropless=True), 8, 2)
    (1.0, 1.0)
    >>> [round(x, 4) for x in planned_imbalance(RoutingOptions(dropless=True, hottest_share=0.4), 4, 2)]
    [1.6, 1.2]
    """
    p, local = hottest_share(opts, experts), experts // ep
    other = (1 - p) / (experts - 1) if experts > 1 else 0.0
    return p * experts, ep * (p + (local - 1) * other)


def routing(opts: RoutingOptions, tokens: int, top_k: int, experts: int, ep: int) -> Routing:
    """:class:`Routing` of ``tokens`` routed tokens per rank (module docstring)."""
    p, copies, local = hottest_share(opts, experts), tokens * top_k, experts // ep
    if not opts.dropless and not opts.padded:
        return _unpadded(opts, tokens, top_k, experts, ep)
    if not opts.dropless:
        cap = expert_capacity(tokens, top_k, experts, opts.capacity_factor)
        rows = experts * cap
        return Routing(tokens, copies, cap, rows, rows, ep * cap, ep * cap, max(0, int(_ceil(p * copies)) - cap), p)
    other = (1 - p) / (experts - 1) if experts > 1 else 0.0
    hot, rest = int(_ceil(ep * p * copies)), int(_ceil(ep * other * copies))
    return Routing(tokens, copies, None, copies, hot + (local - 1) * rest, hot, rest, 0, p)


def _unpadded(opts: RoutingOptions, tokens: int, top_k: int, experts: int, ep: int) -> Routing:
    """:func:`routing` of a capacity without padding (module docstring): each expert keeps at most C
    of its copies from each source rank. Balanced, f 0.5, T 4096, k 8, E 256: C = 64 of 128 copies
    per expert, 16384 of the 32768 copies kept (recv: 64 ranks x 4 local experts x 64):

    >>> r = routing(RoutingOptions(capacity_factor=0.5, padded=False), 4096, 8, 256, 64)
    >>> r.capacity, r.send_rows, r.recv_rows, r.hot_expert_rows
    (64, 16384, 16384, 4096)
    """
    p, copies, local = hottest_share(opts, experts), tokens * top_k, experts // ep
    cap = expert_capacity(tokens, top_k, experts, opts.capacity_factor)
    other = (1 - p) / (experts - 1) if experts > 1 else 0.0
    hot_in, rest_in = int(_ceil(p * copies)), int(_ceil(other * copies))
    hot, rest = min(hot_in, cap), min(rest_in, cap)
    kept = hot + (experts - 1) * rest
    return Routing(tokens, copies, cap, kept, ep * (hot + (local - 1) * rest), ep * hot, ep * rest,
                   max(0, hot_in - cap), p)


def a2a_rows(opts: RoutingOptions, tokens, top_k: int, experts: int, ep):
    """``recv_rows`` of :func:`routing` for numpy arrays of ``tokens`` and ``ep`` (the
    search's candidates): the same formula, elementwise.

    >>> import numpy as np
    >>> a2a_rows(RoutingOptions(capacity_factor=1.25), np.array([4096, 10]), 2, 8, np.array([4, 2])).tolist()
    [10240, 32]
    """
    p, copies = hottest_share(opts, experts), np.asarray(tokens) * top_k
    if not opts.dropless and not opts.padded:
        cap, ep = _ceil(opts.capacity_factor * copies / experts), np.asarray(ep)
        other = (1 - p) / (experts - 1) if experts > 1 else 0.0
        hot, rest = np.minimum(_ceil(p * copies), cap), np.minimum(_ceil(other * copies), cap)
        return (ep * (hot + (experts // ep - 1) * rest)).astype(np.int64)
    if not opts.dropless:
        return experts * _ceil(opts.capacity_factor * copies / experts).astype(np.int64)
    ep = np.asarray(ep)
    other = (1 - p) / (experts - 1) if experts > 1 else 0.0
    hot, rest = _ceil(ep * p * copies), _ceil(ep * other * copies)
    return (hot + (experts // ep - 1) * rest).astype(np.int64)
