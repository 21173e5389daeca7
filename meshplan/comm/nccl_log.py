"""Read ``NCCL_DEBUG=INFO`` logs: which links and NICs each communicator really used.

Line formats (NVIDIA/nccl src/init.cc, graph/rings.cc, transport/p2p.cc, transport/net.cc,
transport/net_ib.cc), each after the prefix ``host:pid:tid [cudaDev] NCCL INFO``:

- ``comm 0x55d0c8a0 rank 0 nRanks 16 nNodes 2 localRanks 8 localRank 0 MNNVL 0``
- ``ncclCommInitRankConfig comm 0x55d0c8a0 rank 0 nranks 16 cudaDev 0 nvmlDev 0 busId 18000
  commId 0x7d2f3c1b8e4a9a10 - Init COMPLETE``: the commId (a hash of the unique id, printed
  ``0x%llx``) is common to all ranks of a communicator. As NCCL versions print it (init.cc):
  2.16-2.20 ``comm ... commId 0x.. - Init COMPLETE`` (nvmlDev from 2.18.3); 2.21-2.22 a
  function name first, splits ``ncclCommSplit comm .. parent 0x.. color c key k commId 0x..``;
  from 2.23 splits print no commId: ``parent 0x.. color c key k - Init COMPLETE`` (2.23),
  ``parent 0x.. splitCount n color c key k`` (2.24-2.29), ``... childCount n ...`` (2.30). A
  split is then known by its parent's communicator, the split count and the color (what NCCL
  hashes into the child's commHash): id ``<parent id>/split <n> color <c>``. Before 2.16 the
  line has no commId at all (``comm 0x.. rank r nranks n cudaDev d busId b - Init COMPLETE``)
  and communicators cannot be matched across processes: noted, not guessed.
- ``Channel 00/02 :    0   1   2   3`` (rank 0 only; at most 20 ranks are printed) and the
  old ``Ring 00 : 0 1 2 3``; ``Ring 00 : 7 -> 0 -> 1`` (prev -> rank -> next, subsystem
  GRAPH); ``Trees [0] 1/-1/-1->0->-1 [1] ...`` (down/down/down->rank->up).
- ``Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read`` (also ``P2P/IPC``, ``P2P/direct
  pointer``, ``SHM/direct/direct``), ``Channel 00/0 : 7[7] -> 15[7] [send] via
  NET/IB/7/GDRDMA`` printed by the sender and ``... [receive] via NET/IB/7/GDRDMA`` by the
  receiver: ``rank[nvmlDev]``; the number after ``NET/IB/`` indexes the process's device
  list, ``NET/IB/0(4)/...`` goes through rank 4's NIC (PXN).
- ``NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_3:1/IB ... ; OOB ibp26s0:10.1.0.1<0>`` (one per
  process: index -> device), ``Using network IB``.

Lines are attributed per process (host:pid) to its most recent communicator whose rank
matches the line (with NCCL_RUNTIME_CONNECT, connections are made at a communicator's first
collective; run with NCCL_RUNTIME_CONNECT=0 to keep each communicator's lines inside its
init). Other lines are ignored.

>>> log = '''h:1:1 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_3:1/IB ; OOB eth0:10.0.0.1<0>
... h:1:1 [0] NCCL INFO comm 0x1 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0
... h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/1/GDRDMA
... h:1:1 [0] NCCL INFO ncclCommInitRank comm 0x1 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 18000 \\
... commId 0xab - Init COMPLETE'''
>>> check_against_placement(parse_nccl_log(log), {0: "mlx5_0", 1: "mlx5_3"})
['comm 0xab (2 ranks): rank 0 used mlx5_3 but the placement meant mlx5_0']
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from meshplan.errors import ConfigError, printable
from meshplan.fileio import read_text_limited
from meshplan.limits import FILE_BYTES, MAX_LINE_CHARS, over

# Every regex is linear in the line (no lazy scan before an optional tail, no nested
# quantifiers over whitespace), numbers are ASCII and at most 9 digits (int() never meets
# Python's digit limit), and lines are bounded (MAX_LINE_CHARS).
_N = r"[0-9]{1,9}"
_PREFIX = re.compile(rf"^(?P<host>[^\s:\x00-\x1f\x7f]{{1,255}}):(?P<pid>{_N}):(?P<tid>{_N}) \[(?P<dev>{_N})\] NCCL INFO (?P<msg>.*)$")
_COMM = re.compile(rf"^comm (0x[0-9a-fA-F]+) rank ({_N}) nRanks ({_N}) nNodes ({_N}) localRanks ({_N}) localRank ({_N})")
_DONE = re.compile(rf"^(?:\w+ )?comm (0x[0-9a-fA-F]+) rank ({_N}) nranks ({_N}) cudaDev ({_N})(?: nvmlDev ({_N}))?"
                   rf" busId ([0-9a-fA-F]+)(?: parent (0x[0-9a-fA-F]+)(?: (?:splitCount|childCount) ({_N}))?"
                   rf" color (-?{_N}) key (-?{_N}))?(?: commId (0x[0-9a-fA-F]+))? ?- Init COMPLETE$")
_RING_LIST = re.compile(rf"^(?:Channel|Ring) ({_N})(?:/{_N})? :((?: +{_N})+)$")
_RING = re.compile(rf"^Ring ({_N}) : (-?{_N}) -> ({_N}) -> (-?{_N})$")
_TREE = re.compile(rf"\[({_N})\] (-?{_N})/(-?{_N})/(-?{_N})->({_N})->(-?{_N})")
_CONN = re.compile(rf"^Channel ({_N})(?:/({_N}))? : ({_N})\[\w+\] -> ({_N})\[\w+\](?: \[(send|receive)\])? via "
                   r"([\x20-\x7e]+)$")
_NET_LIST = re.compile(r"^NET/(\w+) ?: Using (.*)$")
_NET_ITEM = re.compile(rf"\[({_N})\]([^\s:\[<\x00-\x1f\x7f]+)")
_NET_VIA = re.compile(rf"^NET/(\w+)/({_N})(?:\(({_N})\))?")
_NETWORK = re.compile(r"^Using network (\S+)")
# A comm or Init COMPLETE line whose ids are not hexadecimal (so the strict forms above miss it).
_COMM_PTR = re.compile(r"^(?:\w+ )?comm (\S{1,64}) rank ")
_COMM_ID = re.compile(r" commId (\S{1,64}) - Init COMPLETE$")
_HEX = re.compile(r"0x[0-9a-fA-F]{1,32}")
_NRANKS = re.compile(rf" nranks ({_N}) ")


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
    up); ``connections``: distinct connection lines."""

    comm_id: str
    n_ranks: int
    n_nodes: Optional[int]
    ranks: dict[int, RankInfo]
    rings: tuple[tuple[int, ...], ...] = ()
    ring_links: dict[int, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    trees: dict[int, tuple[tuple[int, tuple[int, ...], int], ...]] = field(default_factory=dict)
    connections: tuple[Connection, ...] = ()

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
        has a communicator of every rank: :func:`world_ranks`)."""
        return max(self.communicators, key=lambda c: c.n_ranks)


@dataclass
class _Rec:
    """One process's view of one communicator while parsing."""

    ptr: str
    rank: int
    n_ranks: int
    n_nodes: Optional[int] = None
    done: Optional[tuple] = None  # (cuda_dev, nvml_dev, bus_id, comm_id)
    unread: bool = False  # its Init COMPLETE line was seen but names no known communicator
    rings: dict = field(default_factory=dict)
    links: list = field(default_factory=list)
    trees: list = field(default_factory=list)
    conns: list = field(default_factory=list)


@dataclass
class _Proc:
    recs: list = field(default_factory=list)
    nets: tuple = ()


def _find(proc: _Proc, rank: int, peers: Sequence[int] = (), listed: Optional[int] = None) -> Optional[_Rec]:
    """Most recent communicator of ``proc`` where it is ``rank`` and ``peers`` fit; with
    ``listed``, one whose ring lists that many ranks (NCCL prints at most 20)."""
    for rec in reversed(proc.recs):
        if rec.rank == rank and all(0 <= p < rec.n_ranks for p in peers) and (
                listed is None or listed == min(rec.n_ranks, 20)):
            return rec
    return None


def _bad_comm_id(msg: str) -> Optional[str]:
    """The comm pointer or commId of a ``comm``/``Init COMPLETE`` line that is not
    hexadecimal (the line is skipped, so its communicator may lack this rank), or None."""
    ptr = _COMM_PTR.match(msg)
    done = _COMM_ID.search(msg) if ptr else None
    bad = [m[1] for m in (ptr, done) if m is not None and not _HEX.fullmatch(m[1])]
    return bad[0] if bad else None


def _split_id(proc: _Proc, m: re.Match) -> tuple[Optional[str], str]:
    """(communicator id, "") of an ``Init COMPLETE`` line ``m`` of :data:`_DONE`, or (None,
    why) when the line does not identify its communicator (module docstring)."""
    if m[11] is not None:
        return m[11], ""
    if m[7] is None:
        return None, ("no commId (NCCL before 2.16 prints none), so its communicator cannot be matched across "
                      "processes; log the run with NCCL 2.16 or later")
    parent = next((r for r in reversed(proc.recs) if r.ptr == m[7] and r.done is not None), None)
    if parent is None:
        return None, (f"a split of comm {m[7]} without a commId, and that parent's Init COMPLETE is not in this "
                      "process's output before it; keep the log from the parent communicator's init on")
    return f"{parent.done[3]}/{'' if m[8] is None else f'split {m[8]} '}color {m[9]}", ""


def _record(proc: _Proc, ptr: str, rank: int, n_ranks: int) -> _Rec:
    rec = next((r for r in proc.recs if r.ptr == ptr), None)
    if rec is None:
        rec = _Rec(ptr, rank, n_ranks)
        proc.recs.append(rec)
    return rec


def _on_comm(proc: _Proc, msg: str) -> tuple[bool, str, int]:
    """(whether ``msg`` is a comm or Init COMPLETE line, why its communicator is unknown or
    "", the line's nranks)."""
    m = _COMM.match(msg)
    if m:
        _record(proc, m[1], int(m[2]), int(m[3])).n_nodes = int(m[4])
        return True, "", int(m[3])
    m = _DONE.match(msg)
    if not m:
        return False, "", 0
    rec = _record(proc, m[1], int(m[2]), int(m[3]))
    comm_id, why = _split_id(proc, m)
    if comm_id is None:
        rec.unread = True
        return True, why, int(m[3])
    rec.done = (int(m[4]), None if m[5] is None else int(m[5]), m[6], comm_id)
    return True, "", int(m[3])


def _on_bad_id(proc: _Proc, msg: str) -> Optional[int]:
    """Mark the record of a skipped ``Init COMPLETE`` line with a non-hexadecimal id as
    unread; its ``nranks`` (None when that is not readable either)."""
    n = _NRANKS.search(msg)
    ptr = _COMM_PTR.match(msg)
    if ptr is not None:
        for rec in proc.recs:
            if rec.ptr == ptr[1]:
                rec.unread = True
    return None if n is None else int(n[1])


def _unread_notes(unread: list[UnreadInit]) -> list[str]:
    """One note per reason: its first line, and how many more lines share it."""
    firsts: dict[str, list[UnreadInit]] = {}
    for u in unread:
        firsts.setdefault(u.why, []).append(u)
    return [f"{us[0].where}: Init COMPLETE line with {why}"
            + (f" ({len(us) - 1} more such line(s))" if len(us) > 1 else "") for why, us in firsts.items()]


def _on_graph(proc: _Proc, msg: str) -> Optional[str]:
    """Rings and trees; returns a note when a line fits no communicator."""
    m = _RING_LIST.match(msg)
    if m:
        ranks = tuple(int(x) for x in m[2].split())
        rec = _find(proc, 0, ranks, listed=len(ranks))
        if rec is not None:
            rec.rings[int(m[1])] = ranks
        return None if rec else f"ring list '{msg}' fits no communicator of this process"
    m = _RING.match(msg)
    if m:
        c, prev, rank, nxt = (int(x) for x in m.groups())
        rec = _find(proc, rank, [p for p in (prev, nxt) if p >= 0])
        if rec is not None:
            rec.links.append((c, prev, nxt))
        return None if rec else f"'{msg}' fits no communicator of this process"
    if msg.startswith("Trees"):
        items = [tuple(int(x) for x in t) for t in _TREE.findall(msg)]
        if items:
            rec = _find(proc, items[0][4], [x for t in items for x in (*t[1:4], t[5]) if x >= 0])
            if rec is not None:
                rec.trees += [(t[0], tuple(x for x in t[1:4] if x >= 0), t[5]) for t in items]
            return None if rec else f"'{msg[:60]}' fits no communicator of this process"
    return None


def _on_conn(proc: _Proc, msg: str) -> Optional[str]:
    m = _CONN.match(msg)
    if not m:
        return None
    channel, src, dst, direction, via = int(m[1]), int(m[3]), int(m[4]), m[5] or "", m[6]
    reporter = dst if direction == "receive" else src
    rec = _find(proc, reporter, (src, dst))
    if rec is None:
        return f"'{msg}' fits no communicator of this process"
    nic = net_dev = proxy = None
    net = _NET_VIA.match(via)
    if net:
        net_dev, proxy = int(net[2]), None if net[3] is None else int(net[3])
        nic = proc.nets[net_dev] if net_dev < len(proc.nets) else None  # see Communicator.unlisted_net_devs
    rec.conns.append(Connection(channel, src, dst, direction, via, reporter, nic, net_dev, proxy))
    return None


def parse_nccl_log(text: str, source: str = "NCCL log") -> NcclLogReport:
    """Communicators, their ranks, rings, trees, transports and NICs from an
    ``NCCL_DEBUG=INFO`` log (any mix of processes). Raises ConfigError when no
    communicator reached ``Init COMPLETE``."""
    procs: dict[tuple[str, int], _Proc] = {}
    network, notes, unread = None, [], []
    unmatched: list[UnreadInit] = []  # lines read but naming no communicator (bad ids have their own notes)
    for ln, line in enumerate(io.StringIO(text), 1):
        if len(line) > MAX_LINE_CHARS:
            raise ConfigError(f"{source}:{ln}", f"a line of {len(line)} characters; {over('line', len(line))}")
        m = _PREFIX.match(line.rstrip("\r\n"))
        if not m:
            continue
        key, msg = (m["host"], int(m["pid"])), m["msg"].rstrip()
        proc = procs.setdefault(key, _Proc())
        handled, why, n_ranks = _on_comm(proc, msg)
        if why:
            unmatched.append(UnreadInit(printable(f"{source}:{ln}"), n_ranks, printable(why)))
            unread.append(unmatched[-1])
        if handled:
            continue
        bad_id = _bad_comm_id(msg)
        if bad_id:
            notes.append(printable(f"{source}:{ln}: comm id '{bad_id}' is not hexadecimal (0x...); line skipped, so "
                                   "this process's rank is missing from that communicator"))
            if _COMM_ID.search(msg):
                unread.append(UnreadInit(printable(f"{source}:{ln}"), _on_bad_id(proc, msg),
                                         printable(f"comm id '{bad_id}', not hexadecimal (0x...)")))
            continue
        nets = _NET_LIST.match(msg)
        if nets:
            devices = nets[2].split(";")[0]  # "[0]mlx5_0:1/IB ... ; OOB eth0:..."
            proc.nets = tuple(name for _, name in sorted((int(i), n) for i, n in _NET_ITEM.findall(devices)))
            continue
        used = _NETWORK.match(msg)
        if used:
            network = used[1]
            continue
        note = _on_conn(proc, msg) if _CONN.match(msg) else _on_graph(proc, msg)
        if note:
            notes.append(printable(f"{source}:{ln}: {note}"))
    notes += _unread_notes(unmatched)
    comms = _assemble(procs, notes)
    if not comms:
        first = f" (first {unread[0].where}: {unread[0].why})" if unread else ""
        raise ConfigError(source, f"no communicator reached 'Init COMPLETE'{first}; run with NCCL_DEBUG=INFO "
                                  "(NCCL_DEBUG_SUBSYS must include INIT) and keep every rank's output")
    return NcclLogReport(tuple(comms), network, tuple(notes), source, tuple(unread))


def _assemble(procs: dict, notes: list) -> list[Communicator]:
    """Group every process's records by commId into communicators."""
    groups: dict[str, list] = {}
    for (host, pid), proc in procs.items():
        for rec in proc.recs:
            if rec.done is None:
                if not rec.unread:
                    notes.append(f"{host}:{pid} comm {rec.ptr} rank {rec.rank} never reached Init COMPLETE")
                continue
            groups.setdefault(rec.done[3], []).append((host, pid, proc, rec))
    out = []
    for comm_id, members in groups.items():
        ranks, links, trees, rings = {}, {}, {}, {}
        conns: dict = {}
        for host, pid, proc, rec in members:
            cuda, nvml, bus, _ = rec.done
            ranks[rec.rank] = RankInfo(rec.rank, host, pid, cuda, nvml, bus, proc.nets)
            links[rec.rank], trees[rec.rank] = tuple(rec.links), tuple(rec.trees)
            rings.update(rec.rings)
            for c in rec.conns:
                conns.setdefault((c.channel, c.src, c.dst, c.direction, c.via, c.reporter), c)
        first = members[0][3]
        out.append(Communicator(comm_id, first.n_ranks, first.n_nodes, dict(sorted(ranks.items())),
                                tuple(rings[c] for c in sorted(rings)), links, trees, tuple(conns.values())))
    return out


def read_nccl_log(path) -> NcclLogReport:
    """:func:`parse_nccl_log` of a file."""
    p = Path(path)
    text = read_text_limited(p, "LOG", FILE_BYTES["nccl_log"], "give the NCCL_DEBUG=INFO output of the run",
                             errors="replace")  # other programs' bytes may mix into a log
    return parse_nccl_log(text, source=p.name)


# --------------------------------------------------------------------------- check


def world_ranks(report: NcclLogReport, world: int) -> dict[tuple[str, int, int], int]:
    """(host, pid, CUDA device) of each process -> its global rank: its rank in the log's first
    communicator of ``world`` ranks (NCCL numbers ranks per communicator, so only one spanning
    the world gives global ranks). Raises ConfigError naming the log when there is none: the
    log cannot be checked, and guessing would check the wrong ranks.

    >>> log = ("h:1:1 [0] NCCL INFO init comm 0x1 rank 0 nranks 2 cudaDev 0 busId 1 commId 0xa - Init COMPLETE\\n"
    ...        "g:2:2 [3] NCCL INFO init comm 0x2 rank 1 nranks 2 cudaDev 3 busId 2 commId 0xa - Init COMPLETE")
    >>> world_ranks(parse_nccl_log(log), 2)
    {('h', 1, 0): 0, ('g', 2, 3): 1}
    >>> world_ranks(parse_nccl_log(log, "run.log"), 16)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: run.log: cannot check: no communicator of all 16 ranks in the log (the largest, ...
    """
    biggest = report.largest()
    if biggest.n_ranks > world:
        raise ConfigError(report.source, f"a communicator of {biggest.n_ranks} ranks (commId {biggest.comm_id}) but "
                                         f"the config's world is {world}; give the log of this config's run")
    full = next((c for c in report.communicators if c.n_ranks == world), None)
    lost = [u for u in report.unread if u.n_ranks in (world, None)]
    if full is None and lost:
        raise ConfigError(report.source, f"cannot check: no {world}-rank communicator could be read: {len(lost)} of its "
                                         f"Init COMPLETE lines name none it can be matched by (first {lost[0].where}: "
                                         f"{lost[0].why}), so the global ranks are unknown")
    if full is None:
        raise ConfigError(report.source, f"cannot check: no communicator of all {world} ranks in the log (the "
                                         f"largest, commId {biggest.comm_id}, has {biggest.n_ranks}), so its ranks "
                                         "are not global ranks; log the run from the world communicator's init on "
                                         "(a collective on the default process group, e.g. dist.barrier(), creates "
                                         "it) with NCCL_DEBUG=INFO")
    return {(r.host, r.pid, r.cuda_dev): r.rank for r in full.ranks.values()}


def _unchecked(report: NcclLogReport, to_global: dict[tuple[str, int, int], int], world: int) -> list[str]:
    """One note per communicator rank whose process is no rank of the world communicator in
    the log (part of the output is missing): its lines are not checked."""
    return [f"comm {c.comm_id} ({c.n_ranks} ranks): rank {r} ({i.host}:{i.pid}, GPU {i.cuda_dev}) is no rank of "
            f"the log's {world}-rank communicator; not checked"
            for c in report.communicators for r, i in c.ranks.items() if (i.host, i.pid, i.cuda_dev) not in to_global]


def _unlisted(comm: Communicator, rank: int) -> Optional[str]:
    """Why ``rank``'s NIC is unknown: a ``NET/<x>/<i>`` index past the devices its process's
    NCCL listed; None when every index was listed."""
    info = comm.ranks[rank]
    devs = sorted({"/".join(c.via.split("/")[:3]) for c in comm.connections
                   if c.reporter == rank and c.net_dev is not None and c.nic is None})
    if not devs:
        return None
    listed = (f"listed {len(info.net_devices)} net device(s), {', '.join(info.net_devices)}" if info.net_devices
              else "listed no net devices (no 'NET/IB : Using' line from its process)")
    return f"{', '.join(devs)} but its NCCL {listed}; the log does not say which NIC that is"


def _nic_lines(comm: Communicator, label: str, to_global, expected: dict[int, str]) -> list[str]:
    out = []
    for rank in comm.ranks:
        g = to_global(rank)
        meant = expected.get(g) if g is not None else None
        if meant is None:
            continue
        unlisted = _unlisted(comm, rank)
        if unlisted:
            out.append(f"{label}: rank {g} used {unlisted}")
        used = sorted(comm.net_nics(rank))
        if not used or used == [meant]:
            continue
        proxies = sorted({c.proxy_rank for c in comm.connections if c.reporter == rank and c.proxy_rank is not None})
        pxn = f" (through PXN proxy rank {', '.join(map(str, proxies))})" if proxies else ""
        if meant in used:
            others = ", ".join(n for n in used if n != meant)
            out.append(f"{label}: rank {g} used {meant} as meant but also {others}{pxn}")
        else:
            out.append(f"{label}: rank {g} used {', '.join(used)}{pxn} but the placement meant {meant}")
    return out


def _intra_lines(comm: Communicator, label: str, to_global, accepted: tuple[str, ...]) -> list[str]:
    out, seen = [], set()
    for c in comm.connections:
        a, b = comm.ranks.get(c.src), comm.ranks.get(c.dst)
        if a is None or b is None or a.host != b.host or c.transport in accepted:
            continue
        key = (c.src, c.dst, c.via)
        if key not in seen:
            seen.add(key)
            out.append(f"{label}: ranks {to_global(c.src)} -> {to_global(c.dst)} on {a.host} connected via "
                       f"{c.via}, not {'/'.join(accepted)}")
    return out


def check_against_placement(report: NcclLogReport, expected: dict[int, str],
                            expected_intra: Union[str, Sequence[str]] = "P2P") -> list[str]:
    """Differences between what NCCL used and what the placement meant, one line each:

    - ``expected``: global rank -> the NIC name the placement gives it
      (``rank_row(p, r)["nic"]``), for every rank 0..world-1. A process is known by the
      ``host:pid`` prefix of its lines and its CUDA device; its global rank is its rank in the
      log's communicator of all ``world`` ranks (:func:`world_ranks`: a ConfigError, "cannot
      check", when the log has none). For every communicator, a rank whose network channels
      went through another NIC: "comm 0x.. (2 ranks): rank 5 used mlx5_0 but the placement
      meant mlx5_9"; one that sent through a device index its NCCL did not list says so.
    - ``expected_intra``: the transport(s) meant between ranks on one host (P2P = NVLink or
      PCIe peer access); any other (SHM, NET) is reported.
    """
    return list(check_log(report, expected, expected_intra).differences)


@dataclass(frozen=True)
class NcclCheck:
    """What :func:`check_log` finds: ``differences`` (:func:`check_against_placement`) and
    ``unchecked``: one note per communicator rank whose process is no rank of the log's world
    communicator (part of the output is missing), so its lines were not checked."""

    differences: tuple[str, ...]
    unchecked: tuple[str, ...]


def check_log(report: NcclLogReport, expected: dict[int, str],
              expected_intra: Union[str, Sequence[str]] = "P2P") -> NcclCheck:
    """:func:`check_against_placement`'s differences and the ranks it could not check, from
    one :func:`world_ranks` (ConfigError "cannot check" when the log has no world
    communicator)."""
    accepted = (expected_intra,) if isinstance(expected_intra, str) else tuple(expected_intra)
    to_global_key = world_ranks(report, len(expected))
    out: list[str] = []
    for comm in report.communicators:
        label = f"comm {comm.comm_id} ({comm.n_ranks} ranks)"

        def to_global(rank, comm=comm):
            info = comm.ranks.get(rank)
            return None if info is None else to_global_key.get((info.host, info.pid, info.cuda_dev))

        out += _nic_lines(comm, label, to_global, expected)
        out += _intra_lines(comm, label, to_global, accepted)
    return NcclCheck(tuple(out), tuple(_unchecked(report, to_global_key, len(expected))))
