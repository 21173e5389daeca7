"""``meshplan calibrate``: a user's own nccl-tests outputs (text or ``-J`` JSON, parsed by
:mod:`meshplan.comm.nccl_tests`) into the calibration file ``--calibration`` reads, the same
TOML that ``meshplan bench comm`` writes (:func:`~meshplan.comm.calibration.calibration_toml`).

Each file is one nccl-tests run, read by :mod:`meshplan.comm.calibrate_file`: its link class
(``nvlink`` for one host, ``nic`` for one rank per host, a run of several ranks per host on
several hosts refused unless ``link`` says ``nic``, its busbw then split over the NICs of a
host), its GPU model (one model across the files) and its alpha-beta fit.

A ``nic`` fit (per NIC, after the split) above the line rate of every NIC of the catalog nodes
of its GPU model (of every catalog node when the model is not known; of the node ``system``
names when given) gets a ``warning:`` line (:func:`~meshplan.comm.calibrate_nics.nic_warning`): a NIC carries at most its
line rate, so each rank drove several NICs (hosts missing from its ``#  Rank`` lines, or fewer
NICs per host given than the ranks drove) or the measured nodes' NICs are faster than the
catalog's.

Per link class, one alpha-beta fit (:func:`~meshplan.comm.linkfit.fit_alpha_beta`) per
file; the class keeps the all-reduce fit when there is one (as ``bench comm`` does), and of
several the slowest bus bandwidth (a collective over every rail waits for the slowest NIC), the
files' order playing no part but between equal fits;
its ``source`` names that file, and a note names each dropped file with its fit and why (on
``nic`` every ring run, of any ring op, is a rival: one fit times the three ring ops).
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
place of NCCL's latency.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from pydantic import ValidationError

from meshplan.comm.calibrate_file import file_op, read_run
from meshplan.comm.calibrate_nics import (asked_nics, catalog_nic_gb_per_s, curve_nic_warning, fit_gbs, nic_warning,
                                         system_gpu_warning)
from meshplan.comm.calibrate_table import DROP_OTHER_OP, DROP_FASTER, run_table
from meshplan.comm.calibration_kinds import RING_OPS, kinds_set, read_rate
from meshplan.comm.linkfit import LinkFit
from meshplan.comm.nccl_tests import BenchRow
from meshplan.comm.nccl_tests_program import op_of_test
from meshplan.errors import ConfigError
from meshplan.spec.cluster import BusbwCurve
from meshplan.units import GB, US, human_bytes


#: The ops a measured curve can be (:class:`~meshplan.spec.cluster.BusbwCurve`'s ``op``).
CURVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send/recv")


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
    """:func:`calibrate_runs` without its table of runs."""
    fits, notes, sources, curves, split, _ = calibrate_runs(paths, link, nics_per_host, system, op)
    return fits, notes, sources, curves, split


def calibrate_runs(paths: Sequence[Path], link: Optional[str] = None, nics_per_host: Optional[int] = None,
                   system: Optional[str] = None, op: Optional[str] = None
                   ) -> tuple[list[LinkFit], list[str], dict[str, str], dict[str, list[BusbwCurve]], dict[str, int],
                              list[dict]]:
    """:func:`calibrate`'s fits, notes and sources, per link class each file's measured curve
    (:func:`measured_curve`, read against the class's kept fit x the NICs of its run's host),
    and ``{"nic": N}`` when the kept ``nic`` run's busbw was split over N NICs per host other
    than its ranks per host (``nics_per_host`` or ``system``'s, :func:`~meshplan.comm.calibrate_nics.nic_split`; the
    calibration file's ``nics_per_node``). Raises ConfigError naming the file for unreadable
    or unusable input, or the option for a bad NIC count. ``op`` (``--op``): the test of the text
    logs without nccl-tests' ``# Collective test starting`` banner (before 2025-06), a program name
    (``alltoall`` or ``alltoall_perf``) or meshplan's op name; a log with the banner is read by it.
    Last, every file's row of ``--json``'s ``runs``, kept, dropped or not used
    (:func:`~meshplan.comm.calibrate_table.run_table`)."""
    if not paths:
        raise ConfigError("NCCL_TESTS_OUTPUT", "no files; pass nccl-tests outputs (text or -J JSON)")
    op = op_of_test(op, "--op") if op is not None else None
    asked = asked_nics(nics_per_host, system)
    notes: list[str] = []
    by_link, runs, files, models, unused = _read_files(paths, (link, op), asked, system, notes)
    notes += [w for w in [system_gpu_warning(system, models)] if w]
    notes.append(column_note(files))
    if nics_per_host is not None and "nic" not in by_link:
        raise ConfigError("--nics-per-host", "no file is recorded as nic (a run over several hosts, or --link "
                                             "nic); drop it, or pass --link nic")
    fits, sources, curves, split = [], {}, {}, {}
    for cls, candidates in by_link.items():  # all of one GPU model (one_gpu), where named
        fit, sources[cls], curves[cls], nics, kept_notes = _kept_class(cls, candidates, runs[cls], asked, system)
        fits.append(fit)
        notes += kept_notes
        split.update({cls: nics} if nics is not None else {})
    return fits, notes, sources, curves, split, run_table(by_link, fits, unused, system)


#: Per link class, its files' fits: (fit, source, file name, ranks per host, NICs per host).
FitsByClass = dict[str, list[tuple[LinkFit, str, str, int, int]]]
#: Per link class, its files' runs: (rows, hosts, NICs per host, source, fitted alpha in us).
RunsByClass = dict[str, list[tuple[list[BenchRow], int, int, str, float]]]


def _read_files(paths: Sequence[Path], link_op: tuple[Optional[str], Optional[str]], asked: Optional[tuple[int, str]],
                system: Optional[str], notes: list[str]
                ) -> tuple[FitsByClass, RunsByClass, list[tuple[str, list[BenchRow]]], dict[str, str],
                           list[tuple]]:
    """Every file of ``paths`` read (:func:`~meshplan.comm.calibrate_file.read_run`; ``link_op``:
    ``--link`` and ``--op``): (per link class its fits and its runs, each file's name and rows for
    :func:`column_note`, GPU model -> the first file that named it, each file whose fit sets no beta:
    (class, name, fit, why, ranks per host, NICs per host)); each file's notes appended to ``notes``, a file whose fit sets no beta
    noted and left out. ConfigError naming the first such
    file of a class no other file sets the beta of."""
    link, op = link_op
    by_link: FitsByClass = {}
    runs: RunsByClass = {}
    models: dict[str, str] = {}  # GPU model -> the first file that named it
    files: list[tuple[str, list[BenchRow]]] = []  # file name, rows: column_note
    latency_bound: dict[str, tuple[str, str]] = {}  # link class -> (file, why) of its first run setting no beta
    unused: list[tuple] = []  # every run setting no beta: (class, file, fit, why, ranks per host, NICs per host)
    used_op = False
    for path, own in map(file_op, paths):
        cls, fit, rows, hosts, per_node, nics, source, why = read_run(path, (link, own or op), asked, system, models,
                                                                      notes, own)
        used_op |= own is None and op is not None and fit.op == op
        if why is not None:  # cut off below the bandwidth-bound sizes: no beta from it (linkfit.latency_bound_reason)
            notes.append(f"{path.name}: not used: {why}")
            latency_bound.setdefault(cls, (path.name, why))
            unused.append((cls, path.name, fit, why, per_node, nics))
            continue
        by_link.setdefault(cls, []).append((fit, source, path.name, per_node, nics))
        runs.setdefault(cls, []).append((rows, len(set(hosts)), nics, source, fit.latency_s / US))
        files.append((path.name, rows))
    for cls, (name, why) in latency_bound.items():
        if cls not in by_link:  # no other file of the class sets its beta
            raise ConfigError(name, f"{why}; pass the whole output, or rerun nccl-tests up to 1 GiB or more (-e 1G)")
    if op is not None and not used_op:
        notes.append(f"--op {op}: read no log (each names its test, or has its own FILE:op)")
    return by_link, runs, files, models, unused


def _kept_class(cls: str, candidates: list[tuple[LinkFit, str, str, int, int]],
                runs: list[tuple[list[BenchRow], int, int, str, float]], asked: Optional[tuple[int, str]],
                system: Optional[str]) -> tuple[LinkFit, str, list[BusbwCurve], Optional[int], list[str]]:
    """What link class ``cls`` keeps of its files' ``candidates`` (:data:`FitsByClass`): (its fit, a
    ring op's where there is one, all-reduce first, the slowest of them; that file's source; the
    curves of its ``runs`` (:data:`RunsByClass`), each read against the fit x its run's NICs per host, the
    kept file's first; the NICs per host the kept ``nic`` run's busbw was split over where they are
    not its ranks per host, else None; its notes: the files dropped, the line-rate warning, the
    kinds it sets)."""
    pool = ([c for c in candidates if c[0].op == "all-reduce"] or [c for c in candidates if c[0].op in RING_OPS]
            or candidates)  # a ring fit sets the class's rate; the other ops' runs their own (curves)
    fit, source, name, per_node, nics = min(pool, key=lambda c: c[0].bandwidth_bytes_per_s)
    notes = []
    # nic: every ring run, the all-reduce's pool or not (one busbw for the three ops); nvlink, pcie: the fit's op
    # alone (other ops are timed on their own runs, calibration_kinds.own_runs)
    rivals = [c for c in candidates if c[0].op == fit.op or (cls == "nic" and {c[0].op, fit.op} <= set(RING_OPS))]
    if len(rivals) > 1:
        notes.append(_kept_note(cls, (fit, name), rivals))
    given = (per_node, nics) if asked is not None and per_node > 1 else None
    notes += [w for w in [nic_warning(fit, name, system, given)] if w]
    kept = [measured_curve(r, k, read_rate(fit.bandwidth_bytes_per_s / GB, per, r[0].op, r[0].n_ranks, k, cls),
                           text, alpha) for r, k, per, text, alpha in runs]
    if cls == "nic" and not any(n.startswith("warning: ") and "line rate" in n for n in notes) and fit.backend != "gloo":
        line = catalog_nic_gb_per_s(fit.gpu, system)
        notes += [w for (r, k, per, text, _), c in zip(runs, kept) if c is not None and (w := curve_nic_warning(
            text.rsplit("file ", 1)[-1], c.op, c.ranks, c.ranks // c.nodes, per, c.busbw_gb_per_s, line))]
    curves = sorted((c for c in kept if c is not None), key=lambda c: c.source != source)  # kept file first
    notes.append(kinds_set(cls, fit.op, fit.n_ranks, curves))
    return fit, source, curves, nics if cls == "nic" and nics != per_node else None, notes


def _kept_note(cls: str, kept: tuple[LinkFit, str], candidates: list) -> str:
    """``nvlink: kept a.txt (all-reduce 180.20 GB/s); dropped b.txt (all-gather 170.00 GB/s: the
    all-reduce fit is kept where there is one, as bench comm does), c.txt (all-reduce 190.00
    GB/s: faster than the kept one; a collective over every link waits for the slowest)``. On
    ``nic`` each fit with its ranks and hosts (per NIC), and a dropped run of another ring op says by
    how much it differs and that its curve times nothing (newcomer trial 51: an all_gather_perf log
    over 4 hosts beside an all_reduce_perf one over 2, 36.34 against 37.32 GB/s per NIC)."""
    dropped = []
    for fit, _, name, per_node, _ in candidates:
        if name == kept[1] and fit is kept[0]:
            continue
        why = DROP_OTHER_OP if fit.op != kept[0].op and kept[0].op == "all-reduce" else DROP_FASTER
        if cls == "nic" and fit.op != kept[0].op:  # its curve is written, but the kept fit times the ring ops
            diff = fit.bandwidth_bytes_per_s / kept[0].bandwidth_bytes_per_s - 1
            why += (f"; {diff:+.1%} against it; NCCL runs the three ring ops on one ring, one busbw (nccl-tests "
                    f"doc/PERFORMANCE.md), so one fit times them: its curve is written to the file but times "
                    f"nothing: {kept[1]}'s fit and curve time all-reduce, all-gather and reduce-scatter across "
                    f"nodes; to time them from {name}, pass it without {kept[1]}")
        dropped.append(f"{name} ({_fit_words(cls, fit, per_node)}: {why})")
    mine = next(c[3] for c in candidates if c[0] is kept[0])
    return f"{cls}: kept {kept[1]} ({_fit_words(cls, kept[0], mine)}); dropped " + ", ".join(dropped)


def _fit_words(cls: str, fit: LinkFit, per_node: int) -> str:
    """A fit as :func:`_kept_note` names it: :func:`~meshplan.comm.calibrate_nics.fit_gbs`, on ``nic``
    with its ranks and hosts (``per_node`` ranks each) and ``per NIC``.

    >>> _fit_words("nic", LinkFit("nic", "all-reduce", 16, 60.3e-6, 37.32e9, 0.0, 0.0, 62), 8)
    'all-reduce over 16 ranks on 2 hosts, 37.32 GB/s per NIC'
    """
    if cls != "nic":
        return fit_gbs(fit)
    return (f"{fit.op} over {fit.n_ranks} ranks on {fit.n_ranks // max(per_node, 1)} hosts, "
            f"{fit.bandwidth_bytes_per_s / 1e9:.2f} GB/s per NIC")
