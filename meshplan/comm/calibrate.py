"""``meshplan calibrate``: a user's own nccl-tests outputs (text or ``-J`` JSON, parsed by
:mod:`meshplan.comm.nccl_tests`) into the calibration file ``--calibration`` reads, the same
TOML that ``meshplan bench comm`` writes (:func:`~meshplan.comm.calibration.calibration_toml`).

Each file is one nccl-tests run. Its link class comes from where its ranks ran (the host
names of the ``#  Rank`` lines, or ``config.devices[].hostname`` in JSON):

- all ranks on one host: ``nvlink`` (the node's fabric);
- one rank per host: ``nic`` (each rank's traffic crosses one NIC: ``mpirun -N 1 ... -g 1``);
- several hosts with several ranks each: refused, since such a run mixes NVLink and NIC
  hops (measure the two separately), unless ``link`` says which class to record it as.
  Recorded as ``nic`` (:func:`ranks_per_node`), its busbw is split over the NICs the ranks
  of a node use, one per rank (a rail-optimized node: DGX H100 has one 400G NIC per GPU):
  an all-reduce ring leaves each node once per channel and the channels spread over the
  node's NICs, so a node sends busbw bytes/s in all (NCCL's busbw is each rank's send rate
  on the ring's slowest hop), busbw / k per NIC for k ranks per host. [S18] 2 x 8 A100
  (8 HDR 200 Gb/s NICs per node): 188.18 GB/s busbw at 4 GiB, 23.5 GB/s per 25 GB/s NIC.
  Its curve keeps the measured busbw, read against the node's rate once applied (k x the
  per-NIC fit, as catalog/nccl.toml's ``ib-hdr-200-8nic`` against 8 x 25 = 200 GB/s;
  :func:`~meshplan.comm.calibration_kinds.read_rate`); the file writes no ``line_gb_per_s``,
  since nccl-tests' output gives no line rate and a fit is not one.
  An all-to-all's busbw is per rank (algbw x (n - 1) / n, nccl-tests doc/PERFORMANCE.md) and
  each rank's bytes for other hosts leave through its own NIC, so its per-NIC fit is busbw x
  (n - g) / (n - 1) for g ranks per host, the share of a rank's bytes that leaves the host
  (:func:`~meshplan.comm.calibration_kinds.host_share`; 16 x 8 H100 at 37.80 GB/s: 35.72 per
  NIC, not 37.80 / 8), which :func:`~meshplan.comm.nccl_algorithms.all_to_all_time` puts back: its
  (n - g) / n x S through each rank's NIC at that rate takes the logged time.
  A run with an unequal number of ranks per host is refused.
  Hosts whose ranks share NICs (8 GPUs on 4 NICs, two GPUs under each NIC's PCIe switch) give
  their count: ``nics_per_host`` (``--nics-per-host N``, a divisor of k: the ranks share the
  NICs evenly; it wins over ``--system``, and the note says so) or, without it, the catalog
  node ``system`` names (``--system NODE``: the length of nodes.toml's ``nics``, at most k:
  a rank drives one NIC; a ``warning:`` line when its GPU is not the one the ``#  Rank`` lines
  name, :func:`~meshplan.comm.calibrate_nics.system_gpu_warning`). The per-NIC fit is then
  busbw / N (:func:`~meshplan.comm.calibrate_nics.nic_split`; 2 x 8 ranks at
  160 GB/s busbw over 4 NICs per host: 40 GB/s per NIC), the curve read against N x it, and
  the file records ``nics_per_node = N`` where N is not k, so that ``--calibration`` reads the
  curve against the node's N NICs (:mod:`meshplan.comm.calibration`).

A ``nic`` fit (per NIC, after the split) above the line rate of every NIC of the catalog nodes
of its GPU model (of every catalog node when the model is not known; of the node ``system``
names when given) gets a ``warning:`` line (:func:`~meshplan.comm.calibrate_nics.nic_warning`): a NIC carries at most its
line rate, so each rank drove several NICs (hosts missing from its ``#  Rank`` lines, or fewer
NICs per host given than the ranks drove) or the measured nodes' NICs are faster than the
catalog's.

Each file's GPU model is what nccl-tests prints after the PCI address of its ``#  Rank``
lines (``device_info`` in JSON; :func:`~meshplan.comm.nccl_tests.gpus_of`). Files whose
ranks name two GPU models (an A100 node's run beside an H200 node's) are refused, in one
file or across the files given: a calibration file describes the links of one cluster, whose
GPUs are of one model (:class:`~meshplan.spec.cluster.ClusterSpec`), and the slowest of an
A100 and an H200 NVLink fit is neither machine's. Each link class records that model as
``gpu`` (none when no file names one; never for a gloo run, which ran on CPUs).

Per link class, one alpha-beta fit (:func:`~meshplan.comm.linkfit.fit_alpha_beta`) per
file; the class keeps the all-reduce fit when there is one (as ``bench comm`` does), and of
several the slowest bus bandwidth (a collective over every rail waits for the slowest NIC);
its ``source`` names that file, and a note names each dropped file with its fit and why.
Each file also gives its measured curve (:func:`measured_curve`: busbw at every logged size,
per op, rank count and node count), written beside the fit as ``[[link.<class>.curve]]``
(:mod:`meshplan.comm.calibration`), so ``--calibration`` reads the logged sizes off the
curve (above the largest along its last segment, below the smallest latency-bound: never slower
than the smallest logged time), with the fit's alpha.

Which collective kinds a file sets (one ``<class>: this file sets ...`` line per class,
:func:`~meshplan.comm.calibration_kinds.kinds_set`), per op: on ``nic`` the kept fit is a ring
op's where there is one (all-reduce first), and it and its curve set all-reduce, all-gather and
reduce-scatter (NCCL runs the three on one ring and nccl-tests doc/PERFORMANCE.md defines their
busbw as the same per-link figure, :data:`~meshplan.comm.calibration_kinds.RING_OPS`);
all-to-all is set by an ``alltoall_perf`` run over more than 2 ranks (its curve), send/recv by
a run of the pair pattern (``sendrecv_perf``, or ``alltoall_perf`` over 2 ranks on 2 hosts); an
op no file measures keeps the catalog's curve (send/recv and the one-rank-per-node all-reduce
beside a ring fit: scaled by this run's busbw per NIC over the catalog's of its own pattern,
:mod:`meshplan.comm.calibration_kinds`). An alltoall_perf log alone therefore leaves the ring
ops and send/recv at the catalog's (trial 28: 34.66 GB/s per NIC of all-to-all is not a ring's
46-48, NVIDIA/nccl-tests issue #290). On ``nvlink`` and ``pcie`` the kept fit (all-reduce first)
sets the class's rate and every op no file measures; an op with a run of its own is timed on that
run (:func:`~meshplan.comm.calibration_kinds.own_runs`: on an NVSwitch node NCCL runs all-reduce on
NVLS and the other ops on the ring), so such a run is no rival of the kept fit. Each curve records
its run's own fitted alpha (``latency_us``), which an all-to-all or per-op curve is read at in
place of NCCL's latency. ``--link nvlink`` or ``pcie`` (links inside one node) on a run over several hosts is refused.
A file ``meshplan bench comm`` wrote from a gloo run (its first line says ``(gloo,``) keeps
``backend = "gloo"``, so that ``--calibration`` refuses it for NCCL links.

>>> link_class(["a", "a", "a", "a"], "x.txt"), link_class(["a", "b"], "x.txt")
('nvlink', 'nic')
"""

from __future__ import annotations

import re
from dataclasses import replace
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from pydantic import ValidationError

from meshplan.comm.calibrate_nics import (asked_nics, fit_gbs, nic_split, nic_warning, split_note,
                                          system_gpu_warning)
from meshplan.comm.calibration_kinds import RING_OPS, host_share, kinds_set, read_rate
from meshplan.comm.linkfit import LINK_CLASSES, LinkFit, fit_alpha_beta, latency_bound_reason
from meshplan.comm.nccl_tests import (TEST_OPS, BenchRow, gpus_of, hosts_of, parse_nccl_tests, read_nccl_tests_text,
                                      op_of_test, row_fits, trailer_warning)
from meshplan.errors import ConfigError
from meshplan.spec.cluster import BusbwCurve
from meshplan.units import GB, US, human_bytes

#: The ops a measured curve can be (:class:`~meshplan.spec.cluster.BusbwCurve`'s ``op``).
CURVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send/recv")


def link_class(hosts: Sequence[str], where: str, link: Optional[str] = None,
               asked: Optional[tuple[int, str]] = None, system: Optional[str] = None) -> str:
    """``link`` when given (checked: nvlink and pcie are links inside one node, so a run whose
    ``#  Rank`` lines name several hosts is refused for them; ``nic`` on a run whose lines name one
    host is read as ``nvlink``, which it crossed, so one call takes 1-node and 8-node logs), else ``nvlink`` for one host,
    ``nic`` for one rank per host; a ConfigError otherwise (see the module docstring), naming
    ``where``, or ``--link`` where the NICs per host are given (``asked``, :func:`~meshplan.comm.
    calibrate_nics.asked_nics`; ``system``, ``--system``'s node): --link nic is then the one fix.

    >>> link_class(["a"] * 8 + ["b"] * 8, "x.txt", asked=(8, "--system"), system="dgx-h100")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --link: x.txt ran 16 ranks on 2 hosts, up to 8 per host, which mixes NVLink and NIC hops: pass --link nic to record it as nic, its busbw split over the 8 NICs per host that --system dgx-h100 gives; or measure one node (nvlink) and one GPU per node (nic) separately

    >>> link_class(["a"] * 8 + ["b"] * 8, "x.txt", "nvlink")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: --link: nvlink is a link inside one node, but x.txt ran 16 ranks on 2 hosts (its busbw crosses the network); pass --link nic, or measure one node for nvlink
    """
    per_host = Counter(hosts)
    if link is not None:
        if link not in LINK_CLASSES:
            raise ConfigError("--link", f"unknown link class '{link}'; use one of {', '.join(LINK_CLASSES)}")
        if link == "nic" and len(per_host) == 1 and "" not in per_host:  # one named host: no NIC hop
            return "nvlink"
        if link != "nic" and len(per_host) > 1:
            raise ConfigError("--link", f"{link} is a link inside one node, but {where} ran {len(hosts)} ranks on "
                                        f"{len(per_host)} hosts (its busbw crosses the network); pass --link nic, or "
                                        f"measure one node for {link}")
        return link
    if not hosts or "" in per_host:
        raise ConfigError(where, "no host names in the '#  Rank' lines; pass --link nvlink, pcie or nic")
    if len(per_host) == 1:
        return "nvlink"
    if max(per_host.values()) == 1:
        return "nic"
    k = max(per_host.values())
    if asked is not None:
        nics, by = asked  # a --system node's NICs, at most the ranks per host (nic_split: a rank drives one)
        nics, by = (min(nics, k), f"--system {system}") if by == "--system" else (nics, by)
        raise ConfigError("--link", f"{where} ran {len(hosts)} ranks on {len(per_host)} hosts, up to {k} per host, "
                                    "which mixes NVLink and NIC hops: pass --link nic to record it as nic, its busbw "
                                    f"split over the {nics} NICs per host that {by} gives; or measure one node "
                                    "(nvlink) and one GPU per node (nic) separately")
    raise ConfigError(where, f"{len(hosts)} ranks on {len(per_host)} hosts, up to {k} per "
                             "host: the run mixes NVLink and NIC hops; measure one node (nvlink) and one GPU "
                             "per node (nic) separately, or pass --link nic to split its busbw over the NICs of a "
                             "host: one per rank, or the NICs they drove as --nics-per-host N or --system NODE "
                             "gives")


def ranks_per_node(hosts: Sequence[str], where: str) -> int:
    """Ranks per host of a run recorded as ``nic`` (each rank driving its own NIC, module
    docstring): 1 when the ``#  Rank`` lines name no hosts; a ConfigError naming ``where``
    when hosts run unequal numbers of ranks.

    >>> ranks_per_node(["a"] * 8 + ["b"] * 8, "x.txt"), ranks_per_node([], "x.txt")
    (8, 1)
    >>> ranks_per_node(["a"] * 8 + ["b"] * 4, "x.txt")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: x.txt: 12 ranks on 2 hosts, 4 to 8 per host: its busbw cannot be split over the NICs of one node; give a run with the same number of ranks on every host
    """
    counts = Counter(h for h in hosts if h).values()
    if len(set(counts)) > 1:
        raise ConfigError(where, f"{len(hosts)} ranks on {len(counts)} hosts, {min(counts)} to {max(counts)} per "
                                 "host: its busbw cannot be split over the NICs of one node; give a run with the "
                                 "same number of ranks on every host")
    return next(iter(counts), 1)


def _source(path: Path, text: str, rows: list[BenchRow], hosts: list[str]) -> str:
    version = re.search(r"^# nccl-tests version (\S+)", text, flags=re.M)
    tool = f"nccl-tests {version[1]}" if version else "nccl-tests"
    return (f"{tool} {rows[0].op} over {rows[0].n_ranks} ranks on {len(set(hosts)) or '?'} host(s), "
            f"file {path.name}")


def measured_curve(rows: list[BenchRow], nodes: int, line_gb_per_s: float, source: str,
                   latency_us: Optional[float] = None) -> Optional[BusbwCurve]:
    """The busbw curve of one nccl-tests run ``rows`` over ``nodes`` hosts, read against
    ``line_gb_per_s`` (:func:`~meshplan.comm.calibration_kinds.read_rate` of its class's fit; the
    calibration file leaves it out, ``apply_calibration`` sets it again): at each logged size the slower of the
    out-of-place and in-place busbw (GB/s, as printed), with ``latency_us``, the run's own fitted
    alpha per call; None for an op a curve cannot be (broadcast) or a run of fewer than 2 ranks.

    >>> r = [BenchRow("all-reduce", 8, s, 1e-4, 0.0, b * 1e9, p) for s, b, p in
    ...      [(1024, 0.05, False), (1024, 0.04, True), (2048, 0.1, False)]]
    >>> c = measured_curve(r, 1, 200.0, "x")
    >>> c.sizes_bytes, c.busbw_gb_per_s, c.nodes
    ([1024, 2048], [0.04, 0.1], 1)
    """
    if rows[0].op not in CURVE_OPS or rows[0].n_ranks < 2:
        return None
    slowest: dict[int, float] = {}
    for r in rows:
        slowest[r.size_bytes] = min(slowest.get(r.size_bytes, float("inf")), r.busbw_bytes_per_s / GB)
    sizes = sorted(s for s, b in slowest.items() if s > 0 and b > 0)
    if not sizes:
        return None
    fields = {"op": rows[0].op, "ranks": rows[0].n_ranks, "nodes": max(nodes, 1), "line_gb_per_s": line_gb_per_s,
              "sizes_bytes": sizes, "busbw_gb_per_s": [round(slowest[s], 6) for s in sizes], "source": source,
              "latency_us": None if latency_us is None else round(latency_us, 4)}
    try:
        return BusbwCurve.model_validate(fields)
    except ValidationError as err:
        raise ConfigError(source, f"its busbw curve is out of bounds ({err.errors()[0]['msg']}); check the rows") from None


#: Why a curve keeps the slower busbw column at each size (:func:`measured_curve`), the start of
#: :func:`column_note`: torch issues a collective both ways. In place (NCCL's sendbuff inside recvbuff):
#: DDP's bucket all-reduce, HSDP's all-reduce and FSDP2's all-gather, whose input is this rank's slice of the
#: output (torch 2.13 torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, ``all_gather_copy_in``); out of
#: place: FSDP2's reduce-scatter into a new shard (``foreach_reduce``: ``reduce_output = reduce_scatter_input
#: .new_empty(...)``).
COLUMN_RULE = ("busbw columns: the fit uses both of nccl-tests' out-of-place and in-place rows; each curve keeps, "
               "per size, the slower busbw of the two, since torch issues both (in place: DDP's and HSDP's "
               "all-reduce, FSDP2's all-gather; out of place: FSDP2's reduce-scatter)")


def column_note(runs: Sequence[tuple[str, list[BenchRow]]]) -> str:
    """:data:`COLUMN_RULE` and, per run ``(file name, rows)``, the column kept at its largest
    size with both busbw values (GB/s, as printed).

    >>> r = [BenchRow("all-reduce", 8, 2**33, 1.0, 0.0, b * 1e9, p) for b, p in [(369.66, False), (366.0, True)]]
    >>> column_note([("ar.txt", r)]).split(": here ")[1]
    'ar.txt at 8.00 GiB: in-place 366.00 GB/s kept (out-of-place 369.66)'
    """
    parts = []
    for name, rows in runs:
        top = max(r.size_bytes for r in rows)
        bw = {r.in_place: r.busbw_bytes_per_s / GB for r in rows if r.size_bytes == top}
        if len(bw) < 2:
            parts.append(f"{name} at {human_bytes(top)}: {'in-place' if True in bw else 'out-of-place'} only")
            continue
        kept = bw[True] < bw[False]
        word, other = ("in-place", "out-of-place") if kept else ("out-of-place", "in-place")
        parts.append(f"{name} at {human_bytes(top)}: equal ({bw[True]:.2f} GB/s)" if bw[True] == bw[False] else
                     f"{name} at {human_bytes(top)}: {word} {bw[kept]:.2f} GB/s kept ({other} {bw[not kept]:.2f})")
    return f"{COLUMN_RULE}: here " + "; ".join(parts)


def calibrate(paths: Sequence[Path], link: Optional[str] = None, nics_per_host: Optional[int] = None,
              system: Optional[str] = None) -> tuple[list[LinkFit], list[str], dict[str, str]]:
    """(one fit per link class, a note per file and per class that had several, each class's
    ``source``: the measurement of the file it kept) from nccl-tests outputs ``paths``
    (:func:`calibrate_curves` without the curves and NIC counts)."""
    return calibrate_curves(paths, link, nics_per_host, system)[:3]


def calibrate_curves(paths: Sequence[Path], link: Optional[str] = None, nics_per_host: Optional[int] = None,
                     system: Optional[str] = None, op: Optional[str] = None) -> tuple[list[LinkFit], list[str], dict[str, str],
                                                           dict[str, list[BusbwCurve]], dict[str, int]]:
    """:func:`calibrate`'s fits, notes and sources, per link class each file's measured curve
    (:func:`measured_curve`, read against the class's kept fit x the NICs of its run's host),
    and ``{"nic": N}`` when the kept ``nic`` run's busbw was split over N NICs per host other
    than its ranks per host (``nics_per_host`` or ``system``'s, :func:`~meshplan.comm.calibrate_nics.nic_split`; the
    calibration file's ``nics_per_node``). Raises ConfigError naming the file for unreadable
    or unusable input, or the option for a bad NIC count. ``op`` (``--op``): the test of the text
    logs without nccl-tests' ``# Collective test starting`` banner (before 2025-06), a program name
    (``alltoall`` or ``alltoall_perf``) or meshplan's op name; a log with the banner is read by it."""
    if not paths:
        raise ConfigError("NCCL_TESTS_OUTPUT", "no files; pass nccl-tests outputs (text or -J JSON)")
    op = op_of_test(op, "--op") if op is not None else None
    asked = asked_nics(nics_per_host, system)
    by_link: dict[str, list[tuple[LinkFit, str, str, int, int]]] = {}  # fit, source, file, ranks, NICs per host
    notes: list[str] = []
    runs: dict[str, list[tuple[list[BenchRow], int, int, str, float]]] = {}  # rows, hosts, NICs per host, source, alpha
    models: dict[str, str] = {}  # GPU model -> the first file that named it
    files: list[tuple[str, list[BenchRow]]] = []  # file name, rows: column_note
    latency_bound: dict[str, tuple[str, str]] = {}  # link class -> (file, why) of its first run setting no beta
    used_op = False
    for path, own in map(_file_op, paths):
        cls, fit, rows, hosts, per_node, nics, source, why = _read_run(path, (link, own or op), asked, system, models,
                                                                       notes)
        used_op |= own is None and op is not None and fit.op == op
        if why is not None:  # cut off below the bandwidth-bound sizes: no beta from it (linkfit.latency_bound_reason)
            notes.append(f"{path.name}: not used: {why}")
            latency_bound.setdefault(cls, (path.name, why))
            continue
        by_link.setdefault(cls, []).append((fit, source, path.name, per_node, nics))
        runs.setdefault(cls, []).append((rows, len(set(hosts)), nics, source, fit.latency_s / US))
        files.append((path.name, rows))
    for cls, (name, why) in latency_bound.items():
        if cls not in by_link:  # no other file of the class sets its beta
            raise ConfigError(name, f"{why}; pass the whole output, or rerun nccl-tests up to 1 GiB or more (-e 1G)")
    if op is not None and not used_op:
        notes.append(f"--op {op}: read no log (each names its test, or has its own FILE:op)")
    notes += [w for w in [system_gpu_warning(system, models)] if w]
    notes.append(column_note(files))
    if nics_per_host is not None and "nic" not in by_link:
        raise ConfigError("--nics-per-host", "no file is recorded as nic (a run over several hosts, or --link "
                                             "nic); drop it, or pass --link nic")
    fits, sources, curves, split = [], {}, {}, {}
    for cls, candidates in by_link.items():  # all of one GPU model (_one_gpu), where named
        pool = ([c for c in candidates if c[0].op == "all-reduce"] or [c for c in candidates if c[0].op in RING_OPS]
                or candidates)  # a ring fit sets the class's rate; the other ops' runs their own (curves)
        fit, source, name, per_node, nics = min(pool, key=lambda c: c[0].bandwidth_bytes_per_s)
        fits.append(fit)
        sources[cls] = source
        rivals = [c for c in pool if cls == "nic" or c[0].op == fit.op]  # nvlink, pcie: other ops from their own runs
        if len(rivals) > 1:
            notes.append(_kept_note(cls, (fit, name), rivals, pool))
        given = (per_node, nics) if asked is not None and per_node > 1 else None
        notes += [w for w in [nic_warning(fit, name, system, given)] if w]
        split.update({cls: nics} if cls == "nic" and nics != per_node else {})
        kept = [measured_curve(r, k, read_rate(fit.bandwidth_bytes_per_s / GB, per, r[0].op, r[0].n_ranks, k, cls),
                               text, alpha) for r, k, per, text, alpha in runs[cls]]
        curves[cls] = sorted((c for c in kept if c is not None), key=lambda c: c.source != source)  # kept file first
        notes.append(kinds_set(cls, fit.op, fit.n_ranks, curves[cls]))
    return fits, notes, sources, curves, split


def _file_op(spec) -> tuple[Path, Optional[str]]:
    """(file, its own test) of a ``NCCL_TESTS_OUTPUT`` argument: ``FILE:TEST`` (``old_ag.log:all_gather``)
    names the test of a log without nccl-tests' banner for that file alone (newcomer trial 34 finding 6:
    ``--op`` applies to every such log), where ``FILE:TEST`` itself is not a file and TEST is a test
    meshplan models; else the path as given, None.

    >>> _file_op("logs/old_ag.log:all_gather_perf"), _file_op("logs/ar.log")
    ((PosixPath('logs/old_ag.log'), 'all-gather'), (PosixPath('logs/ar.log'), None))
    """
    path = Path(spec)
    name, colon, test = str(spec).rpartition(":")
    if path.exists() or not colon or not name or "/" in test:
        return path, None
    return Path(name), op_of_test(test, str(spec))


def _op_fits(text: str, name: str, op: str) -> None:
    """ConfigError naming the log ``name`` (without nccl-tests' banner) whose rows do not fit the test
    ``op`` it is read as (:func:`~meshplan.comm.nccl_tests.row_fits`): an all_reduce log read as
    all_gather by an ``--op`` meant for another log."""
    found = row_fits(text, len(hosts_of(text)) or None)
    if found is None or not found[0] or any(TEST_OPS[f] == op for f in found[0]):
        return
    fits, said = found
    tests = " or ".join(f"{f}_perf" for f in fits)
    raise ConfigError(name, f"read as {op} (--op), but its rows ({said}) fit {tests}; --op applies to every log "
                            f"without the banner: give each its own test, {name}:{fits[0]}")


def _read_run(path: Path, link_op: tuple[Optional[str], Optional[str]], asked: Optional[tuple[int, str]], system: Optional[str],
              models: dict[str, str], notes: list[str]
              ) -> tuple[str, LinkFit, list[BenchRow], list[str], int, int, str, Optional[str]]:
    """One nccl-tests file: (link class, its fit (per NIC for a ``nic`` run of several ranks
    per host), rows, hosts, ranks per host, NICs per host, source, why its fit sets no beta
    (:func:`~meshplan.comm.linkfit.latency_bound_reason`, None when it does)); its notes appended to
    ``notes``, its GPU model checked against ``models`` (:func:`_one_gpu`); ``link_op``: ``--link``
    and ``--op`` (the test of a text log without the banner)."""
    link, op = link_op
    text = read_nccl_tests_text(path)
    banner = text.lstrip().startswith("{") or re.search(r"^# Collective test starting:", text, flags=re.M)
    if op is not None and not banner:
        _op_fits(text, path.name, op)
    rows = parse_nccl_tests(text, path.name, None if banner else op)
    hosts = hosts_of(text)
    cls = link_class(hosts, path.name, link, asked, system)
    if link == "nic" and cls != "nic":
        notes.append(f"{path.name}: ran on one host ({hosts[0]}): --link nic is for the runs over several hosts; "
                     f"read as {cls}, the link it crossed")
    per_node = ranks_per_node(hosts, path.name) if cls == "nic" else 1
    nics = nic_split(per_node, path.name, asked) if cls == "nic" else 1
    try:
        fit = fit_alpha_beta(rows, cls)
    except ConfigError as err:
        raise ConfigError(path.name, err.message) from None
    if re.search(r"^# meshplan bench comm \(gloo,", text, flags=re.M):  # bench comm without a GPU
        fit = replace(fit, backend="gloo")
    else:
        fit = replace(fit, gpu=_one_gpu(path.name, gpus_of(text), models))
    notes.append(f"{path.name}: {cls} {fit.op} over {fit.n_ranks} ranks, alpha {fit.latency_s * 1e6:.1f} us, "
                 f"beta {fit.bandwidth_bytes_per_s / 1e9:.2f} GB/s bus bandwidth, rms residual "
                 f"{fit.rms_residual:.2f} ({fit.points} rows)")
    cut = trailer_warning(text, rows, path.name)
    notes += [cut] if cut else []
    why = latency_bound_reason(fit, max(r.size_bytes for r in rows))
    why = f"{why} (the log has no nccl-tests trailer line: cut off)" if why and cut else why
    if per_node > 1:  # per NIC: the host's share of the busbw over its NICs (calibration_kinds.host_share)
        share = host_share(fit.op, fit.n_ranks, per_node)
        fit = replace(fit, bandwidth_bytes_per_s=fit.bandwidth_bytes_per_s * share / nics)
        notes.append(split_note(path.name, fit, per_node, nics, asked, system))
    return cls, fit, rows, hosts, per_node, nics, _source(path, text, rows, hosts), why


def _one_gpu(name: str, gpus: list[str], models: dict[str, str]) -> Optional[str]:
    """The GPU model of file ``name`` whose ranks name ``gpus`` (None when none), after
    ``models`` (model -> first file that named it, updated here) of the files before it; a
    ConfigError naming the file(s) and both models when that makes two.

    >>> seen = {}
    >>> _one_gpu("a.txt", ["NVIDIA H200"] * 8, seen), _one_gpu("b.txt", [], seen)
    ('NVIDIA H200', None)
    >>> _one_gpu("c.txt", ["NVIDIA A100-SXM4-80GB"] * 8, seen)
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: NCCL_TESTS_OUTPUT: two GPU models, NVIDIA H200 (a.txt) and NVIDIA A100-SXM4-80GB (c.txt); a calibration file is for one GPU model: calibrate each model's files into its own --out and give --calibration the one of the cluster's GPU
    """
    own = list(dict.fromkeys(gpus))
    if len(own) > 1:
        raise ConfigError(name, f"its ranks ran on {len(own)} GPU models ({', '.join(own)}); a calibration file is "
                                "for one GPU model: measure one model per nccl-tests run")
    for gpu in own:
        models.setdefault(gpu, name)
    if len(models) > 1:
        said = " and ".join(f"{m} ({f})" for m, f in models.items())
        raise ConfigError("NCCL_TESTS_OUTPUT", f"two GPU models, {said}; a calibration file is for one GPU model: "
                                               "calibrate each model's files into its own --out and give "
                                               "--calibration the one of the cluster's GPU")
    return own[0] if own else None


def _kept_note(cls: str, kept: tuple[LinkFit, str], candidates: list, pool: list) -> str:
    """``nvlink: kept a.txt (all-reduce 180.20 GB/s); dropped b.txt (all-gather 170.00 GB/s: the
    all-reduce fit is kept where there is one, as bench comm does), c.txt (all-reduce 190.00
    GB/s: faster than the kept one; a collective over every link waits for the slowest)``."""
    dropped = []
    for fit, _, name, *_ in candidates:
        if name == kept[1] and fit is kept[0]:
            continue
        why = ("the all-reduce fit is kept where there is one, as bench comm does" if fit.op != kept[0].op
               and kept[0].op == "all-reduce" else "faster than the kept one; a collective over every link waits "
               "for the slowest")
        if cls == "nic" and fit.op != kept[0].op:  # its curve is written, but the kept fit times the ring ops
            why += (f"; its curve is written to the file but times nothing: {kept[1]}'s fit and curve time "
                    f"all-reduce, all-gather and reduce-scatter across nodes")
        dropped.append(f"{name} ({fit_gbs(fit)}: {why})")
    return f"{cls}: kept {kept[1]} ({fit_gbs(kept[0])}); dropped " + ", ".join(dropped)
