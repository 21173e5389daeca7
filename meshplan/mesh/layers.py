"""Layers per pipeline stage and virtual stage (chunk).

Interleaved assignment follows Megatron-LM (Narayanan et al. SC'21, section 2.2.2): with p
stages and v virtual stages, the model is cut into p*v chunks of equal layers and stage k
holds chunks k, k+p, k+2p, ... (uneven chunks with an explicit ``pp_layer_split``).

>>> stage_layers(layers=8, pp=2, vpp=2)
[[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
"""

from __future__ import annotations

from typing import Callable, Optional, Union

#: A schedule's chunk-to-virtual-stage map, ``(chunk, stage, pp, vpp) -> virtual stage``
#: (:meth:`meshplan.pipeline.base.PipelineSchedule.virtual_stage`).
VirtualStage = Callable[[int, int, int, int], int]


def looped(chunk: int, stage: int, pp: int, vpp: int) -> int:
    """The looped map ``chunk * pp + stage`` (Megatron-LM's and torch's interleaved)."""
    return chunk * pp + stage


def stage_layers(layers: int, pp: int, vpp: int = 1, split: Optional[list[int]] = None,
                 virtual_stage: VirtualStage = looped) -> Union[list[list[list[int]]], str]:
    """Layer indices per stage, per chunk: ``result[stage][chunk] = [layer, ...]``; chunk c
    of stage k holds virtual stage ``virtual_stage(c, k, pp, vpp)`` (default looped; a
    V-shaped schedule puts the model's first and last virtual stage on stage 0).

    ``split``: explicit layers per stage (``pp`` entries) or per virtual stage (``pp * vpp``
    entries, in virtual-stage order ``chunk * pp + stage``); uneven allowed; must sum to
    ``layers``. With ``pp`` entries and vpp > 1 each stage's layers go to its chunks as evenly
    as possible, the short chunks at the model's ends (stage 0's first chunk, the last stage's
    last chunk), as Llama 3 ran (Dubey et al. 2024, 3.3.2: one layer fewer on the first and
    the last stage, with interleaving). The model's first virtual stage may hold no layer (the
    embedding alone) and its last none (the output layer and the loss alone): Megatron-Core's
    ``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split`` count
    each as one layer's slot, so at (layers + 2) / (pp x vpp) = 1 slot per virtual stage those
    chunks build no transformer layer (``get_num_layers_to_build`` in
    megatron/core/transformer/transformer_block.py:150-202@d98e8a6; Llama 3 405B, 126 layers
    at pp 16 and vpp 8); every other virtual stage needs a layer, and every stage one (meshplan
    does not model a stage of the embedding or the output layer alone). Returns a one-line
    reason (str) when the layers cannot be assigned.

    >>> stage_layers(6, 2, 2, split=[3, 3])  # virtual stages of 1, 2, 2, 1 layers
    [[[0], [3, 4]], [[1, 2], [5]]]
    >>> stage_layers(6, 2, 2, split=[1, 2, 2, 1])
    [[[0], [3, 4]], [[1, 2], [5]]]
    >>> stage_layers(8, 2, 2, virtual_stage=lambda c, k, p, v: k if c == 0 else 2 * p - 1 - k)  # a V
    [[[0, 1], [6, 7]], [[2, 3], [4, 5]]]
    >>> stage_layers(6, 2, 4, split=[0, 1, 1, 1, 1, 1, 1, 0])  # (6 + 2) / (2 x 4) = 1 slot each
    [[[], [1], [3], [5]], [[0], [2], [4], []]]
    >>> stage_layers(6, 2, 4, split=[3, 3]) == stage_layers(6, 2, 4, split=[0, 1, 1, 1, 1, 1, 1, 0])
    True
    >>> print(stage_layers(94, 8, 2))
    94 layers do not divide into pp 8 stages (11.75 per stage) of vpp 2 virtual stages (5.875 layers per chunk); give an explicit pp_layer_split of 8 entries (layers per stage) or 16 (per virtual stage); the fix line gives the framework's uneven split
    """
    vs = [[virtual_stage(c, k, pp, vpp) for c in range(vpp)] for k in range(pp)]
    if split is not None:
        counts = _virtual_counts(layers, pp, vpp, split, vs)
        if isinstance(counts, str):
            return counts
        starts = [sum(counts[:j]) for j in range(pp * vpp)]
        return [[list(range(starts[j], starts[j] + counts[j])) for j in vs[k]] for k in range(pp)]
    if layers % pp and vpp > 1:  # newcomer trial 50 #5: the virtual stages named, and what to give
        return (f"{layers} layers do not divide into pp {pp} stages ({layers / pp:g} per stage) of vpp {vpp} "
                f"virtual stages ({layers / (pp * vpp):g} layers per chunk); give an explicit pp_layer_split of "
                f"{pp} entries (layers per stage) or {pp * vpp} (per virtual stage); the fix line gives the "
                f"framework's uneven split")
    if layers % pp:
        return (f"{layers} layers do not divide into pp {pp} stages ({layers / pp:g} per stage); "
                f"give an explicit pp_layer_split")
    per_stage = layers // pp
    if per_stage % vpp:
        return (f"{per_stage} layers per stage ({layers} / pp {pp}) do not divide into vpp {vpp} "
                f"virtual stages ({per_stage / vpp:g} layers per chunk)")
    chunk = per_stage // vpp
    return [[list(range(j * chunk, (j + 1) * chunk)) for j in vs[k]] for k in range(pp)]


def last_stage(stages: list[list[list[int]]]) -> int:
    """The stage holding the model's last virtual stage (its last layer, or the output layer
    alone, and so the final norm, the output layer and the loss): ``pp - 1`` looped, 0 under a
    V-shaped schedule. An empty chunk other than stage 0's first (the embedding alone,
    :func:`stage_layers`) is that head-only last virtual stage.

    >>> last_stage(stage_layers(8, 2, 2)), last_stage([[[0, 1], [6, 7]], [[2, 3], [4, 5]]])
    (1, 0)
    >>> last_stage([[[], [1], [3], [5]], [[0], [2], [4], []]]), last_stage([[[], [2, 3]], [[0, 1], []]])
    (1, 1)
    """
    # chunks are ascending runs of layers (stage_layers): each chunk's last layer is its largest,
    # so one look per chunk, not a scan of every layer (called per stage: O(p^2 v) at pp 128);
    # one pass: the first head-only chunk, else the first stage holding the top layer
    top, at = -1, -1
    for k, chunks in enumerate(stages):
        for c, chunk in enumerate(chunks):
            if not chunk:
                if k or c:
                    return k
            elif chunk[-1] > top:
                top, at = chunk[-1], k
    if at < 0:
        raise ValueError("last_stage: no stage holds a layer")
    return at


def _virtual_counts(layers: int, pp: int, vpp: int, split: list[int],
                    vs: list[list[int]]) -> Union[list[int], str]:
    """Layers per virtual stage (model order) from a per-stage or per-virtual-stage ``split``
    (see :func:`stage_layers`; ``vs[stage][chunk]``: the virtual stage), or a one-line reason.
    Every virtual stage needs a layer but the model's first and last, every stage one (see
    :func:`stage_layers`)."""
    if len(split) not in (pp, pp * vpp):
        return (f"pp_layer_split has {len(split)} entries for pp {pp}"
                + (f" (or {pp * vpp} virtual stages)" if vpp > 1 else ""))
    if sum(split) != layers:
        return f"pp_layer_split {split} sums to {sum(split)}, must be {layers} layers"
    if min(split) < 0:
        return f"pp_layer_split {split} has a negative entry"
    per = len(split) == pp * vpp  # per virtual stage (per stage too when vpp is 1)
    counts = list(split) if per else [0] * (pp * vpp)
    for k, n in ([] if per else enumerate(split)):
        base, extra = divmod(n, vpp)
        chunks = range(vpp - extra, vpp) if k == 0 and pp > 1 else range(extra)  # stage 0: its first chunk short
        for c in range(vpp):
            counts[vs[k][c]] = base + (c in chunks)
    ends = (0, pp * vpp - 1)
    empty = [j for j, n in enumerate(counts) if n < 1 and j not in ends]
    bare = [k for k in range(pp) if not sum(counts[j] for j in vs[k])]
    if bare and not empty:  # a stage of the embedding or the output layer alone (vpp 1, or both ends under a V)
        return (f"pp_layer_split gives stage{'s' if len(bare) > 1 else ''} {_few(bare)} no layer: a chunk may "
                f"hold the embedding or the output layer alone, a stage needs >= 1 layer")
    if not empty:
        return counts
    if per:
        unit = "virtual stage" if vpp > 1 else "stage"
        return (f"pp_layer_split gives {unit}{'s' if len(empty) > 1 else ''} {_few(empty)} no layer: each {unit} "
                f"needs >= 1 but the model's first (the embedding alone) and last (the output layer alone)")
    short = sorted({k for k in range(pp) for j in vs[k] if j in empty})
    return (f"pp_layer_split gives stage{'s' if len(short) > 1 else ''} {_few(short)} a chunk with no layer: each "
            f"stage needs >= vpp {vpp} layers, {vpp - 1} where it holds the model's first virtual stage (the "
            f"embedding alone) or its last (the output layer alone)")


def _few(items: list[int]) -> str:
    """``0, 1, 2`` (at most 8, then ``...``)."""
    return ", ".join(map(str, items[:8])) + (" ..." if len(items) > 8 else "")


def vpp_from_chunk(layers: int, pp: int, layers_per_chunk: int) -> Union[int, str]:
    """Virtual stages from Megatron's ``--num-layers-per-virtual-pipeline-stage``.

    >>> vpp_from_chunk(80, 16, 2)
    '5 layers per stage (80 / pp 16) are not a multiple of 2 layers per virtual stage'
    """
    if layers % pp:
        return f"{layers} layers do not divide into pp {pp} stages"
    per_stage = layers // pp
    if per_stage % layers_per_chunk:
        return (f"{per_stage} layers per stage ({layers} / pp {pp}) are not a multiple of "
                f"{layers_per_chunk} layers per virtual stage")
    return per_stage // layers_per_chunk


def balanced_split(layers: int, pp: int) -> list[int]:
    """Layers per stage as even as possible, the extra layers on the middle stages (the
    first and last stages also hold the embedding and the output layer).

    >>> balanced_split(126, 16)
    [7, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 7]
    """
    base, extra = divmod(layers, pp)
    order = sorted(range(pp), key=lambda k: (min(k, pp - 1 - k) == 0, k))
    bonus = set(order[:extra])
    return [base + (k in bonus) for k in range(pp)]


def first_last_split(layers: int, pp: int) -> Optional[list[int]]:
    """Layers per stage as Megatron-LM's ``--decoder-first-pipeline-num-layers`` and
    ``--decoder-last-pipeline-num-layers`` cut them: every middle stage ``ceil(layers / pp)``
    layers, the ``pp x ceil - layers`` left short taken off the first and the last stage, the
    last (the output layer and the loss) one more where the shortfall is odd. Megatron-Core
    takes no other uneven split at vpp 1 but ``--pipeline-model-parallel-layout``: the layers
    the two flags leave are spread evenly over the other stages (``get_num_layers_to_build``,
    megatron/core/transformer/transformer_block.py@d98e8a6; meshplan reads and writes them so,
    :mod:`meshplan.interop.megatron_pipeline`). Where that leaves an end stage no layer but
    ``floor(layers / pp)`` on every middle stage leaves at most 2 over, those go to the ends (the
    first before the last, which holds the output layer and the loss), no stage holding more
    than ``ceil(layers / pp)`` either way: 61 layers at pp 30 give [3, 2 x 28, 2]. None
    otherwise (an end stage with no layer, or ends heavier than a middle stage by more than one).

    >>> first_last_split(80, 7), first_last_split(80, 27)[-2:], first_last_split(80, 41)[::40]
    ([10, 12, 12, 12, 12, 12, 10], [3, 2], [1, 1])
    >>> first_last_split(80, 15), first_last_split(80, 31)
    ([1, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 1], None)
    >>> first_last_split(61, 30)[:2], first_last_split(61, 30)[-2:], first_last_split(61, 32)
    ([3, 2], [2, 2], None)
    """
    if pp < 2:
        return None
    per = -(-layers // pp)
    short = pp * per - layers
    first, last = per - short // 2, per - (short - short // 2)
    if min(first, last) >= 1:
        return [first] + [per] * (pp - 2) + [last]
    per, over = divmod(layers, pp)  # the floor on the middle stages, the rest on the ends
    if per < 1 or over > 2:
        return None
    return [per + over - over // 2] + [per] * (pp - 2) + [per + over // 2]


def first_last_sets(split: Optional[list[int]]) -> bool:
    """Whether Megatron-LM's ``--decoder-first/last-pipeline-num-layers`` set layers per stage
    ``split`` (None: even) at vpp 1: they set the first and the last stage and spread the rest
    evenly (:func:`first_last_split`), so every middle stage holds the same layers. The one
    test of a split Megatron-LM runs: the restart's (:meth:`meshplan.restart_degrees.PipelineRule.runs`),
    the search's (:func:`meshplan.search.candidate.stage_split`, :func:`meshplan.search.space.short_ok`)
    and the export's (:func:`meshplan.interop.megatron_pipeline.first_last_flags`).

    >>> first_last_sets([3] + [4] * 14 + [2]), first_last_sets([1] + [2] * 29 + [1, 1]), first_last_sets(None)
    (True, False, True)
    """
    return split is None or len(set(split[1:-1])) <= 1


def split_balance(split: Optional[list[int]], layers: int, pp: int) -> float:
    """How evenly layers per stage ``split`` (``pp`` entries; None: even) load a pipeline: the
    mean stage over the heaviest, the better of two counts: the layers alone (the even split's
    count, Megatron-LM's default) and the layers with the embedding and the output layer (and
    loss) as one layer each on the first and the last stage (Llama 3, Dubey et al. 2024, 3.3.2;
    Megatron-LM's ``--account-for-embedding/loss-in-pipeline-split``; torchtitan's
    ``pipeline_parallel_first/last_stage_less_layers``, 1 by default). The slowest stage paces
    every micro-batch, so ``1 - balance`` is the share of the pipeline's stage time idle by the
    split. 80 layers: even at pp 16 is 1; pp 31 (2 or 3 layers a stage) 80 / (31 x 3) and
    (80 + 2) / (31 x 3); pp 7's [10, 12 x 5, 10] 80 / 84 and 82 / 84:

    >>> split_balance(None, 80, 16), round(split_balance(balanced_split(80, 31), 80, 31), 3)
    (1.0, 0.882)
    >>> round(split_balance([10] + [12] * 5 + [10], 80, 7), 3), round(split_balance([7, 9, 9, 7], 32, 4), 3)
    (0.976, 0.944)
    """
    if split is None:
        return 1.0
    slots = [n + (k == 0) + (k == pp - 1) for k, n in enumerate(split)]
    return max(layers / (pp * max(split)), (layers + 2) / (pp * max(slots)))


def ends_short_split(layers: int, pp: int, vpp: int = 1) -> Optional[list[int]]:
    """Layers per stage with the embedding and the output layer each counted as one layer
    (Llama 3, Dubey et al. 2024, 3.3.2: "one layer fewer on the first and the last stage"):
    :func:`~meshplan.mesh.layers.balanced_split` of ``layers + 2``, one layer then taken off
    the first and the last stage. With ``vpp`` > 1 Llama 3's rule per virtual stage: every
    virtual stage holds (layers + 2) / (pp x vpp) slots, the embedding one of the first's and
    the output layer one of the last's, so that whole number must be >= 1 (at 1 the first
    chunk holds the embedding alone and the last the output layer alone: Llama 3 405B at pp 16
    and vpp 8); each stage's layers
    then go to its chunks as :func:`~meshplan.mesh.layers.stage_layers` spreads a per-stage
    split (the short chunk at the model's ends), which is exactly that layout, and the split
    Megatron-LM runs with ``--account-for-embedding-in-pipeline-split
    --account-for-loss-in-pipeline-split`` (other uneven chunkings are not searched: Megatron-Core
    refuses them, and each adds a whole block of candidates). None (no new candidate) with pp <
    3, with vpp 1 when it equals the default split (:func:`stage_split`), with vpp > 1 when the
    rule does not hold (the default there is even chunks only, so the split is a new candidate
    even where it equals :func:`~meshplan.mesh.layers.balanced_split`: Llama 3 405B's 126 layers
    at pp 16 are interleaved only this way, 128 / 16 = 8 slots per stage, vpp 2, 4 or 8).

    >>> ends_short_split(32, 4), ends_short_split(126, 16), ends_short_split(8, 2)
    ([7, 9, 9, 7], None, None)
    >>> ends_short_split(126, 16, 2)[:3], ends_short_split(126, 16, 8)[:3], ends_short_split(32, 4, 2)
    ([7, 8, 8], [7, 8, 8], None)
    >>> ends_short_split(14, 4, 2), ends_short_split(14, 4, 3), ends_short_split(14, 4, 4)
    ([3, 4, 4, 3], None, [3, 4, 4, 3])
    """
    if pp < 3 or pp > layers:
        return None
    if vpp > 1 and (layers + 2) % (pp * vpp):
        return None
    split = balanced_split(layers + 2, pp)
    split[0], split[-1] = split[0] - 1, split[-1] - 1
    # a chunk per virtual stage: vpp layers a stage, vpp - 1 on the ends (their end chunk
    # holds the embedding or the output layer alone, stage_layers); vpp 1 keeps a layer there
    if min(split[1:-1]) < vpp or min(split[0], split[-1]) < max(vpp - 1, 1):
        return None
    return split if vpp > 1 or split != balanced_split(layers, pp) else None

def dense_first_split(layers: int, dense: int, pp: int) -> Optional[list[int]]:
    """Layers per stage with the model's ``dense`` leading dense layers alone on the first stage
    (with the embedding) and its MoE layers on the other ``pp - 1``: evenly where ``pp - 1``
    divides them, else :func:`balanced_split` with the output layer counted as one layer on the
    last stage (taken off again). Megatron-LM's DeepSeek-V3 layout does so
    (``--pipeline-model-parallel-layout "Et*3|(tt|)*29,m|L"``: the embedding and the 3 dense
    layers, then the 58 MoE layers 2 per stage; NVIDIA/Megatron-LM
    docs/user-guide/features/pipeline_parallel_layout.md@d98e8a6), and so does DeepSeek-V3's
    configured [3, 4 x 14, 2] at pp 16. None where a stage would hold no layer or ``pp`` < 2.

    DeepSeek-V3 (61 layers, 3 dense): pp 16 is the configured split, pp 30 puts 2 MoE layers on
    each stage, pp 31 would leave the last stage the output layer alone (59 / 30 rounds to 1,
    less the output layer):

    >>> dense_first_split(61, 3, 16) == [3] + [4] * 14 + [2], dense_first_split(61, 3, 30) == [3] + [2] * 29
    (True, True)
    >>> dense_first_split(61, 3, 31), dense_first_split(61, 3, 3)
    (None, [3, 29, 29])
    """
    moe, n = layers - dense, pp - 1
    if pp < 2 or dense < 1 or n > moe:
        return None
    if moe % n == 0:
        return [dense] + [moe // n] * n
    rest = balanced_split(moe + 1, n)
    rest[-1] -= 1
    return [dense] + rest if rest[-1] >= 1 else None


def restart_split(layers: int, pp: int, vpp: int = 1, short: bool = False,
                  first_last: bool = False) -> Union[None, list[int], str]:
    """Layers per stage over all the layers when a mesh moves to ``pp`` stages of ``vpp`` chunks
    each (a restart on fewer nodes, :mod:`meshplan.restart`), the rule the search plans a
    candidate with (:func:`meshplan.search.space.stage_split`): Llama 3's
    :func:`ends_short_split` where ``short`` (the configured split is that rule) and it exists;
    else even stages (None) where pp divides the layers and vpp the layers per stage; else, with
    vpp 1, :func:`balanced_split` (``first_last``: :func:`first_last_split`, the only uneven
    split Megatron-LM's flags express, or a reason where it has none); else a one-line reason
    (the chunks cannot be even).

    DeepSeek-V3's 61 layers, configured [3, 4 x 14, 2] at pp 16 (the ends-short rule):

    >>> restart_split(61, 8, short=True), restart_split(61, 8), restart_split(32, 4)
    ([7, 8, 8, 8, 8, 8, 8, 6], [7, 8, 8, 8, 8, 8, 7, 7], None)
    >>> restart_split(32, 3, 2)
    '32 layers do not divide into pp 3 stages of vpp 2 chunks (Llama 3 ends-short split: none either)'
    """
    if pp > layers:
        return f"pp {pp} is more stages than the model's {layers} layers"
    if pp == 1:
        return None if vpp == 1 else f"vpp {vpp} needs pp > 1"
    split = ends_short_split(layers, pp, vpp) if short else None
    if split is not None:
        return split
    if layers % pp == 0 and (layers // pp) % vpp == 0:
        return None
    if vpp == 1 and first_last:
        return first_last_split(layers, pp) or f"{layers} layers over pp {pp} leave an end stage no layer"
    if vpp == 1:
        return balanced_split(layers, pp)
    return (f"{layers} layers do not divide into pp {pp} stages of vpp {vpp} chunks (Llama 3 ends-short split: "
            f"{'none either' if ends_short_split(layers, pp, vpp) is None else 'not configured'})")


def restart_splits(layers: int, pp: int, vpp: int = 1, short: bool = False, dense: int = 0,
                   first_last: bool = False) -> Union[list[Optional[list[int]]], str]:
    """The distinct layer splits a restart plans at ``pp`` (the planner keeps the fastest,
    :func:`meshplan.restart_rank.rank`), or why none exists: with ``dense`` (> 0: the configured
    split holds the model's dense layers alone on the first stage, vpp 1)
    :func:`dense_first_split` first; then :func:`restart_split` (``short``: Llama 3's
    ends-short rule; ``first_last``: Megatron-LM's cut, :func:`first_last_split`); with ``short``
    also the split without it (even, else :func:`balanced_split`), which may plan faster: at pp
    31 the ends-short split of DeepSeek-V3's 61 layers puts 3 on stage 1, the balanced one at
    most 2. At most 3 splits; which of them the job runs balanced enough is the restart's rule
    (:meth:`meshplan.restart_degrees.PipelineRule.runs`).

    >>> restart_splits(61, 31, short=True, dense=3)  # doctest: +NORMALIZE_WHITESPACE
    [[1, 3, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1],
     [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1]]
    >>> restart_splits(61, 8, short=True, dense=3)
    [[3, 8, 9, 9, 9, 8, 8, 7], [7, 8, 8, 8, 8, 8, 8, 6], [7, 8, 8, 8, 8, 8, 7, 7]]
    >>> restart_splits(61, 2, short=True, dense=3), restart_splits(32, 4, short=True), restart_splits(32, 3, 2)[:31]
    ([[3, 58], [31, 30]], [[7, 9, 9, 7], None], '32 layers do not divide into pp')
    """
    out: list[Optional[list[int]]] = []
    first = dense_first_split(layers, dense, pp) if dense and vpp == 1 else None
    rules = [restart_split(layers, pp, vpp, short, first_last)] + (
        [restart_split(layers, pp, vpp, first_last=first_last)] if short else [])
    for got in [first] * (first is not None) + rules:
        if not isinstance(got, str) and got not in out:
            out.append(got)
    return out or next(r for r in rules if isinstance(r, str))
