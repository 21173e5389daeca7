"""First collective table: per group kind and phase, the collective each rank issues, its
payload, count per micro-batch, per layer and per step, dtype, what waits on it, the NCCL
algorithm (ring, tree, NVLS, hierarchical) and its alpha-beta time on the link class the group
crosses (:func:`meshplan.comm.alphabeta.collective_time`, on the node's measured nccl-tests
curves where the catalog has them).

Conventions, matched op by op against what torch 2.13 issues for DTensor TP/SP and FSDP2
(``meshplan.runtime.validation.dryrun``; torchtitan's Llama plan):
- ``size_bytes`` is the full buffer S as nccl-tests prints it (all-gather output,
  reduce-scatter input, all-reduce buffer).
- TP without SP: forward all-reduce after the vocab-parallel embedding (first stage) and after
  wo and w_down of every layer; backward all-reduce of the input gradient of wq/wk/wv and
  w_gate/w_up of every layer and of the output layer (last stage) (Megatron-LM, Shoeybi et al.
  2019, Fig. 3). With SP each becomes an all-gather (before column-parallel GEMMs) and a
  reduce-scatter (after row-parallel GEMMs), in forward and mirrored in backward (Korthikanti
  et al. 2022, 4.2.2); the replicated norm weights get their gradients all-reduced over tp in
  backward (one per norm parameter, h elements in compute dtype; FSDP2 issues it in its gradient
  reduction, so with pp > 1, where ``PipelineStage`` turns gradient sync off for every backward
  but the last, once per step: measured, torch 2.13 gloo). Without FSDP to reduce them
  in backward, those gradients stay Partial DTensors and the optimizer reduces them at each
  use: AdamW reads each 3 times (measured with torch 2.13 on gloo, ``meshplan validate``).
- Float8 Linears with tensorwise scaling under torch (``TrainingSpec.float8_tp_gathers``:
  torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` / ``PrepareFloat8ModuleInput``,
  torchao eab345c ``float8/float8_tensor_parallel.py``), with SP: a dense layer's all-gathers,
  forward (inputs), backward (output gradients) and replayed, move float8, 1 byte a value
  (:func:`meshplan.compute.dtensor_sp.float8_tp`; rows of dtype fp8, :data:`FLOAT8_TP_CADENCE`);
  its reduce-scatters, the embedding's and the output layer's collectives stay in the compute dtype. Llama 3 8B at b 12, s 8192, tp 8:
  an all-gather of 12 x 8192 x 4096 values is 402,653,184 B instead of 805,306,368 B. Each cast of
  a tp shard all-reduces its amax over tp first (:func:`_float8_amax_rows`, one fp64 scalar: per
  Llama layer 4 forward, 7 backward, and the forward's again where the layer is recomputed).
- TP with MoE layers (etp 1, :func:`_tp_layer_ops`): attention and shared experts as above;
  the tp ranks split the tokens for the routed experts (:mod:`meshplan.runtime.execution.moe`), so
  the routed path has no tp collective under SP (a rank routes its own sequence shard) and
  without SP one all-gather of the b*s*h routed outputs (the replicated activation rebuilt
  after combine) in forward and one of the input gradient in backward; no MLP collectives
  without shared experts. The router weight, replicated over tp, gets a Partial gradient:
  one all-reduce of experts*h elements per MoE layer, issued with the SP norms'. Measured
  with torch 2.13 (fake process group and gloo, ``tests/test_validate_moe.py``).
- TP with multi-head latent attention (:func:`_mla_grad_rows`, torchtitan's DeepSeek-V3 plan,
  framework torch): the replicated down projections and latent norms get Partial gradients,
  one all-reduce over tp per weight and layer, issued with the SP norms'.
- TP past the KV heads (tp > kv_heads, handed case C6; :func:`_kv_replica_rows`): each KV
  head is copied on ``r = tp / kv_heads`` tp ranks; once per step, before the optimizer, one
  all-reduce (sum) per layer of the copies' wk/wv gradients over those ``r`` ranks (axis
  ``kv_replica``), so the copies stay equal.
- Loss parallel (last stage, tp > 1): three all-reduces of b*s fp32 values (max, sum of
  exponentials, target logit); without it, one all-gather of the b*s*V logits.
- Full recompute: torch's non-reentrant checkpoint replays each layer's forward up to its last
  saved tensor, so it repeats every forward TP collective except the last one of the layer;
  torchtitan's per-layer AC (``recompute = "layer"``) does so in its checkpointed layers
  (``TrainingSpec.layer_recomputed``); its op-level AC (cp = ep = 1; with tp > 1
  under SP) replays the forward's tp all-gathers only (it saves the reduce-scatters' outputs).
- FSDP2 (zero3, hsdp): one unit per transformer layer and the ends as torchtitan wraps them
  (``TrainingSpec.torchtitan_units``: the embedding on the stage holding it, chunk 0 of stage
  0, and [final norm, output] on the stage holding the last chunk, at every pp and vpp; tied
  embeddings at pp 1, Megatron and DeepSpeed: one root unit of both ends; tied under pp: the
  embedding's unit kept gathered, the last stage's [norm, output] with its output copy). Each unit is
  all-gathered in forward, again in backward when ``reshard_after_forward`` (not the
  unit holding the output layer, which torchtitan keeps gathered unless
  ``training.reshard_head_after_forward``, its policy ``"always"``: :func:`kept_gathered`), and its gradients
  reduce-scattered in backward, every micro-batch. FSDP2 pads dim 0 of each
  parameter to a multiple of the shard degree (:func:`~meshplan.mesh.tpsplit.fsdp_padded_numel`).
  HSDP all-reduces each unit's gradient shard over dp_replicate. Expert weights form their
  own unit over efsdp (torchtitan), sharded on dim 1 when efsdp x ep > experts (torchtitan's
  ``shard_placement_fn``, :func:`~meshplan.spec.axes.ep.expert_shard_dim`), so a rank's one
  expert over efsdp 4 is gathered unpadded, not as 4 experts' rows. Gradient accumulation with pp 1
  (``training.grad_accumulation``): ``no_sync`` reduce-scatters (and HSDP all-reduces) once
  per step, in the last micro-batch; ``no_sync_unsharded`` also gathers in forward only in
  micro-batch 0 (:func:`_accumulation_gathers`); measured with torch 2.13's FSDP2 on the
  fake process group (``tests/test_grad_accumulation.py``).
- ZeRO-1 (Megatron distributed optimizer): one gradient reduce-scatter and one parameter
  all-gather per step, as one bucket per stage. ZeRO-2 (gradients sharded, so they cannot
  accumulate unreduced): every micro-batch's backward reduce-scatters its gradients one bucket
  at a time, as the buckets fill (DeepSpeed's ``allreduce_gradients``: "ZeRO stage >= 2
  communicates during non gradient accumulation boundaries as well", ``stage_1_and_2.py``
  ``reduce_independent_p_g_buckets_and_remove_grads`` / ``reduce_ipg_grads``), the bucket the
  memory model holds (:meth:`~meshplan.spec.memory.MemoryOptions.bucket_elements`: ``[memory]
  grad_bucket_elements``, DeepSpeed's ``reduce_bucket_size``), then one parameter all-gather
  per step (:func:`_zero2_rows`). DDP (none): one all-reduce per gradient bucket in
  the backward of the step's last micro-batch, the buckets of torch 2.13's reducer after its first
  step (25 MiB, the first 1 MiB, or ``[memory] grad_bucket_elements``; :func:`_ddp_rows`; the very
  first step sends one bucket of all, :func:`meshplan.runtime.execution.parallelize.apply_ddp`);
  Megatron-LM 2022 (``framework = "megatron"``): one all-reduce of its contiguous gradient buffer.
  DeepSpeed's own ZeRO-1/2 (``training.zero12_engine = "deepspeed"``): one all-reduce per
  bucket of whole parameters, every micro-batch (zero2) or once per step (zero1), then one
  all-gather of the padded flat parameters (:mod:`meshplan.comm.deepspeed_zero12`).
  Every gradient reduction (FSDP reduce-scatter, HSDP all-reduce, ZeRO-1/2 reduce-scatter, DDP
  all-reduce) is in ``training.gradient_reduce_dtype``: ``training.grad_reduce_dtype = "fp32"``
  gives Megatron-LM's fp32 main-gradient reduction.
- CP (all-gather CP, Llama 3, Dubey et al. 2024, 3.3.2; :mod:`meshplan.runtime.execution.cp`): per
  layer in forward one all-gather of the local K and V stacked in one buffer (full buffer
  ``2 * b * s * kv_heads_local * d_head`` in compute dtype, K/V heads before the GQA repeat;
  multi-head latent attention: ``b * s * heads_local * (d_qk + d_v)``, the up-projected K and V),
  and its autograd backward, one reduce-scatter (sum) of dK and dV of the same size. Full
  recompute replays the gather (the checkpoint replays a layer up to its last saved tensor,
  which comes after the gather), so backward also has one all-gather per layer; the
  reduce-scatter stays one per layer (only the replayed graph is differentiated). Measured
  with torch 2.13 on the fake process group and gloo (``tests/test_table_vs_torch.py``,
  ``tests/test_validate_cp.py``).
- PP: per micro-batch, one send of the activation for every chunk that is not the model's
  last and one receive for every chunk that is not its first (``2 vpp - first - last``), in
  forward, and the same for gradients in backward. The tensor sent is the residual stream as
  the TP plan leaves it between layers: a plain tensor (row-parallel outputs are local), so
  with SP each tp rank sends its own sequence shard (b * s/tp * h) to its peer of the next
  stage, and without SP every tp rank sends the whole (b, s, h) activation (no Megatron
  scatter/gather across tp): measured with ``torch.distributed.pipelining`` 2.13.
  With pp > 1, FSDP2 inside ``torch.distributed.pipelining`` reduce-scatters each unit once
  per step and gathers it when the schedule finds it sharded (:func:`_pipelined_gathers`).
  With cp the activation is this rank's b * s/cp * h (its two chunks; /tp under SP).
  Tied embeddings with pp > 1 (embedding on the first stage, its copy as the output layer on
  the last): once per step, after the schedule, the two copies' gradients are all-reduced
  (sum) over the embedding group, the first and last rank of a pp group (Megatron-LM
  ``finalize_model_grads._allreduce_word_embedding_grads``); the buffer is the rank's local
  gradient (:func:`_tied_grad_bytes`), since FSDP2 has already reduced it over the data axes
  (``meshplan.runtime.execution.pipelined_stage``, measured with torch 2.13 on gloo).
- EP: all-to-all dispatch and combine per MoE layer in forward, and their gradients in
  backward; full recompute replays both (non-reentrant checkpoint: the combine's output is
  saved by the gate multiply), so backward has 4 per MoE layer. Each rank dispatches a
  fixed buffer of ``experts x C`` token rows, ``C = ceil(f * T * top_k / experts)`` for its
  ``T = b*s/cp * etp/tp`` distinct tokens (:mod:`meshplan.compute.routing`, capacity
  factor f = ``training.moe_capacity_factor``, default 1: overflowing copies dropped, empty
  slots padded), so the bytes are known before
  routing; torch cannot size an all-to-all by the router's (data-dependent) counts without
  an extra exchange of counts. Equal to ``T * top_k`` rows when experts divides it, the
  balanced-routing size used before (runtime MoE: :mod:`meshplan.runtime.execution.moe`, measured
  with torch 2.13 on gloo). Dropless (the default of both frameworks, ``training.moe_dropless``): the
  buffer is the busiest rank's received rows under the stated ``moe_hottest_expert_share``
  (its all-to-all sets the time every rank waits for); unstated, the expected load of uniform
  routing, ``T * top_k`` rows (``T * top_k / ep`` per peer), the balanced case. Before each
  dispatch the ranks exchange their per-expert counts: under torch one all-to-all of
  ``experts`` int64 per MoE layer in forward (and per replayed layer in backward), no gradient
  (torchtitan's ``_token_count_exchange``), under Megatron-LM an all-gather of them over ep x
  etp (:func:`_count_rows`), rows of cadence :data:`DROPLESS_COUNTS`, timed by the comm model
  (latency-dominated) and placed on the ep stream before each dispatch, which waits for it
  (:func:`meshplan.schedule.comm_times.comm_kind`; its device-to-host sync is not modelled).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

from meshplan.comm import deepspeed, deepspeed_zero12, fsdp2
from meshplan.comm.alphabeta import REFERENCE_STEP_S, busbw_factor, collective_time
from meshplan.compute import float8
from meshplan.compute.dtensor_sp import float8_tp
from meshplan.compute.measured import kernel_data
from meshplan.compute.megatron import stage_param_tensors
from meshplan.compute.routing import RoutingOptions, routing
from meshplan.compute.shapes import local_split
from meshplan.mesh.layout import grid_groups
from meshplan.mesh.resolve import Mesh
from meshplan.mesh.tpsplit import (
    KV_REPLICA,
    fsdp_padded_numel,
    kv_replica_groups,
    local_heads,
    local_numel,
    local_rows,
    padded_numel,
    padded_vocab,
)
from meshplan.pipeline.registry import get as get_schedule
from meshplan.pipeline.simulate import stage_order
from meshplan.spec.axes.base import Dim
from meshplan.spec.axes.registry import AXES, Axis
from meshplan.spec.cluster import ClusterSpec, GPUSpec
from meshplan.spec.memory import MemoryOptions, deepspeed_copied_bytes
from meshplan.spec.mesh import Schedule
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes


@dataclass(frozen=True)
class Path:
    """Link class a group's collective crosses, the bandwidth each rank gets on it (bytes/s)
    and the per-step latency scale against NCCL's defaults (1 = NCCL's constants). Across
    nodes: ``nodes`` spanned, ``ranks_per_node`` of the group on a node, and
    ``nic_bandwidth_bytes_per_s``, the share of its own NIC a rank gets while every group of
    the axis runs (all-to-all's cross-node bytes leave through it). ``calibrated``: the link
    class carries the user's nccl-tests fit (:func:`meshplan.comm.calibration.apply_calibration`),
    timed as :func:`meshplan.comm.alphabeta.collective_time` says."""

    kind: str  # "local" | "nvlink" | "network"
    bandwidth_bytes_per_s: float
    note: str
    latency_scale: float = 1.0
    nodes: int = 1
    ranks_per_node: int = 0
    nic_bandwidth_bytes_per_s: float = 0.0
    calibrated: bool = False


@dataclass(frozen=True)
class CollectiveRow:
    """One collective kind on one axis in one phase (see the module docstring).
    ``waits``: what compute waits on it; ``depth``: how many compute ops wait on it;
    ``host_s``: host seconds per call that delay the compute's issue (DeepSpeed ZeRO-3's
    list-based calls, :func:`meshplan.comm.deepspeed.host_seconds`; 0 for the others);
    ``copy_s``: GPU seconds per call of FSDP2's copy on the compute stream, the copy-out after
    an all-gather or the copy-in before a reduce-scatter (:mod:`meshplan.comm.fsdp2`: bytes at
    the catalog's BabelStream Triad, never below the issue floor; 0 for the others)."""

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
    waits: str = ""
    depth: int = 0
    algorithm: str = "ring"
    per_layer: float = 0.0
    host_s: float = 0.0
    copy_s: float = 0.0

    @property
    def algbw_bytes_per_s(self) -> float:
        return self.size_bytes / self.time_s if self.time_s else 0.0

    @property
    def busbw_bytes_per_s(self) -> float:
        return self.algbw_bytes_per_s * busbw_factor(self.op, self.group_size)

    @property
    def sent_bytes(self) -> float:
        """Bytes one rank sends per call: S x busbw factor ((n-1)/n S for all-gather,
        reduce-scatter and all-to-all, 2(n-1)/n S for all-reduce; nccl-tests PERFORMANCE.md)."""
        return self.size_bytes * busbw_factor(self.op, self.group_size)

    @property
    def algorithm_shown(self) -> str:
        """The algorithm column of the printed tables: ``p2p`` for a send/recv, which NCCL runs as one
        point-to-point transfer (no ring or tree; its time is still :func:`path_time`'s, whose
        ``algorithm`` names the curve family it was timed on), else :attr:`algorithm`."""
        return "p2p" if self.op == "send/recv" else self.algorithm

    @property
    def sent_bytes_per_step(self) -> float:
        """Bytes one rank sends per step on this row: :attr:`sent_bytes` x ``per_step``. The
        one traffic unit of every report (printed in GB, 1e9 B)."""
        return self.sent_bytes * self.per_step

    @property
    def link_bytes(self) -> tuple[float, float]:
        """(NVLink, network) bytes one rank of rank 0's group sends per call: all of
        :attr:`sent_bytes` on the fabric inside a node or NVLink domain, nothing with no
        peers, and across nodes the split of :func:`link_bytes` for the row's algorithm on its
        path's ``nodes`` and ``ranks_per_node``."""
        if self.path.kind == "local":
            return 0.0, 0.0
        if self.path.kind == "nvlink":
            return self.sent_bytes, 0.0
        return link_bytes(self.op, self.algorithm, self.group_size, self.size_bytes, self.path.nodes,
                          self.path.ranks_per_node)


def link_bytes(op: str, algorithm: str, n: int, size_bytes: float, nodes: int,
               ranks_per_node: int) -> tuple[float, float]:
    """(NVLink, network) bytes one rank sends per call of ``op`` on ``size_bytes`` (nccl-tests
    S) over a group of ``n`` ranks spread on ``nodes`` nodes, ``ranks_per_node`` (g) of them
    on each, when ``algorithm`` (the table's choice, :func:`path_time`) runs it. The two
    parts are what the rank puts on its NVLink and what leaves its node through a NIC; a node
    sends g x the network part. With g = 1 (or no node count) every byte crosses the network.

    - ring (every op but all-to-all; NCCL's multi-node rings enter and leave each node once
      per channel, NCCL ``graph/rings.cc``; with one channel per NIC every GPU is the exit of
      one): of the rank's ring bytes ``sent = busbw_factor(op, n) S`` (nccl-tests
      PERFORMANCE.md), ``(g-1)/g`` go to its NVLink neighbour and ``1/g`` through a NIC, so a
      node sends one rank's ring bytes, as each ring edge carries them;
    - hierarchical (:func:`meshplan.comm.alphabeta.collective_time`): inside the node the
      reduce-scatter and/or all-gather over g ranks on S (``(g-1)/g S`` each), across nodes
      the op over the ``nodes`` ranks of the same local index on S/g;
    - tree all-reduce (NCCL's double binary tree: inside a node a chain of g ranks, across
      nodes a tree of chains, each of the two trees on S/2, NCCL ``graph/trees.cc``): each of
      the g - 1 chain hops carries S/2 up and S/2 down per tree, ``2 (g-1)/g S`` per rank on
      NVLink; the N - 1 tree edges between nodes carry S/2 each way per tree, so a node sends
      ``2 (N-1)/N S`` on average, ``2 (N-1)/N S / g`` per rank: the hierarchical all-reduce's
      split;
    - pairwise all-to-all (:func:`meshplan.comm.alphabeta.all_to_all_time`): S/n to each
      peer, ``(g-1)/n S`` to the node's own and ``(n-g)/n S`` through the NIC;
    - send/recv along a pipeline of n stages, g consecutive ones per node: N - 1 of the n - 1
      hops cross nodes, so ``(N-1)/(n-1)`` of the bytes go through a NIC on average over the
      stages (all of them with one stage per node).

    2 nodes x 8 GPUs, ring all-gather of 16 GB: 15 GB sent, 7/8 on NVLink, 1/8 on the NIC;
    hierarchical: 7/8 x 16 GB inside, (1/2) x 16/8 GB across:

    >>> link_bytes("all-gather", "ring", 16, 16e9, 2, 8)
    (13125000000.0, 1875000000.0)
    >>> link_bytes("all-gather", "hierarchical", 16, 16e9, 2, 8)
    (14000000000.0, 1000000000.0)
    >>> link_bytes("all-reduce", "tree", 16, 16e9, 2, 8)
    (28000000000.0, 2000000000.0)
    >>> link_bytes("all-to-all", "pairwise", 16, 16e9, 2, 8)
    (7000000000.0, 8000000000.0)
    """
    sent = size_bytes * busbw_factor(op, n)
    g = min(max(ranks_per_node, 1), n)
    big_n = max(nodes, 1)
    if g <= 1 or big_n <= 1:
        return 0.0, sent
    if algorithm == "pairwise" or op == "all-to-all":
        return (g - 1) / n * size_bytes, (n - g) / n * size_bytes
    if op == "send/recv":
        cross = (big_n - 1) / (n - 1)
        return sent * (1 - cross), sent * cross
    if algorithm in ("hierarchical", "tree"):
        local = {"all-reduce": ("reduce-scatter", "all-gather"), "all-gather": ("all-gather",),
                 "reduce-scatter": ("reduce-scatter",)}.get(op, (op,))
        return (sum(busbw_factor(o, g) for o in local) * size_bytes,
                busbw_factor(op, big_n) * size_bytes / g)
    return sent * (g - 1) / g, sent / g


def axis_path(mesh: Mesh, placement, cluster: ClusterSpec, axis: str) -> Path:
    """Path of ``axis``'s collectives when all its groups run at once (SPMD).

    Inside one node (or NVLink domain): the fabric's per-GPU bandwidth. Across nodes: on
    each node, every group with members there sends its ring traffic out through its
    members' affine NICs; per-rank bandwidth = min(fabric, NIC bandwidth of the NICs used on
    the node / groups leaving the node), taken at node 0. For all-to-all, each rank's own
    NIC share: its NIC's rate / the node-0 ranks of all the axis's groups that use that NIC,
    the smallest over group 0's members on node 0 (the link-load model's per-NIC sharing,
    :func:`meshplan.schedule.linkload.edge_loads`). Latency scales are the link's per-step
    latency over :data:`~meshplan.comm.alphabeta.REFERENCE_STEP_S`.
    """
    return groups_path(mesh.groups(axis), placement, cluster)


def groups_path(groups: np.ndarray, placement, cluster: ClusterSpec) -> Path:
    """:func:`axis_path` of any set of rank groups (n_groups, size) that run at once: an
    axis's, or the KV replica groups inside tp (:func:`meshplan.mesh.tpsplit.kv_replica_groups`)."""
    if groups.shape[1] == 1:
        return Path("local", float("inf"), "no peers")
    node = placement.node[groups]
    fabric = cluster.node.fabric
    if (placement.domain[groups] == placement.domain[groups][:, :1]).all():
        return Path("nvlink", fabric.bandwidth_bytes_per_s, fabric.name, fabric.latency_s / REFERENCE_STEP_S["nvlink"],
                    calibrated=fabric.calibrated)
    nics = cluster.node.nics
    tier = cluster.network[0].latency_s / REFERENCE_STEP_S["network"] if cluster.network else 1.0
    calibrated = bool(cluster.network) and cluster.network[0].calibrated
    if not nics:
        return Path("network", cluster.node.pcie.bandwidth_bytes_per_s, "no NIC in catalog: PCIe bound", tier,
                    calibrated=cluster.node.pcie.calibrated)
    n0 = int(node[0, 0])
    on_node = np.flatnonzero((node == n0).any(axis=1))
    members = groups[on_node][node[on_node] == n0]
    used = sorted({int(i) for i in placement.nic[members] if i >= 0})
    nic_bw = sum(nics[i].bandwidth_bytes_per_s for i in used)
    bw = min(fabric.bandwidth_bytes_per_s, nic_bw / len(on_node))
    rails = np.unique(placement.rail[groups[0]])
    users = Counter(int(i) for i in placement.nic[members] if i >= 0)
    own = [int(i) for i in placement.nic[groups[0][node[0] == n0]] if i >= 0]
    share = min((nics[i].bandwidth_bytes_per_s / users[i] for i in own), default=0.0)
    return Path("network", bw, f"{len(on_node)} group(s) per node share NIC(s) "
                f"{','.join(nics[i].name for i in used)}; rails {rails.tolist()}", tier,
                len(np.unique(node[0])), int((node[0] == n0).sum()), share, calibrated)


def path_time(op: str, n: int, size_bytes: float, path: Path, cluster: ClusterSpec,
              nccl_era: str = "current") -> tuple[str, float]:
    """(algorithm, seconds) of ``op`` over ``n`` ranks on a ``size_bytes`` buffer (nccl-tests
    ``S``) along ``path`` (:func:`axis_path`) of ``cluster``:
    :func:`meshplan.comm.alphabeta.collective_time` with the path's bandwidth, kind, latency
    scale, nodes and NIC share, and the cluster's fabric, library and measured curves. The
    one call behind every table row and the predicted message curves of ``validate``
    (:mod:`meshplan.runtime.validation.staged`). ``nccl_era`` "2021": NCCL 2.8-2.9, the
    library of DeepSpeed ZeRO-3 of 2021, without the hierarchical algorithm."""
    return collective_time(op, n, size_bytes, path.bandwidth_bytes_per_s, path.kind, nvls=cluster.node.fabric.nvls,
                           latency_scale=path.latency_scale, nodes=path.nodes,
                           intra_bandwidth_bytes_per_s=cluster.node.fabric.bandwidth_bytes_per_s,
                           library=cluster.collective_library, curves=cluster.node.busbw,
                           nic_bandwidth_bytes_per_s=path.nic_bandwidth_bytes_per_s,
                           ranks_per_node=path.ranks_per_node, nccl_era=nccl_era, calibrated=path.calibrated)


def collective_table(model: ModelSpec, training: TrainingSpec, mesh: Mesh, cluster: ClusterSpec,
                     placement, stage_layers: list[int], micro_batches: int,
                     first_stage: bool = True, last_stage: bool = True,
                     loss_parallel: bool = True, stage: int = 0, vpp: int = 1,
                     schedule: Schedule = Schedule.ONE_F_ONE_B,
                     chunks: Optional[list[list[int]]] = None,
                     grad_bucket_elements: Optional[int] = None,
                     deepspeed_prefetch: Optional[tuple[int, int]] = None) -> list[CollectiveRow]:
    """Rows for pipeline stage ``stage`` holding ``stage_layers`` (layer indices) in ``vpp``
    chunks (``chunks``: the layers of each; default ``vpp`` equal runs of ``stage_layers``),
    run under ``schedule`` with ``micro_batches`` micro-batches; ``grad_bucket_elements``: DDP's
    bucket cap (``[memory] grad_bucket_elements``; None: torch's default, :func:`_ddp_rows`);
    ``deepspeed_prefetch``: DeepSpeed ZeRO-3's (prefetch, max live) bytes
    (:meth:`~meshplan.spec.memory.MemoryOptions.deepspeed_prefetch_bytes`; None: DeepSpeed's defaults)."""
    rows: list[CollectiveRow] = []
    paths: dict[str, Path] = {}

    def add(axis, phase, op, size, dtype, per_mb, cadence, waits="", depth=1, per_step=None, ranks=None,
            list_copies=False, groups=None, copy_s=0.0, ds_gpu_s=0.0, ds_host_s=None):
        # ranks: rank 0's group, a subset of axis's; groups: every group of a named set that is
        # no mesh axis (KV replicas), rank 0's in ranks; ds_gpu_s / ds_host_s: DeepSpeed ZeRO-3's
        # GPU seconds added to the call and host seconds (instead of the list's) per call
        n = mesh.degree(axis) if ranks is None else len(ranks)
        if n <= 1 or size <= 0 or (per_mb == 0 and not per_step):
            return
        path = paths.setdefault(axis if groups is None else (axis, tuple(ranks)),
                                axis_path(mesh, placement, cluster, axis) if groups is None
                                else groups_path(groups, placement, cluster))
        ds = list_copies or ds_host_s is not None
        alg, t = path_time(op, n, size, path, cluster, nccl_era="2021" if ds else "current")
        host = 0.0
        if list_copies:  # torch 2021's list-based all_gather / reduce_scatter: n views and n copies
            data = kernel_data(cluster.gpu.name)
            t += deepspeed.list_copy_seconds(n, size, data)
            host = deepspeed.host_seconds(n, data)
        t += ds_gpu_s
        host = host if ds_host_s is None else ds_host_s
        rows.append(CollectiveRow(mesh.display_name(axis), phase, op, n, mesh.world // n,
                                  tuple(mesh.group_of(0, axis) if ranks is None else ranks), float(size), dtype, per_mb,
                                  per_step if per_step is not None else per_mb * micro_batches,
                                  cadence, path, t, waits, depth, alg, per_mb / max(len(stage_layers), 1), host,
                                  copy_s))

    if chunks is None:
        per = max(len(stage_layers) // vpp, 1)
        chunks = [stage_layers[k * per:(k + 1) * per] for k in range(vpp)]
    chunk_of = {i: k for k, ls in enumerate(chunks) for i in ls}
    ctx = _Ctx(model=model, training=training, mesh=mesh, layers=stage_layers, first=first_stage, last=last_stage,
               gpu=cluster.gpu, stage=stage, vpp=vpp, schedule=schedule, micro=micro_batches, chunk_of=chunk_of,
               loss_parallel=loss_parallel, bucket_elements=grad_bucket_elements,
               deepspeed_prefetch=deepspeed_prefetch or MemoryOptions().deepspeed_prefetch_bytes(training))
    for axis in TABLE_ORDER + tuple(a for a in AXES if a not in TABLE_ORDER):
        build = AXES[axis].rows or LAYER_ROWS.get(axis)
        if build is not None:
            build(add, ctx)
    return rows


@dataclass(frozen=True)
class _Ctx:
    model: ModelSpec
    training: TrainingSpec
    mesh: Mesh
    layers: list[int]
    first: bool
    last: bool
    gpu: GPUSpec  # the GPU the compute-stream copies run on (FSDP2)
    stage: int = 0
    vpp: int = 1
    schedule: Schedule = Schedule.ONE_F_ONE_B
    micro: int = 1
    chunk_of: Optional[dict] = None  # layer -> local chunk
    loss_parallel: bool = True
    bucket_elements: Optional[int] = None  # [memory] grad_bucket_elements (DDP's bucket cap)
    deepspeed_prefetch: Optional[tuple[int, int]] = None  # DeepSpeed ZeRO-3's (prefetch, max live) bytes

    @property
    def runs(self) -> int:
        """Pipeline schedule runs per step (``training.pp_schedule_runs`` with pp > 1, else 1)."""
        return self.training.pp_schedule_runs if self.mesh.degree("pp") > 1 else 1

    @property
    def seq_local(self) -> int:
        """Tokens of a sequence on one rank: s / cp, the sequence as the registered axes split
        it (:func:`meshplan.compute.shapes.local_split`)."""
        return self.training.seq_len // local_split(self.mesh)[Dim.SEQUENCE]

    @property
    def act_bytes(self) -> int:
        """TP activation buffer b * s/cp * h in compute dtype."""
        t = self.training
        return t.micro_batch * self.seq_local * self.model.hidden * dtype_bytes(t.compute_dtype)


def _tp_layer_ops(c: _Ctx, layer: int) -> tuple[list[str], list[str]]:
    """(forward, backward) tp collectives of one layer, forward in issue order (backward: the
    forward's mirror, then Megatron's re-gathers with SP); ``+``: the
    routed outputs' all-gather (no SP). Full recompute replays the forward up to the layer's
    last saved tensor: all but its last collective, or all when the layer ends in the routed
    experts (SP, no shared experts: the gate multiply saves the combine's output). torchtitan's
    op-level AC (``recompute = "op"``, planned with SP) saves the reduce-scatters' outputs but not
    the all-gathers' (``_save_list`` of torchtitan's llama3 ``parallelize``), so its recompute
    replays the forward's all-gathers (the inputs of the recomputed wk and w3 and of every
    column-parallel weight gradient)."""
    sp, m = c.mesh.sequence_parallel, c.model
    part = ["all-gather", "reduce-scatter"] if sp else ["all-reduce"]
    moe = m.is_moe_layer(layer)
    fwd = part + (["all-gather+"] if moe and not sp else []) + (part if not moe or m.shared_experts else [])
    mirror = {"all-gather": "reduce-scatter", "reduce-scatter": "all-gather", "all-reduce": "all-reduce",
              "all-gather+": "all-gather"}
    bwd = [mirror[o] for o in fwd]
    if sp and c.training.framework == "megatron" and not get_schedule(c.schedule).splits_backward:
        # Megatron-LM saves only the sequence shard of a column-parallel linear's input and
        # all-gathers it again for the weight gradient: the attention's and a dense MLP's
        # (schedule/layer_timeline._block_backward; not where B and W are separate units)
        bwd += ["all-gather"] * (1 if moe else 2)
    if c.training.layer_recomputed(c.layers.index(layer)):
        bwd += fwd if moe and sp and not m.shared_experts else fwd[:-1]
    elif c.training.recompute == "op" and sp:
        bwd += [o for o in fwd if o == "all-gather"]
    return [o.rstrip("+") for o in fwd], [o.rstrip("+") for o in bwd]


#: Cadence of the tp all-gathers that move float8 (:func:`meshplan.compute.dtensor_sp.float8_tp`).
FLOAT8_TP_CADENCE = "every layer (SP, float8 tensorwise: torchao casts before the all-gather)"


#: Cadence of the per-step all-reduce of the float8 weights' amaxes (``fp8_all_gather``), which
#: torchao's ``precompute_float8_dynamic_scale_for_fsdp`` issues after the optimizer step, over
#: fsdp and, under TP, again over tp (:func:`meshplan.compute.float8.precompute_all_reduces`).
FLOAT8_PRECOMPUTE_CADENCE = "once per step (float8 amax of every float8 weight, precompute_float8_dynamic_scale_for_fsdp)"
#: Cadence of the tp all-reduces of float8 amaxes (:func:`_float8_amax_rows`).
FLOAT8_AMAX_CADENCE = "every float8 cast of a tp shard (torchao tensorwise: the amax, all-reduced max)"
#: Bytes of one amax all-reduce: torchao's ``amax_to_scale`` upcasts the Partial amax to float64
#: before the ``clamp`` at which DTensor redistributes it (eab345c ``float8_utils.py``; size not
#: checked in a trace: latency-bound either way).
FLOAT8_AMAX_BYTES = 8


def _float8_amax_rows(add, c: _Ctx) -> None:
    """The tp all-reduces of the amaxes of the float8 casts of tp shards under torchao's float8
    TP (:func:`meshplan.compute.float8.tp_amax_per_layer`: 4 forward, 7 backward per Llama layer,
    weights gathered in float8): ``tensor_to_amax``'s ``torch.max(torch.abs(x))`` of a Shard
    DTensor is a Partial max, all-reduced before the scale; the cast waits for it (eab345c
    ``float8_scaling_utils.hp_tensor_to_float8_dynamic``). A recomputed layer (full, per-layer or
    op-level AC) replays its forward casts' all-reduces (op-level AC saves ``aten.max``'s output,
    not the collective's). One scalar each (:data:`FLOAT8_AMAX_BYTES`)."""
    fwd = bwd = 0
    for k, i in enumerate(c.layers):
        if c.model.is_moe_layer(i):
            continue
        names = frozenset(x.name for x in c.model.layer_tensors(i) if c.training.float8_linear(x))
        f, b = float8.tp_amax_per_layer(names, c.training.fp8_all_gather)
        replay = c.training.layer_recomputed(k) or c.training.recompute == "op"
        fwd, bwd = fwd + f, bwd + b + (f if replay else 0)
    for phase, n in (("forward", fwd), ("backward", bwd)):
        add("tp", phase, "all-reduce", FLOAT8_AMAX_BYTES, "fp64", n, FLOAT8_AMAX_CADENCE, "the float8 cast")


#: Cadence of Megatron-LM 2022's coalesced all-reduce of the SP norm gradients (one per step).
SP_NORM_COALESCED_CADENCE = "once per step (Megatron SP norm and row-parallel bias gradients, coalesced)"


def _replicated_grad_rows(add, c: _Ctx, size: int, count: int, cadence: str) -> None:
    """All-reduce over tp of ``count`` Partial gradients of weights replicated over tp (SP
    norms, an MoE router): in FSDP2's gradient reduction (once per step under a pipeline
    schedule), else at each of AdamW's 3 reads (measured, torch 2.13)."""
    dt = c.training.compute_dtype
    if c.training.sharding in ("zero3", "hsdp") and c.mesh.degree("fsdp") > 1:
        pipelined = c.mesh.degree("pp") > 1
        add("tp", "backward", "all-reduce", size, dt, 0 if pipelined else count, cadence, "optimizer step", depth=0,
            per_step=count if pipelined else None)
    else:
        add("tp", "step", "all-reduce", size, dt, 0, cadence + ", 3 per optimizer step (no FSDP)",
            "optimizer step", depth=0, per_step=3 * count)


def _mla_grad_rows(add, c: _Ctx) -> None:
    """Multi-head latent attention under tp > 1, torchtitan's DeepSeek-V3 plan
    (``models/deepseek_v3/infra/parallelize.py``): the down projections ``wq_a`` and ``wkv_a``
    and the latent norms ``q_a_norm`` and ``kv_a_norm`` are replicated (``NoParallel``) and
    the attention's intermediates stay DTensors, so the gradients reaching them are Partial
    over tp and stay Partial: no activation collective beyond dense attention's, but each
    of those weights gets a Partial gradient, all-reduced over tp as the SP norms' are
    (:func:`_replicated_grad_rows`), one all-reduce per weight per layer, its numel in
    compute dtype, with or without SP. DeepSeek-V2-Lite (no query compression) at tp 2,
    bf16: ``wkv_a`` 2048 x (512 + 64) x 2 B = 2,359,296 B and ``kv_a_norm`` 512 x 2 B =
    1,024 B per layer. Measured with torch 2.13 on the fake process group
    (:mod:`meshplan.runtime.execution.mla`, ``tests/test_mla_tp.py``). ``training.framework =
    "megatron"``: Megatron-Core's MLA splits its own way (not modelled here, no rows)."""
    if not c.model.is_mla or c.mesh.degree("tp") == 1 or c.training.framework != "torch":
        return
    for t in c.model.mla_tensors():
        if t.split == "replicated":
            _replicated_grad_rows(add, c, t.numel * dtype_bytes(c.training.compute_dtype), len(c.layers),
                                  f"every layer (MLA {t.name} weight gradient)")


#: Cadence of the all-reduce that keeps the copies of a replicated KV head equal.
KV_REPLICA_CADENCE = "once per step, every layer (replicated KV heads: wk/wv gradients summed over their copies)"


def kv_replica_grad_numel(model: ModelSpec, training: TrainingSpec, mesh: Mesh) -> int:
    """Elements of one layer's K/V gradient buffer that a rank all-reduces over its KV
    replica group when tp > kv_heads (:func:`_kv_replica_rows`): the rank's local gradient of
    every ``kv_column`` tensor (wk, wv and their biases; one KV head, ``head_dim`` rows each),
    flattened into one buffer; under FSDP2 (zero3, hsdp) the local shard of each, the
    largest (rank 0's: ``ceil(rows / fsdp)`` rows, :func:`~meshplan.mesh.tpsplit.padded_numel`).
    0 when no KV head is replicated.

    Handed case C6 (h 4096, 32 q / 4 KV heads of 128, tp 8): wk and wv of 128 x 4096 each,
    2 x 524,288 = 1,048,576 elements; with dp_shard 2 under FSDP2, half of it:

    >>> m = ModelSpec(layers=1, hidden=4096, ffn=1, q_heads=32, kv_heads=4, head_dim=128, vocab=1)
    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> mesh = resolve_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[2, 8]), world=16)
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="none")
    >>> kv_replica_grad_numel(m, t, mesh), kv_replica_grad_numel(m, t.model_copy(update={"sharding": "zero3"}), mesh)
    (1048576, 524288)
    """
    tp = mesh.degree("tp")
    if local_heads(model, tp)[2] == 1:
        return 0
    fsdp = mesh.degree("fsdp") if training.sharding in ("zero3", "hsdp") else 1
    kv = [t for t in model.layer_tensors(0) if t.split == "kv_column"]
    return sum(padded_numel(local_rows(t, model, tp), local_numel(t, model, tp), fsdp) // fsdp for t in kv)


def _kv_replica_rows(add, c: _Ctx) -> None:
    """KV heads replicated past ``kv_heads`` (tp > kv_heads, handed case C6): the ``r = tp /
    kv_heads`` tp ranks holding copies of one KV head (:func:`~meshplan.mesh.tpsplit.kv_replica_groups`)
    each get the gradient of their own q heads only, so the copies drift apart unless their
    gradients are summed: once per step, after the gradient reduction over the data axes and
    before the optimizer, one all-reduce (sum) per layer of the layer's flattened wk/wv (and
    bias) gradients (:func:`kv_replica_grad_numel`) over the replica group, in the gradient
    dtype ``training.grad_dtype`` (the buffer is the reduced gradient the optimizer reads, as
    the tied-embedding all-reduce's). Once per step, not per micro-batch: the sum is linear,
    so summing the accumulated gradient equals summing each micro-batch's. As bigcode's
    Megatron-LM does for multi-query attention (PR 39, ``reduce_model_grads``: without it
    the loss was 3.74 against 2.64) and HF transformers' KV replication group (PR 47811);
    the runtime: :class:`meshplan.runtime.execution.kvsync.KVReplicaSync`."""
    numel = kv_replica_grad_numel(c.model, c.training, c.mesh)
    if not numel:
        return
    groups = kv_replica_groups(c.mesh, c.model)
    g = c.training.grad_dtype
    rank0 = tuple(int(x) for x in groups[np.flatnonzero((groups == 0).any(axis=1))[0]])
    add(KV_REPLICA, "step", "all-reduce", numel * dtype_bytes(g), g, 0, KV_REPLICA_CADENCE, "optimizer step",
        depth=0, per_step=len(c.layers), ranks=rank0, groups=groups)


def _tp_rows(add, c: _Ctx, loss_parallel: bool) -> None:
    first, last, dt = int(c.first), int(c.last), c.training.compute_dtype
    act = c.act_bytes
    counts: Counter[tuple] = Counter()
    f8 = "fp8" if float8_tp(c.model, c.training, c.mesh.sequence_parallel) else ""  # float8 all-gathers counted apart
    for i in c.layers:
        fwd, bwd = _tp_layer_ops(c, i)
        counts.update(("forward", o, f8 if o == "all-gather" else "") for o in fwd)
        counts.update(("backward", o, f8 if o == "all-gather" else "") for o in bwd)
    act8 = act // dtype_bytes(dt)  # the same values in float8
    moe = sum(c.model.is_moe_layer(i) for i in c.layers)
    if c.mesh.sequence_parallel:
        # Megatron-LM 2022 (2755bcb megatron/mpu/layers.py VocabParallelEmbedding.forward:
        # reduce_from_tensor_model_parallel_region, then language_model.py Embedding.forward:
        # scatter_to_sequence_parallel_region, a split) all-reduces the embedding's output and
        # keeps its shard; torch's SequenceParallel embedding reduce-scatters it
        embed_ar = first if c.training.framework == "megatron" else 0
        add("tp", "forward", "all-gather", act, dt, counts["forward", "all-gather", ""] + last, "every layer (SP)",
            "next column-parallel GEMM")
        add("tp", "forward", "all-gather", act8, "fp8", counts["forward", "all-gather", "fp8"], FLOAT8_TP_CADENCE,
            "next column-parallel GEMM")
        add("tp", "forward", "reduce-scatter", act, dt, counts["forward", "reduce-scatter", ""] + first - embed_ar,
            "every layer (SP)", "residual add")
        add("tp", "forward", "all-reduce", act, dt, embed_ar, "every micro-batch (Megatron embedding, SP)",
            "embedding's sequence split")
        # Megatron-LM also gathers the output layer's input again in its backward (mpu/layers.py
        # LinearWithGradAccumulationAndAsyncCommunication, parallel_lm_logits), for its wgrad
        regather_head = last if c.training.framework == "megatron" else 0
        add("tp", "backward", "all-gather", act, dt, counts["backward", "all-gather", ""] + first + regather_head,
            "every layer (SP)", "next weight-gradient GEMM")
        add("tp", "backward", "all-gather", act8, "fp8", counts["backward", "all-gather", "fp8"], FLOAT8_TP_CADENCE,
            "next weight-gradient GEMM")
        add("tp", "backward", "reduce-scatter", act, dt, counts["backward", "reduce-scatter", ""] + last,
            "every layer (SP)", "previous layer's backward")
        if f8:
            _float8_amax_rows(add, c)
        per_norm = 2 if c.model.norm == "layernorm" else 1
        norms = per_norm * (2 * len(c.layers) + last)
        if c.training.framework == "megatron":
            # Megatron-LM 2755bcb optimizer.py allreduce_layernorm_grads: the main gradients of
            # every sequence_parallel parameter (the norms' weights and biases and, set by
            # mpu/layers.py RowParallelLinear, its bias: compute.megatron.stage_param_tensors)
            # flattened into one buffer, one all-reduce over tp per step, copied back (the
            # flatten and copies: compute.megatron_cost.megatron_step_cost in the optimizer step)
            g = c.training.grad_dtype
            shared = sum(n for _, n, sp in stage_param_tensors(c.model, c.mesh.degree("tp"), 0, list(c.layers), False,
                                                               bool(last), 1) if sp)
            add("tp", "step", "all-reduce", shared * dtype_bytes(g), g, 0,
                SP_NORM_COALESCED_CADENCE, "optimizer step", depth=0, per_step=1)
        else:
            _replicated_grad_rows(add, c, c.model.hidden * dtype_bytes(dt), norms, "every norm (SP weight gradients)")
    else:
        add("tp", "forward", "all-reduce", act, dt, counts["forward", "all-reduce", ""] + first, "every layer",
            "next layer's GEMMs")
        add("tp", "backward", "all-reduce", act, dt, counts["backward", "all-reduce", ""] + last, "every layer",
            "previous layer's backward")
        add("tp", "forward", "all-gather", act, dt, counts["forward", "all-gather", ""], "every MoE layer (routed "
            "outputs of each rank's tokens)", "residual add")
        add("tp", "backward", "all-gather", act, dt, counts["backward", "all-gather", ""], "every MoE layer (input "
            "gradients of each rank's tokens)", "previous layer's backward")
    if moe and c.mesh.degree("tp") > 1:  # each tp rank routes its own tokens through the replicated router
        _replicated_grad_rows(add, c, c.model.experts * c.model.hidden * dtype_bytes(dt), moe,
                              "every MoE layer (router weight gradient)")
    _mla_grad_rows(add, c)
    _kv_replica_rows(add, c)
    if not c.last:
        return
    b, s = c.training.micro_batch, c.training.seq_len // c.mesh.degree("cp")
    if loss_parallel:
        add("tp", "loss", "all-reduce", b * s * 4, "fp32", 3, "every micro-batch (vocab-parallel loss)", "loss")
    else:
        v = padded_vocab(c.model.vocab, c.training.vocab_pad_divisor, c.mesh.degree("tp"))
        add("tp", "forward", "all-gather", b * s * v * dtype_bytes(dt), dt, 1, "every micro-batch (logits)", "loss")


def _units(c: _Ctx, shards: dict[str, int]) -> list[tuple[str, str, int, int, int, int, float]]:
    """FSDP units of the stage as (label, axis, unsharded elements per rank incl. padding,
    local chunk, all-gather bytes, float8 weights, seconds of their pre-all-gather casts); the
    root's chunk is the first (embedding) or the last (output layer); under a V-shaped schedule
    stage 0 holds both, each chunk module its own FSDP root. All-gather bytes: each weight in
    ``training.gather_dtype`` (float8 Linear weights beside compute-dtype norms and
    embeddings in one buffer under ``fp8_all_gather``); the casts: torchao's
    ``fsdp_pre_all_gather`` of each float8 weight's local shard
    (:func:`meshplan.compute.float8.pre_all_gather_seconds`)."""
    m, mesh, t = c.model, c.mesh, c.training
    tp, ep, etp = mesh.degree("tp"), mesh.ep, mesh.etp
    pad = t.sharding in ("zero3", "hsdp")
    data, pb = kernel_data(c.gpu.name), dtype_bytes(t.param_dtype)

    def numel(x, axis):
        return fsdp_padded_numel(x, m, shards[axis], tp, ep, etp) if pad else local_numel(x, m, tp, ep, etp)

    def unit(label, axis, tensors, chunk):
        n = [numel(x, axis) for x in tensors]
        f8 = [k // shards[axis] for k, x in zip(n, tensors) if t.gather_dtype(x) == "fp8"]
        cast = float8.pre_all_gather_seconds(f8, pb, data, c.gpu.hbm_bandwidth_bytes_per_s) if f8 else 0.0
        return (label, axis, sum(n), chunk, sum(k * dtype_bytes(t.gather_dtype(x)) for k, x in zip(n, tensors)),
                len(f8), cast)

    out = []
    for i in c.layers:
        ts = m.layer_tensors(i)
        k = (c.chunk_of or {}).get(i, 0)
        out.append(unit("layer", "fsdp", [x for x in ts if not x.expert], k))
        if any(x.expert for x in ts):
            out.append(unit("experts", "efsdp", [x for x in ts if x.expert], k))
    v = padded_vocab(m.vocab, t.vocab_pad_divisor, tp)
    emb = m.embedding_tensors(v) if c.first else []
    head = [x for x in (m.head_tensors(v) if c.last else []) if not (x.tied and c.first)]
    one_module = c.first and c.last and c.vpp == 1  # pp 1: both ends in one chunk module
    if one_module and (m.tied_embeddings or not t.torchtitan_units):
        # tied (torchtitan: one unit of the three), or Megatron and DeepSpeed: one root unit
        out.append(unit("root (embedding/norm/output)", "fsdp", emb + head, 0))
    elif t.torchtitan_units or c.first and c.last:
        # torchtitan's units at every pp (TrainingSpec.torchtitan_units): the embedding on the
        # stage holding it (chunk 0), [norm, output] on the stage holding them (its last chunk);
        # otherwise a V, whose stage 0 holds both in two chunk modules (two FSDP roots)
        out += [unit("root (embedding)", "fsdp", emb, 0), unit("root (norm/output)", "fsdp", head, c.vpp - 1)]
    else:
        out.append(unit("root (embedding/norm/output)", "fsdp", emb + head, 0 if c.first else c.vpp - 1))
    return [u for u in out if u[2] > 0]


def kept_gathered(label: str, t, tied: bool = False) -> bool:
    """Whether the FSDP unit ``label`` stays gathered from its forward to its backward
    whatever ``reshard_after_forward`` says: the root, or under torchtitan's units
    (:attr:`~meshplan.spec.training.TrainingSpec.torchtitan_units`) the unit holding the
    output layer; the embedding's own unit reshards as a layer unless ``tied`` (torchtitan's
    tied branch reshards the ends after forward only under ``"always"``, on the first pipeline
    stage too). With ``training.reshard_head_after_forward`` (torchtitan's ``"always"``) no unit
    is kept: each reshards as a layer.

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16)
    >>> [kept_gathered(u, t) for u in ("layer", "root (embedding)", "root (norm/output)")]
    [False, False, True]
    >>> kept_gathered("root (norm/output)", t.model_copy(update={"reshard_head_after_forward": True}))
    False
    """
    if not label.startswith("root") or t.reshard_head_after_forward:
        return False
    return not t.torchtitan_units or label != "root (embedding)" or tied


def _deepspeed_copied(c: _Ctx, units: list, label: str, gathered: int) -> tuple[int, int]:
    """(forward, backward) bytes DeepSpeed ZeRO-3 (``zero3_engine = "deepspeed"``, edaa722) copies
    out of one all-gather of the unit ``label`` of ``gathered`` bytes, on its all-gather stream
    (:func:`meshplan.comm.fsdp2.compute_stream_copies`): only the part its coordinator prefetched,
    ``torch.cat`` in ``AllGatherCoalescedHandle.wait`` (``partition_parameters.py:750-784``); the
    rest is gathered parameter by parameter (``_all_gather_sequential``, :1339-1376), the
    parameters views of the buffer, no copy. The prefetched part is
    :func:`~meshplan.spec.memory.deepspeed_copied_bytes` after a layer's fetch (a layer precedes
    every layer, the head in forward and the embedding in backward: ``held`` the largest
    ``"layer"`` unit), as the memory model holds it; none for the embedding's unit in forward,
    the step's first fetch, which nothing before it prefetched (the memory model's too)."""
    held = max((u[4] for u in units if u[0] == "layer"), default=0)
    copied = deepspeed_copied_bytes(gathered, c.deepspeed_prefetch, held) if c.deepspeed_prefetch else gathered
    return (0 if label.startswith("root (embedding") else copied), copied


def _dp_rows(add, c: _Ctx) -> None:
    t, mesh = c.training, c.mesh
    shards = {"fsdp": mesh.degree("fsdp"), "efsdp": mesh.degree("efsdp")}
    ag, rs = t.compute_dtype, t.gradient_reduce_dtype
    if t.sharding == "zero3" and t.zero3_engine == "deepspeed-2021":
        _deepspeed_rows(add, c)
        return
    if t.sharding in ("zero3", "hsdp"):
        data, hbm = kernel_data(c.gpu.name), c.gpu.hbm_bandwidth_bytes_per_s
        grad_b, red_b = fsdp2.copy_in_element_bytes(t)  # unsharded gradients, reduce-scatter input

        ds = t.sharding == "zero3" and t.zero3_engine == "deepspeed"  # its copies on its collectives' streams
        if ds:  # the gradient into DeepSpeed's bucket, in the reduce dtype
            grad_b, red_b = dtype_bytes(t.compute_dtype), dtype_bytes(rs)

        pipelined = mesh.degree("pp") > 1
        units = _units(c, shards)

        def copies(gathered: int, numel: int) -> tuple[float, float]:
            # FSDP2's copy-out after each all-gather and copy-in before each reduce-scatter, on the
            # compute stream (meshplan.comm.fsdp2); Megatron FSDP's GEMMs use its buckets in place;
            # DeepSpeed's ZeRO-3 copies on its reduce stream (its copy-out: _deepspeed_copied)
            if not (fsdp2.compute_stream_copies(t) or ds):
                return 0.0, 0.0
            return (fsdp2.copy_out_seconds(gathered, data, hbm),
                    fsdp2.copy_in_seconds(numel, grad_b, red_b, data, hbm))

        for (label, axis, numel, gbytes, fp8, cast_s), n in Counter(u[:3] + u[4:] for u in units).items():
            root = kept_gathered(label, t, c.model.tied_embeddings)
            cadence = f"per {label}" if label.startswith("root") else f"every {label}"
            gdt = ag if not fp8 else "uint8" if gbytes != numel else "fp8"  # FSDP2: mixed dtypes in a byte buffer
            per_step = _pipelined_gathers(c, root, [u[3] for u in units if u[:3] == (label, axis, numel)]) \
                if pipelined else _accumulation_gathers(c, root, n)
            fwd = _per_microbatch(per_step[0], n, c.micro, pipelined) if per_step is not None else (n, None)
            back = _per_microbatch(per_step[1], n, c.micro, pipelined) if per_step is not None \
                else (0 if root or not t.reshard_after_forward else n, None)
            # pp: one reduce-scatter per unit per schedule run (PipelineStage.perform_reduce_grad)
            red = (0, n * c.runs) if pipelined or t.grad_accumulation != "sync" else (n, None)
            out_s, in_s = copies(gbytes, numel)
            on_compute = (0.0, 0.0) if ds else (out_s, in_s)  # copy_s: the compute stream's
            on_stream = (0.0, in_s) if ds else (0.0, 0.0)  # ds_gpu_s: added to the collective's time
            ds_out = [fsdp2.copy_out_seconds(b, data, hbm) for b in _deepspeed_copied(c, units, label, gbytes)] \
                if ds else [0.0, 0.0]  # (forward, backward)
            # the float8 weights' pre-all-gather casts on FSDP2's copy-in stream delay each all-gather
            add(axis, "forward", "all-gather", gbytes, gdt, fwd[0], cadence, f"the {label}'s GEMMs", 7,
                per_step=fwd[1], copy_s=on_compute[0], ds_gpu_s=ds_out[0] + cast_s)
            add(axis, "backward", "all-gather", gbytes, gdt, back[0], cadence,
                f"the {label}'s backward", 7, per_step=back[1], copy_s=on_compute[0], ds_gpu_s=ds_out[1] + cast_s)
            add(axis, "backward", "reduce-scatter", numel * dtype_bytes(rs), rs, red[0], cadence, "optimizer step",
                per_step=red[1], copy_s=on_compute[1], ds_gpu_s=on_stream[1])
            if "dp_replicate" in mesh.layout.names:
                add("dp_replicate", "backward", "all-reduce", numel // shards[axis] * dtype_bytes(rs), rs, red[0],
                    cadence + " (HSDP replicas)", "optimizer step", per_step=red[1])
        amax = sum(u[5] for u in units if u[1] == "fsdp")
        for dim in float8.precompute_all_reduces(mesh.degree("tp")):  # Partial over fsdp, and over tp under TP
            add(dim, "step", "all-reduce", amax * 4, "fp32", 0, FLOAT8_PRECOMPUTE_CADENCE, "next step's forward",
                depth=0, per_step=1)
        return
    if t.sharding in ("zero1", "zero2") and t.zero12_engine == "deepspeed":
        deepspeed_zero12.bucket_rows(add, t, "fsdp", _registration_numels(c), mesh.degree("fsdp"),
                                     MemoryOptions(grad_bucket_elements=c.bucket_elements).deepspeed_bucket_elements())
        return
    by_axis: Counter[str] = Counter()
    for _, axis, numel, *_ in _units(c, shards):
        by_axis[axis] += numel
    for axis, numel in by_axis.items():
        if t.overlap_grad_reduce and t.sharding in ("none", "zero1"):  # Megatron-LM's DDP buffers: bucketed
            _megatron_bucket_rows(add, c, axis, numel)
        elif t.sharding in ("zero1", "zero2"):
            if t.sharding == "zero1":
                add(axis, "step", "reduce-scatter", numel * dtype_bytes(rs), rs, 0, "once per step", "optimizer step",
                    per_step=1)
            else:
                _zero2_rows(add, c, axis, numel)
            add(axis, "step", "all-gather", numel * dtype_bytes(t.param_dtype), t.param_dtype, 0,
                "once per step (updated params)", "next step's forward", per_step=1)
        elif t.framework == "megatron":  # Megatron-LM 2022's local DDP: one all-reduce of its contiguous buffer
            add("loss" if axis == "fsdp" else axis, "backward", "all-reduce", numel * dtype_bytes(rs),
                rs, 0, "once per step (DDP, one bucket: Megatron-LM's contiguous buffer)", "optimizer step",
                per_step=1)
        else:
            _ddp_rows(add, c, axis)


#: Cadence mark of the bucketed reductions of Megatron-LM's DDP buffers under
#: ``training.overlap_grad_reduce`` (:func:`_megatron_bucket_rows`); "(DDP" places them as DDP's
#: buckets in the rank timeline (:func:`meshplan.schedule.grad_reduce.reduce_pieces`).
MEGATRON_BUCKET_CADENCE = "(DDP buffer bucket"


def _megatron_bucket_rows(add, c: _Ctx, axis: str, numel: int) -> None:
    """Megatron-LM's DDP buffers under ``--overlap-grad-reduce`` (``training.overlap_grad_reduce``,
    sharding none or zero1): the stage's ``numel`` gradient elements over ``axis`` in buckets of
    ``B`` = :meth:`~meshplan.spec.memory.MemoryOptions.bucket_elements` of the data-parallel
    degree (``max(40e6, 1e6 x dp)``: ``DistributedDataParallel.__init__``, NVIDIA/Megatron-LM
    d98e8a6 ``megatron/core/distributed/distributed_data_parallel.py`` lines 131-137), ``numel // B``
    of ``B`` and one of the rest (Megatron closes a bucket at the first whole parameter that
    reaches ``B``: ``_compute_default_per_buffer_param_layout``, so each holds up to one
    parameter more). Each is reduced once per step, in the last micro-batch's backward, when its
    gradients are all ready (``register_grad_ready``): an all-reduce (none) or a reduce-scatter
    (zero1, the distributed optimizer), then zero1 all-gathers the updated parameters bucket by
    bucket. E.g. 2.2e9 elements at dp 8: 55 buckets of 4e7."""
    t, rs = c.training, c.training.gradient_reduce_dtype
    bucket = MemoryOptions(grad_bucket_elements=c.bucket_elements).bucket_elements(c.mesh.degree("fsdp"))
    full, rest = divmod(numel, bucket)
    sizes = [(n, k) for n, k in ((bucket, full), (rest, 1 if rest else 0)) if k]
    how = f"{full + (1 if rest else 0)} buckets {MEGATRON_BUCKET_CADENCE} {bucket:,} elements, --overlap-grad-reduce)"
    for size, k in sizes:
        if t.sharding == "zero1":
            add(axis, "step", "reduce-scatter", size * dtype_bytes(rs), rs, 0, f"once per step, {k} of {how}",
                "optimizer step", per_step=k)
        else:
            add("loss" if axis == "fsdp" else axis, "backward", "all-reduce", size * dtype_bytes(rs), rs, 0,
                f"once per step, {k} of {how}", "optimizer step", per_step=k)
    for size, k in sizes if t.sharding == "zero1" else []:
        add(axis, "step", "all-gather", size * dtype_bytes(t.param_dtype), t.param_dtype, 0,
            f"once per step (updated params), {k} of {how}", "next step's forward", per_step=k)


#: Cadence mark of ZeRO-2's per-micro-batch bucket reduce-scatters (:func:`_zero2_rows`).
ZERO2_CADENCE = "(ZeRO-2 bucket"


def _zero2_rows(add, c: _Ctx, axis: str, numel: int) -> None:
    """ZeRO-2's gradient reduce-scatters of the stage's ``numel`` gradient elements over
    ``axis`` in one micro-batch: ``numel // B`` buckets of ``B`` elements and one of the rest,
    ``B`` = :meth:`~meshplan.spec.memory.MemoryOptions.bucket_elements` of the fsdp degree (the
    bucket the memory model holds during every backward). Issued in every micro-batch's
    backward as each bucket fills; e.g. 8.03e9 elements, B 5e8: 16 of 5e8 and 1 of 3e7."""
    bucket = MemoryOptions(grad_bucket_elements=c.bucket_elements).bucket_elements(c.mesh.degree("fsdp"))
    full, rest = divmod(numel, bucket)
    rs = c.training.gradient_reduce_dtype
    for size, k in ((bucket, full), (rest, 1 if rest else 0)):
        add(axis, "backward", "reduce-scatter", size * dtype_bytes(rs), rs, k,
            f"every micro-batch, {k} of {full + (1 if rest else 0)} buckets {ZERO2_CADENCE} {bucket:,} elements, "
            f"issued as it fills)", "optimizer step")


#: torch DDP's bucket caps (torch 2.13 ``torch/nn/parallel/distributed.py``: ``bucket_cap_mb``
#: default 25 MiB, ``dist._DEFAULT_FIRST_BUCKET_BYTES`` 1 MiB for the first bucket when the cap
#: is the default).
DDP_BUCKET_BYTES = 25 * 2 ** 20
DDP_FIRST_BUCKET_BYTES = 2 ** 20


def ddp_buckets(sizes_bytes: list[int], cap_bytes: int, first_cap_bytes: int) -> list[int]:
    """Bytes of each gradient bucket when tensors of ``sizes_bytes`` (in gradient-ready order)
    fill buckets as torch's reducer does (``compute_bucket_assignment_by_size``): whole tensors
    are added to the open bucket, which closes once it holds at least its cap, the first bucket's
    ``first_cap_bytes``, every later one's ``cap_bytes``.

    >>> ddp_buckets([4, 600, 300, 300, 300, 10], 500, 100)
    [604, 600, 310]
    """
    out: list[int] = []
    cur = 0
    for b in sizes_bytes:
        cur += b
        if cur >= (first_cap_bytes if not out else cap_bytes):
            out.append(cur)
            cur = 0
    return out + ([cur] if cur else [])


def _ddp_rows(add, c: _Ctx, axis: str) -> None:
    """DDP's gradient all-reduces of the stage in steady state: one per bucket, issued in the
    backward as each bucket fills (torch's reducer, after the first step's rebuild in
    gradient-ready order; the table takes that order as the reverse of the parameters'). The
    bucket cap is ``[memory] grad_bucket_elements`` x the reduce dtype's bytes, for the first
    bucket too; by default torch's 25 MiB, the first 1 MiB (:func:`ddp_buckets`). One row per
    bucket size, ``per_step`` buckets of that size (micro-batches before the last run under
    ``no_sync``). torch's very first step sends one bucket of every gradient (its initial
    bucketing with ``find_unused_parameters=False``); ``validate`` records that step and sets
    the bucket to the whole model to match it."""
    m, mesh, rs = c.model, c.mesh, c.training.gradient_reduce_dtype
    b, tp = dtype_bytes(rs), mesh.degree("tp")
    sizes = [local_numel(x, m, tp, mesh.ep, mesh.etp) * b for x in reversed(_registered(c))
             if x.expert == (axis == "efsdp")]
    if c.bucket_elements is None:
        cap, first = DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES
    else:
        cap = first = c.bucket_elements * b
    buckets = ddp_buckets([x for x in sizes if x > 0], cap, first)
    how = (f"{c.bucket_elements:,} elements" if c.bucket_elements is not None else "torch's 25 MiB, the first 1 MiB")
    for size, k in sorted(Counter(buckets).items(), key=lambda kv: -kv[1]):
        add("loss" if axis == "fsdp" else axis, "backward", "all-reduce", size, rs, 0,
            f"per step, {k} of {len(buckets)} buckets (DDP, bucket cap {how})", "optimizer step", per_step=k)


def _registered(c: _Ctx) -> list:
    """The stage's parameter tensors (:class:`~meshplan.spec.model.Tensor`) in registration
    order: the embedding (first stage), the layers, the head (last stage; a tied output layer
    on the embedding's stage is the embedding)."""
    m = c.model
    v = padded_vocab(m.vocab, c.training.vocab_pad_divisor, c.mesh.degree("tp"))
    ts = (m.embedding_tensors(v) if c.first else []) + [x for i in c.layers for x in m.layer_tensors(i)]
    return ts + [x for x in (m.head_tensors(v) if c.last else []) if not (x.tied and c.first)]


def _registration_numels(c: _Ctx) -> list[int]:
    """Local elements of each of the stage rank's parameters in registration order, as the
    model code holds them (:func:`_deepspeed_params`: Megatron-LM's fused QKV under
    ``framework = "megatron"``): the order DeepSpeed ZeRO-1/2 flattens them in
    (:mod:`meshplan.comm.deepspeed_zero12`)."""
    if c.training.framework == "megatron":
        parts = [([], c.first, False), (list(c.layers), False, False), ([], False, c.last)]
        return [k for layers, first, last in parts for _, k in _deepspeed_params(c, layers, first, last)]
    mesh = c.mesh
    return [local_numel(x, c.model, mesh.degree("tp"), mesh.ep, mesh.etp) for x in _registered(c)]


def _deepspeed_params(c: _Ctx, layers: list[int], first: bool, last: bool) -> list[tuple[str, int]]:
    """(name, local elements) of the parameter tensors of ``layers`` (and the root's on the
    first / last stage) as the model code holds them: Megatron-LM's (fused QKV,
    :func:`~meshplan.compute.megatron.stage_param_tensors`) under ``framework = "megatron"``,
    else one per :class:`~meshplan.spec.model.Tensor`."""
    m, mesh, t = c.model, c.mesh, c.training
    tp = mesh.degree("tp")
    v = padded_vocab(m.vocab, t.vocab_pad_divisor, tp)
    if t.framework == "megatron":
        return [(n, k) for n, k, _ in stage_param_tensors(m, tp, v // tp, layers, first, last, mesh.degree("pp"))]
    ts = [x for i in layers for x in m.layer_tensors(i)]
    ts += (m.embedding_tensors(v) if first else []) + [x for x in (m.head_tensors(v) if last else [])
                                                        if not (x.tied and first)]
    return [(x.name, local_numel(x, m, tp, mesh.ep, mesh.etp)) for x in ts]


def _deepspeed_rows(add, c: _Ctx) -> None:
    """DeepSpeed ZeRO-3 of 2021 (:mod:`meshplan.comm.deepspeed`): per micro-batch one
    all-gather per gathered parameter tensor in forward, its re-gathers in backward (each timed
    with the ``n`` list copies; its host time with the zero fill the host waits for), and one
    all-reduce per gradient bucket, over the data-parallel group; one row per (phase, op,
    size), ``per_microbatch`` its calls. The root (embedding, positions, final norm, an untied
    output layer) is gathered once in forward and once in backward; a tied output layer
    reuses the embedding's weight (one more forward gather at the logits, kept for their
    backward). Once per step the optimizer step gathers the persistent parameters again."""
    t, mesh = c.training, c.mesh
    n, data = mesh.degree("fsdp"), kernel_data(c.gpu.name)
    later = 0
    calls: Counter = Counter()
    for k, i in reversed(list(enumerate(c.layers))):
        params = _deepspeed_params(c, [i], False, False)
        for name, numel in params:
            fwd, bwd, _ = deepspeed.layer_calls(params, t.layer_recomputed(k), 2 * later)[name]
            size = deepspeed.padded(numel, n)
            calls[("layer", "forward", "all-gather", size)] += fwd
            calls[("layer", "backward", "all-gather", size)] += bwd
        later += sum(x for _, x in params)
    tied = c.model.tied_embeddings and c.first and c.last
    root = _deepspeed_params(c, [], c.first, c.last)
    for name, numel in root:
        size, gathered = deepspeed.padded(numel, n), numel >= deepspeed.PERSISTENCE_THRESHOLD
        extra = 1 if tied and name in ("embedding", "word_embedding") else 0
        calls[("root", "forward", "all-gather", size)] += gathered * (1 + extra)
        calls[("root", "backward", "all-gather", size)] += gathered
    ag = t.compute_dtype
    for (unit, phase, op, size), count in sorted(calls.items(), key=lambda kv: (kv[0][0] != "layer", kv[0][1:])):
        label = "root (embedding/norm/output)" if unit == "root" else "layer"
        add("fsdp", phase, op, size * dtype_bytes(ag), ag, count,
            f"{deepspeed.CADENCE}, every {label}, list of {n} outputs/inputs)", f"the {label}'s GEMMs", 7,
            list_copies=True, ds_host_s=deepspeed.host_seconds(n, data)
            + deepspeed.zero_fill_seconds(size * dtype_bytes(ag), data))
    _deepspeed_grad_rows(add, c, root, data)
    persistent = [k for i in c.layers for _, k in _deepspeed_params(c, [i], False, False)
                  if k < deepspeed.PERSISTENCE_THRESHOLD]
    persistent += [k for _, k in root if k < deepspeed.PERSISTENCE_THRESHOLD]
    if persistent:  # _post_step: all of them at once, synchronously, their n x p copies issued one by one
        p = t.param_dtype
        add("fsdp", "step", "all-gather", sum(deepspeed.padded(k, n) for k in persistent) * dtype_bytes(p), p, 0,
            f"once per step (DeepSpeed ZeRO-3 persistent parameters, {len(persistent)} tensors gathered in the "
            f"optimizer step, list of {n} outputs)", "the next step's forward", 1, per_step=1, list_copies=True,
            ds_host_s=deepspeed.persistent_gather_host_seconds(persistent, n, data))


def _deepspeed_grad_rows(add, c: _Ctx, root: list[tuple[str, int]], data) -> None:
    """DeepSpeed ZeRO-3 of 2021's gradient all-reduces per micro-batch
    (:func:`meshplan.comm.deepspeed.grad_buckets`): the stage's gradients in the order the
    backward produces them (the final norm's and an untied output layer's, the layers' from
    the last, each layer's parameters from its last, then the embeddings': a tied word
    embedding's gradient is complete only there), bucketed by ``reduce_bucket_size`` (``[memory]
    grad_bucket_elements``, default 5e8); a bucket is the layer's when most of its elements are
    a layer's, else the root's. One row per (unit, bucket elements, tensors, the module whose
    gradient flushes it: :func:`meshplan.comm.deepspeed.flush_modules`, where the rank timeline
    places it). With
    ``training.contiguous_gradients`` the same buckets, each gradient reduce-scattered
    (:func:`_deepspeed_scatter_rows`)."""
    t = c.training
    tag = lambda unit, name: (unit, deepspeed.module_of(name))
    head = [(tag("root", name), k) for name, k in root if "embedding" not in name]
    embed = [(tag("root", name), k) for name, k in root if "embedding" in name]
    order = head[::-1] + [(tag("layer", name), k) for i in reversed(c.layers)
                          for name, k in reversed(_deepspeed_params(c, [i], False, False))] + embed[::-1]
    cap = MemoryOptions(grad_bucket_elements=c.bucket_elements).deepspeed_bucket_elements()  # reduce_bucket_size
    buckets = deepspeed.grad_buckets(order, cap)
    if t.contiguous_grads:
        _deepspeed_scatter_rows(add, c, buckets, cap, data)
        return
    rows: Counter = Counter()
    for bucket, flush in zip(buckets, deepspeed.flush_modules(buckets)):
        layer = sum(k for (unit, _), k in bucket if unit == "layer")
        total = sum(k for _, k in bucket)
        rows[("layer" if 2 * layer > total else "root", total, len(bucket), flush)] += 1
    g, n = t.gradient_reduce_dtype, c.mesh.degree("fsdp")
    for (unit, total, tensors, flush), count in sorted(rows.items()):
        label = "root (embedding/norm/output)" if unit == "root" else "layer"
        size = total * dtype_bytes(g)
        add("fsdp", "backward", "all-reduce", size, g, count,
            f"{deepspeed.CADENCE}, every {label}, gradient bucket of {tensors} flattened, reduce_bucket_size "
            f"{cap:,}, {deepspeed.FLUSHED}{flush})", "optimizer step", 1,
            ds_gpu_s=deepspeed.bucket_copy_seconds(size, data), ds_host_s=deepspeed.bucket_host_seconds(tensors, data))


def _deepspeed_scatter_rows(add, c: _Ctx, buckets: list, cap: int, data) -> None:
    """DeepSpeed ZeRO-3 of 2021's gradient reduce-scatters per micro-batch under
    ``contiguous_gradients`` (:mod:`meshplan.comm.deepspeed`): ``buckets`` (lists of (unit,
    module), elements), :func:`meshplan.comm.deepspeed.grad_buckets`) of ``cap`` elements, each
    gradient one list-based reduce-scatter of its padded size (the ``n`` list copies and
    views), the bucket's first one after the ipg buffer's ``div_``
    (:func:`~meshplan.comm.deepspeed.contiguous_gpu_seconds`), each one's copy into the buffer
    and slice kept on the compute stream (:func:`~meshplan.comm.deepspeed.contiguous_host_seconds`).
    One row per (unit, gradient elements, past the bucket, first of its bucket, flushing module)."""
    g, n = c.training.gradient_reduce_dtype, c.mesh.degree("fsdp")
    rows: Counter = Counter()
    for bucket, flush in zip(buckets, deepspeed.flush_modules(buckets)):
        for j, ((unit, _), k) in enumerate(bucket):
            rows[(unit, k, k > cap, j == 0, flush)] += 1
    for (unit, k, large, first, flush), count in sorted(rows.items()):
        label = "root (embedding/norm/output)" if unit == "root" else "layer"
        size, grad = deepspeed.padded(k, n) * dtype_bytes(g), k * dtype_bytes(g)
        how = "past the bucket, divided alone" if large else "copied into the bucket's buffer"
        add("fsdp", "backward", "reduce-scatter", size, g, count,
            f"{deepspeed.CADENCE}, every {label}, contiguous_gradients: {how}"
            f"{', first of its bucket' if first else ''}, reduce_bucket_size {cap:,}, list of {n} inputs, "
            f"{deepspeed.FLUSHED}{flush})",
            "optimizer step", 1, list_copies=True,
            ds_gpu_s=deepspeed.contiguous_gpu_seconds(grad, cap * dtype_bytes(g), large, first, data),
            ds_host_s=deepspeed.host_seconds(n, data) + deepspeed.contiguous_host_seconds(grad, large, first, data))


def _pipelined_gathers(c: _Ctx, root: bool, chunks: list[int]) -> tuple[int, int]:
    """(forward, backward) all-gathers per step of FSDP units of a pipeline stage, one unit in
    each local chunk of ``chunks``, as torch ``PipelineStage`` runs FSDP2
    (:func:`fsdp_gather_flags`). Counted per chunk: under interleaved 1F1B with
    ``reshard_after_forward`` the chunks' orders differ (pp 2, vpp 2, m 4, stage 0: chunk 0
    gathers 4 F + 1 B, chunk 1 3 F + 2 B). With ``training.pp_schedule_runs`` r, each of the r
    runs of ``micro / r`` micro-batches starts from sharded parameters (the previous run's
    ``perform_reduce_grad`` resharded them): r times one run's gathers."""
    flags = fsdp_gather_flags(c.schedule, c.mesh.degree("pp"), c.micro // c.runs, c.vpp, c.stage,
                              c.training.reshard_after_forward and not root)
    per = Counter((ch, k) for (ch, k, _), g in flags.items() if g)
    return c.runs * sum(per[(ch, "F")] for ch in chunks), c.runs * sum(per[(ch, "B")] for ch in chunks)


def _per_microbatch(count: int, n: int, micro: int, pipelined: bool) -> tuple[int, Optional[int]]:
    """``add``'s (per_mb, per_step) of a row of ``count`` calls per step of ``n`` units: (n,
    None) when it is ``n`` calls in every one of ``micro`` micro-batches (no_sync gathers as
    sync does), else (0, count): a row not issued alike in every micro-batch (no_sync_unsharded's
    forward, pipelined stages' gathers), which the table shows per step only."""
    return (n, None) if not pipelined and count == n * micro else (0, count)


def _accumulation_gathers(c: _Ctx, root: bool, n: int) -> Optional[tuple[int, int]]:
    """(forward, backward) all-gathers per step of ``n`` FSDP units of one kind with pp 1
    under ``training.grad_accumulation`` (None for ``sync``: ``n`` per micro-batch, the
    table's per-micro-batch rows). ``no_sync`` gathers as ``sync`` does (parameters are
    resharded after every backward); ``no_sync_unsharded`` keeps them gathered from a
    backward to the next forward, so only micro-batch 0's forward gathers, and backward
    gathers every micro-batch only when ``reshard_after_forward`` (never the root, which
    FSDP2 does not reshard after forward). The walk is :func:`fsdp_gather_flags` on pp 1.

    With m = 4 micro-batches, reshard_after_forward true, 3 layer units: ``no_sync``
    gathers (12, 12), ``no_sync_unsharded`` (3, 12), its root (1, 0).
    """
    mode = c.training.grad_accumulation
    if mode == "sync":
        return None
    flags = fsdp_gather_flags(c.schedule, 1, c.micro, 1, 0, c.training.reshard_after_forward and not root,
                              reshard_after_backward=mode == "no_sync")
    per = Counter(k for (_, k, _), g in flags.items() if g)
    return n * per["F"], n * per["B"]


def fsdp_gather_flags(schedule: Schedule, pp: int, micro: int, vpp: int, stage: int,
                      reshard: bool, reshard_after_backward: bool = False) -> dict[tuple[int, str, int], bool]:
    """Whether each F or B pass ``(chunk, kind, micro-batch)`` of stage ``stage`` all-gathers
    its chunk's FSDP units, as torch ``PipelineStage`` runs FSDP2 with pp > 1: gradient sync
    and reshard-after-backward are off for every backward but the last, so a unit stays
    gathered after a backward, is resharded after a forward when ``reshard`` (FSDP2's
    ``reshard_after_forward``; never the root), and is gathered whenever a pass finds it
    sharded. Walks :func:`meshplan.pipeline.simulate.stage_order`. ``reshard_after_backward``
    (pp 1, ``training.grad_accumulation = "no_sync"``): every backward but the last reshards.

    >>> f = fsdp_gather_flags("1f1b", 2, 3, 1, 0, reshard=False)
    >>> [k for k, g in f.items() if g]
    [(0, 'F', 0)]
    >>> f = fsdp_gather_flags("1f1b", 2, 3, 1, 0, reshard=True)  # F0 F1 B0 F2 B1 B2
    >>> [k for k, g in f.items() if g]  # F2 follows B0 (gathered); B1 follows F2 (resharded)
    [(0, 'F', 0), (0, 'F', 1), (0, 'B', 0), (0, 'B', 1)]
    """
    if micro * vpp <= _CACHED_PASSES:  # the search asks for the same few orders thousands of times
        return dict(_cached_gather_flags(schedule, pp, micro, vpp, stage, reshard, reshard_after_backward))
    return _gather_flags(schedule, pp, micro, vpp, stage, reshard, reshard_after_backward)


#: Largest ``micro x vpp`` whose gather flags :func:`fsdp_gather_flags` keeps (a copy is returned).
_CACHED_PASSES = 1024


def _gather_flags(schedule, pp, micro, vpp, stage, reshard, reshard_after_backward) -> dict:
    sharded = [True] * vpp
    out = {}
    for u in stage_order(schedule, pp, micro, vpp, stage):
        if u.kind not in ("F", "B"):
            continue
        out[(u.chunk, u.kind, u.mb)] = sharded[u.chunk]
        sharded[u.chunk] = reshard if u.kind == "F" else reshard_after_backward
    return out


_cached_gather_flags = lru_cache(maxsize=512)(_gather_flags)


def _pp_ep_rows(add, c: _Ctx) -> None:
    t, mesh, m = c.training, c.mesh, c.model
    dt = t.compute_dtype
    pp = mesh.degree("pp")
    if pp > 1:
        tp = mesh.degree("tp")
        sg = scatter_gather(t, mesh, c.act_bytes)
        sent = c.act_bytes / (tp if mesh.sequence_parallel or sg else 1)
        # one send per chunk whose next virtual stage is on another rank, one receive per chunk whose
        # previous one is (the schedule's chunk map: looped 2 vpp - first - last; a V turns locally on pp - 1)
        n = get_schedule(c.schedule).p2p_per_microbatch(pp, c.vpp, c.stage)
        add("pp", "forward", "send/recv", sent, dt, n, "every micro-batch per chunk boundary", "next stage's forward")
        add("pp", "backward", "send/recv", sent, dt, n, "every micro-batch per chunk boundary",
            "previous stage's backward")
        if sg:  # each receive is the 1/tp slice a tp peer also received: all-gathered over tp
            add("tp", "forward", "all-gather", c.act_bytes, dt, n, f"every {SCATTER_GATHER_CADENCE}",
                "the received chunk's forward")
            add("tp", "backward", "all-gather", c.act_bytes, dt, n, f"every {SCATTER_GATHER_CADENCE}",
                "the received chunk's backward")
        if m.tied_embeddings and (c.first or c.last) and not (c.first and c.last):  # first and last pp rank
            pp0 = mesh.group_of(0, "pp")
            add("pp", "step", "all-reduce", _tied_grad_bytes(c), t.grad_dtype, 0,
                "once per step (tied embedding gradients, first and last stage)", "optimizer step", depth=0,
                per_step=1, ranks=(pp0[0], pp0[-1]))
    if mesh.ep > 1:
        moe = sum(m.is_moe_layer(i) for i in c.layers)
        replayed = sum(m.is_moe_layer(i) and t.layer_recomputed(k) for k, i in enumerate(c.layers))
        tokens = t.micro_batch * c.seq_local * mesh.etp // mesh.degree("tp")  # see shapes
        ro = RoutingOptions.of(t)
        rows = routing(ro, max(1, tokens), m.top_k, m.experts, mesh.ep).recv_rows
        a2a = rows * m.hidden * dtype_bytes(dt)
        add("ep", "forward", "all-to-all", a2a, dt, 2 * moe, "every MoE layer (dispatch, combine)", "expert GEMMs")
        add("ep", "backward", "all-to-all", a2a, dt, 2 * moe + 2 * replayed, "every MoE layer", "expert GEMMs")
        if ro.dropless:  # the per-expert counts, no gradient (a replayed forward exchanges them again)
            _count_rows(add, c, moe, replayed)


def _count_rows(add, c: _Ctx, moe: int, replayed: int) -> None:
    """The dropless dispatch's count exchange, before each dispatch of ``moe`` MoE layers in
    forward and of the ``replayed`` ones again in backward; no gradient, none in the combine or
    the backward all-to-alls (they reuse the split sizes). torch (torchtitan's
    ``_token_count_exchange``, pytorch/torchtitan b5bcd76 ``torchtitan/models/common/token_dispatcher.py``
    lines 245-273): one ``all_to_all_single`` of the ``experts`` int64 counts over ep, ``experts / ep``
    to each peer: ``8 E`` bytes. Megatron-LM (``MoEAlltoAllTokenDispatcher.preprocess``,
    NVIDIA/Megatron-LM d98e8a6 ``megatron/core/transformer/moe/token_dispatcher.py`` lines 541-590):
    ``gather_from_sequence_parallel_region`` of the ``E`` counts over ``tp_ep_group``, the ep x etp
    ranks of one expert-data-parallel slot: an all-gather of ``8 E ep etp`` bytes (output); its
    drop-and-pad path (``--moe-pad-expert-input-to-capacity``, a capacity plan) exchanges nothing.
    A few hundred bytes to a few hundred KB: the comm model's latency term sets the time
    (:func:`path_time` on the group's path). The device-to-host copy of the split sizes that
    follows is not modelled."""
    m, mesh = c.model, c.mesh
    if c.training.framework != "megatron":
        add("ep", "forward", "all-to-all", m.experts * COUNT_BYTES, COUNT_DTYPE, moe, DROPLESS_COUNTS, "dispatch")
        add("ep", "backward", "all-to-all", m.experts * COUNT_BYTES, COUNT_DTYPE, replayed, DROPLESS_COUNTS,
            "the replayed dispatch")
        return
    names, grid = mesh.expert_grid()
    groups = grid_groups(grid, [names.index("ep"), names.index("etp")])
    rank0 = tuple(int(x) for x in groups[np.flatnonzero((groups == 0).any(axis=1))[0]])
    size = m.experts * COUNT_BYTES * len(rank0)
    add("ep", "forward", "all-gather", size, COUNT_DTYPE, moe, DROPLESS_COUNTS, "dispatch", ranks=rank0, groups=groups)
    add("ep", "backward", "all-gather", size, COUNT_DTYPE, replayed, DROPLESS_COUNTS, "the replayed dispatch",
        ranks=rank0, groups=groups)


#: Cadence of the dropless count exchange (:func:`_count_rows`); its elements' dtype and bytes.
DROPLESS_COUNTS = "every MoE layer (per-expert token counts, before the dispatch)"
COUNT_DTYPE, COUNT_BYTES = "int64", 8


#: Row builders of the axis families whose rows need this layer's FSDP units and gather flags,
#: the pipeline registry or the routing model (later layers than :mod:`meshplan.spec.axes`,
#: so not on their descriptors): tp (+SP, the loss, replicated weights' gradients), the data
#: axes (fsdp, efsdp, dp_replicate, DDP over ``loss``) and pp with ep. Every other axis's
#: rows come from its descriptor (:attr:`~meshplan.spec.axes.base.AxisDef.rows`: cp's).
LAYER_ROWS = {Axis.TP: lambda add, c: _tp_rows(add, c, c.loss_parallel), Axis.DP_SHARD: _dp_rows,
              Axis.PP: _pp_ep_rows}
#: The table lists these axes' rows first, in this order, then every other registered axis's
#: in the registry's order.
TABLE_ORDER = (Axis.TP, Axis.CP, Axis.DP_SHARD, Axis.PP)
#: The stage context a row builder reads (:data:`~meshplan.spec.axes.base.RowBuilder`).
StageContext = _Ctx


#: Cadence of the tp all-gather rebuilding a pp receive (read by the rank timeline's comm_kind).
SCATTER_GATHER_CADENCE = "pp receive, scatter/gather"


def scatter_gather(training: TrainingSpec, mesh: Mesh, act_bytes: int) -> bool:
    """Whether pipeline sends use Megatron-LM's scatter/gather: each of the tp ranks sends
    ``1/tp`` of the activation over the pp link and the receivers all-gather the slices over
    tp (NVLink inside a node): Megatron-LM 2022 ``_communicate``
    (``--scatter-gather-tensors-in-pipeline``, on by default) with tp > 1, without sequence
    parallelism (its activation is already split over tp) and when the activation's elements
    divide by tp (else it sends the whole tensor). torch's pipelining sends the whole tensor.
    """
    tp = mesh.degree("tp")
    elements = act_bytes // max(dtype_bytes(training.compute_dtype), 1)
    return training.framework == "megatron" and tp > 1 and not mesh.sequence_parallel and elements % tp == 0


def _tied_grad_bytes(c: _Ctx) -> int:
    """Bytes of one rank's gradient of a tied embedding copy (padded vocab x hidden split
    over tp, then dim 0 over fsdp under FSDP2: ``ceil(rows / fsdp)`` rows; a last shard of
    uneven rows is smaller) in the main-gradient dtype ``training.grad_dtype`` (Megatron-LM
    all-reduces the fp32 main gradients, like the data-parallel reduction beside it)."""
    t, mesh = c.training, c.mesh
    tp = mesh.degree("tp")
    emb = c.model.embedding_tensors(padded_vocab(c.model.vocab, t.vocab_pad_divisor, tp))[0]
    fsdp = mesh.degree("fsdp") if t.sharding in ("zero3", "hsdp") else 1
    return fsdp_padded_numel(emb, c.model, fsdp, tp) // fsdp * dtype_bytes(t.grad_dtype)
