"""validate, validate-slice, testbed: meshes run for real (torchrun, imported by the runtime
only when a run starts) on this host, on several hosts or on the netns testbed, and the
testbed brought up and down."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from meshplan.cli.common import TOML_ONLY_HELP, _json_option, _refuse_existing, _require_torch, _write_doc
from meshplan.errors import ConfigError, check_number
from meshplan.limits import MAX_MICRO_BATCHES
from meshplan.report.json_docs import testbed_down_doc, testbed_up_doc, validate_doc, validate_slice_doc
from meshplan.runtime.testbed.netns import main_down, main_up
from meshplan.runtime.validation.coverage import everywhere
from meshplan.runtime.validation.slice import MARKER as SLICE_MARKER, main as slice_main
from meshplan.runtime.validation.validate import Options, main as validate_main


def validate(config: Path = typer.Argument(..., help=TOML_ONLY_HELP + "; its mesh is scaled to each world size"),
             worlds: str = typer.Option("2,4", "--worlds", help="world sizes run in this order, e.g. 2,4,8; each "
                                        "re-sizes only the outermost data axis (ep, etp, tp, cp, pp keep theirs)"),
             layers: int = typer.Option(2, "--layers", help="layers of the scaled-down model (an explicit "
                                        "mesh.pp_layer_split is rescaled to them in proportion, each entry >= 1)"),
             hidden_div: Optional[int] = typer.Option(None, "--hidden-div",
                                                     help="divide hidden, head_dim, ffn by N (default: to <= 256)"),
             seq_len: int = typer.Option(64, "--seq-len", help="tokens per sequence in the run"),
             vocab: int = typer.Option(512, "--vocab", help="vocabulary of the scaled-down model"),
             steps: int = typer.Option(3, "--steps", help="timed steps (after a recorded and a memory step)"),
             micro_batches: Optional[int] = typer.Option(
                 None, "--micro-batches", help="micro-batches per step of each data-parallel rank (default: the "
                                               "fewest the pipeline schedule runs, e.g. pp for 1F1B, 2 pp for "
                                               "DualPipeV; 1 without pp)"),
             out: Path = typer.Option(Path("out/validate"), "--out", help="evidence folder (default under out/; its "
                                                                          "missing parent folders are made)"),
             timeout_s: Optional[float] = typer.Option(None, "--timeout-s", help="wall-clock limit per world size "
                                                        "(default 120 s, x world / (4 x cores) past 4 ranks per core)"),
             tolerance: Optional[float] = typer.Option(None, "--tolerance",
                                                      help="fail when step time (calibrated when probed) or peak "
                                                           "memory is off by more than this fraction, e.g. 0.5; "
                                                           "default: report them without failing"),
             testbed: Optional[str] = typer.Option(None, "--testbed",
                                                   help="prefix of a `meshplan testbed up` cluster to run across"),
             probe: bool = typer.Option(True, "--probe/--no-probe",
                                        help="after the steps, time each of the plan's collectives under the run's "
                                             "load and re-predict the step with those times (calibrated rows), then "
                                             "each axis's message curve, 1 KiB..4 MiB (staged evidence)"),
             nnodes: int = typer.Option(1, "--nnodes", help="hosts of a multi-host run: run the same command on "
                                                            "each with its --node-rank (W / nnodes ranks per host)"),
             node_rank: int = typer.Option(0, "--node-rank", help="this host's node: it runs ranks K x W/nnodes "
                                                                  "onwards (static rendezvous, as launch's "
                                                                  "torchrun.sh; 0 hosts it and writes the evidence)"),
             rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint",
                                                         help="HOST:PORT of node 0 for the static rendezvous (same on "
                                                              "every host; --out must be a folder all hosts share)"),
             local_addr: Optional[str] = typer.Option(None, "--local-addr",
                                                      help="this host's address the others reach (torchrun "
                                                           "--local-addr), when its FQDN does not resolve there"),
             checkpoint_gbps: Optional[float] = typer.Option(
                 None, "--checkpoint-gbps", help="storage bandwidth of one rank, GB/s: predicts the DCP save and "
                                                 "load times measured after the steps (bytes per rank are "
                                                 "predicted without it)"),
             json_path: Optional[Path] = _json_option("validate"),
             force: bool = typer.Option(False, "--force", help="replace an existing evidence folder and --json "
                                                                "file")):
    """Run the mesh for real (torchrun: NCCL on the GPUs when CUDA is present, else gloo on CPU) and compare
    collectives, times, memory, checkpoint (DCP) writes and, under pp, each rank's pipeline op order (F, B,
    I, W) with the plan; one host, the netns testbed, or
    several hosts (--nnodes/--node-rank/--rdzv-endpoint). An axis of the config that a world runs at degree 1
    is named ("not exercised: ...", with the world that runs it); it does not change the verdict. Every reason
    it refuses to run (a world size, a mesh the runtime does not build) is printed before anything runs, one
    error line each, with a fix the other checks accept."""
    _require_torch("validate")

    try:
        sizes = tuple(int(w) for w in worlds.split(","))
    except ValueError:
        raise ConfigError("--worlds", f"{worlds!r}: give comma-separated integers, e.g. 2,4,8") from None
    for w in sizes:
        check_number("--worlds", w, 1, 4096, "ranks")
    _check_run_options(layers, seq_len, vocab, steps, hidden_div, timeout_s, tolerance)
    if checkpoint_gbps is not None:
        check_number("--checkpoint-gbps", checkpoint_gbps, 1e-3, 1e6, "GB/s")
    if micro_batches is not None:
        check_number("--micro-batches", micro_batches, 1, MAX_MICRO_BATCHES)
    opt = Options(worlds=sizes, layers=layers, hidden_div=hidden_div, seq_len=seq_len, vocab=vocab, steps=steps,
                  micro_batches=micro_batches,
                  timeout_s=timeout_s, tolerance=tolerance, testbed=testbed, probe=probe, nnodes=nnodes,
                  node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, local_addr=local_addr,
                  checkpoint_bytes_per_s=checkpoint_gbps * 1e9 if checkpoint_gbps else None)
    _refuse_existing(json_path, force, "--json")
    code, results = validate_main(str(config), opt, out, force)
    gaps = [g["line"] for g in everywhere(results)]
    _write_doc(json_path, validate_doc(str(config), code, results, str(out), node_rank, gaps), force)
    raise typer.Exit(code)


def _check_run_options(layers: int, seq_len: int, vocab: int, steps: int, hidden_div: Optional[int],
                       timeout_s: Optional[float], tolerance: Optional[float]) -> None:
    """The scaled-down run's options of validate and validate-slice, checked as fields (one-line
    error naming the option): whole numbers in range, finite times and tolerance."""
    for name, v, lo, hi in (("--layers", layers, 1, 1024), ("--seq-len", seq_len, 1, 1 << 20),
                            ("--vocab", vocab, 1, 1 << 24), ("--steps", steps, 1, 10_000)):
        check_number(name, v, lo, hi)
    if hidden_div is not None:
        check_number("--hidden-div", hidden_div, 1, 1 << 20)
    if timeout_s is not None:
        check_number("--timeout-s", timeout_s, 1.0, 86400.0, "s")
    if tolerance is not None:
        check_number("--tolerance", tolerance, 1e-6, 1e6, "(fraction)")


def validate_slice(configs: list[Path] = typer.Argument(..., help="TOML configs of one workload, one mesh each"),
                   testbed: str = typer.Option(..., "--testbed", help="prefix of a `meshplan testbed up` cluster"),
                   world: int = typer.Option(8, "--world", help="ranks per mesh (nodes x ranks per node)"),
                   layers: int = typer.Option(2, "--layers", help="layers of the scaled-down model (an explicit "
                                              "mesh.pp_layer_split is rescaled to them in proportion)"),
                   hidden_div: int = typer.Option(64, "--hidden-div", help="divide hidden, head_dim, ffn by N"),
                   seq_len: int = typer.Option(512, "--seq-len", help="tokens per sequence in the run"),
                   vocab: int = typer.Option(128, "--vocab", help="vocabulary of the scaled-down model"),
                   steps: int = typer.Option(3, "--steps", help="timed steps per mesh"),
                   timeout_s: float = typer.Option(120.0, "--timeout-s", help="wall-clock limit per mesh"),
                   out: Path = typer.Option(Path("out/validate-slice"), "--out",
                                            help="evidence folder (default under out/; its missing parent folders "
                                                 "are made)"),
                   json_path: Optional[Path] = _json_option("validate-slice"),
                   force: bool = typer.Option(False, "--force", help="replace an existing slice folder and --json "
                                                                     "file")):
    """Run several meshes on the testbed; order measured step times against predicted; choose the measured fastest
    of those whose own plan fits at full scale; keep each in OUT/<config stem>-<chosen|rejected>/ with why."""
    _require_torch("validate-slice")
    _check_run_options(layers, seq_len, vocab, steps, hidden_div, timeout_s, None)
    check_number("--world", world, 1, 4096)

    opt = Options(worlds=(world,), layers=layers, hidden_div=hidden_div, seq_len=seq_len, vocab=vocab,
                  steps=steps, timeout_s=timeout_s, testbed=testbed)
    _refuse_existing(json_path, force, "--json")
    code = slice_main([str(c) for c in configs], testbed, out, opt, force)
    if json_path:
        evidence = json.loads((out / SLICE_MARKER).read_text(encoding="utf-8"))
        _write_doc(json_path, validate_slice_doc(evidence, code, str(out)), force)
    raise typer.Exit(code)


def testbed_up_cmd(nodes: int = typer.Option(2, help="emulated nodes (one network namespace each)"),
                   nics: int = typer.Option(2, help="NICs per node (one rail bridge each)"),
                   rate_mbit: float = typer.Option(200.0, help="tbf rate limit per NIC, Mbit/s"),
                   prefix: str = typer.Option("t", help="name prefix of the namespaces"),
                   json_path: Optional[Path] = _json_option("testbed-up"),
                   force: bool = typer.Option(False, "--force", help="replace an existing --json file")):
    """Create one namespace per node, one rate-limited interface per NIC (10.77.RAIL.NODE+1), a bridge
    per rail and a spine between the rails (gateway 10.77.RAIL.254): traffic from a NIC's address leaves
    by that NIC, to another rail through the spine."""

    _refuse_existing(json_path, force, "--json")
    code, tb = main_up(nodes, nics, rate_mbit, prefix=prefix)
    if tb is not None:
        _write_doc(json_path, testbed_up_doc(tb), force)
    raise typer.Exit(code)


def testbed_down_cmd(prefix: str = typer.Option("t", help="name prefix given to up"),
                     json_path: Optional[Path] = _json_option("testbed-down"),
                     force: bool = typer.Option(False, "--force", help="replace an existing --json file")):
    """Remove every namespace, interface, bridge and process of the testbed PREFIX."""

    _refuse_existing(json_path, force, "--json")
    code, removed = main_down(prefix=prefix)
    if code == 0:
        _write_doc(json_path, testbed_down_doc(prefix, removed), force)
    raise typer.Exit(code)
