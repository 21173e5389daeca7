"""The blocking calls of Megatron-LM 2022's (and torch's single-stage) pipeline p2p on arrays, for
the array simulation (:mod:`meshplan.pipeline.fast`) and its round loops
(:mod:`meshplan.pipeline.rounds`): each cross-stage input's send and receive call
(:class:`Transfers`, :func:`rendezvous`), the call table in the round loops' slots
(:func:`call_table`) and the one reader of its slot layout (:func:`stage_calls`), and each
input's transfer time by its stage boundary (:func:`input_seconds`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from meshplan.pipeline.orders import Flat, flat_units  # noqa: F401 (flat_units: the doctests')
from meshplan.pipeline.sim_types import PipelineSpec

__all__ = ["Transfers", "rendezvous", "call_table", "stage_calls", "input_seconds"]


def _rows_of(key: np.ndarray, first: int) -> tuple[int, "int | np.ndarray"]:
    """(how many distinct values the small integers ``key`` take, the row of each entry:
    ``first`` plus the rank of its value among them): from the least and the largest value when
    they are at most one apart (1F1B: one value; interleaved 1F1B: two), else by a count per
    value in their range; no sort.

    >>> _rows_of(np.array([5, 5]), 1)
    (1, 1)
    >>> [(n, r.tolist()) for n, r in (_rows_of(np.array([2, 1, 2]), 1), _rows_of(np.array([0, 3, 7, 3]), 2))]
    [(2, [2, 1, 2]), (3, [2, 3, 4, 3])]
    """
    if not len(key):
        return 0, first
    low, high = int(key.min()), int(key.max())
    if high - low <= 1:  # both values occur
        return high - low + 1, (first if high == low else key + (first - low))
    present = np.bincount(key - low) > 0
    if present.all():  # consecutive values (1F1B: one)
        return len(present), (first if len(present) == 1 else key + (first - low))
    return int(present.sum()), (np.cumsum(present) + (first - 1))[key - low]


def _call_table(pairs, width: int, pad: int) -> tuple:
    """Per slot of :func:`run_rounds`, the call issued just before it (after the slot before),
    from ``pairs`` (:class:`~meshplan.pipeline.calls.Transfers`): (shape (1 + peers, slots): the
    slot before, whose end posts the call, then the slots of the calls the call meets, ``pad``
    padding, in no particular order; how many of its transfers share its link, the larger of
    its sends and its receives (:func:`meshplan.pipeline.rendezvous.call_loads`; 0 for a call
    without transfers); whether it has a peer; with a time per boundary (``pairs.xfer_s``) the
    seconds of its transfers, its longest link's sends' or receives' times added
    (:func:`_call_seconds`), else None: ``k x p2p_s``). One row per send delay and one per receive
    lead (1F1B: one each; interleaved 1F1B: two each), filled by one scatter per side: a call
    sends at most one output per delay (its producer ``delay`` units before the call) and posts
    at most one receive per lead (its consumer ``lead`` units after)."""
    ws, wr = pairs.sides()  # an asynchronous side is in no call (Megatron-LM's overlap_p2p_comm)
    send, recv, delay, lead = pairs.send, pairs.recv, pairs.delay, pairs.lead
    after_send, after_recv = send[ws] + 1, recv[wr] + 1  # the slot whose unit waits for each call
    n_send, send_row = _rows_of(delay[ws], 1)
    n_recv, recv_row = _rows_of(lead[wr], 1 + n_send)
    cols = pad + 1
    table = np.full((1 + n_send + n_recv, cols), pad, dtype=np.int64)
    table[0] = np.arange(-1, pad)
    flat = table.reshape(-1)
    flat[send_row * cols + after_send] = recv[ws]
    flat[recv_row * cols + after_recv] = send[wr]
    n_out, n_in = np.bincount(after_send, minlength=cols), np.bincount(after_recv, minlength=cols)
    loads = n_out + n_in if pairs.serial else np.maximum(n_out, n_in)
    return table, loads.astype(float), loads > 0, _call_seconds(pairs, after_send, after_recv, cols)


def _call_seconds(pairs, after_send: np.ndarray, after_recv: np.ndarray, cols: int) -> "np.ndarray | None":
    """Per slot after a call (``after_send``/``after_recv``: of each waited send and receive), the
    seconds of the call's transfers with a time per boundary (``pairs.xfer_s``; None without): the
    longest of its links' loads, its sends' times added per link (``pairs.link``) and its
    receives' (:func:`meshplan.pipeline.rendezvous.call_seconds`, whose NCCL source says why), the
    same additions in the same (flat) order; with ``pairs.xfer_pair`` each link's load as
    :func:`meshplan.pipeline.rendezvous.link_load` takes it."""
    xs = getattr(pairs, "xfer_s", None)
    if xs is None:
        return None
    ws, wr = pairs.sides()
    link = getattr(pairs, "link", None)
    pair = getattr(pairs, "xfer_pair", None)
    secs = np.zeros(cols)
    for at, side in ((after_send, ws), (after_recv, wr)):
        t, two = xs[side], None if pair is None else pair[side]
        on = None if link is None else link[side]
        for k in ([None] if on is None else np.unique(on).tolist()):
            mine = slice(None) if on is None else on == k
            if pairs.serial:  # one blocking call per transfer: they add (rendezvous.call_seconds)
                secs += np.bincount(at[mine], t[mine], minlength=cols)
            elif two is None:
                np.maximum(secs, np.bincount(at[mine], t[mine], minlength=cols), out=secs)
            else:  # rendezvous.link_load: the largest fixed part (2 t - pair) once, each share (pair - t) added
                slot, tk, pk = at[mine], t[mine], two[mine]
                np.maximum(secs, _largest(slot, 2 * tk - pk, cols) + np.bincount(slot, pk - tk, minlength=cols),
                           out=secs)
    return secs


def _largest(slot: np.ndarray, value: np.ndarray, cols: int) -> np.ndarray:
    """Per slot the largest of ``value`` over its entries, at least 0 (0 for a slot without one):
    one value for all (one boundary path: a single write), else by distinct value, largest last
    (a few: one per boundary path), not ``np.maximum.at``.

    >>> _largest(np.array([0, 0, 2]), np.array([1.0, 3.0, 2.0]), 4).tolist()
    [3.0, 0.0, 2.0, 0.0]
    """
    out = np.zeros(cols)
    if not len(value):
        return out
    lo, hi = float(value.min()), float(value.max())
    if lo == hi:
        out[slot] = max(hi, 0.0)
        return out
    for v in np.unique(value).tolist():  # ascending: a later (larger) value overwrites
        if v > 0:
            out[slot[value == v]] = v
    return out


def call_table(pairs, p: int, length: int) -> tuple:
    """:func:`_call_table` of ``pairs`` in the slots of :func:`run_rounds` for ``p`` stages of
    ``length`` units (width ``length + 2``, padding peer ``p (length + 2) + 1``); ``pairs.calls``
    when it holds one (the pipeline simulated again with other durations: 0.02 s and 25 MB of
    call table at pp 128 x 4,096 micro-batches)."""
    if getattr(pairs, "calls", None) is not None:
        return pairs.calls
    width = length + 2
    return _call_table(pairs, width, p * width + 1)


def stage_calls(per_slot: np.ndarray, p: int, length: int) -> np.ndarray:
    """A value per call of :func:`call_table` (indexed by the slot after the call: its ``loads``
    or seconds) as (p, L + 1): per stage its leading call (receives posted before its first unit),
    then the call after each of its ``length`` units (the trailing slot's call, after the last
    unit, last). The one reader of the table's slot layout (width ``length + 2`` per stage) outside
    the round loops; a view.

    >>> stage_calls(np.arange(9), 2, 2).tolist()  # slots: stage 0 at 0-3, stage 1 at 4-7, the padding 8
    [[1, 2, 3], [5, 6, 7]]
    """
    width = length + 2
    return per_slot[1:p * width + 1].reshape(p, width)[:, :length + 1]


class Transfers(NamedTuple):
    """Megatron-LM 2022's rendezvous p2p (:func:`rendezvous`): per cross-stage input, one entry
    per unit with ``f.cross`` in flat order: ``send`` and ``recv``, the calls that send and
    receive it, each as the slot of :func:`~meshplan.pipeline.rounds.run_rounds` it is issued
    after (``stage * (L + 2) + position + 1``; position -1: before the first unit, the stage's
    leading slot); ``cons``, the flat index of the consumer; ``delay``, how many units after its
    producer the send is issued; ``lead``, how many units before the consumer the receive is;
    ``send_async`` and ``recv_async`` (Megatron-LM's ``overlap_p2p_comm``,
    ``PipelineSpec.overlap_p2p``): the side is issued without waiting (its call holds nothing for
    it), the consumer then waits for the transfer just before it, ``max(both posts) + p2p``
    (None: every side waited); ``calls``: :func:`~meshplan.pipeline.calls.call_table` of these
    transfers, kept once :func:`simulate_arrays` has built it (None: not yet); ``xfer_s``: with a
    time per boundary (``PipelineSpec.p2p_s`` a tuple), each entry's seconds, its boundary's
    (None: every transfer takes the one ``p2p_s``); ``link``: with ``xfer_s`` and
    ``PipelineSpec.p2p_link``, each entry's link (:meth:`~meshplan.pipeline.sim_types.PipelineSpec.link_of`;
    None: one link); ``xfer_pair``: with ``PipelineSpec.p2p_pair_s``, each entry's seconds of two
    such transfers at once (:meth:`~meshplan.pipeline.sim_types.PipelineSpec.pair_s`; None: twice
    ``xfer_s``), which also sets ``xfer_s`` under one ``p2p_s``."""

    send: np.ndarray
    recv: np.ndarray
    cons: np.ndarray
    delay: np.ndarray
    lead: np.ndarray
    send_async: Optional[np.ndarray] = None
    recv_async: Optional[np.ndarray] = None
    calls: Optional[tuple] = None
    xfer_s: Optional[np.ndarray] = None
    link: Optional[np.ndarray] = None
    serial: bool = False  # PipelineSpec.serial_p2p: a call's transfers add (rendezvous.call_loads)
    xfer_pair: Optional[np.ndarray] = None

    def sides(self) -> tuple[np.ndarray, np.ndarray]:
        """(the entries whose send is waited in its call, those whose receive is): a call's peers
        and its load count only its waited sides (all entries without ``send_async``)."""
        every = np.ones(len(self.cons), dtype=bool)
        if self.send_async is None or self.recv_async is None:
            return every, every
        return ~self.send_async, ~self.recv_async


def rendezvous(spec: PipelineSpec, f: Flat) -> Transfers:
    """Megatron-LM 2022's rendezvous p2p (:mod:`meshplan.pipeline.rendezvous` docstring,
    :func:`~meshplan.pipeline.rendezvous.calls`) on the flat units: per cross-stage input the call
    that sends it and the call that receives it (:class:`Transfers`).

    >>> f = flat_units("1f1b", 2, 2, 1)  # stage 0: F0 F1 B0 B1; stage 1: F0 B0 F1 B1
    >>> t = rendezvous(PipelineSpec("1f1b", p=2, m=2, blocking_p2p=True), f)
    >>> t.cons.tolist()  # stage 0's B0, B1; stage 1's F0, F1
    [2, 3, 4, 6]
    >>> [(int(x) // 6, int(x) % 6 - 1) for x in t.send], [(int(x) // 6, int(x) % 6 - 1) for x in t.recv]
    ([(1, 1), (1, 3), (0, 0), (0, 1)], [(0, 1), (0, 2), (1, -1), (1, 1)])
    """
    length, p = f.length, spec.p
    delay, lead, send_async, recv_async = (np.concatenate(x) for x in zip(*[spec.p2p_calls(s, length)
                                                                            for s in range(p)]))
    cons = np.flatnonzero(f.cross)
    prod = f.dep[cons]
    delay, lead = delay[prod], lead[cons]
    slot = lambda flat: flat + 2 * (flat // length) + 1  # noqa: E731
    out = Transfers(slot(prod) + delay, slot(cons) - lead, cons, delay, lead, serial=spec.serial_p2p)
    if spec.per_boundary or spec.p2p_pair_s is not None:  # each transfer on its own boundary's pair
        a, c = prod // length, cons // length
        out = out._replace(xfer_s=np.broadcast_to(np.asarray(spec.transfer_s(a, c), dtype=float), a.shape),
                           link=np.asarray(spec.link_of(a, c), dtype=np.int64) if spec.p2p_link else None,
                           xfer_pair=None if spec.p2p_pair_s is None else np.broadcast_to(
                               np.asarray(spec.pair_s(a, c), dtype=float), a.shape))
    some = spec.overlap_p2p or spec.torch_p2p  # (torch 1F1B and GPipe: sends without a wait)
    return out._replace(send_async=send_async[prod], recv_async=recv_async[cons]) if some else out


def input_seconds(spec: PipelineSpec, f: Flat) -> np.ndarray:
    """Per flat unit, seconds of the transfer that brings its input from another stage: its
    boundary's (:meth:`~meshplan.pipeline.sim_types.PipelineSpec.transfer_s`, producer stage to
    consumer stage), 0 where the input is local; ``spec.p2p_s`` on every such unit when one value.

    >>> f = flat_units("1f1b", 3, 1, 1)  # each stage F0 B0: stage 1's F0 from 0, B0 from 2
    >>> input_seconds(PipelineSpec("1f1b", p=3, m=1, p2p_s=(0.1, 0.7, 0.0)), f).tolist()
    [0.0, 0.1, 0.1, 0.7, 0.7, 0.0]
    """
    if not spec.per_boundary:
        return np.where(f.cross, spec.p2p_s, 0.0)
    n = len(f.dep)
    if not n:
        return np.zeros(0)
    link = spec.transfer_s(np.minimum(f.dep, n - 1) // f.length, np.arange(n) // f.length)
    return np.where(f.cross, link, 0.0)
