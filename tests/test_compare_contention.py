"""``compare``'s compute by kernel kind itemises the SM contention (nc52fixC review point a): the
kernels' slowdown while collectives' NCCL channels hold SMs
(:meth:`~meshplan.schedule.step_summary.StepTime.contention_s`) was filed under ``other
(memory-bound ops, optimizer step)``, the residual of :func:`meshplan.search.step_parts.compute_split`,
so a pair whose kernels are the same read as if one side's memory-bound ops were slower. Now it is
its own part, ``SM contention (NCCL channels)``, in the reasons' line and in ``--json``'s
``compute_split_s`` (:attr:`meshplan.compare.sides.Side.compute_split_s`)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from meshplan.compare import compare
from meshplan.compare.output import compare_to_dict
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.plan import build_plan
from meshplan.report.json_docs import schema_of
from meshplan.search.step_parts import SM_CONTENTION, SPLIT_PARTS

OPTS = ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096)


def _plan(tmp_path, name: str, **zero):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 1,
                                "zero_optimization": {"stage": 3, **zero}, "bf16": {"enabled": True}}))
    return build_plan(load_any(path, opts=OPTS))


def test_sm_contention_is_its_own_part_of_compare_compute_split(tmp_path):
    """DeepSpeed ZeRO-3, Llama 3 8B on 2 x 8 H100 (test_deepspeed_zero3_knobs' job), overlap_comm
    true against false: the same kernels. Off, every all-gather and reduce-scatter runs on the
    compute stream, so no kernel runs beside a collective: contention 0 by construction. On, the
    collectives over the 2 nodes run beside the compute holding NCCL's 16 network rings of the
    H100's 132 SMs (row_shares.nccl_net_channels): 248.80 ms of contention, read from the model,
    and the one difference of the two computes (test_deepspeed_zero3_knobs: on's compute less its
    contention is off's, 5686.27 ms, to 5e-6 s). So the row equals each step's contention, the
    five parts add up to each compute, and with the contention out, ``other`` (718.8 ms) is the
    same on both sides: before, it read on 996.5 ms, off 747.7 ms, the contention taken for
    memory-bound ops. (kvheads: 747.7 -> 718.8 ms, the repeat_kv copies no longer planned, 28.92 ms:
    test_deepspeed_zero3_knobs.)"""
    c = compare(_plan(tmp_path, "on"), _plan(tmp_path, "off", overlap_comm=False), names=("on", "off"))
    sa, sb = c.a.compute_split_s, c.b.compute_split_s
    assert sa is not None and sb is not None and list(sa) == [*SPLIT_PARTS, SM_CONTENTION]
    assert sa[SM_CONTENTION] == c.a.step.contention_s() and round(sa[SM_CONTENTION] * 1e3, 2) == 248.80
    assert sb[SM_CONTENTION] == c.b.step.contention_s() == 0.0
    for split, st in ((sa, c.a.step), (sb, c.b.step)):
        assert sum(split.values()) == pytest.approx(st.parts_s()["compute"], rel=1e-12)
    other = SPLIT_PARTS[3]
    assert sa[other] == pytest.approx(sb[other], abs=5e-6) and round(sb[other] * 1e3, 1) == 718.8
    assert [sa[k] for k in SPLIT_PARTS[:3]] == [sb[k] for k in SPLIT_PARTS[:3]]  # the same kernels
    line = next(r for r in c.reasons if r.startswith("of compute by kernel kind"))
    assert "per step): SM contention (NCCL channels) on 248.8 ms, off 0.0 ms (-248.8 ms); " in line
    assert "other (memory-bound ops, optimizer step) on 718.8 ms, off 718.8 ms (+0.0 ms)" in line
    doc = compare_to_dict(c)
    assert doc["a"]["compute_split_s"] == sa and doc["b"]["compute_split_s"][SM_CONTENTION] == 0.0
    assert list(jsonschema.Draft202012Validator(schema_of("compare")).iter_errors(json.loads(json.dumps(doc)))) == []

