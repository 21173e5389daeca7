"""The host sync before each of torchtitan's all-to-all dispatches (newcomer trial 48, finding 10):
its split sizes go to the host and the host waits for them (pytorch/torchtitan e347b1e
``torchtitan/distributed/expert_parallel.py``:102-135, ``ExpertParallel._token_dispatch``: the counts'
``all_to_all_single``, then ``.to("cpu", non_blocking=False)`` "would incur a device-to-host sync", then
``.tolist()`` for ``all_to_all_single_autograd``'s splits). One per MoE layer forward, and again in a
recomputed layer's forward. Not timed in the step: each drains the device queue, so the host's lead over
the GPU is lost there; :func:`ep_sync_note` says how many and what they would cost at the catalog's
issue floor per sync (kernels.toml ``[host] kernel_issue_s``, the figure Megatron-LM 2022's
``.cpu()`` / ``.item()`` syncs are charged at, :mod:`meshplan.compute.megatron_cost`)."""

from __future__ import annotations

from meshplan import catalog

#: Where the sync is, for the note.
EP_SYNC_SOURCE = "pytorch/torchtitan e347b1e torchtitan/distributed/expert_parallel.py:102-135"


def ep_syncs(plan, stage: int) -> int:
    """Host syncs per step on ``stage``: micro-batches x (its MoE layers' forwards, a layer under full or
    layer recompute twice); 0 unless framework torch, an MoE model at ep > 1 and the all-to-all dispatcher
    (DeepEP's dispatch takes no split sizes from the host: :mod:`meshplan.comm.deepep`)."""
    cfg, t = plan.config, plan.config.training
    if t.framework != "torch" or not cfg.model.is_moe or plan.mesh.ep < 2 or t.moe_dispatcher != "alltoall":
        return 0
    layers = [i for chunk in plan.stages[stage] for i in chunk]  # no Stage view: the search's plans have none
    per = sum(1 + t.layer_recomputed(k) for k, i in enumerate(layers) if cfg.model.is_moe_layer(i))
    return plan.micro_batches * per


def ep_sync_note(plan, stage: int) -> tuple[str, ...]:
    """The step's note on :func:`ep_syncs` of ``stage`` (the critical one), none without any."""
    n = ep_syncs(plan, stage)
    if not n:
        return ()
    data = catalog.kernel_data(plan.config.cluster.gpu.name)
    floor = data["host"]["kernel_issue_s"] if data else None
    cost = (f"; at the issue floor per sync (kernels.toml [host] kernel_issue_s, {floor * 1e6:g} us) that is "
            f"{n * floor * 1e3:.3g} ms per step" if floor else "")
    return (f"torchtitan's all-to-all dispatch copies its split sizes to the host and waits ({EP_SYNC_SOURCE}): "
            f"{n} device-to-host syncs per step on stage {stage} (each MoE layer's forward, recompute included), "
            f"not timed: each drains the GPU's queue, so the host's lead is lost there{cost}",)
