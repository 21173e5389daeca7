"""The reduced plan of ``bench rank``'s one-rank run (:mod:`meshplan.runtime.validation.one_rank`)
and its prediction; no torch.

**The reduced plan** (:func:`reduced_data`): the config with ``model.layers`` set to ``layers``,
the pipeline axis removed (a stage's local GEMM, attention and norm shapes depend on tp, cp, ep,
the micro-batch and the sequence, not on pp; the ``pp`` entry of ``mesh.shape`` is dropped and
``pp_layer_split``, ``virtual_stages`` and ``pp_schedule`` with it), one micro-batch (``global_batch``
= micro-batch x the data-parallel degree), and, with ``system``, the cluster's node type replaced
by the local machine's (``dgx-h200`` for an H200) with as many nodes as the remaining mesh needs.
The prediction (:func:`predict`) is :func:`meshplan.plan.build_plan` of that config: per layer the ops of
:func:`meshplan.compute.layer.layer_cost` (``forward``: the forward ops; ``backward``: the input
and weight gradients with the recompute replay), and the stage's memory timeline peak without the
kinds this run cannot hold (NCCL buffers: the fake group allocates none; fragmentation: the
allocator's reserved-but-unused bytes, compared against ``max_memory_reserved`` instead). The
``[memory]`` table states what the runtime model does (:data:`RUN_MEMORY`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Optional

from meshplan import catalog
from meshplan.compute.layer import layer_cost
from meshplan.errors import ConfigError
from meshplan.memory.timeline import UNTRACKED_KINDS
from meshplan.plan import Infeasible, Plan, build_plan
from meshplan.schedule.backward_pass import block_backward_issue_s
from meshplan.schedule.workload import workload_of

#: ``[memory]`` of what the run does (module docstring): no NCCL buffers on the fake group, no
#: fragmentation in ``max_memory_allocated``, one micro-batch; the runtime model's own layout:
#: K/V repeated to the query heads before SDPA, torch's cross entropy, DTensor's all-gathered
#: sequence-parallel inputs kept for backward; at tp > 1 the whole-vocabulary embedding gradient of
#: torch's ``RowwiseParallel`` embedding (as :data:`~meshplan.runtime.validation.memcheck.TORCH_CPU_MEMORY`
#: states for the same model; omitted before, it left 1.11 GB out of 405B tp 8's peak, run 3), and the
#: CUDA embedding backward's working set (``embedding_backward_work``: 0.83 GB more there).
RUN_MEMORY = dict(nccl_buffsize_bytes=0, fragmentation_fraction=0.0, cross_entropy="torch",
                  sp_gathered_input=True, kv_expanded=True, dropout=False, embedding_grad_full_vocab=True,
                  embedding_backward_work=True)
#: Mesh axes that split the batch (``fsdp`` is ``dp_shard``'s other name).
DATA_AXES = ("dp", "dp_replicate", "dp_shard", "fsdp")


def reduced_data(data: dict, layers: int, system: Optional[str] = None) -> dict:
    """The config mapping of the one-rank run (module docstring); ``data`` is not changed.

    >>> d = {"model": {"catalog": "llama3-405b"}, "cluster": {"system": "dgx-h100", "nodes": 2048},
    ...      "training": {"global_batch": 2048, "micro_batch": 1, "seq_len": 8192},
    ...      "mesh": {"names": ["pp", "dp_shard", "tp"], "shape": [16, 128, 8], "pp_layer_split": [8] * 16}}
    >>> r = reduced_data(d, 2, "dgx-h200")
    >>> r["mesh"], r["model"]["layers"], r["training"]["global_batch"], r["cluster"]
    ({'names': ['dp_shard', 'tp'], 'shape': [128, 8]}, 2, 128, {'system': 'dgx-h200', 'nodes': 128})
    """
    if layers < 1:
        raise ConfigError("--layers", f"{layers}; give 1 or more layers")
    out = copy.deepcopy(data)
    mesh = out.setdefault("mesh", {})
    names, shape = list(mesh.get("names", [])), list(mesh.get("shape", []))
    if "pp" in names:
        i = names.index("pp")
        del names[i], shape[i]
    if any(int(s) < 1 for s in shape):
        raise ConfigError("mesh.shape", "the one-rank run needs every degree given (no -1); write the degrees out")
    mesh["names"], mesh["shape"] = names, shape
    for key in ("pp_layer_split", "virtual_stages", "pp_schedule"):
        mesh.pop(key, None)
        out.get("training", {}).pop(key, None)
    out["model"]["layers"] = layers
    if out["model"].get("dense_layers", 0) >= layers:
        out["model"]["dense_layers"] = layers - 1 if layers > 1 else 0
    dp = math.prod(s for n, s in zip(names, shape) if n in DATA_AXES)
    out["training"]["global_batch"] = out["training"].get("micro_batch", 1) * dp
    out["training"].pop("grad_accum", None)
    world = math.prod(shape)
    if system is not None:
        out["cluster"] = {"system": system}
    gpus = _gpus_per_node(out["cluster"])
    out["cluster"]["nodes"] = max(1, math.ceil(world / gpus))
    if world % gpus:  # fewer GPUs than whole nodes: the mesh uses `world` of them
        mesh["world"] = world
    else:
        mesh.pop("world", None)
    out.setdefault("memory", {}).update(RUN_MEMORY)
    return out


def _gpus_per_node(cluster: dict) -> int:
    return int(cluster.get("gpus_per_node") or catalog.node(cluster["system"]).gpus)


@dataclass(frozen=True)
class Predicted:
    """The reduced plan's figures for one rank: seconds per layer and bytes."""

    forward_s: float
    backward_s: float
    recompute_s: float
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_where: str
    gpu: str
    peak_by_kind: dict = field(default_factory=dict)
    kernels_s: tuple = (0.0, 0.0)  # (forward, backward) per layer of the kernels alone, without the host's pace


def predict(cfg) -> tuple[Plan, Predicted]:
    """(plan, :class:`Predicted`) of the reduced config ``cfg``; ConfigError when infeasible.
    A layer's time is its kernels' (the fake process group's collectives take none), or the
    host's pace of issuing it where that is longer (eager DTensor TP:
    :func:`~meshplan.schedule.workload.dtensor_host_s`, as the step's unit timelines hold it)."""
    plan = build_plan(cfg)
    if isinstance(plan, Infeasible):
        raise ConfigError("mesh", "the reduced plan is infeasible: " + "; ".join(plan.reasons))
    w = workload_of(plan)
    cost = layer_cost(cfg.model, cfg.cluster.gpu, w)
    peak = plan.timelines[0].peak
    untracked = sum(peak.by_kind.get(k, 0) for k in UNTRACKED_KINDS)
    frag = peak.by_kind.get("fragmentation", 0)
    kernels = (cost.seconds("forward"), cost.seconds("backward_input") + cost.seconds("backward_weight"))
    back = max(kernels[1], block_backward_issue_s(w, cost))
    fwd = max(kernels[0], w.dtensor_host_s[0])  # the host's pace under eager DTensor TP
    return plan, Predicted(forward_s=fwd, backward_s=back, recompute_s=cost.seconds(recompute=True),
                           peak_allocated_bytes=peak.total_bytes - untracked,
                           peak_reserved_bytes=peak.total_bytes - untracked + frag, peak_where=peak.where(),
                           gpu=cfg.cluster.gpu.name, peak_by_kind=dict(peak.by_kind), kernels_s=kernels)
