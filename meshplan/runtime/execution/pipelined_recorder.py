"""How the pipeline's collectives are named when the runtime records them under a
``torch.distributed.pipelining`` schedule (:mod:`meshplan.runtime.execution.pipelined` runs it).

:class:`PipelineRecorder`: the :class:`~meshplan.runtime.execution.recorder.CollectiveRecorder` with the
pipeline's point-to-point ops named as meshplan names them: every ``send`` and ``recv`` (c10d
``send``/``recv_``, also when issued through ``batch_isend_irecv``) becomes ``send/recv`` with
the tensor's bytes, phase ``forward`` for activations and ``backward`` for gradients (known
from the stage's ``get_{fwd,bwd}_{send,recv}_ops``, by buffer address). Other collectives
(FSDP) take the phase of the stage computation that issued them (``forward_one_chunk`` /
``backward_one_chunk``); the ones after the last backward (FSDP's deferred gradient
reduce-scatter in ``_post_backward``) keep ``backward``. A multi-stage schedule (torch 2.13's
interleaved 1F1B, ZB-V, DualPipeV: ``_add_unshard_reshard``, a window of 3 local stages) unshards
every chunk (``UNSHARD``: ``unshard`` of each FSDP module) before its first computation; at
vpp <= 3 once per ``schedule.step``, never evicted: the chunk's first forward all-gathers, named
``forward`` as the plan counts them (:func:`label_unshard`). At vpp > 3 it evicts chunks from the
window (``RESHARD``) and unshards them again before their next computation
(:mod:`meshplan.pipeline.unshard_window`, which the plan counts): named by that computation,
``forward`` or ``backward``. Anything else before the first stage
computation is phase ``schedule``; every stage computation is also appended to the runner's ``ops``
as (kind, micro-batch, stage index) (:func:`op_kind`), the executed order ``validate`` compares with
the plan's (:mod:`meshplan.runtime.validation.op_order`). P2P outside those ops (torch 2.13's warm-up vote of static
mode: one int32 per stage boundary on the first step) is phase ``schedule-setup``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.profiler import record_function

from meshplan.runtime.execution.recorder import CollectiveRecorder
from meshplan.runtime.execution.unshard_labels import stage_unshard_phases

if TYPE_CHECKING:  # the runner whose recorder these label; no import at run time (it imports this)
    from meshplan.runtime.execution.pipelined import PipelineRunner


class PipelineRecorder(CollectiveRecorder):
    """:class:`CollectiveRecorder` that names P2P as meshplan does (see the module docstring).
    ``p2p_phase``: buffer address -> phase, filled by :func:`instrument`."""

    def __init__(self):
        super().__init__()
        self.p2p_phase: dict[int, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        n = len(self.records)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.records) > n and self.records[-1].op in ("send", "recv"):
            rec = self.records[-1]
            t = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            phase = self.p2p_phase.get(t.data_ptr(), "schedule-setup")
            self.records[-1] = type(rec)(**{**rec.__dict__, "op": "send/recv", "phase": phase,
                                            "torch_op": f"{rec.torch_op} ({rec.op})"})
        return out


def instrument(stage, runner: "PipelineRunner") -> None:
    """Wrap ``stage``'s P2P op builders, compute entry points and FSDP modules' ``unshard``
    (:func:`label_unshard`) so the active recorder (``runner.rec``) labels what follows."""
    for name, phase in (("get_fwd_send_ops", "forward"), ("get_fwd_recv_ops", "forward"),
                        ("get_bwd_send_ops", "backward"), ("get_bwd_recv_ops", "backward")):
        orig = getattr(stage, name)

        def wrapped(chunk_id, _orig=orig, _phase=phase):
            ops = _orig(chunk_id)
            if runner.rec is not None:
                for op in ops:
                    runner.rec.p2p_phase[op.tensor.data_ptr()] = _phase
            return ops

        setattr(stage, name, wrapped)
    for name, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                        ("backward_weight_one_chunk", "backward")):
        orig = getattr(stage, name)

        def entered(*a, _orig=orig, _phase=phase, _name=name, **kw):
            runner.set_phase(_phase)
            runner.ops.append((op_kind(_name, a, kw), int(a[0]), stage.stage_index))
            if _phase == "forward" and runner.tracker is not None:
                # MemTracker refuses a root module's second forward ("multiple iterative calls"); a
                # schedule runs each stage module once per micro-batch: start its entry afresh
                runner.tracker.memory_tracking.pop(stage.submod, None)
            with record_function(_phase):
                return _orig(*a, **kw)

        setattr(stage, name, entered)
    from torch.distributed.fsdp import FSDPModule

    for module in stage.submod.modules():
        if isinstance(module, FSDPModule):
            label_unshard(module, runner, stage)


def op_kind(name: str, args: tuple, kwargs: dict) -> str:
    """The executed computation a stage entry point runs, as meshplan's orders name it: ``F``
    (``forward_one_chunk``), ``B`` (``backward_one_chunk``, full backward), ``I`` (the same with
    ``full_backward=False``: the input gradient of a split backward), ``W`` (``backward_weight_one_chunk``).

    >>> op_kind("forward_one_chunk", (0,), {}), op_kind("backward_one_chunk", (3,), {"full_backward": False})
    ('F', 'I')
    >>> op_kind("backward_one_chunk", (3,), {}), op_kind("backward_weight_one_chunk", (3,), {})
    ('B', 'W')
    """
    if name == "forward_one_chunk":
        return "F"
    if name == "backward_weight_one_chunk":
        return "W"
    full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
    return "B" if full else "I"


def label_unshard(module, runner: "PipelineRunner", stage=None) -> None:
    """Name the all-gathers of ``module.unshard`` (an FSDP module of ``stage``) in the active
    recorder as the plan counts them, then restore its phase. Only a multi-stage schedule's
    ``UNSHARD`` calls it (FSDP's own hooks unshard through the param group): a prefetch for the
    stage's next computation, ``forward`` or ``backward`` (a chunk evicted at vpp > 3 and
    unsharded again for a backward), the k-th call of each step by :func:`stage_unshard_phases`."""
    orig, calls = module.unshard, [0]
    phases: list[str] = []  # the phase of the k-th call of a step, filled at the first call

    def unshard(*a, **kw):
        phases[:] = phases or stage_unshard_phases(runner, stage)
        phase, calls[0] = phases[calls[0] % len(phases)], calls[0] + 1
        rec = runner.rec
        if rec is None:
            return orig(*a, **kw)
        before, rec.phase = rec.phase, phase
        try:
            return orig(*a, **kw)
        finally:
            rec.phase = before

    module.unshard = unshard
