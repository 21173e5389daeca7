"""Unit constants. Inside meshplan every quantity is SI (bytes, seconds, FLOP, bytes/s);
these constants convert only at input and output.

>>> 80 * GB / GiB
74.50580596923828
"""

import math

MB = 1e6
GB = 1e9
TB = 1e12
KiB = 2**10
MiB = 2**20
GiB = 2**30
US = 1e-6
MS = 1e-3
GBIT_PER_S = 1e9 / 8  # bytes/s in one Gb/s
TFLOPS = 1e12

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (one of :data:`DTYPE_BYTES`).

    >>> dtype_bytes("bf16")
    2
    """
    return DTYPE_BYTES[dtype]


def traffic_gb(n: float) -> str:
    """Traffic for printing, one unit everywhere: GB (1e9 B), e.g. bytes a rank sends per step.

    >>> traffic_gb(3.9234e12)
    '3,923.4 GB'
    """
    return f"{n / GB:,.1f} GB"


def human_bytes(n: float) -> str:
    """Format bytes in binary units for printing.

    >>> human_bytes(3 * GiB)
    '3.00 GiB'
    """
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1 (an added "es" after ch, sh, s or x, else
    "s"), for printing.

    >>> counted(1, "node"), counted(2048, "node"), counted(1, "micro-batch"), counted(4, "micro-batch")
    ('1 node', '2048 nodes', '1 micro-batch', '4 micro-batches')
    """
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun}{'es' if noun.endswith(('ch', 'sh', 's', 'x')) else 's'}"


def param_number(n: int) -> str:
    """A parameter count for printing: ``X.XX B`` from 1e9, ``X.XX M`` from 1e6, else the exact
    count with thousands separators (a tiny test model's 13,088 would print as 0.00 B).

    >>> param_number(140_630_071_296), param_number(7_500_000), param_number(13_088)
    ('140.63 B', '7.50 M', '13,088')
    """
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    if n >= 1e6:
        return f"{n / 1e6:.2f} M"
    return f"{n:,}"


def step_seconds(s: float) -> str:
    """A step time for the ``hint:`` and ``cause:`` lines with at least 3 significant figures, so two
    re-planned steps that differ by the 1% tie threshold never print alike: seconds to 2 decimals
    from 1 s up, milliseconds to 1 decimal under 1 s (409.62 ms and 438.23 ms print ``409.6 ms`` and
    ``438.2 ms``, where one decimal of a second printed both as ``0.4 s``). One formatter for every
    hint line. A re-plan without a step (``Replanned.step_s`` None) has no line that prints it: each
    caller tests for None where it reads the re-plan.

    >>> step_seconds(0.40962), step_seconds(0.43823), step_seconds(23.614), step_seconds(1.0), step_seconds(0.0523)
    ('409.6 ms', '438.2 ms', '23.61 s', '1.00 s', '52.3 ms')
    """
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def rounded_to_total(values: dict, total: int) -> dict:
    """``values`` rounded to integers that add up to ``total`` (largest remainder: floors,
    then one more to the largest fractions; when the floors already exceed ``total``, one
    less from the smallest), each within 1 of its value when ``total`` is the rounded sum; so
    printed parts add up to their printed sum (``step``'s parts line and FSDP-wait line).

    >>> rounded_to_total({"a": 1.4, "b": 1.4, "c": 1.2}, 4)
    {'a': 2, 'b': 1, 'c': 1}
    """
    out = {k: math.floor(v) for k, v in values.items()}
    order = sorted(values, key=lambda k: out[k] - values[k])  # the largest fraction first
    left = total - sum(out.values())
    for k in (order if left >= 0 else order[::-1])[:abs(left)]:
        out[k] += 1 if left > 0 else -1
    return out
