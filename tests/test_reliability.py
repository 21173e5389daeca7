"""Reliability: failure rate from Llama 3, Young/Daly intervals, Daly goodput, checkpoint
size from the persistent state, failure domains, and restarting on fewer nodes."""

import dataclasses
import json
from math import exp, prod, sqrt
from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.checkpoint_bytes import CheckpointSize, checkpoint_size, write_time_s
from meshplan.memory.state import state_bytes
from meshplan.mesh.resolve import resolve_mesh
from meshplan.mesh.tpsplit import local_numel
from meshplan.mesh.layers import stage_layers
from meshplan.plan import build_plan
from meshplan.plan_runtime import run_reasons
from meshplan.reliability import (DEFAULT_RATE_PER_GPU_DAY, daly_interval_s, failure_domains, goodput,
                                  interruptions_per_day, mtbf_s, reliability, young_interval_s)
from meshplan.restart import restart_on_fewer_nodes
from meshplan.config import load_config
from meshplan.spec.accuracy import REMESH_MARGIN
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from tests.cli_run import run_cli


def test_llama3_rate():
    """arXiv 2407.21783 3.3.4: 419 unexpected interruptions, 54 days, 16,384 GPUs."""
    assert DEFAULT_RATE_PER_GPU_DAY == 419 / (54 * 16384)
    assert interruptions_per_day(16384) == pytest.approx(419 / 54)  # 7.76 a day
    assert mtbf_s(16384) == pytest.approx(54 * 86400 / 419)  # 3.09 h
    assert interruptions_per_day(64) == pytest.approx(64 * 419 / (54 * 16384))
    assert mtbf_s(64, rate_per_gpu_day=0.01) == pytest.approx(86400 / 0.64)


def test_young_and_daly():
    c, m = 60.0, 3600.0
    assert young_interval_s(c, m) == pytest.approx(sqrt(2 * 60 * 3600))  # 657.3 s
    x = c / (2 * m)
    assert daly_interval_s(c, m) == pytest.approx(sqrt(2 * c * m) * (1 + sqrt(x) / 3 + x / 9) - c)  # 617.9 s
    assert daly_interval_s(8000, 3600) == 3600  # C >= 2M: the interval is M
    assert daly_interval_s(1e-3, 1e6) == pytest.approx(young_interval_s(1e-3, 1e6), rel=1e-3)


def test_goodput_hand_value_and_optimum():
    t, c, r, m = 600.0, 60.0, 300.0, 36000.0
    assert goodput(t, c, r, m) == pytest.approx(t / (m * exp(r / m) * (exp((t + c) / m) - 1)))  # 0.8933
    assert goodput(t, c, r, m) == pytest.approx(0.8933, abs=1e-4)
    best = daly_interval_s(c, m)
    for other in (best / 3, best / 1.5, best * 1.5, best * 3):
        assert goodput(best, c, r, m) >= goodput(other, c, r, m)
    assert goodput(600.0, 0.0, 0.0, 1e12) == pytest.approx(1.0, abs=1e-6)  # no cost, no failures


def test_checkpoint_size_c9_tiny_gpt():
    """C9 tiny GPT, tp 2, pp 2, dp 4, zero1. Per rank (stage 1): params 3488 x 2 B + master
    ceil(3488/4) x 4 B + Adam ceil(3488/4) x 8 B = 6976 + 3488 + 6976 = 17440 B (gradients
    not saved). Total: each shard once: tp x fsdp pieces per stage =
    stage 0 (3456 x 2) x 2 + (864 x 12) x 2 x 4 = 96768; stage 1 13952 + 83712 = 97664."""
    tiny = ModelSpec(layers=4, hidden=16, ffn=64, gated_mlp=False, q_heads=4, vocab=32,
                     tied_embeddings=True, norm="layernorm")
    mesh = resolve_mesh(MeshSpec(names=["pp", "dp", "tp"], shape=[2, 4, 2]), world=16)
    train = TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", vocab_pad_divisor=1)
    size = checkpoint_size(state_bytes(tiny, mesh, train, stage_layers(4, 2)), mesh)
    assert size.per_rank_bytes == 17440
    assert size.total_bytes == 96768 + 97664
    assert size.total_bytes == (3456 + 3488) * 2 * (2 + 4 + 8)  # = every tp rank's params x 14 B


def test_write_time():
    s = CheckpointSize(per_rank_bytes=2e9, total_bytes=1e12)
    assert write_time_s(s, 100e9) == 10.0
    assert write_time_s(s, 100e9, per_rank_bandwidth_bytes_per_s=0.1e9) == 20.0


def test_failure_domains_with_leaf_switches():
    cluster = catalog.system("dgx-h100", 64)
    doms = {d.name: (d.count, d.gpus_each) for d in failure_domains(cluster, 512)}
    assert doms["gpu"] == (512, 1) and doms["node"] == (64, 8)
    leaf = [d for d in cluster.network if d.nodes_per_domain]
    if leaf:
        n = leaf[0].nodes_per_domain
        assert doms[leaf[0].name] == (-(-64 // n), n * 8)


def test_partial_last_leaf_is_counted_as_the_job_fills_it():
    """Newcomer finding: 256 GPUs on 32 dgx-a100 (superpod-hdr-su20: 20 nodes under a leaf) printed
    ``leaf 2 x 160 GPU``, 320 GPUs for a 256-GPU job. Node-major ranks fill leaf 0 with nodes
    0-19 (160 GPUs) and leaf 1 with the other 12 nodes (96 GPUs)."""
    doms = {d.name: d for d in failure_domains(catalog.system("dgx-a100", 32), 256)}
    leaf = doms["leaf"]
    assert (leaf.count, leaf.gpus_each, leaf.gpus_last) == (2, 160, 96)
    assert leaf.text == "leaf 1 x 160 GPU + 1 x 96 GPU (the last leaf partial)"
    assert (leaf.count - 1) * leaf.gpus_each + leaf.gpus_last == 256
    assert doms["node"].text == "node 32 x 8 GPU"  # full nodes: one count
    # 12 GPUs on 8-GPU nodes: one full node and a half one
    assert failure_domains(catalog.system("dgx-a100", 2), 12)[1].text == "node 1 x 8 GPU + 1 x 4 GPU (the last node partial)"


def test_reliability_of_the_seed_plan(seed_path):
    plan = build_plan(load_config(seed_path))
    r = reliability(plan, write_bandwidth_bytes_per_s=50e9, read_bandwidth_bytes_per_s=100e9,
                    restart_overhead_s=600)
    assert r.checkpoint.total_bytes == pytest.approx(plan.config.model.param_count(128256) * (4 + 8), rel=0.01)
    assert r.write_s == pytest.approx(r.checkpoint.total_bytes / 50e9)
    assert r.restart_s == pytest.approx(600 + r.checkpoint.total_bytes / 100e9)
    assert r.interval_s == pytest.approx(daly_interval_s(r.write_s, r.mtbf_s))
    assert 0.9 < r.goodput < 1
    text = "\n".join(r.lines())
    assert "2407.21783" in text and "Daly" in text and "Young" in text


def _mesh(names, shape):
    return resolve_mesh(MeshSpec(names=names, shape=shape), world=prod(shape))


def test_restart_seed_mesh_loses_a_node():
    """Seed (dp_shard 8, tp 8, global batch 512), one node lost: 56 GPUs, tp 8 kept, dp <= 7.
    512 = 2^9: dp 7, 6 and 5 give no whole number of micro-batches (issue 11: dp_shard 7 was
    proposed); dp 4 keeps the contract, 512 / 4 = 128 micro-batches, on 32 GPUs (24 idle).
    Without an evaluator the meshes keeping the global batch rank by GPUs: dp 4, 2, 1; dp 7
    is the alternative changing it to 73 x 7 = 511. The shards change (DCP reshards);
    per-rank data-loader state cannot go from dp 8 to dp 4."""
    r = restart_on_fewer_nodes(_mesh(["dp_shard", "tp"], [8, 8]), 1, gpus_per_node=8, global_batch=512,
                               micro_batch=1)
    assert r.feasible and r.gpus_left == 56 and r.new_world == 32 and r.shape == (4, 8) and r.changed == ("dp_shard",)
    assert r.batch_contract and r.contract == "" and r.micro_batches == (64, 128)
    assert [(p.dp, p.micro_batches, p.global_batch) for p in r.proposals] == [(4, 128, 512), (2, 256, 512),
                                                                              (1, 512, 512), (7, 73, 511)]
    assert r.proposals[-1].contract == "global_batch 512 -> 511"
    assert r.reshard and not r.dataloader_ok
    assert r.refused[0] == ("dp_shard 7 x tp 8 (56 GPUs): global_batch 512 is not divisible by micro_batch 1 x dp 7 "
                            "= 7 (the alternative below changes the global batch)")
    text = "\n".join(r.lines())
    assert r.lines()[0] == ("restart: world 64 -> 32 (56 GPUs left); mesh dp_shard 8 x tp 8 -> dp_shard 4 x tp 8 "
                            "(shrunk: dp_shard 8 -> 4; kept: tp 8); not " + r.refused[0])
    assert "runner-up" not in text  # one alternative at most (rs8): the larger mesh at another global batch
    assert ("- with a different global batch (changes the optimisation): dp_shard 7 x tp 8 on 56 GPUs, global_batch "
            "512 -> 511") in text
    assert ("- 24 of the 56 GPUs left sit idle (spares for the next failure): the mesh takes nodes 0-3 of the 7 nodes "
            "left (node-major); idle: nodes 4-6") in text
    assert "- global batch 512 = micro_batch 1 x dp 4 x 128 micro-batches" in text
    assert "DCP" in text and "cannot be resharded" in text
    g = restart_on_fewer_nodes(_mesh(["dp_shard", "tp"], [8, 8]), 4, gpus_per_node=8, global_batch=512,
                               micro_batch=1, dataloader_state="global")
    assert g.shape == (4, 8) and g.batch_contract and g.micro_batches == (64, 128) and g.dataloader_ok


def test_restart_hsdp_drops_replicas_without_resharding():
    r = restart_on_fewer_nodes(_mesh(["dp_replicate", "dp_shard", "tp"], [4, 2, 8]), 2, gpus_per_node=8,
                               global_batch=480, micro_batch=1)
    assert r.shape == (3, 2, 8) and r.changed == ("dp_replicate",) and not r.reshard
    assert r.micro_batches == (60, 80) and r.batch_contract


def test_restart_with_spares_and_impossible_restarts():
    m = _mesh(["pp", "dp_shard", "tp"], [2, 4, 8])
    same = restart_on_fewer_nodes(m, 1, gpus_per_node=8, global_batch=64, micro_batch=1, spare_nodes=1)
    assert same.shape == (2, 4, 8) and not same.changed and not same.reshard
    # 56 GPUs left, pp 2 x tp 8 = 16 per replica: dp <= 3, but 64 / 3 is not whole; dp 2 (64 / 2 = 32) on 32 GPUs,
    # 24 idle: the first 4 of the 7 nodes; dp 3 on 48 GPUs is the alternative with global batch 21 x 3 = 63
    idle = restart_on_fewer_nodes(m, 1, gpus_per_node=8, global_batch=64, micro_batch=1)
    assert idle.gpus_left == 56 and idle.new_world == 32 and idle.shape == (2, 2, 8) and idle.batch_contract
    assert idle.notes[0] == ("24 of the 56 GPUs left sit idle (spares for the next failure): the mesh takes nodes 0-3 "
                             "of the 7 nodes left (node-major); idle: nodes 4-6")
    assert [(p.shape, p.contract) for p in idle.proposals] == [((2, 2, 8), ""), ((2, 1, 8), ""),
                                                               ((2, 3, 8), "global_batch 64 -> 63")]
    # fewer GPUs than one model replica: no mesh
    bad = restart_on_fewer_nodes(m, 7, gpus_per_node=8, global_batch=64, micro_batch=1)
    assert not bad.feasible and "fewer than tp 8 x pp 2 x cp 1 = 16" in bad.reasons[0]
    ok = restart_on_fewer_nodes(m, 2, gpus_per_node=8, global_batch=64, micro_batch=1)
    assert ok.shape == (2, 2, 8) and ok.batch_contract and ok.new_world == ok.gpus_left - 16 == 32


def test_restart_keeps_the_schedules_micro_batch_rule():
    """pp 2 x dp 4 x tp 8 loses 2 nodes: dp <= 3, global batch 9. Interleaved 1F1B under
    Megatron-LM needs pp | m: dp 3 gives m 3 (odd), dp 1 gives m 9 (odd), dp 2 does not divide
    9: no mesh keeps the global batch; the largest, dp 3, runs with 2 micro-batches: global
    batch 1 x 3 x 2 = 6, said with the schedule's reason. Under torch (one round of 3) dp 3
    keeps it."""
    m = _mesh(["pp", "dp_shard", "tp"], [2, 4, 8])
    why = lambda fw: (lambda pp, mm: run_reasons("interleaved_1f1b", pp, mm, 2, 1, fw))
    meg = restart_on_fewer_nodes(m, 2, gpus_per_node=8, global_batch=9, micro_batch=1, micro_batch_reasons=why("megatron"))
    assert meg.feasible and meg.shape == (2, 3, 8) and meg.micro_batches == (2, 2) and not meg.batch_contract
    assert meg.contract == "global_batch 9 -> 6" and [p.dp for p in meg.proposals] == [3]
    assert ("- global batch 6 = micro_batch 1 x dp 3 x 2 micro-batches (global_batch 9 -> 6: as configured, "
            "interleaved 1F1B needs micro-batches (3) divisible by pp (2) (Megatron-LM); no mesh of these GPUs keeps "
            "the global batch, a different one changes the optimisation)") in meg.lines()
    tor = restart_on_fewer_nodes(m, 2, gpus_per_node=8, global_batch=9, micro_batch=1, micro_batch_reasons=why("torch"))
    assert tor.batch_contract and tor.shape == (2, 3, 8) and tor.micro_batches == (2, 3)


def test_restart_expert_mesh_must_still_divide():
    """dp_shard 4 x tp 2, ep 8 on 2-GPU nodes loses one: 6 GPUs, dp <= 3; the dense block
    dp_shard x tp is 6, 4 or 2, never a multiple of 8: no mesh, one line with the reasons."""
    m = resolve_mesh(MeshSpec(names=["dp_shard", "tp", "ep"], shape=[4, 2, 8]), world=8)
    r = restart_on_fewer_nodes(m, 1, gpus_per_node=2, global_batch=64, micro_batch=1)
    assert not r.feasible and r.names == ("dp_shard", "tp") and r.gpus_left == 6
    assert r.reasons[0] == ("dp_shard 3 x tp 2 x ep 8 (6 GPUs): ep(8) * etp(1) = 8 does not divide dp_shard(3) * "
                            "tp(2) = 6; rule: (dp_shard * cp * tp) % (ep * etp) == 0")
    assert len(r.reasons) == 3 and r.lines()[0].startswith("restart: world 8 -> 6: no mesh to restart on (dp_shard 3")


def test_restart_keeps_the_global_batch_with_a_smaller_micro_batch():
    """dp_shard 8 on 2-GPU nodes losing one: 6 GPUs, global batch 60, micro_batch 4. dp 6:
    60 / (4 x 6) = 2.5; micro_batch 3 (18) does not divide 60, 2 (12) does: the global batch
    is kept with micro_batch 4 -> 2, 5 micro-batches. dp 5: 60 / 20 = 3, as configured; dp 4:
    micro_batch 3 (60 / 12 = 5); dp 3: 60 / 12 = 5 as configured. Ranked by GPUs."""
    r = restart_on_fewer_nodes(_mesh(["dp_shard"], [8]), 1, gpus_per_node=2, global_batch=60, micro_batch=4)
    assert r.shape == (6,) and not r.batch_contract and r.contract == "micro_batch 4 -> 2"
    assert [(p.dp, p.micro_batch, p.micro_batches, p.contract) for p in r.proposals] == [
        (6, 2, 5, "micro_batch 4 -> 2"), (5, 4, 3, ""), (4, 3, 5, "micro_batch 4 -> 3"), (3, 4, 5, "")]
    assert ("- global batch 60 = micro_batch 2 x dp 6 x 5 micro-batches (micro_batch 4 -> 2: the global batch is kept)"
            in r.lines())
    assert "- runner-up: dp_shard 5 on 5 GPUs, contract kept" in r.lines()


def test_checkpoint_counts_each_replicated_kv_head_once():
    """Handed case C6: 8 q / 2 KV heads of 8, h 64, ffn 128 (SwiGLU), vocab 256 untied, 1
    layer, tp 4 (KV heads replicated 2x), DDP. Per rank: wq 64 x 64 / 4 = 1024, wk + wv one
    head each 2 x 8 x 64 = 1024, wo 1024, MLP 3 x 128 x 64 / 4 = 6144, norms 3 x 64 = 192,
    embedding and output 256 x 64 / 4 = 4096 each: 17600 elements, 14 B each in the
    checkpoint (bf16 param 2 + fp32 master 4 + Adam 8). Every tp rank's state: 4 x 17600 x 14
    = 985,600 B; the 4 ranks hold 4 KV heads' wk/wv (4096 elements) of which 2 heads (2048)
    are distinct: 985,600 - 2048 x 14 = 956,928 B. (The norms are still counted on every tp
    rank: 3 x 192 x 14 = 8064 B above the model's 67,776 params x 14 = 948,864 B.) The DCP
    share per rank is the total over the 4 ranks."""
    m = ModelSpec(layers=1, hidden=64, ffn=128, q_heads=8, kv_heads=2, head_dim=8, vocab=256)
    mesh = resolve_mesh(MeshSpec(names=["tp"], shape=[4]), world=4)
    train = TrainingSpec(global_batch=4, seq_len=16, sharding="none", vocab_pad_divisor=1, param_dtype="bf16")
    states = state_bytes(m, mesh, train, stage_layers(1, 1))
    assert states[0].params.total == 17600 and m.param_count() == 67776
    assert checkpoint_size(states, mesh).total_bytes == 4 * 17600 * 14 == 985600  # every copy counted
    size = checkpoint_size(states, mesh, m)
    assert size.total_bytes == 985600 - 2048 * 14 == 956928
    assert size.total_bytes - 67776 * 14 == 3 * 192 * 14
    assert size.per_rank_bytes == 17600 * 14  # a rank still holds (and reads back) its copy
    assert size.written_per_rank_bytes == 956928 / 4
    # no copies at tp 2 (one KV head per rank): the model changes nothing
    mesh2 = resolve_mesh(MeshSpec(names=["tp"], shape=[2]), world=2)
    s2 = state_bytes(m, mesh2, train, stage_layers(1, 1))
    assert checkpoint_size(s2, mesh2, m) == checkpoint_size(s2, mesh2)


def test_reliability_c6_405b_shape_counts_eight_kv_heads():
    """128 q / 8 KV heads (Llama 3 405B), tp 16 under framework megatron: Megatron-LM's QKV
    sub-sharding (spec/axes/tp_kv.py) holds no KV copy, each rank 1/16 of wk and wv (8 x 128 x
    16384 / 16 = 1,048,576 elements each), so the checkpoint is every rank's state as it is: the
    total with the model equals the total without it. (Before, the copies' model: each rank one
    whole head, less 126 x 8 x 4,194,304 x 12 B = 50.7 GB of copies.)"""
    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "llama3-405b_16384xh100_tp8-pp16-dp128.toml")
    # framework megatron: torch refuses tp past the KV heads (rule torch_kv_heads: torchtitan replicates none)
    cfg = dataclasses.replace(cfg, mesh=cfg.mesh.model_copy(update={"shape": [16, 64, 16]}),
                              training=cfg.training.model_copy(update={"framework": "megatron"}))
    plan = build_plan(cfg)
    rel = reliability(plan, write_bandwidth_bytes_per_s=1e12, read_bandwidth_bytes_per_s=1e12, restart_overhead_s=60)
    assert checkpoint_size(plan.state, plan.mesh).total_bytes == rel.checkpoint.total_bytes
    wk = next(t for t in plan.config.model.layer_tensors(0) if t.name == "wk")
    assert local_numel(wk, plan.config.model, 16, framework="megatron") == 8 * 128 * 16384 // 16 == 1_048_576


def _reliability_cli(capsys, *extra):
    from meshplan.cli import main
    cfg = Path(__file__).resolve().parents[1] / "examples" / "mixtral-8x7b_32xh100_ep8-dp32.toml"
    with pytest.raises(SystemExit) as done:
        main(["reliability", str(cfg), "--write-gbps", "10", "--read-gbps", "10", "--restart-overhead-s", "300",
              *extra])
    out = capsys.readouterr()
    return done.value.code or 0, out.out, out.err


def test_restart_with_no_gpu_left_is_one_line_and_exit_1(capsys):
    """Newcomer finding (issue 11 items 2, 3): losing all 4 nodes of a 32-GPU job printed
    'mesh dp_shard 32 -> dp_shard 32 (unchanged)', then 'infeasible: 0 GPUs left', exit 0;
    and the leaf domain was printed as the switch's 32 nodes x 8 = 256 GPUs, not the job's 32."""
    rc, out, err = _reliability_cli(capsys, "--lost-nodes", "4")
    assert rc == 1
    assert "failure domains: gpu 32 x 1 GPU; node 4 x 8 GPU; leaf 1 x 32 GPU\n" in out
    restart = [line for line in out.splitlines() if line.startswith("restart:")]
    assert restart == ["restart: world 32 -> 0: no GPU left to restart on (0 GPUs left are fewer than tp 1 x pp 1 "
                       "x cp 1 = 1)"]
    assert "unchanged" not in out and "infeasible" not in out
    assert err == ("infeasible: restart after losing 4 of 4 nodes (0 spare): 0 GPUs left are fewer than tp 1 x pp 1 "
                   "x cp 1 = 1\n")
    rc, out, err = _reliability_cli(capsys, "--lost-nodes", "1")  # dp_shard 16 x ep 8: test_restart_mixtral_*
    assert (rc, err) == (0, "")
    assert ("restart: world 32 -> 24; mesh dp_shard 32 x ep 8 -> pp 3 x dp_shard 8 x ep 8 (shrunk: dp_shard "
            "32 -> 8; grown: pp 1 -> 3; kept: ep 8)") in out


def test_default_restart_scenario_informs_without_failing_a_one_node_job(capsys):
    """A one-node job under the default scenario (--lost-nodes not given, 1): losing the only node
    leaves no GPU; the report says so in its restart line and exits 0, while the same scenario
    asked for with --lost-nodes 1 is exit 1 (the restart asked for is a verdict)."""
    from meshplan.cli import main
    cfg = Path(__file__).resolve().parents[1] / "examples" / "mini_2x4_tp2-dp4.toml"  # 1 dgx-h100 node, 8 GPUs
    base = ["reliability", str(cfg), "--write-gbps", "10", "--read-gbps", "10",
            "--restart-overhead-s", "300"]
    codes = []
    for extra in ([], ["--lost-nodes", "1"]):
        with pytest.raises(SystemExit) as done:
            main(base + extra)
        out = capsys.readouterr()
        codes.append(done.value.code or 0)
        restart = [line for line in out.out.splitlines() if line.startswith("restart:")]
        assert restart and restart[0].startswith("restart: world 8 -> 0: no GPU left to restart on"), out
    assert codes == [0, 1]


def _example_plan(name, shape=None, world=None, nodes=None):
    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / name)
    if shape:
        cfg = dataclasses.replace(cfg, mesh=cfg.mesh.model_copy(update={"shape": shape, "world": world}),
                                  cluster=cfg.cluster.model_copy(update={"nodes": nodes}))
    return build_plan(cfg)


def _mixtral_24(names, shape):
    """The Mixtral example on 3 nodes (24 GPUs) as ``names``/``shape``, pp 3 with layers [11, 11, 10]."""
    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "mixtral-8x7b_32xh100_ep8-dp32.toml")
    mesh = {"names": names, "shape": shape, "world": 24, "pp_layer_split": [11, 11, 10]}
    return build_plan(dataclasses.replace(cfg, mesh=cfg.mesh.model_copy(update=mesh),
                                          cluster=cfg.cluster.model_copy(update={"nodes": 3})))


def test_restart_mixtral_keeps_ep_and_the_global_batch(capsys, tmp_path):
    """Mixtral dp_shard 32 x ep 8 (32 layers), global batch 256, one of 4 nodes lost: 24 GPUs.
    ep 8 needs dp_shard x cp a multiple of 8, 256 / dp whole: at cp 1 dp 8 or 16 (24 is not
    whole). pp 1: dp_shard 16 on 16 GPUs; pp 2 x dp_shard 8 on 16; pp 3 x dp_shard 8 on all 24,
    layers balanced_split(32, 3) = [11, 11, 10], 32 micro-batches (>= pp 3); at cp 2 (twice the
    configured 1; 4096 % 4 == 0) pp 3 x dp_shard 4 x cp 2 on all 24 too, 64 micro-batches.
    The plans rank pp 3 x dp_shard 8 first (its step is the plan's own: an independent
    build_plan + step_time of each mesh) and cp 2 the runner-up; no GPU idle. What puts cp 2
    second is torch's CP ring (meshplan.compute.ring_attention), eager (no torch_compile) under
    full AC: per layer and micro-batch on cp rank 1, local Q n_q = 32 heads x 2048 x 128 =
    8,388,608 elements, K and V 2 n_q (repeat_kv), forward merge n_q (12 + 38) + 2 n_q x 8 =
    553,648,128 B (replayed once more by the recompute), backward n_q (10 + 20) + 2 n_q (24 + 17 +
    16) = 1,207,959,552 B; stage 0's 11 layers x 64 micro-batches at the H100's Triad 2.97 TB/s
    (kernels.toml) add 0.549 s to cp 2's compute (its step 9.55 s), against 9.10 s for pp 3 x
    dp_shard 8 (9.104 s, 115,172 tokens/s, as docs/commands.md's sample), which has no ring; without that term cp 2 would be first (the proposal before the
    ring was counted, 1d93a21). Since torch's ring traffic is the table's too (issue 11, cp_attention
    "ring": spec.axes.cp.ring_rows) cp 2 also exposes each layer's last fp32 dK/dV shift: 9.70 s, and
    it stays second without the merge term (9.15 s). (kvheads: the ring's K/V are the 8 KV heads the SDPA
    reads, ``[memory] kv_expanded`` false: n_kv = 8 x 2048 x 256 = n_q / 2, and the block is cp rank 0 (its
    slower SDPA now outweighs rank 1's extra merge bytes, test_ring_attention.test_small_blocks_at_the_kv_heads_by_hand):
    forward n_q (12 + 27) + n_kv x 8 = 43 n_q = 360,710,144 B (replayed once more), backward n_q (20 + 13) +
    n_kv (24 + 10 + 4 + 16) = 60 n_q = 503,316,480 B: 64 x 11 x 146 n_q / 2.97 TB/s = 0.290 s. cp 2 9.28 s
    (its cp traffic a half), pp 3 x dp_shard 8 9.07 s (the repeat_kv copies gone): cp 2 still second, and
    without the ring's kernels it would be first again (8.99 s): they order the two, as before the traffic
    was counted.)"""
    from meshplan.compute.kernel_fragment import kernel_data
    from meshplan.schedule.rank_timeline import Overlap
    from meshplan.schedule.steptime import step_time
    from meshplan.schedule.workload import chunk_costs, workload_of
    rc, out, err = _reliability_cli(capsys, "--lost-nodes", "1", "--json", str(tmp_path / "r.json"))
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("restart:"))
    assert lines[head] == ("restart: world 32 -> 24; mesh dp_shard 32 x ep 8 -> pp 3 x dp_shard 8 x ep 8 "
                           "(shrunk: dp_shard 32 -> 8; grown: pp 1 -> 3; kept: ep 8)")
    old = step_time(_example_plan("mixtral-8x7b_32xh100_ep8-dp32.toml"), Overlap())
    new_plan = _mixtral_24(["pp", "dp_shard", "ep"], [3, 8, 8])
    new = step_time(new_plan, Overlap())
    assert lines[head + 1] == (f"- planned step {new.step_s:.2f} s, {new.tokens_per_s:,.0f} tokens/s, memory peak "
                               f"{new_plan.timeline.peak.total_bytes / 2 ** 30:.1f} GiB: "
                               f"{1 - new.tokens_per_s / old.tokens_per_s:.1%} of the throughput lost (the 32-GPU "
                               f"plan: step {old.step_s:.2f} s, {old.tokens_per_s:,.0f} tokens/s)")
    cp_plan = _mixtral_24(["pp", "dp_shard", "cp", "ep"], [3, 4, 2, 8])
    cp = step_time(cp_plan, Overlap())
    assert lines[head + 2] == (f"- runner-up: pp 3 (11 layers per stage, 10 on the last) x dp_shard 4 x cp 2 x ep 8 "
                               f"on 24 GPUs, contract kept: step "
                               f"{cp.step_s:.2f} s, {cp.tokens_per_s:,.0f} tokens/s")
    # the term that orders them: the ring's bytes on cp 2's critical stage 0, derived in the docstring
    ring = [o for chunk in chunk_costs(cp_plan, workload_of(cp_plan))[0] for layer in chunk.layers
            for o in layer.ops if o.name.startswith("cp ring")]
    per_layer = 360_710_144 + 360_710_144 + 503_316_480  # 146 n_q (docstring, kvheads)
    assert len(ring) == 3 * 11 and sum(o.size_bytes for o in ring) == 11 * per_layer
    ring_s = 64 * sum(o.seconds for o in ring)
    assert ring_s == pytest.approx(64 * 11 * per_layer / kernel_data(cp_plan.config.cluster.gpu).stream_bytes_per_s)
    assert round(ring_s, 3) == 0.290 and cp.critical_stage == 0
    # kvheads: 8.994 < 9.074 < 9.284 s (9.104 < 9.154 < 9.703 s at the q heads, where the exposed traffic ordered them)
    assert cp.step_s - ring_s < new.step_s < cp.step_s
    assert (round(cp.step_s - ring_s, 3), round(new.step_s, 3), round(cp.step_s, 3)) == (8.994, 9.074, 9.284)
    # the job's kind (dp_shard x ep 8, pp 1): dp_shard 16 keeps 256 (the 9th proposal; pp 3 on 24 GPUs plans more
    # than REMESH_MARGIN, 29.4%, over it: passed over, the only restart of these three examples that still remeshes);
    # dp_shard 24 on all 24 GPUs needs global batch 256 // 24 x 24 = 240 and its experts efsdp 24 / 8 = 3, which
    # divides neither expert_ffn 14336 (3 x 4778 + 2) nor hidden 4096 (3 x 1365 + 1): refused, on a line of its own
    assert lines[head + 3].startswith("- the job's kind (pp 1, tp 1, cp 1 and ep 8 kept, only the data axes shrunk; "
                                      "tried first): dp_shard 16 x ep 8 on 16 GPUs plans ")
    assert lines[head + 4] == (
        "- refused: the job's kind dp_shard 24 x ep 8 (24 GPUs, global_batch 256 -> 240): routed experts sharded on "
        "dim 1 (efsdp 3 x ep 8 > experts 8, torchtitan's shard_placement_fn): expert_ffn 14336 / etp 1 and hidden "
        "4096 must both divide by efsdp 3; FSDP2 refuses uneven sharding on dim 1 (torch NotImplementedError)")
    assert lines[head + 5:head + 7] == [
        "- global batch 256 = micro_batch 1 x dp 8 x 32 micro-batches",
        "- pipeline: pp 1 -> 3, layers per stage 11 x 2, 10"]  # pp 1 ran no schedule: none named
    doc = json.loads((tmp_path / "r.json").read_text())["restart"]
    assert doc["refused"] == [lines[head + 4][len("- refused: "):]]
    kind16 = next(p for p in doc["proposals"] if (p["names"], p["shape"]) == (["dp_shard"], [16]))
    gain = new.tokens_per_s / kind16['tokens_per_s'] - 1
    assert gain > REMESH_MARGIN  # 24 GPUs against the kind's 16: 44.5% (ideal 24 / 16 - 1 = 50%, less pp 3's bubble)
    assert lines[head + 3] == (f"- the job's kind (pp 1, tp 1, cp 1 and ep 8 kept, only the data axes shrunk; tried "
                               f"first): dp_shard 16 x ep 8 on 16 "
                               f"GPUs plans {kind16['tokens_per_s']:,.0f} tokens/s; passed over: pp 3 (11 layers per "
                               f"stage, 10 on the last) x dp_shard 8 x ep 8 on 24 GPUs plans {new.tokens_per_s:,.0f} tokens/s, "
                               f"{gain:.1%} more, over the 29.4% remesh margin (the step model's largest mean "
                               "error when it was set, docs/fidelity.md); it is the proposal")
    assert (doc["shape"], doc["ep"], doc["new_world"], doc["gpus_left"], doc["contract"]) == ([3, 8], 8, 24, 24, "")
    assert doc["proposals"][0]["tokens_per_s"] == new.tokens_per_s and doc["old_step_s"] == old.step_s


def _deepseek_restart(rule=True, evaluate=True):
    from meshplan.restart import pipeline_rule, plan_evaluator
    plan = _example_plan("deepseek-v3_2048xh100_pp16-ep64-dp128.toml")
    t = plan.config.training
    why = lambda pp, m: run_reasons(plan.spec.pp_schedule, pp, m, plan.vpp, t.pp_schedule_runs, t.framework)
    return plan, restart_on_fewer_nodes(plan.mesh, 1, gpus_per_node=8, global_batch=15360, micro_batch=1,
                                        micro_batch_reasons=why, pipeline=pipeline_rule(plan) if rule else None,
                                        evaluate=plan_evaluator(plan, 255) if evaluate else None)


def test_restart_deepseek_v3_varies_pp():
    """Issue 11 (trial 3 finding 1, trial 5 item 1): DeepSeek-V3 pp 16 x dp_shard 128 x ep 64 on
    256 nodes loses one: 2040 GPUs. pp kept (16), ep 64 needs dp_shard a multiple of 64 and
    15360 / 127 is not whole: dp_shard 64 on 1024 GPUs, 1016 idle. pp varied (DCP and
    Megatron dist-checkpointing reshard on load): the pp whose 61 layers split balanced enough
    (test_restart_pp_splits_offer_dense_first_and_all_layers: 1-9, 11, 13, 16, 21, 22, 31-33,
    61). dp = 64 k with k | 240 (15360 = 64 x 240), pp k <= 2040 / 64 = 31.9: pp 31 x dp 64 (k 1,
    240 micro-batches) uses the most, 1984 GPUs; then 1920 GPUs (pp k = 30) at pp 1, 2, 3, 5, 6
    (k 30, 15, 10, 6, 5; pp 10, 15 and 30 split unbalanced); then pp 7 x k 4 = 28 (1792 GPUs), pp
    9 x k 3 = 27 (1728), pp 13 x k 2 = 26 (1664). Without an evaluator ranked by GPUs, then the
    ideal throughput 1920 m / (m + pp - 1), m = 240 / k: 1920, 1807, 1772, 1745, 1739, and the
    first split of a mesh (at pp 31 the one left, 2 x 30, 1: the ends-short 1, 3, 2 x 28, 1 is
    63 / (31 x 3) = 0.68 balanced). No mesh changing the global batch uses more than 1984 GPUs
    (pp 1 x dp 1984 = 31 x 64 ties): no alternative."""
    _, kept = _deepseek_restart(rule=False, evaluate=False)
    assert kept.shape == (16, 64) and kept.new_world == 1024 and kept.changed == ("dp_shard",)
    _, r = _deepseek_restart(evaluate=False)
    assert [(p.pp, p.dp, p.gpus) for p in r.proposals[:9]] == [
        (31, 64, 1984), (1, 1920, 1920), (2, 960, 1920), (3, 640, 1920), (5, 384, 1920), (6, 320, 1920),
        (7, 256, 1792), (9, 192, 1728), (13, 128, 1664)]
    by_pp = {p.pp: p for p in r.proposals}
    assert 30 not in by_pp and by_pp[2].pp_layer_split == (31, 30)
    assert by_pp[31].pp_layer_split == (2,) * 30 + (1,)
    assert r.changed == ("pp", "dp_shard") and r.shape == (31, 64)
    assert all(p.keeps_global_batch for p in r.proposals)
    # the largest mesh refused: pp 1 (shown, as pp is an axis) on all 2040 GPUs, not a multiple of ep 64
    assert r.refused[0].startswith("pp 1 x dp_shard 2040 x ep 64 (2040 GPUs): ep(64) * etp(1) = 64 does not divide")
    assert "pipeline: pp 16 -> 31, layers per stage 3, 4 x 14, 2 -> 2 x 30, 1 (the schedule kept)" in r.notes
    assert any(n.startswith("checkpoint: resharded on load (pp, dp_shard changed): DCP") for n in r.notes)


def test_restart_pp_splits_offer_dense_first_and_all_layers():
    """Each pp offers DeepSeek-V3's 3 dense layers alone on the first stage (its config's split,
    Megatron-LM's documented layout "Et*3|(tt|)*29,m|L": the 58 MoE layers on pp - 1 stages,
    evenly where pp - 1 divides 58, else balanced with the output layer counted on the last
    stage) AND the split over all 61 layers: the ends-short rule (balanced_split of 63, one off
    each end) and the balanced one, distinct; each kept only where it is balanced enough
    (PipelineRule.runs: the mean stage at least 0.95 of the heaviest, counting the layers alone
    or with the embedding and the output layer as one more on the first and the last stage).
    pp 31: ends-short [1, 3, 2 x 28, 1] is 61 / (31 x 3) = 0.66 (63 / 93 = 0.68 with the ends):
    dropped; balanced [2 x 30, 1] 61 / 62 = 0.98: kept. pp 30: [3, 2 x 29] (61 / 90, 63 / 120),
    [1, 3, 3, 3, 2 x 25, 1] and [2, 3, 2 x 28] (61 / 90, 63 / 90 = 0.70): none, pp 30 is not
    tried. pp 21: [3, 3 x 19, 1] (61 / 63 = 0.97) and [2, 3 x 19, 2] (63 / 63). pp 2: [3, 58]
    (61 / 116, 63 / 118) dropped, [31, 30] (61 / 62) kept. pp 16: the configured split (which
    both the dense and the ends-short rule give), then balanced 61 = 16 x 3 + 13 -> [3, 4 x 13,
    3, 3] (61 / 64 = 0.95). pp runs 1-9, 11, 13, 21, 22, 31-33 and 61, the configured 16 first.
    Under Megatron-LM (the example's framework) a split's middle stages are even (its
    --decoder-first/last-pipeline-num-layers): pp 22's [1, 3 x 19, 2, 1] is not, and its cut
    (first_last_split: 3 a stage, 66 - 61 = 5 off the ends) leaves the last stage none."""
    from meshplan.mesh.layers import dense_first_split
    from meshplan.restart import PipelineRule, pipelines
    configured = (3,) + (4,) * 14 + (2,)
    rule = PipelineRule(61, 16, split=configured, short=True, dense=3)
    got = pipelines(_mesh(["pp", "dp_shard"], [16, 128]), 2040, rule)
    assert list(dict.fromkeys(pp for pp, _ in got)) == [16, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 21, 22, 31, 32, 33, 61]
    assert dense_first_split(61, 3, 16) == list(configured) and dense_first_split(61, 3, 31) is None
    assert rule.splits_for(31) == [(2,) * 30 + (1,)]
    assert rule.splits_for(30) == ("61 layers over pp 30: the most even split loads its stages 0.70 as evenly as an "
                                   "even one, under 0.95")
    assert rule.splits_for(21) == [(3,) * 20 + (1,), (2,) + (3,) * 19 + (2,)]
    assert rule.splits_for(2) == [(31, 30)] and rule.splits_for(1) == [None]
    assert rule.splits_for(16) == [configured, (3,) + (4,) * 13 + (3, 3)]
    assert [s for pp, s in got if pp == 16] == rule.splits_for(16) and rule.splits_for(62).startswith("pp 62 is more")
    plan = _example_plan("deepseek-v3_2048xh100_pp16-ep64-dp128.toml")
    from meshplan.restart import pipeline_rule
    megatron = pipeline_rule(plan)
    assert (megatron.dense, megatron.framework) == (3, "megatron")
    assert isinstance(megatron.splits_for(22), str) and megatron.splits_for(21) == rule.splits_for(21)


def test_restart_candidates_are_bounded(monkeypatch):
    """The candidate set of the DeepSeek-V3 restart: pp 1-61, 1 to 3 splits each (framework megatron:
    pp 1-9, 11, 13, 16, 21, 31 and 61, those whose split Megatron-LM runs balanced enough,
    test_restart_pp_splits_offer_dense_first_and_all_layers; 1 split each but 2 at pp 11, [3, 6
    x 9, 4] dense-first and Megatron-LM's cut [4, 6 x 9, 3], and pp 21: 17 (pp, split) pairs); up
    to KEEPERS (4) meshes keeping the global batch per (pp, split) (dp = 64 k, k | 240, pp k <=
    31): pp 1-7 four, pp 8-9 three, pp 11 and 13 two, pp 16, 21 and 31 one (dp 64), pp 61 none:
    28 + 6 + 4 + 3 = 41 meshes (63 before the balance rule, pp 10, 12, 14, 15, 17-20, 22-30 with
    them). TRIED (16) meshes are kept, each with all its
    splits, those of the most GPUs less the 1F1B bubble, highest first: pp 1 x dp 1920 (1920),
    pp 2 x 960 (1920 x 16 / 17 = 1807), pp 3 x 640 (1920 x 24 / 26 = 1772), pp 31 x 64 (1984 x
    240 / 270 = 1764), pp 5 x 384 (1920 x 40 / 44 = 1745); at most PLANNED (8) meshes are planned feasible. tp and cp varied
    (degree_rule: tp 1, 2, 4, 8 split the 128 heads and the 18432-wide dense MLP and divide the
    node's 8 GPUs, cp 1 or twice it, 4096 % 4 == 0): 8 pairs, each other pair adds its one mesh
    of the highest ideal throughput with its splits: 16 + 7 meshes tried."""
    from meshplan.restart import KEEPERS, PLANNED, TRIED, degree_rule, pipeline_rule, pipelines
    from meshplan.restart_meshes import Where, candidates
    from meshplan.restart_rank import variants
    plan = _example_plan("deepseek-v3_2048xh100_pp16-ep64-dp128.toml")
    rule = pipeline_rule(plan)
    assert len(pipelines(plan.mesh, 2040, rule)) == 17 and (KEEPERS, TRIED, PLANNED) == (4, 16, 8)
    t = plan.config.training
    why = lambda pp, m: run_reasons(plan.spec.pp_schedule, pp, m, plan.vpp, t.pp_schedule_runs, t.framework)
    w = Where(plan.mesh, 2040, 15360, 1, why)
    keepers = candidates(w, rule)[0]
    meshes = variants(keepers)
    assert len(meshes) == TRIED and len(keepers) <= 3 * TRIED
    assert [(g[0].pp, g[0].dp, len(g)) for g in meshes[:5]] == [(1, 1920, 1), (2, 960, 1), (3, 640, 1), (31, 64, 1),
                                                                 (5, 384, 1)]
    assert (16, 64) not in [(p.pp, p.dp) for p in keepers]
    pairs = degree_rule(plan).pairs
    assert pairs == ((1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1), (8, 2))
    tried = candidates(w, rule, pairs)[0]
    assert len(variants(tried)) == TRIED + len(pairs) - 1 and tried[:len(keepers)] == keepers
    assert [(g[0].tp_cp, g[0].pp, g[0].dp, g[0].gpus, len(g)) for g in variants(tried[len(keepers):])] == [
        ((1, 2), 1, 960, 1920, 1), ((2, 1), 1, 960, 1920, 1), ((2, 2), 31, 16, 1984, 1), ((4, 1), 31, 16, 1984, 1),
        ((4, 2), 31, 8, 1984, 1), ((8, 1), 31, 8, 1984, 1), ((8, 2), 31, 4, 1984, 1)]
    import meshplan.restart_rank
    monkeypatch.setattr(meshplan.restart_rank, "TRIED", 1000)
    every = variants(candidates(w, rule)[0])
    per_pp = [sum(g[0].pp == pp for g in every) for pp in range(1, 32)]
    assert len(every) == 41 and per_pp == ([4] * 7 + [3] * 2 + [0, 2, 0, 2, 0, 0, 1] + [0] * 4 + [1] + [0] * 9
                                           + [1])


def test_restart_changes_tp_where_the_old_one_leaves_gpus_idle():
    """Hand case where changing tp wins: dp_shard 24 (tp 1) on 3 nodes of 8, global batch 24,
    micro_batch 1, loses a node: 16 GPUs. tp 1: dp must divide 24, at most 16: dp 12 (12 GPUs;
    dp 16 breaks the batch: 24 / 16 is not whole); pp 2 x dp 8 uses 16 but idles a quarter
    (1F1B, m = 3: ideal 16 x 3 / 4 = 12), pp 4 x dp 4 more (m = 6: 16 x 6 / 9 = 10.7). tp 2
    (DegreeRule pairs (1, 1), (2, 1)): dp 8 x tp 2 = 16 GPUs, 3 micro-batches, no bubble:
    proposed, tp and dp_shard changed (resharded)."""
    from meshplan.restart import DegreeRule, PipelineRule
    m = _mesh(["dp_shard"], [24])
    rule, pairs = PipelineRule(32, 1), DegreeRule(((1, 1), (2, 1)))
    r = restart_on_fewer_nodes(m, 1, gpus_per_node=8, global_batch=24, micro_batch=1, pipeline=rule, degrees=pairs)
    top = r.proposals[0]
    assert (top.names, top.shape, top.gpus, top.micro_batches) == (("dp_shard", "tp"), (8, 2), 16, 3)
    assert r.changed == ("dp_shard", "tp") and r.reshard
    assert [(p.tp_cp, p.pp, p.dp, p.gpus) for p in r.proposals[1:3]] == [((1, 1), 2, 8, 16), ((1, 1), 4, 4, 16)]
    assert r.lines()[0] == "restart: world 24 -> 16; mesh dp_shard 24 -> dp_shard 8 x tp 2 (shrunk: dp_shard 24 -> 8; grown: tp 1 -> 2)"
    kept = restart_on_fewer_nodes(m, 1, gpus_per_node=8, global_batch=24, micro_batch=1, pipeline=rule)
    assert kept.proposals[0].tp_cp == (1, 1) and kept.proposals[0].gpus == 16 and kept.proposals[0].pp == 2


def test_restart_names_the_data_axis_by_the_sharding():
    """The restart's mesh text is mesh_words.mesh_text's: under zero1 the data axis is dp (no
    parameter sharded over it), under zero3 dp_shard, whatever the config calls it; the changed
    axes and the checkpoint note say so too."""
    m = _mesh(["dp_shard", "tp"], [8, 8])
    z1 = restart_on_fewer_nodes(m, 1, gpus_per_node=8, global_batch=512, micro_batch=1, sharding="zero1")
    assert z1.lines()[0].startswith("restart: world 64 -> 32 (56 GPUs left); mesh dp 8 x tp 8 -> dp 4 x tp 8 "
                                    "(shrunk: dp 8 -> 4; kept: tp 8); not dp 7 x tp 8 (56 GPUs): global_batch 512")
    assert any(n.startswith("with a different global batch (changes the optimisation): dp 7 x tp 8 on 56 GPUs")
               for n in z1.notes)
    assert any(n.startswith("checkpoint: resharded on load (dp changed)") for n in z1.notes)
    z3 = restart_on_fewer_nodes(_mesh(["dp", "tp"], [8, 8]), 1, gpus_per_node=8, global_batch=512, micro_batch=1,
                                sharding="zero3")
    assert z3.lines()[0].startswith("restart: world 64 -> 32 (56 GPUs left); mesh dp_shard 8 x tp 8 -> dp_shard 4 x "
                                    "tp 8 (shrunk: dp_shard 8 -> 4; kept: tp 8)")


def test_restart_deepseek_v3_planned(capsys, tmp_path):
    """The planned DeepSeek-V3 restart (the CLI's default scenario): every proposal's step is
    its own plan's, ranked by tokens/s; the proposal's numbers are those of an independent
    build_plan + step_time of its mesh and layer split, and the throughput lost is against the
    2048-GPU plan."""
    from meshplan.cli import main
    from meshplan.schedule.rank_timeline import Overlap
    from meshplan.schedule.steptime import step_time
    cfg = Path(__file__).resolve().parents[1] / "examples" / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml"
    with pytest.raises(SystemExit) as done:
        main(["reliability", str(cfg), "--write-gbps", "100", "--read-gbps", "100", "--restart-overhead-s", "300",
              "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert (done.value.code or 0) == 0
    doc = json.loads((tmp_path / "r.json").read_text())["restart"]
    tps = [p["tokens_per_s"] for p in doc["proposals"]]
    assert tps == sorted(tps, reverse=True) and len(tps) <= 8 + 7  # PLANNED, and one per other (tp, cp)
    top = doc["proposals"][0]
    c = load_config(cfg)
    c = dataclasses.replace(c, mesh=c.mesh.model_copy(update={"names": top["names"] + ["ep"],
                                                              "shape": top["shape"] + [64], "world": top["gpus"],
                                                              "pp_layer_split": top["pp_layer_split"]}),
                            cluster=c.cluster.model_copy(update={"nodes": 255}))
    new = step_time(build_plan(c), Overlap())
    assert new.tokens_per_s == top["tokens_per_s"] and doc["new_names"] == ["pp", "dp_shard", "cp"]
    gain = new.tokens_per_s / doc["old_tokens_per_s"] - 1
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("restart:"))
    # the proposal on 2040 GPUs (cp 2 under Transformer Engine's p2p ring, its correction kernels counted
    # since tering2) runs 1.2% below the 2048-GPU plan: said as throughput lost, not a negative gain.
    # testreams: TE's lse correction of step 0 (a clone, floored at 4.7 us) runs beside call 1 on its other
    # flash stream, hidden: 2 layers on the critical stage x 480 micro-batches x (forward and its replay) x
    # 4.7 us = -9.024 ms of compute (bubble -0.55 ms): step 46.8098 -> 46.8003 s, -1.151% -> -1.131%
    # Since the example plans Megatron Core (training.megatron_runtime "core", 2026-12): get_batch runs on the
    # first and last stages only, without 2022's mask kernels and timer syncs (compute/megatron_core.py), so the
    # 2048-GPU step goes 46.2729 -> 46.2521 s (120 micro-batches a rank) and the proposal's, whose 31 stages each
    # ran get_batch for 480 micro-batches under 2022, 46.8003 -> 46.7273 s: 46.2521 / 46.7273 - 1 = -1.017%
    # recomp48 (merged with it): the shared expert's activation at its own width, 62 us less per MoE layer and
    # micro-batch, shortens both through their stage 0's bubble: the 2048-GPU step 46.2521 -> 46.2190 s
    # (test_words' DeepSeek-V3 headline, by hand) and the proposal's 46.7273 -> 46.6958 s (the independent
    # step_time of its mesh above): 46.2190 / 46.6958 - 1 = -1.021%
    assert round(2 * 480 * 2 * 4.7e-6 * 1e3, 3) == 9.024
    assert round(46.2190 / 46.6958 - 1, 5) == -0.01021 and round(gain, 5) == -0.01021
    assert round(new.step_s, 4) == 46.6958
    assert f"{-gain:.1%} of the throughput lost (the 2048-GPU plan" in lines[head + 1]
    # zero1: the data axis printed dp (mesh_words.mesh_text), as plan prints it
    assert lines[head].startswith(f"restart: world 2048 -> {top['gpus']} (2040 GPUs left); mesh pp 16 x dp 128 x ep 64 "
                                  f"-> pp 31 x dp 32 x cp 2 x ep 64 (shrunk: dp 128 -> 32; grown: pp 16 -> 31, "
                                  f"cp 1 -> 2; kept: ep 64)")
    # slower than the 2048-GPU plan: no "plans more tokens/s" line (restart_text.faster_text, its doctests);
    # the idle GPUs' line follows (uxsmall's 1.5% faster came before TE's correction kernels)
    assert not any("more tokens/s than the 2048-GPU plan" in line for line in lines)
    assert lines[head + 2].startswith("- 56 of the 2040 GPUs left sit idle")
    assert lines[head + 3].startswith("- runner-up: pp ")
    # pp 31, 62 GPUs a replica, fills 1984 of 2040, with its one balanced split (2 x 30, 1): the ends-short split
    # (1, 3, 2 x 28, 1), which planned 0.03% faster, is 0.68 balanced and Megatron-LM's flags cannot set its uneven
    # middle stages (PipelineRule.runs); the rsmore branch's dense-first-only split lost 12.0% at pp 10 x dp 192
    assert top["pp_layer_split"] == [2] * 30 + [1] and top["gpus"] == 1984 and gain < 0
    note = next(line for line in lines if line.startswith("- pipeline: "))
    assert note == "- pipeline: pp 16 -> 31, layers per stage 3, 4 x 14, 2 -> 2 x 30, 1 (the schedule kept)"


def test_restart_dense_seed_varies_pp():
    """Dense: the seed (Llama 3 70B, 80 layers, dp_shard 8 x tp 8, global batch 512) loses a
    node: 56 GPUs, tp 8 kept, pp x dp <= 7, dp | 512 (a power of 2). pp kept (1): dp 4 on 32
    GPUs. pp varied (1F1B needs m = 512 / dp >= pp: always): pp 7 x dp 1 uses all 56 GPUs,
    80 layers on 7 stages balanced_split [11, 12, 12, 12, 11, 11, 11]; then 48 GPUs (pp 6 x
    dp 1, pp 3 x dp 2), 40, 32 ...; without an evaluator ranked by GPUs."""
    plan = _example_plan("seed-64gpu.toml")
    from meshplan.restart import pipeline_rule
    r = restart_on_fewer_nodes(plan.mesh, 1, gpus_per_node=8, global_batch=512, micro_batch=1,
                               pipeline=pipeline_rule(plan))
    top = r.proposals[0]
    assert (top.names, top.shape, top.gpus, top.micro_batches) == (("pp", "dp_shard", "tp"), (7, 1, 8), 56, 512)
    assert top.pp_layer_split == (11, 12, 12, 12, 11, 11, 11) and r.changed == ("pp", "dp_shard")
    assert sorted((p.gpus, p.pp, p.dp) for p in r.proposals[1:3]) == [(48, 3, 2), (48, 6, 1)]
    assert r.lines()[0] == ("restart: world 64 -> 56; mesh dp_shard 8 x tp 8 -> pp 7 x dp_shard 1 x tp 8 (shrunk: "
                            "dp_shard 8 -> 1; grown: pp 1 -> 7; kept: tp 8)")
    assert "pipeline: pp 1 -> 7, layers per stage 11, 12 x 3, 11 x 3" in r.notes  # pp 1 ran no schedule to keep


def test_restart_seed_planned_keeps_the_kind_at_another_global_batch():
    """Seed on 7 nodes, planned: dp_shard 7 (global batch 511) plans 11,291 tokens/s, dp_shard 4
    (512 kept, 24 GPUs idle) 7,383: both keep the job's kind (dp_shard x tp, pp 1), and 11,291 /
    7,383 = 1.53 > 1 + RESTART_MARGIN, so dp_shard 7 is proposed (rs8; it ranked below dp_shard 4
    before), dp_shard 4 the one alternative, keeping the global batch; dp_shard 2 and 1 exceed the
    usable memory. (nicshare4: 11,291 -> 11,521 and 7,383 -> 7,528 tokens/s under FSDP2's
    reduce-scatters on their own stream beside the next layer's all-gather, each at its max-min share of
    the NIC, as the seed's (tests/test_compare.py test_same_mesh_other_recompute_is_weighed_as_the_knob):
    dp_shard 7's backward unit 3773.541 -> 3672.705 ms x 73 micro-batches, the last tail 68.873 ->
    38.279 ms: 370.740 -> 363.348 s; dp_shard 4's 3296.640 -> 3211.381 ms x 128, tail 60.128 -> 33.478
    ms: 568.106 -> 557.167 s; 11,521 / 7,528 = 1.53 still.)"""
    from meshplan.restart import plan_evaluator
    plan = _example_plan("seed-64gpu.toml")
    r = restart_on_fewer_nodes(plan.mesh, 1, gpus_per_node=8, global_batch=512, micro_batch=1,
                               evaluate=plan_evaluator(plan, 7))
    assert [(p.dp, p.global_batch) for p in r.proposals] == [(7, 511), (4, 512)]
    seven, four = r.proposals
    assert seven.tokens_per_s > four.tokens_per_s * 1.05 and r.shape == (7, 8) and r.contract == "global_batch 512 -> 511"
    assert (round(seven.tokens_per_s), round(four.tokens_per_s)) == (11521, 7528)
    hand = (370.7397 - (73 * (3773.541 - 3672.705) + 68.873 - 38.279) / 1e3,
            568.1064 - (128 * (3296.640 - 3211.381) + 60.128 - 33.478) / 1e3)
    assert [round(511 * 8192 / hand[0]), round(512 * 8192 / hand[1])] == [11521, 7528]
    assert "- alternative keeping the global batch: dp_shard 4 x tp 8 on 32 GPUs, contract kept: step 557.17 s, 7,528 " \
           "tokens/s" in r.lines()
    assert not [line for line in r.lines() if "runner-up" in line]


def test_restart_pp_values_keep_vpp():
    """Interleaved (vpp 2) pp 2 x dp_shard 4 x tp 8, 32 layers, loses a node: 56 GPUs, pp <= 7.
    vpp 2 is kept: pp 1 has no chunks, and pp must give even chunks (32 / pp / 2 whole): pp 2
    and 4 only (3, 5, 6, 7 do not divide 32; no ends-short split configured). pp 2: dp 2 (64 /
    3 is not whole), dp 1; pp 4: dp 1; ranked by GPUs, dp 3 the alternative (64 -> 63)."""
    from meshplan.restart import PipelineRule, pipelines
    m = _mesh(["pp", "dp_shard", "tp"], [2, 4, 8])
    rule = PipelineRule(32, 2, vpp=2)
    assert pipelines(m, 56, rule) == [(2, None), (4, None)]
    r = restart_on_fewer_nodes(m, 1, gpus_per_node=8, global_batch=64, micro_batch=1, pipeline=rule)
    assert [(p.pp, p.dp, p.gpus, p.contract) for p in r.proposals] == [
        (2, 2, 32, ""), (4, 1, 32, ""), (2, 1, 16, ""), (2, 3, 48, "global_batch 64 -> 63")]
    assert "- with a different global batch (changes the optimisation): pp 2 x dp_shard 3 x tp 8 on 48 GPUs, " \
           "global_batch 64 -> 63" in r.lines()


def test_restart_names_the_checkpoint_engines_path():
    """DeepSpeed saves ZeRO state per dp rank: a restart at another dp converts it
    (ds_to_universal.py) and loads it with load_universal; torch's DCP and Megatron-Core
    dist-checkpointing reshard on load. The engine follows the training section (an imported
    DeepSpeed JSON sets zero12_engine deepspeed), and under DeepSpeed a replica-only change
    still reshards (its partitions span every dp rank)."""
    from meshplan.interop.common import ImportOptions
    from meshplan.interop.deepspeed import read
    from meshplan.restart import checkpoint_engine
    m = _mesh(["dp_shard", "tp"], [8, 8])
    note = lambda engine: next(n for n in restart_on_fewer_nodes(
        m, 1, gpus_per_node=8, global_batch=512, micro_batch=1, checkpoint=engine).notes if n.startswith("checkpoint"))
    moved = "checkpoint: resharded on load (dp_shard changed): "
    assert note("dcp").startswith(moved + "DCP (torch.distributed.checkpoint)")
    assert note("megatron").startswith(moved + "Megatron-Core dist-checkpointing")
    ds = note("deepspeed")
    assert ds.startswith("checkpoint: not loadable as saved (dp_shard changed): DeepSpeed saves the ZeRO state per "
                         "data-parallel rank") and "ds_to_universal.py" in ds and '"load_universal": true' in ds
    assert "DCP" not in ds
    rep = _mesh(["dp_replicate", "dp_shard", "tp"], [4, 2, 8])
    r = restart_on_fewer_nodes(rep, 2, gpus_per_node=8, global_batch=480, micro_batch=1, checkpoint="deepspeed")
    assert r.changed == ("dp_replicate",) and r.reshard
    t = lambda **kw: TrainingSpec(global_batch=8, seq_len=16, **kw)
    assert [checkpoint_engine(t(sharding="zero3", zero3_engine="deepspeed")),
            checkpoint_engine(t(sharding="zero2", zero12_engine="deepspeed")),
            checkpoint_engine(t(sharding="zero3")), checkpoint_engine(t(sharding="zero1", framework="megatron"))] == [
        "deepspeed", "deepspeed", "dcp", "megatron"]
    doc = json.loads((Path(__file__).resolve().parents[1] / "examples" / "deepspeed_zero2_16xh100.json").read_text())
    got = read(doc, ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096)).tables["training"]
    assert checkpoint_engine(TrainingSpec(**got)) == "deepspeed"


def test_restart_faster_than_the_full_plan_blames_the_original_mesh():
    """The seed (dp_shard 8 x tp 8, 64 GPUs) plans 324.73 s a step (12,916 tokens/s; 331.38 s before
    FSDP2's reduce-scatters shared the NIC beside the all-gathers on their own stream, derived in
    tests/test_compare.py test_same_mesh_other_recompute_is_weighed_as_the_knob); its restart
    on 56 GPUs (pp 7 x cp 2 x tp 4) plans 73.12 s: more tokens/s on fewer GPUs, so the note says
    the original mesh is the problem, with both steps, and suggests meshplan search. The seed
    uses all 56 GPUs: no batch-contract note. Llama 3 405B's case (8192 of 16376 GPUs, global
    batch 2048 / micro_batch 1 = 2048 = dp, one micro-batch a rank) by hand: the cap note."""
    from meshplan.restart import Proposal, plan_evaluator, pipeline_rule, degree_rule
    from meshplan.restart_text import result_notes
    from meshplan.schedule.rank_timeline import Overlap
    from meshplan.schedule.steptime import step_time
    plan = _example_plan("seed-64gpu.toml")
    old = step_time(plan, Overlap())
    r = restart_on_fewer_nodes(plan.mesh, 1, gpus_per_node=8, global_batch=512, micro_batch=1,
                               pipeline=pipeline_rule(plan), degrees=degree_rule(plan),
                               evaluate=plan_evaluator(plan, 7), old_step=(old.step_s, old.tokens_per_s))
    top = r.proposals[0]
    assert f"{old.step_s:.2f}" == "324.73" and round(512 * 8192 / old.step_s) == 12916 and top.gpus == 56 and top.tokens_per_s > old.tokens_per_s
    assert r.notes[1] == ("the original mesh is the problem, not the lost node: the 64-GPU plan takes 324.73 s a step, "
                          f"{top.mesh_text()} takes {top.step_s:.2f} s on 56 GPUs; run `meshplan search` on the "
                          "original cluster for a faster full-size mesh")
    assert not any(n.startswith("fewer GPUs") for n in r.notes)
    big = Proposal(("dp_shard", "tp"), (2048, 4), 1, 1, 8192, 2048, 1, 2048, 1, step_s=12.0, tokens_per_s=2.0,
                   peak_bytes=1.0)
    alt = Proposal(("dp_shard", "tp"), (2047, 8), 1, 1, 16376, 2047, 1, 2047, 1, contract="global_batch 2048 -> 2047",
                   step_s=14.0, tokens_per_s=1.0, peak_bytes=1.0)
    notes = result_notes(big, [big, alt], [], 16384, 16376, _mesh(["dp_shard", "tp"], [2048, 8]), 8, (14.0, 1.0))
    assert notes[1].startswith("the original mesh is the problem") and notes[3] == (
        "fewer GPUs by the batch contract: global batch 2048 / micro_batch 1 = 2048 micro-batches a step, so dp "
        "divides 2048 (at most 2048, 1 micro-batch each); dp 2048 takes 8192 GPUs, a larger dp changes the "
        "global batch")


def test_the_original_mesh_is_blamed_only_beyond_the_models_accuracy():
    """uxsmall item 3: the note blaming the original mesh fired at any gain (DeepSeek-V3: 1.5%).
    RESTART_MARGIN is issue 11's goal (step time within 5%): 12,657 -> 13,290 tokens/s
    (+5.0%, 13,290 / 12,657 - 1 = 0.05001) blames it; 12,657 -> 13,280 (+4.9%) says the two
    are within the model's accuracy; no gain, no line."""
    from meshplan.restart import Proposal
    from meshplan.restart_text import result_notes
    from meshplan.spec.accuracy import RESTART_MARGIN

    assert RESTART_MARGIN == 0.05

    def notes(tps):
        p = Proposal(("pp", "tp"), (7, 8), 1, 1, 56, 1, 1, 512, 512, step_s=73.12, tokens_per_s=tps, peak_bytes=1.0)
        return result_notes(p, [p], [], 64, 56, _mesh(["dp_shard", "tp"], [8, 8]), 8, (331.38, 12657.0))

    assert notes(13290.0)[1].startswith("the original mesh is the problem, not the lost node: the 64-GPU plan")
    assert notes(13280.0)[1] == ("pp 7 x tp 8 on 56 GPUs plans 4.9% more tokens/s than the 64-GPU plan, within the "
                                 "5% restart margin (a judgement, not the model's measured error): "
                                 "the original mesh is not shown to be the problem")
    assert notes(12000.0)[1].startswith("runner-up")


def _deepspeed_cli(capsys, seq_len):
    from meshplan.cli import main
    cfg = Path(__file__).resolve().parents[1] / "examples" / "deepspeed_zero2_16xh100.json"
    with pytest.raises(SystemExit) as done:
        main(["reliability", str(cfg), "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "2", "--seq-len",
              str(seq_len), "--write-gbps", "100", "--read-gbps", "200", "--restart-overhead-s", "600",
              "--rank-gbps", "2"])
    out = capsys.readouterr()
    return done.value.code or 0, out.out, out.err


def test_deepspeed_restart_varies_the_data_axis_only_and_writes_as_deepspeed(capsys):
    """Newcomer trial 7 (issue 11): the DeepSpeed ZeRO-2 example (Llama 3 8B, dp 16) restarted on
    dp 4 x tp 2, which a DeepSpeed config cannot run (its import keeps tp = [1]); and the busiest
    rank's write was DCP's balanced share, 7.026 GB. DeepSpeed's save_checkpoint (engine.py@edaa722)
    has data-parallel rank 0 write the whole bf16 module, 2 B x 8.03e9 = 16.06 GB, and its ZeRO-2
    optimizer partition, 12 B x 8.03e9 / 16 = 6.02 GB: 22.083 GB, 11.04 s at 2 GB/s (was 3.51 s).
    At seq 8192 the 16-GPU plan itself does not fit (71.5 GiB) and no dp of 8 GPUs does: one line."""
    rc, out, err = _deepspeed_cli(capsys, 8192)
    assert rc == 1 and err.splitlines()[-1].startswith("infeasible: peak 71.5 GiB")
    assert ("DeepSpeed: the busiest rank (data-parallel rank 0) writes 22.083 GB, the whole module state_dict "
            "(model_states.pt) and its zero_pp_rank optimizer partition, and reads back 22.083 GB, all it holds; at "
            "2 GB/s per rank: write 11.04 s, read 11.04 s") in out
    assert "DCP" not in out and "write 11.0 s, read 11.0 s" in out
    restart = next(line for line in out.splitlines() if line.startswith("restart:"))
    assert restart.startswith("restart: world 16 -> 8: no mesh to restart on (dp 8 (8 GPUs): peak 78.0 GiB")
    assert "tp" not in restart
    rc, out, err = _deepspeed_cli(capsys, 4096)  # the plan fits: dp 16 -> dp 8, the data axis alone
    assert rc == 0 and "infeasible" not in err
    assert "restart: world 16 -> 8; mesh dp 16 -> dp 8 (shrunk: dp 16 -> 8)\n" in out
    # kvheads: 5.80 -> 5.77 s, the repeat_kv copies gone (28.9 ms a step, test_words' zero2 row)
    assert "of the throughput lost (the 16-GPU plan: step 5.77 s" in out


def test_deepspeed_engine_rules_keep_tp_cp_and_pp_where_the_engine_refuses_it():
    """Under DeepSpeed tp and cp are kept; pp varies only where its pipeline engine runs pp 2:
    ZeRO-1 without overlap_comm under 1F1B, not ZeRO-2 (pipe/engine.py refuses it), not ZeRO-3,
    not overlap_comm; DCP keeps the degree rule's tp choices."""
    from types import SimpleNamespace as N
    from meshplan.restart import engine_rules
    plan = _example_plan("seed-64gpu.toml")
    pipe, deg = engine_rules(plan)
    assert pipe is not None and len(deg.pairs) > 1  # DCP: tp and cp varied
    mesh = _mesh(["dp_shard", "tp"], [8, 2])
    for kw, runs_pp in [({"sharding": "zero1", "zero12_engine": "deepspeed"}, True),
                        ({"sharding": "zero1", "zero12_engine": "deepspeed", "overlap_comm": True}, False),
                        ({"sharding": "zero2", "zero12_engine": "deepspeed"}, False),
                        ({"sharding": "zero3", "zero3_engine": "deepspeed"}, False),
                        ({"sharding": "zero3", "zero3_engine": "deepspeed-2021"}, False)]:
        t = TrainingSpec(global_batch=64, seq_len=16, **kw)
        fake = N(config=N(training=t, model=plan.config.model, mesh=N(pp_layer_split=None)), mesh=mesh,
                 spec=N(pp_schedule="1f1b"), vpp=1, pp=1)
        pipe, deg = engine_rules(fake)
        assert (pipe is not None, deg.pairs) == (runs_pp, ((2, 1),)), kw


def test_restart_against_an_infeasible_plan_says_so():
    """When the plan before the loss does not fit, the restart line names why instead of a
    throughput lost against it (issue 11, trial 7: '54.1% lost' against a 71.5 GiB plan)."""
    from meshplan.restart import Proposal
    from meshplan.restart_text import result_notes
    top = Proposal(("dp_shard",), (8,), 1, 1, 8, 8, 1, 256, 32, step_s=11.52, tokens_per_s=91029.0,
                   peak_bytes=54.5 * 2 ** 30)
    why = "infeasible: peak 71.5 GiB at backward of the head (micro-batch 0) on stage 0 > 67.1 GiB usable"
    notes = result_notes(top, [top], [], 16, 8, _mesh(["dp_shard"], [16]), 8, (13.01, 161220.0), old_infeasible=why)
    assert notes[0] == ("planned step 11.52 s, 91,029 tokens/s, memory peak 54.5 GiB (the 16-GPU plan does not run, "
                        f"{why}: no throughput to lose against it)")
    notes = result_notes(top, [top], [], 16, 8, _mesh(["dp_shard"], [16]), 8, (13.01, 161220.0))
    assert notes[0].endswith(": 43.5% of the throughput lost (the 16-GPU plan: step 13.01 s, 161,220 tokens/s)")


# --- the job's own checkpoint interval (newcomer trial "roundtrip" item 2) ---

def test_lost_work_per_failure_hand_value():
    """T = tau + C = 600 + 60 s, M = 36000 s: M - T / (e^{T/M} - 1) = T/2 - T^2 / (12 M) + ... =
    330 - 1.008 = 328.99 s (the series of x / (e^x - 1)); about T / 2 when T << M."""
    from meshplan.reliability import lost_work_s
    assert lost_work_s(600, 60, 36000) == pytest.approx(330 - 660 ** 2 / (12 * 36000), abs=0.01)
    assert lost_work_s(6, 0, 1e9) == pytest.approx(3.0, abs=1e-6)


def test_job_interval_line_hand_values():
    """MTBF 36000 s (1 GPU at 2.4 interruptions a day), C 60 s, R 300 s, the job's 300 steps x 2 s
    = 600 s = 10.0 min: work lost per failure 328.99 s = 5.5 min, goodput 0.8933 (Daly 2006's
    formula, goodput's own doctest); at Daly's interval, that interval's."""
    from meshplan.reliability import JobInterval, Reliability, lost_work_s
    ck = CheckpointSize(total_bytes=1, per_rank_bytes=1)
    r = Reliability(1, 2.4, (), ck, write_s=60.0, read_s=0.0, restart_overhead_s=300.0,
                    job=JobInterval(300, 2.0, "checkpoint.interval"))
    assert r.mtbf_s == pytest.approx(36000)
    daly = daly_interval_s(60, 36000)  # 2038.6 s = 34.0 min
    line = r.lines()[-1]
    assert line == (f"job's interval: 300 steps (checkpoint.interval) x 2.000 s per step = 10.0 min against Daly's "
                    f"34.0 min; expected work lost per failure 5.5 min (at Daly's "
                    f"{lost_work_s(daly, 60, 36000) / 60:.1f} min); goodput 89.33% (at Daly's {r.goodput:.2%})")
    doc = r.job_fields()
    assert (doc["interval_s"], round(doc["lost_work_s"], 2), round(doc["goodput"], 4)) == (600.0, 328.99, 0.8933)
    assert len(dataclasses.replace(r, job=None).lines()) == len(r.lines()) - 1  # no interval, no line


TT_JOB = """[model]
name = "llama3"
flavor = "8B"

[training]
local_batch_size = 2
seq_len = 8192

[parallelism]
data_parallel_shard_degree = -1

[checkpoint]
enable = true
folder = "checkpoint"
interval = 500
"""


def test_torchtitan_checkpoint_interval_is_used(tmp_path, capsys):
    """An imported torchtitan job's ``checkpoint.interval`` (with ``enable = true``) is no longer
    listed unused: reliability sets 500 x the predicted step beside Daly's interval, and the
    --json holds the same; without ``enable`` torchtitan saves nothing and the keys stay unused."""
    from meshplan.cli import main
    from meshplan.interop.foreign import load_any
    from meshplan.interop.common import ImportOptions
    f = tmp_path / "job.toml"
    f.write_text(TT_JOB)
    cfg = load_any(f, "torchtitan", ImportOptions(cluster="dgx-h100", nodes=1))
    assert cfg.checkpoint_interval_steps == 500
    assert cfg.notes[-1] == "torchtitan: fields meshplan does not use: checkpoint.folder"
    with pytest.raises(SystemExit):
        main(["reliability", str(f), "--cluster", "dgx-h100", "--nodes", "1", "--write-gbps", "5", "--read-gbps", "5",
              "--restart-overhead-s", "300", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "r.json").read_text())
    import jsonschema
    schema = Path(__file__).resolve().parents[1] / "meshplan" / "schemas" / "reliability.v1.schema.json"
    jsonschema.validate(doc, json.loads(schema.read_text()))
    job = doc["job_interval"]
    step = job["step_s"]
    assert job["interval_s"] == pytest.approx(500 * step)
    assert job["goodput"] == pytest.approx(goodput(500 * step, doc["write_s"], doc["restart_s"], doc["mtbf_s"]))
    assert (f"job's interval: 500 steps (checkpoint.interval) x {step:.3f} s per step = {500 * step / 60:.1f} min "
            f"against Daly's {doc['interval_s'] / 60:.1f} min; ") in out
    f.write_text(TT_JOB.replace("enable = true\n", ""))
    cfg = load_any(f, "torchtitan", ImportOptions(cluster="dgx-h100", nodes=1))
    assert cfg.checkpoint_interval_steps is None
    assert cfg.notes[-1] == "torchtitan: fields meshplan does not use: checkpoint.folder, checkpoint.interval"


def test_megatron_save_interval_round_trips(tmp_path):
    """``--save-interval 1000`` is read (not listed unused), written back by export --to megatron
    and as ``[reliability] checkpoint_interval_steps`` by export --to meshplan."""
    from meshplan.config import config_from_dict
    from meshplan.config_toml import parse_toml
    from meshplan.interop.common import ImportOptions
    from meshplan.interop.export import export
    from meshplan.interop.foreign import load_any
    args = (Path(__file__).resolve().parents[1] / "examples" / "megatron_llama3-8b_16xh100_tp2-pp2.args").read_text()
    f = tmp_path / "a.args"
    f.write_text(args + "--save-interval 1000\n")
    cfg = load_any(f, "megatron", ImportOptions(cluster="dgx-h100", nodes=2))
    assert cfg.checkpoint_interval_steps == 1000 and not any("--save-interval" in n for n in cfg.notes)
    assert "--save-interval 1000" in export(cfg, "megatron", "a")[0].splitlines()
    toml = export(cfg, "meshplan", "a")[0]
    assert "[reliability]\ncheckpoint_interval_steps = 1000\n" in toml
    assert config_from_dict(parse_toml(toml, "t")).checkpoint_interval_steps == 1000


@pytest.mark.parametrize("value", ["0", "1.5", "true", '"500"'])
def test_reliability_table_refuses_a_bad_interval(value):
    from meshplan.config import config_from_dict
    from meshplan.config_toml import parse_toml
    from meshplan.errors import ConfigError
    tables = parse_toml(f"[reliability]\ncheckpoint_interval_steps = {value}\n", "t")
    base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 8, "seq_len": 1024}, "mesh": {"names": ["dp_shard"], "shape": [8]}}
    with pytest.raises(ConfigError, match=r"^reliability.checkpoint_interval_steps: .*whole number >= 1$"):
        config_from_dict(base | tables)


def test_megatron_save_interval_unresolved_is_a_note(tmp_path):
    """A launch script's ``--save-interval $SAVE_INTERVAL`` (left unresolved) plans as before, with
    a note instead of an error: only ``reliability`` uses the interval."""
    from meshplan.interop.common import ImportOptions
    from meshplan.interop.foreign import load_any
    f = tmp_path / "a.args"
    f.write_text((Path(__file__).resolve().parents[1] / "examples" / "megatron_llama3-8b_16xh100_tp2-pp2.args")
                 .read_text() + "--save-interval $SAVE_INTERVAL\n")
    cfg = load_any(f, "megatron", ImportOptions(cluster="dgx-h100", nodes=2))
    assert cfg.checkpoint_interval_steps is None
    assert ("megatron: --save-interval '$SAVE_INTERVAL' is not a whole number >= 1 (a shell variable?): the job's "
            "checkpoint interval is not set beside the optimal one") in cfg.notes


def test_the_storage_default_is_named_as_llama3s_cluster_and_not_capped(capsys):
    """Newcomer trial 27 #E: reliability timed 256 A100 at the Llama 3 16K-GPU cluster's 2 TB/s with
    no word of it. Left out, each default flag is named on a note line saying whose figure it is and
    that the catalog has no storage or front-end NIC bandwidth to cap it by (dgx-a100's nodes list
    their 8 compute NICs alone; its storage NICs mlx5_4-5 are not modelled); given, no note."""
    cfg = Path(__file__).resolve().parents[1] / "examples" / "mini_2x4_tp2-dp4.toml"  # 1 dgx-h100 node
    notes = []
    for given in ([], ["--write-gbps", "10"], ["--write-gbps", "10", "--read-gbps", "10"]):
        rc, out, err = run_cli(["reliability", cfg, "--restart-overhead-s", "300", *given], capsys)
        assert rc == 0, err
        notes.append([x for x in out.splitlines() if x.startswith("note: the 2000 GB/s")])
    words = ("note: the 2000 GB/s checkpoint default is the storage of Llama 3's 16,384-GPU cluster (arXiv "
             "2407.21783, 3.3.1), not this cluster's 1 node; the catalog holds no storage or front-end NIC bandwidth "
             "for dgx-h100, so it is not capped at what 1 node can push: measure yours (fio or IOR from every node at "
             "once) and set {}")
    assert notes == [[words.format("--write-gbps, --read-gbps")], [words.format("--read-gbps")], []]
