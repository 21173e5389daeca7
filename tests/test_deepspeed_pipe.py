"""DeepSpeed's PipelineEngine and BF16_Optimizer per micro-batch (``training.pp_engine =
"deepspeed"``, :mod:`meshplan.compute.deepspeed_pipe`), values derived by hand from DeepSpeed v0.6.5's
source (``runtime/bf16_optimizer.py:390-407``, ``runtime/pipe/engine.py:639-1031``,
``runtime/utils.py:660-760``) and the catalog's A100 rates: BabelStream Triad 1.70 TB/s
(kernels.toml S3) and the 4.7 us issue floor."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.compute.deepspeed_pipe import engine_cost, hp_grad_ops
from tests.cli_run import run_cli

BLOOM = Path(__file__).resolve().parent.parent / "benchmarks" / "bloom" / "bloom-176b_384xa100_tp4-pp12-dp8.toml"
A100 = catalog.gpu("a100-sxm-80gb")
TRIAD, FLOOR = 1.70e12, 4.7e-6


def test_hp_grad_accumulation_of_one_bloom_stage():
    """update_hp_grads on BLOOM-176B's stage 1 (6 layers, tp 4, h = 14336), per micro-batch. Per
    layer, Megatron's GPT at tp 4 holds (local elements): query_key_value 3h x h / 4 = 154,140,672,
    dense (wo) h x h / 4 = 51,380,224, dense_h_to_4h 4h x h / 4 = 205,520,896, dense_4h_to_h the
    same: 616,562,688 weight elements; biases 3h/4 = 10,752, h, 4h/4 and h (14,336 each); two
    LayerNorms of weight and bias (4 x 14,336). Each tensor: a cast (6 B an element) and an add
    (12 B): the four weights move 18 x 616,562,688 = 11,098,128,384 B, 6.5283 ms at 1.70 TB/s; the
    8 small tensors' 16 kernels each sit at the 4.7 us floor (at most 57,344 x 12 B = 0.69 MB, 0.40
    us). A layer: 6.5283 + 16 x 0.0047 = 6.6035 ms; 6 layers: 39.621 ms."""
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.schedule.workload import deepspeed_pipe_costs, workload_of

    plan = build_plan(load_config(BLOOM))
    costs = deepspeed_pipe_costs(plan, workload_of(plan))
    hp = [o for o in costs[1].ops if "hp_grad" in o.name]
    assert len(hp) == 6 * 12 * 2
    weights = 18 * 616_562_688
    assert sum(o.size_bytes for o in hp) == pytest.approx(6 * (weights + 18 * (10_752 + 3 * 14_336 + 4 * 14_336)))
    assert sum(o.seconds for o in hp) == pytest.approx(6 * (weights / TRIAD + 16 * FLOOR), rel=1e-9)
    assert sum(o.seconds for o in hp) * 1e3 == pytest.approx(39.621, abs=1e-3)


def test_hp_grad_kernels_at_the_floor():
    """A tensor of 100 elements: the cast moves 600 B (0.35 ns at 1.70 TB/s), the add 1,200 B: both
    at the 4.7 us issue floor."""
    ops = hp_grad_ops(A100, [("b", 100, False)])
    assert [(o.size_bytes, o.seconds) for o in ops] == [(600, FLOOR), (1200, FLOOR)]


def test_partitioned_tensor_ops_by_stage_position():
    """BLOOM's activation, micro-batch 2 x seq 2048 x h 14336 x 2 B = 117,440,512 B; its tp 4 slice
    29,360,128 B. Middle stage forward: the received slice cloned (2 x 29,360,128 B), the input
    tuple cloned (the same), ``full()`` of the input (zeros 117,440,512, slice copy 2 x 29,360,128,
    clone 2 x 117,440,512) and the output's slice (2 x 29,360,128): 8 x 29,360,128 + 3 x
    117,440,512 = 587,202,560 B. Backward: ``full()`` of the output and of its gradient (2 x
    411,041,792 B) and the input gradient's slice (58,720,256 B): 880,803,840 B, with the re-gather
    given (1 ms). The first stage has no input ops, the last none of its output (no re-gather);
    the syncs: forward 3 (the ThroughputTimer's, input tolist, output to_meta), backward 3 on a
    middle stage. At tp 1 nothing is partitioned: the timer's sync alone (engine.py:640,
    utils/timer.py:173-178)."""
    act, part = 117_440_512, 29_360_128
    mid = engine_cost(A100, [], act, 4, False, False, 1e-3, False)
    fwd = [o for o in mid.ops if o.phase == "forward"]
    bwd = [o for o in mid.ops if o.phase == "backward_input"]
    assert sum(o.size_bytes for o in fwd) == 8 * part + 3 * act == 587_202_560
    assert sum(o.size_bytes for o in bwd) == 2 * (act + 2 * part + 2 * act) + 2 * part == 880_803_840
    assert [o.seconds for o in bwd if "re-gather" in o.name] == [1e-3]
    assert sum(o.kind == "overhead" for o in fwd) == 3 and sum(o.kind == "overhead" and "re-gather" not in o.name
                                                               for o in bwd) == 3
    first = engine_cost(A100, [], act, 4, True, False, 1e-3, False)
    last = engine_cost(A100, [], act, 4, False, True, 1e-3, False)
    assert not any(o.name.startswith(("input", "received")) for o in first.ops)
    assert not any(o.name.startswith("output") for o in last.ops)
    alone = engine_cost(A100, [("w", 10, False)], act, 1, False, False, 0.0, False).ops
    assert [(o.name, o.seconds) for o in alone] == [("ThroughputTimer.start synchronize", FLOOR)]


def test_bloom_step_moves_by_the_engine(capsys):
    """The BLOOM plan with ``pp_engine = "deepspeed"`` against ``"framework"``: each stage's
    forward + backward per micro-batch grows by its engine cost (stage 1: 39.62 ms of hp grads,
    0.50 ms of re-gather, 0.89 ms of copies and syncs, benchmarks/bloom_176b.py), about (m + p - 1) x
    41.0 ms = 139 x 41.0 = 5.70 s over the 1F1B step of m 128 and p 12; and its sends and receives are
    one blocking call each (serial_p2p): in the uniform simulation of F 1, B 3 at p 12, m 128 that
    adds 263 transfers to the step (582.90 against 569.75 at 0.05 a transfer), 263 x 4.707 ms (the
    plan's 29.4 MB send through a 100 Gb/s NIC shared by two GPUs) = 1.24 s: about 6.94 s in all
    (84.83 -> 91.91 s, 7.08 s, as the benchmark prints), between 6.5 and 7.5 s."""
    from dataclasses import replace

    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.schedule.steptime import step_time

    cfg = load_config(BLOOM)
    ds = step_time(build_plan(cfg)).step_s
    fw = step_time(build_plan(replace(cfg, training=cfg.training.model_copy(update={"pp_engine": "framework"})))).step_s
    assert 6.5 < ds - fw < 7.5


def test_pp_engine_needs_megatron_under_deepspeed(tmp_path, capsys):
    """``pp_engine = "deepspeed"`` without DeepSpeed's engine is a one-line error naming the field and
    the fix (a check across fields, as zero0_engine's: its line starts ``error: training:``)."""
    text = BLOOM.read_text().replace('zero12_engine = "deepspeed"\n', "")
    path = tmp_path / "bad.toml"
    path.write_text(text)
    rc, out, err = run_cli(["step", str(path)], capsys)
    assert rc != 0 and "Traceback" not in err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and line[0].startswith('error: training: pp_engine "deepspeed"')
    assert "zero12_engine" in line[0] and "remove pp_engine" in line[0]


def test_bloom_script_imports_deepspeed_pipeline(capsys):
    """BigScience's tr11-176B-ml command (tests/data/megatron_deepspeed/tr11_176b.sh, its ds config
    at ZeRO stage 0 with bf16) imports under DeepSpeed's PipelineEngine (``pp_engine = "deepspeed"``:
    --deepspeed without --no-pipeline-parallel), split as DeepSpeed's ``partition_balanced`` splits
    GPTModelPipe's 72 specs weighted by 'type:transformer|embedding' (the embedding, 70 layers, the
    tied embedding: 6 a stage, so [embed | 5], 10 x 6, [5 | embed], the README's table), without
    flash attention (no --use-flash-attn*: Megatron-DeepSpeed's CoreAttention), with ALiBi
    (--position-embedding-type alibi, BigScience's fork)."""
    script = Path(__file__).resolve().parent / "data" / "megatron_deepspeed" / "tr11_176b.sh"
    rc, out, err = run_cli(["import", "megatron", str(script), "--cluster", "dgx-a100"], capsys)
    assert rc == 0, err
    assert 'pp_engine = "deepspeed"' in out and "flash_attention = false" in out
    assert 'position_embedding = "alibi"' in out
    assert "pp_layer_split = [5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5]" in out


def test_serial_p2p_is_deepspeeds_train_schedule():
    """DeepSpeed's TrainSchedule (v0.6.5 runtime/pipe/schedule.py:182-250) at p 2, m 2, F 1, B 2 and
    0.5 s a transfer, each send and receive a blocking call of its own (p2p.py: dist.send /
    dist.recv). By hand, in its instruction order: stage 0 F0 [0, 1]; its send of F0's output meets
    stage 1's receive at 1: [1, 1.5]; F1 [1.5, 2.5]; stage 1 F0 [1.5, 2.5], B0 [2.5, 4.5]; stage 0's
    send of F1 meets stage 1's receive at 4.5: [4.5, 5]; then stage 0 receives B0's gradient, which
    stage 1 sends next: [5, 5.5]; stage 0 B0 [5.5, 7.5]; stage 1 F1 [5.5, 6.5], B1 [6.5, 8.5], its send
    [8.5, 9]; stage 0 B1 [9, 11]: 11.0 s. Megatron-LM's combined calls (a send and a receive at once)
    give 10.5. The event simulation and the array path agree."""
    from meshplan.pipeline.fast import simulate_arrays
    from meshplan.pipeline.sim_types import PipelineSpec
    from meshplan.pipeline.simulate import simulate

    for serial, want in ((True, 11.0), (False, 10.5)):
        spec = PipelineSpec("1f1b", p=2, m=2, forward_s=1.0, backward_s=2.0, p2p_s=0.5, blocking_p2p=True,
                            serial_p2p=serial)
        assert simulate(spec).step_s == simulate_arrays(spec).step_s == want
    per_boundary = PipelineSpec("1f1b", p=4, m=8, forward_s=1.0, backward_s=3.0, p2p_s=(0.05, 0.02, 0.07, 0.0),
                                blocking_p2p=True, serial_p2p=True)
    assert simulate(per_boundary).step_s == pytest.approx(simulate_arrays(per_boundary).step_s, abs=1e-12)


def test_alibi_bias_in_baddbmm():
    """ALiBi without flash attention (BigScience's Megatron-DeepSpeed: the bias as baddbmm's input,
    beta 1; torch copies the expanded input into the scores, then the batched GEMM reads it as C).
    BLOOM's layer at tp 4, micro-batch 2: 2 x 112 / 4 = 56 score matrices of 2048 x 2048 in bf16,
    234,881,024 elements: the copy writes 469,762,048 B and reads the [56, 1, 2048] source,
    229,376 B (469,991,424 B, 0.27647 ms at 1.70 TB/s); the C read 469,762,048 B (0.27633 ms);
    each in forward and in its recompute: 1.1056 ms a layer a micro-batch. A RoPE model has neither."""
    from meshplan.compute.layer import layer_cost
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.schedule.workload import workload_of

    plan = build_plan(load_config(BLOOM))
    model, w = plan.config.model, workload_of(plan)
    ops = [o for o in layer_cost(model, A100, w).ops if o.name.startswith("alibi")]
    assert sorted((o.name, o.size_bytes, o.recompute) for o in ops) == [
        ("alibi bias copy (baddbmm beta 1)", 469_991_424, False),
        ("alibi bias copy (baddbmm beta 1) (recompute)", 469_991_424, True),
        ("alibi bias read as C (baddbmm beta 1)", 469_762_048, False),
        ("alibi bias read as C (baddbmm beta 1) (recompute)", 469_762_048, True)]
    assert sum(o.seconds for o in ops) * 1e3 == pytest.approx(2 * (469_991_424 + 469_762_048) / TRIAD * 1e3, rel=1e-9)
    assert sum(o.seconds for o in ops) * 1e3 == pytest.approx(1.1056, abs=1e-4)
    rope = model.model_copy(update={"position_embedding": "rope"})
    assert not [o for o in layer_cost(rope, A100, w).ops if o.name.startswith("alibi")]


def test_validate_refuses_alibi():
    """validate's torch model has RoPE or learned positions: an ALiBi model is refused with its fix."""
    from meshplan.config import config_from_dict
    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.runtime.validation.refusals import runtime_refusals
    from meshplan.runtime.validation.scaling import config_mesh

    model = {"layers": 2, "hidden": 256, "ffn": 1024, "gated_mlp": False, "q_heads": 4, "vocab": 1024,
             "norm": "layernorm", "position_embedding": "alibi", "source": "test"}
    cfg = config_from_dict({"model": model, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 128}, "mesh": {"names": ["dp"], "shape": [8]}})
    reasons = runtime_refusals(cfg, resolve_mesh(config_mesh(cfg), 8))
    assert [r for r in reasons if r.startswith("model.position_embedding is 'alibi'")] == [
        "model.position_embedding is 'alibi': validate's model runs RoPE or learned positions, not an ALiBi bias on "
        "the scores; set position_embedding = \"rope\" to validate this mesh"]


def test_bloom_exports_to_megatron_deepspeed_and_back(tmp_path, capsys):
    """``export --to megatron`` of the BLOOM plan writes Megatron-DeepSpeed's flags: the split as
    BigScience's --pp-partition-method 'type:transformer|embedding' (Megatron-DeepSpeed has no
    --decoder-first/last-pipeline-num-layers), ALiBi as --position-embedding-type alibi, no
    --attention-backend (not in its parser; without a flash switch it runs CoreAttention); imported
    back: the same split, engine, positions and attention."""
    out = tmp_path / "bloom.args"
    rc, _, err = run_cli(["export", str(BLOOM), "--to", "megatron", "-o", str(out)], capsys)
    assert rc == 0, err
    text = out.read_text()
    assert "--pp-partition-method 'type:transformer|embedding'" in text and "--position-embedding-type alibi" in text
    assert "--decoder-first-pipeline-num-layers" not in text and "--attention-backend" not in text
    rc, toml, err = run_cli(["import", "megatron", str(out), "--cluster", "dgx-a100", "--nodes", "48"], capsys)
    assert rc == 0, err
    for line in ("pp_layer_split = [5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5]", 'pp_engine = "deepspeed"',
                 'position_embedding = "alibi"', "flash_attention = false"):
        assert line in toml


def test_search_rows_leave_the_pipeline_engine_outside_zero0_and_zero1():
    """A Megatron-DeepSpeed config under DeepSpeed's PipelineEngine searched: its zero2 and zero3 rows
    run without it (the engine asserts ZeRO stage < 2; Megatron-DeepSpeed's --no-pipeline-parallel),
    so their training is valid; its zero1 rows keep it."""
    from meshplan.search.candidate import sharding_knobs, sharding_training
    from meshplan.spec.training import TrainingSpec

    t = TrainingSpec(global_batch=8, seq_len=16, framework="megatron", sharding="zero1", zero12_engine="deepspeed",
                     pp_engine="deepspeed")
    assert sharding_knobs(t, "zero2")["pp_engine"] == sharding_knobs(t, "zero3")["pp_engine"] == "framework"
    assert "pp_engine" not in sharding_knobs(t, "zero1")
    for sharding in ("zero2", "zero3"):
        knobs = sharding_training(t, sharding).model_dump(exclude_unset=True)
        TrainingSpec(**knobs)  # validates: no pp_engine "deepspeed" beside ZeRO-2/3
