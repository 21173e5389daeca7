"""Several ``validate`` runs of one world size in one torchrun launch.

Each launch of :func:`meshplan.runtime.validation.validate.validate` starts torchrun's agent and
``W`` workers, each importing torch, and a rendezvous: on 2 CPU cores about 10-15 s of
start-up before the first step, the same for every config. :func:`validate_batch` runs a list
of ``(config, Options, OUT)`` of the same world as one launch: each config is scaled, planned
and its GEMMs timed as ``validate`` does (:func:`~meshplan.runtime.validation.validate.prepare_world`),
the workers run the plans in turn on one process group (the worker's ``--jobs``,
:func:`meshplan.runtime.execution.worker.parse_jobs`; each job builds its own DeviceMesh, model
and optimizer from its seed), then each config is compared and its evidence folder written
exactly as ``validate`` writes it (:func:`~meshplan.runtime.validation.validate.finish_world`).

What differs from one ``validate`` per config: ``torchrun.log`` (in every folder) is the
shared launch's; ``elapsed_s`` and the host record (load before and after) cover the whole
launch; a job whose every rank wrote ``done`` counts as run even when a later job of the
launch failed (the failed job, and those after it, which never started, get the fault
report). Faults (``fail_rank``, ``hang_rank``), ``testbed`` and multi-host runs are refused:
they are what one launch per config is for.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from meshplan.config import Config
from meshplan.errors import ConfigError, ConfigErrors
from meshplan.runtime.execution.launch import run_torchrun
from meshplan.runtime.validation import host
from meshplan.runtime.validation.coverage import not_exercised
from meshplan.runtime.validation.options import Options
from meshplan.runtime.validation.refusals import refusals
from meshplan.runtime.validation.validate import (Prepared, _pythonpath, _run_worlds, finish_world, prepare_out,
                                                  prepare_world)
from meshplan.fileio import staged_folder

Job = tuple[Config, Options, Path]


def check_batch(jobs: Sequence[Job]) -> int:
    """The one world every job runs (ConfigError naming the field otherwise): one world per
    job, the same for all, no fault injection, testbed or multi-host run."""
    if not jobs:
        raise ConfigError("jobs", "give at least one (config, Options, out)")
    worlds = {opt.worlds for _, opt, _ in jobs}
    if len(worlds) != 1 or len(next(iter(worlds))) != 1:
        raise ConfigError("worlds", f"{sorted(worlds)}: every job of one launch runs the same single world")
    for _, opt, _ in jobs:
        if opt.fail_rank >= 0 or opt.hang_rank >= 0 or opt.testbed or opt.rendezvous is not None:
            raise ConfigError("fail_rank/hang_rank/testbed/nnodes", "run faults, testbeds and multi-host runs with "
                              "validate, one launch each")
    return next(iter(worlds))[0]


def validate_batch(jobs: Sequence[Job], force: bool = False, echo=print) -> list[tuple[int, list[dict]]]:
    """Per job, ``validate(config, opt, out, force)``'s (exit code, per-world results), the
    jobs' workers sharing one torchrun launch (module docstring); limit: the jobs' wall-clock
    limits (``Prepared.limit_s``: ``timeout_s``, or its default scaled with the ranks per core) summed.
    ``echo``: where the console lines go, one callable for all jobs or a list of one per job
    (each job's lines as its own ``validate`` prints them)."""
    world = check_batch(jobs)
    echoes = list(echo) if isinstance(echo, (list, tuple)) else [echo] * len(jobs)
    for config, opt, out in jobs:
        errors = refusals(config, opt)
        if errors:
            raise ConfigErrors(errors)
        prepare_out(out, force)
    with contextlib.ExitStack() as stack:
        tmps = [stack.enter_context(staged_folder(out, "--out", force, create_folders=True)) for _, _, out in jobs]
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="meshplan-batch-")))
        preps = []
        for (config, opt, _), tmp, say in zip(jobs, tmps, echoes):
            folder = tmp / f"world{world}"
            folder.mkdir(parents=True, exist_ok=True)
            preps.append(prepare_world(config, world, opt, folder, folder, say))
        results = _launch(preps, [opt for _, opt, _ in jobs], world, work)
        return [_run_worlds(config, opt, tmp, say, run_one=_given(result))
                for (config, opt, _), tmp, result, say in zip(jobs, tmps, results, echoes)]


def _launch(preps: list, opts: list[Options], world: int, work: Path) -> list[dict]:
    """One torchrun of every prepared job (the others' result dicts pass through); each job's
    result (:func:`~meshplan.runtime.validation.validate.finish_world`), ``torchrun.log`` copied into its folder."""
    ready = [(p, o) for p, o in zip(preps, opts) if isinstance(p, Prepared)]
    if not ready:
        return preps
    (work / "jobs.json").write_text(json.dumps([p.argv[1:] for p, _ in ready]))
    before = host.state()
    outcome = run_torchrun(world, ["meshplan.runtime.execution.worker", "--jobs", str(work / "jobs.json")],
                           work / "torchrun.log", sum(p.limit_s for p, _ in ready),
                           env={"PYTHONPATH": _pythonpath()})
    done = {}
    for p, o in ready:
        shutil.copyfile(work / "torchrun.log", p.folder / "torchrun.log")
        ran = _all_done(p.folder, world)  # this job finished on every rank: a later job's failure is not its own
        done[id(p)] = finish_world(p, o, replace(outcome, returncode=0, timed_out=False) if ran else outcome, before)
    return [done.get(id(p), p) for p in preps]


def _all_done(folder: Path, world: int) -> bool:
    try:
        return all(json.loads((folder / f"rank{r}" / "status.json").read_text()).get("state") == "done"
                   for r in range(world))
    except (OSError, ValueError):
        return False


def _given(result: dict):
    """A ``run_one`` for :func:`~meshplan.runtime.validation.validate._run_worlds` returning the
    launched ``result`` (with its ``not_exercised``, as :func:`~meshplan.runtime.validation.validate.run_world` adds)."""
    def run_one(config: Config, world: int, opt: Options, out: Path, echo) -> dict:
        return {**result, "not_exercised": not_exercised(config, world, opt)}
    return run_one
