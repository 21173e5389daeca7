"""Several tests' ``meshplan validate`` runs sharing one torchrun launch per world size
(:func:`meshplan.runtime.validation.batch.validate_batch`).

A 4-rank launch costs 10-15 s of start-up on 2 cores (torchrun's agent and every worker import
torch, then the rendezvous), an 8-rank one 20-30 s, before the first step. Every test module
that reads validate runs defines ``shared_validate_runs()`` (``name -> (config or its path,
Options)``); the session fixtures ``world2_runs``, ``world4_runs`` and ``world8_runs``
(tests/conftest.py, :func:`shared`) run the runs of their world of every collected module that
asks for them in one launch, each into its own evidence folder, which every test reads as it
read its own ``validate`` run's (same files, same comparison). Running one file launches only
its own runs; the whole suite one launch per world. What the shared launch changes: a job that
fails stops the jobs after it (they report that they did not start), and ``torchrun.log`` is
the launch's.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from meshplan.config import Config, load_config


def launch(root: Path, runs: dict) -> dict[str, SimpleNamespace]:
    """``name -> (config or its path, Options)`` run as one launch per world; ``name ->``
    namespace of ``code`` (validate's exit code), ``results`` (its per-world list), ``out`` (the
    evidence folder ``root/name``), ``folder`` (``out/world<W>``) and ``stdout`` (the lines
    ``validate`` prints for it, each ending in a newline)."""
    from meshplan.runtime.validation.batch import validate_batch

    by_world: dict[int, list[str]] = {}
    for name, (_, opt) in runs.items():
        by_world.setdefault(opt.worlds[0], []).append(name)
    done = {}
    for world, names in by_world.items():
        jobs = []
        for name in names:
            config, opt = runs[name]
            jobs.append((config if isinstance(config, Config) else load_config(config), opt, root / name))
        lines: list[list[str]] = [[] for _ in names]
        echoes = [lambda *a, out=out: out.append(" ".join(map(str, a)) + "\n") for out in lines]
        for name, (code, results), said in zip(names, validate_batch(jobs, echo=echoes), lines):
            done[name] = SimpleNamespace(code=code, results=results, out=root / name,
                                         folder=root / name / f"world{world}", stdout="".join(said))
    return done


#: Time limit of a test that reads a shared launch (tests/conftest.py sets it on every such test):
#: the first to ask waits for the whole launch (the world-4 one, 23 configs: 5-8 min on 2 shared cores).
SHARED_TIMEOUT_S = 1500


def shared(request, root: Path, world: int, always: dict | None = None) -> dict[str, SimpleNamespace]:
    """:func:`launch` of ``always`` and of the ``shared_validate_runs()`` of this ``world`` (its
    Options' first world) of every collected module with a test that asks for
    ``world<W>_runs`` (directly or through another fixture), in collection order. A name given
    twice is an error naming both modules."""
    runs: dict = dict(always or {})
    owner = {name: "tests/conftest.py" for name in runs}
    modules: list = []
    for item in request.session.items:
        if f"world{world}_runs" in getattr(item, "fixturenames", ()) and item.module not in modules:
            modules.append(item.module)
    for module in modules:
        for name, run in getattr(module, "shared_validate_runs", dict)().items():
            if run[1].worlds[0] != world:
                continue
            if name in runs:
                pytest.fail(f"shared validate run {name!r} of {module.__name__} is also {owner[name]}'s")
            runs[name], owner[name] = run, module.__name__
    return launch(root, runs)
