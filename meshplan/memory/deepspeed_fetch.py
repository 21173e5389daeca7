"""DeepSpeed ZeRO-3's fetch and prefetch in one pass's memory events (``zero3_engine =
"deepspeed"``): :func:`deepspeed_fetch` and :func:`deepspeed_prefetch`, the part of
:class:`meshplan.memory.passes.PassBuilder` (``b``, whose events they add) that follows DeepSpeed's parameter coordinator
instead of FSDP2's unshard (its conventions are that module's docstring). The bytes its prefetch keeps gathered and the ``torch.cat`` copy of a
prefetched part are :mod:`meshplan.spec.deepspeed_memory`'s, as the step's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshplan.memory.pass_sizes import Unit, UnitKey
from meshplan.mesh.resolve import Mesh, resolve_mesh
from meshplan.mesh.tpsplit import local_numel
from meshplan.spec.deepspeed_memory import deepspeed_ahead_bytes, deepspeed_copied_bytes
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes

if TYPE_CHECKING:  # the builder whose events these add; no import at run time (it imports this)
    from meshplan.memory.passes import PassBuilder


def deepspeed_fetch(b: PassBuilder, key: UnitKey, u: Unit, ahead: list) -> None:
    """DeepSpeed ZeRO-3's fetch of ``key`` (deepspeedai/DeepSpeed edaa722 ``runtime/zero/
    partition_parameters.py``): what was not prefetched is gathered one parameter per Llama leaf
    module by ``_all_gather_sequential`` (:1339-1376), the parameters views of its buffer (one
    copy); of the prefetched part, a bucket gathered coalesced (:1301-1342) is copied out by
    ``torch.cat`` at its ``AllGatherCoalescedHandle.wait`` (:750-784), a second copy until its
    buffer goes: :func:`~meshplan.spec.deepspeed_memory.deepspeed_copied_bytes`, the step's too."""
    have = b.issued_bytes.pop(key, 0)
    b._add(u.layer, "gathered_params", u.gathered - have,
           f"{u.name}: all-gathered, the parameters views of the buffer" + (" (the rest)" if have else ""))
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


def deepspeed_prefetch(b: PassBuilder, ahead: list, prefetch: int, live: int) -> None:
    """DeepSpeed ZeRO-3's prefetch after a fetch (edaa722 ``partitioned_param_coordinator.py:452-480``;
    ``prefetch`` and ``live`` bytes): the units of ``ahead`` (next in the pass) gathered or in flight
    up to :func:`~meshplan.spec.deepspeed_memory.deepspeed_ahead_bytes` past the units held (the
    one fetched, a root kept), a unit's part where that ends in it: after a layer's fetch the
    step's frontier at the layer's start, ``max live - layer``; after an end unit's (the
    embedding's in forward, the head's in backward) ``max live - that unit``, the step's
    ``Overlap.fsdp_start``; beside a kept root, less. DeepSpeed
    takes whole parameters, to the end of the one that reaches max live (``b.sz.deepspeed_params``,
    :func:`layer_param_bytes`: :func:`~meshplan.spec.deepspeed_reuse.frontier_bytes`)."""
    held = sum(b.sz.units[k].gathered for k in b.gathered)
    room = deepspeed_ahead_bytes((prefetch, live), held, b.sz.deepspeed_params) - sum(b.issued_bytes.values())
    for nxt in ahead:
        if room <= 0:
            break
        room -= b._issue(nxt, room)


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


def config_layer_param_bytes(config) -> tuple[int, ...]:
    """:func:`layer_param_bytes` of a :class:`~meshplan.config.Config` whose mesh resolves (its
    ``[mesh]`` over its world), else ()."""
    spec, c = config.mesh, config.cluster
    mesh = resolve_mesh(spec, spec.world or c.world, gpus_per_node=c.node.gpus) if spec is not None else None
    return layer_param_bytes(config.model, config.training, mesh) if isinstance(mesh, Mesh) else ()
