"""Issue 14 item 4: FSDP2 gradient accumulation modes (``training.grad_accumulation``).

``sync`` (FSDP2's default) reduce-scatters every micro-batch; ``no_sync``
(``set_requires_gradient_sync(False)`` on every micro-batch but the last) reduce-scatters once
per step and keeps each unit's unsharded fp32 gradient between micro-batches;
``no_sync_unsharded`` (also ``set_reshard_after_backward(False)``) keeps the parameters
gathered from a backward to the next forward, so only micro-batch 0's forward all-gathers.

Collective counts by hand, 4 units as torchtitan wraps them: the embedding (resharded after
forward as the layers are), 2 layers, [final norm, output] (never resharded after forward),
m micro-batches, reshard_after_forward (raf):

============================  ==================  ==================  ============
mode                          forward AG          backward AG (raf)   reduce-scatter
============================  ==================  ==================  ============
sync                          4 m                 3 m                 4 m
no_sync                       4 m                 3 m                 4
no_sync_unsharded             4                   3 m                 4
============================  ==================  ==================  ============

(backward all-gathers 0 without raf), checked against what torch 2.13's FSDP2 issues on the
fake process group. Memory of the tiny model of tests/test_memory_timeline.py (10320
elements on the stage, fp32 reduce, bf16 compute) by hand.
"""

from math import prod

import pytest

from meshplan import catalog
from meshplan.comm.collectives import collective_table
from meshplan.errors import ConfigError
from meshplan.memory.timeline import KINDS
from meshplan.mesh.resolve import resolve_mesh
from meshplan.placement.assign import place
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec

from tests.test_memory_timeline import MEM, plan_of

SMALL = ModelSpec(name="tiny", layers=2, hidden=64, ffn=128, q_heads=4, kv_heads=2, vocab=256)
FP32 = dict(param_dtype="fp32", compute_dtype="fp32", reduce_dtype="fp32", recompute="none")
MODES = ("sync", "no_sync", "no_sync_unsharded")


def by_hand(mode: str, raf: bool, m: int) -> dict:
    """(phase, op) -> count per step of the table above."""
    fwd = 4 if mode == "no_sync_unsharded" else 4 * m
    return {("forward", "all-gather"): fwd, ("backward", "all-gather"): 3 * m if raf else 0,
            ("backward", "reduce-scatter"): 4 * m if mode == "sync" else 4}


def table_counts(training: TrainingSpec, mesh, m: int) -> dict:
    cluster = catalog.system("dgx-h100", nodes=1)
    rows = collective_table(SMALL, training, mesh, cluster, place(cluster, mesh.world), [0, 1], micro_batches=m)
    out: dict = {}
    for r in rows:
        out[(r.phase, r.op)] = out.get((r.phase, r.op), 0) + r.per_step
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("raf", [True, False])
def test_table_counts_by_hand(mode, raf):
    mesh = resolve_mesh(MeshSpec(names=["dp_shard"], shape=[4]), world=4)
    t = TrainingSpec(global_batch=12, seq_len=16, grad_accumulation=mode, reshard_after_forward=raf, **FP32)
    got = table_counts(t, mesh, 3)
    want = {k: v for k, v in by_hand(mode, raf, 3).items() if v}
    assert got == want


@pytest.mark.parametrize("mode", MODES)
def test_table_per_layer_and_per_mb_columns_by_hand(mode):
    """``meshplan plan``'s "per layer", "per mb" and "per step" cells, m = 3, raf: a row issued
    alike in every micro-batch shows its calls per micro-batch (2 layer units: per layer 1.00;
    the embedding's and [norm, output]'s units: 1 per micro-batch, 0.50 per layer), a
    once-per-step row "-" (its count is per step). Before, every FSDP row of no_sync and no_sync_unsharded showed per layer 0.00 and
    per mb 0 beside per step 6, though no_sync gathers 2 units in each micro-batch as sync does."""
    from meshplan.report.text import _per_columns
    mb, once = ("0.50", "1", 3), ("-", "-", 1)  # a root unit every micro-batch, once per step
    every = {"sync": (("1.00", "2", 6),) * 3 + (mb,) * 5,
             "no_sync": (("1.00", "2", 6),) * 2 + (("-", "-", 2), mb, mb, once, mb, once),
             "no_sync_unsharded": (("-", "-", 2), ("1.00", "2", 6), ("-", "-", 2), once, mb, once, once, once)}
    emb, head = "per root (embedding)", "per root (norm/output)"
    keys = [("forward", "all-gather", "every layer"), ("backward", "all-gather", "every layer"),
            ("backward", "reduce-scatter", "every layer"), ("forward", "all-gather", emb),
            ("backward", "all-gather", emb), ("backward", "reduce-scatter", emb), ("forward", "all-gather", head),
            ("backward", "reduce-scatter", head)]
    mesh = resolve_mesh(MeshSpec(names=["dp_shard"], shape=[4]), world=4)
    cluster = catalog.system("dgx-h100", nodes=1)
    t = TrainingSpec(global_batch=12, seq_len=16, grad_accumulation=mode, **FP32)
    rows = collective_table(SMALL, t, mesh, cluster, place(cluster, 4), [0, 1], micro_batches=3)
    assert {(r.phase, r.op, r.cadence): (*_per_columns(r), r.per_step) for r in rows} == dict(zip(keys, every[mode]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_table_matches_torch_fsdp2_per_mode():
    pytest.importorskip("torch")
    from meshplan.runtime.validation.compare import differences, tally_records, tally_table
    from meshplan.runtime.validation.dryrun import dry_run

    mesh = resolve_mesh(MeshSpec(names=["dp_shard"], shape=[4]), world=prod([4]))
    cluster = catalog.system("dgx-h100", nodes=1)
    for mode in MODES:
        for raf in (True, False):
            t = TrainingSpec(global_batch=12, seq_len=16, grad_accumulation=mode, reshard_after_forward=raf, **FP32)
            run = dry_run(SMALL, t, mesh, rank=0, optimizer_step=False, micro_batches=3)
            recorded = tally_records(run.records, mesh, 0)
            rows = collective_table(SMALL, t, mesh, cluster, place(cluster, 4), [0, 1], micro_batches=3)
            assert differences(recorded, tally_table(rows, per_step=True)) == [], (mode, raf)
            measured: dict = {}
            for (_, phase, op, _, _), n in recorded.items():
                measured[(phase, op)] = measured.get((phase, op), 0) + n
            assert measured == {k: v for k, v in by_hand(mode, raf, 3).items() if v}, (mode, raf)


def at_end_of_first_backward(tl):
    r = tl.running()[tl.passes[3].first_event - 1]  # init, F0, B0 | F1
    return {k: int(r[KINDS.index(k)]) for k in ("grad_buffers", "gathered_params", "grads")}


def test_memory_per_mode_by_hand():
    # tiny model: global batch 4 over dp_shard 2, micro-batch 1 -> 2 micro-batches
    sync = at_end_of_first_backward(plan_of().timeline)
    assert sync == {"grad_buffers": 0, "gathered_params": 0, "grads": 10320 * 4 // 2}  # sharded fp32 grads
    no_sync = plan_of(grad_accumulation="no_sync").timeline
    # every unit's unsharded fp32 accumulator kept; parameters resharded; no sharded grads yet
    assert at_end_of_first_backward(no_sync) == {"grad_buffers": 10320 * 4, "gathered_params": 0, "grads": 0}
    kept = plan_of(grad_accumulation="no_sync_unsharded").timeline
    assert at_end_of_first_backward(kept) == {"grad_buffers": 10320 * 4, "gathered_params": 10320 * 2,
                                              "grads": 0}
    # micro-batch 1's forward gathers again under no_sync, never under no_sync_unsharded
    f1 = lambda tl: [e for e in tl.events() if e.phase == "forward" and e.microbatch == 1  # noqa: E731
                     and e.kind == "gathered_params" and e.delta_bytes > 0]
    assert len(f1(no_sync)) == 2 * 4 and f1(kept) == []  # all-gather output + copy-out of 4 units
    # [memory] fsdp_reduce states the mode's rule (after_last); with sync it is refused
    after_last = plan_of(grad_accumulation="no_sync_unsharded", memory={**MEM, "fsdp_reduce": "after_last"}).timeline
    assert after_last.templates == kept.templates and after_last.peak == kept.peak
    with pytest.raises(ConfigError, match="memory.fsdp_reduce: 'per_microbatch' contradicts training.grad_accumulation "
                                          "'no_sync'"):
        plan_of(grad_accumulation="no_sync", memory={**MEM, "fsdp_reduce": "per_microbatch"})
    # the peak in both modes: the last micro-batch's reduce-scatter input of [norm, output]'s unit
    # (torchtitan's units: reduced right after the head's backward), the head (2064 x 2 B)
    # gathered beside layer 1's prefetched all-gather output (3104 x 2 B), every unit's fp32
    # accumulator (10320 x 4 B) and the head's fp32 reduce-scatter input (2064 x 4 B); above
    # the sync peak's bf16 gradients of the units in flight
    for tl in (kept, no_sync):
        assert tl.peak.label == "head: reduce-scatter input (reduce dtype)"
        assert tl.peak.by_kind["gathered_params"] == (2064 + 3104) * 2
        assert tl.peak.by_kind["grad_buffers"] == 10320 * 4 + 2064 * 4
    assert kept.peak.total_bytes == no_sync.peak.total_bytes > plan_of().timeline.peak.total_bytes


def test_step_time_drops_collectives():
    steps = {mode: step_time(plan_of(grad_accumulation=mode), Overlap()) for mode in MODES}
    # fewer reduce-scatters (no_sync) and fewer forward all-gathers (no_sync_unsharded)
    assert steps["no_sync_unsharded"].step_s <= steps["no_sync"].step_s <= steps["sync"].step_s
    assert steps["no_sync_unsharded"].step_s < steps["sync"].step_s


def test_mode_errors():
    with pytest.raises(ConfigError, match="training.*grad_accumulation 'no_sync' is an FSDP2 mode"):
        plan_of(sharding="none", grad_accumulation="no_sync")
    with pytest.raises(ConfigError, match="training.grad_accumulation: 'no_sync' is for pp 1"):
        plan_of(grad_accumulation="no_sync", mesh=dict(names=["pp", "dp_shard"], shape=[2, 2], world=4))


@pytest.mark.parametrize("mode", MODES[1:])
def test_array_timeline_equals_reference(mode):
    from meshplan.memory.timeline import memory_timeline

    p = plan_of(grad_accumulation=mode, global_batch=8)
    fast, ref = memory_timeline(p, 0), memory_timeline(p, 0, reference=True)
    assert fast.templates == ref.templates and fast.passes == ref.passes and fast.peak == ref.peak


def test_step_verdict_offers_the_accumulation_modes():
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.schedule.verdict import network_verdict
    from meshplan.schedule.waits import bubble_wait
    from tests.conftest import EXAMPLES

    plan = build_plan(load_config(EXAMPLES / "seed-64gpu.toml"))
    st = step_time(plan)
    lines = network_verdict(plan, st, bw=bubble_wait(st))
    assert "reduce-scattered once per micro-batch" in lines[1]
    assert 'fewer with training.grad_accumulation = "no_sync" or training.grad_accumulation = "no_sync_unsharded"' \
        in lines[1]
