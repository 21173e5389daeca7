"""`meshplan place` on the docs' 4-NIC HGX A100 node (one HDR NIC per GPU pair) no longer warns
"GPU k is not under NIC k ... bind GPU 1 to mlx5_0" when its own bindings already bind GPU 1 to
mlx5_0 (newcomer trial nc52, finding 17): the index map's miss is a note on the NIC decision."""

from __future__ import annotations

from pathlib import Path

from tests.cli_run import run_cli

JOB = Path(__file__).parent / "data" / "nc52c" / "job_z3_a100_80g_4nic.toml"  # fits: place exits 0


def test_four_nic_node_binds_pairs_without_a_warning(capsys):
    """NICs mlx5_0..3 serve GPUs [0,1], [2,3], [4,5], [6,7] (NodeSpec.nic_of: the NIC under the
    GPU's switch), so the bindings are 0:mlx5_0 1:mlx5_0 2:mlx5_1 3:mlx5_1 ... 7:mlx5_3. The index
    map local_rank % 4 gives GPU 1 mlx5_1, GPU 2 mlx5_2, GPU 3 mlx5_3, GPU 5 mlx5_1, GPU 6 mlx5_2,
    GPU 7 mlx5_3 (GPUs 0 and 4 land right): 6 GPUs on a farther NIC, said on the NIC line; the
    warnings section is empty, and rank 1's binding names mlx5_0."""
    rc, out, _ = run_cli(["place", JOB], capsys)
    assert rc == 0
    text = " ".join(out.split())
    assert "GPU:NIC 0:mlx5_0 1:mlx5_0 2:mlx5_1 3:mlx5_1 4:mlx5_2 5:mlx5_2 6:mlx5_3 7:mlx5_3" in text
    assert "GPU k is not under NIC k on a100-40g-4nic for 6 GPUs" in text
    assert "the bindings above do that" in text
    assert "warnings: (none)" in text
    assert "rank 1: node 0 LOCAL_RANK 1 RANK 1 GPU 1 (cuda:1) socket 0 NIC mlx5_0" in text
