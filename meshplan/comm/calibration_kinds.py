"""Which collective kinds a ``--calibration`` fit sets, and how the NIC class's other catalog
curves follow it (:func:`meshplan.comm.calibration_apply.apply_calibration`).

The rule, per link class:

- the fit and its own curve (``[[link.<class>.curve]]`` of the fitted run) set the class's
  ring collectives: all-reduce, all-gather and reduce-scatter, whose busbw is the same bus
  figure for every ring op (nccl-tests doc/PERFORMANCE.md: busbw "should reflect the speed of
  the hardware", independent of the op; :data:`RING_OPS`); on ``nvlink`` and ``pcie``, and in a
  ``nic`` table without logged curves (a file of before them), all-to-all too;
- on ``nic``, all-to-all is set by the file's own all-to-all run over more than 2 ranks (its
  curve, "a2a", :func:`~meshplan.comm.calibration_apply.op_curves`), else it keeps the catalog's "nic"
  curve; an all-to-all fit alone (trial 28: 34.66 GB/s per NIC, where rings reach 46-48, NVIDIA/
  nccl-tests issue #290) sets neither the NIC rate nor the ring ops nor send/recv (:func:`sets_ops`);
- on ``nvlink`` and ``pcie`` (links inside one node), per op too: the fit and its curve set every op
  the file has no run of, and an op with a run of its own is timed on that run's curve at that
  run's fitted alpha (:func:`own_runs`). NCCL does not run every op of a node alike: on an
  NVSwitch node all-reduce runs on NVLS, the others on the ring (catalog h100-nvlink4-nvls 478.87
  GB/s busbw at 8 GiB against h100-nvlink4-ring 368.0, [S3] and [S17]), so an all-reduce log does
  not stand for an all-gather;
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

#: The ops one ring op's log stands for: NCCL runs all-reduce (a reduce-scatter then an all-gather
#: on the same ring; tree too), all-gather and reduce-scatter on its ring, and nccl-tests
#: doc/PERFORMANCE.md defines their busbw (algbw x 2(n-1)/n for all-reduce, x (n-1)/n for the other
#: two) so that it is the same per-link figure for the three. all-to-all (pairwise sends to every
#: peer, busbw algbw x (n-1)/n too) and send/recv (busbw = algbw) run no ring: only their own log sets them.
RING_OPS = ("all-reduce", "all-gather", "reduce-scatter")

#: The NIC curve keys of a catalog node's ``busbw`` (catalog/nodes.toml) and the pattern each holds.
NIC_PATTERNS = {"nic": "all-reduce with several ranks per node", "nic1": "all-reduce with one rank per node",
                "p2p": "send/recv pair"}


def host_share(op: str, n: int, g: int) -> float:
    """A run's bytes per second through one host's NICs over its busbw (nccl-tests' column),
    for ``op`` over ``n`` ranks, ``g`` on each host, each rank on its own NIC (or ``g / N`` ranks
    on each of N); a ``nic`` fit per NIC is busbw x this / N (:mod:`meshplan.comm.calibrate_file`):

    - ring ops (all-reduce, all-gather, reduce-scatter) and send/recv: 1. A ring leaves a host
      once per channel and the channels spread over its NICs, so the host sends busbw bytes/s
      in all ([S18] 2 x 8 A100 all-reduce: 188.18 GB/s busbw at 4 GiB, 23.5 GB/s per 25 GB/s NIC);
    - all-to-all: ``g (n - g) / (n - 1)``. Its busbw is per rank: ``algbw (n - 1) / n``, the
      bytes a rank sends to its n - 1 peers per second (nccl-tests doc/PERFORMANCE.md), S/n to
      each (:func:`~meshplan.comm.nccl_algorithms.all_to_all_time`), so ``(n - g) / (n - 1)`` of them
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
    :func:`~meshplan.comm.calibration_apply.apply_calibration`), so that at the class's calibrated
    rate the curve reads its logged busbw: for ``nic`` the fit per NIC x the ``nics`` of a host
    over :func:`host_share` (the busbw the host's NICs carry at that rate); else the fit.

    >>> read_rate(45.0, 8, "all-reduce", 16, 2), round(read_rate(35.7165, 8, "all-to-all", 128, 16), 2)
    (360.0, 37.8)
    """
    if link != "nic":
        return fit_gb_per_s
    return fit_gb_per_s * nics / host_share(op, ranks, ranks // max(nodes, 1))


def pattern_of(op: str, ranks: int, nodes: int) -> str:
    """:func:`pattern` of a run of ``op`` over ``ranks`` on ``nodes`` hosts. "nic1" is the ring
    ops' one-rank-per-node pattern only: an all-to-all over more than 2 ranks is "nic" however
    many ranks a host holds (:func:`~meshplan.comm.nccl_algorithms.all_to_all_time` reads one curve
    for every group, each rank's bytes for other hosts through its own NIC, :func:`host_share`).

    >>> pattern_of("all-reduce", 4, 4), pattern_of("all-to-all", 4, 4), pattern_of("all-to-all", 2, 2)
    ('nic1', 'nic', 'p2p')
    """
    if op == "send/recv" or (op == "all-to-all" and ranks == 2):
        return "p2p"
    return "nic1" if ranks == nodes and op != "all-to-all" else "nic"


def pattern(curve: BusbwCurve) -> str:
    """The NIC pattern key a curve was measured in: "p2p" for send/recv or a 2-rank all-to-all
    (nccl-tests' alltoall over 2 ranks is one send and one receive per rank), "nic1" for a ring
    op's one rank per node, else "nic" (:func:`pattern_of`).

    >>> from meshplan.catalog import busbw_curve
    >>> [pattern(busbw_curve(k)) for k in ("ib-hdr-200-8nic", "ib-hdr-200-1nic-ring", "ib-hdr-200-1nic-pair")]
    ['nic', 'nic1', 'p2p']
    """
    return pattern_of(curve.op, curve.ranks, curve.nodes)


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
    ``own`` itself becomes "nic", :func:`~meshplan.comm.calibration_apply.apply_calibration`): a run
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
        kept = catalog.get(key) or (catalog.get("nic") if key == "p2p" else None)  # send/recv reads "nic" without
        if theirs is not None:
            out[key] = theirs
        elif kept is not None:
            if r is None:
                r, how = nic_ratio(own, fit_gb_per_s, catalog, nic_gb_per_s)
            out[key] = scaled_curve(kept, r, fit_gb_per_s, nic_gb_per_s, how)
    return out


def sets_ops(link: str, op: Optional[str], curves: Sequence[Any]) -> tuple[str, ...]:
    """The collectives a ``link`` table of fit ``op`` with logged ``curves`` (each with ``op``,
    ``ranks``, ``nodes``) sets: on ``nic`` with curves, the ring ops (:data:`RING_OPS`) for a
    ring fit, all-to-all for an all-to-all run over more than 2 ranks, send/recv for a run of the
    pair pattern (:func:`pattern_of`); every op else (``nvlink``, ``pcie``, and a file without
    curves, written before they were: its fit sets the class's rate for every op, as it did).

    >>> sets_ops("nic", "all-to-all", [BusbwCurve(op="all-to-all", ranks=16, nodes=2, line_gb_per_s=1.0,
    ...                                           sizes_bytes=[1], busbw_gb_per_s=[1.0], source="-")])
    ('all-to-all',)
    >>> sets_ops("nic", "all-reduce", [])
    ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'send/recv')
    """
    if link != "nic" or not curves:
        return (*RING_OPS, "all-to-all", "send/recv")
    kinds = {pattern_of(c.op, c.ranks, c.nodes) for c in curves if c.op not in RING_OPS}
    return (*(RING_OPS if op in RING_OPS else ()), *(("all-to-all",) if "nic" in kinds else ()),
            *(("send/recv",) if "p2p" in kinds else ()))


def own_runs(link: str, op: Optional[str], curves: Sequence[Any]) -> dict[str, Any]:
    """The ops an ``nvlink`` or ``pcie`` table of fit ``op`` times on runs of their own: each op of
    ``curves`` (each with ``op``) other than the fit's, with its first curve in the file (module
    docstring); {} on ``nic``, whose ops :func:`sets_ops` gives.

    >>> c = [BusbwCurve(op=o, ranks=8, line_gb_per_s=1.0, sizes_bytes=[1], busbw_gb_per_s=[1.0], source=o)
    ...      for o in ("all-reduce", "all-gather", "all-gather")]
    >>> list(own_runs("nvlink", "all-reduce", c)), own_runs("nic", "all-reduce", c)
    (['all-gather'], {})
    """
    out: dict[str, Any] = {}
    for c in curves if link != "nic" else ():
        if c.op != op:
            out.setdefault(c.op, c)
    return out


#: The ops an ``nvlink`` all-reduce fit does not set on a node whose all-reduce runs on NVLS
#: (``fabric.nvls``): the all-reduce log timed NVLS's all-reduce (catalog h100-nvlink4-nvls 478.87
#: GB/s busbw at 8 GiB against h100-nvlink4-ring 368.0, [S3] and [S17]), not them. NCCL's tuner may
#: pick NVLS for them too (NVIDIA/nccl 5067397 ``src/graph/tuning.cc`` lines 295-296 keep NVLS among
#: the all-gather and reduce-scatter algorithms), at a rate no log here measured; they stay on the
#: catalog's measured ring curve unless the file has a run of their own.
NVLS_KEPT = ("all-gather", "reduce-scatter")

#: What :func:`kinds_set` and the plan's header say of :data:`NVLS_KEPT`.
NVLS_KEPT_WORDS = ("except on a node whose all-reduce runs on NVLS (fabric nvls: dgx-h100, h200): there all-gather "
                   "and reduce-scatter keep the catalog's ring curve (the all-reduce log timed NVLS's all-reduce, "
                   "not them; an all_gather_perf or reduce_scatter_perf log sets them)")


def nvls_kept(link: str, op: Optional[str], curves: Sequence[Any]) -> tuple[str, ...]:
    """The ops of :data:`NVLS_KEPT` a ``link`` table of fit ``op`` leaves on the catalog's ring
    curve on an NVLS node: an ``nvlink`` all-reduce fit's, those without a run of their own.

    >>> nvls_kept("nvlink", "all-reduce", []), nvls_kept("nvlink", "all-gather", []), nvls_kept("pcie", "all-reduce", [])
    (('all-gather', 'reduce-scatter'), (), ())
    """
    if link != "nvlink" or op != "all-reduce":
        return ()
    own = own_runs(link, op, curves)
    return tuple(o for o in NVLS_KEPT if o not in own)


#: How to set the ops a file leaves at the catalog's curves.
SET_BY = {"ring": "an all_reduce_perf, all_gather_perf or reduce_scatter_perf log sets the three",
          "all-to-all": "an alltoall_perf log over several ranks per host sets it",
          "send/recv": "a sendrecv_perf log (or alltoall_perf over 2 ranks on 2 hosts) sets it"}


def ops_words(ops: Sequence[str]) -> str:
    """``all-reduce, all-gather and reduce-scatter``: ``ops`` as a list in words."""
    return ", ".join(ops[:-1]) + f" and {ops[-1]}" if len(ops) > 1 else "".join(ops)


def kinds_set(link: str, op: Optional[str], ranks: Optional[int], curves: Sequence[Any] = ()) -> str:
    """What a ``link`` class's fit of ``op`` over ``ranks`` with its logged ``curves`` (the fitted
    run's first) sets, one line for ``meshplan calibrate``'s output (:func:`sets_ops`; the ops it
    leaves keep the catalog's curves, each with the log that sets it, :data:`SET_BY`).

    >>> a2a = BusbwCurve(op="all-to-all", ranks=16, nodes=2, line_gb_per_s=1.0, sizes_bytes=[1],
    ...                  busbw_gb_per_s=[1.0], source="nccl-tests all-to-all over 16 ranks on 2 host(s), file a.log")
    >>> kinds_set("nic", "all-to-all", 16, [a2a]).split("; ")[0]
    'nic: this file sets, across nodes, all-to-all (its own logged curve: nccl-tests all-to-all over 16 ranks on 2 host(s), file a.log)'
    """
    own, nvls = own_runs(link, op, curves), nvls_kept(link, op, curves)
    if own or nvls:
        return f"{link}: this file sets, on {link}, " + "; ".join(
            [f"{ops_words([o for o in (*RING_OPS, 'all-to-all', 'send/recv') if o not in own])} from the {op} fit "
             f"over {ranks} ranks (no run of their own)"]
            + [f"{o} from its own run (its logged curve at its fitted alpha: {c.source})" for o, c in own.items()]
            + ([NVLS_KEPT_WORDS] if nvls else []))
    if link != "nic" or not curves:
        return (f"{link}: this file sets all-reduce, all-gather, reduce-scatter and all-to-all "
                f"{'across nodes' if link == 'nic' else 'on ' + link} (from the {op} fit over {ranks} ranks; one "
                "busbw for every ring op, nccl-tests doc/PERFORMANCE.md)"
                + ("; NVLS and tree are not added to it" if link != "nic" else ""))
    ops = sets_ops(link, op, curves)
    said = []
    if op in RING_OPS:
        said.append(f"{ops_words(RING_OPS)} (the {op} fit over {ranks} ranks and its curve: {curves[0].source}; NCCL "
                    "runs the three on one ring and nccl-tests doc/PERFORMANCE.md defines their busbw as the same "
                    "per-link figure, so one's log stands for all three)")
    for o in ops:
        if o not in RING_OPS:
            run = next(c for c in curves if o in sets_ops(link, None, [c]))
            said.append(f"{o} (its own logged curve: {run.source})")
    kept = [k for k in ("ring", "all-to-all", "send/recv") if k not in ops and not (k == "ring" and op in RING_OPS)]
    tail = [f"{ops_words(RING_OPS) + ' keep' if k == 'ring' else k + ' keeps'} the catalog's "
            f"{'curves' if k == 'ring' else 'curve'} ({SET_BY[k]})" for k in kept]
    return "; ".join([f"{link}: this file sets, across nodes, " + ", ".join(said[:-1])
                      + (" and " if len(said) > 1 else "") + said[-1]] + tail)
