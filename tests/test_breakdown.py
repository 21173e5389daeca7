"""meshplan.runtime.validation.breakdown: the profiled step split into parts, on a hand-made trace."""

from __future__ import annotations

import json

import pytest

from meshplan.runtime.validation.breakdown import PARTS, measured_parts


def test_measured_parts_sum_the_named_ops_and_leave_the_rest(tmp_path):
    ev = lambda name, ts, dur, tid=1: {"ph": "X", "name": name, "dur": dur, "tid": tid, "ts": ts}
    trace = {"traceEvents": [
        ev("aten::matmul", 0, 1600), ev("aten::mm", 0, 1000), ev("aten::addmm", 1000, 500),  # matmul: not counted
        ev("aten::scaled_dot_product_attention", 2000, 2100),
        ev("aten::_scaled_dot_product_flash_attention_for_cpu", 2000, 2000),
        ev("aten::_scaled_dot_product_flash_attention_for_cpu_backward", 5000, 3000),
        ev("_c10d_functional::wait_tensor", 9000, 4000), ev("gloo:all_reduce", 9000, 9000, tid=2),
        {"ph": "i", "name": "aten::mm", "ts": 0, "dur": 99999}]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    got = measured_parts(path, 0.020)
    assert list(got) == list(PARTS)
    assert got["GEMM kernels"] == pytest.approx(1.5e-3) and got["attention kernels"] == pytest.approx(5e-3)
    assert got["waits on collectives"] == pytest.approx(4e-3)
    assert got["the rest"] == pytest.approx(0.020 - 1.5e-3 - 5e-3 - 4e-3)


def test_nested_events_of_one_part_count_once(tmp_path):
    """DTensor's aten::mm holds the local aten::mm it dispatches (and, under SP, the
    all-gather of its input): only the innermost event is the kernel; overlapping kernels on
    two threads count once (the union of the intervals)."""
    ev = lambda name, ts, dur, tid=1: {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [ev("aten::mm", 0, 1000), ev("aten::mm", 100, 800),
                                                ev("aten::mm", 2000, 500), ev("aten::mm", 0, 300, tid=2)]}))
    got = measured_parts(path, 0.01)
    # leaves: [100, 900) (not its holder [0, 1000)), [2000, 2500), tid 2's [0, 300): union 900 + 500 us
    assert got["GEMM kernels"] == pytest.approx(1.4e-3)
    assert got["the rest"] == pytest.approx(0.01 - 1.4e-3)
