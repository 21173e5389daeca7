"""torch's sequence-parallel layout copies (meshplan.compute.dtensor_sp): with more than one
sequence per micro-batch, torch 2.13's functional all-gather on dim 1 ends with a
``cat(chunk(...))`` copy and its reduce-scatter on dim 1 starts with one
(``_maybe_view_chunk_cat``, ``_chunk_or_narrow_cat``).

Llama 3 8B at tp 8, 12 sequences of 8,192 tokens (torchtitan's async TP run of 2025-06):
each copy reads and writes 98,304 x 4,096 bf16 elements, 1,610,612,736 B, at the catalog's H100
Triad (2.97 TB/s, BabelStream, kernels.toml): 0.54229 ms. 8 per layer (4 forward, 4 backward).
"""

from __future__ import annotations

import pytest

from meshplan import catalog
from meshplan.compute import dtensor_sp
from meshplan.compute.layer import layer_cost
from meshplan.compute.ops import Workload
from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time

COPY_B = 2 * 12 * 8192 * 4096 * 2
COPY_S = COPY_B / 2.97e12
LLAMA, H100 = catalog.model("llama3-8b"), catalog.gpu("h100-sxm5-80gb")


def copies(w: Workload) -> list:
    return [o for o in layer_cost(LLAMA, H100, w).ops if o.name.startswith("SP layout copy")]


def workload(**kw) -> Workload:
    base = dict(seq_len=8192, micro_batch=12, tp=8, sp=True, sp_layout_copies=True, recompute="none")
    return Workload(**{**base, **kw})


def test_copies_by_hand():
    """8 copies per layer, each 1.61 GB at Triad; 4 forward, 4 in the input-gradient pass."""
    ops = copies(workload())
    assert COPY_B == 1_610_612_736
    assert len(ops) == 8
    assert all(o.size_bytes == COPY_B for o in ops)
    assert all(o.seconds == pytest.approx(COPY_S, rel=1e-12) for o in ops)
    assert sorted(o.phase for o in ops) == ["backward_input"] * 4 + ["forward"] * 4
    assert sorted({o.block for o in ops}) == ["attn", "mlp"]


def test_only_where_torch_rearranges():
    """None at one sequence (a view), under Megatron-LM ([s, b, h]: SP on dim 0), without SP;
    under torch's async TP 3 per block, all in the input-gradient pass: the weight gradients'
    reshape of the gathered input and of the gathered output gradient the fused all-gathers
    return as sequence-major views, and the unfused input-gradient reduce-scatter's cat. With
    full recompute none is replayed (the replay's fused all-gather returns the input the
    weight gradients copy once): 6 per layer either way, against 8 and 11 without async TP."""
    assert copies(workload(micro_batch=1)) == []
    assert copies(workload(sp_layout_copies=False)) == []
    assert copies(workload(sp=False)) == []
    fused = copies(workload(async_tp="torch"))
    assert [(o.name, o.phase) for o in fused if o.block == "attn"] == [
        ("SP layout copy (gathered input, attn)", "backward_input"),
        ("SP layout copy (gather, attn)", "backward_input"), ("SP layout copy (scatter, attn)", "backward_input")]
    assert len(fused) == 6 and all(o.size_bytes == COPY_B for o in fused)
    assert len(copies(workload(async_tp="torch", recompute="full"))) == 6


def test_full_recompute_replays_the_forward_copies():
    """Full recompute replays the forward with its gathers' and the attention's scatter copies,
    not the MLP's: torch's replay ends before the MLP's closing reduce-scatter, whose output only
    feeds the next layer (ops.full_ac_not_replayed): 8 + 3 = 11 per layer."""
    replayed = [o.name for o in copies(workload(recompute="full")) if o.recompute]
    assert replayed == ["SP layout copy (gather, attn) (recompute)", "SP layout copy (scatter, attn) (recompute)",
                        "SP layout copy (gather, mlp) (recompute)"]
    assert len(copies(workload(recompute="full"))) == 11


def _plan(micro_batch: int):
    t = {"global_batch": micro_batch * 8, "seq_len": 8192, "micro_batch": micro_batch, "sharding": "zero3",
         "recompute": "selective", "torch_compile": True}
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 8},
                            "training": t, "mesh": {"names": ["dp_shard", "tp"], "shape": [8, 8], "world": 64,
                                                    "sequence_parallel": True}})
    return build_plan(cfg)


def test_step_compute_grows_by_the_copies(monkeypatch):
    """The blocking step's compute part grows by 32 layers x 8 copies x 0.54229 ms = 138.83 ms,
    its exposed tp unchanged (the copies run on the compute stream, between collectives)."""
    p = _plan(12)
    with_copies = step_time(p).parts_s()
    monkeypatch.setattr(dtensor_sp, "applies", lambda *a: False)
    without = step_time(p).parts_s()
    assert with_copies["compute"] - without["compute"] == pytest.approx(32 * 8 * COPY_S, rel=1e-9)
    assert 32 * 8 * COPY_S == pytest.approx(0.13883, abs=1e-5)
    assert with_copies["exposed tp"] == pytest.approx(without["exposed tp"], rel=1e-12)
