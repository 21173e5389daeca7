"""What one rank allocates and frees, event by event, in one pass of the schedule.

A pass is the forward or the backward of one model chunk for one micro-batch
(:mod:`meshplan.memory.schedule`), or the init or the optimizer step. Its events are
entries ``(layer, kind, delta_bytes, label)``; a pass depends on the micro-batch only
through a few flags, so :class:`PassBuilder` builds each distinct pass once and the
timeline repeats it (run-length, not millions of events).

Conventions (bytes on one rank; sizes from :mod:`meshplan.memory.sizes`): the FSDP units' events
(all-gather, copy-out, reshard; DeepSpeed ZeRO-3's fetch; the unit's gradient and its reduce-scatter)
follow :mod:`meshplan.memory.unit_events`.

Forward of layer l: unshard l; the SP all-gather of the input (``temporaries``) while the
layer runs; allocate the layer's saved activations (``activations``); reshard l after its
forward when ``reshard_after_forward``. The last stage's head keeps its saved terms and the
logits of the loss; the compute-dtype logits are a transient (``temporaries``) when the
loss keeps another dtype, and so, beside them, are the eager torch loss's own fp32 tensors
(the ``.float()`` copy; with tp > 1 also ``x - max`` and ``exp(x - max)``:
``memory.cross_entropy``, :class:`~meshplan.spec.memory.MemoryOptions`).

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

ZB-H1 (``frees_at_weight``): its backward passes stand at the W units (:mod:`meshplan.memory.schedule`);
each holds the lagging W passes' output gradients while it runs (``StageSizes.w_lag``), and on the head's
stage the logits gradient replaces the loss terms from each head forward to its W (``head_lag``):
:mod:`meshplan.memory.wlag`. ZB-V and DualPipeV: their backward passes stand at the W units too, each
holding the output gradients of the chunk passes whose B is done and W not at its W (``lag``, per
pass: :func:`meshplan.memory.wlag.cooldown_lag_levels`).
"""

from __future__ import annotations

from meshplan.memory.deepspeed_fetch import reuse_kept_bytes
from meshplan.memory.pass_sizes import BackStep
from meshplan.memory.unit_events import Entry, UnitEvents

#: What an event allocates or frees (the timeline's columns; described in :mod:`meshplan.memory.timeline`).
KINDS = ("params", "master", "optimizer", "grads", "comm_buffers", "userbuffers", "workspace", "fragmentation",
         "gathered_params", "grad_buffers", "activations", "temporaries")
#: Kinds PyTorch's caching allocator (and so MemTracker) never sees.
UNTRACKED_KINDS = ("comm_buffers", "userbuffers", "fragmentation")


class PassBuilder(UnitEvents):
    """Events of one pass. ``gathered``: units unsharded when it starts; ``first`` and
    ``last``: first and last backward of this chunk in the step; ``evict``: torch's pipeline
    schedule reshards the chunk right after this pass (its window of 3 local stages moves past
    it, :func:`meshplan.pipeline.unshard_window.released_after`): the units still held are
    released at the pass's end, so the chunk holds its shard only until torch UNSHARDs it again.
    Under torch's multi-stage schedules (:func:`~meshplan.pipeline.unshard_window.unshards_first`)
    ``unshard``: the chunks UNSHARDed right before this pass, their all-gather outputs allocated at
    its start (:func:`~meshplan.pipeline.unshard_window.unshards_before`, up to 2 distinct chunks
    ahead of the op that needs them); ``waits``: this pass's chunk was UNSHARDed (at or before it)
    and is copied out whole before it runs (:meth:`_schedule_unshards`). ``lag``: a V-shaped
    schedule's backward pass, the output gradients its lagging W passes hold while it runs, bytes
    (:func:`meshplan.memory.wlag.cooldown_lag_levels`; 0 elsewhere). After :meth:`build`,
    ``gathered`` holds the units still unsharded when it ends."""

    def build(self) -> tuple[Entry, ...]:
        self._schedule_unshards()
        if self.phase == "forward":
            self._forward()
        else:
            self._backward()
        if self.evict:
            for key in self.keys:
                self._release(key, "by the pipeline schedule's window (RESHARD)")
        return tuple(self.events)

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
        mask = self._batch_mask()
        for key in (k for k in ("root", "embedding") if k in keys):
            self._unshard(key, list(sz.chunks[self.chunk]), depth, keep)
            self._add(None, "activations", sz.embedding_saved, "embedding: token ids (+ dropout mask) saved")
            if key == "embedding" and sz.embedding_reshards:
                self._release(key, "after forward")
        layers = sz.chunks[self.chunk]
        for i, layer in enumerate(layers):
            self._unshard(layer, list(layers[i + 1:]) + [k for k in keys if k == "head"], depth, keep)
            a = sz.acts[layer]
            work = a.fwd_what
            self._add(layer, "temporaries", a.fwd_temp, f"layer {layer} forward: {work}")
            rc = sz.layer_recompute[layer] if sz.layer_recompute else sz.recompute
            self._add(layer, "activations", a.saved, f"layer {layer}: saved activations (recompute {rc})")
            self._add(layer, "temporaries", -a.fwd_temp, f"layer {layer} forward: {work} freed")
            if sz.reshard_after_forward:
                self._release(layer, "after forward", reuse_kept_bytes(self, layer))
        if self._head_here:
            self._unshard("head", [], depth, keep)
            self._head_forward()
        self._free_outputs()
        self._add(None, "temporaries", -mask, "get_batch: the attention mask freed as forward_step returns")

    def _batch_mask(self) -> int:
        """Megatron Core's data-loader attention mask, allocated where this pass's chunk runs
        ``get_batch`` (the first chunk of the first stage, the last of the last:
        :func:`meshplan.compute.batch_input.core_batch_chunk`): the GPU copy (tp rank 0's ``.cuda()``,
        the other tp ranks' broadcast buffer), then at cp > 1 its cp slice replacing it
        (:attr:`~meshplan.memory.pass_sizes.StageSizes.batch_mask`); the bytes kept, 0 elsewhere."""
        full, kept = self.sz.batch_mask
        first = self.chunk == 0 and any(k in self.keys for k in ("root", "embedding"))
        if not full or not (first or "head" in self.keys or "root" in self.keys):
            return 0
        self._add(None, "temporaries", full, "get_batch: the data loader's b x 1 x s x s bool attention mask on the "
                                             "GPU (tp rank 0's copy, the other tp ranks' broadcast buffer)")
        if kept != full:
            self._add(None, "temporaries", kept - full, "get_batch: the mask's cp slice (index_select), the full "
                                                        "copy freed")
        return kept

    def _free_outputs(self) -> None:
        """The root's post-forward: the last all-gather output kept is freed."""
        for key in list(self.issued):
            self._free_output(key, "at the root's post-forward")

    def _head_forward(self) -> None:
        sz = self.sz
        self._add(None, "temporaries", sz.logits_temp, "head: logits in compute dtype (+ the loss's fp32 copy and x - max)")
        if sz.head_reshards:  # its post-forward, as the output layer returns the logits
            self._release("head" if "head" in self.keys else "root", "after forward")
        self._free_outputs()  # the model's forward returns the logits before the loss runs
        self._add(None, "temporaries", sz.logits_extra, "loss forward: exp(x - max)")
        self._add(None, "temporaries", -sz.logits_extra, "loss forward: exp(x - max) freed")
        self._add(None, "activations", sz.head_lag, "ZB-H1: the input-gradient pass (next) frees the loss terms, keeps "
                                                    "the logits gradient for W")
        self._add(None, "activations", sz.head_saved, "head: final norm and output inputs, logits and loss saved")
        self._add(None, "temporaries", -sz.logits_temp, "head: logits (and the loss's temporaries) freed")

    # backward ----------------------------------------------------------------------
    def _backward(self) -> None:
        sz, keys = self.sz, self.keys
        bucket = sz.bucket if sz.bucket_every_backward or self.last else 0  # FSDP: DeepSpeed ZeRO-3 2021's only
        held = sz.w_lag + self.lag  # ZB-H1's (every backward pass) or a V-shaped schedule's (this pass's)
        self._add(None, "activations", held, "output gradients held by the lagging weight-gradient passes (W)")
        if self._head_here:
            self._add(None, "activations", -sz.head_lag, "this W's logits gradient back to the loss terms it frees")
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
        self._add(None, "activations", -held, "this W's output gradients freed (the others' counted at the next)")

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
