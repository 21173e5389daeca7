from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.fixture
def no_host_pace(monkeypatch):
    """The kernels' and collectives' composition alone: eager DTensor TP's host pace per block
    (kernels.toml [host] dtensor_tp_block_*, M1) set to none, for tests of what the device runs
    (the pace's own golden: tests/test_golden_steptime.py::test_tp8_host_pace)."""
    monkeypatch.setattr("meshplan.schedule.workload.dtensor_host_s", lambda config, tp: (0.0, 0.0))


@pytest.fixture
def seed_path():
    return EXAMPLES / "seed-64gpu.toml"


#: Exhaustive and torch-side checks: in ``make test`` (CI), not in ``make test-fast``, the
#: edit-loop lane. File names, or ``file::test`` for one test of a file.
HEAVY = (
    "test_devicemesh_oracle.py",        # torch DeviceMesh as the oracle at 64-1024 ranks
    "test_layout_properties.py",        # hypothesis over every axis subset
    "test_runtime_dryrun.py",           # fake process group, every rank
    "test_table_vs_torch.py",           # fake process group, DTensor/FSDP2 op by op
    "test_memory_vs_tracker.py",        # FSDPMemTracker on the fake process group
    "test_forward_prefetch_recompute.py",  # FSDP2 prefetch under recompute, fake process group
    "test_search.py::test_verdict_equals_build_plan_for_every_candidate",  # exact plan of every candidate
    "test_search_stage_bounds.py::test_bounds_never_exceed_the_step_with_the_host_pace",  # every candidate's step
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = Path(str(item.fspath)).name
        if name in HEAVY or f"{name}::{getattr(item, 'originalname', '')}" in HEAVY:
            item.add_marker(pytest.mark.heavy)


def spawn_ranks(fn, world: int, *args, timeout_s: float = 90.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; fail the test on an error or
    after ``timeout_s``. The processes fork from a forkserver that imported torch and ``fn``'s
    module once (a fresh single-threaded process, so fork-safe): about 2 s of start-up instead
    of 10-15 s of spawn re-imports on 2 cores."""
    import multiprocessing
    import time

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", fn.__module__])
    ctx = mp.start_processes(fn, args=(world, *args), nprocs=world, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world}-rank run did not finish in {timeout_s:g} s")
