"""DeepSpeed ZeRO-3's ``stage3_max_reuse_distance`` (``[memory] deepspeed_max_reuse_elements``) in
the collective table, the rank timeline and the memory timeline (deepspeedai/DeepSpeed edaa722
coordinator :634-664, :365-366; :mod:`meshplan.spec.deepspeed_reuse`).

The tiny Llama-style model of ``test_deepspeed_prefetch_step`` (4 layers, h 1024, gated FFN 4096,
dp_shard 16, bf16). A layer's parameters in forward order, elements: attn_norm 1,024, wq, wk, wv,
wo 1,048,576 each, mlp_norm 1,024, w_gate, w_up, w_down 4,194,304 each: 16,779,264 in all
(``E``), 16,777,216 gathered (the norms are under ``stage3_param_persistence_threshold``, 1e5);
its unit's all-gather 33,558,528 B. The head: final norm 1,024 and output 1,048,576 (1,049,600).

Without recompute parameter j of layer i is kept when ``2 tail_j + 2 (3 - i) E + 2 x 1,049,600``
is under the distance:

- 0: nothing (``params_traversed >= 0`` breaks at once): each layer gathered again in backward,
  and the output layer too (its next use, its backward, is 0 elements away, not under 0);
- 1e7: of layer 3 only w_down (tail 0: 2,099,200; w_up's 2 x 4,194,304 + 2,099,200 = 10,487,808
  is not): 4,194,304 elements, 8,388,608 B; its backward gathers 1 - 4,194,304 / 16,777,216 =
  75% of its unit, 25,168,896 B; the head kept;
- 1e9: every layer (layer 0's wq: 2 x 15,729,664 + 6 x 16,779,264 + 2,099,200 = 134,234,816):
  no layer gathered in backward.

Full recompute, 1e7: forward -> replay ``E - n_j + 2 (3 - i) E + 2,099,200`` is at least
14,684,160 + 2,099,200 > 1e7: nothing; replay -> backward ``2 tail_j``: w_down (0) and w_up
(8,388,608) are kept, w_gate (16,777,216) not: each layer gathered whole for its replay and 50%
(16,779,264 B) again for its backward, 8 calls per micro-batch; at 0, 8 whole calls.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest

from meshplan.config import load_config
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.plan import Plan, build_plan
from meshplan.schedule.steptime import step_time
from tests.test_deepspeed_prefetch_step import LAYER_BYTES, TOML
from tests.test_schedule_semantics import table_counts, timeline_counts

L = LAYER_BYTES  # 33,558,528 B
HEAD = 2_099_200  # final norm and output, 1,049,600 x 2 B


def _plan(tmp_path, distance, recompute="none", bucket=None):
    f = tmp_path / "tiny.toml"
    f.write_text(TOML)
    cfg = load_config(f)
    cfg = replace(cfg, training=cfg.training.model_copy(update={"recompute": recompute}),
                  memory=cfg.memory.model_copy(update={"deepspeed_max_reuse_elements": distance,
                                                       "deepspeed_prefetch_elements": bucket}))
    return build_plan(cfg)


def _backward_gathers(plan) -> dict:
    """{(cadence, bytes): calls per micro-batch} of the backward all-gathers."""
    name = lambda c: c.rsplit(" (", 1)[0] if REUSE in c else c  # without the share's percentage
    return {(name(r.cadence), int(r.size_bytes)): r.per_microbatch for r in plan.stage(0).collectives
            if r.phase == "backward" and r.op == "all-gather"}


REUSE = "every layer, the part stage3_max_reuse_distance did not keep"


@pytest.mark.parametrize("distance, recompute, gathers", [
    (0, "none", {("every layer", L): 4, ("per root (embedding)", 2_097_152): 1, ("per root (norm/output)", HEAD): 1}),
    (10**7, "none", {("every layer", L): 3, (REUSE, 25_168_896): 1, ("per root (embedding)", 2_097_152): 1}),
    (10**9, "none", {("per root (embedding)", 2_097_152): 1}),
    (0, "full", {("every layer", L): 8, ("per root (embedding)", 2_097_152): 1, ("per root (norm/output)", HEAD): 1}),
    (10**7, "full", {("every layer", L): 4, (REUSE, L // 2): 4, ("per root (embedding)", 2_097_152): 1}),
    (10**9, "full", {("per root (embedding)", 2_097_152): 1}),
])
def test_backward_gathers_what_the_distance_did_not_keep(tmp_path, distance, recompute, gathers):
    """The table's backward all-gathers, by hand (module docstring); the rank timeline issues as
    many per (group, phase, op) as the table counts (prefetch off: one call, one event)."""
    plan = _plan(tmp_path, distance, recompute, bucket=0)
    assert _backward_gathers(plan) == gathers
    st = step_time(plan)
    assert timeline_counts(st, 0) == table_counts(plan, 0)


@pytest.mark.parametrize("distance, kept", [(0, (0, 0, 0, 0)), (10**7, (0, 0, 0, 8_388_608)),
                                            (10**9, (33_554_432,) * 4)])
def test_memory_holds_the_kept_bytes_from_forward_to_backward(tmp_path, distance, kept):
    """The first forward releases each layer but its kept bytes (by hand, module docstring: the
    gathered parameters x 2 B), and the backward gathers only the rest: the gathered parameters
    come back to 0 at the step's end; at 0 the head is released after its forward too."""
    plan = _plan(tmp_path, distance)
    events = [e for e in plan.timeline.events() if e.kind == "gathered_params"]
    released = {e.layer: e for e in events if e.phase == "forward" and e.microbatch == 0
                and "after forward" in e.label and e.layer is not None}
    gathered = {k: L for k in range(4)}  # each layer's unit
    assert tuple(gathered[k] + released[k].delta_bytes for k in range(4)) == kept
    assert sum(e.delta_bytes for e in events) == 0
    head_released = [e for e in events if e.label.startswith("head: released") and e.phase == "forward"]
    assert bool(head_released) == (distance == 0)


def test_kept_layers_hold_memory_until_their_backward(tmp_path):
    """1e7: layer 3's w_down (8,388,608 B) stays gathered from the forward's release of layer 3
    to its backward: the running gathered bytes just after that release are 8,388,608 B higher
    than at distance 0 (the head is released, at 0, only after its own forward)."""
    def after_release(plan):
        held = 0
        for e in plan.timeline.events():
            if e.kind != "gathered_params" or e.microbatch != 0 or e.phase == "init":
                continue
            held += e.delta_bytes
            if e.phase == "forward" and e.layer == 3 and "after forward" in e.label:
                return held
    assert after_release(_plan(tmp_path, 10**7)) - after_release(_plan(tmp_path, 0)) == 8_388_608


def _ds_json(tmp_path, distance) -> str:
    path = tmp_path / f"ds{distance}.json"
    path.write_text(json.dumps({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 1,
                                "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": distance},
                                "bf16": {"enabled": True}}))
    return str(path)


OPTS = ["--cluster", "dgx-h100", "--nodes", "2", "--model", "llama3-8b", "--seq-len", "4096"]


def test_step_of_a_deepspeed_json_at_distance_0_and_1e9(tmp_path):
    """Llama 3 8B (dp_shard 16, 16 micro-batches, no recompute): the head is 4,096 + 128,256 x 4,096
    = 525,340,672 elements, so even the last layer's parameters are 2 x 525,340,672 > 1e9 from their
    backward: 1e9 keeps only the output layer (0 elements from its backward), 0 keeps nothing. The
    layers' backward gathers are the same (32 per micro-batch); at 0 each backward starts with the
    [norm, output] unit's all-gather (1,050,681,344 B), which its backward waits for whole: the step
    is 16 x that all-gather's seconds longer."""
    from tests.cli_run import run_main
    out, rows = {}, {}
    for d in (0, 10**9):
        assert run_main("step", _ds_json(tmp_path, d), *OPTS, "--json", tmp_path / f"s{d}.json") == 0
        out[d] = json.loads((tmp_path / f"s{d}.json").read_text())["step_s"]
        cfg = load_any(tmp_path / f"ds{d}.json", opts=ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b",
                                                                   seq_len=4096))
        rows[d] = Counter({(r.cadence, int(r.size_bytes)): r.per_microbatch for r in build_plan(cfg).stage(0).collectives
                           if r.phase == "backward" and r.op == "all-gather"})
        head = [r.time_s for r in build_plan(cfg).stage(0).collectives if r.cadence == "per root (norm/output)"
                and r.op == "all-gather"][0]
    assert rows[0] - rows[10**9] == Counter({("per root (norm/output)", 1_050_681_344): 1})
    assert rows[10**9][("every layer", 436_224_000)] == 32
    assert out[0] - out[10**9] == pytest.approx(16 * head, rel=1e-6)


@pytest.mark.parametrize("distance", [0, 10**7, 10**9])
def test_search_bounds_hold_the_reuse_distance(tmp_path, distance):
    """The search's bounds of the DeepSpeed ZeRO-3 rows of one stage hold the plans the distance
    moves (module docstring: 8, 5, 0 layer gathers in backward, the head's at 0; 8,388,608 or
    134,217,728 B kept past the forward): step lower bound and memory bounds around each plan. At
    sequence 64 the layers' gathers outlast their compute: a bound that counted every layer's
    backward all-gather at 1e9 (none in the plan) was 6% above the step (checked by mutation)."""
    from meshplan.search.candidate import candidate_config
    from meshplan.search.columns import SHARDING
    from meshplan.search.driver import search
    f = tmp_path / "tiny.toml"
    f.write_text(TOML.replace("seq_len = 512", "seq_len = 64").replace(
        "[mesh]", f"[memory]\ndeepspeed_max_reuse_elements = {distance}\n\n[mesh]"))
    r = search(load_config(f))
    c = r.candidates
    rows = [i for i in range(len(c)) if SHARDING[c.sh[i]] == "zero3" and c.pp[i] == 1 and c.rf[i]]
    assert len({int(c.rc[i]) for i in rows}) >= 2  # with and without full recompute
    checked = 0
    for i in rows:
        try:  # a row DeepSpeed's engine refuses (cp > 1, ...) is not planned
            plan = build_plan(candidate_config(r.config, r.candidates, i))
        except ConfigError:
            continue
        if not isinstance(plan, Plan) or not plan.feasible:
            continue
        checked += 1
        step, peak = step_time(plan).step_s, plan.timeline.peak.total_bytes
        assert r.est.step_lo[i] <= step * (1 + 1e-9), r.candidates.label(i)
        assert r.est.peak_lo[i] <= peak <= r.est.peak_hi[i], r.candidates.label(i)
    assert checked >= 2
