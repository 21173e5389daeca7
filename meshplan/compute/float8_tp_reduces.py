"""The tp all-reduces torchao's float8 Linears add per dense layer and micro-batch, counted from
the layer's float8 GEMMs: the amaxes of tp-sharded tensors under torchao's float8 TP
(:func:`tp_amax_per_layer`) and under torch's plain TP (:func:`plain_tp_amax_per_layer`), the
rowwise scales over tp (:func:`rowwise_tp_per_layer`), and those among a list of kernels
(:func:`tp_amax_calls`). The casts themselves, and the rules of when each count applies:
:mod:`meshplan.compute.float8` (its module docstring gives the sources, pytorch/ao eab345c and
6243040).
"""

from __future__ import annotations

from meshplan.compute.float8 import INPUTS, OVER_TP, ROW_PARALLEL


def rowwise_tp_per_layer(names) -> tuple[int, int]:
    """(forward, backward) tp all-reduces of each of :data:`~meshplan.compute.float8.TOKEN_SCALES`
    and :data:`~meshplan.compute.float8.WEIGHT_SCALES` per dense layer and micro-batch under
    :func:`~meshplan.compute.float8.rowwise_tp`, ``names``: the layer's float8 GEMMs: one each per
    row-parallel Linear in forward, per column-parallel one in backward. Llama: 2, 5.

    >>> rowwise_tp_per_layer(frozenset(INPUTS)), rowwise_tp_per_layer(frozenset({"wq", "w_down"}))
    ((2, 5), (1, 1))
    """
    mine = [n for n in INPUTS if n in names]
    row = sum(n in ROW_PARALLEL for n in mine)
    return row, len(mine) - row


def plain_tp_amax_per_layer(names, fp8_all_gather: bool) -> tuple[int, int]:
    """(forward, backward) tp all-reduces of amaxes per dense layer and micro-batch under
    :func:`~meshplan.compute.float8.tensorwise_plain_tp`: forward one per row-parallel Linear's input (torch's
    ``RowwiseParallel`` hands it over sharded along K) and, unless FSDP gathers them in float8, per
    weight (a tp-sharded DTensor); backward one per column-parallel Linear's output gradient
    (sharded along N). The column-parallel inputs and row-parallel output gradients arrive gathered
    (Replicate): no all-reduce. Llama: 9 and 5.

    >>> plain_tp_amax_per_layer(frozenset(INPUTS), False), plain_tp_amax_per_layer(frozenset(INPUTS), True)
    ((9, 5), (2, 5))
    """
    mine = [n for n in INPUTS if n in names]
    row = sum(n in ROW_PARALLEL for n in mine)
    return row + (0 if fp8_all_gather else len(mine)), len(mine) - row


def tp_amax_calls(kernels, side: str, phase: str, mark: str = OVER_TP) -> int:
    """The tp all-reduces of amaxes among ``kernels`` (:func:`~meshplan.compute.float8.layer_kernels` tuples or
    :class:`~meshplan.compute.ops.Op`) of ``phase`` on ``side`` ("attn": blocks attn_pre, attn,
    attn_post; "mlp": mlp_pre, mlp, mlp_post; "" both), replayed kernels left out: the kernels
    named with ``mark`` (:data:`~meshplan.compute.float8.OVER_TP`, or rowwise's
    :data:`~meshplan.compute.float8.TOKEN_SCALES`, :data:`~meshplan.compute.float8.WEIGHT_SCALES`)."""
    out = 0
    for k in kernels:
        name, block, ph = (k[0], k[1], k[2]) if isinstance(k, tuple) else (k.name, k.block, k.phase)
        if getattr(k, "recompute", False):  # a replay: its all-reduces are counted as the forward's
            continue
        if ph == phase and mark in name and block.startswith(side):
            out += 1
    return out


def tp_amax_per_layer(names, fp8_all_gather: bool) -> tuple[int, int]:
    """(forward, backward) tp all-reduces of amaxes per dense layer and micro-batch under
    torchao's float8 TP (:func:`~meshplan.compute.float8.float8_tp`), ``names``: the layer's float8
    GEMMs: one per distinct input and, unless FSDP gathers them in float8, per weight (a tp-sharded
    DTensor) in forward; one per output gradient in backward. The same count as the
    :data:`~meshplan.compute.float8.OVER_TP` kernels of :func:`~meshplan.compute.float8.layer_kernels`
    (``tests/test_float8_casts.py``). Llama: 4 and 7.

    >>> tp_amax_per_layer(frozenset(INPUTS), True), tp_amax_per_layer(frozenset(INPUTS), False)
    ((4, 7), (11, 7))
    """
    mine = [n for n in INPUTS if n in names]
    return len({INPUTS[n][0] for n in mine}) + (0 if fp8_all_gather else len(mine)), len(mine)
