"""What ``meshplan bench comm`` (:mod:`meshplan.runtime.bench.comm`) writes from the worker's
``raw.json``, atomically, into ``--out``: nccl-tests text per collective and link class
(:func:`nccl_tests_text`), the send/recv bandwidth matrix between every two ranks with its fast
domains (:func:`pairs_text`, :func:`fast_domains`), and ``calibration.toml``, alpha-beta per link
class (:func:`fit_link`, from a knee up when the times jump: :func:`knee_sizes`); all in
:func:`write_results`. No torch: pure functions of the raw measurements."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

from meshplan.atomic_write import write_json_atomic, write_text_atomic
from meshplan.comm.alphabeta import busbw_factor
from meshplan.comm.calibration import calibration_toml, measured_over
from meshplan.comm.linkfit import LinkFit, fit_alpha_beta
from meshplan.comm.nccl_tests import BenchRow, float_str, parse_nccl_tests_text
from meshplan.comm.nccl_tests_run import gpus_of
from meshplan.errors import ConfigError

#: meshplan op -> nccl-tests program (the "Collective test starting" name).
BENCH_OPS = {"all-reduce": "all_reduce_perf", "all-gather": "all_gather_perf",
             "reduce-scatter": "reduce_scatter_perf", "all-to-all": "alltoall_perf"}


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
