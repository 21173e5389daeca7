"""What one FSDP unit allocates and frees in a pass: its all-gather, copy-out and reshard,
its unsharded gradient and its reduce-scatter (:class:`UnitEvents`, the base of
:class:`meshplan.memory.passes.PassBuilder`, which orders them within the pass).

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

The reduce of a unit after its backward (one reduce-scatter in flight, the sharded gradient at
the first reduce, the gradient-accumulation modes) is described in :mod:`meshplan.memory.passes`.
"""

from __future__ import annotations

from typing import Optional

from meshplan.memory.deepspeed_fetch import deepspeed_fetch, deepspeed_prefetch, reuse_kept_bytes
from meshplan.memory.pass_sizes import StageSizes, Unit, UnitKey

Entry = tuple  # (layer: int | None, kind: str, delta_bytes: int, label: str)


class UnitEvents:
    """The FSDP units' events of one pass and the state they keep (arguments: those of
    :class:`meshplan.memory.passes.PassBuilder`, which adds the pass's own events)."""

    def __init__(self, sizes: StageSizes, phase: str, chunk: int, gathered: frozenset,
                 first: bool = False, last: bool = False, evict: bool = False,
                 waits: bool = False, unshard: tuple[int, ...] = (), lag: int = 0):
        self.sz, self.phase, self.chunk = sizes, phase, chunk
        self.gathered, self.first, self.last, self.evict = set(gathered), first, last, evict
        self.waits, self.unshard, self.lag = waits, unshard, lag
        self.events: list[Entry] = []
        self.in_flight: Optional[UnitKey] = None  # unit whose reduce-scatter input is held
        self.issued: list[UnitKey] = []  # units whose all-gather output is held, oldest first
        self.issued_bytes: dict[UnitKey, int] = {}  # of each, the bytes held (DeepSpeed: a part, prefetched)
        self.keys = sizes.chunk_units(chunk)
        # layers whose part stage3_max_reuse_distance kept is held (DeepSpeed ZeRO-3; deepspeed_fetch.reuse_kept_bytes)
        self.kept = {k for k in self.keys if phase == "backward" and reuse_kept_bytes(self, k)}

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

    def _schedule_unshards(self) -> None:
        """torch's pipeline schedule before this pass (``_add_unshard_reshard``'s actions,
        :func:`meshplan.pipeline.unshard_window.unshards_before`): each UNSHARD of ``unshard``
        (``unshard(async_op=True)`` of every FSDP module of that chunk, all sharded then: none
        is in the window) allocates every unit's all-gather output; then, where this pass's chunk
        was UNSHARDed (``waits``), ``_assert_unsharded`` waits for its handles before the pass
        runs: each unit copied out into its unsharded parameters and, an async all-gather, its
        output freed at once (FSDP2 ``wait_for_unshard``). Its pass then gathers nothing."""
        for c in self.unshard:
            for key in self.sz.chunk_units(c):
                u = self._sharded(key)
                if u is not None:
                    self._add(u.layer, "gathered_params", u.gathered,
                              f"{u.name}: all-gather output (UNSHARD of chunk {c} by the pipeline schedule)")
        if not self.waits:
            return
        for key in self.keys:
            u = self._sharded(key)
            if u is not None and key not in self.gathered:
                self._add(u.layer, "gathered_params", u.gathered, f"{u.name}: copy-out at the wait for its UNSHARD")
                self._add(u.layer, "gathered_params", -u.gathered, f"{u.name}: all-gather output freed after its copy-out")
                self.gathered.add(key)

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
