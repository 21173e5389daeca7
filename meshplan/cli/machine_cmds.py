"""catalog, calibrate, bench: the machine's numbers: the built-in catalog with its sources,
alpha-beta fits of nccl-tests runs, and this machine's collectives, GEMMs and attention
measured (torch imported inside the bench commands only)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from meshplan import catalog
from meshplan.cli.common import (
    TOML_ONLY_HELP,
    _echo,
    _exit_infeasible,
    _json_option,
    _refuse_existing,
    _require_torch,
    _write_doc,
    _written,
    _wrote,
)
from meshplan.cli.loading import _load
from meshplan.comm.calibrate import calibrate_runs
from meshplan.comm.calibration import calibration_toml
from meshplan.errors import ConfigError, check_number
from meshplan.fileio import check_destination, write_output
from meshplan.plan import Infeasible, Plan
from meshplan.report.json_docs import bench_attention_doc, bench_comm_doc, bench_gemm_doc, calibrate_doc, catalog_doc
from meshplan.runtime.bench.comm import parse_sizes, run_bench
from meshplan.schedule.workload import plan_step_gemms
from meshplan.units import param_number


def catalog_cmd(kind: str = typer.Argument("model", help="gpu, node, network or model"),
                json_path: Optional[Path] = _json_option("catalog"),
                force: bool = typer.Option(False, "--force", help="replace an existing --json file")):
    """List the built-in catalog entries of KIND: each one's values (scalars, and a table's scalars
    inline; a network's tiers, each value its source does not give marked '(assumed)'), then its sources; a model also its total parameters and, for an MoE model, the active ones (a
    token's: attention, norms, router, top-k routed and shared experts). --json has every field."""

    _refuse_existing(json_path, force, "--json")
    for name in catalog.names(kind):
        entry = catalog.entry(kind, name)
        _echo(f"{name}: {_catalog_values({k: v for k, v in entry.items() if k != 'assumed'})}")
        if kind == "model":
            _echo(f"  params: {_param_words(catalog.model(name))}")
        if kind == "network":
            _echo(f"  tiers: {_tier_words(entry['tiers'], catalog.network_assumed(name))}")
        _echo(f"  source: {entry.get('source', '')}")
    _write_doc(json_path, catalog_doc(kind, {n: catalog.entry(kind, n) for n in catalog.names(kind)}), force)


def _tier_words(tiers: list[dict], assumed: tuple[str, ...]) -> str:
    """A catalog network's tiers, innermost first, each value marked "(assumed)" where the entry
    lists it so (:func:`meshplan.catalog.network_assumed`): ``leaf latency_us 14, oversubscription 1
    (assumed), nodes_per_domain 0 (assumed); ...``."""
    def one(t: dict) -> str:
        return t["name"] + " " + ", ".join(f"{k} {v:g}" + (" (assumed)" if f"{t['name']}.{k}" in assumed else "")
                                           for k, v in t.items() if k != "name")
    return "; ".join(one(t) for t in tiers)


def _param_words(m) -> str:
    """A catalog model's total parameters and, for an MoE model, its active ones with their
    definition (:meth:`~meshplan.spec.model.ModelSpec.active_words`)."""
    return param_number(m.param_count()) + (f"; {m.active_words()}" if m.is_moe else "")


def _catalog_values(entry: dict) -> str:
    """The scalar fields of a catalog entry as ``key value`` (a table of scalars as
    ``key {k v, ...}``, without its source; lists and deeper tables by their length), in the
    catalog's units (named in the keys)."""
    def one(v):
        if isinstance(v, dict):
            inner = [f"{k} {x:g}" if isinstance(x, float) else f"{k} {x}" for k, x in v.items()
                     if not isinstance(x, (dict, list)) and k != "source"]
            return "{" + ", ".join(inner) + "}" if inner else f"({len(v)} entries)"
        if isinstance(v, list):
            return f"({len(v)} entries)"
        return f"{v:g}" if isinstance(v, float) else str(v)
    return "; ".join(f"{k} {one(v)}" for k, v in entry.items() if k != "source")


def calibrate_cmd(logs: list[Path] = typer.Argument(..., metavar="NCCL_TESTS_OUTPUT...",
                                                    help="nccl-tests outputs (stdout text or -J JSON), one run each; FILE:TEST "
                                                         "names the test of a log without nccl-tests' '# Collective test "
                                                         "starting' line for that file alone (old_ag.log:all_gather); on a log "
                                                         "with that line it is noted as unused, or refused where it names "
                                                         "another test"),
                  out: Path = typer.Option(Path("out/calibration.toml"), "--out", help="calibration TOML for --calibration (default under out/)"),
                  link: Optional[str] = typer.Option(None, "--link", help="nvlink, pcie or nic for every file "
                                                     "(default: from the ranks' hosts: one host nvlink, several nic, said in a 'link: nic' line; nic with k ranks per host: busbw / k per NIC, "
                                                     "or / --nics-per-host; all-to-all: busbw x (n - k) / (n - 1), "
                                                     "the share leaving the host; nic leaves a run on one named host nvlink, so 1-node and multi-node logs "
                                                     "go in one call)"),
                  nics_per_host: Optional[int] = typer.Option(None, "--nics-per-host", help="NICs each host's ranks "
                                                              "drive in the log, a divisor of its ranks per host (they "
                                                              "share NICs evenly); default: one per rank; wins over "
                                                              "--system's count"),
                  system: Optional[str] = typer.Option(None, "--system", help="catalog node the runs ran on (e.g. "
                                                       "dgx-h100): without --nics-per-host its NIC count (at most "
                                                       "one per rank) splits a nic run's busbw, and the line-rate "
                                                       "warnings compare its NICs (above the line rate; below half "
                                                       "of it, only with --system); a warning when its GPU is not "
                                                       "the log's"),
                  op: Optional[str] = typer.Option(None, "--op", help="the test that wrote the text logs without "
                                                   "nccl-tests' '# Collective test starting' line (before 2025-06): "
                                                   "alltoall, all_reduce, all_gather, reduce_scatter, sendrecv or "
                                                   "broadcast (with or without _perf), for every such log without "
                                                   "its own FILE:TEST; a log with that line is read by it"),
                  json_path: Optional[Path] = _json_option("calibrate"),
                  force: bool = typer.Option(False, "--force", help="replace existing --out and --json files")):
    """Fit alpha-beta per link class to your nccl-tests runs and write the calibration file, with the GPU model the
    runs name (runs on two GPU models are refused: one calibration file per model). The fit uses both the
    out-of-place and the in-place rows; each measured curve keeps, per size, the slower busbw of the two, since
    torch issues both (in place: DDP's and HSDP's all-reduce, FSDP2's all-gather; out of place: FSDP2's
    reduce-scatter), and a `busbw columns:` line names the column kept at each file's largest size. A line per link
    class says which collectives the file sets, each from a run of its own op: a ring fit (all_reduce_perf,
    all_gather_perf or reduce_scatter_perf: one busbw for the three, nccl-tests doc/PERFORMANCE.md) sets all-reduce,
    all-gather and reduce-scatter; an alltoall_perf run all-to-all; a sendrecv_perf run send/recv; an op no file
    measures keeps the catalog's curve (send/recv beside a ring fit scaled by the measured over the catalog busbw of
    the fitted pattern); on nvlink and pcie an op with a run of its own is timed on that run, the fit setting the
    others; an all-to-all or per-op run at its own fitted alpha. Of several runs per class one fit is kept, whatever
    the files' order: a ring op's, all-reduce first, then the slowest; on nic the ring runs of different ops (one busbw)
    are rivals too, and a 'nic: kept ...; dropped ...' line names each with its fitted busbw per NIC. A text log without nccl-tests' trailer lines (cut off) gets a warning line, and a run
    whose largest size is below alpha x beta / busbw factor of its own fit (latency-bound rows only) sets no bandwidth.
    Every result row must hold nccl-tests' own definitions, algbw = size / time and busbw = algbw x the op's factor
    (doc/PERFORMANCE.md): a log with a row that does not (edited columns, Gb/s written as GB/s) is refused naming
    its line, as is one whose banner names another test than its rows fit. --json lists every file read under
    runs: its fit (per NIC on nic), whether it was kept, dropped (and why) or not used, and the catalog NIC line
    rate it was checked against."""

    fits, notes, sources, curves, nics, runs = calibrate_runs(logs, link, nics_per_host, system, op)  # before --out's errors
    check_destination(out, "--out", force)
    _refuse_existing(json_path, force, "--json")
    source = "; ".join(f"{cls}: {text}" for cls, text in sources.items())  # --json: every class's own
    for line in notes:
        _echo(line)
    _wrote(write_output(out, calibration_toml(fits, sources, curves=curves, nics_per_node=nics), force=force))
    _write_doc(json_path, calibrate_doc(fits, notes, source, str(out), runs), force)


def bench_comm_cmd(nproc: int = typer.Option(4, help="ranks (per node with --testbed)"),
                   sizes: str = typer.Option("1K..64M", help="LO..HI doubling, or a comma list (K/M/G = 2^10/20/30)"),
                   out: Path = typer.Option(Path("out/bench/comm"), help="folder for the nccl-tests text, pairs and calibration.toml"),
                   testbed: Optional[str] = typer.Option(None, help="run on the netns testbed of this prefix"),
                   iters: int = typer.Option(20, help="timed calls per size at most"),
                   budget_s: float = typer.Option(0.2, help="seconds per size, which caps iters"),
                   timeout_s: float = typer.Option(600.0, help="kill the run after this many seconds"),
                   json_path: Optional[Path] = _json_option("bench-comm"),
                   force: bool = typer.Option(False, "--force", help="replace an existing --out folder and --json "
                                                                     "file")):
    """Collectives per link class in nccl-tests columns, alpha-beta fits, and a send/recv matrix. The --out folder
    is built under a temporary name and renamed into place when the run succeeds."""
    _require_torch("bench comm")

    check_number("--timeout-s", timeout_s, 1.0, 86400.0, "s")
    _refuse_existing(json_path, force, "--json")
    size_list = parse_sizes(sizes)
    try:
        fits = run_bench(nproc, size_list, out, testbed=testbed, iters=iters, budget_s=budget_s,
                         timeout_s=timeout_s, echo=_echo, force=force)
    except RuntimeError as e:
        _echo(f"error: {e}", err=True)
        raise typer.Exit(1)
    files = _written(sorted(p for p in out.rglob("*") if p.is_file()))
    _write_doc(json_path, bench_comm_doc(nproc, size_list, testbed, fits, files), force)
    raise typer.Exit(0 if fits else 1)


def _bench_target(config: Path, device: str, dtype: Optional[str], json_path: Optional[Path], force: bool,
                  infeasible_doc) -> tuple[Plan, str, str]:
    """The plan whose local shapes a bench times, the device (``--device``: auto is cuda when
    torch sees one) and the dtype (``--dtype``; default the compute dtype on a GPU, fp32 on the
    CPU). A mesh that does not resolve writes ``infeasible_doc(plan)`` to ``--json`` and exits 1
    with its reasons."""
    from meshplan.runtime.bench.gemm import resolve_device

    p = _load(config)
    if isinstance(p, Infeasible):
        _write_doc(json_path, infeasible_doc(p), force)
        _exit_infeasible(p)
    device = resolve_device(device)
    dt = dtype or (p.config.training.compute_dtype if device == "cuda" else "fp32")
    if dt not in ("fp32", "bf16", "fp16"):
        raise ConfigError("--dtype", f"{dt!r}; use fp32, bf16 or fp16")
    if device == "cpu":
        _echo(cpu_headline(dt))
    return p, device, dt


def cpu_headline(dtype: str) -> str:
    """What a bench on the CPU measures (said first: its rows are not a GPU's)."""
    from meshplan.runtime.bench.gemm import device_name

    return (f"no GPU: timing on the CPU, {device_name('cpu')}, {dtype}; the table describes this CPU, not "
            f"the plan's GPU, and --gemm-table with it predicts this CPU's compute")


GRID_HELP = ("sweep the catalog's grid for the plan's GPU (a default grid without catalog data) and write a "
             "kernels.toml fragment (default --out out/bench/<gemm|attention>.toml); on the CPU only with --device "
             "cpu: a tiny grid keyed [gpu.cpu]")


def _check_grid_device(grid: bool, device: str) -> None:
    """``--grid`` without a GPU (``--device auto`` resolving to the CPU) is a ConfigError: its
    sweep would time the CPU, which only ``--device cpu`` asks for (then keyed ``[gpu.cpu]``,
    :func:`meshplan.runtime.bench.grid.run_grid`)."""
    from meshplan.runtime.bench.gemm import resolve_device

    if grid and device == "auto" and resolve_device(device) == "cpu":
        raise ConfigError("--grid", "no GPU here, so the sweep would time the CPU, not the plan's GPU; run it on the "
                                    "GPU, or pass --device cpu for a CPU table keyed [gpu.cpu]")


def _grid_out(out: Path, kind: str, p: Plan, device: str, dtype: str, force: bool, repeats: int = 5) -> Path:
    """Run a ``--grid`` sweep (:func:`meshplan.runtime.bench.grid.run_grid`); the file written."""
    from meshplan.runtime.bench.grid import run_grid

    if out in (Path("out/bench/gemm.csv"), Path("out/bench/attention.json")):  # the default --out
        out = out.with_suffix(".toml")
    check_destination(out, "--out", force)
    path, lines = run_grid(kind, p.config.cluster.gpu.name, dtype, device, out, force=force, repeats=repeats)
    for line in lines:
        _echo(line)
    _wrote(path)
    return path


def bench_gemm(config: Path = typer.Argument(..., help=TOML_ONLY_HELP + "; its local GEMM shapes are timed"),
               out: Path = typer.Option(Path("out/bench/gemm.csv"), "--out", help="CSV table for --gemm-table, or "
                                        "with --grid a kernels.toml fragment (default with --grid out/bench/gemm.toml; "
                                        "both under out/, which git ignores)"),
               device: str = typer.Option("auto", "--device", help="cpu, cuda or auto (cuda when present)"),
               dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32, bf16 or fp16 (default: compute dtype "
                                                   "on a GPU, fp32 on the CPU)"),
               max_elements: Optional[int] = typer.Option(None, "--max-elements",
                                                          help="scale M down so an operand has at most this many "
                                                               "elements (default 2**22 on the CPU, none on a GPU)"),
               grid: bool = typer.Option(False, "--grid", help=GRID_HELP),
               json_path: Optional[Path] = _json_option("bench-gemm"),
               force: bool = typer.Option(False, "--force", help="replace existing --out and --json files")):
    """Time the plan's local GEMM shapes as the step model times them (forward and backward; framework megatron's
    Q, K and V as one fused GEMM) and write the efficiency table
    (--grid: the catalog's (M, N, K) points for the plan's GPU, written in kernels.toml form)."""
    _require_torch("bench gemm")
    from meshplan.runtime.bench.gemm import bench, write_table

    if max_elements is not None:
        check_number("--max-elements", max_elements, 1, 1 << 40)
        if grid:
            raise ConfigError("--max-elements", "the --grid points run at their own size; drop one of the two")
    check_destination(out, "--out", force)
    _refuse_existing(json_path, force, "--json")
    _check_grid_device(grid, device)
    p, device, dt = _bench_target(config, device, dtype, json_path, force,
                                  lambda p: bench_gemm_doc(p, [], device, dtype or "", []))
    if grid:
        out = _grid_out(out, "gemm", p, device, dt, force)
        _write_doc(json_path, bench_gemm_doc(p, [], device, dt, _written([out])), force)
        return
    limit = max_elements if max_elements is not None else (2 ** 22 if device == "cpu" else None)
    rows = bench(plan_step_gemms(p), dtype=dt, device=device, max_elements=limit)
    _echo(f"{'M':>7} {'N':>7} {'K':>7} {'dtype':>5} {'time (us)':>11} {'TFLOP/s':>8}  device")
    for r in rows:
        scaled = f" (run at M {r.scaled_m})" if r.scaled_m != r.gemm.m else ""
        _echo(f"{r.gemm.m:7d} {r.gemm.n:7d} {r.gemm.k:7d} {r.dtype:>5} {r.seconds * 1e6:11.1f} "
                   f"{r.tflops:8.2f}  {r.device}{scaled}")
    _wrote(write_table(rows, out, force=force))
    _write_doc(json_path, bench_gemm_doc(p, rows, device, dt, _written([out])), force)


def bench_attention(config: Path = typer.Argument(..., help=TOML_ONLY_HELP + "; its local attention is timed"),
                    out: Path = typer.Option(Path("out/bench/attention.json"), "--out", help="JSON table for "
                                             "--gemm-table, or with --grid a kernels.toml fragment (default with "
                                             "--grid out/bench/attention.toml; both under out/, which git ignores)"),
                    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto (cuda when present)"),
                    dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32, bf16 or fp16 (default: compute "
                                                        "dtype on a GPU, fp32 on the CPU)"),
                    with_gemm: Optional[Path] = typer.Option(None, "--with-gemm", help="a `bench gemm` table whose "
                                                             "rows are written into --out too (one file for step)"),
                    repeats: int = typer.Option(5, "--repeats", help="timed calls (median)"),
                    grid: bool = typer.Option(False, "--grid", help=GRID_HELP),
                    json_path: Optional[Path] = _json_option("bench-attention"),
                    force: bool = typer.Option(False, "--force", help="replace existing --out and --json files")):
    """Time the plan's local attention (torch SDPA, forward and backward) and write the table --gemm-table reads
    (--grid: the catalog's head dims and lengths for the plan's GPU, causal and not, in kernels.toml form)."""
    _require_torch("bench attention")
    from meshplan.runtime.bench.attention import bench_plan, gemm_rows, write_table

    check_number("--repeats", repeats, 1, 10_000)
    check_destination(out, "--out", force)
    _refuse_existing(json_path, force, "--json")
    _check_grid_device(grid, device)
    p, device, dt = _bench_target(config, device, dtype, json_path, force,
                                  lambda p: bench_attention_doc(p, None, []))
    if grid:
        out = _grid_out(out, "attention", p, device, dt, force, repeats)
        _write_doc(json_path, bench_attention_doc(p, None, _written([out])), force)
        return
    r = bench_plan(p, dt, device, repeats=repeats)
    fwd_flops = 2.0 * r["batch"] * r["q_heads"] * r["seq_q"] * r["seq_kv"] * r["head_dim"]  # causal half
    _echo(f"attention b {r['batch']} heads {r['q_heads']} (kv {r['kv_heads']}) s_q {r['seq_q']} s_kv "
               f"{r['seq_kv']} d {r['head_dim']} {dt}: forward {r['forward_s'] * 1e6:.1f} us "
               f"({fwd_flops / r['forward_s'] / 1e12:.3f} TFLOP/s), backward {r['backward_s'] * 1e6:.1f} us "
               f"({2.5 * fwd_flops / r['backward_s'] / 1e12:.3f} TFLOP/s; flash-attention FLOP convention)  "
               f"{r['device']}")
    rows = (gemm_rows(with_gemm) if with_gemm else []) + [r]
    _wrote(write_table(rows, out, force=force))
    _write_doc(json_path, bench_attention_doc(p, r, _written([out])), force)
