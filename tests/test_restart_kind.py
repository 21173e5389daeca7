"""A restart keeps the job's kind (rs8, newcomer trials 8 and 26): pp, tp and cp unchanged, first
unless a mesh changing them plans more than REMESH_MARGIN (29.4%) more tokens/s; the kind is also tried at
another global batch (all GPUs) and on fewer GPUs; one alternative shown at most."""

import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.mesh.resolve import resolve_mesh
from meshplan.restart import PipelineRule, restart_on_fewer_nodes
from meshplan.spec.accuracy import REMESH_MARGIN, RESTART_MARGIN
from meshplan.spec.mesh import MeshSpec
from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from tests.cli_run import run_main
from meshplan.schedule import steptime
from meshplan.schedule.steptime import step_time
from tests.fsdp2_tail import deferred_wait, tail_of


def _nvlink_shares_only(cluster):
    """The SM share of a collective's NCCL kernel as meshplan charged it before nc52fixC: NVLink rows'
    ``fabric.nccl_channels / gpu.sms``, 0 over the network (row_shares.nccl_sm_share now adds NCCL's
    network channels)."""
    f = cluster.node.fabric.nccl_channels / cluster.gpu.sms
    return lambda row: f if row.path.kind == "nvlink" else 0.0


def _restart(pp_gain: float):
    """The seed's mesh dp_shard 8 x tp 8 (global batch 512, micro_batch 1, 80 layers, pp varied)
    loses a node: 56 GPUs. A stand-in evaluator plans 1000 tokens/s per ideal GPU (GPUs less the
    1F1B bubble, Proposal.ideal), times ``pp_gain`` at pp > 1."""
    def evaluate(p):
        return replace(p, step_s=1.0, tokens_per_s=1000 * p.ideal * (pp_gain if p.pp > 1 else 1.0), peak_bytes=0.0)
    m = resolve_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[8, 8]), world=64)
    return restart_on_fewer_nodes(m, 1, gpus_per_node=8, global_batch=512, micro_batch=1,
                                  pipeline=PipelineRule(80, 1), evaluate=evaluate)


def test_kind_at_another_global_batch_by_hand():
    """tp 8, pp x dp <= 7. The kind (pp 1): dp 7 cannot divide 512 -> global batch 73 x 7 = 511,
    56 GPUs, 56,000 tokens/s; dp 4 keeps 512 on 32 GPUs, 32,000 (24 idle). Other kinds keeping 512:
    pp 7 x dp 1 on 56 GPUs, m = 512: 56 x 512 / 518 = 55,351.4; pp 3 x dp 2: 48 x 256 / 258 =
    47,627.9; pp 6 x dp 1: 48 x 512 / 517 = 47,535.8; pp 5 x dp 1: 40 x 512 / 516 = 39,689.9; pp 2 x
    dp 2: 32 x 256 / 257 = 31,875.5; pp 4 x dp 1: 32 x 512 / 515 = 31,813.6; pp 3 x dp 1: 24 x 512 /
    514 = 23,906.6. The kind's dp 4 is 1.75x slower than its dp 7 (> 5%): the kind's plan is dp 7 at
    511, and nothing plans more than 5% over 56,000 (pp 7: 1.2% less): dp 7 first, pp 7 the one
    alternative, keeping the global batch."""
    r = _restart(1.0)
    assert [(p.pp, p.dp, p.gpus, p.contract, round(p.tokens_per_s, 1)) for p in r.proposals] == [
        (1, 7, 56, "global_batch 512 -> 511", 56000.0), (7, 1, 56, "", 55351.4), (3, 2, 48, "", 47627.9),
        (6, 1, 48, "", 47535.8), (5, 1, 40, "", 39689.9), (1, 4, 32, "", 32000.0), (2, 2, 32, "", 31875.5),
        (4, 1, 32, "", 31813.6), (3, 1, 24, "", 23906.6)]
    assert r.lines()[0] == "restart: world 64 -> 56; mesh dp_shard 8 x tp 8 -> dp_shard 7 x tp 8 (shrunk: dp_shard 8 -> 7; kept: tp 8)"
    assert r.contract == "global_batch 512 -> 511" and r.micro_batches == (64, 73)
    shown = _shown(r)
    assert shown == ["alternative keeping the global batch: pp 7 (layers per stage 11, 12 x 3, 11 x 3) x tp 8 on 56 "
                     "GPUs, contract kept: step 1.00 s, 55,351 tokens/s"]  # balanced_split(80, 7), named (trial 16)
    assert any("the meshes that keep it change the job's kind or plan over 5% fewer tokens/s" in n for n in r.notes)


def _shown(r) -> list[str]:
    """The notes naming another mesh than the proposal."""
    return [n for n in r.notes if n.startswith(("runner-up", "alternative", "with a different global batch"))]


@pytest.mark.parametrize("gain, top", [(1.04, (1, 7)), (1.08, (1, 7)), (1.30, (1, 7)), (1.32, (7, 1))])
def test_kind_first_within_the_model_accuracy(gain, top):
    """pp > 1 planned ``gain`` x faster; pp 7 x dp 1 (pp 1 -> 7: a remesh) at
    55,351.35 x gain against the kind's dp 7 at 56,000. The kind stays first unless pp 7 plans more
    than REMESH_MARGIN (29.4%, FIDELITY's largest mean error when it was set) more: 56,000 x 1.294 = 72,464, so gain
    > 72,464 / 55,351.35 = 1.309. x 1.04 = 57,565.4 (2.8% more), x 1.08 = 59,779.5 (6.7%; under the
    5% rule this passed the kind over, trial 26 found such remeshes too eager) and x 1.30 = 71,956.8
    (28.5%): dp 7 first; x 1.32 = 73,063.8, 30.5% more: pp 7 first (it keeps the global batch too)."""
    assert RESTART_MARGIN == 0.05 and REMESH_MARGIN == 0.294
    r = _restart(gain)
    assert (r.proposals[0].pp, r.proposals[0].dp) == top
    assert round(max(p.tokens_per_s for p in r.proposals if p.pp == 7), 1) == round(55351.35 * gain, 1)
    assert len(_shown(r)) == 1


Q1TOP = """[model]
catalog = "llama3-70b"
[cluster]
system = "dgx-h100"
nodes = 16
[training]
global_batch = 512
seq_len = 8192
param_dtype = "fp32"
recompute = "none"
vocab_pad_divisor = 1
[memory]
kv_expanded = true
[mesh]
names = ["dp_shard", "cp", "tp"]
shape = [32, 2, 2]
sequence_parallel = true
pp_schedule = "1f1b"
"""


@pytest.mark.heavy
def test_q1top_restarts_as_fsdp(tmp_path, monkeypatch):
    """Trial 8's q1top (Llama-3-70B, seq 8192, dp_shard 32 x cp 2 x tp 2 on 16 dgx-h100, global
    batch 512) loses a node: 120 GPUs. It proposed pp 28 x dp_shard 1 x cp 2 x tp 2 (121,380
    tokens/s, global batch kept, 8 GPUs idle): dp_shard x cp 2 x tp 2 keeps 512 only at dp 16
    (64 GPUs: 72.2 GiB > 71.2 usable, 79.11 GiB x 0.9). Now the kind at another global batch: dp_shard 30 x cp 2 x
    tp 2, 512 -> 510 (17 micro-batches), 135,843 tokens/s, 11.9% over pp 28: pp 1 kept, pp 28 the
    one alternative. Since torch's CP ring merges are counted (meshplan.compute.ring_attention) the cp
    2 meshes are slower: the kind 129,127 tokens/s, and the alternative keeping the batch is pp 15 x
    dp_shard 2 x tp 4 on all 120 GPUs (no cp), 118,825 tokens/s, the kind 8.7% over it. Trial 16's
    balance rule (PipelineRule.runs) drops pp 15: 80 layers 5 or 6 a stage, 82 / (15 x 6) = 0.91
    with the ends counted, under 0.95; the alternative is pp 28 x cp 2 x tp 2 on 112 GPUs (balanced_split
    [2, 3 x 24, 2 x 3], 82 / (28 x 3) = 0.98), 115,023 tokens/s, the kind 12.3% over it; since rafpp (its
    FSDP over cp 2 keeps each chunk gathered under pp, torchtitan's default) and torchp2p (torch's 1F1B waits
    on its sends) 119,624 tokens/s at 35.06 s a step, the kind 7.9% over it. Since torch's ring SDPA calls are
    rated one by one at their shapes (cpring, meshplan.compute.ring_attention.ring_seconds: at seq 8192 and cp 2 each
    call is 4,096 or 2,048 long, rated below one call at S 8192) the cp 2 meshes are slower again: the kind 32.36 ->
    32.50 s (128,558 tokens/s; the 128-GPU plan 30.45 -> 30.58 s), the alternative 35.06 -> 35.18 s (119,223
    tokens/s); the same proposal, the kind 7.8% over the alternative. Since the block is one cp rank's
    (meshplan.compute.ring_attention.slowest_rank): eager, cp rank 1's ring kernels move 14 n_q more
    than rank 0's (n_q = 32 heads x 4096 x 128), 14 x 16,777,216 B / 2.97 TB/s = 79.1 us a layer, above
    rank 0's 66.2 us of slower SDPA, so rank 1's calls with the rank 1 bytes counted before: -66.2 us
    a layer and micro-batch, the kind x 80 x 17 = -0.090 s, 32.41 s (128,910 tokens/s; the 128-GPU plan
    x 80 x 16, 30.50 s), the alternative 35.11 s (119,471 tokens/s). Since torch's ring traffic is
    the table's (issue 11, cp_attention "ring": spec.axes.cp.ring_rows), per layer and micro-batch cp 2
    (NVLink) exposes its last fp32 dK/dV shift (134,217,728 B, 384.3 us) and its compute is slowed
    while NCCL holds 24 of the 132 SMs over the overlapped 2 K/V gathers at the q heads (195.7 us) and
    the first shift instead of all-gather CP's 2 x 36.3 us: 384.3 + (775.7 - 72.6) x 24 / 132 = 512.1 us,
    the kind x 80 x 17 = +0.696 s, 33.10 s (126,203 tokens/s; the 128-GPU plan x 80 x 16, 31.15 s), the
    alternative 35.69 s (117,521 tokens/s): the same proposal. Since a send/recv crosses nodes at its sender's one
    NIC (meshplan.comm.nccl_algorithms; pp 28 beside cp 2 x tp 2 has 2 ranks of each pp group on a node, whose group
    path is 2 NICs, 100 GB/s), the alternative's stage-to-stage sends (1 x 8192 / cp 2 / SP 2 x 8192 x 2 B =
    33,554,432 B each) move at one NIC's 50 GB/s: 35.69 -> 36.07 s (116,273 tokens/s); the kind (pp 1) is unchanged:
    the same proposal. Since each stage boundary takes its own pair's path (ppbound: stages 2k and 2k + 1 share a
    node, NVLink pair 111.0 us; 2k + 1 -> 2k + 2 a NIC pair, 721.8 us; tests/test_pp_boundary.py), the critical
    stage 0 spends its 512 calls' transfers at 111.0 us, -512 x 610.8 us = -312.7 ms, and the critical path's first
    forward out and last backward back cross the 14 NVLink boundaries once each, -2 x 14 x 610.8 us = -17.1 ms:
    36.07 -> 35.74 s (117,344 tokens/s), the same proposal. Under nic49 (FSDP2's reduce-scatters on
    their own stream with one in flight, beside the all-gathers at a max-min fair share of the NICs:
    schedule/unit_events.py, schedule/nic_fair.py, schedule/grad_reduce.py rs_buffer_wait) only the
    exposed fsdp part moves (compute, cp and tp to the microsecond), and by hand (tests/fsdp2_tail.py):
    each layer's backward all-gather (4.648 ms alone, demand 0.9061 of the NIC) runs beside the
    reduce-scatter issued 0.576 ms before it (demand 0.9237), each at the max-min level 1/2, so 4.648
    x 0.9061 / 0.5 = 8.423 ms, done 9.0 ms into the layer's 16.19 ms of backward: nothing exposed.
    What moves is each backward's end: the embedding's copy-in now waits for layer 0's reduce-scatter
    (alone on the NIC, no all-gather left: the table's 9.1190 ms, the kind's 9.1280 ms) past the
    embedding's tp all-gather and gradient (1.2111 ms): w = 7.9079 ms exposed a backward (the kind
    9.1280 - 1.2112 = 7.9168 ms), while the last backward's tail, the embedding's reduce-scatter no
    longer queued behind layer 0's, is w - copy-in (1.0613 ms) shorter: the step moves (m - 1) x w +
    copy-in, the 128-GPU plan 15 x 7.9079 + 1.0613 = 119.680 ms, 31.150 -> 31.270 s (134,132 tokens/s);
    the kind 16 x 7.9168 + 1.0615 = 127.730 ms, 33.105 -> 33.233 s (510 x 8192 / 33.2325 = 125,718
    tokens/s). The alternative (pp 28: FSDP over cp 2 inside a node, kept gathered under pp) reduces
    after each chunk's last backward (torch's perform_reduce_grad): stage 0 (layers 0 and 1 and the
    embedding), whose last backward ends the step, ran its copy-ins back to back while the reduce-scatters
    (NVLink, the embedding's 2.8660 ms, a layer's 2.3366) queued one behind the other; one in flight, each
    layer's copy-in (0.8643 ms) waits for the reduce-scatter before it: 2 x 0.8643 = 1.7286 ms (exposed
    fsdp 11.215 -> 12.944 ms), 35.7437 -> 35.7454 s (117,338 tokens/s; tests/fsdp2_tail.py deferred_wait).
    The same proposal, the kind 7.1% over the alternative. (nc52fixC: the FSDP all-gathers and
    reduce-scatters over dp_shard cross nodes and now hold NCCL's 16 network rings of the H100's 132
    SMs while they run (row_shares.nccl_net_channels), s = 0.1212 of every kernel they overlap, and they
    overlap most of the compute: a layer's forward gather (4.648 ms) and backward gather and
    reduce-scatter (8.4 and 9.1 ms at the NIC's max-min share), about 22 ms a layer and micro-batch, x
    0.1212 x 80 layers x 17 micro-batches = 3.6 s; the model plays it, kernels beside two rings at
    1 - 2s: the kind's SM contention 0.200 -> 4.405 s, the 128-GPU plan's 0.188 -> 4.140 s, read from
    the model; their kernels' own time (compute less contention) unchanged, exposed fsdp 2.6 and 2.4 ms
    shorter. Steps 33.23 -> 37.43 s (111,605 tokens/s) and 31.27 -> 35.22 s (119,092 tokens/s). The
    alternative's pp sends block, overlapping no kernel, and its FSDP stays on NVLink: unchanged, now
    5.1% above the kind, within the 29.4% remesh margin, so the kind is still proposed and a why line
    names the alternative. The nic49 tail above is checked as it was derived, with the SM shares of
    NVLink collectives alone, as before nc52fixC.)
    (kvheads: this chain was derived with K and V repeated to the q heads, torchtitan's ``repeat_kv``
    before ff0829c; the job is planned that way, ``[memory] kv_expanded = true``, so each step above holds;
    its peak is 68.9 GiB, not 64.6, as the SDPA then saves the repeated K and V too (4.38 GiB, below).
    At the default, SDPA reading the 8 KV heads, the ring moves 8x fewer K/V bytes and no repeat_kv copies
    run: tests/test_cp_kv_heads.py.)"""
    from typer.testing import CliRunner
    from meshplan import cli
    cfg = tmp_path / "q1top.toml"
    cfg.write_text(Q1TOP)
    out = CliRunner().invoke(cli.app, ["reliability", str(cfg), "--write-gbps", "100", "--read-gbps", "200",
                                       "--restart-overhead-s", "300"], env={"COLUMNS": "200"}).output
    lines = out.splitlines()
    assert ("restart: world 128 -> 120; mesh dp_shard 32 x cp 2 x tp 2 -> dp_shard 30 x cp 2 x tp 2 (shrunk: "
            "dp_shard 32 -> 30; kept: cp 2, tp 2)") in lines
    pair = 32 * 4096 ** 2 * 256   # one ring call's FLOP; rank 1's calls against rank 0's (FA2 rows, S7c / S8)
    layer = pair * (1 / 362 - 1 / 368 + 2.5 * (1 / 310 - 1 / 291)) / 1e12
    assert 14 * 32 * 4096 * 128 / 2.97e12 > -layer and round(80 * 17 * layer, 3) == -0.090
    assert round(32.50 + 80 * 17 * layer, 2) == 32.41 and round(30.58 + 80 * 16 * layer, 2) == 30.50
    ring = 384.3e-6 + (2 * 195.7 + 384.3 - 2 * 36.3) * 1e-6 * 24 / 132   # s a layer and micro-batch (docstring)
    assert (round(32.41 + 80 * 17 * ring, 2), round(30.50 + 80 * 16 * ring, 2)) == (33.11, 31.16)  # 33.10, 31.15 unrounded
    # nic49: (m - 1) x w + copy-in from each plan's own table and kernels (docstring; tests/fsdp2_tail.py),
    # against the step the model plays; 33.104795 and 31.150293 s the steps before nic49 (rounded to 1 us)
    kind = Q1TOP.replace("nodes = 16", "nodes = 15").replace("global_batch = 512", "global_batch = 510")
    nic, texts = [], (kind.replace("[32, 2, 2]", "[30, 2, 2]"), Q1TOP)
    with monkeypatch.context() as mp:  # nc52fixC: the SM shares as before it, NVLink collectives alone
        mp.setattr(steptime, "nccl_sm_share", _nvlink_shares_only)
        for text, base, m in zip(texts, (33.104795, 31.150293), (17, 16)):
            tail, step = tail_of(build_plan(config_from_dict(tomllib.loads(text))))
            assert tail.m == m and step == pytest.approx(base + tail.step_delta, abs=2e-6)
            nic.append((tail.step_delta, step_time(build_plan(config_from_dict(tomllib.loads(text))))))
    assert (round(nic[0][0] * 1e3, 2), round(nic[1][0] * 1e3, 2)) == (127.73, 119.68)
    assert (round(33.104795 + nic[0][0], 2), round(31.150293 + nic[1][0], 2)) == (33.23, 31.27)
    # nc52fixC: the network rings' SMs; the kernels' own time unchanged (read from the model: docstring)
    for text, (_, before), cont, step in zip(texts, nic, (4.405, 4.140), (37.43, 35.22)):
        st = step_time(build_plan(config_from_dict(tomllib.loads(text))))
        own = st.parts_s()["compute"] - st.contention_s()
        assert own == pytest.approx(before.parts_s()["compute"] - before.contention_s(), abs=2e-6)
        assert (round(st.contention_s(), 3), round(st.step_s, 2)) == (cont, step)
    # kvheads: kv_expanded true also saves the repeated K and V for the SDPA's backward at the 32 local q heads, not
    # 4 KV heads: 2 x 4096 tokens x 28 heads x 128 x 2 B x 80 layers = 4.38 GiB more, 64.6 -> 68.9 GiB (docstring)
    assert round(2 * 4096 * 28 * 128 * 2 * 80 / 2 ** 30, 2) == 4.38
    assert "- planned step 37.43 s, 111,605 tokens/s, memory peak 68.9 GiB: 6.3% of the throughput lost (the " \
           "128-GPU plan: step 35.22 s, 119,092 tokens/s)" in lines
    assert "- alternative keeping the global batch: pp 28 (layers per stage 2, 3 x 24, 2 x 3) x cp 2 x tp 2 on 112 " \
           "GPUs, contract kept: step 35.75 s, 117,338 tokens/s" in lines
    assert round(36.07 - (512 + 2 * 14) * (721.8 - 111.0) * 1e-6, 2) == 35.74   # before nic49: 35.7437 s
    alt = Q1TOP.replace("nodes = 16", "nodes = 15").split("[mesh]")[0] + (
        '[mesh]\nnames = ["pp", "cp", "tp"]\nshape = [28, 2, 2]\nworld = 112\nsequence_parallel = true\n'
        'pp_schedule = "1f1b"\npp_layer_split = [2, ' + ", ".join(["3"] * 24 + ["2"] * 3) + "]\n")
    wait, step = deferred_wait(build_plan(config_from_dict(tomllib.loads(alt))))
    assert round(wait * 1e3, 4) == 1.7286 and step == pytest.approx(35.743709 + wait, abs=2e-6)   # main's + nic49's
    assert round(35.743709 + wait, 2) == 35.75
    assert not [line for line in lines if "runner-up" in line or "pp 1 ->" in line]
    assert [line for line in lines if line.startswith("- why: the job's kind") and "plans 117,338 tokens/s, 5.1% "
            "more, within the 29.4% remesh margin" in line] and round(117_338 / 111_605 - 1, 3) == 0.051


def test_larger_changer_within_the_accuracy_is_named_with_its_tokens_per_s():
    """dp_shard 4 x cp 2 x tp 8 (global batch 512) loses a node: 56 GPUs, pp 1, (tp, cp) in (8, 2)
    and (8, 1). The kind (cp 2): dp 3 on 48 GPUs at 512 // 3 x 3 = 510, dp 2 keeps 512 on 32. cp 1:
    dp 7 on 56 at 511 (the largest mesh, other kind), dp 4 keeps 512 on 32. Stand-in tokens/s: 1000
    a GPU, x 1.12 at cp 2: dp 3 53,760, dp 7 56,000 (4.2% more, within REMESH_MARGIN 29.4%): dp 3 x cp 2 proposed,
    dp 7 refused in the head line with its tokens/s; the alternative keeps 512: dp 2 x cp 2 at 32 x
    1000 x 1.12 = 35,840 (dp 4 x cp 1: 32,000)."""
    from meshplan.restart import DegreeRule

    def evaluate(p):
        return replace(p, step_s=1.0, tokens_per_s=1000.0 * p.gpus * (1.12 if p.tp_cp[1] == 2 else 1.0),
                       peak_bytes=0.0)
    m = resolve_mesh(MeshSpec(names=["dp_shard", "cp", "tp"], shape=[4, 2, 8]), world=64)
    r = restart_on_fewer_nodes(m, 1, gpus_per_node=8, global_batch=512, micro_batch=1,
                               degrees=DegreeRule(((8, 2), (8, 1))), evaluate=evaluate)
    assert (r.shape, r.contract, round(r.proposals[0].tokens_per_s)) == ((3, 2, 8), "global_batch 512 -> 510", 53760)
    assert r.lines()[0] == (
        "restart: world 64 -> 48 (56 GPUs left); mesh dp_shard 4 x cp 2 x tp 8 -> dp_shard 3 x cp 2 x tp 8 (shrunk: "
        "dp_shard 4 -> 3; kept: cp 2, tp 8); not dp_shard 7 x tp 8 (56 GPUs): global_batch 512 is not divisible by micro_batch 1 x dp 7 = 7; "
        "with global_batch 512 -> 511: 56,000 tokens/s, not over 29.4% more than the job's kind")
    assert _shown(r) == ["alternative keeping the global batch: dp_shard 2 x cp 2 x tp 8 on 32 GPUs, contract kept: "
                         "step 1.00 s, 35,840 tokens/s"]


@pytest.mark.heavy
def test_405b_restart_drops_one_replica_and_says_why(tmp_path):
    """Newcomer trial 26: Llama-3-405B pp 16 x dp_shard 128 x tp 8 on 2048 dgx-h100 (global batch 2048,
    micro_batch 1) losing a node was proposed pp 1 x dp_shard 2048 x tp 4 on 8192 GPUs (every model-parallel
    degree changed, half the GPUs idle) because that plans 11.4% more tokens/s than the job's kind. Now the
    kind: 16376 GPUs left // (pp 16 x tp 8 = 128) = dp 127; 2048 is not a multiple of 127, so the global batch
    becomes 2048 // 127 = 16 micro-batches x 127 = 2032 on 16 x 127 x 8 = 16256 GPUs (120 idle: 15 nodes);
    the kind's dp keeping 2048 is 64 (8192 GPUs), about half the throughput, so over 5% below dp 127. pp 1 x
    dp_shard 2048 x tp 4 stays within REMESH_MARGIN of it, and the why line names it with its tokens/s.
    (nc52fixC: the network collectives hold NCCL's 16 rings of the H100's 132 SMs beside the kernels they
    overlap, row_shares.nccl_net_channels. pp 1 x dp_shard 2048 x tp 4 gathers and reduce-scatters every
    layer over the network beside its compute, 2 of its ranks on each NIC at tp 4: 1,363,037 -> 1,208,542
    tokens/s, now 0.6% under the kind (1,215,423 -> 1,215,321, its FSDP gathers a small share of its pp 16
    stages' step); read from the model. The fastest mesh changing pp, tp or cp is now pp 1 x dp_shard 2047 x
    tp 8 on 16376 GPUs at global batch 2047 (1,280,613 -> 1,280,101 tokens/s, 5.3% over the kind): within
    REMESH_MARGIN, the why line names it.)
    kvheads: no repeat_kv copies (SDPA reads the 8 KV heads, ``[memory] kv_expanded`` false): both steps
    shorten, pp 1's 126 layers per rank more than pp 16's 8: the gain 5.3% -> 5.2% (read from the model)."""
    import json
    ex = Path(__file__).resolve().parents[1] / "examples" / "llama3-405b_16384xh100_tp8-pp16-dp128.toml"
    out = tmp_path / "r.json"
    assert run_main("reliability", ex, "--lost-nodes", "1", "--json", out) == 0
    doc = json.loads(out.read_text())["restart"]
    assert (doc["shape"], doc["new_world"], doc["gpus_left"], doc["contract"]) == (
        [16, 127, 8], 16 * 127 * 8, 2047 * 8, "global_batch 2048 -> 2032")
    assert doc["micro_batches"] == [2048 // 128, 2048 // 127]  # 16 before (2048 / 128), 16 after (2032 / 127)
    props = {tuple(p["shape"]): p for p in doc["proposals"]}
    kind, keeper, remesh = props[(16, 127, 8)], props[(16, 64, 8)], props[(1, 2047, 8)]
    assert (keeper["gpus"], keeper["contract"], remesh["gpus"], remesh["contract"]) == (
        8192, "", 16376, "global_batch 2048 -> 2047")
    assert kind["tokens_per_s"] > keeper["tokens_per_s"] * (1 + RESTART_MARGIN)
    assert props[(1, 2048, 4)]["tokens_per_s"] < kind["tokens_per_s"]  # nc52fixC: its network rings' SMs
    gain = remesh["tokens_per_s"] / kind["tokens_per_s"] - 1
    assert 0 < gain <= REMESH_MARGIN and round(gain, 3) == 0.052   # kvheads: 0.053 with the repeat_kv copies
    assert any(n == ("why: the job's kind, the least-disruptive mesh (pp 16, tp 8 and cp 1 kept, only the data axes "
                     "shrunk); the fastest mesh changing pp, tp or cp, pp 1 x dp_shard 2047 x tp 8 on 16376 GPUs "
                     "(global_batch 2048 -> 2047), plans "
                     f"{remesh['tokens_per_s']:,.0f} tokens/s, {gain:.1%} more, within the 29.4% remesh margin (the "
                     "step model's largest mean error when it was set, docs/fidelity.md)") for n in doc["notes"])


def test_a_remesh_changing_the_global_batch_never_passes_a_kind_keeping_it():
    """The kind's plan keeps the global batch (dp_shard 4 x tp 8, 100 tokens/s); a remesh changing it
    plans 140 (40% more, over REMESH_MARGIN 29.4%): the kind stays first, since keeping the global batch
    is part of the least-disruptive restart; a remesh keeping it at 130 (30% more) is proposed."""
    from types import SimpleNamespace as N
    from meshplan.restart_rank import kind_first, kind_kept, kind_passed
    from meshplan.restart_text import kind_kept_text
    m = N(degree=lambda a: {"tp": 8}.get(a, 1))
    P = lambda pp, tp, tps, gb=True: N(pp=pp, tp_cp=(tp, 1), tokens_per_s=tps, keeps_global_batch=gb)
    kind, changer, keeper = P(1, 8, 100.0), P(7, 8, 140.0, False), P(1, 4, 130.0)
    assert kind_first([kind, changer], m)[0] is kind
    assert kind_kept([kind, changer], m) == (kind, changer) and kind_passed([kind, changer], m) is None
    kind.ep = kind.etp = 1
    changer.mesh_text, changer.gpus, changer.contract = lambda: "pp 7 x tp 8", 56, "global_batch 512 -> 511"
    assert kind_kept_text(kind, changer) == (
        "why: the job's kind, the least-disruptive mesh (pp 1, tp 8 and cp 1 kept, only the data axes shrunk); the "
        "fastest mesh changing pp, tp or cp, pp 7 x tp 8 on 56 GPUs (global_batch 512 -> 511), plans 140 tokens/s, "
        "40.0% more, over the 29.4% remesh margin (the step model's largest mean error when it was set, docs/fidelity.md), "
        "but it changes the global batch, which the kind keeps")
    assert kind_first([kind, keeper, changer], m)[0] is keeper
    assert kind_passed(kind_first([kind, keeper, changer], m), m) == (kind, keeper)
    assert kind_first([kind, P(1, 4, 129.0)], m)[0] is kind  # 29.0% <= 29.4%
