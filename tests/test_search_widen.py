"""The search's no-feasible-mesh fix names a narrowed ``[search] cp`` where widening it finds a
row (newcomer trial 16: ``plan``'s fix line tries cp, the search's never named it;
:mod:`meshplan.search.widen`).

The case, derived: Llama-3-70B at seq 32768, global batch 512, on 8 dgx-h100 (64 GPUs),
``[search] recompute = ["none"]`` and ``cp = [1]``. Without recompute every layer keeps its
activations of a 32768-token micro-batch; tp 8 (the NVLink domain) splits them at most 8 ways and
pp does not help under 1F1B (stage 0 holds pp micro-batches of layers / pp layers), so no cp 1
candidate fits in 67.1 GiB. ``plan``'s own fix line finds cp 4 fitting for dp_shard 8 x tp 8 of
this workload (README's plan row: 43.4 GiB); the search with every cp lists pp 2 x cp 4 x tp 8
first, resharded (472.820 s, peak 55.1 GiB; 384.060 s before torch's ring traffic was the table's,
385.652 s before the ring block was one cp rank's and 385.172 s before torch's ring SDPA calls were rated one by one, test below): its kept-gathered twin, the default at pp 2, is 0.77%
faster (382.222 s then, its ring calls the same) but peaks at 62.9 GiB, under 15% of the usable memory free, so the headroom tiers
show the mesh at its setting that keeps it (hints37; was 382.035 s kept gathered after searchraf,
384.986 s resharded before it, both before torchp2p's waited 1F1B calls). Why recompute
is narrowed too: with recompute full among the lists, cp 1 fits on as few as 3-4 nodes (4 nodes:
dp_shard 16 x tp 2, full, 97.6 s, seen in a run), and on 2 nodes the state alone (16 B x 70.6e9 / 16
GPUs = 65.7 GiB of 67.1 usable) leaves no room at any cp, so a cp-only fix needs a run that keeps
the activations, as a user who rules out full recompute's replay does.
(nc52fixC: NCCL's network collectives hold their rings' SMs while they run, 16 of the H100's 132
(row_shares.nccl_net_channels). The resharded vpp 1 run gathers every layer in forward and backward
over the NICs beside the compute: 472.977 -> 480.656 s (15.106 s of SM contention, exposed cp 7.416 s
less: the slower kernels cover more of the cp gathers; read from the model). The kept-gathered vpp 8
run, 471.060 s and 59.6 GiB before, is 471.060 s still: its 7.409 s of contention exactly fill its
cp waits (exposed cp 91.722 -> 84.313 s; the cp K/V gathers, not the kernels, pace its layers). It was
0.41% faster than the resharded run, inside the 1% band where the tie rule puts vpp 1 first; now
(480.656 - 471.060) / 480.656 = 2.0%: it is the widened search's row, "pp 2 x cp 4 x tp 8, mb 1,
none, vpp 8, zero3", keeping over 15% free (59.6 GiB), where the vpp 1 kept-gathered run (470.036
s, 62.9 GiB) does not.)
"""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.search.driver import search
from meshplan.search.widen import widen
from meshplan.units import GiB
from tests.cli_run import run_main

TOML = """[model]
catalog = "llama3-70b"
[cluster]
system = "dgx-h100"
nodes = 8
[training]
global_batch = 512
seq_len = 32768
recompute = "none"
[search]
recompute = ["none"]
cp = [1]
"""
ROW = "pp 2 x cp 4 x tp 8, mb 1, none, vpp 8, zero3"   # "vpp 1, zero3, resharded" before nc52fixC (module docstring)


def _cfg(**search):
    d = {"model": {"catalog": "llama3-70b"}, "cluster": {"system": "dgx-h100", "nodes": 8},
         "training": {"global_batch": 512, "seq_len": 32768, "recompute": "none"},
         "search": {"recompute": ["none"], "cp": [1]} | search}
    return config_from_dict(d, require_mesh=False)


@pytest.fixture(scope="module")
def narrowed():
    return widen(search(_cfg(), workers=1), workers=1)


def test_cp_narrowed_to_1_fits_nothing_and_the_fix_names_the_widened_row(narrowed):
    """No row; the widened search's fastest row is cp 4, planned by build_plan + step_time to the
    same step, its peak under usable memory; the same mesh at cp 1 (its data axis 4 x larger:
    pp 2 x dp_shard 4 x tp 8) is over it, which is why the narrowed search has no row. Its step
    384.060 s (385.652 s before the block was one cp rank's, meshplan.compute.ring_attention.slowest_rank:
    eager, cp rank 3's ring kernels move 14 Q elements more per later step than rank 0's (forward
    merge 38 - 27, dQ 10 - 13, dK/dV 2 x (13 - 10)), 3 x 14 x 8 x 8192 x 128 B / 2.97 TB/s = 118.6 us,
    above rank 0's 77.6 us of slower SDPA: rank 3's calls, fwd 3 x 368 at 4,096 keys and bwd 3 x 318
    at 8,192 queries, with the rank 3 bytes counted before: -77.6 us a layer, x 40 x 513: -1.592 s;
    385.172 s before torch's ring SDPA calls were rated one by one,
    meshplan.compute.ring_attention.ring_seconds: per layer and micro-batch cp rank 0 runs one causal
    8192 x 8192 call, FA2 fwd 333 and bwd 318 TFLOP/s at S 8192, and 3 unmasked 4096 x 8192, fwd 370
    at their 8,192 keys and bwd 310 at their 4,096 queries, each 8 heads x 8192^2 x 256 FLOP, where
    one causal 8192 x 32768 call was rated 335 and 322 (held from 16k): +23.4 us a layer, 40 layers
    a stage, 512 + 2 - 1 micro-batch slots of 1F1B: +0.480 s). Since torch's ring traffic is the
    table's (issue 11, cp_attention "ring": spec.axes.cp.ring_rows), 472.820 s: cp 4 beside tp 8 spans
    nodes, and per layer and micro-batch its K/V gathers at the 8 q heads (134 MB, 2.15 ms through the
    NICs, forward and backward) outlast the SDPA step beside them and its 4 fp32 dK/dV shifts (67 MB,
    1.43 ms each) the steps beside 3 of them, the last exposed whole: exposed cp 3.134 -> 91.722 s
    (4.48 ms a layer, 40 layers x 512 micro-batches), 0.173 s more bubble. 472.918 s since the rank
    timeline shares NICs (schedule/nic_fair.py NicBook): the cp transfers issued beside the
    prefetched FSDP all-gathers over the same NICs run at their fair half of the NIC: exposed cp 91.722 ->
    91.818 s, bubble 0.002 s more. 472.977 s since nic49 (schedule.unit_events: every running collective
    at its max-min share from each event on, where main's rule left the one issued first at full speed;
    FSDP2's reduce-scatters one in flight): stage 0's two first forwards (the ones that all-gather, 1F1B's
    warm-up) have each layer's FSDP all-gather (3.4217 ms alone, demand 0.9379) alone 0.7793 ms, then
    beside the cp K/V all-gather (2.1521 ms, 0.9355) at half the NIC each: the cp gather's work done in
    2.1521 / (0.5 / 0.9355) = 4.0266 ms, where beside a gather at full speed it took the gather's
    2.6424 ms left at half (1.4123 ms of work) and its 0.7398 ms left alone, 3.3822 ms: +0.6443 ms a
    layer x 39 (the first layer's gather ends before its cp gather starts) = 25.128 ms each, exposed cp
    +50.26 ms; stage 1's first forward the same +25.128 ms and +0.283 ms of its head's all-gather beside
    the last cp gather: stage 0's first backward waits 25.411 - 25.128 = 0.283 ms more, bubble; the last
    backward's tail, its 40 layer copy-ins (0.2161 ms) each after the reduce-scatter before, not all
    before the first: +40 x 0.2161 = 8.644 ms, exposed fsdp. 472.918 + 0.0503 + 0.0086 + 0.0003.
    (nc52fixC, module docstring: that resharded run is 480.656 s, its 15.106 s of SM contention less
    7.416 s of exposed cp and 0.012 s of bubble; the row is now the kept-gathered vpp 8 run, 471.060 s,
    read from the model: its contention 7.409 s equal to the exposed cp it hides.)
    (kvheads, [memory] kv_expanded false, the default: torchtitan's SDPA reads the KV heads, enable_gqa, so
    torch's ring moves K/V at the 1 local KV head (8 KV heads / tp 8), not the 8 q heads: per layer and
    micro-batch the K/V gathers 134 MB -> 16.8 MB (2.15 -> ~0.27 ms through the NICs) and the fp32 dK/dV
    shifts 67 -> 8.4 MB, now under the SDPA steps beside them: the vpp 8 row's exposed cp 84.313 -> 3.838 s
    and its NCCL-channel SM contention 7.409 -> 1.748 s (the gathers hold the SMs an eighth as long), and no
    repeat_kv copies: 471.060 -> 372.000 s, peak 63,942,262,784 B = 59.6 GiB, still over 15% free; the
    resharded vpp 1 run 480.656 -> 381.299 s (contention 15.106 -> 9.459 s), 2.4% slower: the row is the
    same mesh and setting. Parts, main 578824eb -> kvheads: compute 324.531 -> 305.969 s (contention -5.661
    s; the ring's merge and copy kernels at the KV heads and no repeat_kv copies, 2 a layer of 2 x 8192 x
    (8 + 1) x 128 x 2 B, 12.71 us, x 40 layers x 512 micro-batches = 0.52 s, the rest), exposed cp 84.313
    -> 3.838 s, bubble 5.546 -> 5.522 s; exposed fsdp, pp, tp unchanged; read from the model.)"""
    from meshplan.report.search_fix import infeasible_verdict

    r = narrowed
    assert not r.top and r.counts()["memory"] > 0
    w = r.widened
    assert w is not None and (w.given, w.cp, w.label) == ((1,), 4, ROW)
    assert round(w.step_s, 3) == 372.000 and w.peak_bytes < 0.85 * r.usable_bytes  # the vpp 8 run (docstring)
    pair = 8 * 8192 ** 2 * 256
    layer = pair * (1 / 333 + 3 / 370 + 2.5 * (1 / 318 + 3 / 310) - 4 / 335 - 2.5 * 4 / 322) / 1e12
    assert round(385.172 + 40 * (512 + 2 - 1) * layer, 3) == pytest.approx(385.652, abs=0.002)
    one_rank = pair * (3 / 368 - 3 / 370 + 2.5 * (3 / 318 - 3 / 310)) / 1e12   # rank 3's calls, not rank 0's
    assert 3 * 14 * 8 * 8192 * 128 / 2.97e12 > -one_rank                      # rank 3's extra bytes outweigh
    assert round(385.652 + 40 * (512 + 2 - 1) * one_rank, 3) == pytest.approx(384.060, abs=0.002)
    plan = _plan(["pp", "cp", "tp"])   # the resharded vpp 1 run, the row before nc52fixC
    st = step_time(plan, Overlap())
    assert plan.feasible and round(st.step_s, 3) == 381.299 and round(st.contention_s(), 3) == 9.459   # kvheads
    # its chain at the q heads, main 578824eb's parts of this run: exposed cp 84.4519 s, bubble 4.4152 s
    assert round(480.6556 - 15.1064 + (91.868 - 84.4519) - (4.4152 - 4.427), 3) == 472.977
    assert (st.step_s - w.step_s) / st.step_s > 0.01       # beyond the tie band: vpp 8 is the row
    # NIC sharing: exposed cp 91.722 -> 91.818 s, bubble 0.002 s more (0.173 -> 0.175 over the block's)
    assert round(384.060 + 91.818 - 3.134 + 0.175, 3) == 472.919   # before nic49
    # nic49 (docstring): the first forwards' cp K/V gathers beside the FSDP all-gathers, by hand
    kv = 2.1521 / (0.5 / 0.9355)
    old = 3.4217 - 0.7793 + 2.1521 - (3.4217 - 0.7793) * 0.5 / 0.9355
    assert (round(kv, 4), round(old, 4), round(39 * (kv - old), 2)) == (4.0266, 3.3822, 25.13)   # 25.128 in the unit
    assert round(91.818 + 2 * 0.025128, 3) == 91.868   # exposed cp before nc52fixC
    assert round(472.918 + 2 * 0.025128 + 40 * 0.2161e-3 + 0.283e-3, 3) == 472.977
    v8 = _plan(["pp", "cp", "tp"], reshard=False, vpp=8)
    s8 = step_time(v8, Overlap())
    assert v8.feasible and s8.step_s == pytest.approx(w.step_s, rel=1e-9)
    assert round(s8.contention_s(), 3) == 1.748 and round(s8.parts_s()["exposed cp"], 3) == 3.838   # kvheads
    assert max(t.peak.total_bytes for t in v8.timelines) == pytest.approx(w.peak_bytes, rel=1e-9)
    cp1 = _plan(["pp", "dp_shard", "tp"])
    assert not cp1.feasible and cp1.reasons[0].startswith("peak")
    v = infeasible_verdict(r)
    assert v["fix"].startswith(f"widen [search] cp (now 1): with every cp the fastest that fits is {ROW} (cp 4: step "
                               f"372.000 s, peak {w.peak_bytes / GiB:.1f} GiB); or add nodes, or let [search] reach "
                               "less memory")
    assert v["widened"]["cp"] == 4 and v["line"].endswith(v["fix"])


def _plan(names: list[str], reshard: bool = True, vpp: int = 1):
    """A run of the row's mesh as ``meshplan plan`` takes it: zero3, resharded after forward by
    default (a label's ``resharded``: reshard_after_forward true, off the default false under pp 2),
    SP on, micro-batch 1, ``vpp`` virtual stages (interleaved 1F1B above 1); ``names`` over the
    degrees 2 x 4 x 8."""
    mesh = {"names": names, "shape": [2, 4, 8], "sequence_parallel": True}
    if vpp > 1:
        mesh |= {"virtual_stages": vpp, "pp_schedule": "interleaved_1f1b"}
    d = {"model": {"catalog": "llama3-70b"}, "cluster": {"system": "dgx-h100", "nodes": 8},
         "training": {"global_batch": 512, "seq_len": 32768, "recompute": "none", "sharding": "zero3",
                      "micro_batch": 1, "reshard_after_forward": reshard}, "mesh": mesh}
    return build_plan(config_from_dict(d))


def test_the_cli_prints_the_fix_and_the_json_holds_it(tmp_path, capsys):
    """The one line on stdout and stderr (exit 1), the JSON's ``widened`` valid under the schema."""
    import json

    from tests.test_cli_json import validate

    path = tmp_path / "c.toml"
    path.write_text(TOML)
    assert run_main("search", path, "--json", tmp_path / "s.json") == 1
    out, err = capsys.readouterr()
    assert f"fix: widen [search] cp (now 1): with every cp the fastest that fits is {ROW}" in err
    assert "then" in next(x for x in err.splitlines() if x.startswith("timing:"))  # the widened search's time apart
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["no_feasible_mesh"]["widened"]["label"] == ROW and validate("search", doc) == []


def test_not_widened_where_cp_is_not_narrowed_or_a_row_fits():
    """``[search] cp`` left out on the mesh dp_shard 8 x tp 8 alone (cp 1 the only degree left): no
    row, nothing to widen (the fix is the memory rule's alone); ``cp = [1, 4]`` finds rows itself."""
    from meshplan.report.search_fix import infeasible_verdict
    from meshplan.search.widen import worth_widening

    r = widen(search(_cfg(cp=None, pp=[1], tp=[8], dp_shard=[8]), workers=1), workers=1)
    assert not r.top and r.widened is None and not worth_widening(r)
    assert infeasible_verdict(r)["fix"].startswith("add nodes, or let [search] reach less memory")
    r = widen(search(_cfg(cp=[1, 4], top=1), workers=1), workers=1)
    assert r.top and r.widened is None and r.candidates.label(r.top[0].index) == ROW
