"""The options of one ``meshplan validate`` call (:class:`Options`: scale-down factors, run
limits, faults to inject, multi-host rendezvous) and the check of a multi-host request
(:func:`check_hosts`). Read by :mod:`meshplan.runtime.validation.scaling` and
:mod:`meshplan.runtime.validation.validate`."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from meshplan.errors import ConfigError
from meshplan.placement.launch import parse_endpoint
from meshplan.runtime.execution.launch import Rendezvous


_ADDR = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.:-]{0,252}$")


@dataclass(frozen=True)
class Options:
    """Scale-down factors and run limits of one ``validate`` call."""

    worlds: tuple[int, ...] = (2, 4)
    layers: int = 2
    hidden_div: Optional[int] = None  # None: smallest power of two giving hidden <= 256
    seq_len: int = 64
    vocab: int = 512
    micro_batches: Optional[int] = None  # None: the fewest the schedule runs (micro_batches_for)
    steps: int = 3
    timeout_s: Optional[float] = None  # None: world_timeout_s's default, scaled with ranks per core
    pg_timeout_s: Optional[float] = None  # None: timeout_s / 2
    fail_rank: int = -1
    hang_rank: int = -1
    fault_step: int = 1
    tolerance: Optional[float] = None  # relative error allowed on step time and peak memory
    testbed: Optional[str] = None  # prefix of a netns testbed to run across (meshplan.runtime.testbed.run)
    probe: bool = True  # time the plan's collectives in the launch, after the steps (meshplan.runtime.validation.probe)
    curves: bool = True  # with probe: each axis's message curve (staged evidence); off in validate-slice, whose NIC counters are the step's traffic
    nnodes: int = 1  # hosts of a multi-host run (each runs validate with its node_rank; see check_hosts)
    node_rank: int = 0
    rdzv_endpoint: Optional[str] = None  # host:port of node 0 (static rendezvous, its TCPStore)
    local_addr: Optional[str] = None  # this host's address for the workers' store (torchrun --local-addr)
    checkpoint_bytes_per_s: Optional[float] = None  # one rank's storage bandwidth: predicts DCP save/load times
    world_option: str = "--worlds"  # the CLI option that gave `worlds`, named in errors (validate-slice: --world)

    @property
    def rendezvous(self) -> Optional[Rendezvous]:
        """The multi-host rendezvous (None on one host)."""
        if self.nnodes == 1 and self.rdzv_endpoint is None:
            return None
        return Rendezvous(self.nnodes, self.node_rank, self.rdzv_endpoint or "", self.local_addr)


def check_hosts(opt: Options) -> None:
    """ConfigError for an inconsistent multi-host request: ``--nnodes`` >= 1, ``--node-rank``
    in 0..nnodes-1, ``--rdzv-endpoint`` HOST:PORT required with more than one node, no
    ``--testbed`` with it, and every world a multiple of the node count (``W / nnodes``
    processes per host)."""
    if opt.nnodes < 1:
        raise ConfigError("--nnodes", f"{opt.nnodes} must be at least 1")
    if not 0 <= opt.node_rank < opt.nnodes:
        raise ConfigError("--node-rank", f"{opt.node_rank} outside 0..{opt.nnodes - 1} (--nnodes {opt.nnodes})")
    if opt.rendezvous is None:
        return
    if opt.rdzv_endpoint is None:
        raise ConfigError("--rdzv-endpoint", "required with --nnodes > 1: HOST:PORT of node 0, the same on every host")
    parse_endpoint(opt.rdzv_endpoint)
    if opt.local_addr is not None and not _ADDR.match(opt.local_addr):
        raise ConfigError("--local-addr", f"{opt.local_addr!r} is not a host name or address")
    if opt.testbed:
        raise ConfigError("--testbed", "runs every node itself; give either --testbed or --nnodes/--rdzv-endpoint")
    for w in opt.worlds:
        if w % opt.nnodes:
            raise ConfigError(opt.world_option, f"world {w} is not a multiple of --nnodes {opt.nnodes} (W / nnodes "
                              "processes per host)")


#: validate's wall-clock limit per world up to :data:`RANKS_PER_CORE` ranks per core, s.
BASE_TIMEOUT_S = 120.0
#: Ranks per core up to which :data:`BASE_TIMEOUT_S` holds (validate's own time-sharing note).
RANKS_PER_CORE = 4


def world_timeout_s(opt: "Options", world: int, cores: Optional[int] = None) -> tuple[float, str]:
    """(seconds, how) of one world's wall-clock limit: ``opt.timeout_s`` when given, else
    120 s x max(1, world / (4 x cores)): ranks time-share the cores, so a run's time grows with
    the ranks per core. Measured on 2 cores (newcomer nc33, deepseek-v2-lite scaled to 2
    layers): world 8 (4 per core) ran 80.3 s, world 16 (8 per core) 137.5 s, past the old fixed
    120 s, which ended it as a stall; the rule gives 120 and 240 s.

    >>> world_timeout_s(Options(), 16, cores=2)[0], world_timeout_s(Options(), 8, cores=2)[0]
    (240.0, 120.0)
    """
    if opt.timeout_s is not None:
        return opt.timeout_s, "--timeout-s"
    cores = cores or len(os.sched_getaffinity(0))
    scale = max(1.0, world / (RANKS_PER_CORE * cores))
    how = (f"default {BASE_TIMEOUT_S:g} s x {world} ranks / ({RANKS_PER_CORE} x {cores} cores); --timeout-s sets it"
           if scale > 1 else f"default for up to {RANKS_PER_CORE} ranks per core; --timeout-s sets it")
    return BASE_TIMEOUT_S * scale, how
