"""torch's async TP against its source (meshplan.compute.asynctp, module docstring): the fused
ops' two-stream schedule replayed in issue order, and the restride copy before wo's fused
reduce-scatter.

The schedule: torch's ``_pipelined_multi_all_gather_and_consume`` issues the own shard's GEMMs on
the current stream, then for step i = 1 .. tp - 1 the pull of peer (rank + i)'s shard and its
GEMMs on the backend stream (i odd) or the current stream (i even);
``_pipelined_produce_and_all2all`` issues per step the rows for peer (rank + i), a barrier, the
pull of its own rows from peer (rank - i), a barrier, on the same alternation, and the own rows
last on the current stream (torch 2.13 ``torch/distributed/_symmetric_memory/__init__.py``, the
same functions in the stored mid-2025 version). Each op starts when its stream's previous op has
ended and its engine is free: the SMs run one GEMM at a time (a piece of M / tp rows fills the
GPU), the copy engines one pull at a time (the source: "cp from different streams cannot
overlap"); barriers take no time here. :func:`meshplan.compute.asynctp.fused_seconds` is the
closed form of that replay.
"""

from __future__ import annotations

import pytest

from meshplan import catalog
from meshplan.compute import asynctp
from meshplan.compute.layer import layer_cost
from meshplan.compute.ops import Workload

MS = 1e-3


def replay(ops: list[tuple[str, str, float]]) -> float:
    """End of the last of ``ops`` ((stream, engine "sm" or "ce", seconds) in issue order): at
    each turn the op that can start first (ties: the earlier issued) starts when its stream's
    previous op has ended and its engine is free."""
    end: list = [None] * len(ops)
    free = {"sm": 0.0, "ce": 0.0}
    last: dict = {}
    before = []
    for i, (stream, _, _) in enumerate(ops):
        before.append(last.get(stream))
        last[stream] = i
    pending = list(range(len(ops)))
    while pending:
        ready = [(max(0.0 if before[i] is None else end[before[i]], free[ops[i][1]]), i)
                 for i in pending if before[i] is None or end[before[i]] is not None]
        start, i = min(ready)
        end[i] = start + ops[i][2]
        free[ops[i][1]] = end[i]
        pending.remove(i)
    return max(end)


def all_gather_ops(tp: int, g: float, c: float) -> list[tuple[str, str, float]]:
    ops = [("current", "sm", g)]
    for i in range(1, tp):
        stream = "backend" if i % 2 else "current"
        ops += [(stream, "ce", c), (stream, "sm", g)]
    return ops


def reduce_scatter_ops(tp: int, g: float, c: float) -> list[tuple[str, str, float]]:
    ops = []
    for i in range(1, tp):
        stream = "backend" if i % 2 else "current"
        ops += [(stream, "sm", g), (stream, "ce", c)]
    return ops + [("current", "sm", g)]


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("g, c", [(1.0, 0.5), (0.2, 0.5), (1.0, 1.0), (0.3, 0.31)])
def test_fused_seconds_is_the_sources_schedule(tp, g, c):
    """Pieces of g ms against pulls of c ms: both fused ops end at g + (tp - 1) max(g, c). By hand
    at tp 8: GEMM-bound (g 1, c 0.5) the GEMMs run back to back, 8 ms, each pull beside the
    previous GEMM; transfer-bound (g 0.2, c 0.5) the pulls run back to back from 0 (all-gather:
    the own GEMM beside the first; reduce-scatter: the first rows before it) and one GEMM
    follows the last, 0.2 + 7 x 0.5 = 3.7 ms."""
    want = asynctp.fused_seconds(tp * g * MS, c * MS, tp)
    assert replay(all_gather_ops(tp, g * MS, c * MS)) == pytest.approx(want, rel=1e-12)
    assert replay(reduce_scatter_ops(tp, g * MS, c * MS)) == pytest.approx(want, rel=1e-12)
    if tp == 8 and (g, c) == (1.0, 0.5):
        assert want == pytest.approx(8 * MS)
    if tp == 8 and (g, c) == (0.2, 0.5):
        assert want == pytest.approx(3.7 * MS)


def llama8b(**kw) -> Workload:
    """Llama 3 8B as torchtitan's async-TP run of 2025-06 ran it: tp 8, 12 sequences of 8,192
    (98,304 rows gathered), compiled, bf16."""
    base = dict(seq_len=8192, micro_batch=12, tp=8, sp=True, recompute="none", async_tp="torch",
                sp_layout_copies=True, framework="torch")
    return Workload(**{**base, **kw})


def restrides(cost) -> list[tuple[str, str, float]]:
    return [(o.name, o.phase, o.size_bytes) for o in cost.ops if o.name.startswith(asynctp.RESTRIDE)]


def test_restride_of_wo_input_by_hand():
    """wo's input is the attention kernel's [12, 8192, 4 heads, 128] output, 98,304 x 512 bf16;
    the fused reduce-scatter wants it sequence-outermost, so inductor copies it once a forward:
    2 x 98,304 x 512 x 2 B = 201,326,592 B (w_down's input is inductor's own SiLU x up kernel:
    written in that order, no copy). On the catalog H100 at Triad (2.97 TB/s, the memory-bound
    kernels' rate): at least 201.3 MB / 2.97 TB/s = 67.8 us."""
    h100 = catalog.gpu("h100-sxm5-80gb")
    c = layer_cost(catalog.model("llama3-8b"), h100, llama8b())
    assert restrides(c) == [("async-TP restride (wo input)", "forward", 201_326_592)]
    op = next(o for o in c.ops if o.name.startswith(asynctp.RESTRIDE))
    assert op.seconds >= 201_326_592 / 2.97e12


def test_restride_only_where_the_source_copies():
    """One sequence a micro-batch (both orders the same bytes), a float8 wo (its input cast by
    inductor first, written in the asked order), torch's ring attention at cp 2 (its merge, an
    inductor kernel, writes wo's input), no async TP, Megatron-LM (TE's userbuffers): no
    restride."""
    h100, m = catalog.gpu("h100-sxm5-80gb"), catalog.model("llama3-8b")
    assert restrides(layer_cost(m, h100, llama8b(micro_batch=1))) == []
    f8 = llama8b(linear_dtype="fp8", float8_gemms=frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}))
    assert f8.gemm_dtype("wo") == "fp8"
    assert restrides(layer_cost(m, h100, f8)) == []
    assert restrides(layer_cost(m, h100, llama8b(cp=2, torch_ring_attention=True))) == []
    assert restrides(layer_cost(m, h100, llama8b(cp=2))) != []
    assert restrides(layer_cost(m, h100, llama8b(async_tp=""))) == []
    assert restrides(layer_cost(m, h100, llama8b(async_tp="megatron", framework="megatron"))) == []


def test_restride_replays_with_its_reduce_scatter():
    """Full AC replays the attention's fused reduce-scatter (the MLP's closing one is not
    replayed, compute.recompute.full_ac_not_replayed) and with it wo's restride: twice a layer.
    torchtitan's op-level AC saves the reduce-scatter's output (``_save_list``): not replayed,
    once a layer."""
    h100, m = catalog.gpu("h100-sxm5-80gb"), catalog.model("llama3-8b")
    full = restrides(layer_cost(m, h100, llama8b(recompute="full")))
    assert [(n, p) for n, p, _ in full] == [("async-TP restride (wo input)", "forward"),
                                            ("async-TP restride (wo input) (recompute)", "backward_input")]
    op = restrides(layer_cost(m, h100, llama8b(recompute="op")))
    assert [(n, p) for n, p, _ in op] == [("async-TP restride (wo input)", "forward")]
