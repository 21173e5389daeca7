"""What an ``NCCL_DEBUG=INFO`` log says once read (:func:`meshplan.comm.nccl_log.parse_nccl_log`):
its communicators (:class:`Communicator`: ranks, rings, trees, connections), where each rank ran
(:class:`RankInfo`), each connection line (:class:`Connection`), the ``Init COMPLETE`` lines whose
communicator is unknown (:class:`UnreadInit`), and the whole (:class:`NcclLogReport`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Connection:
    """One ``Channel c/i : src[dev] -> dst[dev] [send|receive] via ...`` line. ``transport``
    is the first word of ``via`` (P2P, SHM, NET, COLLNET...); ``reporter`` the rank that
    printed it (the sender, or the receiver for ``[receive]``); for NET, ``nic`` is the
    reporter's device ``net_dev`` (None when its process listed fewer devices) and
    ``proxy_rank`` the PXN rank whose NIC carries it."""

    channel: int
    src: int
    dst: int
    direction: str
    via: str
    reporter: int
    nic: Optional[str] = None
    net_dev: Optional[int] = None
    proxy_rank: Optional[int] = None

    @property
    def transport(self) -> str:
        return self.via.split("/")[0]


@dataclass(frozen=True)
class RankInfo:
    """Where one rank of a communicator ran: host, pid, CUDA and NVML device, PCI bus id,
    and the NET devices its process listed (index order)."""

    rank: int
    host: str
    pid: int
    cuda_dev: int
    nvml_dev: Optional[int]
    bus_id: str
    net_devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator (all ranks sharing ``comm_id``). ``rings``: rank 0's ring per
    channel; ``ring_links[rank]``: (channel, prev, next); ``trees[rank]``: (channel, down,
    up); ``connections``: distinct connection lines; ``unattributed``: ``log:line (comm A or
    B)`` of each channel line that fits this and another communicator of its process alike
    (:mod:`meshplan.comm.nccl_log`), so its connections are not all known."""

    comm_id: str
    n_ranks: int
    n_nodes: Optional[int]
    ranks: dict[int, RankInfo]
    rings: tuple[tuple[int, ...], ...] = ()
    ring_links: dict[int, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    trees: dict[int, tuple[tuple[int, tuple[int, ...], int], ...]] = field(default_factory=dict)
    connections: tuple[Connection, ...] = ()
    unattributed: tuple[str, ...] = ()

    def transports(self, rank: int) -> dict[int, set[str]]:
        """Peer -> transports ``rank`` used with it (both directions)."""
        out: dict[int, set[str]] = {}
        for c in self.connections:
            if rank in (c.src, c.dst) and c.src != c.dst:
                out.setdefault(c.dst if c.src == rank else c.src, set()).add(c.transport)
        return out

    def net_nics(self, rank: int) -> set[str]:
        """NET devices ``rank``'s own network channels went through."""
        return {c.nic for c in self.connections if c.reporter == rank and c.nic}


@dataclass(frozen=True)
class UnreadInit:
    """An ``Init COMPLETE`` line whose communicator is unknown, so its process's rank is
    missing from it: ``where`` (``log:line``), the line's ``n_ranks`` (None when not
    readable) and ``why`` (with the fix)."""

    where: str
    n_ranks: Optional[int]
    why: str


@dataclass(frozen=True)
class NcclLogReport:
    """Communicators found in a log (in order of first appearance), the network NCCL chose,
    notes on lines that could not be attributed, the ``Init COMPLETE`` lines whose
    communicator is unknown (``unread``), and the log's name (``source``) for errors."""

    communicators: tuple[Communicator, ...]
    network: Optional[str] = None
    notes: tuple[str, ...] = ()
    source: str = "NCCL log"
    unread: tuple[UnreadInit, ...] = ()

    def largest(self) -> Communicator:
        """The communicator with the most ranks, first on ties (the world only when the log
        has a communicator of every rank: :func:`~meshplan.comm.nccl_check.world_ranks`)."""
        return max(self.communicators, key=lambda c: c.n_ranks)
