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
"""

from __future__ import annotations

import numpy as np

from meshplan.search.columns import LAYER_AC_FREQ, RECOMPUTE, Candidates


def layer_rows(c: Candidates) -> np.ndarray:
    """(candidates, 1): 1 on ``layer`` rows, 0 elsewhere."""
    return (c.rc == RECOMPUTE.index("layer"))[:, None].astype(np.int64)


def replayed_layers(c: Candidates, n: np.ndarray, plus: int = 0) -> np.ndarray:
    """Layers a ``layer`` row surely replays in a chunk of ``n`` consecutive stage layers
    (candidates, pp): ``n // LAYER_AC_FREQ``, the fewest multiples any ``n`` consecutive
    positions hold, ``plus`` more (0 or 1: a chunk that holds one more); 0 on other rows.

    >>> c = type("C", (), {"rc": np.array([RECOMPUTE.index("layer"), RECOMPUTE.index("full")])})()
    >>> replayed_layers(c, np.array([[7, 8], [7, 8]])).tolist(), replayed_layers(c, np.array([[1], [1]]), 1).tolist()
    ([[3, 4], [0, 0]], [[1], [0]])
    """
    return layer_rows(c) * (np.asarray(n) // LAYER_AC_FREQ + plus)


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
