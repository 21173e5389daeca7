"""The headroom rule, one home for every command (newcomer trial 27 #C): a planned peak that leaves
under :data:`~meshplan.spec.memory.ALLOCATOR_FRAGMENTATION` (15%) of the usable memory free while
``[memory] fragmentation_fraction``, the allowance the plan itself reserves, is below it is
*tight*: PyTorch's caching allocator was measured to lose about that much to fragmentation in LLM
training (GMLake, ASPLOS 2024), so such a mesh fits only if the allocator fragments less than it
was measured to. ``search`` lists tight rows after the others (:mod:`meshplan.search.headroom`,
its tiers), ``compare`` prints :func:`headroom_words` under its verdict per tight side, and the
memory ``fix:`` line of ``plan`` (:mod:`meshplan.plan_fix`) marks a tight option with it.

>>> usable = 72e9  # 80 GB of HBM less a 10% reserve
>>> tight(62.8 * 2**30, usable, 0.0), tight(28.3 * 2**30, usable, 0.0), tight(62.8 * 2**30, usable, 0.15)
(True, False, False)
>>> headroom_words(64.5 * 2**30, 67.1 * 2**30, 0.0)  # newcomer trial 27's fsdp_tp2, A100 80GB then at 80e9 B x 0.9
'tight: 2.6 GiB = 3.9% of the usable 67.1 GiB free, under 15%'
>>> headroom_words(17.9 * 2**30, 67.1 * 2**30, 0.0)
''
"""

from __future__ import annotations

import numpy as np

from meshplan.spec.memory import ALLOCATOR_FRAGMENTATION
from meshplan.units import GiB


#: The measurement behind :data:`ALLOCATOR_FRAGMENTATION`, in the words every tight line quotes
#: (``plan``, ``step``, ``compare``: :func:`tight_warning`; ``search``'s headroom warning).
FRAGMENTATION_SOURCE = (f"PyTorch's caching allocator was measured to lose about {ALLOCATOR_FRAGMENTATION:.0%} to "
                        f"fragmentation in LLM training (GMLake, ASPLOS 2024)")

#: The measured accuracy of the planned peak itself, which every tight line quotes beside
#: :data:`FRAGMENTATION_SOURCE` (newcomer trial 51: the headroom line stated no accuracy): ``bench rank``
#: of six torchtitan meshes on one H200 (benchmarks/gpu_h200/README.md, run 3; docs/fidelity.md) measured
#: peak allocated memory 6.0-36.3% above that day's plan, 0.2-10.7% above the plan after the itemisation
#: of that run's gap (the README's table "plan after", benchmarks/gpu_h200_peaks.py), not re-measured on a GPU.
PEAK_ACCURACY = ("the planned peak's measured error: bench rank on an H200 measured peak allocated memory 6-36% above "
                 "the plan, 0.2-10.7% above it since that gap was itemised (not re-measured; docs/fidelity.md)")


def tight(peak_bytes, usable_bytes: float, fragmentation_fraction: float):
    """Whether a planned peak (bytes; a float or a numpy array of them) leaves under
    :data:`ALLOCATOR_FRAGMENTATION` of ``usable_bytes`` free while the plan's own allowance
    ``fragmentation_fraction`` is below it: ``usable - peak < 0.15 x usable``, i.e. a peak above
    0.85 x usable (61.2e9 B = 57.0 GiB of H100's 72e9 B usable at a 10% reserve). A bool, or an array of them."""
    frac = ALLOCATOR_FRAGMENTATION
    under = (usable_bytes - np.asarray(peak_bytes, dtype=float) < frac * usable_bytes) & (fragmentation_fraction < frac)
    return under if np.ndim(peak_bytes) else bool(under)


def headroom_words(peak_bytes: float, usable_bytes: float, fragmentation_fraction: float) -> str:
    """``tight: 2.6 GiB = 3.9% of the usable 67.1 GiB free, under 15%`` where the peak is
    :func:`tight`, "" otherwise (a peak over usable memory does not fit: the plan's verdict
    says so, not this)."""
    if peak_bytes > usable_bytes or not tight(peak_bytes, usable_bytes, fragmentation_fraction):
        return ""
    free = usable_bytes - peak_bytes
    return (f"tight: {free / GiB:.1f} GiB = {free / usable_bytes:.1%} of the usable {usable_bytes / GiB:.1f} GiB free, "
            f"under {ALLOCATOR_FRAGMENTATION:.0%}")


def tight_warning(name: str, peak_bytes: float, usable_bytes: float, fragmentation_fraction: float) -> str:
    """The one ``warning (NAME): tight: ...`` line ``compare`` prints under its verdict for a tight
    side and ``plan`` and ``step`` for a tight mesh (newcomer trial 49: only search and compare
    flagged it), "" where the peak is not :func:`tight` (:func:`headroom_words`).

    >>> print(tight_warning("a", 64.5 * 2**30, 67.1 * 2**30, 0.0))
    warning (a): tight: 2.6 GiB = 3.9% of the usable 67.1 GiB free, under 15% at [memory] fragmentation_fraction 0%; PyTorch's caching allocator was measured to lose about 15% to fragmentation in LLM training (GMLake, ASPLOS 2024), and search lists such a mesh after those that keep 15% free; the planned peak's measured error: bench rank on an H200 measured peak allocated memory 6-36% above the plan, 0.2-10.7% above it since that gap was itemised (not re-measured; docs/fidelity.md)
    """
    words = headroom_words(peak_bytes, usable_bytes, fragmentation_fraction)
    if not words:
        return ""
    frac = f"{ALLOCATOR_FRAGMENTATION:.0%}"
    return (f"warning ({name}): {words} at [memory] fragmentation_fraction {fragmentation_fraction:.0%}; "
            f"{FRAGMENTATION_SOURCE}, and search lists such a mesh after those that keep {frac} free; {PEAK_ACCURACY}")


def retry_warning(name: str, timelines) -> str:
    """The ``warning (NAME): ...`` line of a mesh whose verdict fits (every stage's peak incl. communication
    buffers within usable memory) while the caching allocator's simulated reserved peak plus the communication
    buffers (:meth:`~meshplan.memory.timeline.Timeline.reserved_memory`, :mod:`meshplan.memory.reserved`) of
    some stage exceeds it: there a ``cudaMalloc`` fails, the allocator frees its cached blocks and retries
    (torch 2.13 ``torch/cuda/memory.py`` ``memory_stats``: ``num_alloc_retries``, "failed cudaMalloc calls that
    result in a cache flush and retry"), which synchronises the device and slows those steps: the run goes on,
    slower, rather than out of memory (newcomer trial 50 #7: plan, memory and the page said "fits" alone).
    "" where no stage's reserved bytes exceed usable, or under ``[memory] reserved_verdict`` (the verdict holds
    them then). The stage of the largest excess is named; ``timelines``: the plan's, one per stage."""
    over = [(tl.reserved_memory().device_bytes - tl.usable_bytes, tl) for tl in timelines
            if tl.reserved is None and tl.fits]
    over = [(x, tl) for x, tl in over if x > 0]
    if not over:
        return ""
    _, tl = max(over, key=lambda o: o[0])
    r = tl.reserved_memory()
    return (f"warning ({name}): fits at its peak incl. communication buffers ({tl.peak.total_bytes / GiB:.1f} GiB on "
            f"stage {tl.stage}), but the caching allocator's reserved peak, simulated, {r.reserved_bytes / GiB:.1f} GiB "
            f"+ {r.untracked_bytes / GiB:.1f} GiB communication buffers = {r.device_bytes / GiB:.1f} GiB exceeds the "
            f"usable {tl.usable_bytes / GiB:.1f} GiB: there a cudaMalloc fails and the allocator frees its cached "
            f"blocks and retries (torch.cuda.memory_stats num_alloc_retries), slower steps, not an OOM; "
            f"[memory] reserved_verdict = true holds the reserved peak instead")
