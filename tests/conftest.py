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


#: The session fixtures of the shared validate launches (tests/validate_runs.py).
SHARED_LAUNCHES = ("world2_runs", "world4_runs", "world8_runs")


def pytest_collection_modifyitems(config, items):
    """Marks ``heavy`` the tests of :data:`HEAVY`; gives every test that reads a shared validate
    launch (:data:`SHARED_LAUNCHES`, directly or through another fixture) the time limit
    ``SHARED_TIMEOUT_S``, closest of its ``timeout`` marks: the first to ask waits for the launch."""
    from tests.validate_runs import SHARED_TIMEOUT_S

    for item in items:
        name = Path(str(item.fspath)).name
        if name in HEAVY or f"{name}::{getattr(item, 'originalname', '')}" in HEAVY:
            item.add_marker(pytest.mark.heavy)
        if any(f in getattr(item, "fixturenames", ()) for f in SHARED_LAUNCHES):
            item.add_marker(pytest.mark.timeout(SHARED_TIMEOUT_S), append=False)


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


#: tp 2 + SP inside, FSDP2 over dp_shard outside (Llama-3-8B shapes): the same tables as
#: examples/mini_2x4_tp2-dp4.toml, the mesh newcomer trial 21 validated at world 4.
TP2_FSDP = Path(__file__).parent / "data" / "validate_llama8b_tp2sp_fsdp.toml"


@pytest.fixture(scope="session")
def staged_tp2_fsdp(tmp_path_factory):
    """One ``meshplan validate`` of :data:`TP2_FSDP` at worlds 2 and 4 (one timed step, validate's
    seq 64, the in-run probe and message curves after the steps), run once for every test that reads its
    evidence (tests/test_validate.py's staged worlds, tests/test_validate_memory_kinds.py's memory
    rows): each launch pays torch's start-up on every rank. The CLI runs in this process
    (tests/cli_run.py); the ranks under torchrun. Returns (evidence folder, the CLI's
    ``returncode``/``stdout``/``stderr``)."""
    from tests.cli_run import run_captured

    out = tmp_path_factory.mktemp("staged_tp2_fsdp") / "ev"
    return out, run_captured("validate", TP2_FSDP, "--worlds", "2,4", "--steps", "1", "--out", out,
                             "--timeout-s", "90")


#: Mixtral-8x7B shapes scaled down: FSDP2 over dp_shard 4, the 8 experts over ep 2 and efsdp 2.
MOE_EP2 = Path(__file__).parent / "data" / "validate_mixtral_ep2_fsdp.toml"


#: Llama-3-8B shapes scaled down, DDP (sharding "none") over dp 4.
DDP4 = Path(__file__).parent / "data" / "validate_llama8b_ddp4.toml"
#: tests/test_validate_moe.py's two exact-match configs: 2 experts sharded on dim 1, and tp 2 + SP x ep 2.
MOE_DIM1 = Path(__file__).parent / "data" / "validate_mixtral_2experts_ep2_dim1.toml"
MOE_TP2_EP2 = Path(__file__).parent / "data" / "validate_mixtral_tp2sp_ep2_fsdp.toml"

def _runs(request, tmp_path_factory, world: int, always=None) -> dict:
    """The shared launch of ``world`` (tests/validate_runs.py :func:`~tests.validate_runs.shared`)."""
    pytest.importorskip("torch")
    from tests.validate_runs import shared

    return shared(request, tmp_path_factory.mktemp(f"world{world}"), world, always)


@pytest.fixture(scope="session")
def world2_runs(request, tmp_path_factory):
    """The 2-rank ``validate`` runs of every collected module's ``shared_validate_runs()`` that a
    test asks for, in one torchrun launch (tests/validate_runs.py). ``name ->`` (code, results,
    out, folder, stdout)."""
    return _runs(request, tmp_path_factory, 2)


@pytest.fixture(scope="session")
def world4_runs(request, tmp_path_factory):
    """The 4-rank ``validate`` runs, in one torchrun launch (tests/validate_runs.py: one torch
    start-up and rendezvous for all), each into its own evidence folder: the test modules' own
    (``shared_validate_runs()``) and the ones several files read: ``moe_ep2`` (:data:`MOE_EP2`, 2
    layers, seq 64, vocab 512: validate's defaults), ``ddp4`` (:data:`DDP4`, seq 32, 2
    micro-batches; checkpoint bandwidth 1 GB/s per rank for the DCP rows' predicted times),
    ``moe_dim1`` and ``moe_tp2_ep2`` (seq 32); every one with one timed step and no in-run probe.
    ``name ->`` (code, results, out, folder, stdout)."""
    pytest.importorskip("torch")
    from meshplan.runtime.validation.validate import Options

    def opt(**kw):
        return Options(**{"worlds": (4,), "layers": 2, "seq_len": 32, "vocab": 512, "steps": 1, "timeout_s": 200,
                          "probe": False, **kw})

    return _runs(request, tmp_path_factory, 4, {
        "moe_ep2": (MOE_EP2, opt(seq_len=64)), "ddp4": (DDP4, opt(micro_batches=2, checkpoint_bytes_per_s=1e9)),
        "moe_dim1": (MOE_DIM1, opt()), "moe_tp2_ep2": (MOE_TP2_EP2, opt())})


@pytest.fixture(scope="session")
def world8_runs(request, tmp_path_factory):
    """The 8-rank ``validate`` runs of every collected module's ``shared_validate_runs()`` that a
    test asks for, in one torchrun launch (tests/validate_runs.py). ``name ->`` (code, results,
    out, folder, stdout)."""
    return _runs(request, tmp_path_factory, 8)


@pytest.fixture(scope="session")
def moe_ep2_fsdp(world4_runs):
    """``validate`` of :data:`MOE_EP2` at world 4 (:func:`world4_runs`), for every test that reads
    its evidence (tests/test_validate_moe.py's collectives, losses and router load,
    tests/test_validate_memory_kinds.py's memory rows by kind). Returns (evidence folder, exit
    code, the worlds' results)."""
    run = world4_runs["moe_ep2"]
    return run.out, run.code, run.results


@pytest.fixture(scope="session")
def ddp4_world4(world4_runs):
    """``validate`` of :data:`DDP4` at world 4 (:func:`world4_runs`), for tests/test_validate_ddp.py
    (collectives, losses) and tests/test_checkpoint_writes.py (DCP bytes per rank): the worker
    saves and loads a DCP checkpoint after the steps of every pp-1 run. Returns (evidence
    folder, exit code, results)."""
    run = world4_runs["ddp4"]
    return run.out, run.code, run.results
