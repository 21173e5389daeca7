"""The machine at hand as a cluster: ``world`` ranks sharing this machine's cores, with the
per-core compute, memory bandwidth and loopback constants of ``cpu_testbed.toml`` (each with
its source there). ``meshplan validate`` predicts CPU runs on it; the netns testbed
(:mod:`meshplan.runtime.testbed.run`) builds its nodes from it.
"""

from __future__ import annotations

import os
import tomllib
from importlib import resources
from typing import Optional

from meshplan.spec.cluster import ClusterSpec, GPUSpec, LinkSpec, NodeSpec, SocketSpec


def cpu_cluster(world: int, cores: Optional[int] = None) -> tuple[ClusterSpec, str]:
    """One-node cluster of ``world`` ranks on this machine's cores (``cpu_testbed.toml``)."""
    data = tomllib.loads(resources.files(__package__).joinpath("cpu_testbed.toml").read_text())
    core, lo = data["core"], data["loopback"]
    cores = cores or len(os.sched_getaffinity(0))
    share = min(1.0, cores / world)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu = GPUSpec(name=f"{core['name']} x{share:.3g}", peak_tflops={"fp32": core["peak_fp32_tflops"] * share},
                  hbm_gb=mem / world / 1e9, hbm_bandwidth_tb_per_s=core["memory_bandwidth_gb_per_s"] * share / 1e3,
                  sms=1, max_gemm_fraction=1.0, source=core["source"])
    link = LinkSpec(name=lo["name"], bandwidth_gb_per_s=lo["bandwidth_gb_per_s"] * share,
                    latency_us=lo["latency_us"], source=lo["source"])
    node = NodeSpec(name="cpu-testbed", gpus=world, fabric=link, pcie=link,
                    sockets=[SocketSpec(gpus=list(range(world)), cores=cores)], nics=[],
                    source="meshplan/runtime/testbed/cpu_testbed.toml")
    why = (f"CPU testbed: {world} ranks on {cores} cores, each rank min(1, {cores}/{world}) = {share:.3g} of a "
           f"core: {core['peak_fp32_tflops'] * share * 1e3:.1f} GFLOP/s fp32 peak, "
           f"{core['memory_bandwidth_gb_per_s'] * share:.2f} GB/s memory, loopback {lo['bandwidth_gb_per_s'] * share:.3f}"
           f" GB/s and {lo['latency_us']:g} us per step; {mem / world / 2**30:.2f} GiB of RAM per rank")
    return ClusterSpec(name=f"cpu-testbed-{world}", collective_library="gloo", gpu=gpu, node=node, nodes=1, network=[],
                       source=why), why
