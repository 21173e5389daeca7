"""The search's lookup tables for the step-time bound (:mod:`meshplan.search.timing`): op times by
workload key (:class:`TimeTables`: one :func:`~meshplan.compute.layer.layer_costs` call per distinct
(tp, cp, micro-batch, ep, etp, layer kind), its fields :data:`OP_FIELDS` and :data:`EXTRA_FIELDS`)
and collective times by (op, ranks, bytes, stride) on the path
:func:`~meshplan.comm.row.axis_path` gives each axis (:func:`coll_times`).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from meshplan.comm.row import CollectiveRow, axis_path, path_time
from meshplan.compute.embed_head import embedding_cost, head_cost
from meshplan.compute.layer import layer_costs
from meshplan.compute.ops import Workload
from meshplan.compute.kernel_choices import float8_gemms, framework_kernels
from meshplan.compute.routing import RoutingOptions
from meshplan.config import Config
from meshplan.mesh.resolve import resolved_mesh
from meshplan.placement.assign import place
from meshplan.schedule.layer_timeline import LAYER_BLOCKS
from meshplan.schedule.row_shares import nic_share
from meshplan.schedule.ring_timeline import cp_parts, step_seconds
from meshplan.search.memory import Tables, lookup
from meshplan.search.space import RECOMPUTE
from meshplan.spec.mesh import MeshSpec

#: The policies one layer's cost is asked for: per-layer AC (``layer``) and block recompute
#: (``block``) are asked as ``none`` and ``full`` (:func:`meshplan.search.columns.bound_recompute`).
UNIFORM = tuple(r for r in RECOMPUTE if r not in ("layer", "block"))


PHASES = {"f": ("forward", None), "bi": ("backward_input", None), "bin": ("backward_input", False),
          "br": ("backward_input", True), "bw": ("backward_weight", None)}


OP_FIELDS = tuple(f"{p}_{b}" for p in PHASES for b in LAYER_BLOCKS) + tuple(
    f"{p}_{x}" for x in ("cpq", "cps", "cpr") for p in PHASES if p != "bw")


EXTRA_FIELDS = ("emb_f", "emb_bw", "head_f", "head_b", "gemm_peak_s", "gemm_s")


class TimeTables:
    """Op times by workload key and collective paths by (stride, degree), each once."""

    def __init__(self, cfg: Config, tables: Tables):
        self.cfg, self.tables = cfg, tables
        self.world = cfg.cluster.world
        self.placement = place(cfg.cluster, self.world)
        self.domain_gpus = int((self.placement.domain == self.placement.domain[0]).sum())  # rank 0's NVLink domain
        self.ops = lru_cache(maxsize=None)(self._ops)
        self.shape = lru_cache(maxsize=None)(self._shape)
        self.path = lru_cache(maxsize=None)(self._path)
        self.coll = lru_cache(maxsize=None)(self._coll)
        self.nic = lru_cache(maxsize=None)(self._nic)

    def _shape(self, tp: int, cp: int, mb: int, ep: int, etp: int, layer: int) -> tuple[dict, dict]:
        """(layer ``layer``'s Cost by recompute policy of :data:`~meshplan.search.space.RECOMPUTE`,
        :func:`~meshplan.compute.layer.layer_costs`; the fields no policy changes: the embedding,
        the head and the GEMM totals, which count no recompute op) of one shape key."""
        cfg, m = self.cfg, self.cfg.model
        t, gpu = cfg.training, cfg.cluster.gpu
        w = Workload(seq_len=t.seq_len, micro_batch=mb, tp=tp, cp=cp, sp=tp > 1, ep=ep, etp=etp,
                     dtype=t.compute_dtype, recompute="none", recompute_modules=tuple(t.recompute_modules),
                     flash=t.flash_attention,
                     vocab_pad_divisor=t.vocab_pad_divisor, routing=RoutingOptions.of(t), **framework_kernels(t),
                     **float8_gemms(m, t), kv_expanded=cfg.memory.kv_expanded)
        costs = layer_costs(m, gpu, w, UNIFORM, layer=layer)
        emb, head = embedding_cost(m, gpu, w, cfg.cluster.node.pcie), head_cost(m, gpu, w)
        out = dict(emb_f=emb.seconds("forward"), emb_bw=emb.seconds("backward_weight"),
                   head_f=head.seconds("forward"), head_b=head.backward_s)
        # a policy only adds recompute ops: every policy's GEMMs are these, in this order
        gemms = [o for o in costs["none"].ops + head.ops if o.kind == "gemm" and not o.recompute]
        # each GEMM's seconds at the dense peak of its own dtype (float8 Linears: fp8's)
        at_peak = [o.hardware_flops / gpu.peak_flops(w.gemm_dtype(o.name)) for o in gemms]
        out.update(gemm_peak_s=sum(p for o, p in zip(gemms, at_peak) if o.block != "head"),
                   gemm_s=sum(o.seconds for o in gemms if o.block != "head"),
                   head_gemm_peak_s=sum(p for o, p in zip(gemms, at_peak) if o.block == "head"),
                   head_gemm_s=sum(o.seconds for o in gemms if o.block == "head"))
        return costs, out

    def _ops(self, tp: int, cp: int, mb: int, rc: int, ep: int, etp: int, layer: int) -> dict:
        """Op seconds of layer ``layer`` (0, or the first MoE layer) by field (module docstring)."""
        costs, shared = self.shape(tp, cp, mb, ep, etp, layer)
        cost = costs[RECOMPUTE[rc]]
        out = {f"{p}_{b}": cost.seconds(ph, b, rec) for p, (ph, rec) in PHASES.items() for b in LAYER_BLOCKS}
        # per phase (not the weight gradients'), the timeline's split of the attention (ring_timeline.cp_parts),
        # taken once: "cpq" the Q projection (input gradient in backward), all the CP K/V all-gather
        # (dK/dV reduce-scatter) may overlap; "cps" one of a ring's cp steps (SDPA call and ring kernels;
        # TE's ring: its longest step beside a send, ring_timeline.step_seconds),
        # which torch's K/V all-gather and each dK/dV shift run beside; "cpr" one step of a selective
        # recompute's replayed core forward, which Transformer Engine's p2p ring runs as its forward's
        # steps, each beside a K/V send (ring_timeline.ring_backward). With the sequence unsplit (cp 1)
        # there is no exchange and ``chains`` adds max(0 - x, 0) = 0 whatever x: not asked
        for p, (ph, rec) in PHASES.items():
            if p == "bw":
                continue
            parts = cp_parts(cost, ph, rec) if cp > 1 else {"q": 0.0, "sdpa": 0.0, "replay": 0.0, "steps": (), "replay_steps": ()}
            out.update({f"{p}_cpq": parts["q"], f"{p}_cps": step_seconds(parts, "sdpa", cp),
                        f"{p}_cpr": step_seconds(parts, "replay", cp)})
        out.update(shared)
        return out

    def _path(self, stride: int, degree: int):
        """:func:`~meshplan.comm.row.axis_path` of an axis of ``degree`` ranks ``stride``
        apart, on a three-axis mesh (outer, axis, inner) with the same groups."""
        outer = self.world // (stride * degree)
        mesh = resolved_mesh(MeshSpec(names=["outer", "axis", "inner"], shape=[outer, degree, stride]), self.world)
        return axis_path(mesh, self.placement, self.cfg.cluster, "axis")

    def _coll(self, op: str, n: int, size: int, stride: int) -> float:
        """Seconds of ``op`` over ``n`` ranks ``stride`` apart on a ``size``-byte buffer, as
        :func:`meshplan.comm.collectives.collective_table` times a row (``coll``: memoised,
        the pp groups of :func:`~meshplan.search.estimate.estimate` ask the same rows)."""
        if n <= 1 or size <= 0:
            return 0.0
        return path_time(op, n, size, self.path(stride, n), self.cfg.cluster)[1]

    def _nic(self, op: str, n: int, size: int, stride: int) -> float:
        """NIC seconds of the call :meth:`_coll` times: its seconds x the share of a NIC it holds
        alone (:func:`~meshplan.schedule.row_shares.nic_share` of the row the collective table builds:
        the same path, algorithm and time), i.e. its bytes through the NIC at the line rate, at most
        its seconds; 0 off the network. The rank timeline shares a NIC max-min among the network
        collectives running (:mod:`meshplan.schedule.nic_fair`, each at ``min(1, share / demand)``
        of its speed alone, the shares summing to at most 1), so collectives that all run inside
        an interval fit in it only if it is at least the sum of their NIC seconds."""
        if n <= 1 or size <= 0:
            return 0.0
        path = self.path(stride, n)
        alg, t = path_time(op, n, size, path, self.cfg.cluster)
        row = CollectiveRow(axis="axis", phase="", op=op, group_size=n, n_groups=1, example_ranks=(),
                            size_bytes=float(size), dtype="", per_microbatch=0, per_step=0, cadence="", path=path,
                            time_s=t, algorithm=alg)
        return nic_share(row) * t


def coll_times(tt: "TimeTables", op: str, n: np.ndarray, size: np.ndarray, stride: np.ndarray) -> np.ndarray:
    """Seconds of one ``op`` per candidate: :func:`meshplan.comm.nccl_algorithms.collective_time` (the
    algorithm NCCL would pick, as the collective table times it) on the path of an axis of
    ``n`` ranks ``stride`` apart, once per distinct (n, size, stride)."""
    return _per_call(tt.coll, op, n, size, stride)


def coll_nic_s(tt: "TimeTables", op: str, n: np.ndarray, size: np.ndarray, stride: np.ndarray) -> np.ndarray:
    """NIC seconds of one ``op`` per candidate (:meth:`TimeTables._nic`), at most
    :func:`coll_times`' seconds, once per distinct (n, size, stride)."""
    return _per_call(tt.nic, op, n, size, stride)


def _per_call(fn, op: str, n: np.ndarray, size: np.ndarray, stride: np.ndarray) -> np.ndarray:
    """``fn(op, n, size, stride)`` per candidate, once per distinct key; 0 where ``n <= 1`` or ``size <= 0``."""
    n, size = np.asarray(n, dtype=np.int64), np.asarray(size, dtype=np.int64)
    stride = np.broadcast_to(np.asarray(stride, dtype=np.int64), n.shape)
    out = lookup([n, size, stride], lambda k, b, st: {"t": fn(op, k, b, st)}, ("t",), dtype=np.float64)["t"]
    return np.where((n <= 1) | (size <= 0), 0.0, out)
