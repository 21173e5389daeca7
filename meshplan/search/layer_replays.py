"""How many layers torchtitan's per-layer AC replays in a stage's chunks, for the search's
step-time lower bound (:mod:`meshplan.search.layer_bounds`).

A ``layer`` row (``recompute = "layer"`` at :data:`~meshplan.search.columns.LAYER_AC_FREQ` k)
checkpoints in full the layers whose position among the rank's stage layers, counted from 0
over its chunks in order, is k - 1 modulo k
(:meth:`~meshplan.spec.training.TrainingSpec.layer_recomputed`, as torchtitan counts the blocks
it wraps): a stage of N layers replays ``N // k`` of them. A chunk of n consecutive positions
holds ``n // k`` or ``n // k + 1`` of them, which depends on where it starts: the bound takes
``n // k`` for every chunk (:func:`replayed_layers`) and adds the stage's remaining replays,
``N // k`` less the chunks' sum (:func:`extra_replays`), each at the smaller increase one more
replay gives a short or a long chunk (:func:`more_replays`), which holds whatever chunks they
fall in.

With vpp 1 the one chunk starts the stage: ``N // k`` exactly, nothing more. Interleaved, 126
layers at pp 32 x vpp 4 under the Llama 3 split (one layer per chunk): every chunk's fewest is 0,
and the stage's 2 replays (4 layers, positions 1 and 3) come from :func:`extra_replays`.

A ``block`` row (Megatron-LM's ``--recompute-method block``, :mod:`meshplan.search.block_recompute`)
checkpoints the first b layers of every model chunk (megatron/core/recompute.py:167-182 at
NVIDIA/Megatron-LM d98e8a6): a chunk of n layers replays ``min(b, n)`` and keeps ``max(n - b, 0)``
whole. The exact planner picks b at the row's least n (:attr:`~meshplan.search.columns.Candidates.rm`)
or above, so the step bound counts ``min(rm, n)`` replays (:func:`replayed_layers`); the memory
lower bound at a trial b (:func:`kept_layers`' ``block``) the layers kept whole at b.
"""

from __future__ import annotations

import numpy as np

from meshplan.pipeline.interleaved import INTERLEAVED
from meshplan.search.columns import LAYER_AC_FREQ, RECOMPUTE, Candidates


def layer_rows(c: Candidates) -> np.ndarray:
    """(candidates, 1): 1 on ``layer`` rows, 0 elsewhere."""
    return (c.rc == RECOMPUTE.index("layer"))[:, None].astype(np.int64)


def block_rows(c: Candidates) -> np.ndarray:
    """(candidates, 1): 1 on ``block`` rows, 0 elsewhere."""
    return (c.rc == RECOMPUTE.index("block"))[:, None].astype(np.int64)


def replayed_layers(c: Candidates, n: np.ndarray, plus: int = 0) -> np.ndarray:
    """Layers a ``layer`` row surely replays in a chunk of ``n`` consecutive stage layers
    (candidates, pp): ``n // LAYER_AC_FREQ``, the fewest multiples any ``n`` consecutive
    positions hold, ``plus`` more (0 or 1: a chunk that holds one more); a ``block`` row
    ``min(rm, n)`` (its least n, :attr:`~meshplan.search.columns.Candidates.rm`: the picked b is no
    smaller), with ``plus`` 1 the most it may replay, ``n`` (a gathering pass's extra shrinks as the
    replays grow, :func:`meshplan.search.layer_bounds._extra`); 0 on other rows.

    >>> L, B = RECOMPUTE.index("layer"), RECOMPUTE.index("block")
    >>> c = type("C", (), {"rc": np.array([L, RECOMPUTE.index("full"), B]), "rm": np.array([0, 0, 3])})()
    >>> replayed_layers(c, np.array([[7, 8], [7, 8], [7, 2]])).tolist()
    [[3, 4], [0, 0], [3, 2]]
    >>> replayed_layers(c, np.array([[1], [1], [7]]), 1).tolist()
    [[1], [0], [7]]
    """
    n = np.asarray(n)
    out = layer_rows(c) * (n // LAYER_AC_FREQ + plus)
    rm = getattr(c, "rm", None)
    if rm is None:
        return out
    return out + block_rows(c) * (n if plus else np.minimum(rm[:, None], n))


def extra_replays(c: Candidates, n_stage: np.ndarray, n_short: np.ndarray, n_long: np.ndarray) -> np.ndarray:
    """Chunks of a stage that replay one layer more than :func:`replayed_layers` counts
    (candidates, pp): the stage's ``n_stage // k`` less the chunks' fewest, its ``vpp - n_long``
    chunks of ``n_short`` layers and ``n_long`` of ``n_short + 1``; 0 on other rows.

    >>> c = type("C", (), {"rc": np.array([RECOMPUTE.index("layer")]), "vpp": np.array([4])})()
    >>> extra_replays(c, np.array([[4, 3]]), np.array([[1, 0]]), np.array([[0, 3]])).tolist()  # 4 x 1; 1 x 0 + 3 x 1
    [[2, 1]]
    """
    v = c.vpp[:, None]
    fewest = (v - n_long) * (n_short // LAYER_AC_FREQ) + n_long * ((n_short + 1) // LAYER_AC_FREQ)
    return layer_rows(c) * (n_stage // LAYER_AC_FREQ - fewest)


def more_replays(out: dict, more: dict, x: np.ndarray, n_short: np.ndarray, n_long: np.ndarray,
                 vpp: np.ndarray) -> np.ndarray:
    """Seconds per micro-batch the stage's :func:`extra_replays` ``x`` chunks add to its
    units (candidates, pp): each at the smaller increase of a short and a long chunk's forward
    plus backward core (``out``'s ``f_core``, ``b_core`` and ``_hi`` forms; ``more``'s at one
    replay more), only the kinds of chunk the stage has that hold layers (an empty short chunk,
    the Llama 3 split's end slot, replays nothing)."""
    d_short = more["f_core"] - out["f_core"] + more["b_core"] - out["b_core"]
    d_long = more["f_core_hi"] - out["f_core_hi"] + more["b_core_hi"] - out["b_core_hi"]
    no_short = (vpp[:, None] - n_long == 0) | (n_short == 0)
    d = np.where(no_short, d_long, np.where(n_long == 0, d_short, np.minimum(d_short, d_long)))
    return x * np.maximum(d, 0.0)



def kept_layers(c: Candidates, n: np.ndarray, block=None) -> np.ndarray:
    """Layers a ``layer`` row surely keeps whole (not checkpointed: all their activations
    saved, as ``none``) in one pass of a chunk of ``n`` consecutive stage layers (candidates,
    pp); a ``block`` row at b = ``block`` (candidates,) ``max(n - b, 0)`` (module docstring; 0
    where ``block`` is None: any b); 0 on other rows. torchtitan's ``_apply_layer_sac`` counts every block it wraps on
    the rank (``_layer_sac_count += 1``) and checkpoints it when the count is a multiple of
    ``ac_freq``: the 0-based positions k - 1 modulo k
    (:meth:`~meshplan.spec.training.TrainingSpec.layer_recomputed`). With vpp 1 the chunk is
    the stage, from position 0: ``n - n // k`` exactly; interleaved, any ``n`` consecutive
    positions hold at most ``ceil(n / k)`` checkpointed ones.

    >>> c = type("C", (), {"rc": np.array([RECOMPUTE.index("layer")] * 2 + [RECOMPUTE.index("full")]),
    ...                    "vpp": np.array([1, 2, 1])})()
    >>> kept_layers(c, np.array([[7, 1], [7, 1], [7, 1]])).tolist()  # k = 2
    [[4, 1], [3, 0], [0, 0]]
    >>> b = type("C", (), {"rc": np.array([RECOMPUTE.index("block")] * 2), "vpp": np.array([1, 2])})()
    >>> kept_layers(b, np.array([[7, 1], [7, 1]]), np.array([3, 5])).tolist(), kept_layers(b, np.array([[7], [7]])).tolist()
    ([[4, 0], [2, 0]], [[0], [0]])
    """
    n = np.asarray(n)
    checkpointed = np.where(c.vpp[:, None] == 1, n // LAYER_AC_FREQ, -(-n // LAYER_AC_FREQ))
    out = layer_rows(c) * (n - checkpointed)
    if block is None:
        return out
    return out + block_rows(c) * np.maximum(n - np.asarray(block)[:, None], 0)


def kept_in_flight(c: Candidates, n: np.ndarray, n_hi: np.ndarray, g: np.ndarray, w: np.ndarray,
                   vshape: np.ndarray, done=0, block=None) -> np.ndarray:
    """Layers a ``layer`` row surely keeps whole in the ``w`` (or more) passes of a stage in
    flight once ``done`` backwards have run (candidates, pp; ``done`` 0: the first ``w``
    forwards, at the first backward). Interleaved 1F1B with even chunks (``n`` = ``n_hi``
    layers each; chunk j at stage positions ``j n`` to ``j n + n - 1``) runs ``g`` micro-batches
    of each chunk in turn, forwards chunk 0 first and backwards chunk vpp - 1 first
    (:meth:`~meshplan.pipeline.interleaved.Interleaved.chunk_forwards`): each chunk's passes
    among the first ``done + w`` forwards less its backwards among the first ``done`` (none
    below 0: more forwards have run then), times the layers it keeps; otherwise (vpp 1, the
    Llama 3 split's uneven chunks, V-shaped schedules) ``w`` times :func:`kept_layers`; a ``block``
    row at b = ``block`` ``w`` times :func:`kept_layers` (every chunk keeps the same ``n - b``, the
    stage's shortest chunk's the fewest); 0 on other rows.

    >>> c = type("C", (), {"rc": np.array([RECOMPUTE.index("layer")]), "vpp": np.array([2])})()
    >>> one = np.array([[1]])  # 1-layer chunks: chunk 0 keeps its layer, chunk 1 checkpoints it
    >>> kept_in_flight(c, one, one, np.array([[4]]), np.array([[11]]), np.array([[False]])).tolist()  # 7 of chunk 0
    [[7]]
    >>> kept_in_flight(c, one, one, np.array([[4]]), np.array([[3]]), np.array([[False]]), done=5).tolist()
    [[3]]
    """
    v = c.vpp[:, None]
    out = w * kept_layers(c, n, block)
    even = (v > 1) & (n == n_hi) & ~vshape & (layer_rows(c) > 0)
    if not even.any():
        return out
    k, by_chunk = LAYER_AC_FREQ, np.zeros_like(out)
    rows_of = lambda a, r: np.broadcast_to(a, out.shape)[r] if np.ndim(a) else a
    for vv in np.unique(c.vpp[c.vpp > 1]).tolist():
        r = np.flatnonzero(c.vpp == vv)  # the rows of this vpp alone (every other row adds 0)
        nr, gr, wr, dr = (rows_of(a, r) for a in (n, g, w, done))
        for j in range(vv):
            kept_j = nr - ((j + 1) * nr // k - j * nr // k)  # positions j n .. j n + n - 1 not k - 1 modulo k
            passes = INTERLEAVED.chunk_forwards(gr, vv, dr + wr, j) - INTERLEAVED.chunk_forwards(gr, vv, dr, vv - 1 - j)
            by_chunk[r] += np.maximum(passes, 0) * kept_j
    return np.where(even, by_chunk, out)
