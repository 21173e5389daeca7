"""``meshplan launch`` (meshplan.placement.launch): the bindings wrapper, the torchrun command
and the sbatch script, each run for real (sh, fake ``torchrun``/``srun``/``scontrol``), input
quoting, and the torchrun command run in two netns testbed "hosts" where the ranks rendezvous
(static rendezvous, each host the node NODE_RANK names) and all-reduce."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.catalog import system
from meshplan.errors import ConfigError
from meshplan.placement.assign import place
from meshplan.placement.launch import LaunchOptions, launch_bindings, parse_endpoint, write_launch
from tests.cli_run import help_words, run_captured
from tests.testbed_gate import needs_testbed

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "tests" / "data" / "launch_testbed_2x2.toml"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

# the program prints its argv and the variables the wrapper sets, as JSON
ECHO = (sys.executable, "-c", "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'env': {k: os.environ.get(k) "
        "for k in ('CUDA_VISIBLE_DEVICES', 'CUDA_DEVICE_ORDER', 'NCCL_IB_HCA', 'NCCL_SOCKET_IFNAME', "
        "'GLOO_SOCKET_IFNAME', 'NCCL_IB_DISABLE')}}))")


#: dgx-h100's 8 compute HCAs (catalog order), the NCCL_IB_HCA of every rank under --nic-scope node (the default)
DGX_H100_HCAS = "=mlx5_0:1,mlx5_3:1,mlx5_4:1,mlx5_5:1,mlx5_6:1,mlx5_9:1,mlx5_10:1,mlx5_11:1"


def _reversed_node0():
    """dgx-h100 x 2, ranks of node 0 on GPUs in reverse order (rank r -> GPU 7 - r), node 1 as is."""
    return place(system("dgx-h100", 2), 16, rank_to_gpu=[7 - r for r in range(8)] + list(range(8, 16)))


def _run_bind(folder: Path, group: int, local: int, rank: int, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GROUP_RANK": str(group), "LOCAL_RANK": str(local), "RANK": str(rank)}
    return subprocess.run(["sh", str(folder / "bind.sh"), *args], capture_output=True, text=True, env=env, timeout=30)


def test_visible_devices_are_ordered_not_hidden():
    """Node 0 reversed: LOCAL_RANK k hosts mesh rank k on GPU 7 - k, so CUDA_VISIBLE_DEVICES
    lists 7..0 and cuda:k is GPU 7 - k; node 1 keeps 0..7. Every GPU stays visible."""
    rows = launch_bindings(_reversed_node0(), LaunchOptions(program=("true",)))
    assert rows[2]["env"]["CUDA_VISIBLE_DEVICES"] == "7,6,5,4,3,2,1,0"
    assert rows[2]["device"] == "cuda:2" and rows[2]["gpu"] == 5
    assert rows[2]["env"]["CUDA_VISIBLE_DEVICES"].split(",")[rows[2]["local_rank"]] == "5"
    assert rows[10]["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    # GPU 5 sits under mlx5_9 on socket 1, cores 70-83 (dgx-h100: 56 cores per socket, 14 per GPU)
    assert rows[2]["nic"] == "mlx5_9" and rows[2]["cores"] == "70-83"
    assert rows[2]["env"]["NCCL_IB_HCA"] == rows[10]["env"]["NCCL_IB_HCA"] == DGX_H100_HCAS  # every NIC, every rank
    assert rows[2]["cpu"] == ["numactl", "--physcpubind=70-83", "--membind=1"]
    assert all(r["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for r in rows)


def test_nic_environment_per_transport():
    p = place(system("dgx-h100", 2), 16)
    ib = launch_bindings(p, LaunchOptions(program=("x",), socket_ifname="bond0", nic_scope="node"))[0]["env"]
    assert ib["NCCL_IB_HCA"].startswith("=mlx5_0:1,mlx5_3:1,") and "NCCL_CROSS_NIC" not in ib  # non-blocking spine
    assert ib["NCCL_SOCKET_IFNAME"] == "=bond0" and ib["GLOO_SOCKET_IFNAME"] == "bond0"
    sock = launch_bindings(p, LaunchOptions(program=("x",), transport="socket", socket_ifname="eth0"))[3]["env"]
    assert (sock["NCCL_SOCKET_IFNAME"], sock["GLOO_SOCKET_IFNAME"], sock["NCCL_IB_DISABLE"]) == ("=eth0", "eth0", "1")
    assert "NCCL_IB_HCA" not in sock and "NCCL_CROSS_NIC" not in sock


def _spine(cluster, oversubscription: float, tiers: int = 2):
    """``cluster`` with its outer network tier's oversubscription set, keeping ``tiers`` tiers."""
    net = [t.model_copy() for t in cluster.network[:tiers]]
    net[-1] = net[-1].model_copy(update={"oversubscription": oversubscription})
    return cluster.model_copy(update={"network": net})


def test_cross_nic_only_where_the_inter_rail_link_is_slow(tmp_path):
    """NCCL_CROSS_NIC=0 forbids cross-rail ring/tree graphs, which NCCL's default 2 takes only when
    its node-local search finds them faster (NCCL env docs: 0 suits rails "with a slow inter-rail
    connection"). dgx-h100 x 2 (8 rails, superpod-ndr-su32: leaf + non-blocking spine): not written,
    and bind.sh says why. The same spine at 2:1: "0" on every rank. One 2:1 tier (every rail under
    the same switches: no inter-rail path), --nic-scope rank or --transport socket: not written."""
    c = system("dgx-h100", 2)
    opts = LaunchOptions(program=("x",))
    assert all("NCCL_CROSS_NIC" not in r["env"] for r in launch_bindings(place(c, 16), opts))
    write_launch(tmp_path / "a", place(c, 16), opts)
    note = [x for x in (tmp_path / "a" / "bind.sh").read_text().splitlines() if "NCCL_CROSS_NIC" in x]
    assert note == ["#   NCCL_CROSS_NIC: not set, so NCCL's default 2 applies (or your environment's value): rings and "
                    "trees keep one rail unless crossing is faster, and the spine between rails is non-blocking; 0 "
                    "would only forbid those faster graphs (NCCL env docs, NCCL_CROSS_NIC: 0 suits rails joined by a "
                    "slow inter-rail link)"]
    slow = place(_spine(c, 2.0), 16)
    assert {r["env"]["NCCL_CROSS_NIC"] for r in launch_bindings(slow, opts)} == {"0"}
    write_launch(tmp_path / "b", slow, opts)
    text = (tmp_path / "b" / "bind.sh").read_text()
    assert "#   NCCL_CROSS_NIC: 0: a ring or tree keeps the same NIC (rail) on every node, because this network is " \
           "oversubscribed above the rail leaves" in text and "not set" not in text
    exports = [x for x in text.splitlines() if x.strip().startswith("export ")]
    # both nodes' bindings are the same by LOCAL_RANK: one table of 8 ranks (16 per-host before)
    assert len(exports) == 8 and all(x.endswith(" NCCL_CROSS_NIC=0") for x in exports)
    one_tier = place(_spine(c, 2.0, tiers=1), 16)
    assert all("NCCL_CROSS_NIC" not in r["env"] for r in launch_bindings(one_tier, opts))
    for o in (LaunchOptions(program=("x",), nic_scope="rank"),
              LaunchOptions(program=("x",), transport="socket", socket_ifname="eth0")):
        assert all("NCCL_CROSS_NIC" not in r["env"] for r in launch_bindings(slow, o))


def test_socket_transport_names_ip_interfaces_not_hcas():
    """NCCL_SOCKET_IFNAME selects IP interfaces; dgx-h100's NICs are the HCAs mlx5_0..mlx5_11
    (no interface is called that, so NCCL would find none). Before, socket transport wrote
    NCCL_SOCKET_IFNAME==mlx5_5 for rank 3. Without an interface name: a one-line error naming
    --socket-ifname; with each NIC's ifname (IPoIB ib0..ib7 here): rank 3's own, or the
    node's with nic_scope node."""
    p = place(system("dgx-h100", 2), 16)
    with pytest.raises(ConfigError, match=r"^--socket-ifname: --transport socket sets NCCL_SOCKET_IFNAME, which names "
                                          r"IP interfaces, but node dgx-h100's NIC mlx5_0 has no IP interface name "
                                          r"\(ifname\); give --socket-ifname IFACE"):
        launch_bindings(p, LaunchOptions(program=("x",), transport="socket"))
    nics = [n.model_copy(update={"ifname": f"ib{k}"}) for k, n in enumerate(p.cluster.node.nics)]
    cluster = p.cluster.model_copy(update={"node": p.cluster.node.model_copy(update={"nics": nics})})
    named = place(cluster, 16)
    sock = launch_bindings(named, LaunchOptions(program=("x",), transport="socket", nic_scope="rank"))[3]["env"]
    assert (sock["NCCL_SOCKET_IFNAME"], sock["GLOO_SOCKET_IFNAME"], sock["NCCL_IB_DISABLE"]) == ("=ib3", "ib3", "1")
    node = launch_bindings(named, LaunchOptions(program=("x",), transport="socket"))[3]["env"]  # node: the default
    assert node["NCCL_SOCKET_IFNAME"] == "=" + ",".join(f"ib{k}" for k in range(8))
    ib = launch_bindings(named, LaunchOptions(program=("x",), nic_scope="rank"))[3]["env"]
    assert ib == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                  "NCCL_IB_HCA": "=mlx5_5:1"}


def test_bind_sh_runs_the_rank_with_its_environment_and_literal_arguments(tmp_path):
    """torchrun.sh then bind.sh run by sh, torchrun faked (it sets node 0, LOCAL_RANK 2, RANK 2
    and execs its program): the rank gets the ordered devices and its NIC, and arguments with
    spaces, quotes, ``$(...)`` and ``;`` reach the program unchanged."""
    nasty = ["a b", "$(touch PWNED)", "';echo x", "`id`", "*"]
    write_launch(tmp_path, _reversed_node0(), LaunchOptions(program=ECHO + tuple(nasty), cpu_bind="none",
                                                           rdzv_endpoint="h:1"))
    _fake(tmp_path / "bin", "torchrun", 'while [ "$1" != --no-python ]; do shift; done; shift\n'
          'GROUP_RANK=0 LOCAL_RANK=2 RANK=2 exec "$@"')
    r = subprocess.run(["sh", str(tmp_path / "torchrun.sh")], capture_output=True, text=True, timeout=30, cwd=tmp_path,
                       env={**os.environ, "TORCHRUN": str(tmp_path / "bin" / "torchrun"), "NODE_RANK": "0"})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["argv"] == nasty
    assert got["env"]["CUDA_VISIBLE_DEVICES"] == "7,6,5,4,3,2,1,0" and got["env"]["NCCL_IB_HCA"] == DGX_H100_HCAS
    assert not (tmp_path / "PWNED").exists()


def test_bind_sh_refuses_a_rank_the_plan_does_not_expect(tmp_path):
    write_launch(tmp_path, place(system("dgx-h100", 2), 16), LaunchOptions(program=ECHO, cpu_bind="none"))
    r = _run_bind(tmp_path, 1, 3, 3)       # node 1 local 3 is RANK 11 with 8 per node
    assert r.returncode == 1 and "has RANK=3, expected 11" in r.stderr
    r = _run_bind(tmp_path, 2, 0, 16)
    assert r.returncode == 1 and "no binding for node 2" in r.stderr


def _fake(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
    (bin_dir / name).chmod(0o755)


def _argv_torchrun(tmp_path: Path, hosts=()):
    """torchrun.sh (dgx-h100 x 2) under a fake torchrun that prints its argv as JSON; returns run(**env)."""
    write_launch(tmp_path, place(system("dgx-h100", 2), 16),
                 LaunchOptions(program=("python", "train.py", "--x", "a b"), rdzv_endpoint="head-0:29400", hosts=hosts))
    base = {k: v for k, v in os.environ.items()
            if k not in ("SLURM_NODEID", "SLURM_JOB_ID", "NODE_RANK", "SLURMD_NODENAME", "MESHPLAN_LOCAL_ADDR")}
    _fake(tmp_path / "bin", "faketorchrun", f'exec {sys.executable} -c "import json,sys; print(json.dumps(sys.argv[1:]))" "$@"')
    base["TORCHRUN"] = str(tmp_path / "bin" / "faketorchrun")
    return lambda **env: subprocess.run(["sh", str(tmp_path / "torchrun.sh")], capture_output=True, text=True,
                                        env={**base, **env}, timeout=30)


def test_torchrun_sh_passes_the_rendezvous_and_node_rank(tmp_path):
    """Slurm admin finding: torchrun.sh's c10d rendezvous never passed --node-rank (torch 2.13's c10d
    ignores it and numbers nodes by sorted host name), so the plan's node order did not decide which
    host ran which node. Now a static rendezvous at node 0's endpoint with --node-rank = NODE_RANK, else
    SLURM_NODEID; without either (two nodes) or outside 0-1 it stops with one line."""
    run = _argv_torchrun(tmp_path)
    argv = json.loads(run(NODE_RANK="1").stdout)
    assert argv == ["--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=static", "--rdzv-endpoint=head-0:29400",
                    "--node-rank=1", "--rdzv-id=meshplan", "--max-restarts=0",
                    "--no-python", str(tmp_path / "bind.sh"), "python", "train.py", "--x", "a b"]
    argv = json.loads(run(SLURM_NODEID="0", SLURM_JOB_ID="77", MESHPLAN_RDZV_ENDPOINT="h:1").stdout)
    assert "--node-rank=0" in argv and "--rdzv-endpoint=h:1" in argv and "--rdzv-id=77" in argv
    argv = json.loads(run(NODE_RANK="1", SLURM_NODEID="0", MESHPLAN_LOCAL_ADDR="10.0.0.7").stdout)
    assert "--node-rank=1" in argv and "--local-addr=10.0.0.7" in argv
    for env, says in (({}, "set NODE_RANK=<0-1>, this host's node in the plan"),
                      ({"NODE_RANK": "2"}, "node rank 2 (NODE_RANK, else SLURM_NODEID) is not a node of the plan (0-1)"),
                      ({"SLURM_NODEID": "01"}, "node rank 01 (NODE_RANK")):
        r = run(**env)
        # exit 1 as bind.sh's refusals and docs/commands.md (it was 2 until nc55 #6)
        assert r.returncode == 1 and r.stdout == "" and len(r.stderr.splitlines()) == 1 and says in r.stderr


def test_torchrun_sh_takes_the_node_rank_from_the_plans_host_list(tmp_path):
    """With --hosts gpu-b,gpu-a the plan's node 0 is gpu-b, although Slurm numbers the allocation
    sorted (sbatch --nodelist: SLURM_NODEID 0 is gpu-a): the host's place in the list wins
    (SLURMD_NODENAME, else hostname, with or without its domain); a host not in the list, or a
    NODE_RANK that disagrees with it, stops with one line. job.sbatch's endpoint is gpu-b."""
    run = _argv_torchrun(tmp_path, hosts=("gpu-b", "gpu-a"))
    assert "--node-rank=1" in json.loads(run(SLURMD_NODENAME="gpu-a", SLURM_NODEID="0").stdout)
    assert "--node-rank=0" in json.loads(run(SLURMD_NODENAME="gpu-b.cluster.local", NODE_RANK="0").stdout)
    r = run(SLURMD_NODENAME="gpu-c", SLURM_NODEID="0")
    assert r.returncode == 1 and r.stderr == ("meshplan torchrun.sh: host gpu-c is not one of the plan's hosts (gpu-b "
                                              "gpu-a): run it there, or write the launch again with meshplan launch "
                                              "--hosts\n")
    r = run(SLURMD_NODENAME="gpu-a", NODE_RANK="0")
    assert r.returncode == 1 and r.stderr == ("meshplan torchrun.sh: NODE_RANK=0, but host gpu-a is node 1 of the plan "
                                              "(gpu-b gpu-a)\n")
    # without --rdzv-endpoint, gpu-b (the plan's node 0) at --port in job.sbatch and torchrun.sh
    s = tmp_path / "s"
    write_launch(s, place(system("dgx-h100", 2), 16), LaunchOptions(program=("python", "t.py"), hosts=("gpu-b", "gpu-a")))
    assert "export MESHPLAN_RDZV_ENDPOINT=${MESHPLAN_RDZV_ENDPOINT:-gpu-b:29500}" in (s / "job.sbatch").read_text().splitlines()
    env = {k: v for k, v in os.environ.items() if k not in ("MESHPLAN_RDZV_ENDPOINT", "NODE_RANK")}
    r = subprocess.run(["sh", str(s / "torchrun.sh")], capture_output=True, text=True, timeout=30,
                       env={**env, "SLURMD_NODENAME": "gpu-a", "TORCHRUN": str(tmp_path / "bin" / "faketorchrun")})
    assert r.returncode == 0 and json.loads(r.stdout)[3:5] == ["--rdzv-endpoint=gpu-b:29500", "--node-rank=1"]


def test_bind_sh_refuses_a_host_torchrun_made_another_node(tmp_path):
    """What the admin asked for: a swapped node fails with one line. torchrun.sh run on gpu-b (the
    plan's node 0) under a fake torchrun that, as c10d does, makes it GROUP_RANK 1 whatever
    --node-rank says: bind.sh stops before binding. One that honours --node-rank (as static does)
    runs node 0's rank; without --hosts the node is SLURM_NODEID's."""
    out = tmp_path / "l"
    write_launch(out, place(system("dgx-h100", 2), 16),
                 LaunchOptions(program=ECHO, cpu_bind="none", rdzv_endpoint="gpu-b:1", hosts=("gpu-b", "gpu-a")))
    _fake(tmp_path / "bin", "c10dlike", 'while [ "$1" != --no-python ]; do shift; done; shift\n'
          'GROUP_RANK=1 LOCAL_RANK=2 RANK=10 exec "$@"')
    _fake(tmp_path / "bin", "staticlike", 'for a; do case "$a" in --node-rank=*) n=${a#--node-rank=} ;; esac; done\n'
          'while [ "$1" != --no-python ]; do shift; done; shift\n'
          'GROUP_RANK=$n LOCAL_RANK=2 RANK=$((n * 8 + 2)) exec "$@"')
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_NODEID", "NODE_RANK", "SLURMD_NODENAME")}
    run = lambda fake, **e: subprocess.run(["sh", str(out / "torchrun.sh")], capture_output=True, text=True,  # noqa: E731
                                           env={**env, "TORCHRUN": str(tmp_path / "bin" / fake), **e}, timeout=30)
    r = run("c10dlike", SLURMD_NODENAME="gpu-b", SLURM_NODEID="1")
    assert r.returncode == 1 and r.stdout == "" and r.stderr == (
        "meshplan bind.sh: torchrun made host gpu-b node GROUP_RANK=1, but the plan puts node 0 here: run "
        "torchrun.sh (static rendezvous, --node-rank)\n")
    r = run("staticlike", SLURMD_NODENAME="gpu-b", SLURM_NODEID="1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["env"]["NCCL_IB_HCA"] == DGX_H100_HCAS
    # no --hosts: SLURM_NODEID names the node; bind.sh run by hand with another GROUP_RANK
    write_launch(tmp_path / "n", place(system("dgx-h100", 2), 16), LaunchOptions(program=ECHO, cpu_bind="none"))
    bind = lambda **e: subprocess.run(["sh", str(tmp_path / "n" / "bind.sh"), *ECHO], capture_output=True,  # noqa: E731
                                      text=True, env={**env, "LOCAL_RANK": "0", **e}, timeout=30)
    r = bind(SLURM_NODEID="0", GROUP_RANK="1", RANK="8")
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and "GROUP_RANK=1, but the plan puts node 0" in r.stderr
    assert bind(SLURM_NODEID="1", GROUP_RANK="1", RANK="8").returncode == 0


def test_torchrun_sh_without_an_endpoint_says_what_to_set(tmp_path):
    write_launch(tmp_path, place(system("dgx-h100", 1), 8), LaunchOptions(program=("python", "t.py")))
    env = {k: v for k, v in os.environ.items() if k != "MESHPLAN_RDZV_ENDPOINT"}
    r = subprocess.run(["sh", str(tmp_path / "torchrun.sh")], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 1 and "set MESHPLAN_RDZV_ENDPOINT" in r.stderr


def test_sbatch_script_under_fake_slurm(tmp_path):
    """job.sbatch with fake scontrol (two hosts) and srun (prints its argv and the endpoint)."""
    out = tmp_path / "job"
    write_launch(out, place(system("dgx-h100", 2), 16),
                 LaunchOptions(program=("python", "t.py"), hosts=("gpu-a", "gpu-b"), partition="batch"))
    text = (out / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=112",
                 "#SBATCH --nodelist=gpu-a,gpu-b", "#SBATCH --partition=batch", "#SBATCH --ntasks-per-node=1"):
        assert line in text.splitlines()
    _fake(tmp_path / "bin", "scontrol", 'printf "gpu-a\\ngpu-b\\n"')
    _fake(tmp_path / "bin", "srun", 'echo "$MESHPLAN_RDZV_ENDPOINT $MESHPLAN_RDZV_ID $*"')
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "SLURM_JOB_ID": "42"}
    env.pop("MESHPLAN_RDZV_ENDPOINT", None)
    r = subprocess.run(["bash", str(out / "job.sbatch")], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["gpu-a:29500", "42", "--ntasks-per-node=1", "--cpus-per-task=112",
                                "--kill-on-bad-exit=1", "--cpu-bind=none", str(out.resolve() / "torchrun.sh")]


def test_srun_asks_for_the_jobs_cpus_again(tmp_path):
    """Slurm user finding: since Slurm 22.05 srun does not inherit sbatch's --cpus-per-task (release
    notes; SRUN_CPUS_PER_TASK), so the step's one task got one CPU under task/cgroup and bind.sh's
    numactl --physcpubind named cores outside its cpuset. srun now asks for the job's value, which
    sbatch exports as SLURM_CPUS_PER_TASK (96 when the user gives sbatch -c 96), else dgx-h100's
    2 x 56 = 112 cores from the #SBATCH line, or all the node's CPUs (SLURM_CPUS_ON_NODE) when
    more, as where Slurm counts hardware threads; the comment above it names the source."""
    out = tmp_path / "job"
    write_launch(out, place(system("dgx-h100", 2), 16), LaunchOptions(program=("python", "t.py")))
    text = (out / "job.sbatch").read_text()
    assert "#SBATCH --cpus-per-task=112" in text.splitlines() and "Slurm 22.05 release" in text
    _fake(tmp_path / "bin", "scontrol", 'printf "gpu-a\\ngpu-b\\n"')
    _fake(tmp_path / "bin", "srun", 'echo "$*"')
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "SLURM_JOB_ID": "42"}
    # sbatch's -c; the CPUs the job holds on the node (224: 2 x 56 cores x 2 threads where Slurm
    # counts threads as CPUs, so 112 CPUs would be 56 cores); srun's ask
    for given, on_node, asked in ((None, None, "--cpus-per-task=112"), ("96", "96", "--cpus-per-task=96"),
                                  ("112", "224", "--cpus-per-task=224")):
        for name, value in (("SLURM_CPUS_PER_TASK", given), ("SLURM_CPUS_ON_NODE", on_node)):
            env.pop(name, None)
            if value:
                env[name] = value
        r = subprocess.run(["bash", str(out / "job.sbatch")], capture_output=True, text=True, env=env, timeout=30)
        assert r.returncode == 0, r.stderr
        assert asked in r.stdout.split()


def test_bind_sh_says_why_memory_is_bound_strictly(tmp_path):
    """bind.sh's numactl uses --membind (strict: numactl(8), an allocation past the node fails) as
    NVIDIA's DGX bind.sh does, and says so with the way out (--cpu-bind taskset); under taskset,
    which binds no memory, the comment is not written."""
    p = place(system("dgx-h100", 1), 8)
    numa = Path(write_launch(tmp_path / "n", p, LaunchOptions(program=ECHO))[0]).read_text()
    assert "--membind=1" in numa and "# numactl --membind (strict), as NVIDIA's bind.sh" in numa
    assert "meshplan launch --cpu-bind taskset" in numa
    cores = Path(write_launch(tmp_path / "t", p, LaunchOptions(program=ECHO, cpu_bind="taskset"))[0]).read_text()
    assert "membind" not in cores and "taskset -c 70-83" in cores


@pytest.mark.parametrize("opts, field", [
    (dict(rdzv_endpoint="head;reboot:1"), "--rdzv-endpoint"),
    (dict(rdzv_endpoint="head:99999"), "--rdzv-endpoint"),
    (dict(hosts=("a", "b c")), "--hosts"),
    (dict(hosts=("a",)), "--hosts"),
    (dict(job_name="x\n#SBATCH --uid=0"), "--job-name"),
    (dict(socket_ifname="eth0 ; id"), "--socket-ifname"),
    (dict(time_limit="1h"), "--time"),
    (dict(cpu_bind="hwloc"), "--cpu-bind"),
    (dict(program=()), "PROGRAM"),
    (dict(program=("train.py", "--steps", "10")), "PROGRAM"),  # bind.sh execs it: not on PATH, maybe no #!
])
def test_unsafe_or_wrong_input_is_rejected(opts, field, tmp_path):
    with pytest.raises(ConfigError) as e:
        write_launch(tmp_path, place(system("dgx-h100", 2), 16), LaunchOptions(**{"program": ("x",), **opts}))
    assert e.value.field == field
    assert not any(tmp_path.iterdir())


def test_nic_names_from_input_are_checked():
    cl = system("dgx-h100", 1)
    node = cl.node.model_copy(update={"nics": [cl.node.nics[0].model_copy(update={"name": "mlx5_0;id"})]})
    with pytest.raises(ConfigError) as e:
        launch_bindings(place(cl.model_copy(update={"node": node}), 8), LaunchOptions(program=("x",)))
    assert e.value.field == "cluster.node.nics"


def test_parse_endpoint_ipv6_brackets():
    assert parse_endpoint("[fe80::1]:29500") == ("[fe80::1]", 29500)


@pytest.mark.parametrize("port", ["9" * 5000, "\u00b2", "\u0661\u0662"])  # 5,000 digits; superscript 2; Arabic-Indic 12
def test_parse_endpoint_port_digits_python_int_refuses_are_a_one_line_error(port):
    """str.isdigit() accepts these and int() raises ValueError on them (the 4,300-digit
    limit, non-ASCII digits): found by benchmarks/fuzz.py; each is the endpoint's error."""
    with pytest.raises(ConfigError, match=r"^--rdzv-endpoint: .* is not HOST:PORT"):
        parse_endpoint(f"node-1:{port}")


def _cli(*args, cwd=None):
    """``meshplan launch ARGS`` in-process (:func:`tests.cli_run.run_captured`: no interpreter start-up; ENV
    is this process's environment), in ``cwd`` when given."""
    with contextlib.chdir(cwd) if cwd else contextlib.nullcontext():
        return run_captured("launch", *args)


@pytest.mark.slow
def test_cli_writes_modes_refuses_overwrite_and_bad_input(tmp_path):
    out = tmp_path / "l"
    r = _cli(str(CFG), "--out", str(out), "--", "python", "train.py")
    assert r.returncode == 0, r.stderr
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == {"bind.sh": 0o755, "torchrun.sh": 0o755, "job.sbatch": 0o755, "bindings.json": 0o644}
    before = (out / "bind.sh").read_text()
    r = _cli(str(CFG), "--out", str(out), "--cpu-bind", "none", "--", "python", "train.py")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: --out: {out / 'bind.sh'} exists; choose another folder or pass --force to replace it"]
    assert (out / "bind.sh").read_text() == before
    r = _cli(str(CFG), "--out", str(tmp_path / "m"), "--rdzv-endpoint", "$(id):1", "--", "python", "t.py")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("error: --rdzv-endpoint: ") and not (tmp_path / "m").exists()


def test_cli_socket_transport_without_an_interface_name(tmp_path, capsys):
    """dgx-h100's catalog NICs have no IP interface name: one line naming --socket-ifname, no
    files; with --socket-ifname the bindings carry it."""
    from meshplan.cli import main
    cfg, out = ROOT / "examples" / "mini_2x4_tp2-dp4.toml", tmp_path / "l"
    with pytest.raises(SystemExit) as e:
        main(["launch", str(cfg), "--out", str(out), "--transport", "socket", "--", "python", "t.py"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: --socket-ifname: --transport socket sets NCCL_SOCKET_IFNAME")
    assert len(err.splitlines()) == 1 and not out.exists()
    with pytest.raises(SystemExit) as e:
        main(["launch", str(cfg), "--out", str(out), "--transport", "socket", "--socket-ifname", "eth0", "--",
              "python", "t.py"])
    assert e.value.code in (0, None)
    rows = json.loads((out / "bindings.json").read_text())
    assert {r["env"]["NCCL_SOCKET_IFNAME"] for r in rows} == {"=eth0"}


@pytest.mark.slow
def test_cli_infeasible_mesh_writes_nothing(tmp_path):
    cfg = tmp_path / "big.toml"
    cfg.write_text(CFG.read_text().replace('catalog = "llama3-8b"', 'catalog = "llama3-405b"'))
    r = _cli(str(cfg), "--out", str(tmp_path / "l"), "--", "python", "t.py")
    assert r.returncode == 1 and "infeasible: " in r.stderr and not (tmp_path / "l").exists()


PROGRAM = r"""
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
info = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
        "local_rank": int(os.environ["LOCAL_RANK"]), "group_rank": int(os.environ["GROUP_RANK"]),
        "netns": os.readlink("/proc/self/ns/net"), "cpus": sorted(os.sched_getaffinity(0)),
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}}
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(sys.argv[1], f"rank{info['rank']}.json"), "w") as f:
    json.dump(info, f)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
@needs_testbed
def test_launch_command_runs_across_two_testbed_hosts(tmp_path):
    """``meshplan launch`` for 2 nodes x 2 ranks (socket transport on nic0, taskset cores),
    its torchrun.sh run in two namespaces (NODE_RANK 0 and 1, static rendezvous at node 0's nic0; each
    node's nic0 address as MESHPLAN_LOCAL_ADDR: the hostname is the machine's): all
    four ranks rendezvous, all-reduce 1+2+3+4 = 10, and each ran in its node's namespace
    with its binding."""
    from meshplan.runtime.testbed import netns as T
    from meshplan.runtime.testbed.launch import launch_per_node

    prefix, state = f"l{os.getpid() % 100000}", tmp_path / "state"
    tb = T.testbed_up(prefix, 2, 1, 1000.0, state_dir=state)
    try:
        out, results = tmp_path / "launch", tmp_path / "results"
        results.mkdir()
        (tmp_path / "prog.py").write_text(PROGRAM)
        r = _cli(str(CFG), "--out", str(out), "--transport", "socket", "--cpu-bind", "taskset",
                 "--rdzv-endpoint", f"{tb.addr(0, 0)}:29511", "--", sys.executable, str(tmp_path / "prog.py"),
                 str(results))
        assert r.returncode == 0, r.stderr
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "TORCHRUN": f"{sys.executable} -m torch.distributed.run"}
        # the namespaces share a host name: c10d numbered them by pid (sorted FQDN_pid), static by NODE_RANK
        res = launch_per_node(tb, lambda i: ["sh", str(out / "torchrun.sh")], timeout_s=120,
                              env_for_node=lambda i: {**env, "NODE_RANK": str(i), "MESHPLAN_LOCAL_ADDR": tb.addr(i, 0)}, log_dir=tmp_path / "logs")
        assert res.ok, res.message + "\n" + "\n".join(n.stderr_tail for n in res.results)
        inode = {i: f"net:[{os.stat(f'/run/netns/{tb.node_ns(i)}').st_ino}]" for i in range(2)}
    finally:
        T.testbed_down(prefix, state_dir=state)
    ranks = {r: json.loads((results / f"rank{r}.json").read_text()) for r in range(4)}
    ns = {info["group_rank"]: set() for info in ranks.values()}
    for r, info in ranks.items():
        assert info["world"] == 4 and info["sum"] == 10.0
        assert (info["group_rank"], info["local_rank"]) == divmod(r, 2)
        assert info["cpus"] == [info["local_rank"]]
        assert info["env"] == {"CUDA_VISIBLE_DEVICES": "0,1", "GLOO_SOCKET_IFNAME": "nic0", "NCCL_SOCKET_IFNAME": "=nic0"}
        ns[info["group_rank"]].add(info["netns"])
    assert len(ns[0]) == len(ns[1]) == 1 and ns[0] != ns[1]      # one namespace per host, two hosts
    assert ns == {0: {inode[0]}, 1: {inode[1]}}  # GROUP_RANK k ran where NODE_RANK=k: the plan's node order
    assert not T._matching_netns(prefix)


@pytest.mark.slow
@pytest.mark.timeout(420)
@needs_testbed
def test_validate_runs_across_two_testbed_hosts(tmp_path):
    """``validate --nnodes 2 --node-rank k --rdzv-endpoint`` run in two namespaces as two
    hosts (world 2: one rank each, FSDP over both): node 0 compares and writes the evidence
    in the shared --out, node 1 leaves its log there; groups and collectives match the plan."""
    from meshplan.runtime.testbed import netns as T
    from meshplan.runtime.testbed.launch import launch_per_node

    prefix, state, out = f"v{os.getpid() % 100000}", tmp_path / "state", tmp_path / "shared"
    tb = T.testbed_up(prefix, 2, 1, 1000.0, state_dir=state)
    try:
        cmd = lambda i: [sys.executable, "-m", "meshplan.cli", "validate", str(CFG), "--worlds", "2",  # noqa: E731
                         "--steps", "1", "--no-probe", "--nnodes", "2", "--node-rank", str(i), "--rdzv-endpoint",
                         f"{tb.addr(0, 0)}:29513", "--local-addr", tb.addr(i, 0), "--out", str(out)]
        res = launch_per_node(tb, cmd, timeout_s=300, env_for_node=lambda i: {
            "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "nic0"}, log_dir=tmp_path / "logs")
        assert res.ok, res.message + "\n" + "\n".join(n.stdout_tail + n.stderr_tail for n in res.results)
    finally:
        T.testbed_down(prefix, state_dir=state)
    doc = json.loads((out / "validate.json").read_text())
    assert doc["ok"] and doc["options"]["nnodes"] == 2 and doc["worlds"][0]["stage"] == "compare"
    assert "collectives match the plan exactly on all 2 ranks" in doc["worlds"][0]["message"]
    assert "node 1: torchrun exited 0" in res.results[1].stdout_tail
    assert (out / "world2" / "torchrun-node1.log").exists()
    for r in (0, 1):
        assert json.loads((out / "world2" / f"rank{r}" / "status.json").read_text())["state"] == "done"
    assert any(n.startswith("hosts: 2 x 1 ranks (this is node 0") for n in doc["worlds"][0]["notes"])


def test_help_documents_the_launch_and_multi_host_options():
    launch = help_words("launch")
    for opt in ("--out", "--rdzv-endpoint", "--port", "--hosts", "--transport", "--nic-scope", "--socket-ifname",
                "--cpu-bind", "--job-name", "--partition", "--time", "--choose", "--topology", "--force"):
        assert f"{opt} <" in launch or f"{opt} " in launch, opt
    assert "cuda:{LOCAL_RANK}" in launch
    validate = help_words("validate")
    for opt in ("--nnodes", "--node-rank", "--rdzv-endpoint", "--local-addr"):
        assert opt in validate, opt


@pytest.mark.slow
def test_place_bindings_visible_all_orders_the_node_gpus(tmp_path):
    """``place --bindings --format sh --visible all``: every rank of the 2-GPU testbed node sees
    both GPUs in LOCAL_RANK order ("0,1"), the default as launch's, instead of its own alone
    (``--visible one``)."""
    run = lambda *a: run_captured("place", CFG, *a)  # noqa: E731  (in-process: no interpreter start-up)
    r = run("--bindings", str(tmp_path / "all.json"), "--visible", "all")
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "all.json").read_text())
    assert [b["env"]["CUDA_VISIBLE_DEVICES"] for b in rows] == ["0,1"] * 4
    assert [b["device"] for b in rows] == ["cuda:0", "cuda:1"] * 2
    r = run("--bindings", str(tmp_path / "default.json"))
    assert json.loads((tmp_path / "default.json").read_text()) == rows
    r = run("--bindings", str(tmp_path / "one.json"), "--visible", "one")
    assert [b["env"]["CUDA_VISIBLE_DEVICES"] for b in json.loads((tmp_path / "one.json").read_text())] == \
        ["0", "1", "0", "1"]
    r = run("--bindings", str(tmp_path / "x.json"), "--visible", "some")
    assert r.returncode == 2 and r.stderr.strip() == "error: --visible: 'some' is not one of one, all"


TP_ACROSS = """[model]
catalog = "llama3-8b"
[cluster]
system = "dgx-h100"
nodes = 2
[training]
global_batch = 64
seq_len = 8192
micro_batch = 1
sharding = "zero3"
recompute = "none"
[mesh]
names = ["tp", "dp_shard"]
shape = [4, 4]
sequence_parallel = true
"""


@pytest.mark.slow
def test_launch_prints_place_warnings_and_the_choice(tmp_path, capsys):
    """Newcomer finding (issue 11 item 4): tp 4 outermost on 2 nodes puts every tp group across
    both nodes; `place` warned, `launch` printed nothing, and `launch --choose` wrote a permuted
    bind.sh without the step change `place --choose` prints. Both now print place's lines."""
    from meshplan.cli import main
    cfg = tmp_path / "tpx.toml"
    cfg.write_text(TP_ACROSS)

    def run(*argv):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in argv])
        out = capsys.readouterr()
        assert e.value.code in (0, None), out.err
        return out.out.splitlines()

    place = run("place", cfg)
    warning = [line.strip()[2:] for line in place if line.startswith("  ! ")]
    assert len(warning) == 1 and warning[0].startswith("tp 4 fits the 8-GPU node but the axis order puts it across")
    plain = run("launch", cfg, "--out", tmp_path / "a", "--", "python", "t.py")
    assert f"warning: {warning[0].replace('meshplan place --choose', 'meshplan launch --choose')}" in plain
    assert "placement: node-major placement as given: weak-path bytes (all ranks, per step) 1,675.2 GB" in plain[0]
    chosen = run("launch", cfg, "--out", tmp_path / "b", "--choose", "--", "python", "t.py")
    placed = run("place", cfg, "--choose")
    assert chosen[0] == "chosen rank_to_gpu: [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15]" == placed[4]
    line = [x for x in chosen if x.startswith("placement: ")]
    assert len(line) == 1 and f"  - {line[0][len('placement: '):]}" in placed
    m = re.search(r"predicted step ([0-9.]+) s -> ([0-9.]+) s \(step-time model\)", line[0])
    assert m and float(m[2]) < float(m[1])  # the choice is faster by the tool's own model (as place's line)
    assert not [x for x in chosen if x.startswith("warning: ")]
    rows = json.loads((tmp_path / "b" / "bindings.json").read_text())
    assert [r["gpu"] for r in rows[:4]] == [0, 4, 0, 4]  # rank_to_gpu 0, 4, 8, 12: local GPUs 0, 4 of each node


@pytest.mark.slow
def test_launch_json_holds_the_warnings_and_the_choice_place_json_holds(tmp_path, capsys):
    """Issue 11 (nits 1): `launch --json` carried the files only, not the warning and the
    `--choose` line launch prints. Now it holds place --json's placement keys, equal to place's
    for the same config, and valid against launch's schema."""
    import jsonschema
    from meshplan.cli import main
    from meshplan.report.json_docs import schema_of
    cfg = tmp_path / "tpx.toml"
    cfg.write_text(TP_ACROSS)

    def doc(command, *argv):
        with pytest.raises(SystemExit) as e:
            main([command, "--json", "-"] + [str(a) for a in argv])  # options first: after `--` is the program
        out = capsys.readouterr()
        assert e.value.code in (0, None), out.err
        return json.loads(out.out), out.err.splitlines()

    plain, err = doc("launch", cfg, "--out", tmp_path / "a", "--", "python", "t.py")
    jsonschema.validate(plain, schema_of("launch"))
    assert len(plain["warnings"]) == 1 and plain["warnings"][0].startswith("tp 4 fits the 8-GPU node but the axis")
    assert f"warning: {plain['warnings'][0]}" in err and plain["searched"] is False
    assert f"placement: {plain['decisions'][-1]}" in err and plain["step_after_s"] is None
    chosen, err = doc("launch", cfg, "--out", tmp_path / "b", "--choose", "--", "python", "t.py")
    placed, _ = doc("place", cfg, "--choose")
    jsonschema.validate(chosen, schema_of("launch"))
    assert chosen["rank_to_gpu"] == [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15] == placed["rank_to_gpu"]
    assert chosen["searched"] and chosen["changed"] and chosen["warnings"] == [] == placed["warnings"]
    for key in ("decisions", "before", "after", "step_before_s", "step_after_s"):
        assert chosen[key] == placed[key], key
    assert chosen["step_after_s"] < chosen["step_before_s"]  # the step change launch prints
    assert f"placement: {chosen['decisions'][-1]}" in err and "chosen rank_to_gpu: [0, 4, 8, 12," in err[0]


def test_a_python_file_as_the_program_is_refused_naming_the_fix(tmp_path, capsys):
    """Newcomer trial: ``launch CONFIG -- train.py`` wrote a bind.sh whose ``exec "$@"`` fails on
    the cluster (train.py is no command on PATH); it is now one line naming PROGRAM and the
    command that runs, before anything is planned or written; ``-- python train.py`` writes."""
    from tests.cli_run import run_main

    out = tmp_path / "l"
    assert run_main("launch", CFG, "--out", out, "--", "train.py", "--job.config_file", "a b.toml") == 2
    assert capsys.readouterr().err == (
        "error: PROGRAM: 'train.py' is a Python file, but bind.sh execs the program as a command (torchrun "
        "--no-python), so it runs only if executable, with a #! line, and on PATH; give -- python train.py "
        "--job.config_file 'a b.toml'\n")
    assert not out.exists()
    assert run_main("launch", CFG, "--out", out, "--", "python", "train.py") == 0
    assert (out / "bind.sh").exists()


def test_rerun_replaces_meshplan_own_output_and_help_says_so(tmp_path, monkeypatch, capsys):
    """Newcomer finding: --help said the --out folder is "refused when it holds files unless --force",
    but a rerun without --partition silently replaced the earlier job.sbatch. That is the rule
    (README, Outputs): meshplan's own unchanged output under out/ is replaced, an edited file is
    refused; --help now says exactly that."""
    from typer.testing import CliRunner

    import meshplan.cli as cli
    from meshplan.cli import main
    monkeypatch.chdir(tmp_path)
    cfg = ROOT / "examples" / "mini_2x4_tp2-dp4.toml"
    sbatch = tmp_path / "out" / "launch" / "mini_2x4_tp2-dp4" / "job.sbatch"
    for extra in (["--partition", "gpu"], []):  # the second run replaces the first's output
        with pytest.raises(SystemExit) as e:
            main(["launch", str(cfg), *extra, "--", "python", "t.py"])
        assert e.value.code in (0, None)
    assert "#SBATCH --partition" not in sbatch.read_text()
    sbatch.write_text(sbatch.read_text() + "#SBATCH --partition=mine\n")  # edited: refused, kept
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["launch", str(cfg), "--", "python", "t.py"])
    assert e.value.code == 2 and "pass --force" in capsys.readouterr().err
    assert sbatch.read_text().endswith("#SBATCH --partition=mine\n")
    helptext = " ".join(CliRunner().invoke(cli.app, ["launch", "--help"], terminal_width=2000).output.split())
    assert ("(default: out/launch/ and CONFIG's name); a rerun replaces meshplan's own unchanged output under out/, "
            "and refuses any other of these files (an edited one, or one elsewhere) unless --force") in helptext


def test_a_refused_rerun_names_the_edited_files(tmp_path, monkeypatch, capsys):
    """Slurm user finding: after editing job.sbatch, the rerun said only `out/launch/e exists`. It now
    names what was edited since meshplan wrote it (the ledger's digest of each file differs), with
    the default folder and with --out naming it; the edits are kept; --force replaces them."""
    from meshplan.cli import main
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "e.toml"
    cfg.write_text((ROOT / "examples" / "mini_2x4_tp2-dp4.toml").read_text())
    folder = Path("out/launch/e")

    def rerun(*extra) -> tuple[int, str]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(["launch", str(cfg), *extra, "--", "python", "t.py"])
        return e.value.code or 0, capsys.readouterr().err
    assert rerun()[0] == 0
    with open(folder / "job.sbatch", "a") as f:
        f.write("#SBATCH --account=mine\n")
    assert rerun() == (2, "error: --out: out/launch/e exists: job.sbatch was edited since meshplan wrote it; choose "
                          "another path or pass --force to replace it (meshplan replaces only what it wrote under "
                          "out/ itself, unchanged since)\n")
    with open(folder / "bind.sh", "a") as f:
        f.write("# mine\n")
    assert rerun("--out", str(folder)) == (2, "error: --out: out/launch/e: bind.sh and job.sbatch were edited since "
                                              "meshplan wrote them; choose another folder or pass --force to "
                                              "replace it\n")
    assert (folder / "job.sbatch").read_text().endswith("#SBATCH --account=mine\n")
    assert rerun("--force")[0] == 0 and "--account=mine" not in (folder / "job.sbatch").read_text()
    assert rerun()[0] == 0  # meshplan's own again


def test_bind_sh_writes_nodes_alike_once_by_local_rank(tmp_path):
    """Newcomer finding: 4,096 ranks on 512 dgx-h100 wrote bind.sh as 18,449 lines (1.3 MB), one
    block per host though node-major bindings differ only by LOCAL_RANK. Nodes alike now share one
    ``case $LOCAL_RANK`` whose RANK check is GROUP_RANK x 8 + LOCAL_RANK; a node that differs (node 0
    with its GPUs reversed) keeps its own. Each run by sh, as torchrun's processes would."""
    big = (Path(write_launch(tmp_path / "big", place(system("dgx-h100", 512), 4096),
                             LaunchOptions(program=ECHO, cpu_bind="none"))[0])).read_text()
    assert big.count("\n") == 65 and sum(x.strip().startswith("expect ") for x in big.splitlines()) == 8
    r = _run_bind(tmp_path / "big", 511, 7, 4095, *ECHO)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["env"]["NCCL_IB_HCA"] == DGX_H100_HCAS
    r = _run_bind(tmp_path / "big", 300, 2, 2402, *ECHO)  # 300 x 8 + 2 = 2402, not 2403
    assert r.returncode == 0 and json.loads(r.stdout)["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    r = _run_bind(tmp_path / "big", 300, 2, 2403)
    assert r.returncode == 1 and "has RANK=2403, expected 2402" in r.stderr
    for group in ("512", "01", "x"):
        r = _run_bind(tmp_path / "big", group, 0, 0)
        assert r.returncode == 1 and f"no binding for node {group}" in r.stderr
    # node 0 reversed (rank r -> GPU 7 - r), nodes 1-3 as is: node 0's block, then the shared table
    p = place(system("dgx-h100", 4), 32, rank_to_gpu=[7 - r for r in range(8)] + list(range(8, 32)))
    text = Path(write_launch(tmp_path / "mixed", p, LaunchOptions(program=ECHO, cpu_bind="none"))[0]).read_text()
    assert "# nodes 1-3: the same bindings by LOCAL_RANK; RANK = GROUP_RANK x 8 + offset" in text.splitlines()
    exports = [x.split()[1] for x in text.splitlines() if x.strip().startswith("export ")]
    assert exports == ["CUDA_VISIBLE_DEVICES=7,6,5,4,3,2,1,0"] * 8 + ["CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7"] * 8
    assert json.loads(_run_bind(tmp_path / "mixed", 0, 2, 2, *ECHO).stdout)["env"]["CUDA_VISIBLE_DEVICES"] == "7,6,5,4,3,2,1,0"
    assert json.loads(_run_bind(tmp_path / "mixed", 3, 2, 26, *ECHO).stdout)["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"


def test_sbatch_finds_the_folder_from_the_submit_directory(tmp_path, monkeypatch):
    """Newcomer finding: job.sbatch ran torchrun.sh by the absolute path it was written at, which the
    compute nodes may not see. A relative --out (the default out/launch/<name>) is looked for under
    SLURM_SUBMIT_DIR, then the submit directory itself: the same file runs when submitted from where
    meshplan launch ran, from its own folder, and from a copy of the tree elsewhere; from anywhere
    else it stops with one line naming both places (fake srun prints what it runs)."""
    import shutil
    monkeypatch.chdir(tmp_path)
    write_launch(Path("out/launch/x"), place(system("dgx-h100", 2), 16), LaunchOptions(program=("python", "t.py")))
    text = (tmp_path / "out/launch/x/job.sbatch").read_text()
    assert str(tmp_path) not in text and "here=\"$submit\"/out/launch/x" in text.splitlines()
    _fake(tmp_path / "bin", "scontrol", 'printf "gpu-a\\ngpu-b\\n"')
    _fake(tmp_path / "bin", "srun", 'echo "$*"')
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "out", moved / "out")
    (tmp_path / "empty").mkdir()

    def submit(submit_dir: Path, script: Path) -> subprocess.CompletedProcess:
        env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[a-b]",
               "SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": str(submit_dir)}
        env.pop("MESHPLAN_LAUNCH_DIR", None)
        return subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, cwd=submit_dir,
                              timeout=30)
    for where, expect in ((tmp_path, tmp_path / "out/launch/x"), (tmp_path / "out/launch/x", tmp_path / "out/launch/x"),
                          (moved, moved / "out/launch/x")):
        r = submit(where, expect / "job.sbatch")
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[-1] == f"{expect}/torchrun.sh"
    r = submit(tmp_path / "empty", tmp_path / "out/launch/x/job.sbatch")
    assert r.returncode == 1 and r.stderr.startswith(f"meshplan job.sbatch: no torchrun.sh in {tmp_path}/empty/out/"
                                                     f"launch/x or {tmp_path}/empty on ")
    assert "a filesystem the compute nodes share" in r.stderr and len(r.stderr.splitlines()) == 1


def test_a_launch_folder_under_tmp_gets_a_note(tmp_path, capsys):
    """/tmp, /var/tmp and /dev/shm are each machine's own on a cluster: launch says so in one line on
    stderr (the files are still written); a folder elsewhere gets none."""
    from meshplan.cli import main
    from meshplan.placement.launch import local_folder_note
    assert local_folder_note("/var/tmp/a/../b") == (
        "note: /var/tmp/b is under /var/tmp, local to each machine on most clusters: the compute nodes run "
        "torchrun.sh and bind.sh from this folder, so write it (--out) on a filesystem they share")
    assert local_folder_note("/home/me/out/launch/x") is None and local_folder_note("/tmpfs/x") is None
    out = Path("/tmp") / f"meshplan-note-{os.getpid()}"
    try:
        with pytest.raises(SystemExit) as e:
            main(["launch", str(ROOT / "examples" / "mini_2x4_tp2-dp4.toml"), "--out", str(out), "--force", "--",
                  "python", "t.py"])
        assert e.value.code in (0, None)
        err = capsys.readouterr().err
        assert err.splitlines() == [local_folder_note(out)] and (out / "job.sbatch").exists()
    finally:
        import shutil
        shutil.rmtree(out, ignore_errors=True)
