"""Which measured-error settings a plan lies in (:func:`meshplan.spec.accuracy.settings_of`, the
pure rule on the plan's fields, beside :data:`~meshplan.spec.accuracy.FIDELITY`), read off a
:class:`~meshplan.plan.Plan`: its sharding, framework, GPU and how many nodes one group of its
sharded data axis spans under its placement (``fsdp``: ``dp_shard`` (or ``dp``) x ``cp``,
:mod:`meshplan.mesh.resolve`; :func:`meshplan.placement.assign.axis_locality`). ``search`` warns
on its row 1 and ``compare`` on each side with :func:`meshplan.spec.accuracy.setting_line`."""

from __future__ import annotations

from meshplan.placement.assign import group_locality
from meshplan.plan import Infeasible, Plan
from meshplan.spec.accuracy import (Fidelity, a100, development_gaps, development_line, gpu_label, h100_rows,
                                    setting_line, settings_of)
from meshplan.spec.training import TrainingSpec
from meshplan.spec.training_fields import DEEPSPEED_ZERO3


def shard_nodes(plan: Plan) -> int:
    """The most nodes one ``fsdp`` group (the ranks ZeRO-3/FSDP shards parameters over) spans
    under the plan's placement (the derived ``fsdp`` axis where the mesh has two of dp, dp_shard and
    cp, else ``dp_shard`` or ``dp`` itself, :meth:`meshplan.mesh.resolve.Mesh.all_axes`); 1 where the
    mesh has none. The locality of that one axis only (:func:`meshplan.placement.assign.group_locality`):
    every axis's (:func:`~meshplan.placement.assign.axis_locality`) took 4.8 ms of CPU on the 405B
    example's row 1 (16,384 ranks, six axes), the one axis 0.55 ms."""
    axes = plan.mesh.all_axes()
    axis = next((a for a in ("fsdp", "dp_shard", "dp") if a in axes), None)
    return group_locality(plan.placement, plan.mesh.groups(axis)).max_nodes if axis is not None else 1


def fidelity_framework(t: TrainingSpec) -> str:
    """The runtime whose measured error a plan's step carries: ``"deepspeed"`` where DeepSpeed's
    engine runs its sharding (``zero3_engine`` ``deepspeed`` or ``deepspeed-2021`` at zero3,
    ``zero12_engine = "deepspeed"`` at zero1/zero2; its TOML's ``framework`` is torch's), else
    ``training.framework``.

    >>> fidelity_framework(TrainingSpec(global_batch=8, seq_len=16, sharding="zero3", zero3_engine="deepspeed"))
    'deepspeed'
    >>> fidelity_framework(TrainingSpec(global_batch=8, seq_len=16, sharding="zero3"))
    'torch'
    """
    if (t.sharding == "zero3" and t.zero3_engine in DEEPSPEED_ZERO3) or \
            (t.sharding in ("zero1", "zero2") and t.zero12_engine == "deepspeed"):
        return "deepspeed"
    return t.framework


def plan_settings(plan: Plan | Infeasible) -> tuple[Fidelity, ...]:
    """:func:`~meshplan.spec.accuracy.settings_of` of ``plan`` (its runtime by
    :func:`fidelity_framework`); () for an infeasible mesh (no step)."""
    if not isinstance(plan, Plan):
        return ()
    t = plan.config.training
    g = plan.config.cluster.gpu
    return settings_of(t.sharding, fidelity_framework(t), g.name, shard_nodes(plan), g.cuda_sm)


def plan_setting_line(who: str, plan: Plan | Infeasible, head: str = "warning") -> str:
    """:func:`~meshplan.spec.accuracy.setting_line` of ``plan`` as ``who``, with the H100 benchmark's
    rows of its settings (:func:`~meshplan.spec.accuracy.h100_rows`: float8 Linears, a TP overlap at
    tp > 1, pp > 1); on an A100 in none, the development set's caveat where the plan differs from it
    (:func:`~meshplan.spec.accuracy.development_line`, :func:`plan_gaps`); else ""."""
    if not isinstance(plan, Plan):
        return ""
    t, mesh, gpu = plan.config.training, plan.mesh, plan.config.cluster.gpu
    settings = plan_settings(plan)
    if not settings:
        return development_line(who, plan_gaps(plan), head) if a100(gpu.name, gpu.cuda_sm) else ""
    rows = h100_rows(t.linear_dtype == "fp8", bool(t.tp_comm_overlap) and mesh.degree("tp") > 1, mesh.degree("pp"))
    return setting_line(who, settings, fidelity_framework(t), rows, head, gpu_label(gpu.name))


def plan_gaps(plan: Plan) -> tuple[str, ...]:
    """:func:`~meshplan.spec.accuracy.development_gaps` of ``plan``: its world size, dp (replicate x
    shard), cp, attention (kv_heads below q_heads), MLP, sharding and seq_len."""
    m, t = plan.config.model, plan.config.training
    return development_gaps(plan.mesh.world, plan.mesh.dp, plan.mesh.degree("cp"), m.n_kv_heads < m.q_heads,
                            m.gated_mlp, t.sharding, t.seq_len)
