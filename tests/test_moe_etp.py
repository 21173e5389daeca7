"""Expert tensor parallelism (etp > 1) as Megatron-Core runs it (MoEAlltoAllTokenDispatcher,
NVIDIA/Megatron-LM d98e8a6 ``megatron/core/transformer/moe/token_dispatcher.py``): each rank routes
its own sequence-parallel tokens, all-to-alls them over ep (:705-724), then all-gathers what it
received over etp (``dispatch_postprocess``, :741-751) and reduce-scatters the experts' output there
(``combine_preprocess``, :824-833) before the combine all-to-all (:864-870). The newcomer trial's
job: Mixtral-8x22B on 512 H100, tp 2 + SP, pp 8, ep 8, etp 2 (tests/configs.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from meshplan.comm.ep_rows import DROPLESS_COUNTS
from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.search.comm_bounds import comm_times
from meshplan.search.layer_bounds import chains, layer_ops
from meshplan.search.memory import Tables
from meshplan.search.space import candidate_config, enumerate_candidates
from meshplan.search.time_tables import TimeTables
from tests.configs import mixtral_8x22b_etp_job, mixtral_ep1_etp2_node_job

# Mixtral-8x22B: hidden 6144, top-2, bf16; micro-batch 1 x seq 4096 at cp 1
H, K, BF16, TOKENS = 6144, 2, 2, 4096


def _plan(tmp_path, **kw):
    f = tmp_path / "etp.toml"
    f.write_text(mixtral_8x22b_etp_job(**kw))
    return build_plan(load_config(f))


def _rows(p, axis, op, phase="forward"):
    return [r for r in p.collectives["stage 0"] if r.axis == axis and r.op == op and r.phase == phase
            and r.dtype == "bf16"]  # not the dropless count exchange (int64)


def test_megatron_etp2_dispatches_each_ranks_own_tokens(tmp_path):
    p = _plan(tmp_path)
    # T_local = 4096 x 1 / tp 2 = 2048 tokens a rank routes (its SP shard), balanced dropless: all
    # 2048 x 2 copies leave in the dispatch: 2048 x 2 x 6144 x 2 B = 50,331,648 B per all-to-all
    own = TOKENS // 2
    (a2a,) = _rows(p, "ep", "all-to-all")
    assert a2a.size_bytes == own * K * H * BF16 == 50_331_648
    (back,) = _rows(p, "ep", "all-to-all", "backward")
    assert back.size_bytes == 50_331_648
    gemms = {g.name: g for g in p.gemms}
    # the router runs on the rank's own 2048 tokens; each expert GEMM on the etp gather's
    # 2 ranks x 2048 x 2 = 8192 rows (1 local expert at ep 8)
    assert gemms["router"].m == own
    assert gemms["expert_w_up"].m == gemms["expert_w_down"].m == 2 * own * K == 8192
    assert any("T = 4096 local tokens / tp 2 = 2048" in n for n in p.notes)


def test_torch_etp1_routes_the_tp_split_as_before(tmp_path):
    # torchtitan (etp 1 with ep > 1): the tp ranks split the 4096 tokens, 2048 each, no etp gather
    p = _plan(tmp_path, etp=1, framework="torch", sharding="zero3")
    (a2a,) = _rows(p, "ep", "all-to-all")
    assert a2a.size_bytes == 2048 * K * H * BF16
    gemms = {g.name: g for g in p.gemms}
    assert gemms["router"].m == 2048 and gemms["expert_w_up"].m == 2048 * K


def test_megatron_etp2_gathers_and_scatters_over_etp(tmp_path):
    p = _plan(tmp_path)
    # each rank received 2048 x 2 = 4096 rows; the etp all-gather's output (nccl-tests' size) is
    # 2 ranks x 4096 rows x 6144 x 2 B = 100,663,296 B (each rank's 50,331,648 B in it), the
    # reduce-scatter's input the same; over etp (ranks 0,1: one node, NVLink)
    size = 2 * (2048 * K) * H * BF16
    assert size == 100_663_296
    # 7 layers a stage (56 / pp 8), every one MoE; full recompute replays each: forward 1 call per
    # layer, backward 2 (the gradient of the other collective, and the replay's own)
    for op in ("all-gather", "reduce-scatter"):
        (f,) = _rows(p, "etp", op)
        (b,) = _rows(p, "etp", op, "backward")
        assert f.size_bytes == b.size_bytes == size and f.group_size == 2 and f.example_ranks == (0, 1)
        assert f.path.kind == "nvlink" and f.per_microbatch == 7 and b.per_microbatch == 14
    # etp 1: none
    assert not _rows(_plan(tmp_path, etp=1), "etp", "all-gather")


def test_the_step_issues_the_etp_calls_the_table_counts(tmp_path):
    """Stage 0's rank timeline issues each etp row as often per step as the table counts it (16
    micro-batches x 7 forward, 14 backward), on the ep stream's queue between the all-to-alls."""
    p = _plan(tmp_path)
    st = step_time(p)
    table = {(r.phase, r.op): r.per_step for r in p.stage(0).collectives if r.axis == "etp"}
    assert table == {("forward", "all-gather"): 112, ("forward", "reduce-scatter"): 112,
                     ("backward", "all-gather"): 224, ("backward", "reduce-scatter"): 224}
    issued = Counter()
    for e in st.pipeline.events:
        if e.stage == 0 and e.name[0] in "FB":
            for ie in st.units.of_event(e).events:
                if ie.args.get("kind") == "ep" and ie.args.get("group") == "etp":
                    issued[ie.args["op"]] += 1
    # the timeline files the full recompute's replay under its forward phase, the table under
    # backward (as the all-to-alls): per op, 112 + 224 = 336 = 16 x 7 x 3 either way
    assert issued == {op: table[("forward", op)] + table[("backward", op)] for op in ("all-gather", "reduce-scatter")}
    assert issued["all-gather"] == 16 * 7 * 3
    assert not any("etp" in n for n in st.notes if "not simulated" in n)


def test_expert_data_parallel_group_is_named_by_the_sharding(tmp_path):
    """Under the distributed optimizer (zero1) nothing is FSDP-sharded over the experts' data axis:
    Megatron-Core's expert data-parallel group, edp = dp 32 x tp 2 / (ep 8 x etp 2) = 4; FSDP (zero3)
    keeps torchtitan's efsdp (there at etp 1: 32 x 2 / 8 = 8)."""
    from meshplan.spec.mesh_words import axis_labels
    p = _plan(tmp_path)
    assert "edp = dp(32) * tp(2) / (ep 8 * etp 2) = 4" in p.derivation
    assert axis_labels(p.mesh, p.config.training)["efsdp"] == "edp"
    assert any("expert mesh edp 4 x ep 8 x etp 2" in n for n in p.notes)
    exposed = next(x for x in step_time(p).lines() if x.startswith("exposed communication"))
    assert ", edp " in exposed and "efsdp" not in exposed
    q = _plan(tmp_path, etp=1, framework="torch", sharding="zero3")
    assert "efsdp = dp(32) * tp(2) / (ep 8 * etp 1) = 8" in q.derivation
    assert "efsdp" not in axis_labels(q.mesh, q.config.training)


def test_megatron_ep1_forward_waits_for_the_etp_reduce_scatter(tmp_path):
    """At ep 1 (etp = tp) there is no combine all-to-all, but the experts' output the etp
    reduce-scatter returns is what unpermute and the residual add read (combine_preprocess,
    token_dispatcher.py :824-833): the forward waits for it, so with nothing beside it its whole
    time is exposed on the ep stream."""
    f = tmp_path / "ep1.toml"
    f.write_text(mixtral_ep1_etp2_node_job())
    p = build_plan(load_config(f))
    # T_local = 4096 x 1 / tp 2 = 2048 tokens a rank routes, x top-2 = 4096 rows kept (ep 1: no
    # all-to-all); gathered over etp 2: 2 x 4096 = 8192 rows x 6144 x 2 B = 100,663,296 B
    (row,) = _rows(p, "etp", "reduce-scatter")
    assert row.size_bytes == 2 * (TOKENS // 2) * K * H * BF16 == 100_663_296
    assert row.group_size == 2 and row.example_ranks == (0, 1) and row.path.kind == "nvlink"
    assert row.per_microbatch == 2  # one call per layer, 2 layers
    assert not _rows(p, "ep", "all-to-all")
    st = step_time(p)
    (fwd,) = [e for e in st.pipeline.events if e.stage == 0 and e.name[0] == "F"]
    ev = st.units.of_event(fwd).events
    seen = 0
    for i, e in enumerate(ev):
        if e.args.get("group") == "etp" and e.args.get("op") == "reduce-scatter":
            mlp = next(x for x in reversed(ev[:i]) if x.name == "mlp")
            wait = next(x for x in ev[i + 1:] if x.name == "mlp combine wait")
            # issued when the expert GEMMs end, nothing else on the compute stream until it lands:
            # exposed = the row's time (0.150 ms at its NVLink bandwidth), not 0 as without the wait
            assert e.start_s == mlp.end_s and wait.start_s == e.end_s
            assert wait.start_s - mlp.end_s == pytest.approx(row.time_s, rel=1e-9)
            seen += 1
    assert seen == 2


def test_search_bound_counts_the_ep1_forward_etp_reduce_scatter(tmp_path):
    """The search's layer chain waits where the timeline does: at ep 1 its forward adds the etp
    reduce-scatter (comm_times "ep_out": the all-to-all's 0 + the reduce-scatter) after the expert
    GEMMs, the table row's time, here dp 4 x tp 2 x etp 2, mb 1, no recompute, no tp overlap."""
    f = tmp_path / "ep1.toml"
    f.write_text(mixtral_ep1_etp2_node_job())
    cfg = load_config(f, require_mesh=False)
    c = enumerate_candidates(cfg)
    i = next(int(j) for j in np.flatnonzero(c.ep == 1) if c.label(int(j)) == "dp 4 x tp 2 x etp 2, mb 1, none, vpp 1, zero1")
    g, tt = c.take(np.array([i])), TimeTables(cfg, Tables(cfg))
    (row,) = _rows(build_plan(candidate_config(cfg, c, i)), "etp", "reduce-scatter")
    cm = comm_times(cfg, tt, g)
    assert cm["ep_out"][0] == pytest.approx(row.time_s, rel=1e-9) and row.time_s > 0
    o = layer_ops(cfg, tt, g, True)
    fwd, _ = chains(g, o, cm, True)
    without, _ = chains(g, o, {**cm, "ep_out": np.zeros(1)}, True)
    assert fwd[0] - without[0] == pytest.approx(row.time_s, rel=1e-9)


def test_megatron_ep1_etp2_dropless_exchanges_its_counts(tmp_path):
    """Megatron-LM's dropless dispatcher all-gathers its per-expert counts over tp_ep_group wherever
    ``ep_size > 1 or tp_size > 1`` (token_dispatcher.py:557-574; tp_size is the etp group's, :86-89),
    so at ep 1, etp 2 too: each rank's 8 experts' int64 counts (``routing_map.sum(dim=0).long()``,
    :543) from the 2 etp ranks, an all-gather output of 8 x 8 B x 2 = 128 B, once per MoE layer
    (2 layers) before the dispatch, none in backward (no recompute); the timeline issues it before
    each layer's etp all-gather. The table had no such row at ep 1."""
    f = tmp_path / "ep1.toml"
    f.write_text(mixtral_ep1_etp2_node_job())
    p = build_plan(load_config(f))
    counts = [r for r in p.collectives["stage 0"] if r.cadence == DROPLESS_COUNTS]
    assert [(r.axis, r.phase, r.op, r.size_bytes, r.per_microbatch, r.group_size, r.example_ranks)
            for r in counts] == [("ep", "forward", "all-gather", 8 * 8 * 2, 2, 2, (0, 1))]
    st = step_time(p)
    (fwd,) = [e for e in st.pipeline.events if e.stage == 0 and e.name[0] == "F"]
    order = [e.args.get("group") for e in st.units.of_event(fwd).events if e.args.get("kind") == "ep"]
    assert order == ["counts", "etp", "etp"] * 2
