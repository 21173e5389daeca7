"""One training step of the validate worker, timed per phase: the batch each rank draws,
:class:`Runner` (forward, loss, backward over the micro-batches, then the optimizer) and
:func:`memory_step`, the step measured for peak memory.

Peak memory: ``torch.cuda.max_memory_allocated`` on a GPU; on CPU FSDPMemTracker
(``torch.distributed._tools``, as :class:`~meshplan.runtime.execution.memtracker.UnitMemTracker`
instruments FSDP units of several modules; MemTracker when the model has no FSDP; for pp > 1 the one
``PipelineRunner.memory_tracker`` gives) over one steady-state step, each micro-batch's
forward restarting the root module's tracker entry (the tracker refuses a second forward of
a root module otherwise); the growth of the resident set (``/proc/self/statm`` sampled every
millisecond) when the tracker fails. The record names the method used.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function

from meshplan.runtime.execution.kvsync import kv_replica_sync
from meshplan.runtime.execution.cp import rank_chunks
from meshplan.runtime.execution.recorder import CollectiveRecorder
from meshplan.spec.training import TrainingSpec

if TYPE_CHECKING:  # the worker imports this module
    from meshplan.runtime.execution.worker import Status

PHASES = ("forward", "loss", "backward", "optimizer")


def batch(training: TrainingSpec, mesh, rank: int, step: int, micro: int, vocab: int, seed: int):
    """Tokens and labels (micro_batch, seq_len) of one micro-batch: the same on every rank of
    a tp or cp group (drawn from the rank's batch coordinate, cp excluded), different across
    data-parallel ranks; a cp rank then keeps its own chunks
    (:func:`meshplan.runtime.execution.cp.rank_chunks`)."""
    # position of the rank inside its batch (data-parallel) group; Layout.group_index would give
    # the group's row, which is equal across a dp group and differs across tp / pp peers
    dp_index = mesh.group_of(rank, "batch").index(rank) if mesh.dp > 1 else 0
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + micro * 101 + dp_index)
    shape = (training.micro_batch, training.seq_len)
    return torch.randint(0, vocab, shape, generator=gen), torch.randint(0, vocab, shape, generator=gen)


def set_accumulation(model, training: TrainingSpec, mb: int, micro: int) -> None:
    """Before micro-batch ``mb`` of ``micro``: FSDP2's gradient sync (and, for
    ``no_sync_unsharded``, reshard after backward) off on every micro-batch but the last, as
    ``training.grad_accumulation`` says; nothing for ``sync`` or a model without FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    if training.grad_accumulation == "sync" or not isinstance(model, FSDPModule):
        return
    last = mb == micro - 1
    model.set_requires_gradient_sync(last)
    if training.grad_accumulation == "no_sync_unsharded":
        model.set_reshard_after_backward(last)


def adamw(params, training: TrainingSpec) -> torch.optim.AdamW:
    """The AdamW step the plan models (lr 1e-4): ``training.optimizer_impl`` ``"fused"``
    (the default) runs torch's fused kernel (``fused=True``, ``torch._fused_adamw_``, on CPU
    too), ``"foreach"`` the multi-tensor one (``foreach=True``), so the Partial gradients'
    all-reduces and the step's temporaries are the ones the plan counts
    (:data:`meshplan.comm.tp_grads.PARTIAL_GRAD_READS`). DTensor and plain parameters (a
    module left unsharded beside sharded ones, e.g. the KV copies past ``kv_heads``) go in
    separate parameter groups: torch's fused and foreach kernels take one list per group and
    refuse a mix ("got mixed torch.Tensor and DTensor", torch 2.13); each group is its own
    kernel call, which is what a run of either kind alone issues."""
    impl = training.optimizer_impl
    params = list(params)
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return torch.optim.AdamW([{"params": g} for g in groups if g] or params, lr=1e-4,
                             fused=impl == "fused", foreach=impl == "foreach")


class Runner:
    """One training step at a time, with per-phase times, recorder labels and status."""

    def __init__(self, model, training, mesh, rank, vocab, seed, status: "Status", device: str):
        self.model, self.training, self.mesh, self.rank = model, training, mesh, rank
        self.vocab, self.seed, self.status, self.device = vocab, seed, status, device
        self.opt = adamw(model.parameters(), training)
        self.micro = max(1, training.global_batch // (training.micro_batch * mesh.dp))
        self.loss_parallel = mesh.degree("tp") > 1
        self.tracker = None  # the memory step's MemTracker/FSDPMemTracker while it runs
        inner = getattr(model, "module", model)  # DDP's wrapped model
        # tp > kv_heads: the KV copies' gradients summed before the optimizer (runtime.execution.kvsync)
        self.kv_sync = kv_replica_sync([inner], inner.spec, mesh)

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def step(self, index: int, rec: CollectiveRecorder | None = None) -> dict:
        """Run step ``index``; returns seconds per phase (summed over micro-batches), the
        step time and the mean loss of this rank."""
        times = dict.fromkeys(PHASES, 0.0)
        losses = []

        def phase(name, label):
            self.status.set(index, name)
            if hasattr(self.tracker, "phase"):  # LabelledMemTracker: the loss is forward, the optimizer step
                self.tracker.phase = {"loss": "forward", "optimizer": "step"}.get(name, name)
            if rec is not None:
                rec.phase = label

        self._sync()
        t_step = time.perf_counter()
        for mb in range(self.micro):
            tokens, labels = (t.to(self.device) for t in rank_chunks(  # cp: this rank's chunks (runtime.cp)
                self.mesh, self.rank, *batch(self.training, self.mesh, self.rank, index, mb, self.vocab, self.seed)))
            lp = contextlib.nullcontext()
            if self.loss_parallel:
                from torch.distributed.tensor.parallel import loss_parallel

                lp = loss_parallel()
            sync = contextlib.nullcontext()
            if mb < self.micro - 1 and isinstance(self.model, DistributedDataParallel):
                sync = self.model.no_sync()  # DDP: gradients all-reduced in the last micro-batch's backward only
            set_accumulation(self.model, self.training, mb, self.micro)
            with sync, lp:
                for name, label in (("forward", "forward"), ("loss", "loss"), ("backward", "backward")):
                    phase(name, label)
                    t0 = time.perf_counter()
                    with record_function(name):
                        if name == "forward":
                            if mb and self.tracker is not None:  # MemTracker refuses a root module's second
                                self.tracker.memory_tracking.pop(self.model, None)  # forward: restart its entry
                            logits = self.model(tokens)
                        elif name == "loss":
                            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                            del logits  # before backward, as torchtitan's train step does (``del pred``)
                        else:
                            loss.backward()
                    self._sync()
                    times[name] += time.perf_counter() - t0
            local = loss.to_local() if hasattr(loss, "to_local") else loss
            losses.append(float(local.detach()))
        phase("optimizer", "step")
        t0 = time.perf_counter()
        with record_function("optimizer"):
            if self.kv_sync is not None:
                self.kv_sync()
            self.opt.step()
            self.opt.zero_grad()
        self._sync()
        times["optimizer"] = time.perf_counter() - t0
        return {"step": index, "step_s": time.perf_counter() - t_step, "phases_s": times,
                "loss": sum(losses) / len(losses), "micro_batches": self.micro}


class RssSampler:
    """Peak resident set (bytes) seen by a thread sampling /proc/self/statm every ~1 ms."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


def memory_step(runner: Runner, index: int) -> tuple[dict, dict]:
    """Run step ``index`` measuring peak memory; returns (timing, memory record)."""
    if runner.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        t = runner.step(index)
        return t, {"method": "torch.cuda.max_memory_allocated", "peak_bytes": torch.cuda.max_memory_allocated(),
                   "before_bytes": before}
    try:
        from torch.distributed.fsdp import FSDPModule

        if hasattr(runner, "memory_tracker"):  # pipeline stages: runtime.pipelined builds it
            tracker, name = runner.memory_tracker()
        elif isinstance(runner.model, FSDPModule):
            return _labelled_memory_step(runner, index)
        else:  # FSDPMemTracker asserts on a model without fully_shard
            from torch.distributed._tools.mem_tracker import MemTracker

            tracker, name = MemTracker(), "MemTracker"
            tracker.track_external(runner.model, runner.opt)
        with _tracking(runner, tracker):
            t = runner.step(index)
        return t, _peak_record(tracker, name)
    except Exception as e:  # the tracker is private API: fall back to the resident set
        err = f"{type(e).__name__}: {e}"
    return _rss_memory_step(runner, index, err)


@contextlib.contextmanager
def _tracking(runner: Runner, tracker, handles=()):
    """Run the body under ``tracker`` with ``runner.tracker`` set (:meth:`Runner.step` restarts
    the root module's entry per micro-batch and labels phases through it); afterwards unset it
    and remove ``handles`` (hooks the tracker installed), also when the step raises."""
    runner.tracker = tracker
    try:
        with contextlib.ExitStack() as stack:
            _enter(stack, tracker)
            yield tracker
    finally:
        runner.tracker = None
        for h in handles:
            h.remove()


def _enter(stack: contextlib.ExitStack, tracker) -> None:
    """Enter ``tracker`` on ``stack``; where its ``__enter__`` raises, undo what it installed before
    raising, since no ``__exit__`` runs then. torch 2.13's ``FSDPMemTracker.__enter__``
    (``torch/distributed/_tools/fsdp2_mem_tracker.py`` 503-518) wraps the FSDP units' hooks and
    backward methods, then the optimizer's hooks, patches ``UntypedStorage.resize_`` and enters its
    ``ModTracker``; left installed, the wrappers run in the resident-set fallback's step and raise.
    The undo is its ``__exit__``'s (520-526) without the dispatch mode, which was never pushed: each
    step may find nothing to undo (``_restore_resize`` puts back the ``resize_`` saved in ``__init__``;
    a removed hook handle removes nothing)."""
    try:
        stack.enter_context(tracker)
    except Exception:
        for undo in ("_deregister_module_and_optimizer_hooks", "_restore_resize"):
            with contextlib.suppress(Exception):
                getattr(tracker, undo, lambda: None)()
        mods = getattr(tracker, "_mod_tracker", None)
        if mods is not None and hasattr(mods, "_fw_pre_handle"):  # ModTracker.__enter__ ran (mod_tracker.py 250-259)
            mods.__exit__(None, None, None)
        raise


def _peak_record(tracker, name: str) -> dict:
    """The memory record of a finished tracker: its peak snapshot's total (bytes, summed over
    devices) and bytes per category; ``name`` is the tracker class named in ``method``."""
    peak = tracker.get_tracker_snapshot("peak")
    return {"method": f"{name} (torch.distributed._tools), peak snapshot over one steady-state step",
            "peak_bytes": sum(int(s.get("Total", 0)) for s in peak.values()),
            "by_category_bytes": _categories(peak)}


def _categories(peak: dict) -> dict[str, int]:
    """A tracker's peak snapshot as bytes per category string, summed over devices."""
    by_cat: dict[str, int] = {}
    for dev_stats in peak.values():
        for cat, n in dev_stats.items():
            if cat != "Total":
                key = str(getattr(cat, "value", cat))  # _FSDPRefType.SHARDED_PARAM -> "Sharded Param"
                by_cat[key] = by_cat.get(key, 0) + int(n)
    return by_cat


def _labelled_memory_step(runner: Runner, index: int) -> tuple[dict, dict]:
    """FSDP2 on CPU: the memory step under :class:`~meshplan.runtime.execution.memtracker.LabelledMemTracker`.
    Beside the tracker's raw peak categories, ``by_kind_bytes`` holds meshplan's kinds at the
    tracker's peak and ``max_by_kind_bytes`` each kind's maximum over the step, both with every
    storage under its final label (:func:`~meshplan.runtime.execution.memtracker.relabelled_kinds`:
    autograd's unsharded gradients, which FSDPMemTracker leaves ``Temp``, as ``grad_buffers``).
    The resident set when the tracker fails."""
    from meshplan.runtime.execution.memtracker import LabelledMemTracker, relabelled_kinds

    try:
        tracker = LabelledMemTracker(runner.model, runner.opt)
        with _tracking(runner, tracker, tracker.label_grads(runner.model)):
            t = runner.step(index)
        phases: dict = {}
        kmax, top, at_top = relabelled_kinds(tracker.log, phases)
        return t, {**_peak_record(tracker, "FSDPMemTracker"), "by_kind_bytes": at_top, "max_by_kind_bytes": kmax,
                   "max_by_kind_phase": phases, "own_peak_bytes": top}
    except Exception as e:  # the tracker is private API: fall back to the resident set
        return _rss_memory_step(runner, index, f"{type(e).__name__}: {e}")


def _rss_memory_step(runner: Runner, index: int, err: str) -> tuple[dict, dict]:
    """The memory step measured as the growth of the resident set (the trackers failed: ``err``)."""
    with RssSampler() as rss:
        t = runner.step(index)
    return t, {"method": "resident-set growth over one steady-state step (/proc/self/statm, 1 ms sampling); "
                         f"FSDPMemTracker failed: {err}",
               "peak_bytes": rss.peak - rss.start, "rss_start_bytes": rss.start, "rss_peak_bytes": rss.peak}
