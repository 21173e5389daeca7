"""Which nccl-tests program wrote a log: its name to meshplan's op (:func:`op_of_test`), and,
from what every version prints in a result row (its redop and root, and busbw / algbw over the
ranks), the programs its rows fit (:func:`row_fits`): the program of a log without its
``# Collective test starting`` banner (:func:`op_from_rows`), and a banner over another
program's rows refused (:func:`check_banner`). The rows themselves are read by
:mod:`meshplan.comm.nccl_tests`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from meshplan.comm.alphabeta import OPS, busbw_factor
from meshplan.errors import ConfigError

#: nccl-tests binary stem -> meshplan op name (reduce, gather, scatter are not modelled).
TEST_OPS = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
            "alltoall": "all-to-all", "broadcast": "broadcast", "sendrecv": "send/recv"}


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


def check_banner(text: str, n: int, op: str, source: str, banner: str) -> None:
    """ConfigError naming ``source`` when its rows fit (:func:`row_fits`) only tests other than ``op``,
    the one its banner ``banner`` names (newcomer trial 54: an all_reduce_perf banner over all_gather_perf
    rows read as a wrong rank count); nothing when they fit it, or fit no modelled test over ``n`` ranks
    (:func:`meshplan.comm.nccl_tests._check_ranks` then names the rank count)."""
    found = row_fits(text, n)
    if found is None or not found[0] or any(TEST_OPS[f] == op for f in found[0]):
        return
    fits, said = found
    tests = " or ".join(f"{f}_perf" for f in fits)
    raise ConfigError(source, f"its banner names {banner}, but its rows ({said}) fit {tests}: the banner and the "
                              "rows are of two runs; pass the whole output of one nccl-tests run, unmodified")


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
    busbw / algbw against ``busbw_factor(op, n)`` on its row of largest algbw (:func:`op_from_rows`)."""
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


def op_from_rows(text: str, n: Optional[int], source: str) -> str:
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
