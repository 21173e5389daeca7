"""An NCCL log (:mod:`meshplan.comm.nccl_log`) against the placement (``meshplan nccl-check``):
each process's global rank from the log's world communicator (:func:`world_ranks`), then for
every communicator the NICs its ranks' network channels used against the placement's and the
transports between ranks on one host (:func:`check_log`, :func:`check_against_placement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from meshplan.comm.nccl_records import Communicator, NcclLogReport
from meshplan.errors import ConfigError


def world_ranks(report: NcclLogReport, world: int) -> dict[tuple[str, int, int], int]:
    """(host, pid, CUDA device) of each process -> its global rank: its rank in the log's first
    communicator of ``world`` ranks (NCCL numbers ranks per communicator, so only one spanning
    the world gives global ranks). Raises ConfigError naming the log when there is none: the
    log cannot be checked, and guessing would check the wrong ranks.

    >>> from meshplan.comm.nccl_log import parse_nccl_log
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
    """What :func:`check_log` finds: ``differences`` (:func:`check_against_placement`),
    ``unchecked``: one note per communicator rank whose process is no rank of the log's world
    communicator (part of the output is missing), so its lines were not checked, and
    ``cannot_check``: one line per communicator some of whose channel lines fit another
    communicator of the same process alike (:attr:`Communicator.unattributed`), so its
    connections are not known and none of its differences is said."""

    differences: tuple[str, ...]
    unchecked: tuple[str, ...]
    cannot_check: tuple[str, ...] = ()


def check_log(report: NcclLogReport, expected: dict[int, str],
              expected_intra: Union[str, Sequence[str]] = "P2P") -> NcclCheck:
    """:func:`check_against_placement`'s differences and the ranks it could not check, from
    one :func:`world_ranks` (ConfigError "cannot check" when the log has no world
    communicator)."""
    accepted = (expected_intra,) if isinstance(expected_intra, str) else tuple(expected_intra)
    to_global_key = world_ranks(report, len(expected))
    out: list[str] = []
    cannot = [_cannot_check(c) for c in report.communicators if c.unattributed]
    for comm in report.communicators:
        label = f"comm {comm.comm_id} ({comm.n_ranks} ranks)"
        if comm.unattributed:
            continue

        def to_global(rank, comm=comm):
            info = comm.ranks.get(rank)
            return None if info is None else to_global_key.get((info.host, info.pid, info.cuda_dev))

        out += _nic_lines(comm, label, to_global, expected)
        out += _intra_lines(comm, label, to_global, accepted)
    return NcclCheck(tuple(out), tuple(_unchecked(report, to_global_key, len(expected))), tuple(cannot))


def _cannot_check(comm: Communicator) -> str:
    """``comm 0x.. (16 ranks): cannot check: 4 channel line(s) fit it and another communicator
    of their process alike (first x.log:12 (comm 0x.. or 0x..)); ...``."""
    return (f"comm {comm.comm_id} ({comm.n_ranks} ranks): cannot check: {len(comm.unattributed)} channel line(s) fit "
            f"it and another communicator of their process alike (first {comm.unattributed[0]}): the log has no "
            "'Init START' or 'comm 0x.. rank .. nRanks' line opening each communicator's init; log with "
            "NCCL_DEBUG_SUBSYS including INIT and NCCL_RUNTIME_CONNECT=0")
