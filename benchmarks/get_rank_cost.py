"""Microbenchmark behind :data:`meshplan.comm.deepspeed.GET_RANK_OF_NARROW`: the host time of
``torch.distributed.get_rank(group=g)`` against that of ``tensor.narrow`` from Python, on the
machine it runs on (CPU only, one process, gloo).

DeepSpeed ZeRO-3 of 2021 (v0.3.13 to v0.5.4, ``partition_parameters.py`` ``_allgather_param``)
builds its list of ``world`` partition views in a Python loop whose every iteration calls
``flat_tensor.narrow`` and ``torch.distributed.get_rank(group=self.ds_process_group)``. meshplan
prices the ``narrow`` at :data:`meshplan.comm.deepspeed.PYTHON_OP_S` (a public figure for one
eager op issued from Python); the ``get_rank`` call is priced at this benchmark's ratio of the two
times it prints, measured on the same interpreter, so that the machine's speed cancels out.

Recorded (the constant's source): torch 2.13.0+cpu, Python 3.11.7, the development machine (2
cores shared with other jobs, so the absolute times vary), 2026-12-04, three runs: narrow 5.79 /
4.72 / 3.54 us, get_rank(group) 2.23 / 2.62 / 1.60 us (best of 7 rounds of 200,000 calls),
median ratio 0.43 / 0.47 / 0.43: 0.45. torch's ``get_rank(group)`` of that time takes the same
steps (``distributed_c10d.py``: ``_rank_not_in_group``, ``_check_default_pg``, the default group's
``rank()`` through pybind, ``_get_group_rank``'s map lookup; read in a stored copy of the file);
its time on a 2021 host was not measured.

Run: PYTHONPATH=. .venv/bin/python benchmarks/get_rank_cost.py
"""

from __future__ import annotations

import tempfile
import timeit

CALLS = 200_000


def paired_us(a, b, calls: int = CALLS, rounds: int = 7) -> tuple[float, float, float]:
    """``a`` and ``b`` timed in alternation, ``calls`` calls each per round: the best time per
    call of each (microseconds) and the median over the rounds of b's time over a's (on a shared
    machine the load changes between rounds, the ratio within one round much less)."""
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(timeit.timeit(a, number=calls) / calls * 1e6)
        tb.append(timeit.timeit(b, number=calls) / calls * 1e6)
    ratios = sorted(y / x for x, y in zip(ta, tb))
    return min(ta), min(tb), ratios[len(ratios) // 2]


def main() -> None:
    import torch
    import torch.distributed as dist

    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            group = dist.new_group([0])
            flat = torch.zeros(1 << 20)
            narrow, get_rank, ratio = paired_us(lambda: flat.narrow(0, 8, 8), lambda: dist.get_rank(group=group))
        finally:
            dist.destroy_process_group()
    print(f"torch {torch.__version__}: narrow {narrow:.2f} us, get_rank(group) {get_rank:.2f} us, "
          f"ratio {ratio:.2f} (median of the rounds)")


if __name__ == "__main__":
    main()
