"""First collective table: per group kind and phase, the collective each rank issues, its
payload, count per micro-batch and per step, dtype, and an alpha-beta time on the link
class the group crosses (:func:`meshplan.comm.ring_time`).

Conventions (stated so a row lines up with what a framework issues):
- ``size_bytes`` is the full buffer S as nccl-tests prints it (the gathered output of an
  all-gather, the input of a reduce-scatter).
- TP without SP: 2 all-reduces per layer forward (after attention and MLP), 2 in backward
  (Megatron-LM, Shoeybi et al. 2019, Fig. 3). With SP: each becomes an all-gather plus a
  reduce-scatter (Korthikanti et al. 2022, section 4.2.2). Full recompute repeats the
  forward collectives in backward.
- FSDP2/ZeRO-3: one all-gather per layer in forward and, with reshard_after_forward, again
  in backward; one reduce-scatter of gradients per layer; all per micro-batch (FSDP2's
  default: gradients are reduced every micro-batch). ZeRO-1/2 (Megatron distributed
  optimizer): one gradient reduce-scatter and one parameter all-gather per step. DDP: one
  gradient all-reduce per step. HSDP adds an all-reduce over dp_replicate of the shard.
- CP: all-gather of the local K and V per layer forward, reduce-scatter of dK, dV backward.
- PP: one send/recv of the activation per micro-batch per chunk boundary in forward and one
  of its gradient in backward; with SP the sent tensor is split over tp.
- EP: all-to-all dispatch and combine per MoE layer, forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .comm import busbw_factor, ring_time
from .mesh import Mesh
from .spec.cluster import ClusterSpec
from .spec.model import ModelSpec
from .spec.training import TrainingSpec
from .tpsplit import local_heads, local_numel, padded_vocab
from .units import dtype_bytes


@dataclass(frozen=True)
class Path:
    """Link class a group's collective crosses and the bandwidth each rank gets on it."""

    kind: str  # "local" | "nvlink" | "network"
    bandwidth_bytes_per_s: float
    note: str


@dataclass(frozen=True)
class CollectiveRow:
    """One collective kind on one axis in one phase (see the module docstring)."""

    axis: str
    phase: str
    op: str
    group_size: int
    n_groups: int
    example_ranks: tuple[int, ...]
    size_bytes: float
    dtype: str
    per_microbatch: int
    per_step: int
    cadence: str
    path: Path
    time_s: float

    @property
    def algbw_bytes_per_s(self) -> float:
        return self.size_bytes / self.time_s if self.time_s else 0.0

    @property
    def busbw_bytes_per_s(self) -> float:
        return self.algbw_bytes_per_s * busbw_factor(self.op, self.group_size)


def axis_path(mesh: Mesh, placement, cluster: ClusterSpec, axis: str) -> Path:
    """Path of ``axis``'s collectives when all its groups run at once (SPMD).

    Inside one node (or NVLink domain): the fabric's per-GPU bandwidth. Across nodes: on
    each node, every group with members there sends its ring traffic out through its
    members' affine NICs; per-rank bandwidth = min(fabric, NIC bandwidth of the NICs used on
    the node / groups leaving the node), taken at the most loaded node.
    """
    groups = mesh.groups(axis)
    if groups.shape[1] == 1:
        return Path("local", float("inf"), "no peers")
    node = placement.node[groups]
    domain = cluster.node.nvlink_domain_gpus
    span_key = placement.global_gpu[groups] // domain if domain else node
    fabric = cluster.node.fabric.bandwidth_bytes_per_s
    if (span_key == span_key[:, :1]).all():
        return Path("nvlink", fabric, cluster.node.fabric.name)
    nics = cluster.node.nics
    if not nics:
        return Path("network", cluster.node.pcie.bandwidth_bytes_per_s, "no NIC in catalog: PCIe bound")
    n0 = int(node[0, 0])
    on_node = [g for g in range(groups.shape[0]) if (node[g] == n0).any()]
    used = sorted({int(placement.nic[r]) for g in on_node for r in groups[g] if placement.node[r] == n0})
    nic_bw = sum(nics[i].bandwidth_bytes_per_s for i in used if i >= 0)
    bw = min(fabric, nic_bw / len(on_node))
    rails = np.unique(placement.rail[groups[0]])
    return Path("network", bw, f"{len(on_node)} group(s) per node share NIC(s) "
                f"{','.join(nics[i].name for i in used)}; rails {rails.tolist()}")


def collective_table(model: ModelSpec, training: TrainingSpec, mesh: Mesh, cluster: ClusterSpec,
                     placement, stage_layers: list[int], micro_batches: int,
                     first_stage: bool = True, last_stage: bool = True) -> list[CollectiveRow]:
    """Rows for one pipeline stage holding ``stage_layers`` (layer indices)."""
    rows: list[CollectiveRow] = []
    tp, cp = mesh.degree("tp"), mesh.degree("cp")
    b, s, h = training.micro_batch, training.seq_len // cp, model.hidden
    act = dtype_bytes(training.compute_dtype)
    nl = len(stage_layers)

    def add(axis, phase, op, size, dtype, per_mb, cadence, per_step=None):
        if mesh.degree(axis) <= 1 or size <= 0 or (per_mb == 0 and not per_step):
            return
        path = axis_path(mesh, placement, cluster, axis)
        n = mesh.degree(axis)
        t = ring_time(op, n, size, path.bandwidth_bytes_per_s, network=path.kind == "network")
        shown = mesh.display_name(axis)
        rows.append(CollectiveRow(shown, phase, op, n, mesh.world // n, tuple(mesh.group_of(0, axis)),
                                  float(size), dtype, per_mb, per_step if per_step is not None else per_mb * micro_batches,
                                  cadence, path, t))

    _tp_rows(add, mesh, training, b * s * h * act, nl, first_stage, last_stage)
    if cp > 1:
        _, kv_l, _ = local_heads(model, tp)
        kv_full = 2 * b * training.seq_len * kv_l * model.d_head * act
        add("cp", "forward", "all-gather", kv_full, training.compute_dtype, nl, "every layer (K and V)")
        add("cp", "backward", "reduce-scatter", kv_full, training.compute_dtype, nl, "every layer (dK and dV)")
    _dp_rows(add, model, training, mesh, stage_layers, first_stage, last_stage, micro_batches)
    pp = mesh.degree("pp")
    if pp > 1:
        sent = b * s * h * act / (tp if mesh.sequence_parallel else 1)
        chunks = 1  # per chunk boundary; interleaved stages add one per extra chunk
        add("pp", "forward", "send/recv", sent, training.compute_dtype, chunks, "every micro-batch")
        add("pp", "backward", "send/recv", sent, training.compute_dtype, chunks, "every micro-batch")
    if mesh.ep > 1:
        moe = sum(model.is_moe_layer(i) for i in stage_layers)
        a2a = b * s * model.top_k * h * act
        add("ep", "forward", "all-to-all", a2a, training.compute_dtype, 2 * moe, "every MoE layer (dispatch, combine)")
        add("ep", "backward", "all-to-all", a2a, training.compute_dtype, 2 * moe, "every MoE layer")
    return rows


def _tp_rows(add, mesh, training, act_bytes, nl, first, last):
    rec = 2 if training.recompute == "full" else 0
    if mesh.sequence_parallel:
        add("tp", "forward", "all-gather", act_bytes, training.compute_dtype, 2 * nl + last, "every layer (SP)")
        add("tp", "forward", "reduce-scatter", act_bytes, training.compute_dtype, 2 * nl + first, "every layer (SP)")
        add("tp", "backward", "all-gather", act_bytes, training.compute_dtype, (2 + rec) * nl, "every layer (SP)")
        add("tp", "backward", "reduce-scatter", act_bytes, training.compute_dtype, (2 + rec) * nl + last,
            "every layer (SP)")
    else:
        add("tp", "forward", "all-reduce", act_bytes, training.compute_dtype, 2 * nl + first, "every layer")
        add("tp", "backward", "all-reduce", act_bytes, training.compute_dtype, (2 + rec) * nl + last,
            "every layer")


def _dp_rows(add, model, training, mesh, stage_layers, first, last, micro):
    tp, ep, etp = mesh.degree("tp"), mesh.ep, mesh.etp
    v = padded_vocab(model.vocab, training.vocab_pad_divisor, tp)
    dense = sum(local_numel(t, model, tp) for i in stage_layers for t in model.layer_tensors(i) if not t.expert)
    expert = sum(local_numel(t, model, tp, ep, etp) for i in stage_layers for t in model.layer_tensors(i) if t.expert)
    root = (sum(local_numel(t, model, tp) for t in model.embedding_tensors(v)) if first else 0)
    root += sum(local_numel(t, model, tp) for t in model.head_tensors(v)
                if last and (not t.tied or mesh.degree("pp") > 1 or not first))
    nl = max(len(stage_layers), 1)
    ag, rs = dtype_bytes(training.compute_dtype), dtype_bytes(training.reduce_dtype)
    shard = "fsdp" if training.sharding != "none" else "loss"
    for params, axis, label in ((dense / nl, shard, "per layer"), (root, shard, "root (embedding/output)"),
                                (expert / nl, "efsdp", "per MoE layer")):
        if not params:
            continue
        n_units = nl if label != "root (embedding/output)" else 1
        if training.sharding in ("zero3", "hsdp"):
            back = n_units if training.reshard_after_forward else 0
            add(axis, "forward", "all-gather", params * ag, training.compute_dtype, n_units, label)
            add(axis, "backward", "all-gather", params * ag, training.compute_dtype, back, label)
            add(axis, "backward", "reduce-scatter", params * rs, training.reduce_dtype, n_units, label)
            if "dp_replicate" in mesh.layout.names:
                add("dp_replicate", "backward", "all-reduce", params * rs / mesh.degree(axis),
                    training.reduce_dtype, n_units, label + " (HSDP replicas)")
        elif training.sharding in ("zero1", "zero2"):
            add(axis, "step", "reduce-scatter", params * n_units * rs, training.reduce_dtype, 0, "once per step",
                per_step=1)
            add(axis, "step", "all-gather", params * n_units * dtype_bytes(training.param_dtype),
                training.param_dtype, 0, "once per step (updated params)", per_step=1)
        else:
            add(axis, "step", "all-reduce", params * n_units * rs, training.reduce_dtype, 0, "once per step (DDP)",
                per_step=1)
