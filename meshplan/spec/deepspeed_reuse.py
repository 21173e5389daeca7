"""DeepSpeed ZeRO-3's parameter coordinator at the grain of one parameter (``training.zero3_engine =
"deepspeed"``; deepspeedai/DeepSpeed edaa722 ``runtime/zero/partitioned_param_coordinator.py``,
the lines quoted below): the one parameter its prefetch takes past ``stage3_max_live_parameters``
(:func:`prefetch_taken`, :func:`frontier_bytes`) and the parameters ``stage3_max_reuse_distance``
keeps gathered between two uses (:func:`reuse_kept`). Pure functions of parameter sizes; the
window they refine is :func:`meshplan.spec.deepspeed_memory.deepspeed_ahead_bytes`'s.

The prefetch loop (:452-476)::

    max_params_to_prefetch = min(self.__max_n_available_params - self.__n_available_params,
                                 self.__prefetch_bucket_sz)
    while self.__param_queue and numel_prefetching < max_params_to_prefetch:
        param_in_trace = self.__param_queue.popleft()
        do_prefetch = param_in_trace.param.ds_status == ZeroParamStatus.NOT_AVAILABLE
        ...
        if do_prefetch:
            params_to_prefetch.add(param_in_trace.param)
            numel_prefetching += param_in_trace.param.ds_numel

The limit is checked before a parameter is taken, so the loop stops at the first parameter that
reaches it: the prefetch takes the shortest run of the queue whose elements reach the room, up
to one parameter (less one element) past ``max_live``.

The release (``release_sub_module`` :498 calls ``__params_to_release(submodule, self.__step_id)``,
the step after the module's own fetch, :490 ``self.__step_id += 1``; :653-662)::

    params_traversed = 0
    for module in self.__submodule_order[step_id:]:
        if params_traversed >= self.__max_reuse_dist_in_numel:
            break
        for param in iter_params(module, ...):
            params_to_release.discard(param.ds_id)
            params_traversed += param.ds_numel

A parameter is kept gathered after its module when its next use in the recorded forward+backward
trace comes after fewer than ``max_reuse_distance`` elements of the modules between (every
parameter's ``ds_numel``, persistent ones too); a kept parameter stays counted in
``__n_available_params`` (:630 only subtracts at a release), so it takes room from the prefetch,
and its next fetch finds it ``AVAILABLE`` (:365-366): no all-gather.

Not modelled: ``__params_to_release`` also keeps a parameter whose later use the prefetch skipped
because it was still gathered (:642-651, ``__most_recent_step_id_param_fetched_for[param] >
step_id``), e.g. at the end of the forward, when the window reaches past the loss into the
backward's first layer while that layer's forward parameters are still gathered; that depends on
module-by-module timing meshplan's layer units do not keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: ``stage3_max_reuse_distance`` default, elements (deepspeedai/DeepSpeed edaa722
#: ``runtime/zero/config.py:244``: ``max_reuse_distance: int = Field(pp_int(1e9), ge=0, ...)``).
DEEPSPEED_MAX_REUSE_ELEMENTS = 1_000_000_000
#: ``stage3_param_persistence_threshold`` default, elements: smaller parameters are never
#: partitioned, never gathered (edaa722 ``runtime/zero/config.py:221``).
DEEPSPEED_PERSISTENCE_ELEMENTS = 100_000


def prefetch_taken(room: int, queue: Sequence[int]) -> int:
    """What one prefetch takes from ``queue`` (the sizes of the parameters next in the trace that
    are not gathered, in trace order; elements or bytes, as ``room``) when ``room`` is
    ``min(max_live - available, bucket)``: the shortest run of the queue whose sum reaches
    ``room`` (``while ... numel_prefetching < max_params_to_prefetch``, :457), the whole queue
    where it is shorter; nothing when ``room <= 0``.

    Parameters of 100, 200, 300 and 400: room 250 takes the first two (300, 50 past it), room 300
    the same (exactly), room 301 three (600):

    >>> [prefetch_taken(r, (100, 200, 300, 400)) for r in (0, 250, 300, 301, 5000)]
    [0, 300, 300, 600, 1000]
    """
    taken = 0
    for size in queue:
        if taken >= room:
            break
        taken += size
    return taken


def frontier_bytes(room: int, layer_params: Sequence[int]) -> int:
    """Bytes gathered past a layer boundary when the prefetch's ``room`` starts there, the layers
    after it alike (``layer_params``: one layer's parameters' bytes in trace order; empty: the
    room to the byte): whole layers, then :func:`prefetch_taken` of the rest in the next one.
    Persistent parameters (never gathered) are in meshplan's layer bytes and so in
    ``layer_params``: a run may end at a norm's boundary where DeepSpeed's ends at the next
    weight's, a norm's bytes short at most.

    The 4-parameter layer of 1,000 B: room 2,250 B is 2 layers and 250 B, which ends in the
    second parameter: 2,300 B:

    >>> frontier_bytes(2250, (100, 200, 300, 400)), frontier_bytes(2250, ()), frontier_bytes(-5, (100,))
    (2300, 2250, 0)
    """
    layer = sum(layer_params)
    if room <= 0 or layer <= 0:
        return max(room, 0)
    whole, rest = divmod(room, layer)
    return whole * layer + prefetch_taken(rest, layer_params)


@dataclass(frozen=True)
class ReuseKept:
    """Elements ``stage3_max_reuse_distance`` keeps gathered per micro-batch (:func:`reuse_kept`):
    ``layers``: of each layer (first to last), from its forward to its next use (the backward, or
    under full recompute the replayed forward); ``head``: of the final norm and output layer, from
    their forward to their backward; ``replay``: of each layer under full recompute, from its
    replayed forward to its backward (0 without recompute)."""

    layers: tuple[int, ...]
    head: int
    replay: int

    @property
    def at_turn(self) -> int:
        """Elements kept across the forward -> backward turn: the layers' and the head's."""
        return sum(self.layers) + self.head

    @property
    def saved(self) -> int:
        """Elements no longer all-gathered per micro-batch: each kept element once."""
        return self.at_turn + self.replay * len(self.layers)

    def gathered_at_turn(self, layer_params: Sequence[int], live: int) -> int:
        """Elements gathered when the last layer's backward starts: every element kept, the rest of
        the last layer fetched on demand, and the prefetch topping up to ``live``
        (``max_live``) where that is more (the kept count in ``__n_available_params``, :593/:630).
        """
        return max(self.at_turn + sum(layer_params) - self.layers[-1], live) if self.layers else live


def _kept(params: Sequence[int], between, distance: int, persist_below: int) -> int:
    """Elements of ``params`` (trace order) gathered (>= ``persist_below``) whose ``between(j)``,
    the elements traversed before their next use, is under ``distance``."""
    return sum(n for j, n in enumerate(params) if n >= persist_below and between(j) < distance)


def reuse_kept(layer_params: Sequence[int], layers: int, head: Sequence[int], distance: int,
               recompute: bool, persist_below: int = DEEPSPEED_PERSISTENCE_ELEMENTS) -> ReuseKept:
    """The elements ``distance`` (``stage3_max_reuse_distance``) keeps gathered in one
    forward+backward of ``layers`` alike layers (``layer_params``: one layer's parameters'
    elements in forward order; ``head``: the final norm's and output layer's, after the last
    layer), the module docstring's rule over the trace (each parameter its own module):

    - forward -> backward (no recompute), parameter j of layer i (0-based) of a layer of ``E``
      elements: ``2 sum_{k>j} n_k + 2 (layers-1-i) E + 2 head`` elements between (the rest of
      the layer, the later layers and the head, each in forward and again in backward);
    - full recompute, forward -> replayed forward: ``E - n_j + 2 (layers-1-i) E + 2 head``; the
      replay -> backward, every layer: ``2 sum_{k>j} n_k``;
    - the head, its forward -> backward: ``2 sum_{k>j} h_k`` (the output layer is reused at once).

    Parameters under ``persist_below`` elements (``stage3_param_persistence_threshold``, 1e5 by
    default, ``config.py:221``) are never partitioned and not counted here (they still count as
    elements traversed). The embedding (at least every layer twice between its uses) is left out.

    4 layers of parameters 100, 200, 300 and 400 (E 1,000), a head of 100, distance 1.5 layers:
    without recompute only the last layer's last two are within it (2 x 400 + 200 = 1,000 and
    0 + 200); the head too (2 x 0); with recompute the last layer whole (1,000 - n_j + 200 <=
    1,100) and, every layer, the replay's last three (2 x 700, 2 x 400, 0 < 1,500):

    >>> p = (100, 200, 300, 400)
    >>> reuse_kept(p, 4, (100,), 1500, False, persist_below=0)
    ReuseKept(layers=(0, 0, 0, 700), head=100, replay=0)
    >>> r = reuse_kept(p, 4, (100,), 1500, True, persist_below=0)
    >>> r, r.saved
    (ReuseKept(layers=(0, 0, 0, 1000), head=100, replay=900), 4700)

    Distance 0 keeps nothing (``params_traversed >= 0`` breaks at once):

    >>> reuse_kept(p, 4, (100,), 0, True, persist_below=0).saved
    0
    """
    big = sum(layer_params)
    tail = [sum(layer_params[j + 1:]) for j in range(len(layer_params))]
    h = 2 * sum(head)
    out = []
    for i in range(layers):
        later = 2 * (layers - 1 - i) * big + h
        if recompute:
            out.append(_kept(layer_params, lambda j: big - layer_params[j] + later, distance, persist_below))
        else:
            out.append(_kept(layer_params, lambda j: 2 * tail[j] + later, distance, persist_below))
    head_tail = [sum(head[j + 1:]) for j in range(len(head))]
    kept_head = _kept(head, lambda j: 2 * head_tail[j], distance, persist_below)
    replay = _kept(layer_params, lambda j: 2 * tail[j], distance, persist_below) if recompute else 0
    return ReuseKept(tuple(out), kept_head, replay)
