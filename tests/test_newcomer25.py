"""Findings of newcomer trial 25 (an H100 RoCE cluster's ``--topology``): each test failed before its fix.

#1: ``--topology`` dropped the catalog node's measured busbw curves (``node_from_topology`` built
the node without ``busbw``), so ``plan`` of llama3-70b on 64 x dgx-h100 (dp_shard 128 x tp 4)
timed its tp all-gather at 242.3 us instead of 291.2 us (busbw 415.5 instead of 345.7 GB/s) with
the same node's topology, and said nothing. The curves are now kept; the NVLink ones (``nvlink``,
``nvls``) are dropped only when the topology's GPU-GPU links are not the node's NVLink, in one note.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.catalog import node
from meshplan.config import load_config
from meshplan.placement.topology import load_topology, parse_nvidia_smi_topo
from meshplan.placement.topology_node import node_from_topology, nvlink_difference, topology_notes
from meshplan.plan import build_plan
from tests.cli_run import run_main

ROOT = Path(__file__).parent.parent
TOPO = Path(__file__).parent / "data" / "topo"


@pytest.fixture(scope="module")
def chosen(tmp_path_factory) -> Path:
    """The newcomer's CHOSEN mesh: the dp16-tp8 example at 64 nodes, dp_shard 128 x tp 4."""
    text = (ROOT / "examples" / "llama3-70b_128xh100_dp16-tp8.toml").read_text()
    for old, new in (("nodes = 16", "nodes = 64"), ("shape = [16, 8]", "shape = [128, 4]"),
                     ("global_batch = 16", "global_batch = 128")):
        assert old in text
        text = text.replace(old, new)
    path = tmp_path_factory.mktemp("n25") / "chosen.toml"
    path.write_text(text)
    return path


def _times(cfg, node_spec=None) -> list[tuple[str, str, str, float]]:
    if node_spec is not None:
        cfg = replace(cfg, cluster=cfg.cluster.model_copy(update={"node": node_spec}))
    return [(r.axis, r.phase, r.op, r.time_s) for r in build_plan(cfg).collectives["stage 0"]]


@pytest.mark.parametrize("name", ["dgx-h100-like_topo-m.txt", "dgx-h100-like_topo.xml"])
def test_shipped_topology_keeps_the_measured_curves(chosen, name):
    cfg = load_config(chosen)
    base = cfg.cluster.node
    n = node_from_topology(load_topology(TOPO / name), base)
    assert n.busbw == base.busbw and sorted(n.busbw) == ["nic", "nvlink", "nvls"]
    plain, topo = _times(cfg), _times(cfg, n)
    assert topo == plain
    first = {(a, ph, op): t for a, ph, op, t in reversed(plain)}  # each kind's first row
    # the values `plan CHOSEN` prints without --topology (dgx-h100's measured curves)
    assert round(first[("tp", "forward", "all-gather")] * 1e6, 1) == 291.2
    assert round(first[("dp_shard", "forward", "all-gather")] * 1e6, 1) == 4856.3
    assert not any("dropped" in line for line in topology_notes(load_topology(TOPO / name), base, n))


def test_no_nvlink_drops_the_nvlink_curves_in_one_note(chosen):
    cfg = load_config(chosen)
    base = cfg.cluster.node
    topo = load_topology(TOPO / "nccl-1405_topo-m.txt")  # GPUs on PCIe only (PIX/SYS)
    n = node_from_topology(topo, base)
    assert sorted(n.busbw) == ["nic"]
    assert nvlink_difference(topo, base) == "GPUs 0 and 1 are joined by PIX, not NVLink"
    assert topology_notes(topo, base, n)[0] == (
        "nccl-1405_topo-m.txt: GPUs 0 and 1 are joined by PIX, not NVLink: dgx-h100's measured nvlink and nvls busbw "
        "curves (measured on its NVLink) are dropped; its intra-node collectives are timed at the fabric's line rate "
        "(nvlink4, 450 GB/s)")
    # the same times as dgx-h100 without its NVLink curves: the network curve stays
    no_nvlink = base.model_copy(update={"busbw": {"nic": base.busbw["nic"]}})
    assert _times(cfg, n) == _times(cfg, no_nvlink.model_copy(update={"sockets": n.sockets, "nics": n.nics}))


def _two_gpus(level: str) -> str:
    return f"\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \t{level}\t0-7\t0\nGPU1\t{level}\t X \t0-7\t0\n"


@pytest.mark.parametrize("level,why", [
    ("NV18", None),
    ("NV8", "GPUs are joined by NV8, dgx-h100 by NV18"),      # an H800's 8 links
    ("SYS", "GPUs 0 and 1 are joined by SYS, not NVLink"),
])
def test_nvlink_difference_by_link_count(level, why):
    base = node("dgx-h100").model_copy(update={"gpus": 2, "nvlink_domain_gpus": 2})
    assert nvlink_difference(parse_nvidia_smi_topo(_two_gpus(level)), base) == why


def test_unequal_nvlink_counts_are_not_an_nvswitch():
    rows = [[" X " if i == j else ("NV4" if {i, j} == {0, 1} else "NV18") for j in range(3)] for i in range(3)]
    text = "\tGPU0\tGPU1\tGPU2\n" + "".join(f"GPU{i}\t" + "\t".join(r) + "\n" for i, r in enumerate(rows))
    base = node("dgx-h100").model_copy(update={"gpus": 3, "nvlink_domain_gpus": 3})
    assert nvlink_difference(parse_nvidia_smi_topo(text), base) == (
        "GPU pairs have different NVLink counts: NV18 (0-2), NV4 (0-1), not one NVSwitch count")


def test_plan_prints_the_dropped_curves_note(chosen, capsys):
    assert run_main("plan", chosen, "--topology", TOPO / "nccl-1405_topo-m.txt") == 0
    err = capsys.readouterr().err
    assert err.count("are dropped") == 1
    assert "note: nccl-1405_topo-m.txt: GPUs 0 and 1 are joined by PIX, not NVLink: dgx-h100's measured" in err
