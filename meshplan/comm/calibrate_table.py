"""``meshplan calibrate --json``'s ``runs``: every file read, kept or not, as fields (newcomer trial 54
#10: the dropped fits, the per-NIC split and the catalog comparison were prose in ``notes`` only).

One row per file (:func:`run_table`), in the order read: its link class, op, ranks, hosts, ranks and NICs
per host, its fitted busbw (bytes/s, as nccl-tests defines it) and, on ``nic``, the per-NIC figure the
fit was split into (:func:`~meshplan.comm.calibration_kinds.host_share` over the NICs per host), its
alpha, its ``role`` in the class and ``why``:

- ``kept``: its fit sets the class's rate (:func:`~meshplan.comm.calibrate._kept_class`: a ring op's,
  all-reduce first, then the slowest);
- ``dropped``: a rival of the kept fit (the same op, or on ``nic`` another ring op: one busbw for the
  three), with the reason :func:`~meshplan.comm.calibrate._kept_note` prints (:data:`DROP_OTHER_OP`,
  :data:`DROP_FASTER`); its curve is still written;
- ``own op``: a run of another op, whose curve times that op on its own
  (:func:`~meshplan.comm.calibration_kinds.own_runs`);
- ``not used``: its largest size is latency-bound, so it sets no beta
  (:func:`~meshplan.comm.linkfit.latency_bound_reason`, the reason as ``why``).

On ``nic`` the row carries the catalog NIC's line rate per NIC it was checked against
(:func:`~meshplan.comm.calibrate_nics.catalog_nic_gb_per_s`: ``--system``'s node, else the fastest catalog
NIC of the log's GPU) and that node; None elsewhere.
"""

from __future__ import annotations

from typing import Any, Optional

from meshplan.comm.calibrate_nics import catalog_nic_gb_per_s
from meshplan.comm.calibration_kinds import RING_OPS, host_share
from meshplan.comm.linkfit import LinkFit
from meshplan.units import GB

#: Why a rival of another op is dropped beside an all-reduce fit (:func:`~meshplan.comm.calibrate._kept_note`).
DROP_OTHER_OP = "the all-reduce fit is kept where there is one, as bench comm does"
#: Why a faster rival is dropped.
DROP_FASTER = "faster than the kept one; a collective over every link waits for the slowest"


def run_table(by_link: dict, kept: list[LinkFit], unused: list[tuple], system: Optional[str]) -> list[dict[str, Any]]:
    """The rows (module docstring) of ``by_link`` (per class, each file's (fit, source, name, ranks per
    host, NICs per host)), ``kept`` the fit each class kept, and ``unused`` (class, name, fit, why, ranks
    per host, NICs per host) of the files that set no beta; ``system``: ``--system``'s catalog node or None."""
    rows = []
    for cls, candidates in by_link.items():
        fit = next(f for f in kept if f.link == cls)
        for c in candidates:
            role, why = _role(cls, fit, c[0])
            rows.append(_row(cls, c[0], c[2], c[3], c[4], role, why, system))
    for cls, name, fit, why, per_node, nics in unused:
        rows.append(_row(cls, fit, name, per_node, nics, "not used", why, system))
    return rows


def _role(cls: str, kept: LinkFit, fit: LinkFit) -> tuple[str, str]:
    """(role, why) of ``fit`` in link class ``cls`` whose kept fit is ``kept`` (module docstring)."""
    if fit is kept:
        return "kept", "sets the class's rate: a ring op's fit, all-reduce first, then the slowest"
    if fit.op == kept.op or (cls == "nic" and {fit.op, kept.op} <= set(RING_OPS)):
        return "dropped", DROP_OTHER_OP if fit.op != kept.op and kept.op == "all-reduce" else DROP_FASTER
    return "own op", f"its curve times {fit.op} on {cls} from its own run"


def _row(cls: str, fit: LinkFit, name: str, per_node: int, nics: int, role: str, why: str,
         system: Optional[str]) -> dict[str, Any]:
    """One row: ``fit`` of file ``name`` (per NIC on ``nic`` where ``per_node`` > 1, split over ``nics``).

    Trial 54's all_gather_8n.txt (8 x 8 H100, 327.21 GB/s busbw over 8 NICs per host: 40.90 per NIC):

    >>> r = _row("nic", LinkFit("nic", "all-gather", 64, 39.2e-6, 327.21e9 / 8, 0.01, 0.01, 52, gpu="NVIDIA H100 80GB HBM3"),
    ...          "all_gather_8n.txt", 8, 8, "dropped", DROP_OTHER_OP, None)
    >>> r["hosts"], r["busbw_bytes_per_s"] / 1e9, r["per_nic_bytes_per_s"] / 1e9, r["catalog_line_per_nic_bytes_per_s"]
    (8, 327.21, 40.90125, 50000000000.0)
    """
    split = cls == "nic" and per_node > 1
    share = host_share(fit.op, fit.n_ranks, per_node) if split else 1.0
    line, node = catalog_nic_gb_per_s(fit.gpu, system) if cls == "nic" else (None, None)
    return {"file": name, "link": cls, "op": fit.op, "ranks": fit.n_ranks, "hosts": fit.n_ranks // max(per_node, 1),
            "ranks_per_host": per_node, "nics_per_host": nics if cls == "nic" else None,
            "busbw_bytes_per_s": fit.bandwidth_bytes_per_s * nics / share if split else fit.bandwidth_bytes_per_s,
            "per_nic_bytes_per_s": fit.bandwidth_bytes_per_s if cls == "nic" else None,
            "latency_s": fit.latency_s, "rms_residual": fit.rms_residual, "points": fit.points, "gpu": fit.gpu,
            "role": role, "why": why,
            "catalog_line_per_nic_bytes_per_s": line * GB if line is not None and line != float("inf") else None,
            "catalog_node": node or None}
