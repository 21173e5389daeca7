"""One nccl-tests file of ``meshplan calibrate`` (:mod:`meshplan.comm.calibrate`) read as a run:
its link class (:func:`link_class`), ranks and NICs per host, GPU model (:func:`one_gpu`) and
alpha-beta fit, per NIC for a ``nic`` run of several ranks per host (:func:`read_run`); the
``FILE:TEST`` form of an argument (:func:`file_op`).

Each file is one nccl-tests run. Its link class comes from where its ranks ran (the host
names of the ``#  Rank`` lines, or ``config.devices[].hostname`` in JSON):

- all ranks on one host: ``nvlink`` (the node's fabric);
- one rank per host: ``nic`` (each rank's traffic crosses one NIC: ``mpirun -N 1 ... -g 1``);
- several hosts with several ranks each (an ordinary 2 x 8 all_reduce_perf run): ``nic`` too,
  with a line saying so (``link: nic (ranks on 2 hosts; --link to override)``, newcomer trial
  nc61 #7; it was refused until ``--link nic``); such a run mixes NVLink and NIC hops, and the
  NIC hop is the slow one that its busbw measures. No host names: refused (pass ``link``).
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

Each file's GPU model is what nccl-tests prints after the PCI address of its ``#  Rank``
lines (``device_info`` in JSON; :func:`~meshplan.comm.nccl_tests_run.gpus_of`). Files whose
ranks name two GPU models (an A100 node's run beside an H200 node's) are refused, in one
file or across the files given: a calibration file describes the links of one cluster, whose
GPUs are of one model (:class:`~meshplan.spec.cluster.ClusterSpec`), and the slowest of an
A100 and an H200 NVLink fit is neither machine's. Each link class records that model as
``gpu`` (none when no file names one; never for a gloo run, which ran on CPUs).

``--link nvlink`` or ``pcie`` (links inside one node) on a run over several hosts is refused.
A file ``meshplan bench comm`` wrote from a gloo run (its first line says ``(gloo,``) keeps
``backend = "gloo"``, so that ``--calibration`` refuses it for NCCL links.

>>> link_class(["a", "a", "a", "a"], "x.txt"), link_class(["a", "b"], "x.txt")
('nvlink', 'nic')
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from meshplan.comm.calibrate_nics import nic_split, split_note
from meshplan.comm.calibration_kinds import host_share
from meshplan.comm.linkfit import LINK_CLASSES, LinkFit, fit_alpha_beta, latency_bound_reason
from meshplan.comm.nccl_tests import BenchRow, parse_nccl_tests, read_nccl_tests_text
from meshplan.comm.nccl_tests_program import TEST_OPS, op_of_test, row_fits
from meshplan.comm.nccl_tests_run import gpus_of, hosts_of, trailer_warning
from meshplan.errors import ConfigError



def link_class(hosts: Sequence[str], where: str, link: Optional[str] = None) -> str:
    """``link`` when given (checked: nvlink and pcie are links inside one node, so a run whose
    ``#  Rank`` lines name several hosts is refused for them; ``nic`` on a run whose lines name one
    host is read as ``nvlink``, which it crossed, so one call takes 1-node and 8-node logs), else
    ``nvlink`` for one host and ``nic`` for several (one rank per host, or several each: an ordinary
    2 x 8 all_reduce_perf run, its busbw then split over the NICs of a host, :func:`ranks_per_node`;
    :func:`default_note` says so, newcomer trial nc61 #7); a ConfigError naming ``where`` when the
    lines name no host (which class is not known; see the module docstring).

    >>> link_class(["a"] * 8 + ["b"] * 8, "x.txt"), link_class(["a"] * 8 + ["b"] * 8, "x.txt", "nic")
    ('nic', 'nic')
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
    return "nvlink" if len(per_host) == 1 else "nic"


def default_note(hosts: Sequence[str], where: str, link: Optional[str]) -> Optional[str]:
    """The line saying that a run over several hosts was read as ``nic`` without ``--link``
    (:func:`link_class`), None where ``--link`` was given or the ranks ran on one host.

    >>> default_note(["a"] * 8 + ["b"] * 8, "x.txt", None)
    'x.txt: link: nic (ranks on 2 hosts; --link to override)'
    >>> default_note(["a"] * 8, "x.txt", None), default_note(["a", "b"], "x.txt", "nic")
    (None, None)
    """
    n = len(set(hosts))
    return f"{where}: link: nic (ranks on {n} hosts; --link to override)" if link is None and n > 1 else None


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


def file_op(spec) -> tuple[Path, Optional[str]]:
    """(file, its own test) of a ``NCCL_TESTS_OUTPUT`` argument: ``FILE:TEST`` (``old_ag.log:all_gather``)
    names the test of a log without nccl-tests' banner for that file alone (newcomer trial 34 finding 6:
    ``--op`` applies to every such log), where ``FILE:TEST`` itself is not a file and TEST is a test
    meshplan models; else the path as given, None.

    >>> file_op("logs/old_ag.log:all_gather_perf"), file_op("logs/ar.log")
    ((PosixPath('logs/old_ag.log'), 'all-gather'), (PosixPath('logs/ar.log'), None))
    """
    path = Path(spec)
    name, colon, test = str(spec).rpartition(":")
    if path.exists() or not colon or not name or "/" in test:
        return path, None
    return Path(name), op_of_test(test, str(spec))


def _own_test_note(name: str, own: str, banner: str) -> str:
    """The note of a ``FILE:TEST`` whose log ``name`` names its test (``banner``, the op its
    ``# Collective test starting`` line or ``-J`` JSON's args name, which reads it) as ``own`` does;
    a ConfigError naming ``FILE:TEST`` where it names another (newcomer trial 54: ``all_gather_2n.txt:
    reduce_scatter`` was read as all-gather without a word). ``FILE:TEST`` is for a log without the banner.

    >>> _own_test_note("ag.txt", "all-gather", "all-gather")
    "ag.txt:all_gather: not used: the log names its test (all_gather_perf) in its '# Collective test starting' line (or -J JSON's args), which reads it"
    >>> _own_test_note("ag.txt", "reduce-scatter", "all-gather")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: ag.txt:reduce_scatter: the log names all_gather_perf in its '# Collective test starting' line (or -J JSON's args), which reads it; FILE:TEST is for a log without that line: drop ':reduce_scatter'
    """
    stem = {v: k for k, v in TEST_OPS.items()}
    where, test = f"{name}:{stem.get(own, own)}", f"{stem.get(banner, banner)}_perf"
    said = "its '# Collective test starting' line (or -J JSON's args), which reads it"
    if own != banner:
        raise ConfigError(where, f"the log names {test} in {said}; FILE:TEST is for a log without that line: drop "
                                 f"':{stem.get(own, own)}'")
    return f"{where}: not used: the log names its test ({test}) in {said}"


def _op_fits(text: str, name: str, op: str) -> None:
    """ConfigError naming the log ``name`` (without nccl-tests' banner) whose rows do not fit the test
    ``op`` it is read as (:func:`~meshplan.comm.nccl_tests_program.row_fits`): an all_reduce log read as
    all_gather by an ``--op`` meant for another log."""
    found = row_fits(text, len(hosts_of(text)) or None)
    if found is None or not found[0] or any(TEST_OPS[f] == op for f in found[0]):
        return
    fits, said = found
    tests = " or ".join(f"{f}_perf" for f in fits)
    raise ConfigError(name, f"read as {op} (--op), but its rows ({said}) fit {tests}; --op applies to every log "
                            f"without the banner: give each its own test, {name}:{fits[0]}")


def read_run(path: Path, link_op: tuple[Optional[str], Optional[str]], asked: Optional[tuple[int, str]], system: Optional[str],
             models: dict[str, str], notes: list[str], own: Optional[str] = None
             ) -> tuple[str, LinkFit, list[BenchRow], list[str], int, int, str, Optional[str]]:
    """One nccl-tests file: (link class, its fit (per NIC for a ``nic`` run of several ranks
    per host), rows, hosts, ranks per host, NICs per host, source, why its fit sets no beta
    (:func:`~meshplan.comm.linkfit.latency_bound_reason`, None when it does)); its notes appended to
    ``notes``, its GPU model checked against ``models`` (:func:`one_gpu`); ``link_op``: ``--link``
    and ``--op`` (the test of a text log without the banner); ``own``: the file's own ``FILE:TEST``
    (:func:`file_op`), which on a log with the banner is noted as unused or refused
    (:func:`_own_test_note`)."""
    link, op = link_op
    text = read_nccl_tests_text(path)
    banner = text.lstrip().startswith("{") or re.search(r"^# Collective test starting:", text, flags=re.M)
    if op is not None and not banner:
        _op_fits(text, path.name, op)
    rows = parse_nccl_tests(text, path.name, None if banner else op)
    if own is not None and banner:
        notes.append(_own_test_note(path.name, own, rows[0].op))
    hosts = hosts_of(text)
    cls = link_class(hosts, path.name, link)
    said = default_note(hosts, path.name, link)
    notes += [said] if said else []
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
        fit = replace(fit, gpu=one_gpu(path.name, gpus_of(text), models))
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


def one_gpu(name: str, gpus: list[str], models: dict[str, str]) -> Optional[str]:
    """The GPU model of file ``name`` whose ranks name ``gpus`` (None when none), after
    ``models`` (model -> first file that named it, updated here) of the files before it; a
    ConfigError naming the file(s) and both models when that makes two.

    >>> seen = {}
    >>> one_gpu("a.txt", ["NVIDIA H200"] * 8, seen), one_gpu("b.txt", [], seen)
    ('NVIDIA H200', None)
    >>> one_gpu("c.txt", ["NVIDIA A100-SXM4-80GB"] * 8, seen)
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
