"""What one rank allocates and frees, event by event, in one pass of the schedule.

A pass is the forward or the backward of one model chunk for one micro-batch
(:mod:`meshplan.memory.schedule`), or the init or the optimizer step. Its events are
entries ``(layer, kind, delta_bytes, label)``; a pass depends on the micro-batch only
through a few flags, so :class:`PassBuilder` builds each distinct pass once and the
timeline repeats it (run-length, not millions of events).

Conventions (bytes on one rank; sizes from :mod:`meshplan.memory.sizes`):

FSDP units (zero3/hsdp, shard degree > 1) follow FSDP2 (torch ``fully_shard``,
``_fsdp_param_group.py``): one unit per layer, the embedding (``embedding``, the first
stage's chunk 0) and the head (``head``: final norm, output; the last chunk of the stage
holding it), the head not resharded after forward (unless ``head_reshards``, below); on a one-chunk one-stage pipeline
Megatron, DeepSpeed and a tied model keep both ends in one root unit (``root``), never
resharded. Under torchtitan's units
(:attr:`~meshplan.spec.training.TrainingSpec.torchtitan_units`, untied) the embedding is
resharded after forward as the layers are (``embedding_reshards``, at every pp) and gathered
again before its backward; with ``training.reshard_head_after_forward`` (torchtitan's
``"always"``) so is the unit holding the output layer (``head_reshards``: the head, or the tied
root), released as the output layer returns the logits; as
:func:`meshplan.runtime.execution.parallelize.apply_fsdp` wraps them and
:mod:`meshplan.comm.collectives` counts them. Unsharding a unit allocates its all-gather output
and then copies it out into the unsharded parameters (``gathered_params``, twice the
unit). In forward the all-gather output is kept until the next unit's copy-out, and the
last one until the end of the forward, with explicit forward prefetch
(``forward_prefetch_layers`` > 0; torchtitan under ep > 1,
:func:`meshplan.memory.units.explicit_forward_prefetch`) too: torch 2.13's
``FSDPParamGroup.wait_for_unshard`` keeps a synchronous all-gather's result in
``comm_ctx.all_gather_state`` whenever its state is ``FORWARD``, which a prefetched unit's
pre-forward sets as well (its docstring's "explicit prefetching" frees at once only for
``unshard_async_op``); of an MoE layer whose experts are a second parameter group (ep > 1) only
theirs, the group copied out last (``Unit.deferred``). In backward it is freed right after its
own copy-out. The all-gathers of the next ``forward_prefetch_layers`` / ``prefetch_layers`` units
(backward: in reverse order, the first one issued by the root's pre-backward, before the head's
backward) are issued after the copy-out. DeepSpeed's ZeRO-3 (``zero3_engine = "deepspeed"``)
holds the unit it computes and, past it, the bytes its prefetch keeps gathered (``max live - layer``:
:func:`~meshplan.spec.deepspeed_memory.deepspeed_ahead_bytes`, as the step's prefetch), one copy of
a fetched unit (its parameters views of the all-gather buffer) and two of a prefetched bucket
only at its wait (:func:`meshplan.memory.deepspeed_fetch.deepspeed_fetch`); a layer's forward releases
all but what ``stage3_max_reuse_distance`` keeps, and its backward gathers only the rest
(:func:`meshplan.memory.deepspeed_fetch.reuse_kept_bytes`; at 0 the head is released too).

Forward of layer l: unshard l; the SP all-gather of the input (``temporaries``) while the
layer runs; allocate the layer's saved activations (``activations``); reshard l after its
forward when ``reshard_after_forward``. The last stage's head keeps its saved terms and the
logits of the loss; the compute-dtype logits are a transient (``temporaries``) when the
loss keeps another dtype.

Backward of the head: the loss's backward (its logits-sized temporaries, then the kept
logits freed), which is when the root's pre-backward hook fires (prefetch); dY, the head's
gradients, the output layer's input freed, the final norm's working set.

Backward of layer l (reverse order): unshard l (+ prefetch); recompute (``activations``:
full activations minus the kept ones); then its steps (:class:`BackStep`, autograd's
order: MLP w_out, activation, w_in, norm, attention w_o, core, w_qkv, norm), each with its
working set (``temporaries``), its weights' unsharded gradients (``grad_buffers``, compute
dtype) and the saved tensors it frees; then the reduce: reduce-scatter input in the
reduce dtype (``grad_buffers``), freed when the next unit's reduce starts (one
reduce-scatter in flight, FSDP2's ``reduce_scatter_max_input_buffers`` = 1); the unit's sharded gradient (``grads``) is
allocated at its first reduce of the step (FSDP2 sets grads to None at ``zero_grad``). The
root's head gradients are written in the head's backward and wait for the root's reduce
after the embedding's backward. The inter-layer gradient dY (``temporaries``) lives
through the pass. Without FSDP the gradients are persistent (Megatron's contiguous grad
buffer) and a bucket (``grad_buffers``) exists during backward: every backward for zero2
and for DeepSpeed's ZeRO-1/2 (``training.zero12_engine``: its bucket buffers,
:meth:`~meshplan.spec.memory.MemoryOptions.deepspeed_bucket_bytes`), the last backward of the
chunk for none/zero1 when grads are reduced in another dtype (else in place: 0). Of the FSDP
engines only DeepSpeed ZeRO-3 of 2021 has one, every backward (its ipg buffers or its flattened
bucket: :func:`meshplan.memory.buffers.deepspeed3_bucket_bytes`).

Gradient accumulation (``training.grad_accumulation``, pp 1): ``no_sync`` and
``no_sync_unsharded`` run the units as ``fsdp_reduce = "after_last"`` (one reduce-dtype
accumulator per unit from the first backward, reduced in the last); ``no_sync`` also
reshards each unit after every backward (``reshard_after_backward``), so the next forward
gathers it again, while ``no_sync_unsharded`` keeps it gathered.
"""

from __future__ import annotations

from typing import Optional

from meshplan.memory.pass_sizes import BackStep, StageSizes, Unit, UnitKey
from meshplan.memory.deepspeed_fetch import deepspeed_fetch, deepspeed_prefetch, reuse_kept_bytes

Entry = tuple  # (layer: int | None, kind: str, delta_bytes: int, label: str)
#: What an event allocates or frees (the timeline's columns; described in :mod:`meshplan.memory.timeline`).
KINDS = ("params", "master", "optimizer", "grads", "comm_buffers", "workspace", "fragmentation",
         "gathered_params", "grad_buffers", "activations", "temporaries")


class PassBuilder:
    """Events of one pass. ``gathered``: units unsharded when it starts; ``first`` and
    ``last``: first and last backward of this chunk in the step; ``evict``: torch's pipeline
    schedule reshards the chunk right after this pass (its window of 3 local stages moves past
    it, :func:`meshplan.pipeline.unshard_window.released_after`): the units still held are
    released at the pass's end, so the chunk holds its shard only and its next pass gathers it
    again (there, not at torch's UNSHARD up to 2 ops earlier: the prefetched bytes are not
    counted during those ops). After :meth:`build`,
    ``gathered`` holds the units still unsharded when it ends."""

    def __init__(self, sizes: StageSizes, phase: str, chunk: int, gathered: frozenset,
                 first: bool = False, last: bool = False, evict: bool = False):
        self.sz, self.phase, self.chunk = sizes, phase, chunk
        self.gathered, self.first, self.last, self.evict = set(gathered), first, last, evict
        self.events: list[Entry] = []
        self.in_flight: Optional[UnitKey] = None  # unit whose reduce-scatter input is held
        self.issued: list[UnitKey] = []  # units whose all-gather output is held, oldest first
        self.issued_bytes: dict[UnitKey, int] = {}  # of each, the bytes held (DeepSpeed: a part, prefetched)
        self.keys = sizes.chunk_units(chunk)
        # layers whose part stage3_max_reuse_distance kept is held (DeepSpeed ZeRO-3; deepspeed_fetch.reuse_kept_bytes)
        self.kept = {k for k in self.keys if phase == "backward" and reuse_kept_bytes(self, k)}

    def build(self) -> tuple[Entry, ...]:
        if self.phase == "forward":
            self._forward()
        else:
            self._backward()
        if self.evict:
            for key in self.keys:
                self._release(key, "by the pipeline schedule's window (RESHARD)")
        return tuple(self.events)

    # helpers -----------------------------------------------------------------------
    def _add(self, layer, kind: str, delta: int, label: str) -> None:
        if delta:
            self.events.append((layer, kind, int(delta), label))

    def _sharded(self, key: UnitKey) -> Optional[Unit]:
        u = self.sz.units.get(key)
        return u if self.sz.fsdp and u is not None and u.gathered else None

    def _issue(self, key: UnitKey, limit: Optional[int] = None) -> int:
        """All-gather of ``key`` issued: its output buffer exists (``limit``: at most that many more
        bytes of it, DeepSpeed's prefetch); the bytes it added."""
        u = self._sharded(key)
        if u is None or key in self.gathered:
            return 0
        have, whole = self.issued_bytes.get(key, 0), u.gathered - (reuse_kept_bytes(self, key) if key in self.kept else 0)
        want = whole if limit is None else min(whole, have + limit)
        if want > have:
            part = "" if want == u.gathered and not have else f" ({'the rest' if have else 'prefetched part'})"
            what = ("prefetched by DeepSpeed's coordinator: all-gather buffer" if limit is not None
                    else f"all-gather output (compute dtype){part}")
            self._add(u.layer, "gathered_params", want - have, f"{u.name}: {what}")
            self.issued_bytes[key] = want
            if key not in self.issued:
                self.issued.append(key)
        return want - have

    def _free_output(self, key: UnitKey, why: str) -> None:
        u = self.sz.units[key]
        self.issued.remove(key)
        what = "coalesced all-gather buffer" if self.sz.deepspeed_prefetch is not None else "all-gather output"
        self._add(u.layer, "gathered_params", -self.issued_bytes.pop(key), f"{u.name}: {what} freed {why}")

    def _unshard(self, key: UnitKey, ahead: list, depth: int, keep_output: bool) -> None:
        """FSDP2 pre-forward/pre-backward of ``key``: all-gather (unless prefetched), copy
        out into the unsharded parameters, then prefetch ``depth`` units of ``ahead``.
        ``keep_output``: the output stays until the next copy-out (forward, implicit)."""
        u = self._sharded(key)
        if self.sz.deepspeed_prefetch is not None:
            if u is not None and key not in self.gathered:
                deepspeed_fetch(self, key, u, ahead)
            deepspeed_prefetch(self, ahead, *self.sz.deepspeed_prefetch)
            return
        if u is not None and key not in self.gathered:
            self._issue(key)
            self._add(u.layer, "gathered_params", u.gathered, f"{u.name}: copy-out to unsharded parameters")
            self.gathered.add(key)
            for older in [k for k in self.issued if k != key and k not in ahead]:
                self._free_output(older, f"at {u.name}'s copy-out")
            if not keep_output:
                self._free_output(key, "after its copy-out")
            elif u.deferred and key in self.issued:  # its experts' group copied out last: theirs kept
                self._add(u.layer, "gathered_params", u.deferred - self.issued_bytes[key],
                          f"{u.name}: all-gather output of its dense group freed at its experts' copy-out")
                self.issued_bytes[key] = u.deferred
        for nxt in ahead[:depth]:
            self._issue(nxt)

    def _release(self, key: UnitKey, why: str, keep: int = 0) -> None:
        """``key`` resharded, all but ``keep`` bytes (DeepSpeed's ``stage3_max_reuse_distance``)."""
        u = self.sz.units.get(key)
        if key in self.gathered and u is not None:
            done = "released (partitioned again)" if self.sz.deepspeed_prefetch is not None else "resharded"
            kept = f", {keep:,} B kept by stage3_max_reuse_distance" if keep else ""
            self._add(u.layer, "gathered_params", -u.gathered + keep, f"{u.name}: {done} {why}{kept}")
            self.gathered.discard(key)
            if keep:
                self.kept.add(key)

    @property
    def _reduce_now(self) -> bool:
        return self.sz.fsdp_reduce == "per_microbatch" or (self.last and not self.sz.reduce_deferred)

    @property
    def _head_here(self) -> bool:
        return "head" in self.keys or "root" in self.keys

    # forward -----------------------------------------------------------------------
    def _forward(self) -> None:
        sz, keys = self.sz, self.keys
        # FSDP2 keeps each all-gather output till the next copy-out in forward, explicit prefetch or
        # not (module docstring); DeepSpeed frees it once its parameters are copied out
        # (AllGatherCoalescedHandle.wait)
        depth, keep = sz.forward_prefetch, sz.deepspeed_prefetch is None
        for key in (k for k in ("root", "embedding") if k in keys):
            self._unshard(key, list(sz.chunks[self.chunk]), depth, keep)
            self._add(None, "activations", sz.embedding_saved, "embedding: token ids (+ dropout mask) saved")
            if key == "embedding" and sz.embedding_reshards:
                self._release(key, "after forward")
        layers = sz.chunks[self.chunk]
        for i, layer in enumerate(layers):
            self._unshard(layer, list(layers[i + 1:]) + [k for k in keys if k == "head"], depth, keep)
            a = sz.acts[layer]
            work = "SP all-gathered input" if a.sp_input else "forward working set"
            self._add(layer, "temporaries", a.fwd_temp, f"layer {layer} forward: {work}")
            self._add(layer, "activations", a.saved, f"layer {layer}: saved activations (recompute {sz.recompute})")
            self._add(layer, "temporaries", -a.fwd_temp, f"layer {layer} forward: {work} freed")
            if sz.reshard_after_forward:
                self._release(layer, "after forward", reuse_kept_bytes(self, layer))
        if self._head_here:
            self._unshard("head", [], depth, keep)
            self._head_forward()
        self._free_outputs()

    def _free_outputs(self) -> None:
        """The root's post-forward: the last all-gather output kept is freed."""
        for key in list(self.issued):
            self._free_output(key, "at the root's post-forward")

    def _head_forward(self) -> None:
        sz = self.sz
        self._add(None, "temporaries", sz.logits_temp, "head: logits in compute dtype (+ the loss's x - max)")
        if sz.head_reshards:  # its post-forward, as the output layer returns the logits
            self._release("head" if "head" in self.keys else "root", "after forward")
        self._free_outputs()  # the model's forward returns the logits before the loss runs
        self._add(None, "temporaries", sz.logits_extra, "loss forward: exp(x - max)")
        self._add(None, "temporaries", -sz.logits_extra, "loss forward: exp(x - max) freed")
        self._add(None, "activations", sz.head_saved, "head: final norm and output inputs, logits and loss saved")
        self._add(None, "temporaries", -sz.logits_temp, "head: logits (and the loss's temporaries) freed")

    # backward ----------------------------------------------------------------------
    def _backward(self) -> None:
        sz, keys = self.sz, self.keys
        bucket = sz.bucket if sz.bucket_every_backward or self.last else 0  # FSDP: DeepSpeed ZeRO-3 2021's only
        self._add(None, "grad_buffers", bucket, sz.bucket_what)
        layers = sz.chunks[self.chunk]
        order = list(reversed(layers))
        if self._head_here:
            self._loss_backward()  # the root's pre-backward hook fires on the logits' gradient
            self._unshard("head" if "head" in keys else "root", order, sz.prefetch, False)
            self._head_backward()
        else:
            self._add(None, "temporaries", sz.dy, "output gradient dY received")
        emb = ["embedding"] if "embedding" in keys and sz.embedding_reshards else []
        for i, layer in enumerate(order):
            self._unshard(layer, order[i + 1:] + emb, sz.prefetch, False)
            self._layer_backward(layer)
        for key in emb:  # gathered again for its backward (prefetched by the layers')
            self._unshard(key, [], sz.prefetch, False)
        for key in (k for k in ("embedding", "root") if k in keys):
            self._add(None, "activations", -sz.embedding_saved, "embedding: saved activations freed")
            self._add(None, "temporaries", sz.embedding_backward_work,
                      "embedding backward: fp32 partial sums (and SP: the all-gathered dY)")
            self._add(None, "grad_buffers", sz.embedding_grad_extra,
                      "embedding gradient over the whole vocabulary (DTensor), before its reduce-scatter over tp")
            self._unit_grads(key, extra=sz.embedding_grad_extra, work=sz.embedding_backward_work)
        self._add(None, "temporaries", -sz.dy, "dY freed")
        if self.last and sz.reduce_deferred:
            self._perform_reduce_grad()
        self._flush()
        self._add(None, "grad_buffers", -bucket, "gradient bucket freed")

    def _perform_reduce_grad(self) -> None:
        """pp > 1 (``reduce_deferred``): torch 2.13's ``PipelineStage`` runs every backward with
        gradient sync off, then after the chunk's last one ``perform_reduce_grad`` runs each
        unit's ``post_backward`` in FSDP's state order (forward order): the reduce-scatter of its
        accumulator, its sharded gradient, and its reshard (``set_reshard_after_backward(True)``)."""
        for key in self.keys:
            u = self._sharded(key)
            if u is None:
                continue
            self._reduce_scatter(key, u, u.reduce_input, True, "(perform_reduce_grad)", "after perform_reduce_grad")

    def _loss_backward(self) -> None:
        """The loss's backward and the logits' gradient. torch's ``F.cross_entropy``
        (``loss_grad_kept`` > 0): its transients (``loss_grad_extra``) beside the kept log-softmax,
        then autograd frees all but the logits' gradient and the saved log-softmax before the
        ``.float()`` upcast's backward writes the compute-dtype gradient (below)."""
        sz = self.sz
        if sz.loss_grad_kept:
            self._torch_loss_backward()
            return
        self._add(None, "temporaries", sz.loss_grad_extra, "loss backward: nll and log-softmax gradients")
        self._add(None, "temporaries", sz.logits_grad_temp, "head backward: logits gradient (compute dtype)")
        self._add(None, "temporaries", -sz.loss_grad_extra, "loss backward: temporaries freed")
        self._add(None, "activations", -sz.head_loss_saved, "loss backward: kept logits and loss terms freed")

    def _torch_loss_backward(self) -> None:
        """torch/autograd order (engine.cpp ``evaluate_function``: a node's input gradients and saved
        tensors are freed when it returns). tp 1: ``nll_loss_backward`` writes a logits-sized
        gradient, ``_log_softmax_backward_data`` another beside it and the saved output. tp > 1:
        ``_nll_loss_and_log_softmax_backward`` (torch/distributed/tensor/parallel/loss.py):
        ``(zeros_like(x) + exp(x)) * grad_output``, three logits-sized tensors at once. Then one
        gradient (logits dtype) is left, and ``.float()``'s backward casts it to the compute dtype."""
        sz = self.sz
        self._add(None, "temporaries", sz.loss_grad_extra, "loss backward: nll and log-softmax gradients")
        self._add(None, "temporaries", sz.loss_grad_kept - sz.loss_grad_extra,
                  "loss backward: temporaries freed, the logits' gradient kept")
        self._add(None, "activations", -sz.head_loss_saved, "loss backward: kept logits and loss terms freed")
        self._add(None, "temporaries", sz.logits_grad_temp, "head backward: logits gradient (compute dtype)")
        self._add(None, "temporaries", -sz.loss_grad_kept, "loss backward: the logits' gradient (logits dtype) freed")

    def _head_backward(self) -> None:
        sz = self.sz
        self._add(None, "temporaries", sz.dy, "head backward: dY of the last layer")
        if "root" in self.keys:
            u = self.sz.units["root"]
            self._grad_out("root", part=u.early, what=" (head)")
        self._add(None, "temporaries", -sz.logits_grad_temp, "head backward: logits gradient freed")
        self._add(None, "activations", -sz.head_output_saved, "output layer backward: its input freed")
        self._add(None, "temporaries", sz.final_norm_work, "final norm backward: working set")
        self._add(None, "temporaries", -sz.final_norm_work, "final norm backward: working set freed")
        rest = sz.head_saved - sz.head_loss_saved - sz.head_output_saved
        self._add(None, "activations", -rest, "final norm backward: its saved input freed")
        if "root" not in self.keys:
            self._unit_grads("head")

    def _layer_backward(self, layer: int) -> None:
        a = self.sz.acts[layer]
        self._add(layer, "activations", a.rework, f"layer {layer} backward: recomputed activations")
        # the steps' events read only the stage's sizes, the layer and ``first`` (no builder
        # state): built once per (layer, first) for every backward pass of the stage
        memo = self.sz.step_events
        key = (layer, self.first)
        if key in memo:
            self.events.extend(memo[key])
        else:
            start = len(self.events)
            self._layer_steps(layer, a)
            memo[key] = tuple(self.events[start:])
        self._unit_grads(layer, produced=True)

    def _layer_steps(self, layer: int, a) -> None:
        """The backward steps of ``layer`` (its activations' sizes ``a``), autograd's order."""
        u = self.sz.units.get(layer)
        steps = a.steps or (BackStep("", a.bwd_temp, u.grad_unsharded if u else 0, a.saved + a.rework),)
        for i, st in enumerate(steps):
            name = f"layer {layer} backward{' ' + st.name if st.name else ''}"
            self._add(layer, "temporaries", st.work, f"{name}: working set (gradients of activations)")
            self._grad_out(layer, part=st.grads, first_part=i == 0, what=f" ({st.name})" if st.name else "")
            self._add(layer, "temporaries", -st.work, f"{name}: working set freed")
            self._add(layer, "activations", -st.frees, f"{name}: saved activations freed")

    def _grad_out(self, key: UnitKey, part: Optional[int] = None, first_part: bool = True, what: str = "") -> None:
        """Autograd writes ``part`` bytes (default: all) of the unit's unsharded weight
        gradient (FSDP only). With ``fsdp_reduce = "after_last"`` the whole reduce-dtype
        accumulator appears with the unit's first part in the first backward."""
        u = self._sharded(key)
        if u is None:
            return
        if self.sz.fsdp_reduce == "per_microbatch":
            part = u.grad_unsharded if part is None else part
            self._add(u.layer, "grad_buffers", part, f"{u.name}: unsharded gradient{what} (compute dtype)")
        elif self.first and first_part:
            self._add(u.layer, "grad_buffers", u.reduce_input,
                      f"{u.name}: unsharded gradient accumulator (reduce dtype)")

    def _unit_grads(self, key: UnitKey, produced: bool = False, extra: int = 0, work: int = 0) -> None:
        """Reduce of one unit after its backward, and its post-backward reshard; ``extra``:
        a transient gradient buffer freed once the unit's own gradient is written; ``work``:
        the backward's working set (temporaries), freed as its kernel ends."""
        u = self._sharded(key)
        if u is None:
            self._add(None, "temporaries", -work, "embedding backward: working set freed")
            return
        if not produced:
            self._grad_out(key, part=u.grad_unsharded - u.early, first_part=not u.early,
                           what=" (embedding)" if u.early else "")
        self._add(None, "temporaries", -work, "embedding backward: working set freed")
        self._add(u.layer, "grad_buffers", -extra, "whole-vocabulary embedding gradient freed")
        if self._reduce_now:
            done = u.grad_unsharded if self.sz.fsdp_reduce == "per_microbatch" else u.reduce_input
            self._reduce_scatter(key, u, done, self.first or self.sz.fsdp_reduce == "after_last",
                                 "(first reduce-scatter)", "after backward")
        elif self.sz.reshard_after_backward:
            self._release(key, "after backward (gradient sync off, reshard on)")

    def _reduce_scatter(self, key: UnitKey, u, done: int, allocate: bool, when: str, why: str) -> None:
        """One unit's reduce-scatter: the one in flight completes, this one's input (reduce
        dtype) is copied in, its unsharded gradient (``done`` bytes) freed, its sharded gradient
        allocated when ``allocate`` (``when`` says at which reduce), then its reshard (``why``)."""
        self._flush()
        self._add(u.layer, "grad_buffers", u.reduce_input, f"{u.name}: reduce-scatter input (reduce dtype)")
        self._add(u.layer, "grad_buffers", -done, f"{u.name}: unsharded gradient freed")
        self.in_flight = key
        if allocate:
            self._add(u.layer, "grads", u.grads, f"{u.name}: sharded gradient allocated {when}")
        self._release(key, why)

    def _flush(self) -> None:
        """The reduce-scatter in flight completes: free its input."""
        if self.in_flight is not None:
            u = self.sz.units[self.in_flight]
            self._add(u.layer, "grad_buffers", -u.reduce_input, f"{u.name}: reduce-scatter done, input freed")
            self.in_flight = None
