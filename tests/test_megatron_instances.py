"""Megatron-LM's --num-distributed-optimizer-instances N (partial distributed optimizer) imported as
dp_replicate N x dp_shard dp / N (nc61 note; meshplan/interop/megatron_mesh.py with_instances).

Megatron-LM d98e8a6, megatron/core/parallel_state.py 921-1010: the optimizer's intra-instance group is
a contiguous slice of (dp x cp) / N ranks of the dp-cp group (cp fastest), the inter-instance group
every (dp x cp / N)-th rank; param_and_grad_buffer.py start_grad_sync reduce-scatters within an
instance, then all-reduces the reduced shard across the instances. train_llama3_70b.sh: 128 nodes x 8
GPUs = 1024 ranks, tp 8, pp 4, cp 1, so dp = 1024 / (8 x 4) = 32; with N = 4: dp_replicate 4 (outer)
x dp_shard 8 (inner, consecutive dp ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.config import config_from_dict
from meshplan.interop import megatron
from meshplan.interop.common import ImportOptions
from meshplan.plan import build_plan

SCRIPT = (Path(__file__).parent / "data" / "nc49" / "train_llama3_70b.sh").read_text()


def _read(extra: str):
    text = SCRIPT.replace("--use-distributed-optimizer", f"--use-distributed-optimizer {extra}")
    return megatron.read(text, ImportOptions(cluster="dgx-h100"))


def test_instances_split_dp_into_replicas_of_the_optimizer():
    imp = _read("--num-distributed-optimizer-instances 4")
    mesh = imp.tables["mesh"]
    assert (mesh["names"], mesh["shape"]) == (["pp", "dp_replicate", "dp_shard", "tp"], [4, 4, 8, 8])
    assert imp.tables["training"]["sharding"] == "zero1"
    assert any(n.startswith("--num-distributed-optimizer-instances 4: dp 32 = dp_replicate 4 x dp_shard 8")
               for n in imp.notes)
    assert not any("NOT modelled" in n and "instances" in n for n in imp.notes)


def test_the_plan_reduce_scatters_over_the_instance_and_all_reduces_across():
    """Stage 0 (pp 4, 4 virtual stages of 5 layers: 20 layers and the embedding) per rank at tp 8:
    20 x (855,638,016 / 8 + 2 x 8192) = 2,139,422,720 (tests/test_newcomer49_precision.py), plus the
    embedding 129,024 x 8192 / 8 = 132,120,576 (vocab 128,256 padded to a multiple of 128 x tp 8 =
    1,024: 126 x 1,024 = 129,024), P = 2,271,543,296 elements, fp32 for the reduction (--bf16
    without --grad-reduce-in-bf16): 9,086,173,184 B reduce-scattered over the 8 ranks of an instance
    (dp_shard, not all 32 of dp), then each rank's P / 8 x 4 B = 1,135,771,648 B all-reduced over the
    4 instances once a step."""
    p = 20 * (855_638_016 // 8 + 2 * 8192) + 129_024 * 8192 // 8
    assert p == 2_271_543_296
    plan = build_plan(config_from_dict(_read("--num-distributed-optimizer-instances 4").tables))
    rows = plan.stage(0).collectives
    rs = [r for r in rows if r.op == "reduce-scatter" and r.phase == "step"]
    ar = [r for r in rows if r.axis == "dp_replicate"]
    assert {r.group_size for r in rs} == {8} and sum(r.size_bytes * r.per_step for r in rs) == p * 4
    assert len(ar) == 1 and (ar[0].op, ar[0].group_size, ar[0].per_step, ar[0].dtype) == ("all-reduce", 4, 1, "fp32")
    assert ar[0].size_bytes == p * 4 // 8 == 1_135_771_648


@pytest.mark.parametrize("extra,why", [
    ("--num-distributed-optimizer-instances 1", "one instance: the plain distributed optimizer"),
    ("--num-distributed-optimizer-instances 3", "3 does not divide dp 32 (Megatron-LM refuses dp x cp % N)"),
])
def test_unmapped_instances_keep_dp(extra, why):
    mesh = _read(extra).tables["mesh"]
    assert (mesh["names"], mesh["shape"]) == (["pp", "dp", "tp"], [4, 32, 8]), why


def test_export_writes_the_instances_back():
    """export --to megatron of the imported mesh: one dp (4 x 8 = 32, inferred by Megatron-LM from the
    world) and --num-distributed-optimizer-instances 4, once (the user's flag not carried beside it);
    none for the plain distributed optimizer (one dp axis)."""
    from meshplan.interop.megatron_write import write
    cfg = config_from_dict(_read("--num-distributed-optimizer-instances 4").tables)
    out = write(cfg)
    assert [o for o in out if "instances" in o] == ["--num-distributed-optimizer-instances 4"]
    assert "--tensor-model-parallel-size 8" in out and "--pipeline-model-parallel-size 4" in out
    assert "--num-distributed-optimizer-instances" not in " ".join(write(config_from_dict(_read("").tables)))
