"""Eager DTensor TP's host pace as a floor on the step bound's unit cores
(:func:`host_pace_floor`, for :func:`meshplan.search.layer_bounds.unit_bounds`): a unit's layers
cannot end before the host has issued them (:meth:`meshplan.schedule.unit_sim.StreamSim.host_pace`).
Moved from :mod:`meshplan.search.layer_bounds` unchanged (that module was over 400 lines).
"""

from __future__ import annotations

import numpy as np

from meshplan.config import Config
from meshplan.schedule import workload  # its dtensor_host_s through the module: one home, one override
from meshplan.search.layer_replays import replayed_layers
from meshplan.search.memory import Stages, split
from meshplan.search.space import RECOMPUTE, Candidates
from meshplan.spec.axes.base import Dim


def host_pace_floor(cfg: Config, c: Candidates, st: Stages, out: dict, roots_s: np.ndarray) -> None:
    """Raise ``out``'s chunk cores (``f_core``, ``b_core``, their ``_hi`` and ``0`` forms, and
    per-layer AC's ``_x`` forms, a chunk with one replay more: :mod:`~meshplan.search.layer_replays`; in
    place) to eager DTensor TP's host pace (:func:`meshplan.schedule.workload.dtensor_host_s`
    per candidate's tp): a unit's layers cannot end before the host has issued them
    (:meth:`meshplan.schedule.unit_sim.StreamSim.host_pace`, its clock from the unit's start).
    A forward unit of n layers lasts at least n x the forward pace, then its head; what runs
    before or beside its layers may run under the host's issue: the embedding, the roots'
    copy-outs (``roots_s``, per stage). A backward unit: n x the backward pace (plus the
    forward's under full recompute, which replays every layer, and on per-layer AC's replayed
    layers, :func:`replayed_layers`), the head's backward under it,
    the embedding's gradient after. The extras step_lower_bound adds to a core (a gathering
    pass's ``f_extra``, ``b_extra``, ``b_extra_head``; a last gradient unit's ``b_red``,
    ``b_wait``) may run under the host's issue too: each is lowered by its core's raise (the
    larger of the short and the long chunk's for the single-length extras, and of a chunk's with
    one replay more), so a core and its
    extra together are at most the larger of the unit's device bound and its pace: the bound
    stays a lower bound."""
    tp = split(c, Dim.HEADS)
    hf, hb = np.zeros(len(c)), np.zeros(len(c))
    for t in np.unique(tp).tolist():
        hf[tp == t], hb[tp == t] = workload.dtensor_host_s(cfg, int(t))
    if not hf.any():
        return
    hb = hb + hf * (c.rc == RECOMPUTE.index("full"))
    col = lambda a: np.asarray(a)[:, None]
    raise_f, raise_b = {}, {}
    for key, n, plus in (("", st.n_chunk, 0), ("_hi", st.n_chunk_hi, 0), ("_x", st.n_chunk, 1),
                         ("_hi_x", st.n_chunk_hi, 1)):
        if "f_core" + key not in out:  # no per-layer AC row: no ``_x`` cores
            continue
        fk, bk, has = "f_core" + key, "b_core" + key, n >= 1
        f = np.maximum(out[fk], has * (n * col(hf) - out["emb_f"] - roots_s))
        # per-layer AC: its replayed layers issue their forward again too
        b = np.maximum(out[bk], has * (n * col(hb) + replayed_layers(c, n, plus) * col(hf) - out["head_b"]))
        raise_f[key], raise_b[key] = f - out[fk], b - out[bk]
        out[fk], out[bk] = f, b
    for key in ("", "_hi"):  # a chunk's last gradient unit, whichever its replays
        for extra in ("b_red", "b_wait"):
            out[extra + key] = np.maximum(out[extra + key] - np.maximum(raise_b[key], raise_b.get(key + "_x", 0.0)), 0.0)
    rf, rb = (np.maximum.reduce(list(r.values())) for r in (raise_f, raise_b))
    out["f_extra"] = np.maximum(out["f_extra"] - rf, 0.0)
    out["b_extra"] = np.maximum(out["b_extra"] - rb, 0.0)
    out["b_extra_head"] = np.maximum(out["b_extra_head"] - rb, 0.0)
    long0 = (out["n_long"] > 0) & (st.k > 0)
    out["f_core0"] = np.where(long0, out["f_core_hi"], out["f_core"])
    out["b_core0"] = np.where(long0, out["b_core_hi"], out["b_core"])
