"""validate-slice warns when an axis's groups cross nodes in the slice but not at full scale
(newcomer trial 54 #3: tp 8 ran across the testbed's emulated NICs and was rejected as 1.57x
slower, while at full scale tp 8 is inside one NVLink node; nothing said the placement differed).
The configs are the trial's (tests/data/nc54b/slice_tp{8,4,2}.toml: Llama-3-70B on 32 x 8 H100)."""

from pathlib import Path

import numpy as np

from meshplan.config import load_config
from meshplan.mesh.resolve import resolved_mesh
from meshplan.runtime.validation.options import Options
from meshplan.runtime.validation.scaling import scale_config
from meshplan.runtime.validation.slice import SLICE_DEFAULTS, MeshResult, decide
from meshplan.runtime.validation.slice_choice import crossing_axes, full_scale, slice_only_words

DATA = Path(__file__).resolve().parent / "data" / "nc54b"


def _slice_crossing(name: str) -> list[str]:
    """The scaled mesh at world 8 on the trial's 2-node testbed: ranks node-major, 8 / 2 = 4 a node."""
    sc = scale_config(load_config(DATA / f"slice_{name}.toml"), 8, Options(**SLICE_DEFAULTS))[0]
    return crossing_axes(resolved_mesh(sc.mesh, 8), np.arange(8) // 4)


def test_tp8_crosses_nodes_only_in_the_slice():
    """Full scale: dp_shard 32 x tp 8 on 32 nodes of 8 GPUs (tp innermost): each tp group is one
    node's 8 GPUs, dp_shard spans the 32 nodes: only dp_shard crosses. Slice at world 8: tp8 scales
    to dp_shard 1 x tp 8, its one tp group [0..7] on nodes 0 and 1 (ranks 0-3, 4-7): tp crosses,
    only in the slice. tp4 scales to dp_shard 2 x tp 4: tp groups [0..3] and [4..7] inside a node,
    dp_shard groups (0, 4)... across: as at full scale, no warning."""
    for name in ("tp8", "tp4", "tp2"):
        assert full_scale(load_config(DATA / f"slice_{name}.toml"))["full_crossing"] == ["dp_shard"]
    assert _slice_crossing("tp8") == ["tp"]
    assert _slice_crossing("tp4") == _slice_crossing("tp2") == ["dp_shard"]


def test_a_mesh_rejected_on_the_slices_placement_says_so():
    """nc54's measured steps: slice_tp8 1991.9 ms, slice_tp4 1267.4 ms (chosen; 1991.9 / 1267.4 =
    1.57x); tp8's why names the placement; tp4's own why is unchanged."""
    fits = dict(full_feasible=True, full_peak_bytes=1.0, full_usable_bytes=2.0, full_verdict="feasible",
                full_crossing=["dp_shard"])
    tp8 = MeshResult("slice_tp8", "slice_tp8.toml", True, "", 1.2, 1.9919, **fits, slice_only_crossing=["tp"])
    tp4 = MeshResult("slice_tp4", "slice_tp4.toml", True, "", 1.0, 1.2674, **fits)
    assert decide([tp8, tp4]) is tp4
    assert tp8.why == ("measured 1991.9 ms, 1.57x the chosen slice_tp4's 1267.4 ms (the slice's placement: in "
                       "slice_tp8, tp crosses nodes in this slice (not at full scale): its measured time is not the "
                       "full-scale one)")
    assert tp4.why == "measured fastest (1267.4 ms) of the meshes that fit at full scale"
    assert slice_only_words(["tp", "cp"]) == ("tp and cp cross nodes in this slice (not at full scale): their "
                                              "measured time is not the full-scale one")
