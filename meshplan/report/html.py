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


def gantt_svg(events: Sequence[Event], post: Sequence[Event], ranks: Sequence[int], width: int = 1200) -> str:
    """The pipeline timeline as an SVG Gantt chart (see the module docstring). ``events``:
    the simulated units (streams ``compute`` and ``pp``), ``post``: the step-end ops,
    ``ranks[s]``: the example rank of stage s. Times in seconds, drawn in ms."""
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
    for e, is_post in [(e, False) for e in events] + [(e, True) for e in post]:
        y = top + e.stage * row_h + (2 if e.stream != "pp" else row_h - lane_h - 4)
        h = row_h - lane_h - 10 if e.stream != "pp" else lane_h
        fill = "#9e9e9e" if is_post else ("#70ad47" if e.stream == "pp" else UNIT_COLORS.get(e.name[:1], "#9e9e9e"))
        w = max(x(e.end_s) - x(e.start_s), 0.5)
        tip = f"stage {e.stage} {e.stream}: {e.name}, {e.start_s * 1e3:.3f}-{e.end_s * 1e3:.3f} ms"
        label = (f'<text x="{x(e.start_s) + w / 2:.1f}" y="{y + h / 2 + 4:.1f}" text-anchor="middle" fill="white">'
                 f'{esc(e.name)}</text>') if e.stream != "pp" and w > 7 * len(e.name) else ""
        out.append(f'<g><title>{esc(tip)}</title><rect x="{x(e.start_s):.2f}" y="{y}" width="{w:.2f}" height="{h}" '
                   f'fill="{fill}" stroke="white" stroke-width="0.5"/>{label}</g>')
    out.append("</svg>")
    legend = " ".join(f'<span style="color:{c}">&#9632;</span> {k}' for k, c in
                      (("forward", UNIT_COLORS["F"]), ("backward", UNIT_COLORS["B"]), ("weight gradient",
                       UNIT_COLORS["W"]), ("pp send", "#70ad47"), ("step end (reduction, optimizer)", "#9e9e9e")))
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
