"""Each nccl-tests result row checked against nccl-tests' own definitions: ``algbw = size / time`` and
``busbw = algbw x factor`` (:func:`row_error`), so a log whose bandwidth columns were edited or converted
(Gb/s written in the GB/s columns: 8x) is refused naming its row rather than read two ways.

nccl-tests (NVIDIA/nccl-tests a0b82b2) computes both columns from the time it prints: src/common.cu
``BenchTime`` averages ``deltaSec`` over the ranks, calls the test's ``getBw(count, wordSize, deltaSec, ...)``
(e.g. src/all_gather.cu ``AllGatherGetBw``: ``baseBw = count * typesize * nranks / 1e9 / sec``, the row's
size column ``max(sendBytes, expectedBytes)``, and ``busBw = baseBw * (nranks - 1) / nranks``) and prints
``timeUsec = deltaSec * 1e6`` beside them (src/util.cu ``writeBenchmarkLineBody``); doc/PERFORMANCE.md
defines ``algbw = S/t`` and ``busbw = algbw x factor`` (:func:`~meshplan.comm.alphabeta.busbw_factor`).
Only with ``-C 1`` is the time column another figure (``cputime``: ``cputimeSec``, the host's time to
issue the calls, taken before ``completeColl`` waits for them), so such rows are not checked.

The text prints each of time, algbw and busbw with :func:`~meshplan.comm.nccl_tests.float_str` (2 decimals
while they fit: 0.005 GB/s rounding for a bandwidth below 1000 GB/s; the time at 4 or more significant
digits, at most 0.5% off for a time of 1 us or more), so a row is refused only beyond :data:`ABS_GB` +
:data:`REL` of the value size / time gives: rounding stays within it, the 8x of a unit slip is far outside.
"""

from __future__ import annotations

from typing import Optional

from meshplan.comm.alphabeta import busbw_factor
from meshplan.units import GB, US, human_bytes

#: Absolute slack (GB/s) of a bandwidth column: twice the 0.005 GB/s rounding of its 2 printed decimals.
ABS_GB = 0.01
#: Relative slack: four times the 0.5% the time column's rounding can make at 1 us (module docstring).
REL = 0.02


def row_error(size_bytes: int, time_s: float, algbw: float, busbw: float, op: str,
              n_ranks: int) -> Optional[tuple[str, float]]:
    """(why, printed over computed) where a row's printed ``algbw`` or ``busbw`` (bytes/s) is not what
    its ``size_bytes`` over ``time_s`` gives (algbw = size / time, busbw = that x ``busbw_factor(op,
    n_ranks)``, module docstring), or None when both agree within :data:`ABS_GB` + :data:`REL`.

    From newcomer trial 54's log, the 8 GiB row of a 2 x 8 H100 all_reduce_perf with its bandwidth
    columns x 8: 8589934592 B / 48087 us = 178.63 GB/s, printed 1429.04:

    >>> why, ratio = row_error(8589934592, 48087e-6, 1429.04e9, 2679.52e9, "all-reduce", 16)
    >>> print(why)
    algbw 1429.04 GB/s is 8.00x size / time (8.00 GiB / 48087 us = 178.63 GB/s; busbw 2679.52 GB/s against 334.94 = that x 1.875, all-reduce over 16 ranks)
    >>> row_error(8589934592, 48087e-6, 178.63e9, 334.94e9, "all-reduce", 16) is None
    True
    """
    if time_s <= 0:
        return None
    alg, factor = size_bytes / time_s, busbw_factor(op, n_ranks)
    bus = alg * factor
    off = [(name, got, want) for name, got, want in (("algbw", algbw, alg), ("busbw", busbw, bus))
           if abs(got - want) > ABS_GB * GB + REL * want]
    if not off:
        return None
    name, got, want = off[0]
    ratio = got / want if want > 0 else float("inf")
    return (f"{name} {got / GB:.2f} GB/s is {ratio:.2f}x {'size / time' if name == 'algbw' else 'size / time x factor'} "
            f"({human_bytes(size_bytes)} / {time_s / US:g} us = {alg / GB:.2f} GB/s; busbw {busbw / GB:.2f} GB/s "
            f"against {bus / GB:.2f} = that x {factor:.3f}, {op} over {n_ranks} ranks)"), ratio


def rows_refusal(bad: list[tuple[str, tuple[str, float]]], rows: int) -> Optional[tuple[str, str]]:
    """(where, message) of a ConfigError for the last of ``bad`` ((``file:line``, :func:`row_error`)
    of each row whose columns disagree, in the log's order, of ``rows`` checked: the largest size, as
    nccl-tests sweeps them upward, where rounding matters least), None when there is none: the fix is the
    unmodified output, and a gap of 8x (or 1/8, within 5%) names the Gb/s-for-GB/s slip.

    >>> print(rows_refusal([("ar.txt:30", ("algbw 0.08 GB/s is 10.00x size / time (...)", 10.0))], 62)[1])
    algbw 0.08 GB/s is 10.00x size / time (...); 1 of its 62 rows so: nccl-tests computes algbw = size / time and busbw = algbw x factor from the time it prints (doc/PERFORMANCE.md), so these columns were edited or converted; pass the output nccl-tests printed, unmodified
    """
    if not bad:
        return None
    where, (why, ratio) = bad[-1]
    slip = ("; an 8x gap is Gb/s written in nccl-tests' GB/s columns"
            if any(abs(ratio / r - 1) <= 0.05 for r in (8.0, 1 / 8)) else "")
    return where, (f"{why}; {len(bad)} of its {rows} rows so: nccl-tests computes algbw = size / time and busbw = "
                   f"algbw x factor from the time it prints (doc/PERFORMANCE.md), so these columns were edited or "
                   f"converted{slip}; pass the output nccl-tests printed, unmodified")
