"""One rule for whether an MoE layer's MLP block issues dense tp collectives: the search's columns
(:func:`meshplan.spec.axes.moe_tp.moe_mlp_blocks_tp`, over arrays of degrees) call the same
:func:`~meshplan.spec.axes.moe_tp.experts_over_tp` as the collective table and the rank timeline
(:func:`~meshplan.spec.axes.moe_tp.moe_mlp_tp_ops`); moe_mlp_blocks_tp had its own copy of the formula."""

from __future__ import annotations

import itertools

import numpy as np

from meshplan.spec.axes.moe_tp import experts_over_tp, moe_mlp_blocks_tp, moe_mlp_tp_ops


def test_experts_over_tp_takes_the_search_columns():
    """torchtitan's experts over tp is framework torch with etp = tp > 1. By hand, (etp, tp) =
    (1, 2) no (etp 1), (2, 2) yes, (4, 4) yes, (2, 4) no (etp != tp), (1, 1) no (tp 1); never under
    framework megatron (its etp is planned as expert shapes only). Arrays give the same as scalars."""
    etp, tp = np.array([1, 2, 4, 2, 1]), np.array([2, 2, 4, 4, 1])
    assert experts_over_tp("torch", etp, tp).tolist() == [False, True, True, False, False]
    assert experts_over_tp("megatron", etp, tp).tolist() == [False] * 5
    assert [bool(experts_over_tp("torch", int(e), int(t))) for e, t in zip(etp, tp)] == [False, True, True, False,
                                                                                           False]


def test_search_columns_follow_the_tables_rule():
    """Under SP (the search runs SP exactly when tp > 1) the search's 1/0 column is whether the
    table's and the timeline's op list is non-empty, for every framework, (etp, tp) in {1, 2, 4}^2 and
    with or without a shared expert."""
    pairs = list(itertools.product((1, 2, 4), repeat=2))
    etp, tp = np.array([e for e, _ in pairs]), np.array([t for _, t in pairs])
    for framework, shared in itertools.product(("torch", "megatron"), (False, True)):
        column = moe_mlp_blocks_tp(framework, etp, tp, shared).tolist()
        assert column == [bool(moe_mlp_tp_ops(framework, e, t, True, shared)) for e, t in pairs], (framework, shared)
