"""The order a pass issues its layers' FSDP all-gathers in: :class:`LayerPrefetch` keeps a
frontier over the chunk's layers in the order the pass computes them and issues, in that
order on the FSDP stream, what a layer needs before it (on demand) and what the prefetch takes
after it (``ahead`` layers of the parameter stream past the layer computed).

``ahead`` is :attr:`~meshplan.schedule.unit_sim.Overlap.fsdp_ahead`: 1 for FSDP2 (its default
prefetch of one unit, as the timeline had it), 0 for no prefetch (every gather issued when its
layer starts, the compute waiting for all of it), and under DeepSpeed ZeRO-3 the layers its
coordinator's prefetch bucket holds (:func:`meshplan.spec.deepspeed_memory.deepspeed_prefetch_ahead`),
which may be a part of the next layer: that part is gathered during the layer before and the
rest on demand, unless ``slide``: DeepSpeed's window of ``stage3_max_live_parameters`` moves on
module by module (each module's release frees its room, the next module's fetch tops the
prefetch up), so while a layer computes the rest of the next layer's gather is issued too. At
the layer granularity of the step that is the next layer issued at the layer's start (a lead
of at least one layer); the bytes gathered at once stay ``ahead`` past the layer computed, the
memory timeline's (:func:`meshplan.spec.deepspeed_memory.deepspeed_prefetch_ahead`). The chunk's
first layer has no layer before it to slide over: ``start`` issues ``ahead`` of it. A part's
seconds are the layer's all-gather seconds times its share of the layer (an all-gather's time
is near linear in its bytes at these sizes; the copy-out DeepSpeed adds to a prefetched part, :func:`meshplan.comm.fsdp_rows._deepspeed_copied`, is shared the same way).

Three layers, one prefetched ahead (FSDP2): layer 0 before the first, then each next one
after the layer before it is issued:

>>> log = []
>>> pf = LayerPrefetch(lambda j, f: log.append((j, f)) or (j, f), [0, 1, 2], 1.0)
>>> pf.start(); pf.need(0); pf.after(0); pf.need(1); pf.after(1); pf.need(2); pf.after(2)
[(0, 1.0)]
[(1, 1.0)]
[(2, 1.0)]
>>> log
[(0, 1.0), (1, 1.0), (2, 1.0)]

A quarter of a layer ahead: the layer's quarter issued after the layer before, its rest on demand:

>>> log.clear(); pf = LayerPrefetch(lambda j, f: log.append((j, f)) or (j, f), [2, 1, 0], 0.25)
>>> pf.start(); _ = [(pf.need(k), pf.after(k)) for k in range(3)]; log
[(2, 0.25), (2, 0.75), (1, 0.25), (1, 0.75), (0, 0.25), (0, 0.75)]

The same quarter sliding (DeepSpeed): a quarter of the first layer behind the fetch before it, its
rest on demand, then each next layer issued whole while the layer before it computes:

>>> log.clear(); pf = LayerPrefetch(lambda j, f: log.append((j, f)) or (j, f), [0, 1, 2], 0.25, slide=True)
>>> pf.start(); _ = [(pf.need(k), pf.after(k)) for k in range(3)]; log
[(0, 0.25), (0, 0.75), (1, 1.0), (2, 1.0)]
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional

#: Below this share of a layer a frontier is where it should be (float sums of parts)
_EPS = 1e-9


class LayerPrefetch:
    """A pass's layer all-gathers (module docstring). ``issue(layer, share)``: the event of an
    all-gather of ``share`` (0 to 1] of ``layer``'s unit, or None where the pass gathers none;
    ``order``: the layers in the order the pass computes them; ``ahead``: layers gathered past
    the one computed, >= 0; ``slide``: the frontier also moves on by a layer during each layer
    computed, so after a layer at least the next one is issued (DeepSpeed's coordinator, module
    docstring)."""

    def __init__(self, issue: Callable[[int, float], Optional[object]], order: list[int], ahead: float,
                 slide: bool = False):
        self.issue, self.order, self.ahead = issue, order, max(0.0, ahead)
        self.lead = max(1.0, self.ahead) if slide and self.ahead > 0 else self.ahead
        self.front = 0.0  # positions of ``order`` issued so far (a fraction: a part of the next layer)
        self.waits: defaultdict[int, list] = defaultdict(list)

    def _upto(self, target: float) -> None:
        target = min(target, float(len(self.order)))
        while self.front < target - _EPS:
            pos = int(self.front + _EPS)
            end = min(target, pos + 1.0)
            share = 1.0 if end - self.front > 1.0 - _EPS else end - self.front
            ev = self.issue(self.order[pos], share)
            if ev is not None:
                self.waits[pos].append(ev)
            self.front = float(pos + 1) if end > pos + 1.0 - _EPS else end

    def start(self, ahead: Optional[float] = None) -> None:
        """The prefetch behind the fetch before the first layer (the embedding's in forward, the
        head's in backward): ``ahead`` layers, or the given ones (DeepSpeed: max live less that
        fetch's unit, ``Overlap.fsdp_start``)."""
        self._upto(self.ahead if ahead is None else max(0.0, ahead))

    def need(self, pos: int) -> list:
        """The all-gathers the layer at ``pos`` of ``order`` waits for: what of it is not issued
        yet, issued now (on demand), and its parts issued before."""
        self._upto(pos + 1.0)
        return self.waits.pop(pos, [])

    def after(self, pos: int) -> None:
        """The prefetch once the layer at ``pos`` has its parameters: up to ``ahead`` layers past it
        (at least one with ``slide``)."""
        self._upto(pos + 1.0 + self.lead)
