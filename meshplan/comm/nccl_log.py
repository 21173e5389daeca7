"""Read ``NCCL_DEBUG=INFO`` logs: which links and NICs each communicator really used.

What a log holds once read is :mod:`meshplan.comm.nccl_records` (:class:`~meshplan.comm.nccl_records.NcclLogReport`
and its communicators); the check of it against a placement is :mod:`meshplan.comm.nccl_check`.

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

- ``ncclCommInitRankConfig comm 0x.. rank r nranks n cudaDev d ... - Init START`` (2.21+):
  opens the communicator's init in its process, as its ``comm .. nRanks`` line does.

Lines are attributed per process (host:pid): a ring or tree line to its most recent
communicator whose rank fits; a channel line to the one whose init is open (from its ``Init
START`` or ``comm .. nRanks`` line to its ``Init COMPLETE``) and fits, else (no INIT lines,
or NCCL_RUNTIME_CONNECT) to the one whose ranks' devices, known once every ``Init COMPLETE``
is read, are the line's ``rank[nvmlDev]`` pairs (dp's ``0[5] -> 1[5]`` is not tp's, whose
rank 1 is GPU 1). A line that still fits several is not attributed and marks each of them
(:attr:`Communicator.unattributed`: nccl-check cannot check them). Other lines are ignored.

>>> from meshplan.comm.nccl_check import check_against_placement
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
from typing import Optional, Sequence

from meshplan.comm.nccl_records import Communicator, Connection, NcclLogReport, RankInfo, UnreadInit
from meshplan.errors import ConfigError, printable
from meshplan.fileread import read_text_limited
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
_CONN = re.compile(rf"^Channel ({_N})(?:/({_N}))? : ({_N})\[(\w+)\] -> ({_N})\[(\w+)\](?: \[(send|receive)\])? via "
                   r"([\x20-\x7e]+)$")
_START = re.compile(rf"^(?:\w+ )?comm (0x[0-9a-fA-F]+) rank ({_N}) nranks ({_N}) cudaDev ({_N}) .*- Init START$")
_NET_LIST = re.compile(r"^NET/(\w+) ?: Using (.*)$")
_NET_ITEM = re.compile(rf"\[({_N})\]([^\s:\[<\x00-\x1f\x7f]+)")
_NET_VIA = re.compile(rf"^NET/(\w+)/({_N})(?:\(({_N})\))?")
_NETWORK = re.compile(r"^Using network (\S+)")
# A comm or Init COMPLETE line whose ids are not hexadecimal (so the strict forms above miss it).
_COMM_PTR = re.compile(r"^(?:\w+ )?comm (\S{1,64}) rank ")
_COMM_ID = re.compile(r" commId (\S{1,64}) - Init COMPLETE$")
_HEX = re.compile(r"0x[0-9a-fA-F]{1,32}")
_NRANKS = re.compile(rf" nranks ({_N}) ")


@dataclass
class _Rec:
    """One process's view of one communicator while parsing."""

    ptr: str
    rank: int
    n_ranks: int
    n_nodes: Optional[int] = None
    done: Optional[tuple] = None  # (cuda_dev, nvml_dev, bus_id, comm_id)
    unread: bool = False  # its Init COMPLETE line was seen but names no known communicator
    open: bool = False  # between its Init START (or comm .. nRanks) line and its Init COMPLETE
    bracketed: bool = False  # an Init START or comm .. nRanks line was seen
    ambiguous: list = field(default_factory=list)  # "log:line" of channel lines that fit it and others alike
    rings: dict = field(default_factory=dict)
    links: list = field(default_factory=list)
    trees: list = field(default_factory=list)
    conns: list = field(default_factory=list)


@dataclass
class _Proc:
    recs: list = field(default_factory=list)
    nets: tuple = ()
    pending: list = field(default_factory=list)  # channel lines outside one open init: (_Pending)


@dataclass
class _Pending:
    """A channel line no single open init owns, resolved by devices once all is read."""

    conn: Connection
    devs: tuple  # (src device, dst device) as printed in brackets
    fits: list  # records of its process that fit it when read
    after: int  # how many records its process had when read (later unbracketed ones may own it)
    where: str  # "log:line"
    msg: str
    note_at: tuple[int, int]  # (how many notes there were when read: its note, if any, goes there; its line)


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
    """(whether ``msg`` is a comm, Init START or Init COMPLETE line, why its communicator is
    unknown or "", the line's nranks)."""
    m = _START.match(msg)
    if m:
        old = next((r for r in proc.recs if r.ptr == m[1]), None)
        if old is not None and (old.done is not None or old.unread):  # a pointer reused by a new communicator
            old.ptr = f"{old.ptr} (closed)"
        rec = _record(proc, m[1], int(m[2]), int(m[3]))
        rec.open = rec.bracketed = True
        return True, "", int(m[3])
    m = _COMM.match(msg)
    if m:
        rec = _record(proc, m[1], int(m[2]), int(m[3]))
        rec.n_nodes, rec.bracketed = int(m[4]), True
        rec.open = rec.done is None and not rec.unread
        return True, "", int(m[3])
    m = _DONE.match(msg)
    if not m:
        return False, "", 0
    rec = _record(proc, m[1], int(m[2]), int(m[3]))
    rec.open = False
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


def _on_conn(proc: _Proc, msg: str, where: str, note_at: tuple[int, int]) -> None:
    """A channel line: to the one open init it fits (module docstring), else kept in
    ``proc.pending`` for :func:`_resolve`."""
    m = _CONN.match(msg)
    if not m:
        return
    channel, src, dst, direction, via = int(m[1]), int(m[3]), int(m[5]), m[7] or "", m[8]
    reporter = dst if direction == "receive" else src
    nic = net_dev = proxy = None
    net = _NET_VIA.match(via)
    if net:
        net_dev, proxy = int(net[2]), None if net[3] is None else int(net[3])
        nic = proc.nets[net_dev] if net_dev < len(proc.nets) else None  # see Communicator.unlisted_net_devs
    conn = Connection(channel, src, dst, direction, via, reporter, nic, net_dev, proxy)
    fits = [r for r in proc.recs if r.rank == reporter and max(src, dst) < r.n_ranks]
    opened = [r for r in fits if r.open]
    if len(opened) == 1:
        opened[0].conns.append(conn)
    else:
        proc.pending.append(_Pending(conn, (m[4], m[6]), opened or fits, len(proc.recs), where, msg, note_at))


def _device_fits(done: Optional[tuple], dev: str) -> bool:
    """Whether a rank whose Init COMPLETE gave ``done`` (cuda, nvml, bus id, id) is the device
    ``dev`` a channel line prints in brackets (nvmlDev; busId before NCCL 2.18.3); True
    when that rank's Init COMPLETE is not in the log (nothing to tell it by)."""
    if done is None:
        return True
    cuda, nvml, bus, _ = done
    return dev == str(nvml if nvml is not None else cuda) or dev.lower() == bus.lower()


def _resolve(procs: dict, notes: list) -> None:
    """Attribute each pending channel line (:func:`_on_conn`) by its devices: among the records
    of its process that fit it (those read before it, and unbracketed ones after), those whose
    communicator has its two ranks on its two bracketed devices. One: attributed; none: a
    note, in line order among the others; several: each is marked ambiguous."""
    devices: dict[str, dict[int, tuple]] = {}
    for proc in procs.values():
        for rec in proc.recs:
            if rec.done is not None:
                devices.setdefault(rec.done[3], {})[rec.rank] = rec.done
    lost = []
    for proc in procs.values():
        for p in proc.pending:
            c = p.conn
            later = [r for r in proc.recs[p.after:] if not r.bracketed and r.rank == c.reporter
                     and max(c.src, c.dst) < r.n_ranks]
            fits = [r for r in p.fits + later if r.done is not None
                    and _device_fits(devices[r.done[3]].get(c.src), p.devs[0])
                    and _device_fits(devices[r.done[3]].get(c.dst), p.devs[1])]
            if len(fits) == 1:
                fits[0].conns.append(c)
            elif not fits:
                lost.append((p.note_at, printable(f"{p.where}: '{p.msg}' fits no communicator of this process")))
            for r in fits if len(fits) > 1 else ():
                r.ambiguous.append(f"{p.where} (comm {' or '.join(x.done[3] for x in fits)})")
    for (at, _), note in sorted(lost, reverse=True):  # the last line first: each goes before those after it
        notes.insert(at, note)


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
        if _CONN.match(msg):
            _on_conn(proc, msg, printable(f"{source}:{ln}"), (len(notes), ln))
            continue
        note = _on_graph(proc, msg)
        if note:
            notes.append(printable(f"{source}:{ln}: {note}"))
    notes += _unread_notes(unmatched)
    _resolve(procs, notes)
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
        ambiguous = [w for *_, rec in members for w in rec.ambiguous]
        for host, pid, proc, rec in members:
            cuda, nvml, bus, _ = rec.done
            ranks[rec.rank] = RankInfo(rec.rank, host, pid, cuda, nvml, bus, proc.nets)
            links[rec.rank], trees[rec.rank] = tuple(rec.links), tuple(rec.trees)
            rings.update(rec.rings)
            for c in rec.conns:
                conns.setdefault((c.channel, c.src, c.dst, c.direction, c.via, c.reporter), c)
        first = members[0][3]
        out.append(Communicator(comm_id, first.n_ranks, first.n_nodes, dict(sorted(ranks.items())),
                                tuple(rings[c] for c in sorted(rings)), links, trees, tuple(conns.values()),
                                tuple(ambiguous)))
    return out


def read_nccl_log(path) -> NcclLogReport:
    """:func:`parse_nccl_log` of a file."""
    p = Path(path)
    text = read_text_limited(p, "LOG", FILE_BYTES["nccl_log"], "give the NCCL_DEBUG=INFO output of the run",
                             errors="replace")  # other programs' bytes may mix into a log
    return parse_nccl_log(text, source=p.name)
