"""Calibrate the alpha-beta link model from nccl-tests measurements.

Inputs (NVIDIA/nccl-tests):

- Text output: ``#`` lines are headers ("# Collective test starting: all_reduce_perf",
  "#  Rank  0 Group  0 Pid ... device  0 [0000:18:00] NVIDIA H100 80GB HBM3", the column
  names ``size count type redop root time algbw busbw #wrong`` for out-of-place then
  in-place, "# Avg bus bandwidth : ..."); every other line whose first field is an integer
  is a result row. ``time`` is in us, ``algbw``/``busbw`` in GB/s (1e9 B/s). Other lines
  (NCCL INFO logs) are skipped.
- JSON from ``-J FILE`` / ``--output_file FILE`` (nccl-tests src/util.cu, version 2):
  ``{"version": 2, "args": ["./all_reduce_perf", ...], "config": {"nthreads", "ngpus",
  "devices": [...one per process...]}, "results": [{"size", "count", "type", "redop",
  "root", "out_of_place": {"time", "alg_bw", "bus_bw", "nwrong"}, "in_place": {...}}]}``;
  ``time`` becomes ``cpu_time`` with ``-C 1``. Ranks = processes x nthreads x ngpus.

The fit: per link class, least squares on ``t = alpha + bytes_sent / beta`` with
``bytes_sent = busbw_factor(op, n) * size`` (nccl-tests doc/PERFORMANCE.md, see
:mod:`meshplan.comm.alphabeta`), each row divided by its measured time so that small (latency) and
large (bandwidth) messages weigh alike. ``alpha`` is the latency per call of the measured
collective; ``beta`` is the bus bandwidth per rank. A negative ``alpha`` is clamped to 0 and
refitted; a non-positive slope is an error.

Calibration file (TOML, one table per link class ``nvlink``, ``pcie`` or ``nic``)::

    [link.nic]
    latency_us = 20.0            # alpha per call of `op` over `ranks` ranks
    bandwidth_gb_per_s = 40.0    # beta: bus bandwidth per rank (per NIC for "nic")
    op = "all-reduce"
    ranks = 8
    residual = 0.001             # RMS relative residual of the fit
    points = 31
    source = "nccl-tests all_reduce_perf 2026-03-02, 8 nodes x 1 GPU"
    backend = "gloo"             # optional: what measured it when not NCCL (bench comm on a CPU host)

``backend = "gloo"`` (``meshplan bench comm`` without a GPU) says the numbers are torch's gloo
over TCP (loopback inside a host, the testbed's veth links between its nodes), not NVLink or a
NIC: :func:`apply_calibration` refuses them for a cluster whose collectives run on NCCL or RCCL
and applies them to a gloo cluster (the CPU testbed's) only.

``nic`` is meant for runs with one GPU per node, so that each rank's traffic crosses one
NIC. Applying a calibration writes the bandwidth, the per-step latency
``latency_us / steps(op, ranks)`` (the meaning of :class:`LinkSpec.latency_us`) and marks the
class ``calibrated``: :func:`meshplan.comm.alphabeta.collective_time` then times it as
``steps(op', n') * latency_us / steps(op, ranks) + busbw_factor(op', n') * S / beta`` with no
NCCL base latency or protocol choice and no NVLS or tree (the fit holds whatever algorithm
NCCL ran), so the measured op over the measured ranks is predicted at the fit itself
(``latency_us`` per call, never less) and no algorithm beats the fitted bus bandwidth; other
ops and rank counts scale alpha per algorithm step.

>>> rows = [BenchRow("all-reduce", 8, s, 20e-6 + 1.75 * s / 40e9, 0.0, 0.0) for s in (8, 2**20, 2**30)]
>>> fit = fit_alpha_beta(rows, "nic")
>>> round(fit.latency_s * 1e6, 3), round(fit.bandwidth_bytes_per_s / 1e9, 3)
(20.0, 40.0)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from meshplan.comm.alphabeta import OPS, busbw_factor, steps
from meshplan.config import parse_toml
from meshplan.errors import ConfigError
from meshplan.fileio import parse_json, read_text_limited
from meshplan.limits import BOUNDS, FILE_BYTES, MAX_LINE_CHARS, MAX_STRING, MAX_WORLD, bound_message, over
from meshplan.spec.cluster import ClusterSpec
from meshplan.units import GB, US

LINK_CLASSES = ("nvlink", "pcie", "nic")
#: nccl-tests binary stem -> meshplan op name (reduce, gather, scatter are not modelled).
TEST_OPS = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
            "alltoall": "all-to-all", "broadcast": "broadcast", "sendrecv": "send/recv"}


@dataclass(frozen=True)
class BenchRow:
    """One nccl-tests measurement: ``op`` over ``n_ranks`` on a ``size_bytes`` buffer took
    ``time_s`` per call; algbw and busbw in bytes/s as printed."""

    op: str
    n_ranks: int
    size_bytes: int
    time_s: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float
    in_place: bool = False


def _op_name(program: str, where: str) -> str:
    stem = Path(program.strip()).name.removesuffix("_perf").removesuffix("_mpi")
    if program.strip() in OPS:
        return program.strip()
    if stem not in TEST_OPS:
        raise ConfigError(where, f"test '{program}' is not one meshplan models; use one of "
                                 f"{', '.join(k + '_perf' for k in TEST_OPS)}")
    return TEST_OPS[stem]


def _check_ranks(rows: list[BenchRow], where: str) -> list[BenchRow]:
    """busbw / algbw must equal busbw_factor(op, n) (nccl-tests computes it so): catches a
    wrong rank count. Checked on the row with the largest algbw when it is >= 1 GB/s."""
    if not rows:
        raise ConfigError(where, "no result rows; pass the full nccl-tests output")
    best = max(rows, key=lambda r: r.algbw_bytes_per_s)
    if best.algbw_bytes_per_s >= GB:
        ratio, want = best.busbw_bytes_per_s / best.algbw_bytes_per_s, busbw_factor(best.op, best.n_ranks)
        if abs(ratio - want) > 0.02 * want + 0.005:
            raise ConfigError(where, f"busbw/algbw = {ratio:.3f} but {best.op} over {best.n_ranks} ranks gives "
                                     f"{want:.3f}, so the rows were measured over another number of ranks; "
                                     "give the whole output of one run, with every '#  Rank' line")
    return rows


def float_str(value: float, width: int) -> str:
    """nccl-tests getFloatStr: 2 decimals while they fit in ``width``, then 1, then 0, then %e."""
    power, val = 0, 1
    while value >= val:
        power, val = power + 1, val * 10
    if power < width - 2:
        return f"{value:{width}.2f}"
    if power < width - 1:
        return f"{value:{width}.1f}"
    if power < width + 1:
        return f"{value:{width}.0f}"
    return f"{value:{width}.1e}"


def parse_nccl_tests_text(text: str, source: str = "nccl-tests output", op: Optional[str] = None,
                          n_ranks: Optional[int] = None) -> list[BenchRow]:
    """Rows of nccl-tests text output (out-of-place, then in-place, per size). ``op`` and
    ``n_ranks`` (for callers of this function; the CLI has no such options) override what the
    header says ("Collective test starting", "# Rank" lines); without the first, the collective
    is told from the rows (:func:`_op_from_rows`).
    Raises ConfigError naming ``source:line`` for a short row or a missing header."""
    found_op = re.search(r"^# Collective test starting: (\S+)", text, flags=re.M)
    ranks = [int(r) for r in re.findall(r"^#[ \t]+Rank[ \t]+([0-9]{1,9})[ \t]", text, flags=re.M)]
    if ranks and max(ranks) >= MAX_WORLD:
        raise ConfigError(source, f"rank {over('world', max(ranks))}; pass the output unmodified")
    n = n_ranks or (max(ranks) + 1 if ranks else None)
    if op is None and not found_op:
        op = _op_from_rows(text, n, source)
    op = _op_name(op or (found_op[1] if found_op else ""), source)
    if not n:
        raise ConfigError(source, "no '#  Rank <r> Group <g> Pid <p> on <host> device <d> ...' lines, which give "
                                  "the ranks; give the whole output of one nccl-tests run, with its '# Using devices' "
                                  "block")
    cols: list[str] = []
    rows: list[BenchRow] = []
    for ln, line in enumerate(text.splitlines(), 1):
        if len(line) > MAX_LINE_CHARS:
            raise ConfigError(f"{source}:{ln}", f"a line of {len(line)} characters; {over('line', len(line))}")
        tokens = line.split()
        if line.startswith("#") and "busbw" in tokens and "size" in tokens:
            cols = tokens[1:]
            continue
        if not tokens or line.startswith("#") or not re.fullmatch(r"[0-9]{1,16}", tokens[0]):
            continue
        where = f"{source}:{ln}"
        if not cols:
            raise ConfigError(where, "result row before the column header; pass the output unmodified")
        if len(tokens) < len(cols):
            raise ConfigError(where, f"{len(tokens)} fields for {len(cols)} columns; pass the output unmodified")
        rows += _text_row(tokens, cols, op, n, where)
    return _check_ranks(rows, source)


#: What each modelled nccl-tests program prints in a result row (NVIDIA/nccl-tests src/util.cu
#: ``writeBenchmarkLinePreamble`` at a0b82b2, 2.19.6): its redop column ("none" where it reduces
#: nothing: all_gather.cu, alltoall.cu, broadcast.cu, sendrecv.cu pass "none") and whether its
#: root is -1; busbw / algbw is ``busbw_factor(op, n)`` (each program's GetBw).
ROW_SIGNATURE = {"all_reduce": (True, True), "reduce_scatter": (True, True), "all_gather": (False, True),
                 "alltoall": (False, True), "broadcast": (False, False), "sendrecv": (False, True)}

_NO_BANNER = ("no '# Collective test starting' line (e.g. '# Collective test starting: all_reduce_perf'; "
              "nccl-tests prints it since 2025-06, NVIDIA/nccl-tests dafb704)")


def _op_from_rows(text: str, n: Optional[int], source: str) -> str:
    """The program of an nccl-tests text output without its ``# Collective test starting``
    banner (nccl-tests before dafb704, 2025-06-03, never printed it), from what every version
    prints: the column header (``size count type redop root time algbw busbw ...``, the same for
    every program: src/util.cu at a0b82b2, src/common.cu before), so not the header alone,
    but each row's redop and root (:data:`ROW_SIGNATURE`) and busbw / algbw against
    ``busbw_factor(op, n)`` on its row of largest algbw. all_reduce (a reduction, 2(n-1)/n) and
    reduce_scatter ((n-1)/n) are told apart; all_gather and alltoall print the same (none, -1,
    (n-1)/n) and are refused, as is a text without rows or ranks, naming the banner to put back."""
    cols, best = [], None
    for line in text.splitlines():
        tokens = line.split()
        if line.startswith("#") and "busbw" in tokens and "redop" in tokens:
            cols = tokens[1:]
        elif cols and tokens and re.fullmatch(r"[0-9]{1,16}", tokens[0]) and len(tokens) >= len(cols):
            try:
                algbw, busbw = float(tokens[cols.index("algbw")]), float(tokens[cols.index("busbw")])
            except ValueError:
                continue
            if best is None or algbw > best[0]:
                best = (algbw, busbw, tokens[cols.index("redop")], tokens[cols.index("root")])
    if best is None or not n or best[0] <= 0:
        raise ConfigError(source, f"{_NO_BANNER}, and no result rows under the column header with the '#  Rank' "
                                  "lines to tell the collective from; give the whole output of one nccl-tests run, "
                                  "or put that line back at its top")
    algbw, busbw, redop, root = best
    fits = [stem for stem, (reduces, no_root) in ROW_SIGNATURE.items()
            if reduces == (redop != "none") and no_root == (root == "-1")
            and abs(busbw / algbw - busbw_factor(TEST_OPS[stem], n)) <= 0.02 * busbw_factor(TEST_OPS[stem], n) + 0.005]
    if len(fits) != 1:
        which = " and ".join(f"{f}_perf" for f in fits) + " alike" if fits else "no modelled test"
        raise ConfigError(source, f"{_NO_BANNER}; its rows (redop {redop}, root {root}, busbw/algbw "
                                  f"{busbw / algbw:.3f} over {n} ranks) fit {which}; put the line "
                                  "'# Collective test starting: <test>_perf' back at its top")
    return f"{fits[0]}_perf"


def _text_row(tokens: list[str], cols: list[str], op: str, n: int, where: str) -> list[BenchRow]:
    """Out-of-place and in-place rows of one result line."""
    times = [i for i, c in enumerate(cols) if c in ("time", "cputime")]
    algbws = [i for i, c in enumerate(cols) if c == "algbw"]
    busbws = [i for i, c in enumerate(cols) if c == "busbw"]
    out = []
    try:
        size = int(tokens[cols.index("size")]) if "size" in cols else -1
        for k, (t, a, b) in enumerate(zip(times, algbws, busbws)):
            out.append(_checked(BenchRow(op, n, size, float(tokens[t]) * US, float(tokens[a]) * GB,
                                         float(tokens[b]) * GB, in_place=k == 1), where))
    except ValueError as err:
        raise ConfigError(where, f"non-numeric size, time or bandwidth ({str(err)[:60]}); pass the output "
                                 "unmodified") from None
    return out


def _checked(row: BenchRow, where: str) -> BenchRow:
    """``row`` when its numbers are finite, not negative and within the stated bounds."""
    values = (row.time_s, row.algbw_bytes_per_s, row.busbw_bytes_per_s)
    if not all(math.isfinite(v) and v >= 0 for v in values) or not 0 <= row.size_bytes <= 2 ** 50:
        raise ConfigError(where, f"size {row.size_bytes}, time {row.time_s / US} us, algbw and busbw must be "
                                 "finite and not negative (size at most 2^50 B); pass the output unmodified")
    if row.time_s > 1e6 or row.busbw_bytes_per_s > BOUNDS["busbw_gb_per_s"].value * GB:
        raise ConfigError(where, f"time {row.time_s / US:g} us or busbw {row.busbw_bytes_per_s / GB:g} GB/s out of "
                                 "range (at most 1e6 s and 1e6 GB/s); pass the output unmodified")
    return row


def parse_nccl_tests_json(text: str, source: str = "nccl-tests JSON", op: Optional[str] = None,
                          n_ranks: Optional[int] = None) -> list[BenchRow]:
    """Rows of an nccl-tests ``-J`` JSON file (shape in the module docstring)."""
    doc = parse_json(text, source, source, "pass the file nccl-tests -J wrote")
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise ConfigError(source, "no 'results' list; pass the file nccl-tests -J wrote")
    cfg = doc.get("config", {})
    args = doc.get("args") or []
    if not isinstance(cfg, dict) or not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{source}: config", "'config' must be an object and 'args' a list of strings; "
                                               "pass the file nccl-tests -J wrote")
    if op is None and not args:
        raise ConfigError(f"{source}: args", "no program name (e.g. [\"./build/all_reduce_perf\", \"-b\", \"8\"]), "
                                             "which names the collective; pass the file nccl-tests -J wrote")
    op = _op_name(op or args[0], f"{source}: args")
    devices, threads, gpus = cfg.get("devices", []), cfg.get("nthreads", 1), cfg.get("ngpus", 1)
    if not isinstance(devices, list) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 < x <= 1024
                                                for x in (threads, gpus)):
        raise ConfigError(f"{source}: config", "devices must be a list, nthreads and ngpus whole numbers 1..1024; "
                                               "pass the file nccl-tests -J wrote")
    n = n_ranks or len(devices) * threads * gpus
    if not n:
        raise ConfigError(f"{source}: config.devices", "no devices listed, so no ranks; pass the file nccl-tests -J "
                                                       "wrote")
    if n > MAX_WORLD:
        raise ConfigError(f"{source}: config.devices", f"{n} ranks; {over('world', n)}")
    rows = []
    for i, res in enumerate(doc["results"]):
        for key in ("out_of_place", "in_place"):
            part = res.get(key) if isinstance(res, dict) else None
            if part is None:
                continue
            values = [res.get("size"), part.get("time", part.get("cpu_time")), part.get("alg_bw"),
                      part.get("bus_bw")] if isinstance(part, dict) else [None]
            fields = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if len(fields) != 4:
                raise ConfigError(f"{source}: results[{i}].{key}", "needs numeric size, time, alg_bw and bus_bw; "
                                                                   "pass the file -J wrote")
            if not (math.isfinite(fields[0]) and 0 <= fields[0] <= 2 ** 50):
                raise ConfigError(f"{source}: results[{i}].size", "must be 0..2^50 bytes; pass the file -J wrote")
            rows.append(_checked(BenchRow(op, n, int(fields[0]), fields[1] * US, fields[2] * GB, fields[3] * GB,
                                          in_place=key == "in_place"), f"{source}: results[{i}].{key}"))
    return _check_ranks(rows, source)


def read_nccl_tests(path, op: Optional[str] = None, n_ranks: Optional[int] = None) -> list[BenchRow]:
    """Rows from a file: JSON when it starts with ``{``, else text output."""
    return parse_nccl_tests(read_nccl_tests_text(path), Path(path).name, op, n_ranks)


def read_nccl_tests_text(path) -> str:
    """The text of an nccl-tests output file, read with the bounded reader."""
    return read_text_limited(path, "NCCL_TESTS_OUTPUT", FILE_BYTES["nccl_tests"],
                             "pass nccl-tests output (stdout text or -J JSON)")


def parse_nccl_tests(text: str, source: str, op: Optional[str] = None, n_ranks: Optional[int] = None) -> list[BenchRow]:
    """Rows of nccl-tests output ``text``: JSON when it starts with ``{``, else text."""
    parse = parse_nccl_tests_json if text.lstrip().startswith("{") else parse_nccl_tests_text
    return parse(text, source=source, op=op, n_ranks=n_ranks)


# --------------------------------------------------------------------------- fit


@dataclass(frozen=True)
class LinkFit:
    """Fitted alpha (``latency_s`` per call) and beta (``bandwidth_bytes_per_s``, bus
    bandwidth per rank) of one link class from ``points`` rows of ``op`` over ``n_ranks``;
    residuals are relative to the measured times; ``clamped``: alpha came out negative and
    was fixed at 0; ``backend``: "gloo" for a measurement of gloo (calibrates a gloo cluster only)."""

    link: str
    op: str
    n_ranks: int
    latency_s: float
    bandwidth_bytes_per_s: float
    rms_residual: float
    max_residual: float
    points: int
    clamped: bool = False
    backend: Optional[str] = None  # "gloo" when gloo measured it (bench comm without a GPU), else NCCL

    def predict(self, size_bytes: float) -> float:
        """Seconds for one call on a ``size_bytes`` buffer."""
        return self.latency_s + busbw_factor(self.op, self.n_ranks) * size_bytes / self.bandwidth_bytes_per_s


def fit_alpha_beta(rows: list[BenchRow], link: str, min_size_bytes: int = 1,
                   max_size_bytes: Optional[int] = None) -> LinkFit:
    """Fit ``t = alpha + busbw_factor(op, n) * size / beta`` to ``rows`` of one (op, n)
    with sizes in [min_size_bytes, max_size_bytes], by ``numpy.linalg.lstsq`` on rows
    divided by t. Raises ConfigError for an unknown link class, mixed (op, n), fewer than
    two sizes, or a time that does not grow with size."""
    if link not in LINK_CLASSES:
        raise ConfigError("link", f"unknown link class '{link}'; use one of {', '.join(LINK_CLASSES)}")
    kinds = {(r.op, r.n_ranks) for r in rows}
    if len(kinds) != 1:
        raise ConfigError("rows", f"rows mix {sorted(kinds)}; fit one (op, ranks) at a time")
    op, n = kinds.pop()
    use = [r for r in rows if r.size_bytes >= min_size_bytes and r.time_s > 0
           and (max_size_bytes is None or r.size_bytes <= max_size_bytes)]
    if len({r.size_bytes for r in use}) < 2:
        raise ConfigError("rows", f"{len(use)} usable rows; measure at least two sizes (nccl-tests -b 8 -e 1G -f 2)")
    t = np.array([r.time_s for r in use])
    sent = busbw_factor(op, n) * np.array([r.size_bytes for r in use], dtype=float)
    a = np.column_stack([np.ones_like(t), sent]) / t[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    clamped = alpha < 0
    if clamped:
        alpha, inv_beta = 0.0, float(np.linalg.lstsq(a[:, 1:], np.ones_like(t), rcond=None)[0][0])
    if inv_beta <= 0:
        raise ConfigError("rows", f"time does not grow with size for {op} over {n} ranks; include sizes "
                                  "large enough to be bandwidth-bound (e.g. up to 1 GiB)")
    rel = (alpha + sent * inv_beta - t) / t
    if not all(math.isfinite(float(x)) for x in (alpha, inv_beta, *rel)):
        raise ConfigError("rows", f"the fit for {op} over {n} ranks is not finite (times or sizes out of range); "
                                  "pass the measured output unmodified")
    return LinkFit(link, op, n, float(alpha), float(1.0 / inv_beta), float(np.sqrt(np.mean(rel ** 2))),
                   float(np.max(np.abs(rel))), len(use), bool(clamped))


# --------------------------------------------------------------------------- file


class CalibratedLink(BaseModel):
    """One ``[link.<class>]`` table of a calibration file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    latency_us: float = Field(ge=0, le=BOUNDS["latency_us"].value)
    bandwidth_gb_per_s: float = Field(gt=0, le=BOUNDS["bandwidth_gb_per_s"].value)
    op: Optional[str] = Field(default=None, max_length=64)
    ranks: Optional[int] = Field(default=None, ge=2, le=MAX_WORLD)
    residual: Optional[float] = Field(default=None, ge=0)
    points: Optional[int] = Field(default=None, ge=0, le=1 << 30)
    source: str = Field(max_length=MAX_STRING)
    backend: Optional[Literal["nccl", "rccl", "gloo"]] = None

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gb_per_s * GB

    @property
    def step_latency_us(self) -> float:
        """Per-step latency: ``latency_us / steps(op, ranks)``; the per-call figure when
        ``op`` or ``ranks`` is not given."""
        if self.op is None or self.ranks is None:
            return self.latency_us
        return self.latency_us / max(steps(self.op, self.ranks), 1)


#: What a gloo measurement of each link class ran over (``meshplan bench comm`` without a GPU).
GLOO_MEDIUM = {"nvlink": "loopback TCP inside one host", "pcie": "loopback TCP inside one host",
               "nic": "TCP over the testbed's veth links"}


def measured_over(link: str, backend: Optional[str]) -> str:
    """``link`` as measured: ``nvlink (gloo: loopback TCP inside one host, not NVLink)`` for a
    gloo run, ``link`` itself for NCCL (nccl-tests, or bench comm on GPUs)."""
    if backend != "gloo":
        return link
    hardware = {"nvlink": "NVLink", "pcie": "PCIe", "nic": "an RDMA NIC"}.get(link, link)
    return f"{link} (gloo: {GLOO_MEDIUM.get(link, 'TCP')}, not {hardware})"


def calibration_toml(fits: list[LinkFit], source: str | Mapping[str, str], backend: Optional[str] = None) -> str:
    """The calibration file for ``fits`` (one table per link class), ``source`` naming the
    measurement (tool, date, machines), one for all or per link class (``meshplan calibrate``:
    each class's own file); ``backend`` "gloo" when gloo measured it (written, and said in a
    comment: such a file calibrates only a gloo cluster)."""
    out = ["# meshplan calibration: alpha-beta per link class fitted from nccl-tests (meshplan.comm.calibration)"]
    if backend == "gloo" or any(f.backend == "gloo" for f in fits):
        out.append("# measured with gloo over TCP, no GPU: not NVLink or NIC figures; --calibration takes it only "
                   "for a gloo cluster (the CPU testbed)")
    for f in fits:
        out += [f"\n[link.{f.link}]", f"latency_us = {f.latency_s / US:.4g}",
                f"bandwidth_gb_per_s = {f.bandwidth_bytes_per_s / GB:.4g}", f'op = "{f.op}"',
                f"ranks = {f.n_ranks}", f"residual = {f.rms_residual:.3g}", f"points = {f.points}",
                f"source = {json.dumps(source if isinstance(source, str) else source[f.link])}"] + ([f'backend = "{f.backend or backend}"']
                                                     if f.backend or backend else [])
    return "\n".join(out) + "\n"


def load_calibration(path) -> dict[str, CalibratedLink]:
    """Read a calibration file: ``{link class: CalibratedLink}``. Unknown link classes,
    unknown keys and bad values are ConfigErrors naming ``--calibration: file: link.<class>.<key>``
    (a file that is not TOML: ``--calibration: file: not valid TOML``)."""
    p = Path(path)
    text = read_text_limited(p, "--calibration", FILE_BYTES["calibration"],
                             "give the calibration TOML that bench comm or calibrate wrote")
    where = f"--calibration: {p.name}"  # the option and the file, each named once
    doc = parse_toml(text, p.name, "--calibration")
    extra = sorted(set(doc) - {"link"})
    if extra or not isinstance(doc.get("link"), dict):
        raise ConfigError(where, f"expected only [link.<class>] tables (got {extra or 'no [link]'}); "
                                 f"use classes {', '.join(LINK_CLASSES)}")
    out = {}
    for name, table in doc["link"].items():
        if name not in LINK_CLASSES:
            raise ConfigError(f"{where}: link.{name}", f"unknown link class; use one of {', '.join(LINK_CLASSES)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: link.{name}", "must be a table [link.<class>] with latency_us, "
                                                      "bandwidth_gb_per_s and source; see meshplan.comm.calibration")
        try:
            out[name] = CalibratedLink(**table)
        except ValidationError as err:
            first = err.errors()[0]
            key = ".".join(str(x) for x in first["loc"])
            why = bound_message(first) or first["msg"]
            raise ConfigError(f"{where}: link.{name}.{key}", f"{why}; see meshplan.comm.calibration") from None
    for name, c in out.items():
        if c.op is not None and c.op not in OPS:
            raise ConfigError(f"{where}: link.{name}.op", f"unknown op '{c.op}'; use one of {', '.join(OPS)}")
    return out


def calibration_line(path, calib: dict[str, CalibratedLink]) -> str:
    """The header line plan, step, search and compare print when ``--calibration`` changed
    their numbers: the file as given and each calibrated link class's bandwidth, in the
    file's order.

    >>> calibration_line("cal.toml", {"nvlink": CalibratedLink(latency_us=10, bandwidth_gb_per_s=450, source="a"),
    ...                               "nic": CalibratedLink(latency_us=20, bandwidth_gb_per_s=45.25, source="b")})
    'links calibrated from cal.toml: nvlink 450 GB/s, nic 45.25 GB/s'
    """
    links = ", ".join(f"{name} {c.bandwidth_gb_per_s:.4g} GB/s" for name, c in calib.items())
    return f"links calibrated from {path}: {links}"


def calibration_doc(path, calib: dict[str, CalibratedLink]) -> dict:
    """The ``calibration`` entry of the plan, step, search and compare ``--json`` documents:
    the file, the header line (:func:`calibration_line`) and per link class its bus bandwidth
    (bytes/s), per-call latency (s) and source, SI."""
    return {"file": str(path), "line": calibration_line(path, calib),
            "links": {name: {"bandwidth_bytes_per_s": c.bandwidth_bytes_per_s, "latency_s": c.latency_us / 1e6,
                             "source": c.source} for name, c in calib.items()}}


def apply_calibration(cluster: ClusterSpec, calib: dict[str, CalibratedLink]) -> ClusterSpec:
    """A new cluster whose link figures come from ``calib``: ``nvlink`` -> the node's fabric,
    ``pcie`` -> its PCIe link (bandwidth, per-step latency); ``nic`` -> every NIC's rate
    (GB/s x 8 = Gb/s) and every network tier's per-step latency. The calibrated link classes
    lose the catalog's measured busbw curves (``nvlink`` the "nvlink" and "nvls" curves, ``nic``
    the "nic" curve and the single-NIC curves "p2p" (cross-node send/recv pair) and "nic1" (one
    rank per node), which run over one NIC):
    the user's own fit replaces them. A gloo measurement (``backend = "gloo"``) on a cluster whose
    library is not gloo is a ConfigError naming the table. Each calibrated class is marked ``calibrated`` (timed on
    the fit alone: module docstring). Other fields are kept."""
    for name, c in calib.items():
        if c.backend == "gloo" and cluster.collective_library != "gloo":
            raise ConfigError(f"--calibration: link.{name}", f"measured with gloo ({GLOO_MEDIUM.get(name, 'TCP')}, "
                              f"{c.bandwidth_gb_per_s:g} GB/s), not with {cluster.collective_library} on the "
                              f"{cluster.name} {name}; calibrate the GPUs (nccl-tests + meshplan calibrate, or bench "
                              "comm on a GPU host) or plan a gloo cluster")
    node, tag = cluster.node, "calibrated: {}"
    upd: dict[str, Any] = {}
    dropped = {"nvlink": ("nvlink", "nvls"), "nic": ("nic", "p2p", "nic1")}
    gone = {c for name in calib for c in dropped.get(name, ())}
    upd["busbw"] = {k: v for k, v in node.busbw.items() if k not in gone}
    for name, field in (("nvlink", "fabric"), ("pcie", "pcie")):
        if name in calib:
            c = calib[name]
            upd[field] = getattr(node, field).model_copy(update={
                "bandwidth_gb_per_s": c.bandwidth_gb_per_s, "latency_us": c.step_latency_us,
                "calibrated": True, "source": tag.format(c.source)})
    network = cluster.network
    if "nic" in calib:
        c = calib["nic"]
        if not node.nics:
            raise ConfigError("--calibration: link.nic", f"node {node.name} has no NIC; drop [link.nic] or add NICs")
        upd["nics"] = [n.model_copy(update={"rate_gbit_per_s": c.bandwidth_gb_per_s * 8}) for n in node.nics]
        network = [t.model_copy(update={"latency_us": c.step_latency_us, "calibrated": True})
                   for t in cluster.network]
    sources = "; ".join(f"{k}: {v.source}" for k, v in calib.items())
    return cluster.model_copy(update={"node": node.model_copy(update=upd), "network": network,
                                      "source": f"{cluster.source} (calibrated: {sources})".strip()})
