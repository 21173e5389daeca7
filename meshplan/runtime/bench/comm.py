"""``meshplan bench comm``: measure collectives and pairwise send/recv on the machine at hand
(or on the netns testbed), print them in nccl-tests' format, fit alpha and beta per link
class and write a calibration file meshplan reads (:mod:`meshplan.comm.calibration`).

Flow: :func:`run_bench` launches :mod:`meshplan.runtime.bench.comm_worker` with torchrun
(``--standalone``: a free port; or one torchrun per testbed node namespace), the worker's
rank 0 writes ``raw.json``; this module then writes, atomically, into ``--out``:

- ``<test>.<link>.txt``: nccl-tests text (``all_reduce_perf.nvlink.txt``...), one row per
  size with nccl-tests' columns size (B), count (elements), type, redop, root, time (us),
  algbw (GB/s), busbw (GB/s), #wrong. One measurement per row: torch's ``all_reduce`` works
  in place, the other collectives out of place, so the in-place block is not printed.
  ``busbw = algbw * busbw_factor(op, n)`` (nccl-tests doc/PERFORMANCE.md; :mod:`meshplan.comm.alphabeta`).
- ``calibration.toml``: alpha-beta per link class fitted with
  :func:`meshplan.comm.linkfit.fit_alpha_beta` on the all-reduce rows read back from the text
  files, beta from a knee up when the times jump (:func:`fit_link`) (the other ops' fits are printed).
- ``pairs.txt`` / ``pairs.json``: one-way send/recv bandwidth between every two ranks (GB/s),
  the fast domains it shows and whether they agree with the node placement.

Link classes (calibration's names): ``nvlink`` = the node's internal fabric (on a CPU
machine: loopback TCP through gloo, labelled so in the text files, the notes and
``calibration.toml``'s ``backend = "gloo"``, which only a gloo cluster accepts), ``nic`` = one rank per node across the testbed's
rate-limited veth links, one group per NIC. On a testbed with ``K`` NICs per node, local
rank ``i`` uses NIC ``i mod K`` (:func:`meshplan.runtime.testbed.nics.apply_local_nic`, as
``validate --testbed`` places ranks), so the ``nic`` groups and the pairs measure every rail
(a pair on two rails crosses the spine); with several NICs each NIC's group has its own
files (``all_reduce_perf.nic.nic1.txt``) and calibration.toml takes the slowest NIC's fit.

>>> parse_sizes("1K..8K")
[1024, 2048, 4096, 8192]
>>> chunked(1000, 4)      # float32 elements, a multiple of n: nccl-tests rounds down the same way
(248, 992)
>>> bench_groups([0, 0, 1, 1])
[('nvlink', (0, 1)), ('nic', (0, 2))]
>>> bench_groups([0, 0, 1, 1], nic_of_rank=["nic0", "nic1", "nic0", "nic1"])
[('nvlink', (0, 1)), ('nic', (0, 2)), ('nic', (1, 3))]
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from meshplan.atomic_write import write_json_atomic, write_text_atomic
from meshplan.comm.alphabeta import busbw_factor
from meshplan.comm.calibration import calibration_toml, measured_over
from meshplan.comm.linkfit import LinkFit, fit_alpha_beta
from meshplan.comm.nccl_tests import BenchRow, float_str, gpus_of, parse_nccl_tests_text
from meshplan.errors import ConfigError
from meshplan.fileio import staged_folder
from meshplan.runtime.testbed.launch import launch_per_node, torchrun_argv
from meshplan.runtime.testbed.netns import require_testbed
from meshplan.runtime.testbed.nics import bind_shim, node_env

#: meshplan op -> nccl-tests program (the "Collective test starting" name).
BENCH_OPS = {"all-reduce": "all_reduce_perf", "all-gather": "all_gather_perf",
             "reduce-scatter": "reduce_scatter_perf", "all-to-all": "alltoall_perf"}
#: Said before and after a run without a GPU: what gloo measured, and what its calibration is for.
GLOO_HEADLINE = ("no GPU: measured torch gloo over TCP on the CPU (loopback inside a host, the testbed's veth "
                 "between its nodes), not NVLink or a NIC; the link classes keep the calibration file's names, "
                 "marked backend = \"gloo\", and --calibration takes it only for a gloo cluster (the CPU testbed)")
MAX_SIZE_BYTES = 1 << 30          # 1 GiB: the worker holds about 2x this per rank
MAX_RANKS = 64
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``64M`` -> 67108864 (binary K/M/G as nccl-tests' -b/-e); ConfigError when malformed."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text), flags=re.I)
    if not m:
        raise ConfigError("--sizes", f"bad size {text!r}; use bytes or K/M/G, e.g. 1K..64M")
    return int(m[1]) * _UNITS[m[2].upper()]


def parse_sizes(text: str) -> list[int]:
    """``LO..HI`` (doubling, as nccl-tests -f 2) or a comma list; each in [4 B, 1 GiB]."""
    if ".." in text:
        lo, hi = (parse_size(x) for x in text.split("..", 1))
        if lo < 1 or hi < lo:
            raise ConfigError("--sizes", f"{text!r}: need 0 < LO <= HI")
        sizes = [lo << k for k in range(64) if lo << k <= hi]
    else:
        sizes = sorted({parse_size(x) for x in text.split(",") if x.strip()})
    bad = [s for s in sizes if not 4 <= s <= MAX_SIZE_BYTES]
    if not sizes or bad:
        raise ConfigError("--sizes", f"sizes must lie in 4 B..1G (got {bad or 'none'}); e.g. 1K..64M")
    return sizes


def chunked(size_bytes: int, n: int) -> tuple[int, int]:
    """(float32 elements, bytes) of a full buffer of at most ``size_bytes`` that splits into
    ``n`` equal chunks (at least one element each)."""
    count = max(size_bytes // 4 // n, 1) * n
    return count, count * 4


def bench_groups(node_of_rank: Sequence[int], nic_of_rank: Optional[Sequence] = None
                 ) -> list[tuple[str, tuple[int, ...]]]:
    """Groups measured: node 0's ranks (``nvlink``) when it has two or more, and for each
    NIC (in order of first use; all one NIC when ``nic_of_rank`` is None) the first rank on
    that NIC of every node (``nic``) when two or more nodes have one."""
    nodes = sorted(set(node_of_rank))
    nics = list(nic_of_rank) if nic_of_rank is not None else [None] * len(node_of_rank)
    out = []
    local = tuple(r for r, nd in enumerate(node_of_rank) if nd == nodes[0])
    if len(local) > 1:
        out.append(("nvlink", local))
    for nic in dict.fromkeys(nics):
        on_nic = list(zip(node_of_rank, nics))
        ranks = tuple(on_nic.index((nd, nic)) for nd in nodes if (nd, nic) in on_nic)
        if len(ranks) > 1:
            out.append(("nic", ranks))
    return out


def file_tag(entry: dict, raw: dict) -> str:
    """``<link>`` in the result file names, ``<link>.<nic>`` for a ``nic`` group when the run
    measured several NICs (``all_reduce_perf.nic.nic1.txt``)."""
    nics = {e.get("nic") for e in raw["collectives"] if e["link"] == entry["link"]}
    return f"{entry['link']}.{entry['nic']}" if len(nics) > 1 and entry.get("nic") else entry["link"]


# --------------------------------------------------------------------------- nccl-tests text




_HEAD = "# " + "  ".join("{:>%d}" % w for w in (10, 12, 8, 6, 6, 7, 6, 6, 6))


def nccl_tests_text(entry: dict, raw: dict) -> str:
    """nccl-tests stdout for one ``raw.json`` collectives entry ({op, link, ranks, rows})."""
    op, ranks, program = entry["op"], entry["ranks"], BENCH_OPS[entry["op"]]
    n, sizes = len(ranks), [r["size_bytes"] for r in entry["rows"]]
    redop = "sum" if op in ("all-reduce", "reduce-scatter") else "none"
    on = f" on {entry['nic']} of every node" if entry.get("nic") else ""
    lines = [f"# meshplan bench comm ({raw['backend']}, torch.distributed), link class "
             f"{measured_over(entry['link'], raw['backend'])}{on}",
             f"# Collective test starting: {program}",
             f"# nThread 1 nGpus 1 minBytes {min(sizes)} maxBytes {max(sizes)} step: 2(factor) warmup iters: "
             f"{raw['warmup']} iters: {raw['iters']} agg iters: 1 validation: 1 graph: 0", "#", "# Using devices"]
    for i, r in enumerate(ranks):
        info = raw["ranks"][r]
        where = f"node {info['node']}" + (f" {info['nic']}" if info.get("nic") else "")
        lines.append(f"#  Rank {i:2d} Group  0 Pid {info['pid']:6d} on {info['host']:>10s} device {r:2d} "
                     f"[{where}] {info['device']} (global rank {r})")
    lines += ["#", f"# {'':>10s}  {'':>12s}  {'':>8s}  {'':>6s}  {'':>6s}           measured",
              _HEAD.format("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"),
              _HEAD.format("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "")]
    total = 0.0
    for row in entry["rows"]:
        algbw = row["size_bytes"] / row["time_s"] / 1e9
        busbw = algbw * busbw_factor(op, n)
        total += busbw
        lines.append(f"{row['size_bytes']:12d}  {row['count']:12d}  {'float':>8s}  {redop:>6s}  {-1:6d}  "
                     f"{float_str(row['time_s'] * 1e6, 7)}  {float_str(algbw, 6)}  {float_str(busbw, 6)}  "
                     f"{row['wrong']:6d}")
    bad = sum(r["wrong"] for r in entry["rows"])
    lines += [f"# {'Out of bounds values':<20s} : {bad} {'OK' if bad == 0 else 'FAILED'}",
              f"# {'Avg bus bandwidth':<20s} : {total / max(len(entry['rows']), 1):g} ", "#",
              f"# Collective test concluded: {program}", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- pairs


def fast_domains(bandwidth: Sequence[Sequence[float]], min_gap: float = 4.0) -> list[list[int]]:
    """Ranks joined by fast links (connected components). The pair bandwidths, sorted, are
    split at their largest ratio between neighbours when it is at least ``min_gap`` (link
    classes differ by 5x or more: loopback against a 200 Mbit/s veth, NVLink against a NIC;
    run-to-run noise on a loaded CPU host stays under about 3x); otherwise all are one class.

    >>> fast_domains([[0, 9, 1, 1], [9, 0, 1, 1], [1, 1, 0, 8], [1, 1, 8, 0]])
    [[0, 1], [2, 3]]
    >>> fast_domains([[0, 3, 1], [3, 0, 2], [1, 2, 0]])
    [[0, 1, 2]]
    """
    n = len(bandwidth)
    values = sorted({bandwidth[i][j] for i in range(n) for j in range(n) if i != j and bandwidth[i][j] > 0})
    cut = values[0] if values else float("inf")
    if len(values) > 1:
        ratio, k = max((values[k + 1] / values[k], k) for k in range(len(values) - 1))
        cut = values[k + 1] if ratio >= min_gap else values[0]
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i in range(n):
        for j in range(i + 1, n):
            if bandwidth[i][j] >= cut:
                parent[root(j)] = root(i)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values())


def pairs_text(raw: dict) -> tuple[str, list[list[float]]]:
    """The bandwidth matrix (GB/s, one-way) as text, with the fast domains against the nodes;
    and the matrix in bytes/s."""
    p, nodes = raw["pairs"], [r["node"] for r in raw["ranks"]]
    n = len(nodes)
    bw = [[p["size_bytes"] / t if t > 0 else 0.0 for t in row] for row in p["one_way_s"]]
    lines = [f"# meshplan bench comm: send/recv ping-pong of {p['size_bytes']} B x {p['iters']}, one-way "
             f"bandwidth (GB/s), row rank -> column rank; backend {raw['backend']}",
             "# node of rank: " + " ".join(str(x) for x in nodes)]
    if any(r.get("nic") for r in raw["ranks"]):
        lines.append("# NIC of rank: " + ", ".join(f"{r['rank']} {r['nic']} {r['addr']}" for r in raw["ranks"]))
    lines.append("rank " + "".join(f"{j:>8d}" for j in range(n)))
    lines += [f"{i:4d} " + "".join(f"{bw[i][j] / 1e9:8.3f}" for j in range(n)) for i in range(n)]
    domains = fast_domains(bw)
    by_node = sorted([r for r in range(n) if nodes[r] == nd] for nd in sorted(set(nodes)))
    lines += [f"# fast domains (split at a >= 4x gap between pair bandwidths): {domains}",
              f"# ranks per node (placement): {by_node}: " + ("agrees" if domains == by_node else "DISAGREES")]
    return "\n".join(lines) + "\n", bw


# --------------------------------------------------------------------------- results


def knee_sizes(rows: Sequence[BenchRow], jump: float = 2.0) -> list[int]:
    """Sizes S_j whose time grew more than ``jump`` x the size ratio from some smaller size
    S_i (t_j / t_i > jump * S_j / S_i), ascending. An alpha-beta line ``t = a + S/b``
    (a, b >= 0) grows at most as fast as S, so such growth is a model break: below it a
    buffer or a rate limiter's burst (the testbed's tbf, TCP socket buffers) absorbs the
    message. Pairs, not only neighbours, so that a knee spread over two doublings is found.

    >>> rows = [BenchRow("all-reduce", 2, s, t, 0, 0) for s, t in ((1, 1.0), (2, 1.1), (4, 3.5), (8, 9.0), (16, 18.0))]
    >>> knee_sizes(rows)
    [8, 16]
    """
    pts = sorted((r.size_bytes, r.time_s) for r in rows)
    return sorted({sj for i, (si, ti) in enumerate(pts) for sj, tj in pts[i + 1:] if ti > 0 and tj / ti > jump * sj / si})


POOR_FIT_RMS = 0.15
"""rms relative residual above which a fit is reported as poor: a clean nccl-tests curve fits
an alpha-beta line to a few percent."""


def fit_link(rows: Sequence[BenchRow], link: str) -> tuple[LinkFit, str]:
    """:func:`fit_alpha_beta` on all rows, unless the times break the model
    (:func:`knee_sizes`): then beta comes from the fit on the sizes from a knee up (the
    sustained rate; of the knees with at least three sizes from it and one below, the
    smallest whose fit's rms residual is within 0.02 of the lowest, since noise on small
    messages also makes knees),
    and alpha is the fastest time below the knee (the latency floor; there messages move at
    the burst's speed, not at beta, and the time hardly depends on the size). Returns the fit and a note saying which rows were used."""
    sizes = sorted({r.size_bytes for r in rows})
    fits = {}
    for knee in knee_sizes(rows):
        if len([s for s in sizes if s >= knee]) >= 3 and sizes[0] < knee:
            try:
                fits[knee] = fit_alpha_beta(list(rows), link, min_size_bytes=knee)
            except ConfigError:
                continue
    if not fits:
        whole = fit_alpha_beta(list(rows), link)
        if whole.rms_residual > POOR_FIT_RMS:
            return whole, (f"all sizes, a poor fit (rms {whole.rms_residual:.2f}): measure larger sizes, "
                           "at least three past the largest jump in time (--sizes)")
        return whole, "all sizes"
    best = min(f.rms_residual for f in fits.values())
    knee = min(k for k, f in fits.items() if f.rms_residual <= best + 0.02)     # ties: more points
    alpha = min(r.time_s for r in rows if r.size_bytes < knee)
    fit = replace(fits[knee], latency_s=alpha, points=len(rows))
    return fit, f"beta from sizes >= {knee} B (time jumps there), alpha = fastest time below"


def write_results(out: Path, raw: dict, source: str) -> tuple[list[str], list[LinkFit], list[str]]:
    """Write the nccl-tests text files, pairs and calibration.toml from ``raw``; returns the
    printed text blocks, the all-reduce fits (one per link class: of several NICs' ``nic``
    fits the slowest, since a collective over every rail waits for it) and notes on the fits."""
    blocks, notes = [], []
    by_link: dict = {}
    for entry in raw["collectives"]:
        if not entry["rows"]:
            continue
        text, name = nccl_tests_text(entry, raw), f"{BENCH_OPS[entry['op']]}.{file_tag(entry, raw)}.txt"
        write_text_atomic(out / name, text)
        blocks.append(text)
        over = measured_over(entry["link"], raw["backend"]) + (f" {entry['nic']}" if entry.get("nic") else "")
        try:
            fit, used = fit_link(parse_nccl_tests_text(text, source=name), entry["link"])
        except ConfigError as err:
            notes.append(f"{entry['op']} over {over}: no fit ({err})")
            continue
        gpus = gpus_of(text) if raw["backend"] != "gloo" else []  # the GPU model calibration.toml records
        fit = replace(fit, gpu=gpus[0] if gpus else None)
        notes.append(f"{entry['op']:>14s} over {over:<6s} ({len(entry['ranks'])} ranks): alpha "
                     f"{fit.latency_s * 1e6:9.1f} us, beta {fit.bandwidth_bytes_per_s / 1e9:8.3f} GB/s bus bandwidth, "
                     f"rms residual {fit.rms_residual:.2f}, {used}")
        if entry["op"] == "all-reduce":
            by_link.setdefault(entry["link"], []).append((fit, over))
    fits = []
    for link, candidates in by_link.items():
        fit, over = min(candidates, key=lambda c: c[0].bandwidth_bytes_per_s)
        fits.append(fit)
        if len(candidates) > 1:
            notes.append(f"calibration.toml {link}: the slowest of {len(candidates)} NICs' all-reduce fits ({over})")
    text, bw = pairs_text(raw)
    write_text_atomic(out / "pairs.txt", text)
    write_json_atomic(out / "pairs.json", {"size_bytes": raw["pairs"]["size_bytes"], "bandwidth_bytes_per_s": bw,
                                           "node_of_rank": [r["node"] for r in raw["ranks"]],
                                           "nic_of_rank": [r.get("nic") for r in raw["ranks"]]})
    blocks.append(text)
    if fits:
        write_text_atomic(out / "calibration.toml", calibration_toml(fits, source, raw["backend"]))
    return blocks, fits, notes


# --------------------------------------------------------------------------- launch


def worker_argv(out: Path, sizes: Sequence[int], iters: int, warmup: int, budget_s: float, pair_size: int,
                timeout_s: float) -> list[str]:
    """Arguments of :mod:`meshplan.runtime.bench.comm_worker` after ``torchrun ... -m``."""
    return ["meshplan.runtime.bench.comm_worker", "--out", str(out), "--sizes", ",".join(map(str, sizes)),
            "--iters", str(iters), "--warmup", str(warmup), "--budget-s", str(budget_s),
            "--pair-size", str(pair_size), "--timeout-s", str(timeout_s)]


def _run_local(nproc: int, wargs: list[str], out: Path, timeout_s: float) -> None:
    """torchrun --standalone (a free port) in its own process group; killed at the deadline."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--max-restarts=0", "-m", *wargs]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(out / "bench.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(0.5)
            proc.wait()
    if rc != 0:
        tail = (out / "bench.log").read_text(errors="replace").strip().splitlines()[-8:]
        why = f"timed out after {timeout_s:g} s" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"bench comm workers {why}; the last lines of bench.log:\n" + "\n".join(tail))


def _run_testbed(prefix: str, nproc: int, wargs: list[str], out: Path, timeout_s: float, state_dir=None) -> str:
    """One torchrun per node namespace of testbed ``prefix`` (static rendezvous at node 0 nic0);
    each worker picks its NIC from the node's addresses (local rank i on nic<i mod K>), its
    connecting sockets bound there by the LD_PRELOAD library. Returns a note on the NICs."""

    tb = require_testbed(prefix, "--testbed", state_dir)
    shim, note = bind_shim()
    envs = [{"OMP_NUM_THREADS": "1", **node_env(tb, i, shim)} for i in range(tb.nodes)]
    res = launch_per_node(tb, lambda i: torchrun_argv(tb, i, nproc, ["-m", *wargs]), timeout_s,
                          env_for_node=envs.__getitem__, log_dir=out / "logs")
    if not res.ok:
        raise RuntimeError(f"bench comm on testbed '{prefix}': {res.message}")
    return (f"testbed '{prefix}': {tb.nodes} nodes x {nproc} ranks, {tb.nics_per_node} NIC(s) per node, "
            f"local rank i on nic<i mod {tb.nics_per_node}>; {note}")


def run_bench(nproc: int, sizes: Sequence[int], out, *, testbed: Optional[str] = None, iters: int = 20,
              warmup: int = 2, budget_s: float = 0.2, pair_size: Optional[int] = None,
              timeout_s: float = 600.0, testbed_state_dir=None, echo=print, force: bool = False) -> list[LinkFit]:
    """Measure, write every file into ``out`` and print them; returns the all-reduce fits.
    ``out`` is built under a temporary name and renamed into place at the end
    (:func:`meshplan.fileio.staged_folder`): an existing non-empty ``out`` is refused before
    the run unless ``force`` (ConfigError naming --out), and a failed or interrupted run
    leaves neither a partial folder nor an earlier result behind.
    ``nproc``: ranks (per node on a testbed). Raises ConfigError for bad arguments and
    RuntimeError when the workers fail or time out. ``testbed_state_dir``: where ``testbed
    up`` wrote its state (default $MESHPLAN_TESTBED_DIR or /tmp/meshplan-testbed)."""
    low = 1 if testbed else 2                 # on a testbed, one rank per node still makes a nic group
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not low <= nproc <= MAX_RANKS:
        raise ConfigError("--nproc", f"{nproc!r} ranks; use {low}..{MAX_RANKS}")
    if not 1 <= iters <= 1000 or not 0 <= warmup <= 100 or not 0 < budget_s <= 60:
        raise ConfigError("--iters", f"iters {iters} (1..1000), warmup {warmup} (0..100), budget {budget_s} s (0..60]")
    dest = Path(out)
    with staged_folder(dest, "--out", force) as out:
        fits = _measure(nproc, sizes, out, testbed, iters, warmup, budget_s, pair_size, timeout_s, testbed_state_dir,
                        echo)
    echo(f"wrote {dest} (nccl-tests text, pairs, calibration.toml)")
    return fits


def _measure(nproc: int, sizes: Sequence[int], out: Path, testbed: Optional[str], iters: int, warmup: int,
             budget_s: float, pair_size: Optional[int], timeout_s: float, testbed_state_dir, echo) -> list[LinkFit]:
    """The run of :func:`run_bench` into the (temporary) folder ``out``."""
    pair = min(pair_size or max(sizes), MAX_SIZE_BYTES)
    wargs = worker_argv(out.resolve(), sizes, iters, warmup, budget_s, pair, timeout_s)
    t0 = time.monotonic()
    if testbed is None:
        _run_local(nproc, wargs, out, timeout_s)
    else:
        echo(_run_testbed(testbed, nproc, wargs, out, timeout_s, testbed_state_dir))
    raw = json.loads((out / "raw.json").read_text(encoding="utf-8"))
    if raw["backend"] == "gloo":
        echo(GLOO_HEADLINE)
    nodes = len({r["node"] for r in raw["ranks"]})
    source = (f"meshplan bench comm {time.strftime('%Y-%m-%d')}, {raw['world']} ranks on {nodes} node(s), "
              f"{raw['backend']}" + (f", testbed {testbed}" if testbed else f", host {raw['ranks'][0]['host']}"))
    blocks, fits, notes = write_results(out, raw, source)
    for b in blocks:
        echo(b)
    for line in notes:
        echo(line)
    if raw["backend"] == "gloo":
        echo(GLOO_HEADLINE)  # again after the tables, where the fits are read
    echo(f"measured in {time.monotonic() - t0:.1f} s")
    return fits
