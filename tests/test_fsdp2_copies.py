"""FSDP2's copy-out after each all-gather and copy-in before each reduce-scatter, on the
compute stream (meshplan.comm.fsdp2): the plan's rows carry them, torch runs one per call.

torch 2.13 names them with record_function: ``FSDP::all_gather_copy_out`` (in
``FSDPParamGroup.wait_for_unshard``) and ``FSDP::post_backward_reduce`` (``post_backward``, around
``foreach_reduce`` whose ``chunk_cat`` copy-in runs on the current stream). One step of the runtime's
model on the fake process group, profiled on the CPU, must show as many of each as the plan's
table has all-gathers and reduce-scatters with a copy, with and without reshard_after_forward.
"""

from collections import Counter
from math import ceil

import pytest

pytest.importorskip("torch")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from meshplan import catalog  # noqa: E402
from meshplan.comm.collectives import collective_table  # noqa: E402
from meshplan.compute.measured import kernel_data  # noqa: E402
from meshplan.mesh.resolve import resolve_mesh  # noqa: E402
from meshplan.placement.assign import place  # noqa: E402
from meshplan.runtime.validation.dryrun import dry_run  # noqa: E402
from meshplan.spec.mesh import MeshSpec  # noqa: E402
from meshplan.spec.model import ModelSpec  # noqa: E402
from meshplan.spec.training import TrainingSpec  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TINY = ModelSpec(name="tiny", layers=2, hidden=64, ffn=128, q_heads=4, kv_heads=2, vocab=256)
FP32 = dict(param_dtype="fp32", compute_dtype="fp32", reduce_dtype="fp32", recompute="none")


def _rows(model, training, mesh):
    cluster = catalog.system("dgx-h100", nodes=ceil(mesh.world / 8))
    return collective_table(model, training, mesh, cluster, place(cluster, mesh.world),
                            list(range(model.layers)), micro_batches=1)


@pytest.mark.parametrize("reshard", [True, False])
def test_one_copy_per_fsdp_collective_as_torch_runs_them(reshard):
    training = TrainingSpec(global_batch=8, seq_len=16, reshard_after_forward=reshard, **FP32)
    mesh = resolve_mesh(MeshSpec(names=["dp_shard"], shape=[8]), world=8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dry_run(TINY, training, mesh, rank=0, optimizer_step=False)
    ran = Counter(e.name.split(" (")[0] for e in prof.events() if e.name.startswith("FSDP::"))
    rows = [r for r in _rows(TINY, training, mesh) if r.axis == "dp_shard"]
    planned = Counter(r.op for r in rows if r.copy_s > 0 for _ in range(r.per_step))
    # 4 units as torchtitan wraps them (the embedding, 2 layers, [norm, output]): 4 forward
    # gathers, with reshard 3 backward re-gathers (the layers and the embedding; [norm, output]
    # stays gathered), 4 reduce-scatters
    assert planned == {"all-gather": 7 if reshard else 4, "reduce-scatter": 4}
    assert ran["FSDP::all_gather_copy_out"] == planned["all-gather"]
    assert ran["FSDP::post_backward_reduce"] == planned["reduce-scatter"]


def test_copy_seconds_of_a_llama3_8b_layer():
    """Llama 3 8B on 8 H100, FSDP2 over 8: a layer's 218,112,000 parameters gathered in bf16 and
    reduced in fp32. Copy-out 2 x 2 B x 218,112,000 / 2.97 TB/s (catalog Triad) = 293.8 us;
    copy-in (2 + 4) B x 218,112,000 / 2.97 TB/s = 440.6 us; every other row has none."""
    model = catalog.model("llama3-8b")
    training = TrainingSpec(global_batch=8, seq_len=8192, param_dtype="fp32", compute_dtype="bf16",
                            reduce_dtype="fp32", recompute="full")
    mesh = resolve_mesh(MeshSpec(names=["dp_shard"], shape=[8]), world=8)
    triad = kernel_data("h100-sxm5-80gb").stream_bytes_per_s
    assert triad == 2.97e12
    n = 218_112_000
    rows = {(r.phase, r.op, r.cadence): r for r in _rows(model, training, mesh)}
    layer = {k[:2]: r for k, r in rows.items() if k[2] == "every layer"}
    assert layer[("forward", "all-gather")].size_bytes == 2 * n
    assert layer[("forward", "all-gather")].copy_s == pytest.approx(2 * 2 * n / triad)
    assert layer[("backward", "all-gather")].copy_s == pytest.approx(2 * 2 * n / triad)
    assert layer[("backward", "reduce-scatter")].copy_s == pytest.approx(6 * n / triad)
    assert round(layer[("backward", "reduce-scatter")].copy_s * 1e6, 1) == 440.6
    others = [r for k, r in rows.items() if k[2] != "every layer" and not k[2].startswith("per root")]
    assert all(r.copy_s == 0 for r in others)
    assert all(r.host_s == 0 for r in rows.values())  # host issue time is DeepSpeed 2021's only


@pytest.mark.parametrize("reshard", [True, False])
def test_timeline_copies_out_only_after_a_gather(reshard):
    """The simulated step runs a backward copy-out (the compute before each layer's backward,
    ``L{i}`` of a B unit) only where the table has a backward all-gather: with
    reshard_after_forward false FSDP2 keeps the forward's unsharded parameters, so it neither
    gathers nor copies out again (torch runs 3 copy-outs there, not 5: the test above). Llama 3 8B
    cut to 4 layers on 8 H100, FSDP over 8, 2 micro-batches: 4 x 2 backward copy-outs of
    293.75 us each (at least: SM sharing with a collective only stretches them) or none."""
    from meshplan.config import config_from_dict
    from meshplan.plan import build_plan
    from meshplan.schedule.steptime import step_time

    cfg = config_from_dict({"model": {"catalog": "llama3-8b", "layers": 4}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 16, "seq_len": 4096, "reshard_after_forward": reshard},
                            "mesh": {"names": ["dp_shard"], "shape": [8]}})
    plan = build_plan(cfg)
    rows = plan.stage(0).collectives
    assert any(r.phase == "backward" and r.op == "all-gather" for r in rows) == reshard
    st = step_time(plan)
    copy_out = [e.end_s - e.start_s for e in st.trace_events(True)
                if e.args.get("unit", "").startswith("B") and e.name[1:].isdigit() and e.name[0] == "L"]
    if reshard:
        assert len(copy_out) == 4 * 2 and min(copy_out) >= 293.75e-6
    else:
        assert copy_out == []
