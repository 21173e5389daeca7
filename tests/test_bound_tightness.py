"""Tightness of the search's vectorised bounds against the exact plan (issue 10, item 3).

``tests/test_search.py`` checks that the bounds hold (bound <= exact on every candidate). That
cannot fail for a bound that is useless: a step-time lower bound of 0 holds everywhere (and
the search then plans every candidate exactly). Here the ratio of each bound to the exact
value must also lie in a band, on 40 candidates sampled evenly (by enumeration index) from
four workloads of ``test_search`` (8 and 16 GPUs dense, 8 GPUs MoE under torch and under
Megatron-LM) and :data:`WORKLOADS`' 16 GPUs MoE under Megatron-LM with ``overlap_grad_reduce`` and
``overlap_param_gather`` at pp 2.

Measured on the whole candidate sets (b3b8e7e, every feasible candidate planned and
simulated; ``min / 5th percentile / median / max``):

========== =========================== =========================== ===========================
workload   step lower bound / step     memory lower bound / peak   memory upper bound / peak
========== =========================== =========================== ===========================
8 GPUs     0.765 / 0.845 / 0.995 / 1   0.811 / 0.885 / 1.000 / 1   1 / 1 / 1.021 / 1.315
16 GPUs    0.689 / 0.797 / 0.960 / 1   0.803 / 0.865 / 0.989 / 1   1 / 1 / 1.098 / 1.416
8 MoE      0.617 / 0.726 / 0.887 / 1   0.771 / 0.862 / 0.955 / 1   1 / 1 / 1.094 / 1.345
========== =========================== =========================== ===========================

Since FSDP with pp > 1 reduces after the last micro-batch, as torch.distributed.pipelining does
(the timeline holds each stage's unsharded gradients and gathered layers; the bounds' term A),
and tp overlap is searched only under torch_compile (torchtitan's async TP), on the 40 sampled
candidates (``min / median / max``): memory lower bound 0.713 / 1.0 / 1, 0.704 / 0.907 / 1,
0.776 / 0.913 / 1; upper bound 1 / 1.031 / 1.499, 1 / 1.264 / 1.58, 1 / 1.153 / 1.476 (8, 16
GPUs, 8 MoE).

Since zero1 under torch is rejected by the search's rule 'framework' (no bound computed) and a
zero1 row without a data axis is left out, the samples hold no zero1 candidate, whose bounds
were among the tightest (no FSDP unit: no transient held at its largest); the same bounds on the
new samples (``min / median / max``, 8, 16 GPUs, 8 MoE): step 0.785 / 0.940 / 0.991, 0.801 /
0.923 / 0.984, 0.717 / 0.790 / 0.991 (before 0.846 / 0.955 / 1, 0.835 / 0.920 / 1, 0.689 / 0.875
/ 0.996); memory lower bound 0.808 / 0.890 / 1, 0.739 / 0.934 / 1, 0.797 / 0.898 / 1 (before
0.832 / 0.951 / 1, 0.704 / 0.918 / 1, 0.806 / 0.921 / 1); upper bound 1 / 1.320 / 1.469, 1 /
1.315 / 1.644, 1 / 1.180 / 1.359 (before 1 / 1.170 / 1.484, 1 / 1.264 / 1.58, 1 / 1.167 / 1.502).

Since ttmoe's rule torch_kv_heads (fewer valid candidates: the even sample moved) the memory lower
bound on the samples fell to 0.668 (8 GPUs: pp 2 x dp_shard 4, mb 2, full, vpp 4, zero3 kept
gathered, where vppevict's window term counted one chunk's kept layers) and 0.657 (16 GPUs: pp 2 x
dp_shard 8, mb 4, full, vpp 1, kept gathered: its forward-end terms counted no layer kept gathered).
With both counted (search/bounds.py F, H and A), ``min / median / max``: 0.722 / 0.902 / 1,
0.749 / 0.886 / 1, 0.807 / 0.897 / 1 (8, 16 GPUs, 8 MoE).

The MoE workloads under Megatron-LM (issue bound41; ``min / median / max`` on the samples, at
the commit that added them): step 0.627 / 0.831 / 0.977 and 0.766 / 0.905 / 0.990 (8 GPUs, 16
GPUs opg), memory lower bound 0.741 / 0.980 / 1 and 0.833 / 0.998 / 1, upper bound 1.002 / 1.008 /
1.415 and 1 / 1.044 / 1.432: within the bands below. The stage-end bound (the optimizer step and
ZeRO-1/2's exposed parameter all-gather, :func:`stage_end_ratios`, per stage) over the simulated
step-end events: 1 on every sampled stage of the torch workloads (the same
:func:`~meshplan.schedule.optimizer_step.optimizer_step_s`, no gather), 0.808 / 1 / 1 (8 GPUs
megatron) and 0.667 / 1 / 1 (16 GPUs opg; the least with virtual stages, where only chunk 0's
fewest dense elements count). Before the fix 0.766 / 1 / 1 and 0.667 / 1 / 1.070: with
``overlap_param_gather`` and no virtual stages the bound took the gather of the dense elements
alone as one bucket where the plan's DDP buffer holds the experts beside them (ep 1, etp = tp) or
its own expert buffer over efsdp (ep > 1), and the exposed gather is the mean call of all the
stage's buckets: pp 2 x dp 8, mb 1, vpp 1, zero1, stage 1: 39,072,768 dense elements in one call
(207.5 us) where the plan gathers 73,671,552 in two buckets of 40,000,000 and 33,671,552 (211.9 +
181.9 us, 196.9 us a call): stage end 944.3 us against 933.7 us (optimizer step 736.8 us in both).
Over every one of that workload's 1,800 valid candidates, 240 rows' stage-end bound exceeded the
simulated events on main (up to 13.6%); none since (min / median / max 0.976 / 1 / 1 at vpp 1,
0.698 / 1 / 1.136 before). The whole-step bound held on every row before and after (its other
terms' slack covered the stage end's excess).

Bands asserted (each with a margin below the worst measured value, so that a legitimate change
of either model does not trip them, while a bound that loses a whole term does):

- step: every ratio in [0.5, 1] and the median >= 0.75 (0.8 before the samples lost zero1). The
  bound leaves out only what the simulation can overlap (FSDP prefetch, weight-gradient
  reduce-scatters, the pipeline's interleaving beyond fill and drain); 0.5 would mean it misses
  half the step.
- stage end: every ratio in [0.6, 1], median >= 0.9 (measured 0.667 and a median of 1); a ratio
  above 1 is a bound above the exact value, which fails the 16 GPUs opg workload on the code before
  the fix (1.070);
- memory lower bound: every ratio in [0.7, 1], median >= 0.85 (0.9 before);
- memory upper bound: every ratio in [1, 1.7], median <= 1.4 (1.6 and 1.3 before; it adds every
  transient at its largest at once; the median was <= 1.2 before the held gradients and layers
  above, which it adds at their largest with everything else).

The constraints' first memory estimate (:func:`meshplan.memory.constraints.estimate`: state of
the most loaded stage + the saved activations of the micro-batches 1F1B holds in flight + the
embedding and head activations + two gathered FSDP layers) is checked the same way against the
timeline peak of the stage it names, once the two fixed terms it leaves out are added (NCCL
communicator buffers, 128 MiB each by default, and the 32 MiB cuBLAS workspace). Still left
out: transients (logits and loss temporaries, a layer's backward working set, optimizer-step
temporaries), FSDP's root units and reduce-scatter buffers, gradient buckets; and it counts
all state at once where the timeline allocates FSDP's sharded gradients only at the first
reduce-scatter. Measured on 60 candidates each of 8 / 16 / 64 GPUs (dense):
``min / median / max`` 0.746 / 0.969 / 1.022, 0.774 / 1.008 / 1.163, 0.815 / 0.957 / 1.114
(without the fixed terms: as low as 0.31 at 64 GPUs, where small HBM makes NCCL buffers large).
Band asserted: every ratio in [0.65, 1.3], median in [0.85, 1.1].

Mutations that fail here (and leave tests/test_search.py green): the step-time lower bound
set to 0 (``step_lower_bound`` in search/timing.py) fails the step test on all three
workloads; the upper memory bound without the saved activations (search/bounds.py
``_upper``) fails the upper-bound test on all three; the first estimate without activations
(memory/constraints.py) fails the estimate test on both dense workloads.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.memory import constraints as cons
from meshplan.plan import build_plan
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.steptime import step_time
from meshplan.search.driver import search
from meshplan.search.memory import Tables, stage_layout, state
from meshplan.search.space import candidate_config
from meshplan.search.step_end_bound import stage_end_bound
from meshplan.search.time_tables import TimeTables
from test_search import CASES, MOE, config

#: test_search's workloads and the small MoE under Megatron-LM on 2 nodes at pp 2 with its DDP buffers
#: bucketed (``overlap_grad_reduce``) and the parameter all-gather overlapped with the next forward
#: (``overlap_param_gather``), so that the stage-end bound's exposed gather is one bucket's
WORKLOADS = {**CASES, "16-moe-megatron-opg": dict(
    nodes=2, model=MOE, micro_batch=[1, 2], recompute=["selective"], pp=[2], top=5,
    training={"framework": "megatron", "sharding": "zero1", "overlap_grad_reduce": True,
              "overlap_param_gather": True})}
#: the simulated step-end events the stage-end bound bounds (schedule.step_end.stage_end's names)
END_EVENTS = ("optimizer step", "param all-gather (per step)")

SAMPLES = 40
STEP_BAND, STEP_MEDIAN = (0.5, 1.0), 0.75
LO_BAND, LO_MEDIAN = (0.7, 1.0), 0.85
HI_BAND, HI_MEDIAN = (1.0, 1.7), 1.4
EST_BAND, EST_MEDIAN = (0.65, 1.3), (0.85, 1.1)
END_BAND, END_MEDIAN = (0.6, 1.0), 0.9
#: relative slack for "bound <= exact" (floating-point rounding, as the search's BOUND_SLACK)
EPS = 1e-9


def stage_end_ratios(cfg, r, pick: np.ndarray, sims: dict) -> list[float]:
    """Each stage's step-end bound (:func:`meshplan.search.step_end_bound.stage_end_bound`: the
    optimizer step and ZeRO-1/2's exposed parameter all-gather) over the simulated step's
    step-end events it bounds (``optimizer step``, with Megatron-LM's per-step kernels, and
    ``param all-gather (per step)``), on the picked rows whose plan ``sims`` simulated
    ({row: StepTime}); stages whose events last nothing left out."""
    tt, out = TimeTables(cfg, Tables(cfg)), []
    c = r.candidates.take(pick)
    for p in np.unique(c.pp).tolist():
        at = np.flatnonzero(c.pp == p)
        g = c.take(at)
        st = stage_layout(cfg, g, p)
        end, _ = stage_end_bound(cfg, tt, g, st, state(cfg, tt.tables, g, st), {})
        for j, i in enumerate(pick[at].tolist()):
            for s in range(p) if i in sims else ():
                exact = sum(e.dur_s for e in sims[i].post_events if e.stage == s and e.name in END_EVENTS)
                if exact > 0:
                    out.append(end[j, s] / exact)
    return out


def sampled_ratios(name: str) -> dict[str, np.ndarray]:
    """(step lower bound / exact step, peak lower bound / exact peak, peak upper bound / exact
    peak, the first estimate / the timeline, stage-end bound / the step-end events) on SAMPLES
    candidates spread evenly over those that passed the validity rules."""
    kw = dict(WORKLOADS[name])
    cfg = config(kw.pop("nodes"), kw.pop("hbm_gb", 6.0), **kw)
    r = search(cfg, workers=1)
    valid = np.flatnonzero(np.isfinite(r.est.step_lo))
    pick = valid[np.linspace(0, len(valid) - 1, min(SAMPLES, len(valid))).astype(int)]
    out: dict[str, list] = {"step": [], "lo": [], "hi": [], "estimate": []}
    constraints, sims = {}, {}
    for i in pick:
        cc = candidate_config(cfg, r.candidates, int(i))
        if cc.training not in constraints:
            constraints[cc.training] = cons.constraints(cc.model, cc.training, cc.cluster, cc.cluster.world)
        plan = build_plan(cc, constraints[cc.training])
        peak = max((tl.peak.total_bytes for tl in plan.timelines), default=None)
        if peak is not None:
            out["lo"].append(r.est.peak_lo[i] / peak)
            out["hi"].append(r.est.peak_hi[i] / peak)
            e = plan.constraints.estimate
            if e is not None:  # dense models only (MoE: no first estimate)
                at = plan.timelines[e.stage].peak.by_kind
                left_out = at.get("comm_buffers", 0) + at.get("workspace", 0)
                out["estimate"].append((e.total_bytes + left_out) / plan.timelines[e.stage].peak.total_bytes)
        if plan.feasible:
            sims[int(i)] = step_time(plan, Overlap())
            out["step"].append(r.est.step_lo[i] / sims[int(i)].step_s)
    out["end"] = stage_end_ratios(cfg, r, pick, sims)
    return {k: np.array(v) for k, v in out.items()}


@pytest.fixture(scope="module", params=["8", "16", "8-moe", pytest.param("8-moe-megatron", marks=pytest.mark.slow),
                                        "16-moe-megatron-opg"],
                ids=["world8", "world16", "world8-moe", "world8-moe-megatron", "world16-moe-megatron-opg"])
def ratios(request):
    out = sampled_ratios(request.param)
    assert len(out["step"]) >= 10 and len(out["lo"]) >= 10 and len(out["end"]) >= 10, \
        {k: len(v) for k, v in out.items()}
    return out


def test_step_time_lower_bound_is_tight(ratios):
    s = ratios["step"]
    assert STEP_BAND[0] <= s.min() and s.max() <= STEP_BAND[1] * (1 + EPS), (s.min(), s.max())
    assert np.median(s) >= STEP_MEDIAN, np.median(s)


def test_stage_end_bound_is_tight(ratios):
    """Each stage's step-end bound (optimizer step, ZeRO-1/2's exposed parameter all-gather)
    against the simulated step-end events it bounds (:func:`stage_end_ratios`)."""
    e = ratios["end"]
    assert END_BAND[0] <= e.min() and e.max() <= END_BAND[1] * (1 + EPS), (e.min(), e.max())
    assert np.median(e) >= END_MEDIAN, np.median(e)


def test_memory_lower_bound_is_tight(ratios):
    lo = ratios["lo"]
    assert LO_BAND[0] <= lo.min() and lo.max() <= LO_BAND[1] * (1 + EPS), (lo.min(), lo.max())
    assert np.median(lo) >= LO_MEDIAN, np.median(lo)


def test_first_memory_estimate_against_the_timeline(ratios):
    """The constraints' first estimate (memory/constraints.py) of the stage it names, plus the
    two fixed terms it leaves out (NCCL communicator buffers and the cuBLAS workspace, read at
    the timeline's peak), against that stage's timeline peak."""
    e = ratios["estimate"]
    if not len(e):
        pytest.skip("MoE: the constraints make no first estimate")
    assert EST_BAND[0] <= e.min() and e.max() <= EST_BAND[1], (e.min(), e.max())
    assert EST_MEDIAN[0] <= np.median(e) <= EST_MEDIAN[1], np.median(e)


def test_memory_upper_bound_is_tight(ratios):
    hi = ratios["hi"]
    assert HI_BAND[0] * (1 - EPS) <= hi.min() and hi.max() <= HI_BAND[1], (hi.min(), hi.max())
    assert np.median(hi) <= HI_MEDIAN, np.median(hi)
