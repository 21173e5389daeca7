"""Cluster specification: GPU, node (fabric, sockets, NICs) and network tiers.

Input fields carry human units in their names (``hbm_gb``, ``bandwidth_gb_per_s``,
``latency_us``); the properties without a unit suffix in the name (``hbm_bytes``,
``bandwidth_bytes_per_s``, ``latency_s``) are SI and are what the models use. Every
catalog entry has a ``source``.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from meshplan.spec.names import Name, Text
from meshplan.limits import BOUNDS, MAX_GPUS_PER_NODE, MAX_STRING, MAX_WORLD, over
from meshplan.units import GB, GBIT_PER_S, GiB, TB, TFLOPS, US

_STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, str_max_length=MAX_STRING)


def _le(name: str):
    """The stated bound of field ``name`` (:data:`meshplan.limits.BOUNDS`, reason there)."""
    return BOUNDS[name].value


class KernelFile(BaseModel):
    """A measured kernel table in kernels.toml form (``meshplan bench gemm/attention --grid``)
    laid over the catalog's data of its GPU for one run: ``path`` as the user gave it, its
    ``source`` line and its whole ``text`` (read once, at load; the compute model parses it,
    :func:`meshplan.compute.kernel_fragment.kernel_data`). Strings only, so that a GPU carrying
    it stays a pure value: the same text, the same kernel times."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    source: str
    text: str


class GPUSpec(BaseModel):
    """One accelerator. ``peak_tflops``: dense peak per dtype (no sparsity);
    ``max_gemm_fraction``: best measured GEMM throughput / peak (bf16), the ceiling of the
    compute model. ``kernels``: the user's measured kernel tables laid over the catalog's, in
    order (``--kernels``, a config's ``[kernels] files``; not a key of a GPU table, and left
    out of the dumped spec: the commands report it as their ``kernels`` entry). ``cuda_sm``: CUDA
    compute capability x 10 (90 for H100), as NCCL's topology dump writes ``<gpu sm=>``; 0 when
    not stated (a ``--topology`` XML of other GPUs then cannot be told apart). ``hbm_gb``: the
    datasheet's HBM, decimal GB (shown by ``catalog``); ``device_memory_gib``: the total the device
    runtime reports, GiB (``torch.cuda.get_device_properties(i).total_memory``, the "total capacity"
    of torch's out-of-memory message: a little below the HBM stacks' binary size, the driver keeps
    the rest); 0 when not published. :attr:`hbm_bytes` is the memory plans fit into."""

    model_config = _STRICT
    name: Name
    peak_tflops: dict[Name, float]
    hbm_gb: float = Field(gt=0, le=_le("hbm_gb"))
    hbm_bandwidth_tb_per_s: float = Field(gt=0, le=_le("hbm_bandwidth_tb_per_s"))
    sms: int = Field(gt=0, le=_le("sms"))
    cuda_sm: int = Field(default=0, ge=0, le=_le("cuda_sm"))
    device_memory_gib: float = Field(default=0, ge=0, le=_le("device_memory_gib"))
    max_gemm_fraction: float = Field(default=0.8, gt=0, le=1)
    source: Text
    kernels: tuple[KernelFile, ...] = Field(default=(), exclude=True)

    @model_validator(mode="after")
    def _peaks(self):
        bad = [(k, v) for k, v in self.peak_tflops.items() if not 0 < v <= _le("peak_tflops")]
        if bad:
            raise ValueError(f"peak_tflops.{bad[0][0]} = {bad[0][1]} must be > 0 and at most "
                             f"{_le('peak_tflops'):g} ({BOUNDS['peak_tflops'].reason})")
        return self

    @property
    def hbm_bytes(self) -> float:
        """Device memory a rank's memory must fit into, bytes: ``device_memory_gib`` x 2**30 where
        the catalog has the runtime's figure, else the datasheet's ``hbm_gb`` x 1e9.

        >>> g = dict(name="g", peak_tflops={"bf16": 312.0}, hbm_gb=80, hbm_bandwidth_tb_per_s=2.0, sms=108, source="-")
        >>> GPUSpec(**g).hbm_bytes, GPUSpec(**g, device_memory_gib=79.25).hbm_bytes   # 79.25 x 2**30
        (80000000000.0, 85094039552.0)
        """
        return self.device_memory_gib * GiB if self.device_memory_gib else self.datasheet_hbm_bytes

    @property
    def datasheet_hbm_bytes(self) -> float:
        """The datasheet's HBM, ``hbm_gb`` x 1e9 bytes (shown, not planned into)."""
        return self.hbm_gb * GB

    @property
    def hbm_bandwidth_bytes_per_s(self) -> float:
        return self.hbm_bandwidth_tb_per_s * TB

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``. Raises KeyError naming the known dtypes."""
        if dtype not in self.peak_tflops:
            raise KeyError(f"{self.name} has no peak for {dtype}; known: {sorted(self.peak_tflops)}")
        return self.peak_tflops[dtype] * TFLOPS


class LinkSpec(BaseModel):
    """A link class: per-GPU (or per-NIC) bandwidth in one direction and a per-step latency.
    ``nvls``: the switch reduces in-network (NVLink SHARP, third-generation NVSwitch).
    ``nccl_channels``: channels NCCL runs a collective on over this link (one thread block
    per channel, each holding one SM while it runs; the ``NCCL INFO Channel xx/NN`` lines);
    0: not known, and compute beside these collectives is not slowed
    (:mod:`meshplan.schedule.rank_timeline`). ``calibrated``: bandwidth and latency are the
    user's nccl-tests fit (:func:`meshplan.comm.calibration_apply.apply_calibration`), which
    :func:`meshplan.comm.nccl_algorithms.collective_time` never beats."""

    model_config = _STRICT
    name: Name
    bandwidth_gb_per_s: float = Field(gt=0, le=_le("bandwidth_gb_per_s"))
    latency_us: float = Field(ge=0, le=_le("latency_us"))
    nvls: bool = False
    nccl_channels: int = Field(default=0, ge=0)
    calibrated: bool = False
    source: Text = ""

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gb_per_s * GB

    @property
    def latency_s(self) -> float:
        return self.latency_us * US


class SocketSpec(BaseModel):
    """A CPU socket (NUMA node): its local GPUs (indices within the node) and cores."""

    model_config = _STRICT
    gpus: list[int] = Field(max_length=MAX_GPUS_PER_NODE)
    cores: int = Field(gt=0, le=_le("cores"))


class NICSpec(BaseModel):
    """A compute NIC: line rate, the GPUs sharing its PCIe switch, its socket and rail.
    In a rail-optimized fabric NIC k of every node connects to leaf (rail) ``rail``.
    ``name``: the device NCCL's IB transport selects (NCCL_IB_HCA, e.g. ``mlx5_0``);
    ``ifname``: the Linux IP interface that carries this NIC's TCP traffic (e.g. ``ib0``
    for IPoIB on ``mlx5_0``, ``eth2`` for an Ethernet port), None when not known: NCCL's
    socket transport selects IP interfaces (NCCL_SOCKET_IFNAME), never HCA names.
    ``transport``: the fabric the NIC speaks, ``"infiniband"`` (every catalog node's) or
    ``"roce"`` (RoCEv2 on Ethernet, which NCCL's IB verbs transport drives too); it changes no
    time: no public nccl-tests sweep over RoCEv2 was found, so a RoCE NIC is timed on the node's
    ``nic`` curve, measured on InfiniBand, read against its own line rate, and step says so
    (:func:`meshplan.comm.calibration_notes.roce_note`)."""

    model_config = _STRICT
    name: Name
    rate_gbit_per_s: float = Field(gt=0, le=_le("rate_gbit_per_s"))
    gpus: list[int] = Field(max_length=MAX_GPUS_PER_NODE)
    socket: int = Field(default=0, ge=0, le=MAX_GPUS_PER_NODE)
    rail: int = Field(ge=0, le=MAX_GPUS_PER_NODE)
    ifname: Optional[Name] = None
    transport: Literal["infiniband", "roce"] = "infiniband"

    #: Other names of a ``transport`` value (lower case, ``_-. +`` dropped; read by
    #: :func:`meshplan.config_errors.spelled`): an Ethernet NIC that NCCL drives is RoCE (RDMA over
    #: Converged Ethernet; NCCL's IB verbs transport), as NCCL's docs call it (newcomer trial nc61 #5).
    SPELLINGS: ClassVar[dict[str, dict[str, tuple[str, str, str]]]] = {"transport": {
        **dict.fromkeys(("ethernet", "eth", "rocev2", "rdma"), (
            "roce", "an Ethernet NIC that NCCL drives over RDMA, RoCEv2", 'transport = "roce"')),
        **dict.fromkeys(("ib", "ibverbs", "infiniband"), (
            "infiniband", "an InfiniBand HCA", 'transport = "infiniband"'))}}

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.rate_gbit_per_s * GBIT_PER_S


class NetworkTier(BaseModel):
    """One inter-node tier (rail/leaf, spine...): the per-step latency of an algorithm step
    whose path reaches this tier (not an increment to add per tier: NCCL uses one network
    figure per step), and the oversubscription ratio (1 = non-blocking). ``nodes_per_domain``: nodes under one switch of this tier (0 = all).
    ``calibrated``: the latency (and the NICs' rate) come from the user's nccl-tests fit, as
    :attr:`LinkSpec.calibrated`."""

    model_config = _STRICT
    name: Name
    latency_us: float = Field(ge=0, le=_le("latency_us"))
    oversubscription: float = Field(default=1.0, ge=1, le=1e3)
    nodes_per_domain: int = Field(default=0, ge=0, le=MAX_WORLD)
    calibrated: bool = False

    @property
    def latency_s(self) -> float:
        return self.latency_us * US


class BusbwCurve(BaseModel):
    """A measured nccl-tests bus-bandwidth curve of one link class: ``op`` over ``ranks`` ranks
    on ``nodes`` nodes, busbw (GB/s, nccl-tests' column) at each buffer size ``sizes_bytes``
    (the full buffer S, increasing), on links of ``line_gb_per_s`` per rank (the rate the
    measurement ran on: NVLink per direction, or the NIC rate the ranks shared), with its
    ``source``. ``rank_counts`` / ``rank_busbw_gb_per_s``: busbw at one large size for other
    rank counts (NVLS gains with the GPUs in the group), empty when busbw does not depend on
    them. How a time is read from it: :func:`meshplan.comm.alphabeta.measured_time` and
    :func:`~meshplan.comm.alphabeta.rank_factor`. ``calibrated``: the run a ``--calibration``
    fit came from (set by :func:`meshplan.comm.calibration_apply.apply_calibration`): read at every size
    at its fit's alpha (above the largest along its last segment, below the smallest latency-bound,
    never above the smallest logged time); every other curve, a calibrated class's scaled catalog
    curves included, is read as a catalog curve (:func:`meshplan.comm.nccl_algorithms.collective_time`).
    ``latency_us``: the per-call alpha of the run's own alpha-beta fit (``meshplan calibrate`` writes it
    with each logged curve); a curve read on its own run (a calibrated class's ``a2a`` or per-op curve)
    takes it in place of NCCL's latency; None for the catalog's curves and files of before it."""

    model_config = _STRICT
    sizes_bytes: list[int] = Field(min_length=1, max_length=1024)
    busbw_gb_per_s: list[float] = Field(min_length=1, max_length=1024)
    line_gb_per_s: float = Field(gt=0, le=_le("line_gb_per_s"))
    op: Literal["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send/recv"] = "all-reduce"
    ranks: int = Field(ge=2, le=MAX_WORLD)
    nodes: int = Field(default=1, ge=1, le=MAX_WORLD)
    rank_counts: list[int] = Field(default_factory=list, max_length=1024)
    rank_busbw_gb_per_s: list[float] = Field(default_factory=list, max_length=1024)
    source: Text = Field(min_length=1)
    calibrated: bool = False
    latency_us: Optional[float] = Field(default=None, ge=0, le=_le("latency_us"))

    @model_validator(mode="after")
    def _check(self):
        if len(self.rank_counts) != len(self.rank_busbw_gb_per_s):
            raise ValueError(f"{len(self.rank_counts)} rank_counts but {len(self.rank_busbw_gb_per_s)} busbw values")
        if self.rank_counts and (self.ranks not in self.rank_counts or sorted(set(self.rank_counts)) != self.rank_counts
                                 or min(self.rank_busbw_gb_per_s) <= 0):
            raise ValueError(f"rank_counts must increase, include ranks {self.ranks}, with positive busbw")
        if len(self.sizes_bytes) != len(self.busbw_gb_per_s):
            raise ValueError(f"{len(self.sizes_bytes)} sizes but {len(self.busbw_gb_per_s)} busbw values")
        if any(b <= a for a, b in zip(self.sizes_bytes, self.sizes_bytes[1:])) or self.sizes_bytes[0] <= 0:
            raise ValueError("sizes_bytes must be positive and increasing")
        if any(not 0 < b <= _le("busbw_gb_per_s") for b in self.busbw_gb_per_s + self.rank_busbw_gb_per_s):
            raise ValueError(f"busbw_gb_per_s must be positive and at most {_le('busbw_gb_per_s'):g} "
                             f"({BOUNDS['busbw_gb_per_s'].reason})")
        if self.sizes_bytes[-1] > 2 ** 50 or max(self.rank_counts, default=0) > MAX_WORLD:
            raise ValueError("sizes_bytes at most 2^50 (1 PiB) and rank_counts at most the world bound")
        return self


#: ``NodeSpec.busbw``'s keys: the link classes' curves, and a calibrated NVLink (or, on a node
#: without NICs, PCIe) class's per-op curves, ``"<class> <op>"``, each from the user's run of that op
#: (:func:`meshplan.comm.calibration_kinds.own_runs`).
CurveKey = Literal["nvlink", "nvls", "nic", "p2p", "nic1", "a2a",
                   "nvlink all-reduce", "nvlink all-gather", "nvlink reduce-scatter", "nvlink all-to-all",
                   "nvlink send/recv", "pcie all-reduce", "pcie all-gather", "pcie reduce-scatter", "pcie all-to-all",
                   "pcie send/recv"]


class NodeSpec(BaseModel):
    """A server: GPUs, the intra-node fabric, CPU sockets and NICs. ``busbw``: measured
    nccl-tests curves per link class (``nvlink`` ring, ``nvls`` all-reduce with NVLink SHARP,
    ``nic`` across nodes, ``p2p`` one GPU's send/recv pair through its own NIC to another
    node, ``nic1`` a ring or tree whose every rank is its node's only member of the group, so
    each drives one NIC, as a dp group beside tp 8, ``a2a`` the pairwise all-to-all across
    nodes: only a ``--calibration`` sets it, from the user's alltoall_perf run,
    :mod:`meshplan.comm.calibration_kinds`; ``nvlink <op>`` and ``pcie <op>`` likewise, a calibrated
    class's op from the user's run of it, :data:`CurveKey`); a class without one is timed at its line
    rate (``p2p``, ``nic1`` and ``a2a`` fall back to ``nic``, an op without its own curve to its class's). ``nvlinks_per_gpu``: NVLinks of one GPU,
    as ``nvidia-smi topo -m`` prints them between two GPUs of an NVSwitch node (``NV18`` on
    H100); 0 when not stated. A ``--topology`` keeps the ``nvlink``/``nvls`` curves only when
    its GPU-GPU links match it (:func:`meshplan.placement.topology_node.nvlink_difference`).
    ``host_memory_gb``: the node's CPU memory (GB = 1e9 B) from its datasheet, which DeepSpeed's
    ZeRO-Offload fills (:mod:`meshplan.memory.offload`); None when not stated (offload then
    refuses the node by name)."""

    model_config = _STRICT
    name: Name
    gpus: int = Field(gt=0, le=_le("gpus"))
    fabric: LinkSpec
    pcie: LinkSpec
    sockets: list[SocketSpec] = Field(max_length=MAX_GPUS_PER_NODE)
    nics: list[NICSpec] = Field(max_length=MAX_GPUS_PER_NODE)
    nvlink_domain_gpus: int = Field(default=0, ge=0, le=MAX_WORLD)
    nvlinks_per_gpu: int = Field(default=0, ge=0, le=_le("nvlinks_per_gpu"))
    busbw: dict[CurveKey, BusbwCurve] = Field(default_factory=dict)
    host_memory_gb: Optional[float] = Field(default=None, gt=0, le=1e6)
    source: Text = ""

    @model_validator(mode="after")
    def _check(self):
        seen = sorted(g for s in self.sockets for g in s.gpus)
        if seen != list(range(self.gpus)):
            raise ValueError(f"sockets must list each of the {self.gpus} GPUs once (got {seen})")
        for nic in self.nics:
            bad = [g for g in nic.gpus if not 0 <= g < self.gpus]
            if bad:
                raise ValueError(f"NIC {nic.name} lists GPUs {bad} outside 0..{self.gpus - 1}")
            if nic.socket >= len(self.sockets):
                raise ValueError(f"NIC {nic.name} socket {nic.socket} but only {len(self.sockets)} sockets")
        return self

    def socket_of(self, gpu: int) -> int:
        return next(i for i, s in enumerate(self.sockets) if gpu in s.gpus)

    def nic_of(self, gpu: int) -> Optional[int]:
        """Index of the NIC ``gpu`` uses: one of the NICs under its PCIe switch; when several
        GPUs share several NICs (DGX A100: GPUs 0-1 with mlx5_0 and mlx5_1) the i-th GPU of
        the switch takes the i-th NIC (round-robin), as NCCL gives each GPU its own NIC.
        Without such a NIC, the first NIC on its socket; None when the node has no NIC."""
        cands = [i for i, nic in enumerate(self.nics) if gpu in nic.gpus]
        if cands:
            peers = sorted({g for i in cands for g in self.nics[i].gpus})
            return cands[peers.index(gpu) % len(cands)]
        sock = self.socket_of(gpu)
        return next((i for i, n in enumerate(self.nics) if n.socket == sock), None)


class ClusterSpec(BaseModel):
    """``nodes`` identical nodes joined by ``network`` tiers (innermost first).
    ``collective_library``: NCCL chooses among ring, tree, NVLS and hierarchical algorithms;
    RCCL (AMD GPUs) is NCCL's fork with the same ring and tree algorithms and is timed as NCCL
    (github.com/ROCm/rccl README: RCCL implements NCCL's API with ring and tree algorithms;
    its own latency tuning for Infinity Fabric is not modelled); gloo (the CPU
    testbed) runs rings only."""

    model_config = _STRICT
    name: Text = "custom"  # free text: catalog systems are named "<nodes>x <node>"
    gpu: GPUSpec
    node: NodeSpec
    nodes: int = Field(gt=0, le=_le("nodes"))
    network: list[NetworkTier] = Field(default_factory=list, max_length=16)
    collective_library: Literal["nccl", "rccl", "gloo"] = "nccl"
    source: Text = Field(default="", max_length=8 * MAX_STRING)

    @model_validator(mode="after")
    def _world(self):
        if self.world > MAX_WORLD:
            raise ValueError(f"{self.nodes} nodes x {self.node.gpus} GPUs = {self.world} GPUs: "
                             f"{over('world', self.world)}")
        return self

    @property
    def world(self) -> int:
        return self.nodes * self.node.gpus
