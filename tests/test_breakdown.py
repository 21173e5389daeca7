"""meshplan.runtime.breakdown: the profiled step split into parts, on a hand-made trace."""

from __future__ import annotations

import json

import pytest

from meshplan.runtime.breakdown import PARTS, measured_parts


def test_measured_parts_sum_the_named_ops_and_leave_the_rest(tmp_path):
    ev = lambda name, dur, tid=1: {"ph": "X", "name": name, "dur": dur, "tid": tid, "ts": 0}
    trace = {"traceEvents": [
        ev("aten::mm", 1000), ev("aten::addmm", 500), ev("aten::matmul", 1600),  # matmul wraps mm: not counted
        ev("aten::scaled_dot_product_attention", 2100), ev("aten::_scaled_dot_product_flash_attention_for_cpu", 2000),
        ev("aten::_scaled_dot_product_flash_attention_for_cpu_backward", 3000),
        ev("_c10d_functional::wait_tensor", 4000), ev("gloo:all_reduce", 9000, tid=2),
        {"ph": "i", "name": "aten::mm", "dur": 99999}]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    got = measured_parts(path, 0.020)
    assert list(got) == list(PARTS)
    assert got["GEMM kernels"] == pytest.approx(1.5e-3) and got["attention kernels"] == pytest.approx(5e-3)
    assert got["waits on collectives"] == pytest.approx(4e-3)
    assert got["the rest"] == pytest.approx(0.020 - 1.5e-3 - 5e-3 - 4e-3)
