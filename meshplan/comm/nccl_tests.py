"""Read nccl-tests measurements: the result rows of its text output or ``-J`` JSON, each checked.

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

Which program wrote a log (its banner, or its rows' redop, root and busbw / algbw) is told in
:mod:`meshplan.comm.nccl_tests_program`; each rank's host and GPU, and whether a text log was
cut off, in :mod:`meshplan.comm.nccl_tests_run`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from meshplan.comm.alphabeta import busbw_factor
from meshplan.comm.nccl_rows import row_error, rows_refusal
from meshplan.comm.nccl_tests_program import check_banner, op_from_rows, op_of_test
from meshplan.errors import ConfigError
from meshplan.fileread import parse_json, read_text_limited
from meshplan.limits import BOUNDS, FILE_BYTES, MAX_LINE_CHARS, MAX_WORLD, over
from meshplan.units import GB, US



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
    is told from the rows (:func:`~meshplan.comm.nccl_tests_program.op_from_rows`).
    Raises ConfigError naming ``source:line`` for a short row or a missing header."""
    found_op = re.search(r"^# Collective test starting: (\S+)", text, flags=re.M)
    ranks = [int(r) for r in re.findall(r"^#[ \t]+Rank[ \t]+([0-9]{1,9})[ \t]", text, flags=re.M)]
    if ranks and max(ranks) >= MAX_WORLD:
        raise ConfigError(source, f"rank {over('world', max(ranks))}; pass the output unmodified")
    n = n_ranks or (max(ranks) + 1 if ranks else None)
    if op is None and not found_op:
        op = op_from_rows(text, n, source)
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
        check_banner(text, n, op, source, found_op[1])
    _check_ranks(rows, source)
    return _check_columns(rows, wheres, "cputime" in cols)


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
