"""Activations a pipeline stage holds at its peak: the micro-batches and model chunks in
flight under 1F1B and interleaved 1F1B (the schedules' own counts,
:meth:`meshplan.pipeline.base.PipelineSchedule.in_flight`), Korthikanti et al. 2022's
interleaved memory factor (eq. 5), and a stage's transformer-layer activation bytes from one
layer's (:func:`meshplan.memory.activations.layer_bytes`)."""

from __future__ import annotations

from meshplan.pipeline.one_f_one_b import ONE_F_ONE_B
from meshplan.pipeline.registry import get


def in_flight_microbatches(stage: int, pp: int, m: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at its peak under 1F1B:
    ``min(m, pp - stage)`` (Narayanan et al. SC'21 2.2.1; Korthikanti 4.3: the first stage
    holds ``pp`` micro-batches of ``L / pp`` layers, i.e. ``L`` layers' worth); the
    schedule's own count (:meth:`meshplan.pipeline.base.PipelineSchedule.in_flight`).

    >>> [in_flight_microbatches(k, 4, 8) for k in range(4)], in_flight_microbatches(0, 4, 2)
    ([4, 3, 2, 1], 2)
    """
    return int(ONE_F_ONE_B.in_flight(pp, m, 1, stage))


def interleaved_factor(pp: int, vpp: int) -> float:
    """Korthikanti eq. 5 memory factor of the first stage under the interleaved schedule,
    ``1 + (p - 1) / (p m)``, where the paper's m is the number of interleaving stages
    (model chunks per rank, ``vpp``), not the number of micro-batches; Megatron's
    ``report_theoretical_memory`` uses the virtual pipeline size there. It follows from
    :func:`in_flight_chunks`: ``(vpp pp + pp - 1)`` chunks of ``L / (pp vpp)`` layers.

    >>> interleaved_factor(4, 2)
    1.375
    """
    return 1 + (pp - 1) / (pp * vpp)


def in_flight_chunks(stage: int, pp: int, m: int, vpp: int = 1) -> int:
    """Model-chunk forward passes stage ``stage`` holds at its peak under 1F1B (vpp 1) or
    interleaved 1F1B (vpp > 1), the schedule's own count
    (:meth:`meshplan.pipeline.base.PipelineSchedule.in_flight`): 1F1B ``min(m, pp - stage)``;
    interleaved (Megatron-LM schedules, warm-up ``2 (pp - stage - 1) + (vpp - 1) pp``, plus
    the first steady-state forward) ``min(m vpp, 2 (pp - stage - 1) + (vpp - 1) pp + 1)``.

    >>> in_flight_chunks(0, 4, 8, vpp=2), in_flight_chunks(3, 4, 8, vpp=2)
    (11, 5)
    """
    return int(get(ONE_F_ONE_B.for_chunks(vpp)).in_flight(pp, m, vpp, stage))



def in_flight_layers(schedule, stage: int, pp: int, m: int, vpp: int, chunk_layers: int) -> int:
    """Layers' worth of activations stage ``stage`` holds at its peak under ``schedule`` (the
    schedule's own :meth:`~meshplan.pipeline.base.PipelineSchedule.in_flight`, walked at ``vpp``
    chunks of ``chunk_layers`` each): chunk passes in flight x ``chunk_layers``; a V-shaped schedule
    given the stage as one chunk (the capacity rows' splits, before its chunks exist) counts its own
    two chunks of ``ceil(chunk_layers / 2)``.

    >>> [in_flight_layers(s, 0, 4, 8, 1, 2) for s in ("1f1b", "gpipe", "zb_h1", "zbv", "dualpipev")]
    [8, 16, 8, 8, 9]
    >>> in_flight_layers("zb_h1", 3, 4, 8, 1, 2), in_flight_layers("1f1b", 3, 4, 8, 1, 2), in_flight_layers("1f1b", 0, 4, 8, 2, 1)
    (8, 2, 11)
    """
    sched = get(get(schedule).for_chunks(vpp))
    v = sched.chunks or vpp
    per = chunk_layers if v == vpp else -(-chunk_layers * vpp // v)
    return int(sched.in_flight(pp, m, v, stage)) * per

def stage_layer_bytes(layer_bytes_: int, layers_per_chunk: int, stage: int, pp: int, m: int,
                      vpp: int = 1) -> int:
    """Transformer-layer activations held by stage ``stage`` at its peak, bytes:
    ``layer_bytes x layers_per_chunk x in_flight_chunks``. Embedding, head and the working
    set of a layer being recomputed are added by the timeline, not here.

    Korthikanti's 22B model on the first (only) stage, 48 layers, tp 8, b 4 (section 6):

    >>> from meshplan.units import GiB
    >>> from meshplan.memory.activations import layer_bytes
    >>> from meshplan.memory.layer_dims import LayerDims
    >>> d = LayerDims.gpt(s=2048, b=4, h=6144, a=64)
    >>> stage_layer_bytes(layer_bytes(d, tp=8), 48, 0, 1, 1) / GiB
    59.25
    """
    return layer_bytes_ * layers_per_chunk * in_flight_chunks(stage, pp, m, vpp)
