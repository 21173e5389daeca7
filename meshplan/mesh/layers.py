"""Layers per pipeline stage and virtual stage (chunk).

Interleaved assignment follows Megatron-LM (Narayanan et al. SC'21, section 2.2.2): with p
stages and v virtual stages, the model is cut into p*v chunks of equal layers and stage k
holds chunks k, k+p, k+2p, ...

>>> stage_layers(layers=8, pp=2, vpp=2)
[[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
"""

from __future__ import annotations

from typing import Optional, Union


def stage_layers(layers: int, pp: int, vpp: int = 1,
                 split: Optional[list[int]] = None) -> Union[list[list[list[int]]], str]:
    """Layer indices per stage, per chunk: ``result[stage][chunk] = [layer, ...]``.

    ``split``: explicit layers per stage (uneven allowed, vpp must be 1); must sum to
    ``layers``. Returns a one-line reason (str) when the layers cannot be assigned.
    """
    if split is not None:
        if len(split) != pp:
            return f"pp_layer_split has {len(split)} entries for pp {pp}"
        if sum(split) != layers or min(split) < 1:
            return f"pp_layer_split {split} sums to {sum(split)}, must be {layers} layers with >= 1 per stage"
        if vpp != 1:
            return "pp_layer_split with virtual stages is not supported; give vpp 1"
        out, start = [], 0
        for n in split:
            out.append([list(range(start, start + n))])
            start += n
        return out
    if layers % pp:
        return (f"{layers} layers do not divide into pp {pp} stages ({layers / pp:g} per stage); "
                f"give an explicit pp_layer_split")
    per_stage = layers // pp
    if per_stage % vpp:
        return (f"{per_stage} layers per stage ({layers} / pp {pp}) do not divide into vpp {vpp} "
                f"virtual stages ({per_stage / vpp:g} layers per chunk)")
    chunk = per_stage // vpp
    return [[list(range((c * pp + k) * chunk, (c * pp + k + 1) * chunk)) for c in range(vpp)]
            for k in range(pp)]


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
