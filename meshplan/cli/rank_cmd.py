"""bench rank: one rank of a planned mesh on this machine's device (real kernels and memory for
its local shapes, torch's fake process group for the collectives, a few layers), its per-layer
times and peak memory against the plan's (:mod:`meshplan.runtime.validation.one_rank`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer

from meshplan.cli.common import (TOML_ONLY_HELP, _echo, _json_option, _refuse_existing, _require_torch,
                                 _write_doc, _written, _wrote)
from meshplan.cli.loading import _load
from meshplan.compute.kernel_fragment import with_kernel_files
from meshplan.compute.rate_check import kernel_file_rates
from meshplan.config import config_from_dict
from meshplan.config_toml import parse_toml
from meshplan.errors import ConfigError, check_number
from meshplan.fileio import check_destination, write_output
from meshplan.fileread import read_text_limited
from meshplan.limits import FILE_BYTES
from meshplan.report.json_docs import bench_rank_doc
from meshplan.runtime.validation.host_pace import host_table
from meshplan.runtime.validation.one_rank_plan import reduced_data


def bench_rank(config: Path = typer.Argument(..., help=TOML_ONLY_HELP + "; one rank of its mesh is run"),
               layers: int = typer.Option(2, "--layers", help="transformer layers run (the model's first N)"),
               rank: int = typer.Option(0, "--rank", help="the rank run (its local shapes; ranks of one mesh "
                                                          "have the same shapes unless pp splits layers unevenly)"),
               device: str = typer.Option("auto", "--device", help="cpu, cuda or auto (cuda when present)"),
               system: Optional[str] = typer.Option(None, "--system", help="catalog node type the prediction uses "
                                                    "(default: the local GPU's, e.g. dgx-h200 on an H200; on the "
                                                    "CPU or an unknown GPU, the config's)"),
               steps: int = typer.Option(3, "--steps", help="timed steps (median), after --warmup untimed ones"),
               warmup: int = typer.Option(2, "--warmup", help="untimed steps first"),
               out: Path = typer.Option(Path("out/bench/rank.json"), "--out", help="evidence JSON (default under "
                                        "out/, which git ignores)"),
               kernels: Optional[list[Path]] = typer.Option(None, "--kernels", metavar="FILE", help="measured "
                                                            "kernel table (as for step) for the GPU the run is "
                                                            "predicted for (--system's), laid over the catalog's "
                                                            "for the prediction, its [host] pace too; repeatable"),
               kernels_out: Optional[Path] = typer.Option(None, "--kernels-out", help="write a kernels file "
                                                          "(--kernels) whose [host] table is this run's eager "
                                                          "DTensor TP pace per block, when both passes ran at the "
                                                          "host's pace (GPU only)"),
               json_path: Optional[Path] = _json_option("bench-rank"),
               force: bool = typer.Option(False, "--force", help="replace existing --out, --kernels-out and --json "
                                                                 "files")):
    """Run one rank of the mesh on this device (the other ranks stood in for by torch's fake process group: no
    communication) for a few layers, and set its per-layer forward and backward times and peak memory beside
    the plan's (on a GPU also the peak less what the run holds between steps beyond the plan's cuBLAS
    workspace). The pipeline axis is dropped (a stage's local shapes do not depend on pp) and the step is one
    micro-batch. --kernels: measured kernel files for the local GPU laid over the catalog's for the prediction
    (a [host] table's pace too). With --kernels-out, a kernels file for --kernels whose [host] table is the host's
    pace per block (meshplan.runtime.validation.host_pace), or a line saying why none was written. Exit 0 when it
    ran (the errors are reported, not gated)."""
    _require_torch("bench rank")
    from meshplan.runtime.bench.gemm import resolve_device
    from meshplan.runtime.validation.one_rank import local_system, run, summary

    for name, v, lo, hi in (("--layers", layers, 1, 1024), ("--steps", steps, 1, 1000), ("--warmup", warmup, 0, 1000)):
        check_number(name, v, lo, hi)
    _load(config)  # the config's own errors first, as plan reports them
    check_destination(out, "--out", force)
    _refuse_existing(json_path, force, "--json")
    dev = resolve_device(device)
    if kernels_out is not None:
        if dev == "cpu":
            raise ConfigError("--kernels-out", "the device is the CPU: its blocks' times are not a GPU host's pace; "
                                               "run bench rank on the GPU (--device cuda)")
        check_destination(kernels_out, "--kernels-out", force)
    data = parse_toml(read_text_limited(config, "config", FILE_BYTES["config"], "give a TOML config"), str(config))
    target = system or local_system(dev)
    reduced = reduced_data(data, layers, target)
    world = math.prod(reduced["mesh"]["shape"])
    gpu, warns = with_kernel_files(config_from_dict(reduced).cluster.gpu, kernels or [])  # checked before the run
    for w in warns + kernel_file_rates(gpu, gpu.kernels):
        _echo(f"warning: {w}", err=True)
    check_number("--rank", rank, 0, world - 1)
    if dev == "cpu":
        _echo("no GPU: the run's times are this CPU's, set beside the plan's GPU; memory is not measured")
    if any(n == "pp" for n in data.get("mesh", {}).get("names", [])):
        _echo("note: pp dropped for the run: a stage's local shapes do not depend on pp")
    ev = run(data, layers=layers, rank=rank, device=dev, system=target, warmup=warmup, steps=steps,
             kernels=tuple(kernels or ()))
    ev["config"] = str(config)
    _echo(summary(ev))
    _wrote(write_output(out, json.dumps(ev, indent=1) + "\n", force=force, field="--out"))
    if kernels_out is not None:
        _write_host_pace(ev, dev, kernels_out, force)
    _write_doc(json_path, bench_rank_doc(ev, _written([out])), force)


def _write_host_pace(ev: dict, device: str, path: Path, force: bool) -> None:
    """``--kernels-out``: the run's ``[host]`` table (:func:`meshplan.runtime.validation.host_pace.host_table`)
    as a kernels file keyed by the GPU the run was predicted for, or the line saying why not."""
    from meshplan.runtime.bench.grid import fragment_toml, source_line

    table, line = host_table([ev])
    if table is None:
        _echo(f"--kernels-out: not written: {line}")
        return
    _echo(line)
    text = fragment_toml(ev["gpu_catalog"], source_line("rank", device), host=table)
    _wrote(write_output(path, text, force=force, field="--kernels-out"))


__all__ = ["bench_rank"]
