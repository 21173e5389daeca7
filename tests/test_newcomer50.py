"""Findings of newcomer trial 50 (a torchtitan MoE user: Qwen3-235B-A22B and DeepSeek-V3 on 64 x 8 H200);
each test failed before its fix. Inputs in ``tests/data/nc50/`` (the trial's own files, cut where said).

#1 (high): ``expert_parallel_comm_backend = "deepep"`` in a qwen3 job was planned as DeepEP, though torchtitan's
qwen3 parallelize (pytorch/torchtitan e347b1e ``torchtitan/models/qwen3/infra/parallelize.py``:108-118) calls
``apply_moe_ep_tp`` without ``use_deepep``: only deepseek_v3 (``models/deepseek_v3/infra/parallelize.py``:99-134)
and llama4 (``models/llama4/infra/parallelize.py``:113-148) read the key. A qwen3 job now plans the standard
all-to-all, with a note that the key is ignored for that family.

#2 (high): DualPipeV + ep + activation checkpointing was planned though torchtitan raises NotImplementedError
(e347b1e ``distributed/dual_pipe_v.py``:32-53, ``get_dual_pipe_v_flag``, when
``pipeline_parallel_expert_parallel_overlap``, default true, ``config/job_config.py``:420): now an infeasible plan
with that reason and the fix; the key is read (``training.pp_ep_overlap``), and where torchtitan overlaps the pairs
(``distributed/pipeline_parallel.py``:216-219) the plan says its timing does not.

#3 (medium): etp = tp with ep > 1 was infeasible under torch (rule torch_etp, b5bcd76's), though every
TOML-reading torchtitan (<= v0.2.2; e347b1e ``distributed/parallel_dims.py``:58-59) runs it: c4b409a removed it
after 9810191 ended TOML job files. The import names the torchtitan it reads (``training.op_sac_policy =
"238fa99"``, :attr:`TrainingSpec.torchtitan_v022`, the one home of "which torchtitan") and the rule and the
search's etp values follow it; a meshplan TOML that names none, or "b5bcd76", is still refused.

#4 (medium): the bubble hint told a torchtitan user ``mesh.virtual_stages = 4, parallelism.module_fqns_per_model_part
[7, 8, ...]`` (meshplan's key, and layer counts where torchtitan takes module names); it now says
``parallelism.pipeline_parallel_layers_per_stage = N`` and re-plans the split torchtitan cuts from it.

#5 (medium): a meshplan TOML at pp 8 with 2 virtual stages and 94 layers was refused with "94 layers do not divide
into pp 8 stages", the virtual stages unnamed; the reason now names them and the two shapes of split it takes, and
the fix line gives torchtitan's uneven split.

#6 (medium): validate (a) refused ``model.qk_norm`` only after torchrun started (rank 0's ConfigError, exit 1): it is
now a refusal decided before anything runs (exit 2), listed in the docs; (b) ``--layers`` left an explicit
``pp_layer_split`` at the config's layers ("sums to 94, must be 4 layers"): it is rescaled in proportion.

#7 (medium-low): where the caching allocator's reserved peak exceeds usable memory but the allocated peak fits,
plan, memory, step and the page said "fits" alone; a warning line now says the allocator will flush and retry.

#8 (low): ``--calibration`` with an all-to-all fit on an inline node printed "links calibrated" beside "links
uncalibrated ... pass --calibration", and "the other collectives stay on the catalog curves" where the node has
none: the origin line says they run at the NIC line rate, and the uncalibrated note names the ops it means.

#9 (low): float8 MFU was against the fp8 peak alone while the routed experts' grouped GEMMs (and attention) run in
bf16: the line now says what that peak counts and gives MFU against the bf16 peak beside it.

#10 (low): ``step`` of a mesh over memory printed the reasons but no ``fix:`` line where ``plan`` does; it prints
plan's (meshplan.plan_fix.memory_fix), the same line.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.cli import main
from meshplan.errors import ConfigError
from meshplan.schedule.bubble_hint import torchtitan_layers_per_stage
from meshplan.plan import Infeasible, build_plan
from meshplan.spec.axes.ep import etp_values

DATA = Path(__file__).parent / "data" / "nc50"
H200_64 = ImportOptions(cluster="dgx-h200", nodes=64)


def _run(capsys, *argv) -> tuple[str, str]:
    """``meshplan ARGV`` in this process: (stdout, stderr); exit status 0 or 1 (a verdict, not an error)."""
    try:
        main([str(a) for a in argv])
    except SystemExit as e:
        assert e.code in (0, 1, None), capsys.readouterr().err[-400:]
    out = capsys.readouterr()
    return out.out, out.err


def test_deepep_ignored_for_qwen3(tmp_path):
    """#1: the trial's ``qwen3_deepep_tt.toml`` (qwen3 235B-A22B, ep 16, backend "deepep") plans the standard
    all-to-all (``moe_dispatcher`` "alltoall", torchtitan's "standard") and says the key is ignored; the same
    job with ``[model] name = "deepseek_v3"`` (flavor 16B: 64 experts, ep 16 divides them) is read as DeepEP,
    since deepseek_v3's parallelize passes ``use_deepep=True`` (e347b1e parallelize.py:113, 133)."""
    cfg = load_any(DATA / "qwen3_deepep_tt.toml", "torchtitan", H200_64)
    assert cfg.training.moe_dispatcher == "alltoall"
    said = [n for n in cfg.notes if "expert_parallel_comm_backend" in n and "ignored" in n]
    assert len(said) == 1 and "qwen3" in said[0] and "standard all-to-all" in said[0]
    text = (DATA / "qwen3_deepep_tt.toml").read_text()
    dsv3 = text.replace('name = "qwen3"', 'name = "deepseek_v3"').replace('flavor = "235B-A22B"', 'flavor = "16B"')
    (tmp_path / "dsv3.toml").write_text(dsv3.replace("hf_assets_path", "# hf_assets_path"))
    cfg = load_any(tmp_path / "dsv3.toml", "torchtitan", H200_64)
    assert cfg.training.moe_dispatcher == "deepep"
    assert not [n for n in cfg.notes if "ignored" in n and "expert_parallel_comm_backend" in n]


def test_dualpipev_ep_ac_infeasible(tmp_path):
    """#2: the trial's ``dpv.toml`` (DualPipeV, pp 4, ep 16, AC selective "op", the overlap key unset: true) and
    ``dpv_overlap.toml`` (the key written true) are infeasible with torchtitan's reason and both fixes; with
    ``pipeline_parallel_expert_parallel_overlap = false`` torchtitan runs it (``get_dual_pipe_v_flag`` returns
    False before the AC test: no such reason), and the key is read, not listed unused."""
    for name in ("dpv.toml", "dpv_overlap.toml"):
        cfg = load_any(DATA / name, "torchtitan", H200_64)
        assert cfg.training.pp_ep_overlap is True
        plan = build_plan(cfg, memory=False)
        assert isinstance(plan, Infeasible)
        why = [r for r in plan.reasons if "NotImplementedError" in r]
        assert len(why) == 1 and "dual_pipe_v.py:32-53" in why[0]
        assert 'activation_checkpoint.mode = "none"' in why[0] and "expert_parallel_overlap = false" in why[0]
    text = (DATA / "dpv_overlap.toml").read_text().replace("expert_parallel_overlap = true",
                                                          "expert_parallel_overlap = false")
    (tmp_path / "off.toml").write_text(text)
    cfg = load_any(tmp_path / "off.toml", "torchtitan", H200_64)
    assert cfg.training.pp_ep_overlap is False
    assert not any("pipeline_parallel_expert_parallel_overlap" in n and "not use" in n for n in cfg.notes)
    plan = build_plan(cfg, memory=False)
    assert not any("NotImplementedError" in r for r in getattr(plan, "reasons", ()))


def test_dualpipev_pair_overlap_note(tmp_path):
    """#2: AC off and the key true (torchtitan registers its OVERLAP_F_B callback, pipeline_parallel.py:216-219):
    feasible as far as the rules go, with the note that the pairs' overlap is not in the timing."""
    text = (DATA / "dpv.toml").read_text().replace('mode = "selective"', 'mode = "none"')
    (tmp_path / "noac.toml").write_text(text.replace('selective_ac_option = "op"', ""))
    plan = build_plan(load_any(tmp_path / "noac.toml", "torchtitan", H200_64), memory=False)
    assert not isinstance(plan, Infeasible)
    assert sum("OVERLAP_F_B" in n for n in plan.notes) == 1


def test_etp_equals_tp_under_toml_torchtitan(tmp_path):
    """#3: the trial's ``etp2tp4.toml`` (tp 4, ep 16, pp 4) with ``expert_tensor_parallel_degree = 4`` (= tp):
    e347b1e ``ParallelDims._validate`` allows ETP = TP, so the import plans it (no torch_etp reason) and names the
    revision; the same mesh in a meshplan TOML without the revision, or with "b5bcd76", has the reason
    (c4b409a's torchtitan cannot run it). The search offers etp 1 and tp (4) with ep 8 only for v0.2.2."""
    (tmp_path / "etp4.toml").write_text((DATA / "etp2tp4.toml").read_text().replace(
        "expert_tensor_parallel_degree = 2", "expert_tensor_parallel_degree = 4"))
    cfg = load_any(tmp_path / "etp4.toml", "torchtitan", H200_64)
    assert cfg.training.op_sac_policy == "238fa99" and cfg.training.torchtitan_v022
    plan = build_plan(cfg, memory=False)
    assert not any("etp 4 with tp 4" in r for r in getattr(plan, "reasons", ()))
    for policy in (None, "b5bcd76"):
        t = cfg.training.model_copy(update={"op_sac_policy": policy})
        plan = build_plan(replace(cfg, training=t), memory=False)
        assert isinstance(plan, Infeasible) and any("etp 4 with tp 4 and ep 16" in r for r in plan.reasons)
    assert etp_values("torch", {"tp": 4, "ep": 8}, v022=True) == [1, 4]
    assert etp_values("torch", {"tp": 4, "ep": 8}) == [1]
    # etp 2 with tp 4 (etp2tp4.toml as the trial wrote it): v0.2.2 refuses it too, a ConfigError
    with pytest.raises(ConfigError, match="expert_tensor_parallel_degree = 1 or 4"):
        load_any(DATA / "etp2tp4.toml", "torchtitan", H200_64)


def test_bubble_hint_in_torchtitan_keys(capsys):
    """#4: ``dsv3_671b_512xh200.toml`` (DeepSeek-V3, 61 layers, pp 8 x 2 stages per rank, Interleaved1F1B): the
    hint's 4 stages per rank are 32 parts; torchtitan cuts ceil((61 + 2) / N) parts, 32 at N = 2 (63 / 2 = 31.5),
    so the line says ``pipeline_parallel_layers_per_stage = 2`` and neither meshplan's mesh.virtual_stages nor
    module_fqns_per_model_part with counts. 94 layers (Qwen3-235B) at pp 4 x 4: 96 / 6 = 16 parts, N = 6;
    40 parts of 96 slots: ceil(96 / 2) = 48, ceil(96 / 3) = 32, no N."""
    assert (torchtitan_layers_per_stage(61, 32), torchtitan_layers_per_stage(94, 16)) == (2, 6)
    assert torchtitan_layers_per_stage(94, 40) is None
    out, err = _run(capsys, "step", DATA / "dsv3_671b_512xh200.toml", "--cluster", "dgx-h200", "--nodes", 64)
    hint = [x for x in (out + err).splitlines() if x.startswith("hint: the pipeline bubble")]
    assert len(hint) == 1 and "parallelism.pipeline_parallel_layers_per_stage = 2 (32 stages, 4 per rank" in hint[0]
    assert "virtual_stages" not in hint[0] and "module_fqns_per_model_part [" not in hint[0]


def test_uneven_layers_name_the_virtual_stages(tmp_path, capsys):
    """#5: the trial's import output ``job.toml`` (Qwen3-235B, interleaved, 2 virtual stages) at pp 8 without its
    split: 94 / 8 = 11.75 layers per stage, 94 / 16 = 5.875 per chunk. torchtitan cuts 16 parts of (94 + 2) / 16 = 6
    slots, the embedding and the output one each: [5, 6 x 14, 5], i.e. per stage 5 + 6 = 11, 12 x 6, 6 + 5 = 11,
    which the fix line gives."""
    text = (DATA / "job.toml").read_text().replace("shape = [4, -1, 16]", "shape = [8, -1, 16]")
    (tmp_path / "pp8.toml").write_text("\n".join(x for x in text.splitlines() if not x.startswith("pp_layer_split")))
    out, err = _run(capsys, "plan", tmp_path / "pp8.toml")
    lines = (out + err).splitlines()
    assert ("infeasible: 94 layers do not divide into pp 8 stages (11.75 per stage) of vpp 2 virtual stages (5.875 "
            "layers per chunk); give an explicit pp_layer_split of 8 entries (layers per stage) or 16 (per virtual "
            "stage); the fix line gives the framework's uneven split") in lines
    assert any(x.startswith("fix: 94 layers over pp 8 x vpp 2: give mesh.pp_layer_split = [11, 12, 12, 12, 12, 12, 12, "
                            "11]") for x in lines)


def test_validate_refuses_qk_norm_up_front_and_rescales_the_split():
    """#6: the trial's ``slice_pp2_ep2.toml`` (Qwen3-235B, qk_norm, pp 2 x ep 2, split [23, 24, 24, 23]) at
    ``--worlds 4 --layers 4``: one refusal naming model.qk_norm among those decided before torchrun; the scaled
    config's split is 4 x (23 or 24) / 94 = 0.98 or 1.02 -> floors [0, 1, 1, 0], the 2 layers left to the largest
    remainders (0.98, entries 0 and 3): [1, 1, 1, 1]; at --layers 8: [1.96, 2.04, 2.04, 1.96] -> [2, 2, 2, 2]."""
    from meshplan.interop.foreign import load_any as load
    from meshplan.runtime.validation.options import Options
    from meshplan.runtime.validation.refusals import refusals
    from meshplan.runtime.validation.scaling import scale_config
    cfg = load(DATA / "slice_pp2_ep2.toml")
    why = [e for e in refusals(cfg, Options(worlds=(4,), layers=4)) if e.field == "model.qk_norm"]
    assert len(why) == 1 and "qk_norm = false" in str(why[0])
    for layers, split in ((4, [1, 1, 1, 1]), (8, [2, 2, 2, 2])):
        scaled, notes = scale_config(cfg, 4, Options(worlds=(4,), layers=layers))
        assert scaled.mesh.pp_layer_split == split and scaled.model.layers == layers
        assert any(f"pp_layer_split [23, 24, 24, 23] -> {split}" in n for n in notes)


def test_reserved_over_usable_warns(capsys, tmp_path):
    """#7: the trial's import output ``job.toml`` (Qwen3-235B pp 4 x ep 16 on 64 H200: usable 139.8 GiB x 0.9 =
    125.8 GiB): stage 0's peak incl. communication buffers 119.1 GiB fits; the simulated caching allocator reserves
    132.6 GiB there, + 0.5 GiB communication buffers (the memory line's) = 133.1 GiB > 125.8 GiB, so
    plan, memory and step each print the retry warning once (stage 1: 125.0 < 125.8, no excess).
    Since torchtitan 238fa99's Qwen3 op-SAC save list is followed (it lacks all_to_all_single: the
    dispatch and combine outputs are replayed, not kept; tests/test_op_sac_qwen3_all_to_all.py) the
    trial's job (op_sac_policy unset, 238fa99's lists) peaks at 57.1 GiB; under b5bcd76's list, which
    saves the all-to-alls, it keeps them as the trial saw: the allocated peak 119.05 GiB + 0.5 GiB
    communication buffers = 119.6 GiB fits, reserved 133.19 + 0.5 GiB = 133.7 GiB > 125.8 GiB (read from
    the model)."""
    job = tmp_path / "job.toml"
    job.write_text(_b5bcd76(DATA / "job.toml"))
    for command, extra in (("plan", ()), ("memory", ("--out", tmp_path)), ("step", ())):
        out, err = _run(capsys, command, job, *extra)
        lines = [x for x in (out + err).replace("\n", " ").split("warning (this mesh): ") if "cudaMalloc" in x]
        assert len(lines) == 1, command
        assert "(119.6 GiB on stage 0)" in lines[0] and "= 133.7 GiB exceeds the usable 125.8 GiB" in lines[0]


def _b5bcd76(path) -> str:
    """The trial's job with torchtitan b5bcd76's op-SAC lists (which save the EP all-to-alls)."""
    text = path.read_text()
    assert "op_sac_policy" not in text and text.count('recompute = "op"\n') == 1
    return text.replace('recompute = "op"\n', 'recompute = "op"\nop_sac_policy = "b5bcd76"\n')


def test_calibration_lines_on_an_inline_node(capsys):
    """#8: the trial's ``job_roce.toml`` (inline hgx-h200-roce node, 400 Gb/s NICs, no catalog curve) with its
    ``calib.toml`` (one alltoall_perf run over 16 ranks on 2 hosts, apply_calibration's "a2a" curve): all-to-all is
    set; all-reduce, all-gather, reduce-scatter and send/recv have neither a catalog curve nor a run, so both
    lines say those four run at line rate, and neither says "catalog curves"."""
    out, err = _run(capsys, "step", DATA / "job_roce.toml", "--calibration", DATA / "calib.toml")
    text = (out + err).replace("\n", " ")
    assert ("sets all-to-all across nodes; all-reduce, all-gather, reduce-scatter and send/recv run at the NIC line "
            "rate (the node has no catalog NIC curve), an upper bound") in text
    assert ("links uncalibrated: hgx-h200-roce NIC (400 Gb/s) for all-reduce, all-gather, reduce-scatter and "
            "send/recv (--calibration set all-to-all)") in text
    assert "stay on the catalog curves" not in text


def test_float8_mfu_names_both_peaks(capsys):
    """#9: ``dsv3_fp8.toml`` (DeepSeek-V3, float8 converter, H200): MFU is stated of the 1,979 TFLOP/s fp8 peak and,
    beside it, of the 989 TFLOP/s bf16 peak (the H200 SXM datasheet's dense figures, catalog): the same model FLOP
    over half the peak, so the second MFU is 1979 / 989 = 2.0x the first (12.4% -> 24.8% at this step)."""
    import re
    out, err = _run(capsys, "step", DATA / "dsv3_fp8.toml", "--cluster", "dgx-h200", "--nodes", 64)
    line = next(x for x in (out + err).replace("\n ", " ").splitlines() if x.startswith("tokens/s"))
    fp8 = float(re.search(r"MFU ([\d.]+)% \(model FLOP", line).group(1))
    bf16 = float(re.search(r"MFU ([\d.]+)% of the 989 TFLOP/s bf16 dense peak", line).group(1))
    assert "of the 1,979 TFLOP/s fp8 dense peak per GPU (the float8 Linears' peak" in line
    assert abs(bf16 - fp8 * 1979 / 989) <= 0.1


def test_step_prints_plans_fix_line(capsys):
    """#10: the trial's ``job_skew.toml`` (its hottest expert's share raised): stage 0 peaks at 130.0 GiB > 125.8
    GiB usable, so both commands exit 1 with the reasons and the same ``fix:`` line (the knobs re-planned).
    Under b5bcd76's op-SAC lists (238fa99's Qwen3 list keeps no all-to-all output: 57.1 GiB, it fits;
    test_reserved_over_usable_warns): 130.0 GiB allocated, 130.5 GiB with buffers, read from the model."""
    import pathlib
    import tempfile
    job = pathlib.Path(tempfile.mkdtemp()) / "job_skew.toml"
    job.write_text(_b5bcd76(DATA / "job_skew.toml"))

    def verdict(command):
        try:
            main([command, str(job)])
        except SystemExit as e:
            assert e.code == 1
        out = capsys.readouterr()
        lines = (out.out + out.err).splitlines()
        return [x for x in lines if x.startswith("infeasible: ")], [x for x in lines if x.startswith("fix: ")]
    (plan_why, plan_fix), (step_why, step_fix) = verdict("plan"), verdict("step")
    assert plan_why and plan_why == step_why
    assert len(plan_fix) == 1 and plan_fix == step_fix


def test_export_says_qwen3_ignores_deepep(tmp_path, capsys):
    """#1, the other way: a meshplan plan of Qwen3-30B-A3B (its config.json: model_type qwen3_moe -> torchtitan's
    qwen3) with moe_dispatcher "deepep" exported to torchtitan keeps the key, and the header says the qwen3
    parallelize ignores it (e347b1e qwen3/infra/parallelize.py:108-118), so the file runs the all-to-all."""
    hf = Path(__file__).parent / "data" / "hf" / "qwen3-30b-a3b" / "config.json"
    (tmp_path / "q.toml").write_text(f'[model]\nhf_config = "{hf}"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                                     '[training]\nglobal_batch = 8\nseq_len = 1024\nmoe_dispatcher = "deepep"\n'
                                     '[mesh]\nnames = ["dp_shard", "ep"]\nshape = [8, 8]\n')
    _run(capsys, "export", tmp_path / "q.toml", "--to", "torchtitan", "-o", tmp_path / "tt.toml")
    text = (tmp_path / "tt.toml").read_text()
    assert "# note: expert_parallel_comm_backend = \"deepep\" is written, but torchtitan's qwen3 parallelize ignores" \
        in text
