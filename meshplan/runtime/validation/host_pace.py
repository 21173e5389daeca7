"""Eager DTensor TP's host pace per transformer block from ``bench rank`` evidence: the values of
a kernels file's ``[host]`` table (:data:`meshplan.compute.kernel_fragment.HOST_KEYS`), derived as
the catalog's were (kernels.toml ``[host] dtensor_tp_block_*``, M1: benchmarks/gpu_h200/run2 and
run3 ``one_rank.json``). Pure functions of the evidence JSON (no torch, no device).

**Host-bound pass** (:func:`host_bound_passes`): a forward or backward of a run at tp > 1 where
(1) the host took at least as long to issue the pass as the device took to run its blocks
(``host.<pass>_issue_s >= host.blocks_<pass>_s``: the host never got ahead) and (2) the measured
per-block median is above the kernels' prediction by more than :data:`HOST_BOUND_EXCESS` (the
device ran slower than its kernels: it waited for the host). The kernels' prediction is the
row's ``kernels`` (evidence written since the host pace: ``predicted`` is then the larger of the
kernels and the pace), else the row's ``predicted`` (runs 1-3 predicted the kernels alone).

**The pace** (:func:`host_pace`): per pass, the mean device time of every block of every
host-bound pass of the evidence (each timed step, each block): there the device runs at the
host's pace. On runs 2 and 3: the 70B tp 8 forward and both passes of the 8B tp 4 run, 48
forward blocks at a mean of 4.65 ms and 24 backward blocks at 5.37 ms, the catalog's figures
(tests/test_one_rank.py).
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Optional

from meshplan.compute.kernel_fragment import HOST_KEYS

#: A pass is host-bound when its measured per-block median exceeds the kernels' prediction by
#: more than this fraction: twice the kernel model's per-layer accuracy where the device is busy
#: on the H200 (within 5%: FSDP alone and 70B at micro-batch 2, benchmarks/gpu_h200/README.md
#: item 1), so that a device-bound pass within that accuracy is never taken for the host's pace.
HOST_BOUND_EXCESS = 0.10
PASSES = ("forward", "backward")


def _tp(ev: dict) -> int:
    """The run's tp degree (1 without a ``tp`` axis)."""
    mesh = ev.get("mesh", {})
    return math.prod(int(s) for n, s in zip(mesh.get("names", []), mesh.get("shape", [])) if n == "tp")


def host_bound_passes(ev: dict) -> tuple[str, ...]:
    """The passes ("forward", "backward") of one ``bench rank`` evidence dict that ran at the
    host's pace (module docstring); none at tp 1 or without host figures."""
    host = ev.get("host") or {}
    out = []
    for p in PASSES:
        row = ev.get("rows", {}).get(f"{p}_s", {})
        kernels = row.get("kernels", row.get("predicted"))
        issue, blocks, measured = host.get(f"{p}_issue_s"), host.get(f"blocks_{p}_s"), row.get("measured")
        if _tp(ev) <= 1 or kernels is None or issue is None or blocks is None or measured is None or not kernels:
            continue
        if issue >= blocks and measured > (1 + HOST_BOUND_EXCESS) * kernels:
            out.append(p)
    return tuple(out)


def host_bound_blocks(evidence: Iterable[dict]) -> dict[str, list[float]]:
    """Per pass, the device seconds of every block of every host-bound pass (:func:`host_bound_passes`)
    over the timed steps of ``evidence`` (``bench rank`` dicts)."""
    blocks: dict[str, list[float]] = {p: [] for p in PASSES}
    for ev in evidence:
        for p in host_bound_passes(ev):
            blocks[p] += [float(t) for step in ev.get("per_step", []) for t in step.get(p, [])]
    return blocks


def host_pace(evidence: Iterable[dict]) -> dict[str, Optional[float]]:
    """Per pass, the mean seconds per block of its host-bound blocks (:func:`host_bound_blocks`),
    None where no pass was host-bound."""
    return {p: (statistics.fmean(b) if b else None) for p, b in host_bound_blocks(evidence).items()}


def host_table(evidence: Iterable[dict]) -> tuple[Optional[dict[str, float]], str]:
    """(the ``[host]`` table, a line saying what it holds), or (None, why not) when a pass was not
    host-bound: the table needs both keys, and a device-bound pass only bounds the pace from above.

    >>> ev = {"mesh": {"names": ["tp"], "shape": [4]}, "per_step": [{"forward": [4e-3, 5e-3], "backward": [6e-3]}],
    ...       "host": {"forward_issue_s": 0.02, "blocks_forward_s": 0.009, "backward_issue_s": 0.03,
    ...                "blocks_backward_s": 0.006},
    ...       "rows": {"forward_s": {"measured": 4.5e-3, "kernels": 2e-3},
    ...                "backward_s": {"measured": 6e-3, "kernels": 4e-3}}}
    >>> table, line = host_table([ev])
    >>> [round(v * 1e3, 6) for v in table.values()], line
    ([4.5, 6.0], 'host pace: forward 4.50 ms (2 blocks), backward 6.00 ms (1 blocks)')
    >>> ev["rows"]["backward_s"]["kernels"] = 5.9e-3   # the backward within 10% of its kernels: device-bound
    >>> host_table([ev])[1].split(" (")[0]
    "the backward did not run at the host's pace"
    """
    evidence = list(evidence)
    pace, counts = host_pace(evidence), {p: len(b) for p, b in host_bound_blocks(evidence).items()}
    fwd, bwd = pace["forward"], pace["backward"]
    if fwd is None or bwd is None:
        missing = [p for p in PASSES if pace[p] is None]
        return None, (f"the {' and '.join(missing)} did not run at the host's pace (tp > 1, the host's issue at least "
                      f"the device's time and the blocks over {HOST_BOUND_EXCESS:.0%} above their kernels)")
    return dict(zip(HOST_KEYS, (fwd, bwd))), (f"host pace: forward {fwd * 1e3:.2f} ms ({counts['forward']} blocks), "
                                              f"backward {bwd * 1e3:.2f} ms ({counts['backward']} blocks)")


__all__ = ["HOST_BOUND_EXCESS", "host_bound_passes", "host_bound_blocks", "host_pace", "host_table"]
