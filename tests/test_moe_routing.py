"""Issue 14 item 2: MoE routing as the frameworks configure it (meshplan.compute.routing).

Model M: 2 MoE layers, hidden 64, 8 experts, top_k 2, expert_ffn 32 (SwiGLU), bf16 compute.
Mesh dp_shard 4 with ep 4 (2 local experts per rank), micro-batch 1 x seq 512, tp 1:
T = 512 tokens routed per rank, T x top_k = 1024 copies. By hand:

- default (framework torch, routing unset): dropless, balanced: the expected load of uniform
  routing, 1024 / ep 4 = 256 rows per peer, 1024 rows = 131072 B, plus one all-to-all of the
  8 per-expert counts (8 x 8 B int64) per MoE layer in forward;
- framework megatron, routing unset: dropless too (Megatron-LM's default); its counts are one
  all-gather over ep 4 of the 8 counts per rank, 4 x 8 x 8 B = 256 B (output) per MoE layer;
- capacity factor 1 (``moe_dropless = false``): C = ceil(1024 / 8) = 128, dispatch buffer 8 x 128 = 1024 rows;
  all-to-all 1024 x 64 x 2 B = 131072 B; each local expert's GEMM ep x C = 512 rows;
- capacity factor 1.25: C = ceil(1.25 x 1024 / 8) = 160, 1280 rows, 163840 B; GEMMs 640 rows;
  with the hottest expert at 25% of the copies it takes 256 copies per rank, 96 dropped;
- dropless, hottest expert 25%: it receives 4 x 0.25 x 1024 = 1024 rows, each other expert
  ceil(4 x 0.75 / 7 x 1024) = ceil(438.86) = 439; its rank (2 local experts) receives
  1024 + 439 = 1463 rows: all-to-all 1463 x 128 = 187264 B.
- routed activations per row: the expert MLP terms a x width x 4 (gated) + dispatched input
  and output 2 a h = 2 x 32 x 4 + 2 x 2 x 64 = 512 B; 256 rows more at factor 1.25: 131072 B.
"""

from collections import Counter
from math import prod

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.memory.sizes import layer_act_sizes
from meshplan.plan import Plan, build_plan
from meshplan.spec.memory import MemoryOptions

MODEL = dict(layers=2, hidden=64, ffn=128, q_heads=4, kv_heads=2, vocab=256, experts=8, top_k=2, expert_ffn=32)


def plan_of(mesh=None, model=MODEL, **training):
    t = {**dict(global_batch=4, seq_len=512, micro_batch=1, sharding="zero3", recompute="none"), **training}
    cfg = {"model": model, "cluster": {"system": "dgx-h100", "nodes": 1}, "training": t,
           "mesh": mesh or dict(names=["dp_shard", "ep"], shape=[4, 4], world=4)}
    return build_plan(config_from_dict(cfg))


def a2a(plan):
    rows = [r for r in plan.collectives[next(iter(plan.collectives))] if r.op == "all-to-all" and r.dtype != "int64"]
    assert {r.axis for r in rows} == {"ep"}
    return {r.size_bytes for r in rows}


def expert_gemms(plan):
    return sorted((g.name, g.m, g.count) for g in plan.gemms if g.name.startswith("expert_w_up"))


def test_torch_default_is_dropless_with_the_balanced_expectation():
    default, megatron = plan_of(), plan_of(framework="megatron")
    assert a2a(default) == {131072} and expert_gemms(default) == [("expert_w_up", 512, 2)]
    note = [n for n in default.notes if n.startswith("MoE")][0]
    assert note.startswith("MoE dropless (balanced)") and "T x top_k / ep = 256 rows per peer" in note
    assert "the balanced case" in note
    counts = [(r.phase, r.size_bytes, r.per_microbatch) for r in default.collectives[next(iter(default.collectives))]
              if r.dtype == "int64"]
    assert counts == [("forward", 64, 2)]
    assert [n for n in megatron.notes if n.startswith("MoE")][0].startswith("MoE dropless (balanced)")
    assert a2a(megatron) == {131072}
    counts = [(r.phase, r.op, r.size_bytes, r.per_microbatch, r.group_size, r.example_ranks)
              for r in megatron.collectives[next(iter(megatron.collectives))] if r.dtype == "int64"]
    assert counts == [("forward", "all-gather", 256, 2, 4, (0, 1, 2, 3))]
    capacity = plan_of(moe_dropless=False, framework="megatron")  # drop and pad: no count exchange
    assert not [r for r in capacity.collectives[next(iter(capacity.collectives))] if r.dtype == "int64"]


def _timeline_ep(st) -> Counter:
    """(group, op) -> calls per step of the ep events in stage 0's units (the replay's dispatch
    is a forward event inside a backward unit, so phases are not compared)."""
    out: Counter = Counter()
    for e in st.pipeline.events:
        if e.stage == 0 and e.stream == "compute":
            out.update((ie.args["group"], ie.args["op"]) for ie in st.units.of_event(e).events
                       if ie.args.get("kind") == "ep")
    return out


@pytest.mark.parametrize("framework,recompute", [("torch", "none"), ("torch", "full"), ("megatron", "full")])
def test_count_exchange_is_timed_before_each_dispatch(framework, recompute):
    """The count exchange is in the step: per step (m 1, 2 MoE layers) the timeline issues as many
    count exchanges and token all-to-alls as the table counts (forward 2 + 2 replayed with full
    recompute; tokens 4 forward + 4 backward + 4 replayed), each count exchange right before a
    dispatch on the ep stream, lasting the row's time."""
    from meshplan.schedule.steptime import step_time

    p = plan_of(framework=framework, recompute=recompute, global_batch=4)
    rows = p.collectives[next(iter(p.collectives))]
    cnt = [r for r in rows if r.dtype == "int64"]
    op = "all-gather" if framework == "megatron" else "all-to-all"
    replayed = 2 if recompute == "full" else 0
    assert sum(r.per_step for r in cnt) == 2 + replayed and {r.op for r in cnt} == {op}
    table = Counter({("counts", op): 2 + replayed, ("", "all-to-all"): 8 + 2 * replayed})
    st = step_time(p)
    assert _timeline_ep(st) == table
    events = [ie for e in st.pipeline.events if e.stage == 0 and e.stream == "compute"
              for ie in st.units.of_event(e).events if ie.args.get("kind") == "ep"]
    for a, b in zip(events, events[1:]):
        if a.args["group"] == "counts":
            assert b.name == "ep dispatch" and b.start_s >= a.end_s - 1e-15
            assert a.end_s - a.start_s == pytest.approx(cnt[0].time_s)
    assert cnt[0].time_s > 0


def test_capacity_factor_by_hand():
    base, wide = plan_of(moe_dropless=False), plan_of(moe_capacity_factor=1.25)
    assert isinstance(base, Plan) and isinstance(wide, Plan)
    assert a2a(base) == {131072} and a2a(wide) == {163840}
    assert expert_gemms(base) == [("expert_w_up", 512, 2)] and expert_gemms(wide) == [("expert_w_up", 640, 2)]
    note = [n for n in wide.notes if n.startswith("MoE capacity")][0]
    assert "ceil(1.25 x T 512 x top_k 2 / experts 8) = 160" in note and "the same on every ep rank" in note
    hot = plan_of(moe_capacity_factor=1.25, moe_hottest_expert_share=0.25)
    assert "96 copies dropped per rank per layer" in [n for n in hot.notes if n.startswith("MoE")][0]
    assert a2a(hot) == {163840}  # padded to capacity: the bytes do not follow the routing


def test_dropless_with_stated_imbalance_by_hand():
    p = plan_of(moe_dropless=True, moe_hottest_expert_share=0.25)
    assert a2a(p) == {1463 * 64 * 2}
    assert expert_gemms(p) == [("expert_w_up", 439, 1), ("expert_w_up (hottest)", 1024, 1)]
    balanced = plan_of(moe_dropless=True)
    assert a2a(balanced) == {1024 * 128} and expert_gemms(balanced) == [("expert_w_up", 512, 2)]


def test_routed_activations_follow_the_rows():
    cfg = lambda **t: config_from_dict({"model": MODEL, "cluster": {"system": "dgx-h100", "nodes": 1},  # noqa: E731
                                        "training": dict(global_batch=4, seq_len=512, recompute="none", **t),
                                        "mesh": dict(names=["dp_shard", "ep"], shape=[4, 4], world=4)})
    mesh = plan_of().mesh
    saved = {}
    for key, extra in {"base": {"moe_capacity_factor": 1.0}, "wide": {"moe_capacity_factor": 1.25},
                       "hot": {"moe_dropless": True, "moe_hottest_expert_share": 0.25}}.items():
        c = cfg(**extra)
        saved[key] = layer_act_sizes(c.model, c.training, mesh, MemoryOptions(), moe=True).saved
    assert saved["wide"] - saved["base"] == 256 * 512
    assert saved["hot"] - saved["base"] == (1463 - 1024) * 512


def test_expert_gemm_time_grows_with_the_rows():
    from meshplan.schedule.unit_sim import Overlap
    from meshplan.schedule.steptime import step_time

    big = {**MODEL, "hidden": 2048, "q_heads": 16, "kv_heads": 8, "expert_ffn": 4096}  # past the issue floor
    t = {k: step_time(plan_of(model=big, seq_len=4096, **kw), Overlap()).step_s
         for k, kw in {"base": {"moe_capacity_factor": 1.0}, "wide": {"moe_capacity_factor": 2.0},
                       "hot": {"moe_dropless": True, "moe_hottest_expert_share": 0.5}}.items()}
    assert t["base"] < t["wide"] and t["base"] < t["hot"]


def test_routing_errors():
    with pytest.raises(ConfigError, match="training.moe_hottest_expert_share: 0.1 is below the balanced share"):
        plan_of(moe_hottest_expert_share=0.1)
    with pytest.raises(ConfigError, match="training.moe_capacity_factor: .* has no experts"):
        plan_of(model={k: v for k, v in MODEL.items() if k not in ("experts", "top_k", "expert_ffn")},
                mesh=dict(names=["dp_shard"], shape=[4], world=4), moe_capacity_factor=1.5)
    with pytest.raises(ConfigError, match="dropless routing has no capacity"):
        plan_of(moe_dropless=True, moe_capacity_factor=1.5)
    # tp 2 without SP splits b x s = 511 tokens unevenly: the ranks would size different capacities
    bad = plan_of(seq_len=511, mesh=dict(names=["dp_shard", "tp", "ep"], shape=[2, 2, 4], world=4))
    assert any("do not split evenly over tp 2" in r and "hang" in r for r in bad.reasons)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_capacity_factor_matches_torch_all_to_all():
    """The runtime MoE with capacity factor 1.5 on the fake process group: 16 tokens x top_k 2
    over 8 experts -> C = ceil(1.5 x 32 / 8) = 6, a 48-row buffer (fp32: 48 x 64 x 4 B)."""
    pytest.importorskip("torch")
    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.runtime.validation.compare import differences, tally_records, tally_table
    from meshplan.runtime.validation.dryrun import dry_run
    from meshplan.spec.mesh import MeshSpec
    from meshplan.spec.model import ModelSpec
    from meshplan.spec.training import TrainingSpec
    from tests.test_table_vs_torch import FP32, table_for

    model = ModelSpec(name="tiny-moe", **MODEL)
    training = TrainingSpec(global_batch=8, seq_len=16, moe_capacity_factor=1.5, **FP32)
    mesh = resolve_mesh(MeshSpec(names=["dp_shard", "ep"], shape=[8, 4]), world=prod([8]))
    run = dry_run(model, training, mesh, rank=3, optimizer_step=False)
    assert {r.size_bytes for r in run.records if r.op == "all-to-all"} == {48 * 64 * 4}
    assert differences(tally_records(run.records, mesh, 3), tally_table(table_for(model, training, mesh), mesh, 3)) == []


def test_runners_build_dropless_and_the_dry_run_refuses_it():
    pytest.importorskip("torch")
    from meshplan.runtime.execution.parallelize import unsupported_mesh
    from meshplan.runtime.validation.dryrun import dry_run
    from meshplan.spec.model import ModelSpec

    p = plan_of(moe_dropless=True)
    assert unsupported_mesh(p.mesh, p.config.training, moe=True) is None
    with pytest.raises(ConfigError, match="training.moe_dropless: dropless MoE routing sizes its all-to-alls"):
        dry_run(ModelSpec(name="tiny-moe", **MODEL), p.config.training, p.mesh, rank=0)


def _balance_job(tmp_path, **training):
    """Model M on one dgx-h100 node, dp_shard 8 with ep 4 (8 experts: 2 per ep rank)."""
    from tests.configs import job_toml
    job = tmp_path / "moe.toml"
    job.write_text(job_toml({**MODEL, "name": "m"}, training={"global_batch": 8, "seq_len": 512, **training},
                            mesh={"names": ["dp_shard", "ep"], "shape": [8, 4]}))
    return job


BALANCED = ("MoE routing assumed balanced: each of the 8 experts gets 1/8 of the token copies on every rank, which "
            "sizes the ep all-to-alls, the expert GEMMs and the routed-expert activations (a real router's per-step "
            "counts scatter around it); set training.moe_hottest_expert_share (the busiest expert's share, 1/8 to 1) "
            "to plan a skewed one")


@pytest.mark.parametrize("command", [["plan"], ["step"], ["memory", "--all-stages"], ["search", "--top", "2"]])
def test_each_moe_command_says_once_that_routing_is_balanced(tmp_path, monkeypatch, capsys, command):
    """n26small #4: plan, step, search and memory of an MoE plan assumed balanced routing (the
    share 1 / experts, training.moe_hottest_expert_share unset) and none said so. Each prints one
    note naming it and the key (8 experts: 1/8); a stated share is named instead; a dense model none."""
    from cli_run import run_main
    monkeypatch.chdir(tmp_path)
    run_main(command[0], _balance_job(tmp_path), *command[1:])
    out = " ".join(capsys.readouterr().out.split())
    assert out.count(BALANCED) == 1 and out.count("moe_hottest_expert_share") == 1, out[-2000:]
    run_main(command[0], _balance_job(tmp_path, moe_hottest_expert_share=0.25), *command[1:])
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("MoE routing as stated: the busiest expert gets 0.25 of the token copies on every rank "
                     "(training.moe_hottest_expert_share; unset: balanced, 1/8)") == 1 and "assumed balanced" not in out
    if command[0] == "memory":
        from tests.conftest import EXAMPLES
        run_main("memory", EXAMPLES / "mini_2x4_tp2-dp4.toml", "--out", "dense")
        assert "MoE routing" not in capsys.readouterr().out
