"""PNG of a memory timeline: bytes per kind stacked over the events of one training step
(matplotlib, Agg backend), usable memory and HBM as lines, the peak marked.

Long timelines are thinned for drawing only: each of ``max_points / 2`` buckets of events
keeps its lowest and its highest total, so the envelope and the peak stay exact.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from meshplan.fileio import check_destination, write_output
from meshplan.memory.timeline import KINDS, Timeline
from meshplan.units import GiB, counted

COLORS = {"params": "#1f4e79", "master": "#2e75b6", "optimizer": "#9dc3e6", "grads": "#548235",
          "comm_buffers": "#7f7f7f", "userbuffers": "#595959", "workspace": "#bfbfbf", "fragmentation": "#d9d9d9",
          "gathered_params": "#c55a11", "grad_buffers": "#a9d18e", "activations": "#ffc000",
          "temporaries": "#ff66cc"}


def _thin(total: np.ndarray, max_points: int) -> np.ndarray:
    """Event indices to draw: all, or the min and max of each bucket (in order)."""
    n = len(total)
    if n <= max_points:
        return np.arange(n)
    edges = np.linspace(0, n, max_points // 2 + 1).astype(int)
    keep = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        if hi > lo:
            seg = total[lo:hi]
            keep += sorted({lo + int(seg.argmin()), lo + int(seg.argmax())})
    return np.array(keep)


def _zoom_range(tl: Timeline) -> tuple[int, int]:
    """Events of the pass holding the peak and of the pass before it."""
    n = max(i for i, p in enumerate(tl.passes) if p.first_event <= tl.peak.t_index)
    lo = tl.passes[max(n - 1, 0)].first_event
    last = tl.passes[n]
    return lo, last.first_event + len(tl.templates[last.template]) - 1


def _panel(ax, tl: Timeline, run: np.ndarray, idx: np.ndarray, shown: list[str], legend: bool) -> None:
    ys = [run[idx, KINDS.index(k)] / GiB for k in shown]
    ax.stackplot(idx, ys, labels=[k.replace("_", " ") for k in shown], colors=[COLORS[k] for k in shown],
                 linewidth=0)
    ax.axhline(tl.usable_bytes / GiB, color="red", linestyle="--", linewidth=1.2,
               label=f"usable {tl.usable_bytes / GiB:.1f} GiB (HBM - {tl.reserve:.0%} reserve)")
    ax.axhline(tl.hbm_bytes / GiB, color="black", linestyle=":", linewidth=1.2, label=f"HBM {tl.hbm_bytes / GiB:.1f} GiB")
    p = tl.peak
    ax.plot([p.t_index], [p.total_bytes / GiB], marker="v", color="red", markersize=10, zorder=5,
            label=f"peak {p.total_bytes / GiB:.1f} GiB")
    ax.set_ylim(0, max(tl.hbm_bytes, p.total_bytes) / GiB * 1.15)
    ax.set_xlim(idx[0], idx[-1])
    ax.set_ylabel("memory per rank (GiB)")
    ax.grid(axis="y", alpha=0.3)
    if legend:
        handles, labels = ax.get_legend_handles_labels()
        n = len(shown)  # stacked kinds listed top to bottom, as drawn
        order = list(range(n, len(handles))) + list(range(n - 1, -1, -1))
        ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _annotate(ax, tl: Timeline, lo: int, hi: int) -> None:
    p = tl.peak
    left = (p.t_index - lo) < 0.3 * (hi - lo)
    ax.annotate(f"peak {p.total_bytes / GiB:.1f} GiB\n{p.where()}", (p.t_index, p.total_bytes / GiB),
                textcoords="offset points", xytext=(40 if left else -40, 12), ha="left" if left else "right",
                fontsize=9, color="darkred", arrowprops=dict(arrowstyle="-", color="darkred"),
                bbox=dict(boxstyle="round", fc="white", ec="darkred", alpha=0.9))


def _figure(tl: Timeline, name: str, max_points: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = tl.running()
    shown = [k for i, k in enumerate(KINDS) if run[:, i].any()]
    fig, (top, zoom) = plt.subplots(2, 1, figsize=(13, 9), dpi=110, gridspec_kw={"height_ratios": [3, 2]})
    idx = _thin(run.sum(axis=1), max_points)
    _panel(top, tl, run, idx, shown, legend=True)
    _annotate(top, tl, 0, tl.n_events - 1)
    step = tl.passes[-1].first_event
    top.axvline(step, color="gray", linewidth=0.8)
    top.text(step, top.get_ylim()[1] * 0.97, "optimizer step ", fontsize=8, color="gray", ha="right", va="top")
    top.set_xlabel(f"event index in one training step ({tl.n_events:,} events: {tl.pipeline or tl.schedule} forward/backward "
                   f"passes of {counted(tl.micro_batches, 'micro-batch')}, then the optimizer step)")
    lo, hi = _zoom_range(tl)
    _panel(zoom, tl, run, np.arange(lo, hi + 1), shown, legend=False)
    zoom.set_ylim(0, tl.peak.total_bytes / GiB * 1.3)  # detail: usable and HBM may lie above
    _annotate(zoom, tl, lo, hi)
    z = [p for p in tl.passes if lo <= p.first_event <= hi]
    zoom.set_xlabel("zoom: " + ", then ".join(f"{p.phase} of micro-batch {p.microbatch}" + (f" chunk {p.chunk}" if
                    len({q.chunk for q in tl.passes}) > 1 else "") for p in z) + " (event index)")
    c = tl.peak
    fig.suptitle(f"{name}: {tl.title}, stage {tl.stage}, {tl.pipeline or tl.schedule}, {counted(tl.micro_batches, 'micro-batch')}\n"
                 f"peak {c.total_bytes / GiB:.1f} GiB at {c.where()}; headroom {tl.headroom_bytes / GiB:.1f} GiB "
                 f"to {tl.usable_bytes / GiB:.1f} GiB usable", fontsize=11)
    fig.tight_layout()
    return fig


def write_png(tl: Timeline, path: str | Path, name: str = "meshplan", force: bool = False,
              max_points: int = 20000) -> Path:
    """Write the timeline plot with :func:`meshplan.fileio.write_output` (atomic; an existing
    file refused unless ``force``, ConfigError naming --out); the folder is the command's own
    (``memory --out``), made when missing."""
    check_destination(path, "--out", force, create_folders=True)
    fig = _figure(tl, name, max_points)
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png")
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return write_output(path, buf.getvalue(), force=force, field="--out", create_folders=True)


def png_bytes(tl: Timeline, name: str = "meshplan", max_points: int = 20000) -> bytes:
    """The plot of :func:`write_png` as PNG bytes (for the HTML report, embedded as base64)."""
    fig = _figure(tl, name, max_points)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)
