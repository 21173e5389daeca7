"""NCCL's network collectives hold SMs too (newcomer trial nc52, finding 6): the SM share of a
cross-node collective is its NCCL channels over the GPU's SMs, one thread block per channel, as
NVIDIA/nccl @5067397 sets the channel counts (meshplan.schedule.row_shares.nccl_net_channels)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as R

import pytest

from meshplan.catalog import system
from meshplan.config import load_config
from meshplan.schedule.row_shares import nccl_net_channels, nccl_sm_share

DATA = Path(__file__).parent / "data" / "nc52c"


def _row(kind: str, op: str):
    return R(path=R(kind=kind), op=op)


def test_dgx_h100_network_rings_hold_16_of_132_sms():
    """DGX H100, 8 ConnectX-7 NICs at 400 Gb/s = 50 GB/s, sm90, 132 SMs (catalog):
    - a ring over nodes: NCCL's search lays one ring per NIC (search.cc:827), 8; the
      communicator doubles them (connect.cc:457): 16 channels, 16 / 132 = 0.1212 (before: 0);
    - a send/recv to a peer on another node: ceil(50 / 14) = 4 channels (paths.cc:950,
      NCCL_P2P_PER_CHANNEL_NET_BW 14), 4 / 132 = 0.0303;
    - NVLink, unchanged: catalog nccl_channels 24 / 132 = 0.1818; inside the GPU 0."""
    c = system("dgx-h100", 4)
    share = nccl_sm_share(c)
    assert nccl_net_channels(c) == (16, 4)
    assert share(_row("network", "reduce-scatter")) == pytest.approx(16 / 132)
    assert share(_row("network", "all-gather")) == pytest.approx(0.1212, abs=1e-4)
    assert share(_row("network", "send/recv")) == pytest.approx(4 / 132)
    assert share(_row("nvlink", "all-gather")) == pytest.approx(24 / 132)
    assert share(_row("local", "all-gather")) == 0.0


def test_four_hdr_nics_per_a100_node_give_8_rings():
    """The docs' 4-NIC HGX A100 40GB node (tests/data/nc52c/job_z3_a100_4nic.toml, from the
    trial): 4 HDR NICs of 200 Gb/s = 25 GB/s, one per GPU pair, sm80, 108 SMs. Rings: 4 (one
    per NIC) x 2 = 8, no sm90 doubling (connect.cc:476 needs compute capability 9.0): 8 / 108 =
    0.0741. Send/recv: max(1 local NIC, ceil(25 / 14) = 2) = 2, 2 / 108 = 0.0185."""
    c = load_config(DATA / "job_z3_a100_4nic.toml").cluster
    share = nccl_sm_share(c)
    assert nccl_net_channels(c) == (8, 2)
    assert share(_row("network", "all-reduce")) == pytest.approx(8 / 108)
    assert share(_row("network", "send/recv")) == pytest.approx(0.0185, abs=1e-4)
