"""``meshplan bench comm``: measure collectives and pairwise send/recv on the machine at hand
(or on the netns testbed), print them in nccl-tests' format, fit alpha and beta per link
class and write a calibration file meshplan reads (:mod:`meshplan.comm.calibration`).

Flow: :func:`run_bench` launches :mod:`meshplan.runtime.bench.comm_worker` with torchrun
(``--standalone``: a free port; or one torchrun per testbed node namespace), the worker's
rank 0 writes ``raw.json``; then :func:`~meshplan.runtime.bench.comm_results.write_results` writes,
atomically, into ``--out``:

- ``<test>.<link>.txt``: nccl-tests text (``all_reduce_perf.nvlink.txt``...), one row per
  size with nccl-tests' columns size (B), count (elements), type, redop, root, time (us),
  algbw (GB/s), busbw (GB/s), #wrong. One measurement per row: torch's ``all_reduce`` works
  in place, the other collectives out of place, so the in-place block is not printed.
  ``busbw = algbw * busbw_factor(op, n)`` (nccl-tests doc/PERFORMANCE.md; :mod:`meshplan.comm.alphabeta`).
- ``calibration.toml``: alpha-beta per link class fitted with
  :func:`meshplan.comm.linkfit.fit_alpha_beta` on the all-reduce rows read back from the text
  files, beta from a knee up when the times jump (:func:`~meshplan.runtime.bench.comm_results.fit_link`)
  (the other ops' fits are printed).
- ``pairs.txt`` / ``pairs.json``: one-way send/recv bandwidth between every two ranks (GB/s),
  the fast domains it shows and whether they agree with the node placement.

Link classes (calibration's names): ``nvlink`` = the node's internal fabric (on a CPU
machine: loopback TCP through gloo, labelled so in the text files, the notes and
``calibration.toml``'s ``backend = "gloo"``, which only a gloo cluster accepts), ``nic`` = one rank per node across the testbed's
rate-limited veth links, one group per NIC. On a testbed with ``K`` NICs per node, local
rank ``i`` uses NIC ``i mod K`` (:func:`meshplan.runtime.testbed.nics.apply_local_nic`, as
``validate --testbed`` places ranks), so the ``nic`` groups and the pairs measure every rail
(a pair on two rails crosses the spine); with several NICs each NIC's group has its own
files (``all_reduce_perf.nic.nic1.txt``) and calibration.toml takes the slowest NIC's fit.

>>> parse_sizes("1K..8K")
[1024, 2048, 4096, 8192]
>>> chunked(1000, 4)      # float32 elements, a multiple of n: nccl-tests rounds down the same way
(248, 992)
>>> bench_groups([0, 0, 1, 1])
[('nvlink', (0, 1)), ('nic', (0, 2))]
>>> bench_groups([0, 0, 1, 1], nic_of_rank=["nic0", "nic1", "nic0", "nic1"])
[('nvlink', (0, 1)), ('nic', (0, 2)), ('nic', (1, 3))]
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from meshplan.comm.linkfit import LinkFit
from meshplan.errors import ConfigError
from meshplan.fileio import staged_folder
from meshplan.runtime.bench.comm_results import write_results
from meshplan.runtime.testbed.launch import launch_per_node, torchrun_argv
from meshplan.runtime.testbed.netns import require_testbed
from meshplan.runtime.testbed.nics import bind_shim, node_env

#: Said before and after a run without a GPU: what gloo measured, and what its calibration is for.
GLOO_HEADLINE = ("no GPU: measured torch gloo over TCP on the CPU (loopback inside a host, the testbed's veth "
                 "between its nodes), not NVLink or a NIC; the link classes keep the calibration file's names, "
                 "marked backend = \"gloo\", and --calibration takes it only for a gloo cluster (the CPU testbed)")
MAX_SIZE_BYTES = 1 << 30          # 1 GiB: the worker holds about 2x this per rank
MAX_RANKS = 64
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``64M`` -> 67108864 (binary K/M/G as nccl-tests' -b/-e); ConfigError when malformed."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text), flags=re.I)
    if not m:
        raise ConfigError("--sizes", f"bad size {text!r}; use bytes or K/M/G, e.g. 1K..64M")
    return int(m[1]) * _UNITS[m[2].upper()]


def parse_sizes(text: str) -> list[int]:
    """``LO..HI`` (doubling, as nccl-tests -f 2) or a comma list; each in [4 B, 1 GiB]."""
    if ".." in text:
        lo, hi = (parse_size(x) for x in text.split("..", 1))
        if lo < 1 or hi < lo:
            raise ConfigError("--sizes", f"{text!r}: need 0 < LO <= HI")
        sizes = [lo << k for k in range(64) if lo << k <= hi]
    else:
        sizes = sorted({parse_size(x) for x in text.split(",") if x.strip()})
    bad = [s for s in sizes if not 4 <= s <= MAX_SIZE_BYTES]
    if not sizes or bad:
        raise ConfigError("--sizes", f"sizes must lie in 4 B..1G (got {bad or 'none'}); e.g. 1K..64M")
    return sizes


def chunked(size_bytes: int, n: int) -> tuple[int, int]:
    """(float32 elements, bytes) of a full buffer of at most ``size_bytes`` that splits into
    ``n`` equal chunks (at least one element each)."""
    count = max(size_bytes // 4 // n, 1) * n
    return count, count * 4


def bench_groups(node_of_rank: Sequence[int], nic_of_rank: Optional[Sequence] = None
                 ) -> list[tuple[str, tuple[int, ...]]]:
    """Groups measured: node 0's ranks (``nvlink``) when it has two or more, and for each
    NIC (in order of first use; all one NIC when ``nic_of_rank`` is None) the first rank on
    that NIC of every node (``nic``) when two or more nodes have one."""
    nodes = sorted(set(node_of_rank))
    nics = list(nic_of_rank) if nic_of_rank is not None else [None] * len(node_of_rank)
    out = []
    local = tuple(r for r, nd in enumerate(node_of_rank) if nd == nodes[0])
    if len(local) > 1:
        out.append(("nvlink", local))
    for nic in dict.fromkeys(nics):
        on_nic = list(zip(node_of_rank, nics))
        ranks = tuple(on_nic.index((nd, nic)) for nd in nodes if (nd, nic) in on_nic)
        if len(ranks) > 1:
            out.append(("nic", ranks))
    return out


# --------------------------------------------------------------------------- launch


def worker_argv(out: Path, sizes: Sequence[int], iters: int, warmup: int, budget_s: float, pair_size: int,
                timeout_s: float) -> list[str]:
    """Arguments of :mod:`meshplan.runtime.bench.comm_worker` after ``torchrun ... -m``."""
    return ["meshplan.runtime.bench.comm_worker", "--out", str(out), "--sizes", ",".join(map(str, sizes)),
            "--iters", str(iters), "--warmup", str(warmup), "--budget-s", str(budget_s),
            "--pair-size", str(pair_size), "--timeout-s", str(timeout_s)]


def _run_local(nproc: int, wargs: list[str], out: Path, timeout_s: float) -> None:
    """torchrun --standalone (a free port) in its own process group; killed at the deadline."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--max-restarts=0", "-m", *wargs]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(out / "bench.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(0.5)
            proc.wait()
    if rc != 0:
        tail = (out / "bench.log").read_text(errors="replace").strip().splitlines()[-8:]
        why = f"timed out after {timeout_s:g} s" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"bench comm workers {why}; the last lines of bench.log:\n" + "\n".join(tail))


def _run_testbed(prefix: str, nproc: int, wargs: list[str], out: Path, timeout_s: float, state_dir=None) -> str:
    """One torchrun per node namespace of testbed ``prefix`` (static rendezvous at node 0 nic0);
    each worker picks its NIC from the node's addresses (local rank i on nic<i mod K>), its
    connecting sockets bound there by the LD_PRELOAD library. Returns a note on the NICs."""

    tb = require_testbed(prefix, "--testbed", state_dir)
    shim, note = bind_shim()
    envs = [{"OMP_NUM_THREADS": "1", **node_env(tb, i, shim)} for i in range(tb.nodes)]
    res = launch_per_node(tb, lambda i: torchrun_argv(tb, i, nproc, ["-m", *wargs]), timeout_s,
                          env_for_node=envs.__getitem__, log_dir=out / "logs")
    if not res.ok:
        raise RuntimeError(f"bench comm on testbed '{prefix}': {res.message}")
    return (f"testbed '{prefix}': {tb.nodes} nodes x {nproc} ranks, {tb.nics_per_node} NIC(s) per node, "
            f"local rank i on nic<i mod {tb.nics_per_node}>; {note}")


def run_bench(nproc: int, sizes: Sequence[int], out, *, testbed: Optional[str] = None, iters: int = 20,
              warmup: int = 2, budget_s: float = 0.2, pair_size: Optional[int] = None,
              timeout_s: float = 600.0, testbed_state_dir=None, echo=print, force: bool = False) -> list[LinkFit]:
    """Measure, write every file into ``out`` and print them; returns the all-reduce fits.
    ``out`` is built under a temporary name and renamed into place at the end
    (:func:`meshplan.fileio.staged_folder`): an existing non-empty ``out`` is refused before
    the run unless ``force`` (ConfigError naming --out), and a failed or interrupted run
    leaves neither a partial folder nor an earlier result behind.
    ``nproc``: ranks (per node on a testbed). Raises ConfigError for bad arguments and
    RuntimeError when the workers fail or time out. ``testbed_state_dir``: where ``testbed
    up`` wrote its state (default $MESHPLAN_TESTBED_DIR or /tmp/meshplan-testbed)."""
    low = 1 if testbed else 2                 # on a testbed, one rank per node still makes a nic group
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not low <= nproc <= MAX_RANKS:
        raise ConfigError("--nproc", f"{nproc!r} ranks; use {low}..{MAX_RANKS}")
    if not 1 <= iters <= 1000 or not 0 <= warmup <= 100 or not 0 < budget_s <= 60:
        raise ConfigError("--iters", f"iters {iters} (1..1000), warmup {warmup} (0..100), budget {budget_s} s (0..60]")
    dest = Path(out)
    with staged_folder(dest, "--out", force) as out:
        fits = _measure(nproc, sizes, out, testbed, iters, warmup, budget_s, pair_size, timeout_s, testbed_state_dir,
                        echo)
    echo(f"wrote {dest} (nccl-tests text, pairs, calibration.toml)")
    return fits


def _measure(nproc: int, sizes: Sequence[int], out: Path, testbed: Optional[str], iters: int, warmup: int,
             budget_s: float, pair_size: Optional[int], timeout_s: float, testbed_state_dir, echo) -> list[LinkFit]:
    """The run of :func:`run_bench` into the (temporary) folder ``out``."""
    pair = min(pair_size or max(sizes), MAX_SIZE_BYTES)
    wargs = worker_argv(out.resolve(), sizes, iters, warmup, budget_s, pair, timeout_s)
    t0 = time.monotonic()
    if testbed is None:
        _run_local(nproc, wargs, out, timeout_s)
    else:
        echo(_run_testbed(testbed, nproc, wargs, out, timeout_s, testbed_state_dir))
    raw = json.loads((out / "raw.json").read_text(encoding="utf-8"))
    if raw["backend"] == "gloo":
        echo(GLOO_HEADLINE)
    nodes = len({r["node"] for r in raw["ranks"]})
    source = (f"meshplan bench comm {time.strftime('%Y-%m-%d')}, {raw['world']} ranks on {nodes} node(s), "
              f"{raw['backend']}" + (f", testbed {testbed}" if testbed else f", host {raw['ranks'][0]['host']}"))
    blocks, fits, notes = write_results(out, raw, source)
    for b in blocks:
        echo(b)
    for line in notes:
        echo(line)
    if raw["backend"] == "gloo":
        echo(GLOO_HEADLINE)  # again after the tables, where the fits are read
    echo(f"measured in {time.monotonic() - t0:.1f} s")
    return fits
