"""Several tests' ``meshplan validate`` runs sharing one torchrun launch per world size
(:func:`meshplan.runtime.validation.batch.validate_batch`).

A 4-rank launch costs 10-15 s of start-up on 2 cores (torchrun's agent and every worker import
torch, then the rendezvous), an 8-rank one 20-30 s, before the first step; the configs a test
file checks run in one launch from a module-scoped fixture, each into its own evidence folder,
which every test reads as it read its own ``validate`` run's (same files, same comparison).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from meshplan.config import Config, load_config


def launch(root: Path, runs: dict) -> dict[str, SimpleNamespace]:
    """``name -> (config or its path, Options)`` run as one launch per world; ``name ->``
    namespace of ``code`` (validate's exit code), ``results`` (its per-world list), ``out`` (the
    evidence folder ``root/name``) and ``folder`` (``out/world<W>``)."""
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
        for name, (code, results) in zip(names, validate_batch(jobs, echo=lambda *_: None)):
            done[name] = SimpleNamespace(code=code, results=results, out=root / name,
                                         folder=root / name / f"world{world}")
    return done
