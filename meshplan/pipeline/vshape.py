"""What the V-shaped schedules share (:mod:`.zbv`, :mod:`.dualpipev`): two model chunks per
rank placed as a V (torch ``generate_stage_to_rank_mapping(style="v")``): rank s holds virtual
stages s (chunk 0, going down the ranks) and ``2p - 1 - s`` (chunk 1, coming back), so rank 0
holds the first and the last virtual stage (the embedding and the output layer, the loss),
rank p - 1 hands its chunk-0 output to its own chunk 1 without a send, and the pipeline's
p2p pattern is one neighbour each way for ranks 0 and p - 1, two for the others.

>>> [[VShaped().virtual_stage(c, s, 4, 2) for c in range(2)] for s in range(4)]
[[0, 7], [1, 6], [2, 5], [3, 4]]
>>> VShaped().last_stage(4, 2), [VShaped().p2p_per_microbatch(4, 2, s) for s in range(4)]
(0, [2, 4, 4, 2])
"""

from __future__ import annotations

import numpy as np

from meshplan.pipeline.base import PipelineSchedule


#: What torch 2.13's V-shaped schedules, ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``, do with
#: FSDP2 over a data axis and ``reshard_after_forward`` true: the rule of one home, read by the
#: search (rule ``v-reshard``, :func:`reshard_defect` over its columns), the plan's warning
#: (:meth:`VShaped.warnings`: plan, step, compare, export) and ``validate``'s refusal
#: (:func:`meshplan.runtime.execution.buildable.unsupported_pipeline`).
#:
#: Why, read in torch's source (torch 2.13.0 as installed, torch/distributed/pipelining/, the same
#: code as pytorch/pytorch's schedules.py at 00722e648b74 for what is cited here; re-checked
#: 2026-12-05): both schedules run on ``_PipelineScheduleRuntime``, whose lowering ``_add_reduce_grad``
#: puts one ``REDUCE_GRAD`` per stage after its last ``W`` or ``B``: ``stage.perform_reduce_grad``,
#: ``post_backward()`` on every FSDP param group of the stage module, which reduce-scatters the groups
#: holding a gradient and skips the others. A backward split into ``I``
#: (``backward_one_chunk(full_backward=False)`` -> ``stage_backward_input(..., self.submod.parameters())``)
#: and ``W`` (``stage_backward_weight``) collects the weights' gradient accumulators from the autograd
#: graph *before* its backward runs, i.e. before FSDP's pre-backward all-gather swaps the unsharded
#: parameters back in. A layer unit resharded after its forward is then a sharded DTensor whose
#: accumulator is not in the graph: its param group is empty and ``W`` computes no weight gradient for
#: that micro-batch. ZB-V splits every backward but stage 0's; DualPipeV splits those of its last
#: phases (:mod:`.dualpipev`, steps 3, 6, 7), so both lose micro-batches of weight gradient.
#:
#: Measured (torch 2.13, pp 2): tests/test_zbv_fsdp_torch.py, two gloo processes, a V of four
#: one-layer ``fully_shard`` stages, 4 micro-batches, each stage's gradient against one process's
#: plain backward: with ``reshard_after_forward`` true ZB-V leaves rank 0's stage 3 gradient None and
#: rank 1's stages wrong, DualPipeV gets rank 0's stage 3 wrong (all its reduce-scatters run); with it
#: false both are exact. ``meshplan validate`` of pp 2 x dp_shard 2 (4 layers, 4 micro-batches):
#: with it true ZB-V reduce-scatters pp rank 0's 3,409,920-byte layer unit (ranks 0 and 1) once, the
#: plan twice; DualPipeV runs every reduce-scatter the plan counts (its gradients are still wrong).
#: With it false both runs issue every collective the plan counts and validate passes with no
#: difference (the schedule's UNSHARD of each chunk before the first forward is the chunk's first
#: forward all-gather, named so: runtime.execution.pipelined_recorder.label_unshard).
#: Stage 0 is right every time: its ``I`` is skipped (``if not self.is_first``) and its ``W`` is a
#: full backward. The fix is :data:`RESHARD_FIX`: torchtitan resolves its
#: ``fsdp_reshard_after_forward = "default"`` to ``not pp_enabled`` (pytorch/torchtitan
#: torchtitan/distributed/fsdp.py at 01e1814, ``get_fsdp_reshard_after_forward_policy``: under pp
#: "do not reshard after forward to avoid per-microbatch all-gathers"), so its default pp run keeps
#: the layers gathered and is not affected.
RESHARD_DEFECT = ("torch 2.13's ScheduleZBVZeroBubble and ScheduleDualPipeV compute no weight gradient for a layer "
                  "unit resharded after its forward where they split its backward (stage_backward_input collects "
                  "the weights before FSDP's all-gather), so their gradients are wrong (measured at pp 2: ZB-V leaves "
                  "pp rank 0's last stage no gradient, one reduce-scatter short in validate at pp 2 x dp_shard 2, "
                  "DualPipeV a wrong one; both exact with reshard_after_forward false)")
#: What makes the V-shaped schedules right under FSDP2 (:data:`RESHARD_DEFECT`).
RESHARD_FIX = "training.reshard_after_forward = false (torchtitan's default under pp)"


def reshard_defect(framework: str, p, fsdp2_over_data, reshard_after_forward):
    """Whether :data:`RESHARD_DEFECT` hits a V-shaped schedule: framework torch, ``p`` > 1 stages,
    FSDP2 over a data axis (zero3 or hsdp with fsdp x dp_replicate > 1) and ``reshard_after_forward``
    true; ints and bools, or arrays of them (the search's rule ``v-reshard`` over its columns,
    :meth:`VShaped.warnings` over one plan and validate's refusal over one mesh: one formula).

    >>> reshard_defect("torch", np.array([1, 2, 2, 2]), np.array([1, 1, 0, 1]), np.array([1, 1, 1, 0])).tolist()
    [False, True, False, False]
    >>> bool(reshard_defect("megatron", 2, True, True))
    False
    """
    return ((framework == "torch") & (np.asarray(p) > 1) & np.asarray(fsdp2_over_data, dtype=bool)
            & np.asarray(reshard_after_forward, dtype=bool))


class VShaped(PipelineSchedule):
    """A schedule with a V-shaped chunk placement (zig-zag: even chunks run down the ranks,
    odd chunks back up); its subclasses hold exactly two chunks (``reasons``)."""

    virtual_stages = True
    splits_backward = True
    chunks = 2

    def virtual_stage(self, chunk, s, p: int, v: int):
        """``chunk p + s`` for an even chunk, ``chunk p + p - 1 - s`` for an odd one (ints or
        arrays)."""
        down, up = chunk * p + s, chunk * p + p - 1 - s
        if isinstance(chunk, np.ndarray) or isinstance(s, np.ndarray):
            return np.where(np.asarray(chunk) % 2 == 0, down, up)
        return down if chunk % 2 == 0 else up

    def lagging_weights(self, p, m, v, s):
        """Most chunk passes of stage ``s`` whose B is done and W not, counted at each W of
        :meth:`order` (its own included; a full backward, B then W at once, counts 1): ZB-V's
        cool-down (``s`` pairs B(chunk 0), B(chunk 1), then B, W of chunk 0) ``2s + 1``, DualPipeV's
        (its split backwards from the middle of step 6) ``s + 1``, at ``m >= 2p``; torch 2.13's
        ``pipeline_order`` the same (tests/test_vshape_lag.py). Ints, or arrays element by element.

        >>> from meshplan.pipeline.registry import get
        >>> [int(get("zbv").lagging_weights(4, 8, 2, s)) for s in range(4)], [int(get("dualpipev").lagging_weights(4, 8, 2, s)) for s in range(4)]
        ([1, 3, 5, 7], [1, 2, 3, 4])
        """
        if any(isinstance(x, np.ndarray) for x in (p, m, s)):
            return np.vectorize(lambda *a: order_lag(self.order(int(a[0]), int(a[1]), v, int(a[2]))))(p, m, s)
        return order_lag(self.order(p, m, v, s))

    def reasons(self, p: int, m: int, v: int, framework: str = "torch") -> list[str]:
        if v == self.chunks:
            return []
        return [f"{self.title} needs virtual_stages = 2 (two chunks per rank, a V), got {v}"]

    def warnings(self, framework: str, p: int, fsdp2_over_data: bool, reshard_after_forward: bool) -> tuple[str, ...]:
        """:data:`RESHARD_DEFECT` where :func:`reshard_defect` holds, one line with its fix
        (``meshplan validate`` refuses such a mesh, ``meshplan search`` rejects such rows, rule
        ``v-reshard``).

        >>> from meshplan.pipeline.registry import get
        >>> get("dualpipev").warnings("torch", 2, True, False), len(get("zbv").warnings("torch", 2, True, True))
        ((), 1)
        """
        if not reshard_defect(framework, p, fsdp2_over_data, reshard_after_forward):
            return ()
        return (f"{self.name} with FSDP2 over a data axis and reshard_after_forward true under framework torch: "
                f"{RESHARD_DEFECT}; meshplan validate refuses this mesh; fix: {RESHARD_FIX}",)


def order_lag(units, weight=None) -> int:
    """Largest ``sum(weight(chunk))`` over the units whose B is done and W not, taken at each W of
    ``units`` (a stage's order; the W's own unit included); ``weight`` default 1 a unit (a count).

    >>> from meshplan.pipeline.base import Unit
    >>> order_lag([Unit("B", 0, 0), Unit("B", 0, 1), Unit("W", 0, 0), Unit("W", 0, 1)], weight=lambda c: 10 + c)
    21
    """
    weight = weight or (lambda c: 1)
    held, top = {}, 0
    for u in units:
        if u.kind == "B":
            held[(u.mb, u.chunk)] = weight(u.chunk)
        elif u.kind == "W":
            top = max(top, sum(held.values()))
            held.pop((u.mb, u.chunk), None)
    return top
