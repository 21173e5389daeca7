"""place --bindings and launch's bind.sh write the same environment (newcomer trial 17: README said
so while place set CUDA_VISIBLE_DEVICES and NCCL_IB_HCA only, and launch also CUDA_DEVICE_ORDER and,
on a network oversubscribed between rails, NCCL_CROSS_NIC=0). One home:
meshplan.placement.nccl_env.rank_env; place's --visible one changes only CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import pytest

from meshplan.catalog import system
from meshplan.placement.assign import place
from meshplan.placement.bindings import all_bindings, to_sh
from meshplan.placement.launch import LaunchOptions, bind_script, launch_bindings


def _oversubscribed(nodes=2):
    """dgx-h100 with its spine 2:1 oversubscribed: NCCL_CROSS_NIC=0 (nccl_env.cross_nic)."""
    c = system("dgx-h100", nodes)
    spine = c.network[1].model_copy(update={"oversubscription": 2.0})
    return c.model_copy(update={"network": [c.network[0], spine]})


@pytest.mark.parametrize("cluster", [system("dgx-h100", 2), _oversubscribed()])
@pytest.mark.parametrize("scope", ["node", "rank"])
def test_place_all_and_launch_give_every_rank_the_same_env(cluster, scope):
    p = place(cluster, 16)
    placed = all_bindings(p, nic_scope=scope, visible="all")
    launched = launch_bindings(p, LaunchOptions(program=("python", "train.py"), nic_scope=scope))
    assert [b["env"] for b in placed] == [b["env"] for b in launched]
    crossed = cluster.network[1].oversubscription > 1 and scope == "node"
    assert all(("NCCL_CROSS_NIC" in b["env"]) == crossed for b in placed)
    assert all(b["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for b in placed)


def test_visible_one_changes_only_the_visible_devices():
    p = place(_oversubscribed(), 16)
    one, every = all_bindings(p, visible="one"), all_bindings(p, visible="all")
    assert [b["env"]["CUDA_VISIBLE_DEVICES"] for b in one[8:10]] == ["0", "1"]  # node 1's first two GPUs
    assert [{k: v for k, v in b["env"].items() if k != "CUDA_VISIBLE_DEVICES"} for b in one] == \
        [{k: v for k, v in b["env"].items() if k != "CUDA_VISIBLE_DEVICES"} for b in every]
    assert one[9]["env"]["NCCL_CROSS_NIC"] == "0"


def test_place_sh_exports_and_explains_the_same_variables():
    p = place(_oversubscribed(), 16)
    text = to_sh(p)
    assert "export CUDA_VISIBLE_DEVICES=\"5\" CUDA_DEVICE_ORDER=\"PCI_BUS_ID\" NCCL_IB_HCA=" in text
    assert 'NCCL_CROSS_NIC="0"' in text and "#   NCCL_CROSS_NIC: 0: a ring or tree keeps the same NIC" in text
    assert "#   CUDA_VISIBLE_DEVICES: the rank's own GPU only, which it uses as cuda:0 (place --visible one)" in text


def test_roce_nics_get_a_comment_and_no_invented_value():
    """nc61 #6: on RoCE NICs ([cluster] nic = { transport = "roce" }) launch wrote the same environment
    as on InfiniBand with nothing about the GID index or traffic class. NCCL's env docs: NCCL_IB_GID_INDEX
    defaults to -1 (picked from the link layer since NCCL 2.21) and NCCL_IB_TC to -1 (the device's); both
    are the site's switch settings, so bind.sh (and place's sh) gets one comment line and no variable."""
    from meshplan.placement.nccl_env import ROCE_NOTE

    ib = system("dgx-h100", 2)
    nics = [n.model_copy(update={"transport": "roce"}) for n in ib.node.nics]
    roce = ib.model_copy(update={"node": ib.node.model_copy(update={"nics": nics})})
    opts = LaunchOptions(program=("python", "train.py"))
    text = bind_script(place(roce, 16), opts)
    assert f"#   {ROCE_NOTE}" in text.splitlines() and f"#   {ROCE_NOTE}" in to_sh(place(roce, 16)).splitlines()
    assert ROCE_NOTE.startswith("RoCE: NCCL_IB_GID_INDEX (the RoCE v2 GID) and NCCL_IB_TC ") and "NCCL >= 2.21" in ROCE_NOTE
    assert "NCCL_IB_GID_INDEX=" not in text and "NCCL_IB_TC=" not in text  # no value invented
    assert "RoCE:" not in bind_script(place(ib, 16), opts)  # InfiniBand: no such line
    # the same environment as on InfiniBand: the note is a comment only
    assert [b["env"] for b in launch_bindings(place(roce, 16), opts)] == \
        [b["env"] for b in launch_bindings(place(ib, 16), opts)]
