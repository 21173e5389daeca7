"""Megatron-LM's block recompute as a knob of the search: the rows that try it (:func:`block_searched`,
``rc`` ``block``), the layers of each row's largest model chunk, what its n counts against
(:func:`chunk_layers`), the rows it cannot differ from none or full on (:func:`block_pointless`), and
the n the exact planner picks, the smallest that fits (:func:`pick_block`: with the headroom the search's
tiers ask for where one does; :func:`smallest_fitting`, by bisection).

What Megatron-LM runs (``--recompute-granularity full --recompute-method block --recompute-num-layers
n``): ``checkpointed_forward`` (megatron/core/recompute.py:157-182 at NVIDIA/Megatron-LM d98e8a6, which
``TransformerBlock.forward`` calls) walks ``range(self.num_layers_per_pipeline_rank)`` and checkpoints
layer ``layer_idx`` where ``layer_idx < recompute_num_layers`` (under fp8/fp4 the slots are pushed past
layers whose input needs no gradient, none on a bf16 run), each under its own checkpoint, the others run
whole. ``num_layers_per_pipeline_rank`` is ``len(self.layers)`` (transformer_block.py:334), the layers of
this TransformerBlock, and with virtual pipeline stages each model chunk is a TransformerBlock of its own
(``get_num_layers_to_build``, transformer_block.py:159-186: ``num_layers_per_pipeline_rank // vp_size``
per chunk): so n counts the first n layers of every model chunk of every stage, each chunk apart (what
:meth:`~meshplan.spec.training.TrainingSpec.layer_recomputed` plans). n at the chunk's size or more is
every layer, ``full``; n 0 is none. ``--recompute-method uniform --recompute-num-layers n`` (lines
157-166) puts n consecutive layers under one checkpoint: one input kept per n layers, the n replayed
together; meshplan plans it as per-layer ``full`` (:mod:`meshplan.interop.megatron_recompute` says so on
import) and the search does not vary it.

The search's ``block`` row stands for every n from 1 to the largest chunk's layers less one. Its memory
bounds hold for all of them (:func:`meshplan.search.columns.bound_recompute`: each field between none's
and full's). Its least n (:func:`meshplan.search.block_bounds.least_block`, vectorised: the smallest n whose memory lower bound,
:func:`meshplan.search.bounds.bounds` at that n, fits the usable memory with ``[search]
memory_margin``; the bound falls as n grows: each layer checkpointed keeps its input alone) is stored
in :attr:`~meshplan.search.columns.Candidates.rm`: no smaller n fits, so the step lower bound counts
that many replayed layers per chunk (:func:`meshplan.search.layer_replays.replayed_layers`: each at the
replay's extra over none's chain that ``full`` rows count, ``meshplan.search.layer_bounds``), and a
row whose least n is its whole largest chunk is rejected, rule ``block`` (only ``full``, its own row,
can fit). The exact planner (:meth:`meshplan.search.exact.Planner.__call__`) picks the n: the smallest
whose plan fits (from n 1 on, the replay's working set is there at every n), found by bisection over
the plans' memory verdicts from the least n, so a row costs ``2 + ceil(log2(k))`` memory plans for k
candidate n at most. Where none fits (nothing to recompute) or only every layer does (the ``full``
row), the row is rejected, rule ``block``.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from meshplan.config import Config
from meshplan.mesh.layers import stage_layers
from meshplan.search.candidate import megatron_split, stage_split, titan_split
from meshplan.search.columns import RECOMPUTE

#: The ``block`` rule's one-line reason (:mod:`meshplan.search.reasons`), which the exact planner's
#: verdict on such a row opens with.
BLOCK_REFUSED = ("block: Megatron-LM's block recompute adds nothing here: recompute none fits (nothing to "
                 "recompute), or no n below the largest model chunk's layers fits (only full, its own row, does)")


def block_searched(cfg: Config) -> bool:
    """Whether the search tries ``block`` rows: under ``training.framework = "megatron"`` (the one
    runtime with ``--recompute-method block``; ``recompute_num_layers`` is refused under any other,
    :mod:`meshplan.spec.training_checks`), by default or where a given ``[search] recompute`` lists
    ``block``.

    >>> from meshplan.config import config_from_dict
    >>> d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...      "training": {"global_batch": 8, "seq_len": 1024, "framework": "megatron"}}
    >>> block_searched(config_from_dict(d, require_mesh=False))
    True
    >>> block_searched(config_from_dict(d | {"search": {"recompute": ["none", "full"]}}, require_mesh=False))
    False
    >>> block_searched(config_from_dict(d | {"search": {"recompute": ["full", "block"]}}, require_mesh=False))
    True
    >>> block_searched(config_from_dict(d | {"training": d["training"] | {"framework": "torch"}}, require_mesh=False))
    False
    """
    o = cfg.search
    return cfg.training.framework == "megatron" and ("recompute" not in o.model_fields_set or "block" in o.recompute)


def chunk_layers(cfg: Config, pp: np.ndarray, vpp: np.ndarray, us: np.ndarray) -> np.ndarray:
    """Layers of the largest model chunk of rows of pipeline degree ``pp``, virtual stages ``vpp``
    and split column ``us`` (int arrays; :func:`~meshplan.search.candidate.stage_split`, then
    :func:`~meshplan.mesh.layers.stage_layers`, as each row's plan splits them), once per distinct
    triple: what a ``block`` row's n counts against (:func:`meshplan.plan_checks.check_block_recompute`).

    >>> from meshplan.config import config_from_dict
    >>> cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...                         "training": {"global_batch": 8, "seq_len": 1024}}, require_mesh=False)
    >>> chunk_layers(cfg, np.array([1, 4, 4, 3]), np.array([1, 1, 2, 1]), np.array([0, 0, 0, 0])).tolist()
    [32, 8, 4, 11]
    """
    layers, first_last, titan = cfg.model.layers, megatron_split(cfg), titan_split(cfg)
    key = np.stack([pp, vpp, us], axis=1) if len(pp) else np.zeros((0, 3), dtype=np.int64)
    uniq, inv = np.unique(key, axis=0, return_inverse=True)
    out = np.zeros(len(uniq), dtype=np.int64)
    for k, (p, v, u) in enumerate(uniq.tolist()):
        split = stage_split(layers, p, v, bool(u), first_last, titan)
        stages = stage_layers(layers, p, v, split)
        out[k] = 0 if isinstance(stages, str) else max(len(ch) for st in stages for ch in st)
    return out[inv.reshape(-1)]


def block_pointless(rc: np.ndarray, rk: np.ndarray) -> np.ndarray:
    """The ``block`` rows (``rc``) whose largest chunk holds one layer or none (``rk``): n 1 is every
    layer there, the ``full`` row. Rule ``block``.

    >>> b = RECOMPUTE.index("block")
    >>> block_pointless(np.array([b, b, 2]), np.array([1, 5, 1])).tolist()
    [True, False, False]
    """
    return (rc == RECOMPUTE.index("block")) & (rk <= 1)


def smallest_fitting(fits: Callable[[int], bool], most: int, least: int = 0) -> Optional[int]:
    """The smallest n in max(1, ``least``) .. ``most`` - 1 with ``fits(n)``, by bisection (``fits``
    monotone there: more layers checkpointed, less kept), or None where ``fits(0)`` (recompute none
    fits; not asked where ``least`` >= 1: none's bound does not fit) or not ``fits(most - 1)`` (no
    block short of every layer fits). ``fits`` is called on 0, ``most`` - 1, then about
    log2(``most`` - ``least``) n.

    >>> peak = {n: 100 - 10 * n for n in range(11)}  # a 10-layer chunk, 10 units saved per layer kept
    >>> smallest_fitting(lambda n: peak[n] <= 55, 10), smallest_fitting(lambda n: peak[n] <= 100, 10)
    (5, None)
    >>> smallest_fitting(lambda n: peak[n] <= 5, 10), smallest_fitting(lambda n: True, 1)
    (None, None)
    >>> asked = []
    >>> smallest_fitting(lambda n: asked.append(n) or peak[n] <= 55, 10, least=4), asked  # 0 not asked
    (5, [9, 6, 5, 4])
    """
    if most < 2 or least >= most or (least < 1 and fits(0)) or not fits(most - 1):
        return None
    lo, hi = max(1, least), most - 1  # fits(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def pick_block(plan_at: Callable[[int], object], most: int, clear: Callable[[object], bool],
               least: int = 0) -> Optional[int]:
    """A ``block`` row's n (:func:`smallest_fitting` over the plans ``plan_at(n)``, n 0 ``none``, each a
    :class:`~meshplan.plan.Plan` or :class:`~meshplan.plan.Infeasible`; ``most``: the largest chunk's
    layers): the smallest whose plan fits and is ``clear`` (under ``[search] headroom_tier``, the
    default, keeps the 15% headroom, :func:`meshplan.memory.headroom.tight`: the n a practitioner runs,
    which the tiers list with the clear rows, where the smallest that merely fits is tight by
    construction); where none is, and recompute none does not fit at all, the smallest that fits
    (tight). None where none is clear, or fits while no n short of every layer is clear, or no n fits.
    ``least``: the row's least n (:func:`~meshplan.search.block_bounds.least_block`; no smaller n fits, none included where >= 1).

    >>> class P:  # a plan: feasible, its peak
    ...     def __init__(self, peak): self.feasible, self.peak = peak <= 100, peak
    >>> plans = {n: P(130 - 10 * n) for n in range(10)}  # none 130, 10 a layer checkpointed
    >>> pick_block(plans.get, 10, lambda p: p.peak <= 85), pick_block(plans.get, 10, lambda p: p.peak <= 20)
    (5, 3)
    """
    def fits(n: int) -> bool:
        p = plan_at(n)
        return bool(getattr(p, "feasible", False))

    n = smallest_fitting(lambda k: fits(k) and clear(plan_at(k)), most, least)
    if n is None and most >= 2 and (least >= 1 or not fits(0)):
        n = smallest_fitting(fits, most, least)
    return n
