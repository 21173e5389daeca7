"""What the critical stage's bubble waits for (issue 11, a newcomer's finding): DeepSeek-V3 at
pp 16 x ep 64 printed "bubble 0.12 as idle/ideal" and a step of which 36.8 s (71%) was stage 0's
bubble, while the cause, the expert stages' exposed ep all-to-alls, appeared only on a side line.
The bubble is split on the simulated timeline (meshplan.schedule.waits): the pipeline simulated
again without the units' exposed ep."""

import dataclasses
import json

import jsonschema
import numpy as np
import pytest

from meshplan.config import config_from_dict, load_config
from meshplan.pipeline.fast import simulate_arrays
from meshplan.pipeline.simulate import PipelineSpec
from meshplan.plan import build_plan
from meshplan.report.json_docs import schema_of, step_doc
from meshplan.schedule.pipeline_exposure import pipeline_without, stage_bubble
from meshplan.schedule.steptime import step_time
from meshplan.schedule.verdict import network_verdict
from meshplan.schedule.waits import bubble_wait
from tests.configs import job_toml
from tests.conftest import EXAMPLES


def test_wait_by_hand_on_the_pipeline():
    """1F1B p 2, m 4, no p2p time. Stage 0 (dense): F 2 s, B 4 s. Stage 1 (experts): F 3 s
    (2 of them exposed all-to-all), B 6 s (4 exposed).

    As simulated: stage 1 runs F0 2-5, B0 5-11, F1 11-14, B1 14-20, F2 20-23, B2 23-29, F3 29-32,
    B3 32-38; stage 0 F0 0-2, F1 2-4, B0 11-15, F2 15-17, B1 20-24, F3 24-26, B2 29-33, B3 38-42:
    busy 24 s, idle 42 - 24 = 18 s (= m (3 + 6) - (m - 1)(2 + 4)).

    Without the exposed time (stage 1: F 1 s, B 2 s) stage 0 is the slower: stage 1 F0 2-3, B0
    3-5, F1 5-6, B1 6-8; stage 0 F0 0-2, F1 2-4, B0 5-9 (idle 1), F2 9-11, B1 11-15, F3 15-17, B2
    17-21, B3 21-25 (stage 1's B3 ends at 20): idle 1 s. Of stage 0's 18 s bubble, 17 s wait for
    stage 1's exposed communication, less than the 24 s stage 1 exposes."""
    spec = PipelineSpec("1f1b", p=2, m=4)

    def dur(f):
        return np.where(f.stage == 0, np.where(f.kind == 0, 2.0, 4.0), np.where(f.kind == 0, 3.0, 6.0))

    res = simulate_arrays(spec, dur)
    exposed = np.where(res.flat.stage == 1, np.where(res.flat.kind == 0, 2.0, 4.0), 0.0)
    bare = pipeline_without(res, exposed)
    assert (res.step_s, stage_bubble(res, 0)) == (42.0, 18.0)
    assert (bare.step_s, stage_bubble(bare, 0)) == (25.0, 1.0)


def small_moe(framework: str, **training):
    """DeepSeek-V2-Lite's shapes on 4 layers, 2 dense then 2 MoE (64 experts of width 512, no
    shared expert), pp 2 (stage 0 dense, stage 1 the experts) x dp_shard 64 with ep 64 over 8
    nodes, 4 micro-batches of 4,096 tokens."""
    return build_plan(config_from_dict({
        "model": {"catalog": "deepseek-v2-lite", "layers": 4, "dense_layers": 2, "expert_ffn": 512,
                  "shared_experts": 0},
        "cluster": {"system": "dgx-h100", "nodes": 16},
        "training": {"global_batch": 256, "seq_len": 4096, "sharding": "zero1", "recompute": "full",
                     "framework": framework, **training},
        "mesh": {"names": ["pp", "dp_shard", "ep"], "shape": [2, 64, 64], "pp_layer_split": [2, 2]}}))


@pytest.fixture(scope="module", params=["torch", "megatron"])
def small(request):
    plan = small_moe(request.param)
    return plan, step_time(plan)


def test_small_moe_wait_by_hand(small):
    """Stage 0 (f0, b0 per micro-batch) waits for stage 1 (f1, b1, of them e_f, e_b exposed ep),
    which stays the slower stage without its exposed ep (f1 + b1 - e_f - e_b > f0 + b0 + 2 p2p).
    torch's Schedule1F1B (tests/test_torch_p2p_waits.py): stage 1 runs its F0 at f0 + p2p, then
    its units with one transfer in each of its m - 1 fused calls (send B k, receive F k + 1,
    waited at once; stage 0 posted its side first), its last gradient's send met by stage 0's
    receive: stage 0 ends f0 + p2p + m (f1 + b1) + (m - 1) p2p + p2p + b0 after the start, its
    bubble m (f1 + b1) - (m - 1)(f0 + b0) + p2p (its idle less its m waited calls' transfers,
    exposed pp; with asynchronous sends, as meshplan modelled torch before, - 2 p2p at m 4).
    Without the exposed ep the bubble loses m (e_f + e_b): all of stage 1's exposed ep. Megatron-LM's
    blocking sends hold each stage for its partner but leave stage 1 back to back, so the wait
    is all of it there too. (NIC sharing, schedule/nic_fair.py NicBook: under torch the last
    backward's ep all-to-alls run beside the gradient reduction's pieces over dp on the same NICs, so
    its exposed ep is 0.4445 ms more than the other micro-batches': all of stage 1's exposed ep is the
    sum over them, m e where the micro-batches agree. By hand: layer 1's reduce-scatter (1.3294 ms
    alone, NIC demand 0.879) issued at 19.6154 ms has 0.6032 ms left when the expert dispatch (2.0469
    ms alone, demand 0.860) is issued at 20.3416 ms; both over the fair half (max-min), each at half the
    NIC: the reduce-scatter at 0.5 / 0.879 = 0.5686 of its speed ends 1.0608 ms later (+0.4576 ms, dp),
    the dispatch does 0.5811 x 1.0608 = 0.6164 ms of its work meanwhile and 1.4305 ms alone after:
    2.4914 ms, +0.4445 ms, which the compute waits for. 0.2527 ms when the earlier collective kept its
    end (the dispatch alone slowed: 0.5811 x 0.6032 done in 0.6032 ms, 1.6964 ms after).)"""
    plan, st = small
    u, m, p2p = st.units, st.pipeline.spec.m, st.pipeline.spec.p2p_s
    f0, b0, f1, b1 = (u.get(s, 0, k, 0).duration_s for s, k in ((0, "F"), (0, "B"), (1, "F"), (1, "B")))
    e = sum(u.get(1, 0, k, 0).exposed_s["ep"] for k in "FB")
    every = sum(u.get(1, 0, k, j).exposed_s["ep"] for k in "FB" for j in range(m))  # m e, or more (torch)
    assert every - m * e == pytest.approx(4.445e-4 if plan.config.training.framework == "torch" else 0.0, abs=1e-7)
    assert st.critical_stage == 0 and "ep" not in st.exposed_s and f1 + b1 - e > f0 + b0 + 2 * p2p
    bw = bubble_wait(st)
    assert (bw.stream, bw.stage, bw.stages) == ("ep", 1, (1,))
    assert bw.exposed_s == pytest.approx(every, rel=1e-9)
    assert bw.wait_s == pytest.approx(every, rel=1e-9)
    assert bw.bubble_s == st.parts_s()["bubble"]
    if plan.config.training.framework == "torch":
        # stage 1's units summed over the micro-batches: m (f1 + b1), and the last backward's 0.4445 ms more
        one = sum(u.get(1, 0, k, j).duration_s for k in "FB" for j in range(m))
        assert one - m * (f1 + b1) == pytest.approx(every - m * e, abs=1e-9)
        assert bw.bubble_s == pytest.approx(one - (m - 1) * (f0 + b0) + p2p, rel=1e-9)
        # e: 24.563 ms of token all-to-alls before the count exchange was timed, + 4 x 176.7 us (2 MoE
        # layers, forward and replay: 512 B over ep 64 on 8 nodes, 63 network latency steps)
        # f0 + b0: stage 0's embedding forward holds torchtitan's batch copy to the GPU (17.1 us over
        # PCIe 5.0, compute/batch_input.py)
        assert (f1 + b1, f0 + b0, e) == pytest.approx((0.046370, 0.012358, 0.025270), abs=1e-6)


def test_schedule_runs_wait_each_run():
    """training.pp_schedule_runs 2: each run of 2 micro-batches repeats the first (stage 0 the
    critical stage, so the run shift is its run and a later run idles as run 1 does): the bubble
    counted by stage_bubble with the later run equals the step's parts, and each run waits for
    its 2 micro-batches' exposed ep on stage 1, 4 (e_f + e_b) in all, as with one run, and each run's
    last backward the 0.4445 ms more its ep all-to-alls wait on the NICs beside the gradient reduction's
    pieces (NIC sharing, test_small_moe_wait_by_hand: 0.2527 ms before the earlier reduce-scatter
    was slowed too)."""
    from meshplan.schedule.pipeline_exposure import last_tail_s, run_shift
    st = step_time(small_moe("torch", pp_schedule_runs=2))
    res, u = st.pipeline, st.units
    assert (st.runs, res.spec.m, st.critical_stage) == (2, 2, 0)
    assert stage_bubble(res, 0, last_tail_s(res, 0, u), 1, run_shift(res, u)) == st.parts_s()["bubble"]
    e = sum(u.get(1, 0, k, 0).exposed_s["ep"] for k in "FB")
    last = sum(u.get(1, 0, k, 1).exposed_s["ep"] for k in "FB") - e  # 0.4445 ms
    assert last == pytest.approx(4.445e-4, abs=1e-7)
    assert bubble_wait(st).wait_s == pytest.approx(4 * e + 2 * last, rel=1e-9)


def test_small_moe_verdict_names_the_waited_all_to_all(small):
    """Torch: stage 0's exposed dp 4.00 ms and pp 1.46 ms and its 101.08 ms wait for stage 1's
    ep are 106.5 ms of the 205.3 ms step: network-bound on the all-to-all that stage 1 exposes.
    Its bytes are stage 1's table's, its rate each rank's own NIC (50 GB/s: ep 64 over 8 nodes,
    one group per node, a NIC per GPU), not the ring's 8 NICs (400 GB/s)."""
    plan, st = small
    bw = bubble_wait(st)
    lines = network_verdict(plan, st, bw=bw)
    wait = f"{round(bw.wait_s * 1e5) / 100:.2f}"
    assert lines[0] == (f"bubble on stage 0: {st.shown_ms()['bubble']} ms, of which {wait} ms waiting for the ep "
                        f"communication the other stages expose (stage 1 the most: {bw.exposed_s * 1e3:.2f} ms per "
                        f"step); the pipeline simulated again without any unit's exposed ep leaves stage 0 "
                        f"{float(st.shown_ms()['bubble']) - float(wait):.2f} ms idle")
    total = sum(st.exposed_s.values()) + bw.wait_s
    rows = [r for r in plan.stage(1).collectives if r.axis == "ep"]
    sent = sum(r.sent_bytes_per_step for r in rows)
    # Megatron-LM also all-gathers the per-expert token counts before each dispatch
    ops = {"all-to-all"} | ({"all-gather"} if plan.config.training.framework == "megatron" else set())
    assert {r.op for r in rows} == ops and rows[0].path.nic_bandwidth_bytes_per_s == 50e9
    if total < 0.5 * st.step_s:  # Megatron-LM: 104.4 ms exposed or waited of a 208.9 ms step, just under half
        assert plan.config.training.framework == "megatron" and len(lines) == 1
        return
    assert lines[1].startswith(f"verdict: network-bound: {total:.1f} s of the {st.step_s:.1f} s step is exposed "
                               f"communication or waiting for it, most on ep (stage 0 waits {bw.wait_s:.1f} s for it "
                               f"in its bubble; stage 1 exposes {bw.exposed_s:.1f} s of it per step): each rank of "
                               f"stage 1 sends {sent / 1e9:,.0f} GB per step on it (forward all-to-all ")
    assert lines[1].endswith("; 50.0 GB/s per rank: its share of its own NIC)")


@pytest.fixture(scope="module")
def deepseek():
    """The example as the finding ran it, under framework torch (the example now sets megatron,
    whose stages 1-14 tie within rounding and list stage 11 first)."""
    cfg = load_config(EXAMPLES / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml")
    cfg = dataclasses.replace(cfg, training=cfg.training.model_copy(update={"framework": "torch"}))
    plan = build_plan(cfg)
    return plan, step_time(plan)


def test_deepseek_bubble_is_mostly_the_expert_stages_all_to_alls(deepseek):
    """The finding's example: of stage 0's 37.0 s bubble, 28.6 s is waiting for the ep
    all-to-alls of the expert stages 1-14 (25.8 s each per step, the count exchanges included); the verdict names them with
    the bytes each rank of stage 1 sends per step (444 GB forward, 888 GB backward: 2 and 4
    all-to-alls per MoE layer and micro-batch, the backward's recompute included) and the link."""
    plan, st = deepseek
    bw = bubble_wait(st)
    assert bw.stream == "ep" and sorted(bw.stages) == list(range(1, 15))  # tied within 1e-9, any first
    assert bw.wait_s > 0.5 * bw.bubble_s and bw.bubble_s > 0.5 * st.step_s
    lines = network_verdict(plan, st, bw=bw)
    # 25814.30 ms before NIC sharing: the last backward's ep all-to-alls beside the gradient reduction's pieces;
    # 25821.10 ms before max-min sharing slowed the earlier collective too: +6.0091 ms in each expert stage's
    # last backward. By hand at layer 1: the dispatch (8.9044 ms alone, NIC demand 0.923) is issued 2.5364 ms
    # after the experts' reduce-scatter (7.4832 ms alone, demand 0.942); both over the fair half, each at half
    # the NIC: the reduce-scatter's 4.9468 ms left take 4.9468 x 0.942 / 0.5 = 9.3162 ms, the dispatch does
    # 0.5416 x 9.3162 ms meanwhile and 3.8590 ms after: 13.1752 ms, 2.0031 ms more than when the reduce-scatter
    # kept its end (4.9468 + 8.9044 - 0.5416 x 4.9468 = 11.1721 ms); the unit's layers before it 4.0060 ms
    # the same way (its events there already 4.0060 ms later)
    assert "(stages 1-14 the most: 25827.11 ms each per step)" in lines[0]
    # 28.8 s of 51.7 s, stage 0 waiting 28.6 s, before NIC sharing (each expert stage's last backward longer);
    # 28.9 of 51.8 s, waiting 28.7 s, before the earlier collective was slowed too: the 14 expert stages'
    # last backwards drain one after another, 14 x 6.0091 = 84.1 ms more of step and of stage 0's wait
    # (51.820 -> 51.904 s, 28.742 -> 28.826 s). 51.904 -> 51.847 s in the event-ordered run (unit_events): the
    # MoE stages' forward unit (4 layers) is main's again to the bit (113.908 ms, no two network collectives at
    # once in it); nicshare4's pass iteration had each layer's mlp 0.0283 ms longer (5.5592 ms against 5.5309),
    # slowed by the ep dispatch's SM share over an interval the dispatch no longer had (its end moved by a
    # forecast pass, the SM list kept the old one), 4 x 0.0283 = 0.113 ms a forward unit and its backward's
    # replay likewise (270.248 -> 269.932 ms); stage 0's wait (28.826 s) and stages 1-14's 25827.11 ms unchanged
    assert lines[1].startswith("verdict: network-bound: 29.0 s of the 51.8 s step is exposed communication or "
                               "waiting for it, most on ep (stage 0 waits 28.8 s for it in its bubble; stages 1-14 "
                               "expose 25.8 s of it per step each): each rank of stage 1 sends 1,332 GB per step on "
                               "it (forward all-to-all 444 GB, backward all-to-all 888 GB (444 GB of it the "
                               "recompute's replay)), 1,183.8 GB of it across the network (the rest over NVLink) "
                               "over network (1 group(s) per node, on NIC(s) ")  # ep 64, 8 a node: 56 of 63 pieces leave it
    doc = json.loads(json.dumps(step_doc(plan, st, lines, None, bw=bw)))
    assert list(jsonschema.Draft202012Validator(schema_of("step")).iter_errors(doc)) == []
    wait = doc["most_exposed_stage"]["bubble_wait"]
    assert wait["bubble_s"] == doc["step_parts_s"]["bubble"] and sorted(wait["stages"]) == list(range(1, 15))
    assert wait["wait_s"] == pytest.approx(wait["bubble_s"] - wait["bare_bubble_s"], abs=1e-12)


SMALL_MOE_TOML = job_toml({"catalog": "deepseek-v2-lite", "layers": 4, "dense_layers": 2, "expert_ffn": 512,
                           "shared_experts": 0}, nodes=16,
                          training={"global_batch": 256, "seq_len": 4096, "sharding": "zero1", "recompute": "full",
                                    "framework": "torch"},
                          mesh={"names": ["pp", "dp_shard", "ep"], "shape": [2, 64, 64], "pp_layer_split": [2, 2]})


def test_step_json_computes_the_wait_once(tmp_path, monkeypatch, capsys):
    """``meshplan step --json`` simulates the pipeline again without the exposed ep once: the
    verdict's first line and the JSON's ``most_exposed_stage.bubble_wait`` share it (issue 11:
    it was computed twice), and both equal what :func:`bubble_wait` gives on its own (the small
    MoE above as TOML: stage 0 waits 98.25 ms of its 144.58 ms bubble for stage 1's ep)."""
    import sys

    from meshplan import cli
    from meshplan.cli import step_cmd
    from meshplan.schedule import waits

    calls = []

    def counted(st):
        calls.append(st)
        return bubble_wait(st)

    for mod in [m for name, m in sys.modules.items() if name.startswith("meshplan") and m is not None]:
        if getattr(mod, "bubble_wait", None) is bubble_wait:
            monkeypatch.setattr(mod, "bubble_wait", counted)
    assert step_cmd.bubble_wait is counted and waits.bubble_wait is counted
    cfg, out = tmp_path / "moe.toml", tmp_path / "step.json"
    cfg.write_text(SMALL_MOE_TOML)
    with pytest.raises(SystemExit) as done:
        cli.main(["step", str(cfg), "--json", str(out)])
    assert not done.value.code
    printed = capsys.readouterr().out
    assert len(calls) == 1
    plan = small_moe("torch")
    st = step_time(plan)
    bw = bubble_wait(st)
    doc = json.loads(out.read_text())
    assert doc["most_exposed_stage"]["bubble_wait"] == {
        "stream": bw.stream, "stages": list(bw.stages), "bubble_s": pytest.approx(bw.bubble_s, rel=1e-12),
        "wait_s": pytest.approx(bw.wait_s, rel=1e-12), "bare_bubble_s": pytest.approx(bw.bare_bubble_s, rel=1e-12)}
    assert doc["verdict"][0] == network_verdict(plan, st, bw=bw)[0] in printed
    # 147.68 ms before torch's 1F1B calls waited (+ 3 transfers of 0.37 ms: test_small_moe_wait_by_hand);
    # 148.77 and 101.08 ms before NIC sharing (the last backward's 0.2527 ms more exposed ep, both);
    # 149.02 and 101.33 ms before the earlier collective was slowed too: 0.4445 - 0.2527 = 0.19 ms more, both
    assert doc["verdict"][0].startswith("bubble on stage 0: 149.22 ms, of which 101.52 ms waiting for the ep")
