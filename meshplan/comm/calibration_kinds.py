"""Which collective kinds a ``--calibration`` fit sets, and how the NIC class's other catalog
curves follow it (:func:`meshplan.comm.calibration.apply_calibration`).

The rule, per link class:

- the fit and its own curve (``[[link.<class>.curve]]`` of the fitted run) set the class's
  ring collectives: all-reduce, all-gather and reduce-scatter, whose busbw is the same bus
  figure for every ring op (nccl-tests doc/PERFORMANCE.md: busbw "should reflect the speed of
  the hardware", independent of the op), and the class's all-to-all bandwidth (its NIC rate);
- a catalog NIC curve of another measured pattern is never replaced by it: the send/recv pair
  ("p2p", one rank per node sending while it receives) and the one-rank-per-node all-reduce
  ("nic1") run other algorithms over the same NIC ([S18]: 15.48 and 18.65 GB/s, against
  23.0 GB/s per NIC of the 8-NIC all-reduce). Such a curve is set by a run of its own pattern in
  the file (``sendrecv_perf``, or ``alltoall_perf`` over 2 ranks on 2 hosts, for "p2p"),
  else kept and scaled by ``r``, the measured over the catalog busbw per NIC of the
  fitted run's own pattern at the catalog curve's largest size (:func:`nic_ratio`), so a
  measured link slower than the catalog's never makes any NIC pattern faster.

Scaling a curve by ``r``: :func:`~meshplan.comm.alphabeta.measured_time` reads a curve at
``bandwidth / line_gb_per_s`` of its busbw, and the calibrated NIC rate is the fit's
bandwidth B (the catalog's was R), so the scaled curve's line is
``line * B / (R * r)``: at the path's bandwidth ``x B / R`` it reads ``r`` x the catalog busbw.

Repro of calib37 (2 x 1 A100 all-reduce at 18.71 GB/s, against S18's 18.65 on the same
pattern): r = 18.71 / 18.65 = 1.003, the pp send/recv pair stays on S18's 15.48 GB/s curve x
1.003 instead of the all-reduce fit's 18.71.

>>> from meshplan.catalog import busbw_curve
>>> pair = busbw_curve("ib-hdr-200-1nic-pair")
>>> c = scaled_curve(pair, 0.5, 18.71, 25.0, "x")
>>> round(c.line_gb_per_s, 2), round(18.71 / c.line_gb_per_s, 3)
(37.42, 0.5)
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, cast

from meshplan.comm.alphabeta import busbw_factor, measured_time
from meshplan.spec.cluster import BusbwCurve
from meshplan.units import GB, human_bytes

#: The NIC curve keys of a catalog node's ``busbw`` (catalog/nodes.toml) and the pattern each holds.
NIC_PATTERNS = {"nic": "all-reduce with several ranks per node", "nic1": "all-reduce with one rank per node",
                "p2p": "send/recv pair"}


def host_share(op: str, n: int, g: int) -> float:
    """A run's bytes per second through one host's NICs over its busbw (nccl-tests' column),
    for ``op`` over ``n`` ranks, ``g`` on each host, each rank on its own NIC (or ``g / N`` ranks
    on each of N); a ``nic`` fit per NIC is busbw x this / N (:mod:`meshplan.comm.calibrate`):

    - ring ops (all-reduce, all-gather, reduce-scatter) and send/recv: 1. A ring leaves a host
      once per channel and the channels spread over its NICs, so the host sends busbw bytes/s
      in all ([S18] 2 x 8 A100 all-reduce: 188.18 GB/s busbw at 4 GiB, 23.5 GB/s per 25 GB/s NIC);
    - all-to-all: ``g (n - g) / (n - 1)``. Its busbw is per rank: ``algbw (n - 1) / n``, the
      bytes a rank sends to its n - 1 peers per second (nccl-tests doc/PERFORMANCE.md), S/n to
      each (:func:`~meshplan.comm.alphabeta.all_to_all_time`), so ``(n - g) / (n - 1)`` of them
      go to ranks of other hosts, through that rank's own NIC, and g ranks send them.

    16 hosts x 8 GPUs (n 128) at 37.80 GB/s all-to-all busbw: 8 x 120 / 127 = 7.559 per host,
    35.72 GB/s per NIC over 8 NICs (not 37.80 / 8 = 4.73); one rank per host: 1.

    >>> round(host_share("all-to-all", 128, 8), 3), host_share("all-to-all", 2, 1), host_share("all-reduce", 16, 8)
    (7.559, 1.0, 1.0)
    """
    if op != "all-to-all" or n < 2 or g >= n:  # on one host (g = n) nothing leaves it: the busbw as is
        return 1.0
    g = max(1, g)
    return g * (n - g) / (n - 1)


def read_rate(fit_gb_per_s: float, nics: int, op: str, ranks: int, nodes: int, link: str = "nic") -> float:
    """The rate (GB/s) a calibrated ``link`` class's logged curve of ``op`` over ``ranks`` on
    ``nodes`` hosts is read against (its ``line_gb_per_s`` once applied,
    :func:`~meshplan.comm.calibration.apply_calibration`), so that at the class's calibrated
    rate the curve reads its logged busbw: for ``nic`` the fit per NIC x the ``nics`` of a host
    over :func:`host_share` (the busbw the host's NICs carry at that rate); else the fit.

    >>> read_rate(45.0, 8, "all-reduce", 16, 2), round(read_rate(35.7165, 8, "all-to-all", 128, 16), 2)
    (360.0, 37.8)
    """
    if link != "nic":
        return fit_gb_per_s
    return fit_gb_per_s * nics / host_share(op, ranks, ranks // max(nodes, 1))


def pattern(curve: BusbwCurve) -> str:
    """The NIC pattern key a curve was measured in: "p2p" for send/recv or a 2-rank all-to-all
    (nccl-tests' alltoall over 2 ranks is one send and one receive per rank), "nic1" for one
    rank per node, else "nic".

    >>> from meshplan.catalog import busbw_curve
    >>> [pattern(busbw_curve(k)) for k in ("ib-hdr-200-8nic", "ib-hdr-200-1nic-ring", "ib-hdr-200-1nic-pair")]
    ['nic', 'nic1', 'p2p']
    """
    if curve.op == "send/recv" or (curve.op == "all-to-all" and curve.ranks == 2):
        return "p2p"
    return "nic1" if curve.ranks == curve.nodes else "nic"


def busbw_at(curve: BusbwCurve, size_bytes: float) -> float:
    """The curve's busbw (GB/s) at ``size_bytes``, read as :func:`~meshplan.comm.alphabeta.measured_time`
    reads it at its own line rate (linear in time between logged sizes, the last segment beyond).

    >>> from meshplan.catalog import busbw_curve
    >>> round(busbw_at(busbw_curve("ib-hdr-200-8nic"), 2**32), 2)
    188.18
    """
    f = busbw_factor(curve.op, curve.ranks)
    t = measured_time(curve, size_bytes, f * size_bytes, 0.0, 0.0, curve.line_gb_per_s * GB)
    return f * size_bytes / t / GB


def per_nic(curve: BusbwCurve, size_bytes: float, nic_gb_per_s: float) -> float:
    """busbw per NIC (GB/s) of ``curve`` at ``size_bytes``, its line being a node's NICs of
    ``nic_gb_per_s`` each: the 8-NIC HDR curve at 4 GiB, 188.18 x 25 / 200 = 23.52."""
    return busbw_at(curve, size_bytes) * nic_gb_per_s / curve.line_gb_per_s


def nic_ratio(own: Optional[BusbwCurve], fit_gb_per_s: float, catalog: Mapping[str, BusbwCurve],
              nic_gb_per_s: float) -> tuple[float, str]:
    """(r, how): the fitted run ``own`` (its line ``fit_gb_per_s`` x its NICs per node, as
    applied) per NIC over the catalog curve of its own pattern per NIC (NICs of
    ``nic_gb_per_s``), both at that curve's largest size. Without ``own`` or a catalog curve of
    its pattern, the fit's ``fit_gb_per_s`` over the fastest catalog all-reduce per NIC (the
    smallest r: a scaled curve is then never faster than the pattern it might be). (1, "") when
    ``catalog`` has no NIC all-reduce curve."""
    ref_key = pattern(own) if own is not None else None
    if own is not None and ref_key is not None and ref_key in catalog:
        ref = catalog[ref_key]
        size = ref.sizes_bytes[-1]
        meas, cat = per_nic(own, size, fit_gb_per_s), per_nic(ref, size, nic_gb_per_s)
        return meas / cat, (f"{meas:.2f} / {cat:.2f} GB/s per NIC at {human_bytes(size)}: the fitted run over the "
                            f"catalog's {NIC_PATTERNS[ref_key]}")
    refs = [(per_nic(c, c.sizes_bytes[-1], nic_gb_per_s), k) for k, c in catalog.items() if k in ("nic", "nic1")]
    if not refs:
        return 1.0, ""
    cat, k = max(refs)
    return fit_gb_per_s / cat, (f"{fit_gb_per_s:.2f} / {cat:.2f} GB/s per NIC: the fit's bandwidth over the "
                                f"catalog's {NIC_PATTERNS[k]}, the fastest (no fitted curve of a catalog pattern)")


def scaled_curve(curve: BusbwCurve, r: float, fit_gb_per_s: float, nic_gb_per_s: float, how: str) -> BusbwCurve:
    """``curve`` read at ``r`` x its busbw once the NIC rate is the fit's ``fit_gb_per_s``
    instead of the catalog's ``nic_gb_per_s`` (module docstring), its source saying so."""
    line = curve.line_gb_per_s * fit_gb_per_s / (nic_gb_per_s * r)
    return curve.model_copy(update={"line_gb_per_s": line, "calibrated": False,
                                    "source": f"scaled x{r:.3f} by --calibration ({how}); catalog: {curve.source}"})


def nic_curves(own: Optional[BusbwCurve], others: list[BusbwCurve], fit_gb_per_s: float,
               catalog: Mapping[str, BusbwCurve], nic_gb_per_s: float) -> dict[str, BusbwCurve]:
    """The calibrated NIC class's curves of the patterns other than ``own``'s ("nic1", "p2p";
    ``own`` itself becomes "nic", :func:`~meshplan.comm.calibration.apply_calibration`): a run
    of that pattern in ``others`` (the file's other curves, read against the fit's NICs as they
    are), else the ``catalog`` curve scaled by :func:`nic_ratio`, else none (the pattern then
    reads "nic", as a catalog node without it does)."""
    mine = pattern(own) if own is not None else "nic"
    out: dict[str, BusbwCurve] = {}
    r, how = None, ""
    for key in ("nic1", "p2p"):
        if key == mine:
            continue
        theirs = next((c for c in others if pattern(c) == key), None)
        if theirs is not None:
            out[key] = theirs
        elif key in catalog:
            if r is None:
                r, how = nic_ratio(own, fit_gb_per_s, catalog, nic_gb_per_s)
            out[key] = scaled_curve(catalog[key], r, fit_gb_per_s, nic_gb_per_s, how)
    return out


def kinds_set(link: str, op: Optional[str], ranks: Optional[int], nodes: Optional[int],
              others: Sequence[BusbwCurve] = ()) -> str:
    """What a ``link`` class's fit of ``op`` over ``ranks`` on ``nodes`` sets, one line (the
    module docstring's rule), for ``meshplan calibrate``'s output; ``others``: the curves of the
    class's other files (a run of a NIC pattern among them sets that pattern).

    >>> kinds_set("nic", "all-reduce", 2, 2).split("; ")[0]
    'nic: this file sets all-reduce, all-gather, reduce-scatter and all-to-all across nodes (from the all-reduce fit over 2 ranks on 2 nodes'
    >>> kinds_set("nic", "all-reduce", 2, 2).split("; ")[2].split(" kept")[0]
    "the catalog's send/recv pair (p2p) curve is"
    """
    run = f"the {op} fit over {ranks} ranks" + (f" on {nodes} nodes" if nodes else "") if op else "the fit"
    head = (f"{link}: this file sets all-reduce, all-gather, reduce-scatter and all-to-all "
            f"{'across nodes' if link == 'nic' else 'on ' + link} (from {run}; one busbw for every ring op, "
            "nccl-tests doc/PERFORMANCE.md)")
    if link != "nic":
        return head + "; NVLS and tree are not added to it"
    own = pattern(BusbwCurve(op=cast(Any, op), ranks=ranks, nodes=nodes or 1, line_gb_per_s=1.0, sizes_bytes=[1],
                             busbw_gb_per_s=[1.0], source="-")) if op and ranks else "nic"
    theirs = {pattern(c) for c in others}
    rest = [k for k in ("nic1", "p2p") if k != own]
    kept = [k for k in rest if k not in theirs]
    parts = [f"its {NIC_PATTERNS[k]} ({k}) from the file's own run of it" for k in rest if k in theirs]
    if kept:
        said = " and ".join(f"{NIC_PATTERNS[k]} ({k})" for k in kept)
        parts.append(f"the catalog's {said} {'curves are' if len(kept) > 1 else 'curve is'} kept, scaled by this "
                     "run's busbw per NIC over the catalog's of its own pattern (a run of that pattern sets it "
                     "instead: sendrecv_perf, or alltoall_perf over 2 ranks on 2 hosts, for send/recv)")
    return "; ".join([head] + parts)
