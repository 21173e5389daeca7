"""torchtitan's ``parallelism.fsdp_reshard_after_forward`` ("default" | "always" | "never")
mapped both ways onto meshplan's ``training.reshard_after_forward`` (the blocks and the
embedding's unit) and ``training.reshard_head_after_forward`` (the [norm, output] unit), as
torchtitan's ``apply_fsdp_to_decoder`` (``torchtitan/distributed/fsdp.py`` at b5bcd76) wraps
them: the blocks and the embedding resharded under "always", under "default" when pp is off;
[norm, output] only under "always".

Llama 3 8B (32 layers), 8 GPUs, local batch 1 and m = 4 micro-batches per step. FSDP all-gathers
per step by hand, units: 32 layers + embedding + [norm, output] at pp 1; at pp 2 (1F1B)
stage 0 holds 16 layers + the embedding, stage 1 16 layers + [norm, output]:

- pp 1, each unit gathered in every forward (4) and, when resharded, in every backward (4):
  default 32 x 8 + 1 x 8 + 1 x 4 = 268; never (nothing regathered) 34 x 4 = 136; always
  34 x 8 = 272.
- pp 2: "default" is "never" there (pp on): each unit gathered once per step and kept
  (17 + 17). "always": a unit resharded after each forward and kept from a backward to the
  next forward (PipelineStage keeps gradient sync and the post-backward reshard off until
  the last): stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3, gathering in F0, F1, B0, B1, B2 (5 per unit,
  85); stage 1 runs F0 B0 F1 B1 F2 B2 F3 B3, gathering in F0 and every B (5 per unit, 85).
"""

from __future__ import annotations

import tomllib

import pytest

from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export
from meshplan.interop.foreign import load_any
from meshplan.interop.torchtitan_write import reshard_policy
from meshplan.plan import build_plan

ONE_NODE = ImportOptions(cluster="dgx-h100", nodes=1)


def _toml(tmp_path, policy: str, pp: int):
    pipe = (f"pipeline_parallel_degree = {pp}\npipeline_parallel_schedule = \"1F1B\"\n"
            f"pipeline_parallel_microbatch_size = 1\n") if pp > 1 else "pipeline_parallel_degree = 1\n"
    local, global_ = (4, 16) if pp > 1 else (1, 32)  # m = 4 either way
    text = (f'[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = {local}\n'
            f'global_batch_size = {global_}\nseq_len = 2048\n[parallelism]\ndata_parallel_shard_degree = -1\n'
            f'{pipe}fsdp_reshard_after_forward = "{policy}"\n[activation_checkpoint]\nmode = "full"\n')
    path = tmp_path / f"tt-{policy}-{pp}.toml"
    path.write_text(text)
    return path


def _all_gathers(plan) -> list[int]:
    return [sum(r.per_step for r in plan.stage(k).collectives if r.op == "all-gather" and r.axis == "dp_shard")
            for k in range(len(plan.stages))]


@pytest.mark.parametrize("pp,policy,flags,gathers", [
    (1, "default", (True, False), [268]),
    (1, "never", (False, False), [136]),
    (1, "always", (True, True), [272]),
    (2, "default", (False, False), [17, 17]),
    (2, "never", (False, False), [17, 17]),
    (2, "always", (True, True), [85, 85]),
])
def test_policy_imports_and_all_gathers_per_step_by_hand(tmp_path, pp, policy, flags, gathers):
    cfg = load_any(_toml(tmp_path, policy, pp), opts=ONE_NODE)
    t = cfg.training.at_pp(pp)  # "default" is read unset (nc24b), resolved per mesh as torchtitan does
    assert (t.reshard_after_forward, t.reshard_head_after_forward) == flags
    plan = build_plan(cfg)
    assert [sum(map(len, s)) for s in plan.stages] == ([32] if pp == 1 else [16, 16])
    assert plan.micro_batches == 4
    assert _all_gathers(plan) == gathers


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("policy", ["default", "always", "never"])
def test_policy_round_trip(tmp_path, pp, policy):
    """Import, export, import: the same meshplan fields; the written policy is the one read,
    except "never" under pp, which torchtitan resolves as "default" does (written "default")."""
    cfg = load_any(_toml(tmp_path, policy, pp), opts=ONE_NODE)
    text, header = export(cfg, "torchtitan", "x")
    assert not [h for h in header if h.startswith("not expressed")], header
    written = tomllib.loads(text.split("\n\n", 1)[1])["parallelism"]["fsdp_reshard_after_forward"]
    assert written == ("default" if (pp, policy) == (2, "never") else policy)
    out = tmp_path / "back.toml"
    out.write_text(text)
    again = load_any(out, "torchtitan", ONE_NODE)
    a, b = cfg.training.at_pp(pp), again.training.at_pp(pp)  # as each resolves at the mesh's pp
    assert (b.reshard_after_forward, b.reshard_head_after_forward) == (a.reshard_after_forward,
                                                                      a.reshard_head_after_forward)


def test_blocks_resharded_under_pp_with_the_head_kept_has_no_policy(tmp_path):
    """reshard_after_forward true at pp 2 with the head kept: torchtitan's "always" would
    reshard the head too; the export writes it and says so."""
    cfg = load_any(_toml(tmp_path, "always", 2), opts=ONE_NODE)
    kept = cfg.training.model_copy(update={"reshard_head_after_forward": False})
    assert reshard_policy(kept, 2) == "always"
    from dataclasses import replace
    _, header = export(replace(cfg, training=kept), "torchtitan", "x")
    assert "not expressed in torchtitan: training.reshard_head_after_forward: False -> True" in header


def test_memory_reshards_the_head_after_forward_and_gathers_it_for_backward():
    """The tiny model of test_memory_timeline (the [norm, output] unit 16 + 128 x 16 = 2,064
    elements, 4,128 B in bf16), dp_shard 2, m = 2: under "always" each forward frees the
    head's unsharded parameters as the logits come out and each backward gathers them again
    (all-gather output, copy-out); kept gathered otherwise."""
    from meshplan.config import config_from_dict
    from tests.test_reduce_dtype import TINY

    def events(head: bool):
        p = build_plan(config_from_dict({
            "model": TINY, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 4, "seq_len": 8, "param_dtype": "fp32", "recompute": "none",
                         "reshard_head_after_forward": head},
            "mesh": {"names": ["dp_shard"], "shape": [2], "world": 2}}))
        return [(e.phase, e.microbatch, e.delta_bytes, e.label.split(": ")[1]) for e in p.timeline.events()
                if e.kind == "gathered_params" and e.label.startswith("head:")]

    assert [e for e in events(False) if e[0] == "backward" and e[2] > 0] == []
    again = events(True)
    assert [e for e in again if e[3] == "resharded after forward"] == [("forward", mb, -4128, "resharded after forward")
                                                                      for mb in (0, 1)]
    assert [e[:3] for e in again if e[0] == "backward" and e[2] > 0] == [("backward", mb, 4128) for mb in (0, 0, 1, 1)]


def test_step_regathers_the_head_before_its_backward_by_hand():
    """test_golden_steptime's dp_shard 16 over two nodes with the head resharded after forward
    (torchtitan's "always"). The forward is unchanged; the backward starts with the head's
    pre-backward: its all-gather (exposed), then layer 1's prefetch behind it on the FSDP stream,
    the head's copy-out, then everything as before, shifted: the head's backward starts at
    ag_head + co_head instead of 0, layer 1's gather at ag_head. (nicshare: FSDP2's reduce-scatters on
    their own stream beside the all-gathers, max-min sharing of each NIC, one reduce-scatter in flight, as
    test_golden_steptime.test_fsdp16_two_nodes derives it: the step 4.4620 -> 4.4952 ms, the same
    +0.0331 ms as there.) (nc52fixC: the cross-node rings hold 16 of the H100's 132 SMs while they
    run, s = 16/132, as test_golden_steptime.test_fsdp16_two_nodes works them in: every kernel beside a
    ring issued before it at 1 - s, beside two at 1 - 2s. Here the head's copy-out and backward run
    beside layer 1's all-gather (issued before the copy-out) for the gather's whole length: + s x ag,
    as the head's backward alone did there; the rest is that test's backward shifted. Contention
    0.2135 ms as there, the step 4.4952 -> 4.6860 ms, the same +0.1908 ms.)"""
    from dataclasses import replace

    from meshplan.schedule.unit_sim import Overlap
    from meshplan.schedule.steptime import step_time
    from tests.test_golden_steptime import (TRIAD, B, H, L, V, config, cross_node_s, gemm_table, head_terms, kernel,
                                            layer_params, layer_terms, optimizer_s)
    n = 16
    lt, ht = layer_terms(1), head_terms(1)
    n_layer, n_emb, n_head = layer_params(1), V * H, H + V * H
    ag, rs = (cross_node_s(op, n, b * n_layer, nodes=2) for op, b in (("all-gather", B), ("reduce-scatter", 4)))
    ag_emb, rs_emb = (cross_node_s(op, n, b * n_emb, nodes=2) for op, b in (("all-gather", B), ("reduce-scatter", 4)))
    ag_head, rs_head = (cross_node_s(op, n, b * n_head, nodes=2) for op, b in (("all-gather", B),
                                                                               ("reduce-scatter", 4)))
    co, co_emb, co_head = (kernel(2 * B * x / TRIAD) for x in (n_layer, n_emb, n_head))
    ci, ci_emb, ci_head = (kernel((B + 4) * x / TRIAD) for x in (n_layer, n_emb, n_head))
    layer_f = sum(lt[f"f_{b}"] for b in ("attn_pre", "attn", "attn_post", "mlp_pre", "mlp", "mlp_post"))
    layer_b = sum(lt[k] for k in lt if k[0] in "bw")
    s = 16 / 132        # SMs one cross-node ring collective holds: 2 x 8 NICs channels of the H100's 132
    forward = ag_emb + ht["emb_f"] + co_emb + ag + co + (layer_f + s * ag) + co + (layer_f + s * ag_head) \
        + co_head + ht["head_f"]
    head_b = ht["head_b"] + ht["head_w"]
    assert co_head + head_b > ag
    start, l1_ag = ag_head + co_head + s * ag, ag_head + ag  # copy-out and backward beside layer 1's gather
    # FSDP2's reduce-scatters on their own stream, one in flight: as test_fsdp16_two_nodes, shifted by start
    def demand(size, t):  # its NIC bytes (the ring's (n-1)/n over the group's 8 NICs) at 50 GB/s over t
        return (n - 1) / n * size / 8 / 50e9 / t
    d_ag, d_rs, d_ag_emb, d_rs_head = (demand(B * n_layer, ag), demand(4 * n_layer, rs), demand(B * n_emb, ag_emb),
                                       demand(4 * n_head, rs_head))
    rs_head_start = start + head_b + ci_head
    l1_co = max(rs_head_start, l1_ag) + co / (1 - s)     # beside the head's reduce-scatter
    ag0_end = l1_co + ag / (0.5 / d_ag)                    # beside the head's reduce-scatter: 1/2 of the NIC each
    rs_head_end = ag0_end + rs_head - (l1_co - rs_head_start) - (ag0_end - l1_co) * 0.5 / d_rs_head
    assert rs_head_start < l1_co < ag0_end < rs_head_end
    done = (ag0_end - l1_co) * (1 - 2 * s) + (rs_head_end - ag0_end) * (1 - s)   # beside two, then one ring
    l1_end = rs_head_end + layer_b - done
    rs1_start = max(l1_end, rs_head_end) + ci              # its copy-in waits for the head's reduce-scatter
    l0_co = max(rs1_start, ag0_end) + co / (1 - s)       # beside layer 1's reduce-scatter
    rs1_end = l0_co + (rs - (l0_co - rs1_start)) / (0.5 / d_rs)   # beside the embedding's all-gather
    ag_emb_end = rs1_end + ag_emb - (rs1_end - l0_co) * 0.5 / d_ag_emb
    assert rs1_start < l0_co < rs1_end < ag_emb_end
    done = (rs1_end - l0_co) * (1 - 2 * s) + (ag_emb_end - rs1_end) * (1 - s)
    assert done < layer_b
    l0_end = ag_emb_end + layer_b - done
    rs0_end = max(l0_end, rs1_end) + ci + rs
    assert ag_emb_end < rs0_end - rs
    emb_end = max(l0_end + ci, ag_emb_end) + (ht["emb_w"] + co_emb) / (1 - s)   # beside layer 0's reduce-scatter
    rs_emb_end = max(rs0_end, emb_end) + ci_emb + rs_emb
    step = forward + rs_emb_end + optimizer_s((L * n_layer + n_emb + n_head) / n, zero_grads=False, master=False)

    cfg = config({"names": ["dp_shard"], "shape": [n]}, 2, 16, "zero3")
    cfg = replace(cfg, training=cfg.training.model_copy(update={"reshard_head_after_forward": True}))
    st = step_time(build_plan(cfg), Overlap(), table=gemm_table(1))
    assert st.step_s == pytest.approx(step, rel=1e-6) and round(step * 1e3, 4) == 4.6860
    fsdp = [e.name for e in st.units.get(0, 0, "B", 0).events if e.stream == "fsdp"]
    assert fsdp[:3] == ["fsdp AG root_head", "fsdp AG L1", "fsdp RS root_head"]


@pytest.mark.parametrize("head", [False, True])
def test_torch_fsdp2_gathers_what_the_table_counts(head):
    """torch's own FSDP2 on a fake process group (dp_shard 8, one micro-batch of 2, fp32, the
    LayerNorm model of test_runtime_dryrun) as the oracle: with the head resharded after forward
    ("always") torch all-gathers [norm, output] ((256 x 64 + 128) x 4 B) again in backward, once,
    as the table counts; without, only in forward. Layers and the embedding: forward and backward."""
    pytest.importorskip("torch")
    from meshplan.runtime.validation.dryrun import dry_run
    from meshplan.spec.training import TrainingSpec
    from tests.test_runtime_dryrun import FP32, TINY, mesh_of, tally

    model = TINY.model_copy(update=dict(gated_mlp=False, norm="layernorm", kv_heads=4))
    tr = TrainingSpec(global_batch=16, seq_len=16, micro_batch=2, reshard_head_after_forward=head, **FP32)
    run = dry_run(model, tr, mesh_of(("dp_shard",), (8,)), rank=1)
    dp = tuple(range(8))
    layer, emb, out = 2 * 128 + 4 * 64 * 64 + 2 * 64 * 128, 256 * 64, 256 * 64 + 128
    gathers = {k[3] // 4: v for k, v in tally(run, "backward").items() if k[1] == "all-gather" and k[2] == dp}
    assert gathers == {layer: 2, emb: 1} | ({out: 1} if head else {})
    from meshplan.config import config_from_dict
    plan = build_plan(config_from_dict({
        "model": model.model_dump(exclude_none=True), "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": tr.model_dump(include={"global_batch", "seq_len", "micro_batch", "reshard_head_after_forward",
                                           *FP32}) | {"recompute": "none"},
        "mesh": {"names": ["dp_shard"], "shape": [8]}}))
    table = {r.size_bytes // 4: r.per_step for r in plan.stage(0).collectives
             if r.op == "all-gather" and r.phase == "backward"}
    assert table == {k: v * 1 for k, v in gathers.items()}  # one micro-batch per step
