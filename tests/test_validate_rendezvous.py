"""``validate --nnodes``'s torchrun arguments: the static rendezvous with ``--node-rank`` that
``launch``'s torchrun.sh writes (one rule, :func:`meshplan.placement.rendezvous.static_rdzv_args`),
so node K runs ranks K x W / nnodes onwards, the plan's node, where torch 2.13's c10d rendezvous
ignored ``--node-rank`` and numbered the hosts by sorted (host name, pid)."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from pathlib import Path

import pytest

from meshplan.placement.rendezvous import static_rdzv_args
from meshplan.runtime.execution.launch import Rendezvous, run_torchrun, torchrun_argv
from meshplan.runtime.validation.options import Options

ROOT = Path(__file__).resolve().parents[1]


def test_validate_node_rank_is_a_static_rendezvous_with_node_rank():
    opt = Options(worlds=(8,), nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500", local_addr="10.0.0.2")
    argv = torchrun_argv(8, ["meshplan.runtime.execution.worker"], opt.rendezvous)
    assert argv == [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4",
                    "--rdzv-backend=static", "--rdzv-endpoint=10.0.0.1:29500", "--node-rank=1",
                    "--rdzv-id=meshplan-validate-w8", "--local-addr=10.0.0.2", "--max-restarts=0",
                    "--monitor-interval=0.1", "-m", "meshplan.runtime.execution.worker"]
    # the rendezvous part is launch's torchrun.sh rule, word for word
    assert argv[3:9] == static_rdzv_args(2, 4, 1, "10.0.0.1:29500", "meshplan-validate-w8")
    assert "--rdzv-backend=c10d" not in argv and not any(a.startswith("--rdzv-conf") for a in argv)
    # one host: torchrun --standalone, no rendezvous arguments
    assert torchrun_argv(4, ["m"], Options(worlds=(4,)).rendezvous)[3:5] == ["--standalone", "--nproc-per-node=4"]


#: Each worker writes its torchrun environment and the node whose agent started it (PROBE_NODE, the
#: node_rank the test gave that agent) to $PROBE_OUT/rank<RANK>.json.
PROBE = """import json, os
keys = ("RANK", "GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE", "PROBE_NODE")
with open(os.path.join(os.environ["PROBE_OUT"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({k: int(os.environ[k]) for k in keys}, f)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_loopback_nodes_get_the_ranks_of_their_node_rank(tmp_path):
    """Two torchrun agents on 127.0.0.1 with torchrun_argv's arguments: world 4, 2 per node; node K runs
    ranks 2K and 2K + 1 with GROUP_RANK K. Node 1 names itself 127.0.0.1 and node 0 localhost
    (--local-addr), so c10d's order, sorted by (address, pid), would make node 1 GROUP_RANK 0: with the
    c10d arguments torchrun_argv built before (--rdzv-backend=c10d, is_host) this test fails so (tried); node 1
    also starts first."""
    (tmp_path / "rankprobe.py").write_text(PROBE)
    endpoint = f"127.0.0.1:{_free_port()}"
    env = {"PROBE_OUT": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    outcomes: dict[int, object] = {}

    def node(k: int) -> None:
        outcomes[k] = run_torchrun(4, ["rankprobe"], tmp_path / f"node{k}.log", timeout_s=150, env={**env, "PROBE_NODE": str(k)},
                                   cwd=str(tmp_path), rdzv=Rendezvous(2, k, endpoint, ("localhost", "127.0.0.1")[k]))
    threads = [threading.Thread(target=node, args=(k,)) for k in (1, 0)]
    for t in threads:
        t.start()
        t.join(timeout=1.0)  # node 1 first
    for t in threads:
        t.join(timeout=200)
    for k in (0, 1):
        assert outcomes[k].ok and outcomes[k].leftover_pids == [], (tmp_path / f"node{k}.log").read_text()
    got = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)}
    assert got == {r: {"RANK": r, "GROUP_RANK": r // 2, "LOCAL_RANK": r % 2, "WORLD_SIZE": 4, "PROBE_NODE": r // 2} for r in range(4)}
