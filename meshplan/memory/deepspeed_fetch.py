"""DeepSpeed ZeRO-3's fetch and prefetch in one pass's memory events (``zero3_engine =
"deepspeed"``): :func:`deepspeed_fetch` and :func:`deepspeed_prefetch`, the part of
:class:`meshplan.memory.unit_events.UnitEvents` (``b``, whose events they add) that follows DeepSpeed's parameter coordinator
instead of FSDP2's unshard (its conventions are that module's docstring). The bytes its prefetch keeps gathered and the ``torch.cat`` copy of a
prefetched part are :mod:`meshplan.spec.deepspeed_memory`'s, as the step's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from meshplan.memory.pass_sizes import Unit, UnitKey
from meshplan.mesh.resolve import Mesh, resolve_mesh
from meshplan.mesh.tpsplit import local_numel, padded_vocab
from meshplan.spec.deepspeed_memory import deepspeed_ahead_bytes, deepspeed_copied_bytes
from meshplan.spec.deepspeed_reuse import DEEPSPEED_MAX_REUSE_ELEMENTS, DEEPSPEED_PERSISTENCE_ELEMENTS, reuse_kept
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes

if TYPE_CHECKING:  # the builder whose events these add; no import at run time (it imports this)
    from meshplan.memory.unit_events import UnitEvents


def deepspeed_fetch(b: UnitEvents, key: UnitKey, u: Unit, ahead: list) -> None:
    """DeepSpeed ZeRO-3's fetch of ``key`` (deepspeedai/DeepSpeed edaa722 ``runtime/zero/
    partition_parameters.py``): what was not prefetched is gathered one parameter per Llama leaf
    module by ``_all_gather_sequential`` (:1339-1376), the parameters views of its buffer (one
    copy); of the prefetched part, a bucket gathered coalesced (:1301-1342) is copied out by
    ``torch.cat`` at its ``AllGatherCoalescedHandle.wait`` (:750-784), a second copy until its
    buffer goes: :func:`~meshplan.spec.deepspeed_memory.deepspeed_copied_bytes`, the step's too. A part
    ``stage3_max_reuse_distance`` kept since the forward is not gathered (:func:`reuse_kept_bytes`)."""
    have, kept = b.issued_bytes.pop(key, 0), reuse_kept_bytes(b, key) if key in b.kept else 0
    b.kept.discard(key)
    b._add(u.layer, "gathered_params", u.gathered - kept - have,
           f"{u.name}: all-gathered, the parameters views of the buffer" + (" (the rest)" if have or kept else ""))
    if have:
        assert b.sz.deepspeed_prefetch is not None  # only DeepSpeed's fetch is here
        layer = max((v.gathered for k, v in b.sz.units.items() if isinstance(k, int)), default=0)
        cat = min(have, deepspeed_copied_bytes(u.gathered, b.sz.deepspeed_prefetch, layer, b.sz.deepspeed_params))
        b._add(u.layer, "gathered_params", cat, f"{u.name}: prefetched part copied out of the buffer (torch.cat)")
        b._add(u.layer, "gathered_params", -cat, f"{u.name}: coalesced all-gather buffer freed after its wait")
        b.issued.remove(key)
    b.gathered.add(key)
    for older in [k for k in b.issued if k != key and k not in ahead]:
        b._free_output(older, f"at {u.name}'s fetch")


def deepspeed_prefetch(b: UnitEvents, ahead: list, prefetch: int, live: int) -> None:
    """DeepSpeed ZeRO-3's prefetch after a fetch (edaa722 ``partitioned_param_coordinator.py:452-480``;
    ``prefetch`` and ``live`` bytes): the units of ``ahead`` (next in the pass) gathered or in flight
    up to :func:`~meshplan.spec.deepspeed_memory.deepspeed_ahead_bytes` past the units held (the
    one fetched, a root kept), a unit's part where that ends in it: after a layer's fetch the
    step's frontier at the layer's start, ``max live - layer``; after an end unit's (the
    embedding's in forward, the head's in backward) ``max live - that unit``, the step's
    ``Overlap.fsdp_start``; beside a kept root, less. DeepSpeed
    takes whole parameters, to the end of the one that reaches max live (``b.sz.deepspeed_params``,
    :func:`layer_param_bytes`: :func:`~meshplan.spec.deepspeed_reuse.frontier_bytes`). The parts
    ``stage3_max_reuse_distance`` keeps (:func:`reuse_kept_bytes`) count as held (they stay in
    ``__n_available_params``, coordinator :630)."""
    held = sum(b.sz.units[k].gathered for k in b.gathered) + sum(reuse_kept_bytes(b, k) for k in b.kept)
    room = deepspeed_ahead_bytes((prefetch, live), held, b.sz.deepspeed_params) - sum(b.issued_bytes.values())
    for nxt in ahead:
        if room <= 0:
            break
        room -= b._issue(nxt, room)


def reuse_kept_bytes(b: UnitEvents, key: UnitKey) -> int:
    """Bytes of layer ``key`` that DeepSpeed's ``stage3_max_reuse_distance`` keeps gathered from its
    forward to its backward (``b.sz.deepspeed_kept``, :func:`deepspeed_reuse`; 0 for another unit
    or engine): the forward releases the rest, the backward gathers only the rest (a prefetch
    too), the kept part counted as held meanwhile (``b.kept``). Under full recompute the replay's
    kept part and the backward are one layer step here: held through the layer's backward."""
    kept = b.sz.deepspeed_kept
    return kept[key] if isinstance(key, int) and 0 <= key < len(kept) else 0


def layer_param_bytes(model: ModelSpec, training: TrainingSpec, mesh: Mesh) -> tuple[int, ...]:
    """Bytes one rank gathers of each parameter of the model's largest layer (the first or, in an
    MoE model, the last), in the order the layer's modules run (:meth:`ModelSpec.layer_tensors`,
    under tp, each in the dtype it is gathered in): the order DeepSpeed's trace holds them in
    (``record_parameters``, ``partitioned_param_coordinator.py:241``, by module), whose boundaries
    its prefetch runs to (:func:`~meshplan.spec.deepspeed_reuse.frontier_bytes`)."""
    tp = mesh.degree("tp")
    layers = [[local_numel(t, model, tp, mesh.ep, mesh.etp) * dtype_bytes(training.gather_dtype(t))
               for t in model.layer_tensors(i)] for i in {0, model.layers - 1}]
    return tuple(max(layers, key=sum))


def _config_mesh(config) -> Optional[Mesh]:
    """The :class:`Mesh` of a :class:`~meshplan.config.Config` (its ``[mesh]`` over its world), or None."""
    spec, c = config.mesh, config.cluster
    mesh = resolve_mesh(spec, spec.world or c.world, gpus_per_node=c.node.gpus) if spec is not None else None
    return mesh if isinstance(mesh, Mesh) else None


def config_layer_param_bytes(config) -> tuple[int, ...]:
    """:func:`layer_param_bytes` of a :class:`~meshplan.config.Config` whose mesh resolves (its
    ``[mesh]`` over its world), else ()."""
    mesh = _config_mesh(config)
    return layer_param_bytes(config.model, config.training, mesh) if mesh is not None else ()


def config_reuse(config) -> Optional["ReuseBytes"]:
    """:func:`deepspeed_reuse` of a :class:`~meshplan.config.Config` whose mesh resolves, at its
    ``[memory] deepspeed_max_reuse_elements``, else None."""
    mesh = _config_mesh(config)
    return deepspeed_reuse(config.model, config.training, mesh, config.memory.deepspeed_max_reuse_elements) \
        if mesh is not None else None


@dataclass(frozen=True)
class ReuseBytes:
    """What ``stage3_max_reuse_distance`` keeps gathered on one rank of a one-stage mesh, at the
    grain of meshplan's layer units (:func:`deepspeed_reuse`): ``kept``, bytes of each layer
    (first to last) held from its forward to its next use (its backward; under full recompute its
    replayed forward); ``head_kept``: the output layer held from its forward to its backward;
    ``backward``: per layer, the shares (0, 1] of its unit's all-gather bytes its backward gathers,
    one per all-gather (under full recompute the replay's, then the backward's)."""

    kept: tuple[int, ...]
    head_kept: bool
    backward: tuple[tuple[float, ...], ...]


def deepspeed_reuse(model: ModelSpec, training: TrainingSpec, mesh: Mesh,
                    distance: Optional[int] = None) -> Optional[ReuseBytes]:
    """:class:`ReuseBytes` of ``distance`` (``[memory] deepspeed_max_reuse_elements``, unset
    DeepSpeed's 1e9 elements) for DeepSpeed ZeRO-3 (``zero3_engine = "deepspeed"``) on a mesh of
    one pipeline stage and a model without routed experts, else None (every layer gathered again). :func:`~meshplan.spec.deepspeed_reuse.reuse_kept` over the
    model's parameters as one rank holds them (``ds_numel`` of the tp-split modules; the largest
    layer's for every layer, as :func:`layer_param_bytes`; the head: final norm and output layer, a
    tied one the embedding's weight used there), its elements turned
    into bytes at the layer's bytes per element (:func:`layer_param_bytes`). A layer ``i`` kept
    ``k`` of the ``E`` elements it gathers (those of ``stage3_param_persistence_threshold`` or more:
    the rest is never partitioned) gathers ``1 - k/E`` of its unit again in backward; under full
    recompute (``training.layer_recomputed``, per layer: a mix of ``ac_freq`` layers is given
    each layer's own rule of the two, the trace distances of a uniform model) the replay gathers
    ``1 - k/E`` and the backward ``1 - replay/E`` (DeepSpeed edaa722 coordinator :365-366: a
    kept parameter's fetch finds it ``AVAILABLE``). The embedding (both ends of the trace) is
    gathered again as before."""
    if training.sharding != "zero3" or training.zero3_engine != "deepspeed" or mesh.degree("pp") > 1 or model.is_moe:
        return None  # a routed-expert model's layers differ (and its experts may be a unit apart): not modelled
    tp = mesh.degree("tp")
    numel = lambda tensors: tuple(local_numel(t, model, tp, mesh.ep, mesh.etp) for t in tensors)
    elements = max((numel(model.layer_tensors(i)) for i in {0, model.layers - 1}), key=sum)
    head = numel(model.head_tensors(padded_vocab(model.vocab, training.vocab_pad_divisor, tp)))
    d = DEEPSPEED_MAX_REUSE_ELEMENTS if distance is None else distance
    full, none = (reuse_kept(elements, model.layers, head, d, r) for r in (True, False))
    e = max(sum(n for n in elements if n >= DEEPSPEED_PERSISTENCE_ELEMENTS), 1)  # gathered ones
    per = sum(layer_param_bytes(model, training, mesh)) / max(sum(elements), 1)
    kept, backward = [], []
    for i in range(model.layers):
        k = (full if training.layer_recomputed(i) else none).layers[i]
        kept.append(int(k * per))
        parts = (1 - k / e, 1 - full.replay / e) if training.layer_recomputed(i) else (1 - k / e,)
        backward.append(tuple(p for p in parts if p > 1e-12))
    return ReuseBytes(tuple(kept), none.head > 0, tuple(backward))
