"""Self-contained HTML pages: tables, embedded PNG plots and inline SVG charts, no script and
no external resource (a page opens from a file, offline, in any browser).

Every string that reaches the page goes through :func:`esc` (``html.escape`` with quotes),
model names and config paths included: input text never becomes markup.

Charts (inline SVG, one ``<title>`` tooltip per shape):

- :func:`gantt_svg`: the predicted pipeline timeline, one row per stage (its example rank),
  the compute stream's forward (F), backward (B) and weight-gradient (W) units and the
  step-end ops, pp sends on a thin lane below; x in ms from the step start.
- :func:`load_bars_svg`: one bar per physical link, busy time / the stage's compute time
  (1.0 marked: a bar past it does not fit).

>>> esc('<b>"x"</b> & y')
'&lt;b&gt;&quot;x&quot;&lt;/b&gt; &amp; y'
>>> table(["a", "b"], [["<1>", 2]])
'<table><thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr><td>&lt;1&gt;</td><td>2</td></tr></tbody></table>'
"""

from __future__ import annotations

import base64
import html
import math
from typing import Iterable, Optional, Sequence

from meshplan.pipeline.simulate import Event

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1400px;color:#1b1b1b}
h1{font-size:22px;margin-bottom:4px}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:3px;margin-top:28px}
h3{font-size:15px;margin-bottom:4px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
th,td{border:1px solid #d0d0d0;padding:3px 7px;text-align:right;vertical-align:top}
th{background:#f0f3f7}td:first-child,th:first-child{text-align:left}
.ok{color:#1b7a1b;font-weight:bold}.bad{color:#b00020;font-weight:bold}
.lines{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px;white-space:pre-wrap}
.cols{display:flex;gap:24px;flex-wrap:wrap}.cols>div{flex:1 1 600px;min-width:0;overflow-x:auto}
img,svg{max-width:100%;height:auto}.note{color:#555;font-size:13px}
"""

#: Fill of a Gantt unit by the first letter of its name; step-end ops and others: gray.
UNIT_COLORS = {"F": "#2e75b6", "B": "#c55a11", "W": "#7030a0"}


def esc(x: object) -> str:
    """``str(x)`` escaped for HTML text and attribute values."""
    return html.escape(str(x), quote=True)


def table(head: Sequence[str], rows: Iterable[Sequence[object]], caption: str = "") -> str:
    """An HTML table; every header and cell escaped."""
    cap = f"<caption>{esc(caption)}</caption>" if caption else ""
    th = "".join(f"<th>{esc(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table>{cap}<thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def lines(text_lines: Iterable[str]) -> str:
    """Printed report lines, kept as they are (monospace, escaped)."""
    return '<div class="lines">' + esc("\n".join(text_lines)) + "</div>"


def section(title: str, body: str) -> str:
    return f"<section><h2>{esc(title)}</h2>{body}</section>"


def png_img(png: bytes, alt: str) -> str:
    """A PNG embedded as a base64 data URI."""
    return f'<img alt="{esc(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def page(title: str, subtitle: str, sections: Iterable[str]) -> str:
    """The whole document: UTF-8, inline CSS, the sections in order."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width\"><title>{esc(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{esc(title)}</h1><p class=\"note\">{esc(subtitle)}</p>"
            + "".join(sections) + "</body></html>\n")


def _ticks(hi: float, n: int = 8) -> list[float]:
    """Round tick positions from 0 to ``hi`` (1, 2 or 5 x 10^k apart).

    >>> _ticks(0.95)
    [0.0, 0.2, 0.4, 0.6, 0.8]
    """
    if hi <= 0:
        return [0.0]
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [round(i * step, 12) for i in range(int(hi / step) + 1)]


#: Narrower than this (px) a Gantt unit is drawn merged with its narrow neighbours (:func:`gantt_runs`).
NARROW_PX = 4.0
#: A merged run of narrow units closes before it grows wider than this (px): at most about 1,050 / 16
#: = 66 merged shapes a lane of the 1,050 px plot.
RUN_PX = 16.0
#: Narrow units further apart than this (px) start a new run (the idle time between them stays visible),
#: but for ticks: units under 1 px (a pp send of 0.02 px, drawn at the 0.5 px floor) join a run across
#: any gap within it, as a row of ticks reads as one band at this scale.
GAP_PX = 1.0


def _fill(e: Event, is_post: bool) -> str:
    return "#9e9e9e" if is_post else ("#70ad47" if e.stream == "pp" else UNIT_COLORS.get(e.name[:1], "#9e9e9e"))


def _blend(shares: dict[str, float]) -> str:
    """The time-weighted mean of fills ``shares`` (hex colour -> seconds): one fill for a merged run.

    >>> _blend({"#2e75b6": 1.0}), _blend({"#000000": 1.0, "#ffffff": 1.0})
    ('#2e75b6', '#808080')
    """
    total = sum(shares.values()) or 1.0
    rgb = [round(sum(int(c[1 + 2 * k:3 + 2 * k], 16) * t for c, t in shares.items()) / total) for k in range(3)]
    return "#" + "".join(f"{v:02x}" for v in rgb)


def gantt_runs(units: Sequence[tuple[Event, bool]], px_per_s: float) -> list[list[tuple[Event, bool]]]:
    """One lane's units (event, is a step-end op), in time order, as the shapes the Gantt draws: a unit
    :data:`NARROW_PX` wide or wider alone; consecutive narrower ones merged while their run is under
    :data:`RUN_PX` wide and no gap between them exceeds :data:`GAP_PX` (a tick's, any; ``px_per_s``: the
    chart's pixels per second). A 175B Megatron-LM plan (pp 16 x dp 8 x tp 8, vpp 3, 192 micro-batches) drew 36,564 rects, one
    per unit at under a pixel each (6.3 MB of HTML, newcomer trial 23); merged, each lane holds at most a
    few hundred shapes and the page keeps what a pixel can show: where each stage is busy, idle, and on what.

    >>> ev = lambda a, b: (Event(0, "compute", "F", a, b), False)  # noqa: E731
    >>> [len(r) for r in gantt_runs([ev(0, 1), ev(1, 1.001), ev(1.001, 1.002), ev(1.5, 1.501)], 1000.0)]
    [1, 2, 1]
    """
    runs: list[list[tuple[Event, bool]]] = []
    for u in units:
        e = u[0]
        narrow = (e.end_s - e.start_s) * px_per_s < NARROW_PX
        last = runs[-1] if runs else None
        tick = (e.end_s - e.start_s) * px_per_s < 1.0
        if (narrow and last is not None and (last[-1][0].end_s - last[-1][0].start_s) * px_per_s < NARROW_PX
                and (tick or (e.start_s - last[-1][0].end_s) * px_per_s <= GAP_PX)
                and (e.end_s - last[0][0].start_s) * px_per_s <= RUN_PX):
            last.append(u)
        else:
            runs.append([u])
    return runs


def _run_shape(run: list[tuple[Event, bool]], x, y: float, h: float) -> str:
    """One rect (with its tooltip, and its name where it fits) for a unit or a merged run."""
    first, last = run[0][0], run[-1][0]
    w = max(x(last.end_s) - x(first.start_s), 0.5)
    if len(run) == 1:
        tip = f"stage {first.stage} {first.stream}: {first.name}, {first.start_s * 1e3:.3f}-{first.end_s * 1e3:.3f} ms"
        label = (f'<text x="{x(first.start_s) + w / 2:.1f}" y="{y + h / 2 + 4:.1f}" text-anchor="middle" fill="white">'
                 f'{esc(first.name)}</text>') if first.stream != "pp" and w > 7 * len(first.name) else ""
        fill = _fill(first, run[0][1])
    else:
        shares: dict[str, float] = {}
        kinds: dict[str, int] = {}
        for e, post in run:
            shares[_fill(e, post)] = shares.get(_fill(e, post), 0.0) + e.end_s - e.start_s
            kind = "step end" if post else ("send" if e.stream == "pp" else e.name[:1])
            kinds[kind] = kinds.get(kind, 0) + 1
        counts = ", ".join(f"{k} {n}" for k, n in kinds.items())
        tip = (f"stage {first.stage} {first.stream}: {len(run)} units merged ({counts}; {first.name} to {last.name}), "
               f"{first.start_s * 1e3:.3f}-{last.end_s * 1e3:.3f} ms")
        label, fill = "", _blend(shares)
    return (f'<rect x="{x(first.start_s):.2f}" y="{y}" width="{w:.2f}" height="{h}" fill="{fill}">'
            f'<title>{esc(tip)}</title></rect>{label}')


def gantt_svg(events: Sequence[Event], post: Sequence[Event], ranks: Sequence[int], width: int = 1200) -> str:
    """The pipeline timeline as an SVG Gantt chart (see the module docstring). ``events``:
    the simulated units (streams ``compute`` and ``pp``), ``post``: the step-end ops,
    ``ranks[s]``: the example rank of stage s. Times in seconds, drawn in ms; units under
    :data:`NARROW_PX` merged with their narrow neighbours (:func:`gantt_runs`)."""
    stages = len(ranks)
    end_s = max([e.end_s for e in (*events, *post)] + [1e-9])
    left, right, row_h, lane_h, top = 130, 20, 34, 8, 24
    plot_w = width - left - right
    height = top + stages * row_h + 40

    def x(t: float) -> float:
        return left + t / end_s * plot_w

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-size="11" role="img" aria-label="pipeline timeline">']
    for t in _ticks(end_s * 1e3):
        xt = x(t / 1e3)
        out.append(f'<line x1="{xt:.1f}" y1="{top - 4}" x2="{xt:.1f}" y2="{top + stages * row_h}" stroke="#e3e3e3"/>'
                   f'<text x="{xt:.1f}" y="{top - 8}" text-anchor="middle">{t:g}</text>')
    out.append(f'<text x="{left + plot_w / 2:.0f}" y="{height - 8}" text-anchor="middle">ms from the step start'
               f' (step {end_s * 1e3:.3f} ms)</text>')
    for s in range(stages):
        y = top + s * row_h
        out.append(f'<text x="4" y="{y + 16}">stage {s} (rank {ranks[s]})</text>')
    lanes: dict[tuple[int, bool], list[tuple[Event, bool]]] = {}
    for e, is_post in [(e, False) for e in events] + [(e, True) for e in post]:
        lanes.setdefault((e.stage, e.stream == "pp"), []).append((e, is_post))
    merged = 0
    out.append('<g stroke="white" stroke-width="0.5">')
    for (stage, pp), units in sorted(lanes.items()):
        y = top + stage * row_h + (row_h - lane_h - 4 if pp else 2)
        h = lane_h if pp else row_h - lane_h - 10
        for run in gantt_runs(sorted(units, key=lambda u: (u[0].start_s, u[0].end_s)), plot_w / end_s):
            merged += len(run) > 1
            out.append(_run_shape(run, x, y, h))
    out.append("</g></svg>")
    legend = " ".join(f'<span style="color:{c}">&#9632;</span> {k}' for k, c in
                      (("forward", UNIT_COLORS["F"]), ("backward", UNIT_COLORS["B"]), ("weight gradient",
                       UNIT_COLORS["W"]), ("pp send", "#70ad47"), ("step end (reduction, optimizer)", "#9e9e9e")))
    if merged:
        legend += (f"; units under {NARROW_PX:g} px are drawn merged with their neighbours, in their colours' "
                   "time-weighted mix (hover for the count)")
    return "".join(out) + f'<p class="note">{legend}</p>'


def load_bars_svg(rows: Sequence[tuple[str, float, float, float]], width: int = 1200) -> str:
    """Horizontal bars, one per link: ``(label, busy_s, interval_s, gb)``; the bar is busy /
    interval, the dashed line at 1.0 (a longer bar does not fit), bars drawn up to 2.0 and
    the ratio written beside each."""
    left, right, bar_h, top = 330, 170, 18, 20
    plot_w = width - left - right
    height = top + len(rows) * (bar_h + 8) + 24
    scale = 2.0

    def x(v: float) -> float:
        return left + min(v, scale) / scale * plot_w

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-size="11" role="img" aria-label="link load">']
    for i, (label, busy, interval, gb) in enumerate(rows):
        y = top + i * (bar_h + 8)
        ratio = busy / interval if interval > 0 else float("inf")
        color = "#548235" if ratio <= 1 else "#b00020"
        tip = f"{label}: {gb:,.1f} GB per step, busy {busy:.4g} s of {interval:.4g} s"
        out.append(f'<g><title>{esc(tip)}</title><text x="4" y="{y + 13}">{esc(label)}</text>'
                   f'<rect x="{left}" y="{y}" width="{x(ratio) - left:.1f}" height="{bar_h}" fill="{color}"/>'
                   f'<text x="{x(ratio) + 4:.1f}" y="{y + 13}">{ratio:.2f}x ({gb:,.1f} GB)</text></g>')
    one = x(1.0)
    out.append(f'<line x1="{one:.1f}" y1="{top - 6}" x2="{one:.1f}" y2="{height - 20}" stroke="black" '
               f'stroke-dasharray="4 3"/><text x="{one:.1f}" y="{height - 6}" text-anchor="middle">busy = '
               f'compute time</text>')
    out.append("</svg>")
    return "".join(out)


def verdict_html(feasible: Optional[bool], reasons: Sequence[str]) -> str:
    """Feasible / infeasible in colour, then the reasons."""
    if feasible is None:
        return ""
    head = '<p class="ok">feasible</p>' if feasible else '<p class="bad">infeasible</p>'
    return head + ("<ul>" + "".join(f"<li>{esc(r)}</li>" for r in reasons) + "</ul>" if reasons else "")
