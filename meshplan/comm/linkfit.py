"""Fit the alpha-beta link model to nccl-tests rows (:mod:`meshplan.comm.nccl_tests`).

Per link class, least squares on ``t = alpha + bytes_sent / beta`` with
``bytes_sent = busbw_factor(op, n) * size`` (nccl-tests doc/PERFORMANCE.md, see
:mod:`meshplan.comm.alphabeta`), each row divided by its measured time so that small (latency) and
large (bandwidth) messages weigh alike. ``alpha`` is the latency per call of the measured
collective; ``beta`` is the bus bandwidth per rank. A negative ``alpha`` is clamped to 0 and
refitted; a non-positive slope is an error.

>>> rows = [BenchRow("all-reduce", 8, s, 20e-6 + 1.75 * s / 40e9, 0.0, 0.0) for s in (8, 2**20, 2**30)]
>>> fit = fit_alpha_beta(rows, "nic")
>>> round(fit.latency_s * 1e6, 3), round(fit.bandwidth_bytes_per_s / 1e9, 3)
(20.0, 40.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from meshplan.comm.alphabeta import busbw_factor
from meshplan.comm.nccl_tests import BenchRow
from meshplan.errors import ConfigError
from meshplan.units import human_bytes

LINK_CLASSES = ("nvlink", "pcie", "nic")


@dataclass(frozen=True)
class LinkFit:
    """Fitted alpha (``latency_s`` per call) and beta (``bandwidth_bytes_per_s``, bus
    bandwidth per rank) of one link class from ``points`` rows of ``op`` over ``n_ranks``;
    residuals are relative to the measured times; ``clamped``: alpha came out negative and
    was fixed at 0; ``backend``: "gloo" for a measurement of gloo (calibrates a gloo cluster only);
    ``gpu``: the GPU model the ranks ran on as nccl-tests names it (``NVIDIA H100 80GB HBM3``,
    :func:`meshplan.comm.nccl_tests_run.gpus_of`), None when the output does not say."""

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
    gpu: Optional[str] = None

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
    sizes = sorted({r.size_bytes for r in use})
    if len(sizes) < 2:  # counted as sizes: nccl-tests gives each size an out-of-place and an in-place row
        found = f"1 usable size ({sizes[0]} B)" if sizes else "no usable size"
        raise ConfigError("rows", f"{found}; measure at least two sizes (nccl-tests -b 8 -e 1G -f 2)")
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



def bandwidth_bound_bytes(fit: LinkFit) -> float:
    """The buffer size S (bytes) at which ``fit``'s bandwidth term equals its latency,
    ``busbw_factor(op, n) * S / beta = alpha``, so ``S = alpha * beta / busbw_factor(op, n)``:
    Hockney's half-performance length n_1/2 of the alpha-beta model (R. W. Hockney, "The
    communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel Computing 20(3),
    1994). Above it the bandwidth term carries most of the time; below it beta is read off
    rows that latency dominates. 0 for a clamped (zero) alpha.

    >>> round(bandwidth_bound_bytes(LinkFit("nic", "all-reduce", 16, 30e-6, 360e9, 0, 0, 24)))  # 2x8 H100 sample
    5760000
    """
    return fit.latency_s * fit.bandwidth_bytes_per_s / busbw_factor(fit.op, fit.n_ranks)


def latency_bound_reason(fit: LinkFit, largest_bytes: int) -> Optional[str]:
    """Why ``fit`` does not set beta when its largest logged size ``largest_bytes`` is below
    :func:`bandwidth_bound_bytes` (its beta then rests on latency-bound rows only: a log cut off
    at 16 KiB fitted 342 GB/s from ten rows of ~30 us); None when the largest size reaches it.

    >>> print(latency_bound_reason(LinkFit("nic", "all-reduce", 16, 30e-6, 360e9, 0, 0, 10), 16384))
    its largest size 16.00 KiB is below 5.49 MiB = alpha 30.0 us x beta 360.00 GB/s / 1.875, where the bandwidth term passes the latency, so its beta rests on latency-bound rows and does not set the bandwidth
    >>> latency_bound_reason(LinkFit("nic", "all-reduce", 16, 30e-6, 360e9, 0, 0, 24), 2**33) is None
    True
    """
    bound = bandwidth_bound_bytes(fit)
    if largest_bytes >= bound:
        return None
    return (f"its largest size {human_bytes(largest_bytes)} is below {human_bytes(bound)} = alpha "
            f"{fit.latency_s * 1e6:.1f} us x beta {fit.bandwidth_bytes_per_s / 1e9:.2f} GB/s / "
            f"{busbw_factor(fit.op, fit.n_ranks):g}, where the bandwidth term passes the latency, so its beta "
            "rests on latency-bound rows and does not set the bandwidth")
