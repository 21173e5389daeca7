"""Issue 14 item 7: activation checkpointing as torchtitan configures it, beside Megatron-LM's.

Model G (4 layers, hidden 16, gated MLP 64, 4 heads of 4, 4 KV heads, bf16 activations,
flash attention, seq 8, micro-batch 1, tp 1). Kept per layer per micro-batch, by hand
(Korthikanti Table 2 terms, meshplan.memory.activations):

- none: attention 2 norm inputs/GEMM input 2 x 256, q k v 3 x 256, flash statistics
  4 x 4 x 8 = 128, context 256; MLP norm input and w_in input 2 x 256, gate, silu, up,
  w_out input 4 x (2 x 8 x 64 = 1024) = 6272 B;
- Megatron selective: the flash statistics recomputed too: 6144 B;
- full (Megatron --recompute-granularity full; torchtitan mode "full"): layer input 256 B;
- torchtitan per layer, ac_freq 2: torchtitan wraps the blocks whose 1-based count is a
  multiple of 2, i.e. layers 1 and 3: 6272, 256, 6272, 256;
- torchtitan per op: layer input 256, wq out 256, wv out 256, SDPA output 256 and its
  statistics 128, w1 (gate) out 1024, w2 (down) out 256 = 2432 B (every second mm, wk, wo,
  w3, is recomputed, as are the norms, RoPE and SiLU).
"""

import pytest

from meshplan.compute.recompute import OP_SAC_SAVED_GEMMS
from meshplan.errors import ConfigError
from meshplan.memory.sizes import stage_sizes
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.steptime import step_time

from tests.test_memory_timeline import plan_of

G = dict(layers=4, hidden=16, ffn=64, gated_mlp=True, q_heads=4, vocab=128)


def kept(plan):
    sz = stage_sizes(plan.config.model, plan.config.training, plan.mesh, plan.stages, plan.state[0],
                     plan.config.memory, [])
    return [sz.acts[i].saved for i in range(4)]


def test_kept_activations_by_hand():
    assert kept(plan_of(model=G, recompute="none")) == [6272] * 4
    assert kept(plan_of(model=G, recompute="selective")) == [6144] * 4
    assert kept(plan_of(model=G, recompute="full")) == [256] * 4
    assert kept(plan_of(model=G, recompute="layer", ac_freq=2)) == [6272, 256, 6272, 256]
    assert kept(plan_of(model=G, recompute="layer", ac_freq=3)) == [6272, 6272, 256, 6272]
    assert kept(plan_of(model=G, recompute="op")) == [2432] * 4


def test_recompute_time_per_policy():
    st = {rc: step_time(plan_of(model=G, recompute=rc, **kw), Overlap())
          for rc, kw in {"none": {}, "full": {}, "layer": {"ac_freq": 2}, "op": {}}.items()}
    full = st["full"].recompute_s()
    assert st["none"].recompute_s() == 0 and full > 0
    # per layer, every 2nd: 2 of the 4 layers replay their whole forward
    assert st["layer"].recompute_s() == pytest.approx(full / 2, rel=1e-12)
    # per op: the whole forward but the saved GEMMs (wq, wv, w_gate, w_down) and the attention kernel
    cost = st["op"].units.chunks[0][0].layers[0]
    skipped = sum(o.seconds for o in cost.ops if o.phase == "forward"
                  and (o.name in OP_SAC_SAVED_GEMMS or o.kind == "attention"))
    assert st["op"].recompute_s() == pytest.approx(full - 4 * skipped, rel=1e-12)
    assert 0 < st["op"].recompute_s() < full


def test_named_in_the_frameworks_words():
    lines = step_time(plan_of(model=G, recompute="layer", ac_freq=2), Overlap()).lines()
    line = [x for x in lines if x.startswith("recompute:")][0]
    assert 'torchtitan selective AC per layer (mode = "selective", selective_ac_option = "2"' in line
    selective = plan_of(model=G, recompute="selective").config.training.recompute_name  # framework torch
    assert "modelled as Megatron-LM's selective recompute" in selective and "torchtitan has no such option" in selective
    assert 'selective_ac_option = "op"' in plan_of(model=G, recompute="op").config.training.recompute_name


def test_peak_orders_policies():
    peak = {rc: plan_of(model=G, recompute=rc, **kw).timeline.peak.total_bytes
            for rc, kw in {"none": {}, "full": {}, "layer": {"ac_freq": 2}, "op": {}}.items()}
    assert peak["full"] < peak["op"] < peak["layer"] < peak["none"]


def test_errors():
    with pytest.raises(ConfigError, match="ac_freq is torchtitan's per-layer checkpointing interval"):
        plan_of(model=G, recompute="full", ac_freq=2)  # (ac_freq 1, the default, is accepted anywhere)
    with pytest.raises(ConfigError, match="training.recompute: 'op' .* cp = 1 only"):
        plan_of(model=G, recompute="op", mesh=dict(names=["cp"], shape=[2], world=2))
    # tp > 1 is planned as torchtitan applies TP, with sequence parallelism (tests/test_op_sac_tp.py)
    with pytest.raises(ConfigError, match="training.recompute: 'op' .* with tp > 1 is planned with sequence "
                                          "parallelism"):
        plan_of(model=G, recompute="op", mesh=dict(names=["tp"], shape=[2], world=2))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_per_layer_collectives_match_torch_checkpoint():
    """tp 2 + SP, 4 layers, ac_freq 2: the runtime model checkpoints layers 1 and 3
    (non-reentrant torch.utils.checkpoint with early_stop=False, as torchtitan wraps its blocks: 238fa99
    activation_checkpoint.py 45/135/154), whose replay runs the whole block and repeats all 4 of
    its forward TP collectives, the closing reduce-scatter after w_down included (with early_stop it
    stopped one short, 3 of 4); the table counts them per layer. Fake process group, torch 2.13."""
    pytest.importorskip("torch")
    from math import prod

    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.runtime.validation.compare import differences, tally_records, tally_table
    from meshplan.runtime.validation.dryrun import dry_run
    from meshplan.spec.mesh import MeshSpec
    from meshplan.spec.model import ModelSpec
    from meshplan.spec.training import TrainingSpec
    from tests.test_table_vs_torch import FP32, table_for

    model = ModelSpec(name="g4", layers=4, hidden=64, ffn=128, q_heads=4, kv_heads=2, vocab=256)
    counts = {}
    for rc in ("none", "layer"):
        training = TrainingSpec(global_batch=8, seq_len=16, **{**FP32, "recompute": rc},
                                **({"ac_freq": 2} if rc == "layer" else {}))
        mesh = resolve_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[4, 2], sequence_parallel=True), world=prod([8]))
        run = dry_run(model, training, mesh, rank=3, optimizer_step=False)
        recorded = tally_records(run.records, mesh, 3)
        assert differences(recorded, tally_table(table_for(model, training, mesh), mesh, 3)) == []
        counts[rc] = sum(n for (axis, phase, _, _, _), n in recorded.items() if axis == "tp" and phase == "backward")
    assert counts["layer"] - counts["none"] == 2 * 4  # two checkpointed layers replay 4 collectives each
