"""What one rank allocates and frees, event by event, in one pass of the schedule.

A pass is the forward or the backward of one model chunk for one micro-batch
(:mod:`meshplan.memory.schedule`), or the init or the optimizer step. Its events are
entries ``(layer, kind, delta_bytes, label)``; a pass depends on the micro-batch only
through a few flags, so :class:`PassBuilder` builds each distinct pass once and the
timeline repeats it (run-length, not millions of events).

Conventions (bytes on one rank; sizes from :mod:`meshplan.memory.sizes`):

Forward of layer l: with FSDP (zero3/hsdp, shard degree > 1) all-gather l and the next
``prefetch_layers`` units not yet gathered (``gathered_params``); the SP all-gather of the
input (``temporaries``) while the layer runs; allocate the layer's saved activations
(``activations``); reshard l after its forward when ``reshard_after_forward``. The stage's
embedding and head are FSDP units too (FSDP2's root unit: never resharded after forward).
The last stage's head keeps its saved terms and the logits of the loss; the compute-dtype
logits are a transient (``temporaries``) when the loss keeps another dtype.

Backward of layer l (reverse order): gather l (+ prefetch); recompute (``activations``:
full activations minus the kept ones, freed at the end of l); the backward working set
(``temporaries``: dX, the widest intermediate gradient, the SP re-gathered input); the
unsharded weight gradient (``grad_buffers``, compute dtype); free l's activations; then the
reduce: reduce-scatter input in the reduce dtype (``grad_buffers``), freed when the next
unit's reduce starts (one reduce-scatter in flight); the unit's sharded gradient
(``grads``) is allocated at its first reduce of the step (FSDP2 sets grads to None at
``zero_grad``). The inter-layer gradient dY (``temporaries``) lives through the pass.
Without FSDP the gradients are persistent (Megatron's contiguous grad buffer) and a bucket
(``grad_buffers``) exists during backward: every backward for zero2, the last backward of
the chunk for none/zero1 when grads are reduced in another dtype (else in place: 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

Entry = tuple  # (layer: int | None, kind: str, delta_bytes: int, label: str)
UnitKey = Union[int, str]  # a layer index, "embedding" or "head"


@dataclass(frozen=True)
class ActSizes:
    """Activation bytes of one layer for one micro-batch on one rank: ``saved`` (kept for
    backward under the recompute policy), ``rework`` (recomputed at the start of the
    layer's backward, freed at its end), ``fwd_temp`` and ``bwd_temp`` (working sets)."""

    saved: int
    rework: int
    fwd_temp: int
    bwd_temp: int


@dataclass(frozen=True)
class Unit:
    """One FSDP unit (a layer, the embedding or the head) of one stage, bytes per rank:
    ``gathered`` unsharded parameters in the compute dtype (0 when not FSDP-sharded),
    ``grad_unsharded`` autograd's weight gradient (compute dtype), ``reduce_input`` the
    reduce-scatter input (reduce dtype), ``grads`` its share of the sharded gradient."""

    name: str
    layer: Optional[int]
    gathered: int
    grad_unsharded: int
    reduce_input: int
    grads: int


@dataclass(frozen=True)
class StageSizes:
    """Everything a pass of stage ``stage`` needs (see :func:`meshplan.memory.sizes.stage_sizes`)."""

    stage: int
    chunks: tuple[tuple[int, ...], ...]
    acts: dict
    units: dict
    embedding_saved: int
    head_saved: int
    logits_temp: int
    logits_grad_temp: int
    dy: int
    fsdp: bool
    reshard_after_forward: bool
    fsdp_reduce: str
    prefetch: int
    bucket: int
    bucket_every_backward: bool
    recompute: str
    init: tuple
    step: tuple

    def chunk_units(self, chunk: int) -> tuple[UnitKey, ...]:
        """FSDP units used by a pass of ``chunk``, in forward order."""
        keys: list[UnitKey] = ["embedding"] if chunk == 0 and "embedding" in self.units else []
        keys += list(self.chunks[chunk])
        return tuple(keys + (["head"] if chunk == len(self.chunks) - 1 and "head" in self.units else []))


class PassBuilder:
    """Events of one pass. ``gathered``: units already gathered when it starts; ``first``
    and ``last``: first and last backward of this chunk in the step. After :meth:`build`,
    ``gathered`` holds the units still gathered when it ends."""

    def __init__(self, sizes: StageSizes, phase: str, chunk: int, gathered: frozenset,
                 first: bool = False, last: bool = False):
        self.sz, self.phase, self.chunk = sizes, phase, chunk
        self.gathered, self.first, self.last = set(gathered), first, last
        self.events: list[Entry] = []
        self.in_flight: Optional[UnitKey] = None

    def build(self) -> tuple[Entry, ...]:
        if self.phase == "forward":
            self._forward()
        else:
            self._backward()
        return tuple(self.events)

    # helpers -----------------------------------------------------------------------
    def _add(self, layer, kind: str, delta: int, label: str) -> None:
        if delta:
            self.events.append((layer, kind, int(delta), label))

    def _gather(self, key: UnitKey) -> None:
        u = self.sz.units.get(key)
        if self.sz.fsdp and u is not None and key not in self.gathered and u.gathered:
            self._add(u.layer, "gathered_params", u.gathered, f"{u.name}: all-gather (unsharded, compute dtype)")
            self.gathered.add(key)

    def _release(self, key: UnitKey, why: str) -> None:
        u = self.sz.units.get(key)
        if key in self.gathered:
            self._add(u.layer, "gathered_params", -u.gathered, f"{u.name}: resharded {why}")
            self.gathered.discard(key)

    @property
    def _reduce_now(self) -> bool:
        return self.sz.fsdp_reduce == "per_microbatch" or self.last

    # forward -----------------------------------------------------------------------
    def _forward(self) -> None:
        sz, keys = self.sz, self.sz.chunk_units(self.chunk)
        if "embedding" in keys:
            self._gather("embedding")
            self._add(None, "activations", sz.embedding_saved, "embedding: token ids (+ dropout mask) saved")
        layers = sz.chunks[self.chunk]
        for i, layer in enumerate(layers):
            for key in layers[i:i + 1 + sz.prefetch]:
                self._gather(key)
            a = sz.acts[layer]
            self._add(layer, "temporaries", a.fwd_temp, f"layer {layer} forward: SP all-gathered input")
            self._add(layer, "activations", a.saved, f"layer {layer}: saved activations (recompute {sz.recompute})")
            self._add(layer, "temporaries", -a.fwd_temp, f"layer {layer} forward: SP all-gathered input freed")
            if sz.reshard_after_forward:
                self._release(layer, "after forward")
        if "head" in keys:
            self._head_forward()

    def _head_forward(self) -> None:
        sz = self.sz
        self._gather("head")
        self._add(None, "temporaries", sz.logits_temp, "head: logits in compute dtype")
        self._add(None, "activations", sz.head_saved, "head: final norm and output inputs, logits and loss saved")
        self._add(None, "temporaries", -sz.logits_temp, "head: compute-dtype logits freed")

    # backward ----------------------------------------------------------------------
    def _backward(self) -> None:
        sz, keys = self.sz, self.sz.chunk_units(self.chunk)
        bucket = sz.bucket if (sz.bucket_every_backward or self.last) and not sz.fsdp else 0
        self._add(None, "grad_buffers", bucket, "gradient bucket (reduce dtype)")
        if "head" in keys:
            self._head_backward()
        else:
            self._add(None, "temporaries", sz.dy, "output gradient dY received")
        layers = sz.chunks[self.chunk]
        for i in reversed(range(len(layers))):
            for key in reversed(layers[max(0, i - sz.prefetch):i + 1]):
                self._gather(key)
            self._layer_backward(layers[i])
        if "embedding" in keys:
            self._add(None, "activations", -sz.embedding_saved, "embedding: saved activations freed")
            self._unit_grads("embedding")
        self._add(None, "temporaries", -sz.dy, "dY freed")
        self._flush()
        self._add(None, "grad_buffers", -bucket, "gradient bucket freed")

    def _head_backward(self) -> None:
        sz = self.sz
        self._gather("head")
        self._add(None, "temporaries", sz.logits_grad_temp, "head backward: logits gradient (compute dtype)")
        self._add(None, "temporaries", sz.dy, "head backward: dY of the last layer")
        self._add(None, "temporaries", -sz.logits_grad_temp, "head backward: logits gradient freed")
        self._add(None, "activations", -sz.head_saved, "head: saved activations freed")
        self._unit_grads("head")

    def _layer_backward(self, layer: int) -> None:
        a = self.sz.acts[layer]
        self._add(layer, "activations", a.rework, f"layer {layer} backward: recomputed activations")
        self._add(layer, "temporaries", a.bwd_temp, f"layer {layer} backward: working set (dX, widest gradient)")
        self._grad_out(layer)
        self._add(layer, "temporaries", -a.bwd_temp, f"layer {layer} backward: working set freed")
        self._add(layer, "activations", -a.rework, f"layer {layer} backward: recomputed activations freed")
        self._add(layer, "activations", -a.saved, f"layer {layer}: saved activations freed")
        self._unit_grads(layer, produced=True)

    def _grad_out(self, key: UnitKey) -> None:
        """Autograd writes the unit's unsharded weight gradient (FSDP only)."""
        u = self.sz.units.get(key)
        if not self.sz.fsdp or u is None:
            return
        if self.sz.fsdp_reduce == "per_microbatch":
            self._add(u.layer, "grad_buffers", u.grad_unsharded, f"{u.name}: unsharded gradient (compute dtype)")
        elif self.first:
            self._add(u.layer, "grad_buffers", u.reduce_input, f"{u.name}: unsharded gradient accumulator (reduce dtype)")

    def _unit_grads(self, key: UnitKey, produced: bool = False) -> None:
        """Reduce of one unit after its backward, and its post-backward reshard."""
        u = self.sz.units.get(key)
        if not self.sz.fsdp or u is None:
            return
        if not produced:
            self._grad_out(key)
        if self._reduce_now:
            self._flush()
            self._add(u.layer, "grad_buffers", u.reduce_input, f"{u.name}: reduce-scatter input (reduce dtype)")
            done = u.grad_unsharded if self.sz.fsdp_reduce == "per_microbatch" else u.reduce_input
            self._add(u.layer, "grad_buffers", -done, f"{u.name}: unsharded gradient freed")
            self.in_flight = key
            if self.first or self.sz.fsdp_reduce == "after_last":
                self._add(u.layer, "grads", u.grads, f"{u.name}: sharded gradient allocated (first reduce-scatter)")
            self._release(key, "after backward")

    def _flush(self) -> None:
        """The reduce-scatter in flight completes: free its input."""
        if self.in_flight is not None:
            u = self.sz.units[self.in_flight]
            self._add(u.layer, "grad_buffers", -u.reduce_input, f"{u.name}: reduce-scatter done, input freed")
            self.in_flight = None
