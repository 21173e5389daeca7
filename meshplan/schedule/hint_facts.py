"""What a step's ``hint:`` line says, as data beside its text (newcomer trial 55 #9: a CI gate read
"which knob, predicted step, peak" only by parsing prose). Each hint module
(:mod:`~meshplan.schedule.verdict`'s FSDP hint, :mod:`~meshplan.schedule.host_hint`,
:mod:`~meshplan.schedule.bubble_hint`, :mod:`~meshplan.schedule.tp_hint`,
:mod:`~meshplan.schedule.cp_hint`, :mod:`~meshplan.schedule.ep_hint`,
:mod:`~meshplan.schedule.link_hint`) returns its line as a :class:`HintLine`: the text, unchanged,
carrying a :class:`Hint` built from the same numbers the text prints, never parsed back from it.
``step --json`` lists them as ``hints`` (:func:`hint_docs`).

>>> line = HintLine("hint: x", Hint("tp", 0.207, (Knob("training.tp_comm_overlap = true", 9.38, 60e9),)))
>>> line == "hint: x", line.hint.knobs[0].step_s
(True, 9.38)
>>> hint_docs(["verdict: ...", line])
[{'stream': 'tp', 'share_of_step': 0.207, 'knobs': [{'knob': 'training.tp_comm_overlap = true', 'step_s': 9.38, 'peak_bytes': 60000000000.0}]}]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

#: The hints' streams: the exposed communication (fsdp, efsdp: expert FSDP, tp, cp, ep), the
#: pipeline bubble, the device waiting for the host, a link loaded past the compute it hides under.
STREAMS = ("fsdp", "efsdp", "tp", "cp", "ep", "bubble", "host", "link")


@dataclass(frozen=True)
class Knob:
    """One knob a hint lists: ``knob``, its words as the line prints them (meshplan's keys,
    ``training.reshard_after_forward = false``); ``step_s``, the step predicted with it (seconds);
    ``peak_bytes``, its memory timeline's peak (bytes). Only knobs that fit with a step more
    than 1% shorter are listed (:func:`meshplan.schedule.verdict.clearly_faster`)."""

    knob: str
    step_s: Optional[float]
    peak_bytes: Optional[float]


@dataclass(frozen=True)
class Hint:
    """One ``hint:`` line's facts: ``stream`` (one of :data:`STREAMS`), ``share``: the part of the
    step it is about as a fraction of the step (exposed time, bubble idle or host wait over the
    step; for ``link``, the busiest link's bytes over its capacity in the window it must fit in,
    which may pass 1), and its ``knobs``, best (shortest step) first; empty where the line lists
    none (a link hint that names no knob)."""

    stream: str
    share: float
    knobs: tuple[Knob, ...] = ()


class HintLine(str):
    """A ``hint:`` line's text (a ``str``, printed and kept in ``verdict`` as before) carrying its
    :class:`Hint` as ``.hint``."""

    hint: Hint

    def __new__(cls, text: str, hint: Hint) -> "HintLine":
        line = super().__new__(cls, text)
        line.hint = hint
        return line

    def __reduce__(self):
        return HintLine, (str(self), self.hint)


def knob_of(words: str, alt: Any) -> Knob:
    """The :class:`Knob` of a re-plan ``alt`` (a :class:`~meshplan.schedule.replan.Replanned`:
    its ``step_s`` and ``peak_bytes``) listed as ``words``."""
    peak = getattr(alt, "peak_bytes", 0.0)
    return Knob(words, getattr(alt, "step_s", None), float(peak) if peak else None)


def hint_docs(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The ``hints`` of ``step --json``: each :class:`HintLine` of ``lines`` (the verdict lines, in
    order) as ``{"stream", "share_of_step", "knobs": [{"knob", "step_s", "peak_bytes"}]}``."""
    return [{"stream": h.stream, "share_of_step": h.share,
             "knobs": [{"knob": k.knob, "step_s": k.step_s, "peak_bytes": k.peak_bytes} for k in h.knobs]}
            for h in (getattr(line, "hint", None) for line in lines) if isinstance(h, Hint)]
