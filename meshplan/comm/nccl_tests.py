"""Read nccl-tests measurements: result rows, and where and on which GPU each rank ran.

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

The ``#  Rank`` lines are printed by nccl-tests src/util.cu (NVIDIA/nccl-tests a0b82b2,
2.19.6, the ``# Using devices`` block) as ``"#  Rank %2d Group %2d Pid %6d on %10s device %2d
[%04x:%02x:%02x] %s"`` with the host name and ``cudaDeviceProp.name`` (the GPU model, e.g.
``NVIDIA H100 80GB HBM3``, ``NVIDIA A100-SXM4-80GB``, ``NVIDIA H200``); ``-J`` JSON carries the
same line parsed per process as ``config.devices[] = {"rank", "group", "pid", "hostname",
"device", "device_hex", "device_info"}`` (``parseRankInfo``, ``jsonRankInfo``): :func:`hosts_of`
and :func:`gpus_of` read them.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from meshplan.comm.alphabeta import OPS, busbw_factor
from meshplan.comm.nccl_rows import row_error, rows_refusal
from meshplan.errors import ConfigError
from meshplan.fileread import parse_json, read_text_limited
from meshplan.limits import BOUNDS, FILE_BYTES, MAX_LINE_CHARS, MAX_WORLD, over
from meshplan.units import GB, US, human_bytes

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


def op_of_test(program: str, where: str) -> str:
    """meshplan's op of the nccl-tests program ``program`` (``alltoall_perf``, ``alltoall``, a path to it,
    or the op itself); a ConfigError naming ``where`` for a test meshplan does not model.

    >>> op_of_test("./build/alltoall_perf", "--op"), op_of_test("all_gather", "--op"), op_of_test("send/recv", "--op")
    ('all-to-all', 'all-gather', 'send/recv')
    """
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
    """Rows of nccl-tests text output (out-of-place, then in-place, per size). ``op`` (``meshplan
    calibrate --op`` for a log without the banner) and ``n_ranks`` override what the
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
    op = op_of_test(op or (found_op[1] if found_op else ""), source)
    if not n:
        raise ConfigError(source, "no '#  Rank <r> Group <g> Pid <p> on <host> device <d> ...' lines, which give "
                                  "the ranks; give the whole output of one nccl-tests run, with its '# Using devices' "
                                  "block")
    cols: list[str] = []
    rows: list[BenchRow] = []
    wheres: list[str] = []  # each row's file:line, for _check_columns
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
        more = _text_row(tokens, cols, op, n, where)
        rows.extend(more)
        wheres.extend([where] * len(more))
    if found_op and op == op_of_test(found_op[1], source):
        _check_banner(text, n, op, source, found_op[1])
    _check_ranks(rows, source)
    return _check_columns(rows, wheres, "cputime" in cols)


def _check_banner(text: str, n: int, op: str, source: str, banner: str) -> None:
    """ConfigError naming ``source`` when its rows fit (:func:`row_fits`) only tests other than ``op``,
    the one its banner ``banner`` names (newcomer trial 54: an all_reduce_perf banner over all_gather_perf
    rows read as a wrong rank count); nothing when they fit it, or fit no modelled test over ``n`` ranks
    (:func:`_check_ranks` then names the rank count)."""
    found = row_fits(text, n)
    if found is None or not found[0] or any(TEST_OPS[f] == op for f in found[0]):
        return
    fits, said = found
    tests = " or ".join(f"{f}_perf" for f in fits)
    raise ConfigError(source, f"its banner names {banner}, but its rows ({said}) fit {tests}: the banner and the "
                              "rows are of two runs; pass the whole output of one nccl-tests run, unmodified")


def _check_columns(rows: list[BenchRow], wheres: list[str], cpu_time: bool) -> list[BenchRow]:
    """``rows`` when each one's algbw and busbw are what its size over its time gives
    (:func:`~meshplan.comm.nccl_rows.row_error`; ``wheres``: each row's place in its file), else a
    ConfigError naming the largest such row (:func:`~meshplan.comm.nccl_rows.rows_refusal`). Not
    checked with ``cpu_time`` (``-C 1``: the time column is the host's time to issue the calls, the
    bandwidths from the time to complete them: src/common.cu ``BenchTime``, ``cputimeSec``)."""
    bad = [] if cpu_time else [(w, e) for w, r in zip(wheres, rows) if (e := row_error(
        r.size_bytes, r.time_s, r.algbw_bytes_per_s, r.busbw_bytes_per_s, r.op, r.n_ranks)) is not None]
    refusal = rows_refusal(bad, len(rows))
    if refusal is not None:
        raise ConfigError(*refusal)
    return rows


#: What each modelled nccl-tests program prints in a result row (NVIDIA/nccl-tests src/util.cu
#: ``writeBenchmarkLinePreamble`` at a0b82b2, 2.19.6): its redop column ("none" where it reduces
#: nothing: all_gather.cu, alltoall.cu, broadcast.cu, sendrecv.cu pass "none") and whether its
#: root is -1; busbw / algbw is ``busbw_factor(op, n)`` (each program's GetBw).
ROW_SIGNATURE = {"all_reduce": (True, True), "reduce_scatter": (True, True), "all_gather": (False, True),
                 "alltoall": (False, True), "broadcast": (False, False), "sendrecv": (False, True)}

_NO_BANNER = ("no '# Collective test starting' line (e.g. '# Collective test starting: all_reduce_perf'; "
              "nccl-tests prints it since 2025-06, NVIDIA/nccl-tests dafb704)")


def row_fits(text: str, n: Optional[int]) -> Optional[tuple[list[str], str]]:
    """(the modelled nccl-tests programs whose rows look like ``text``'s, the evidence in words) over
    ``n`` ranks, or None without result rows: each row's redop and root (:data:`ROW_SIGNATURE`) and
    busbw / algbw against ``busbw_factor(op, n)`` on its row of largest algbw (:func:`_op_from_rows`)."""
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
        return None
    algbw, busbw, redop, root = best
    fits = [stem for stem, (reduces, no_root) in ROW_SIGNATURE.items()
            if reduces == (redop != "none") and no_root == (root == "-1")
            and abs(busbw / algbw - busbw_factor(TEST_OPS[stem], n)) <= 0.02 * busbw_factor(TEST_OPS[stem], n) + 0.005]
    return fits, f"redop {redop}, root {root}, busbw/algbw {busbw / algbw:.3f} over {n} ranks"


def _op_from_rows(text: str, n: Optional[int], source: str) -> str:
    """The program of an nccl-tests text output without its ``# Collective test starting``
    banner (nccl-tests before dafb704, 2025-06-03, never printed it), from what every version
    prints: the column header (``size count type redop root time algbw busbw ...``, the same for
    every program: src/util.cu at a0b82b2, src/common.cu before), so not the header alone,
    but each row's redop and root (:data:`ROW_SIGNATURE`) and busbw / algbw against
    ``busbw_factor(op, n)`` on its row of largest algbw (:func:`row_fits`). all_reduce (a reduction,
    2(n-1)/n) and reduce_scatter ((n-1)/n) are told apart; all_gather and alltoall print the same (none,
    -1, (n-1)/n) and are refused naming ``meshplan calibrate --op`` and ``FILE:op``, which say the test
    for a log of any version; a text without rows or ranks is refused naming the banner."""
    found = row_fits(text, n)
    if found is None:
        raise ConfigError(source, f"{_NO_BANNER}, and no result rows under the column header with the '#  Rank' "
                                  "lines to tell the collective from; give the whole output of one nccl-tests run, "
                                  "or put that line back at its top")
    fits, said = found
    if len(fits) != 1:
        which = " and ".join(f"{f}_perf" for f in fits) + " alike" if fits else "no modelled test"
        each = " or ".join(f"{source}:{f}" for f in fits) if fits else f"{source}:TEST"
        raise ConfigError(source, f"{_NO_BANNER}; its rows ({said}) fit {which}; name the test that wrote "
                                  f"it: {each} for this file alone, or --op (e.g. --op alltoall) for every such log; "
                                  "each reads the log of every nccl-tests version")
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
    op = op_of_test(op or args[0], f"{source}: args")
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
    rows, wheres, cpu = [], [], False
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
            wheres.append(f"{source}: results[{i}].{key}")
            cpu |= isinstance(part, dict) and "time" not in part  # -C 1: cpu_time
    _check_ranks(rows, source)
    return _check_columns(rows, wheres, cpu)


#: The lines nccl-tests prints after its last result row, one of which every version has
#: (src/util.cu at a0b82b2, the end of ``run()``: ``"# %-20s : %g"`` "Avg bus bandwidth", then
#: "# Collective test concluded: <program>", printed since dafb704 with the starting banner).
_TRAILER = re.compile(r"^#[ \t]*(Avg bus bandwidth[ \t]*:|Collective test concluded:)", flags=re.M)


def trailer_warning(text: str, rows: list[BenchRow], source: str) -> Optional[str]:
    """A ``warning:`` line when text output ``text`` (not ``-J`` JSON, which does not parse
    when cut) has neither of nccl-tests' trailer lines (:data:`_TRAILER`): the log was cut off
    at a row boundary after its largest size in ``rows``, so its sizes stop short of the run's
    ``-e``; None when it has one.

    >>> rows = [BenchRow("all-reduce", 16, 16384, 30.09e-6, 0.54e9, 1.02e9)]
    >>> print(trailer_warning("#  Rank  0 ...\\n   16384 ...\\n", rows, "cut.txt"))
    warning: cut.txt: no '# Avg bus bandwidth' or '# Collective test concluded' line, which nccl-tests prints after its last row, so the log was cut off after its 16.00 KiB row; pass the whole output of the run
    >>> trailer_warning("# Avg bus bandwidth    : 165.643\\n", rows, "a.txt") is None
    True
    """
    if text.lstrip().startswith("{") or _TRAILER.search(text) or not rows:
        return None
    top = max(r.size_bytes for r in rows)
    asked = re.search(r"^#.*\bmaxBytes[ \t]+([0-9]{1,16})\b", text, flags=re.M)  # the header's -e
    of = f" of the {human_bytes(int(asked[1]))} its header's maxBytes names" if asked else ""
    return (f"warning: {source}: no '# Avg bus bandwidth' or '# Collective test concluded' line, which nccl-tests "
            f"prints after its last row, so the log was cut off after its {human_bytes(top)} row{of}; pass the "
            "whole output of the run")


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



# --------------------------------------------------------------------------- ranks

#: A ``#  Rank`` line (module docstring): rank, host, and what follows the PCI address (the GPU model).
_RANK_LINE = re.compile(r"^#[ \t]+Rank[ \t]+([0-9]{1,9})[ \t]+Group[ \t]+[0-9]+[ \t]+Pid[ \t]+[0-9]+[ \t]+on[ \t]+(\S+)"
                        r"(?:[ \t]+device[ \t]+[0-9]+[ \t]+\[[^\]\n]*\][ \t]*([^\n]*))?", flags=re.M)


def _devices(text: str) -> Optional[list]:
    """``config.devices`` of ``-J`` JSON; None for text output, [] when absent or malformed."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        devices = json.loads(text).get("config", {}).get("devices", [])
    except (ValueError, AttributeError, RecursionError):
        return []
    return [d for d in devices if isinstance(d, dict)] if isinstance(devices, list) else []


def hosts_of(text: str) -> list[str]:
    """Host of each rank, in rank order: the ``on <host>`` field of nccl-tests' ``#  Rank``
    lines, or ``hostname`` of each ``config.devices`` entry of ``-J`` JSON, once per rank of
    that process (``nthreads x ngpus``: ``-g 8`` runs 8 ranks per process); [] when absent.

    >>> hosts_of("#  Rank  0 Group  0 Pid   7 on     node01 device  0 [0000:18:00] NVIDIA A100\\n"
    ...          "#  Rank  1 Group  0 Pid   8 on     node01 device  1 [0000:1a:00] NVIDIA A100\\n")
    ['node01', 'node01']
    >>> hosts_of('{"config": {"ngpus": 2, "devices": [{"hostname": "a"}, {"hostname": "b"}]}}')  # -g 2
    ['a', 'a', 'b', 'b']
    """
    devices = _devices(text)
    if devices is not None:
        per = _ranks_per_entry(text)
        return [str(d.get("hostname", ""))[:256] for d in devices for _ in range(per)]
    return [m[2] for m in sorted(_RANK_LINE.finditer(text), key=lambda m: int(m[1]))]


def _ranks_per_entry(text: str) -> int:
    """Ranks per ``config.devices`` entry of ``-J`` JSON: ``nthreads x ngpus`` (one entry per
    process, as :func:`parse_nccl_tests_json` counts the ranks), 1 when either is not a whole
    number 1..1024."""
    try:
        cfg = json.loads(text).get("config", {})
        per = cfg.get("nthreads", 1) * cfg.get("ngpus", 1)
    except (ValueError, AttributeError, TypeError, RecursionError):
        return 1
    return per if isinstance(per, int) and not isinstance(per, bool) and 1 <= per <= 1024 else 1


def gpus_of(text: str) -> list[str]:
    """GPU model of each rank that names one, in rank order: what nccl-tests prints after the
    PCI address of a ``#  Rank`` line (``cudaDeviceProp.name``), or ``device_info`` of each
    ``config.devices`` entry of ``-J`` JSON; a trailing ``(global rank N)`` (``meshplan bench
    comm``'s text) is dropped; [] when no line names one.

    >>> gpus_of("#  Rank  0 Group  0 Pid  6899 on ztan-mig-235z device  0 [0000:04:00] NVIDIA H100 80GB HBM3\\n"
    ...         "#  Rank  1 Group  0 Pid  6900 on ztan-mig-235z device  1 [0000:05:00] NVIDIA H100 80GB HBM3\\n")
    ['NVIDIA H100 80GB HBM3', 'NVIDIA H100 80GB HBM3']
    """
    devices = _devices(text)
    if devices is not None:
        names = [str(d.get("device_info", "")) for d in devices]
    else:
        names = [m[3] or "" for m in sorted(_RANK_LINE.finditer(text), key=lambda m: int(m[1]))]
    names = [re.sub(r"\s*\(global rank [0-9]+\)\s*$", "", n).strip()[:128] for n in names]
    return [n for n in names if n]
