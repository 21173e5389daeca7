"""Float8 tensorwise TP all-gathers in float8 (``TrainingSpec.float8_tp_gathers``; torchao
eab345c ``float8/float8_tensor_parallel.py``: ``PrepareFloat8ModuleInput`` casts the block's
Shard(1) input to float8 before the Shard(1) -> Replicate all-gather; ``Float8RowwiseParallel``
wraps the reduce-scattered output in ``NoopFwToFloat8BwDynamic``, so backward casts the output
gradient before the mirror all-gather; torchtitan uses these styles unless the recipe is rowwise).

Llama 3 8B from torchtitan's example TOML on one DGX H100 (8 GPUs): dp_shard 4 x tp 2, local
batch 1, seq 8192, op-level SAC. By hand, per layer (32 layers, one micro-batch):

- forward: 2 all-gathers (attention and MLP input) of b s h = 1 x 8192 x 4096 = 33,554,432
  values, in float8: 33,554,432 B (bf16: 67,108,864 B); 2 reduce-scatters (wo, w_down outputs)
  in bf16, 67,108,864 B;
- backward: 2 all-gathers of the wo / w_down output gradients (float8) and the 2 forward
  all-gathers op-level AC replays (float8): 4 x 32 = 128; 2 reduce-scatters of the input
  gradients (bf16);
- not float8: the output layer's input all-gather (forward, plain ``ColwiseParallel``), the
  embedding's reduce-scatter (plain ``RowwiseParallel``) and their mirrors: 1 each in bf16.

Rowwise scaling (``recipe_name = "rowwise"``): torchtitan's plain TP, every all-gather in bf16.

Which torchtitan applies float8 TP: its parallelize tests ``"float8" in job_config.model.converters``
(``torchtitan/models/llama3/infra/parallelize.py``:77 at 73a0e69, tag v0.2.2; the same line since
57387af), so a job TOML with the converter ``"float8"`` and its ``[float8]`` table (torchtitan 57387af
to 5b5d468, whose registry names it so) gets it, and one with ``"quantize.linear.float8"`` (the
registry's name from 8a2686c, v0.2.0 to v0.2.2) does not: its float8 GEMMs run under plain TP,
every all-gather in bf16 (``training.fp8_tp = false``). The tensorwise float8 TP tests below use the
older file (:func:`older`).
"""

from __future__ import annotations

import pytest

from meshplan import catalog
from meshplan.compute import float8, float8_tp_reduces
from meshplan.compute.layer import layer_cost
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export
from meshplan.interop.foreign import load_any
from meshplan.interop.tomlout import resolved
from meshplan.interop.torchtitan_write import write as titan_write
from meshplan.memory.sizes import layer_act_sizes
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.workload import workload_of

from tests.test_float8_linears import TT, titan

BSH = 1 * 8192 * 4096


def tp_rows(plan) -> dict:
    """(phase, op, dtype) -> (size_bytes, calls per micro-batch) of stage 0's tp rows."""
    return {(r.phase, r.op, r.dtype): (r.size_bytes, r.per_microbatch) for r in plan.stage(0).collectives
            if r.axis == "tp" and r.op in ("all-gather", "reduce-scatter")}


def older(tmp_path, gather: bool, tp: int = 2):
    """The example TOML with float8 Linears as torchtitan 57387af to 5b5d468 names them (converter
    ``"float8"``, table ``[float8]``), whose parallelize applies float8 TP, at tp ``tp``."""
    text = TT.read_text().replace("tensor_parallel_degree = 1", f"tensor_parallel_degree = {tp}")
    text = text.replace('flavor = "8B"\n', 'flavor = "8B"\nconverters = ["float8"]\n')
    text += (f"\n[float8]\nenable_fsdp_float8_all_gather = {str(gather).lower()}\n"
             f"precompute_float8_dynamic_scale_for_fsdp = {str(gather).lower()}\nfilter_fqns = [\"output\"]\n")
    f = tmp_path / "older.toml"
    f.write_text(text)
    return build_plan(load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=1)))


def rowwise(tmp_path, tp: int = 2):
    """The example TOML with float8 Linears under rowwise scaling at tp ``tp``."""
    text = TT.read_text().replace("tensor_parallel_degree = 1", f"tensor_parallel_degree = {tp}")
    text = text.replace('flavor = "8B"\n', 'flavor = "8B"\nconverters = ["quantize.linear.float8"]\n')
    text += '\n[quantize.linear.float8]\nrecipe_name = "rowwise"\nfilter_fqns = ["output"]\n'
    f = tmp_path / "rw.toml"
    f.write_text(text)
    return build_plan(load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=1)))


def test_tensorwise_gathers_float8_by_hand(tmp_path):
    p = older(tmp_path, gather=True)
    assert (p.config.training.fp8_recipe, p.config.training.float8_tp_gathers) == ("tensorwise", True)
    assert tp_rows(p) == {
        ("forward", "all-gather", "fp8"): (BSH, 64), ("forward", "all-gather", "bf16"): (2 * BSH, 1),
        ("forward", "reduce-scatter", "bf16"): (2 * BSH, 65),
        ("backward", "all-gather", "fp8"): (BSH, 128), ("backward", "all-gather", "bf16"): (2 * BSH, 1),
        ("backward", "reduce-scatter", "bf16"): (2 * BSH, 65)}


def test_rowwise_and_bf16_gather_in_bf16(tmp_path):
    rw, off = rowwise(tmp_path), titan(tmp_path, float8=False, tp=2)
    assert (rw.config.training.fp8_recipe, rw.config.training.float8_tp_gathers) == ("rowwise", False)
    want = {("forward", "all-gather", "bf16"): (2 * BSH, 65), ("forward", "reduce-scatter", "bf16"): (2 * BSH, 65),
            ("backward", "all-gather", "bf16"): (2 * BSH, 129), ("backward", "reduce-scatter", "bf16"): (2 * BSH, 65)}
    assert tp_rows(rw) == tp_rows(off) == want
    # exported back: the recipe survives the round trip
    assert titan_write(rw.config)["quantize"]["linear"]["float8"]["recipe_name"] == "rowwise"


def test_timeline_waits_the_float8_gathers(tmp_path):
    """torch's TP collectives block (no async TP): the exposed tp time of tensorwise is
    rowwise's less, for each of the 64 + 128 float8 all-gathers, the bf16 gather's seconds less
    the float8 one's (the table's times); the head's and embedding's gathers stay bf16. Plus the
    tensorwise amax all-reduces, which block too: per layer forward 4 inputs and 7 weights (a
    tp-sharded DTensor each, not gathered in float8 here), backward 7 output gradients and the 11 of
    the forward op-level AC replays, 32 x 29 in all. Less rowwise's, blocking as well: per layer 2
    forward (wo's and w_down's inputs and weights, sharded along K), 5 backward (the column-parallel
    output gradients and weights, sharded along N) and the 2 replayed, 32 x 9 of each kind, the
    tokens' scales 8192 x 8 B, the weights' 4096 x 8 B."""
    tw, rw = older(tmp_path, gather=False), rowwise(tmp_path)
    t = {(r.phase, r.op, r.dtype): r.time_s for r in tw.stage(0).collectives if r.axis == "tp"}
    amax = {r.phase: r.per_step for r in tw.stage(0).collectives if r.dtype == "fp64"}
    assert amax == {"forward": 32 * 11, "backward": 32 * 18}
    scales = sorted((r.size_bytes, r.phase, r.per_step) for r in rw.stage(0).collectives if r.dtype == "fp64")
    assert scales == [(32_768, "backward", 32 * 7), (32_768, "forward", 32 * 2), (65_536, "backward", 32 * 7),
                      (65_536, "forward", 32 * 2)]
    t_rw = {r.size_bytes: r.time_s for r in rw.stage(0).collectives if r.dtype == "fp64" and r.phase == "forward"}
    saved = 192 * (t["forward", "all-gather", "bf16"] - t["forward", "all-gather", "fp8"]) \
        - 32 * 29 * t["forward", "all-reduce", "fp64"] + 32 * 9 * (t_rw[65_536] + t_rw[32_768])
    assert t["forward", "all-gather", "fp8"] < 0.6 * t["forward", "all-gather", "bf16"]
    exposed = [step_time(p).parts_s()["exposed tp"] for p in (rw, tw)]
    assert exposed[0] - exposed[1] == pytest.approx(saved, rel=1e-9)


def test_fp8_recipe_errors_are_one_line():
    base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "mesh": {"names": ["dp_shard"], "shape": [8]}}
    with pytest.raises(ConfigError, match=r"^training: fp8_recipe applies to the float8 Linear layers; set "
                                          r"linear_dtype = \"fp8\" or remove it$"):
        config_from_dict(base | {"training": {"global_batch": 8, "seq_len": 2048, "fp8_recipe": "rowwise"}})
    with pytest.raises(ConfigError, match=r"fp8_all_gather is tensorwise scaling only \(torchtitan refuses it"):
        config_from_dict(base | {"training": {"global_batch": 8, "seq_len": 2048, "linear_dtype": "fp8",
                                              "fp8_recipe": "rowwise", "fp8_all_gather": True}})


def test_gathered_buffers_are_float8_in_memory():
    """Llama 3 8B, dp_shard 4 x tp 2 with SP, micro-batch 1 of 8192 tokens, no recompute: the
    forward's all-gathered layer input (its transient, s b h values) and the backward's
    all-gathered output gradient of wo / w_down take 1 B a value under tensorwise float8, 2 B
    under rowwise: 33,554,432 B against 67,108,864 B."""
    cfg = lambda scaling: config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 4, "seq_len": 8192, "recompute": "none", "linear_dtype": "fp8",
                     "fp8_recipe": scaling},
        "mesh": {"names": ["dp_shard", "tp"], "shape": [4, 2], "sequence_parallel": True}})
    tw, rw = (layer_act_sizes(c.model, c.training, resolved(c), c.memory) for c in (cfg("tensorwise"), cfg("rowwise")))
    assert (tw.fwd_temp, rw.fwd_temp) == (BSH, 2 * BSH)
    work = lambda s: {st.name: st.work for st in s.steps}
    assert work(rw)["mlp w_out"] - work(tw)["mlp w_out"] == BSH
    assert work(rw)["attention w_o"] - work(tw)["attention w_o"] == BSH
    # saved: the float8 input copies (compute.float8.saved_copies, eager here) 1 B a value of the
    # gathered input, cast once before the gather under tensorwise, by each Linear after it under
    # rowwise (wk, wv and w_up again): 3 BSH more under rowwise. Under tensorwise (torchao's float8
    # TP) those copies are the GEMMs' only saved inputs (nc53 #1: PrepareFloat8ModuleInput casts the
    # norm's output before the gather, Float8RowwiseParallel w_down's input; memory.activations'
    # float8_tp): rowwise keeps besides them the bf16 norm-output shards of wq/wk/wv and w_gate/w_up
    # (2 x 8192/2 x 4096 B = BSH each) and the bf16 w_down input (2 x 8192 x 14336/2 B = 3.5 BSH):
    # 3 + 1 + 1 + 3.5 = 8.5 BSH
    assert 2 * (rw.saved - tw.saved) == 17 * BSH


@pytest.mark.parametrize("recompute,sp", [("none", True), ("op", True), ("full", True), ("none", False)])
def test_rowwise_scale_all_reduces_by_hand(recompute, sp):
    """Rowwise under plain TP (tp 2, with and without SP): the tp all-reduces of the scales of
    casts along tp-sharded rows (:func:`meshplan.compute.float8.rowwise_tp`). A GeLU model of 4
    layers, h 64 (wq, wk, wv, wo, w_up, w_down), s 64, micro-batch 1, dp_shard 2: 4 micro-batches
    a step. Per layer and micro-batch, of each kind (a token's scale, 64 x 8 B; a hidden unit's,
    64 x 8 B): forward 2 (wo and w_down, sharded along K), backward 4 (wq, wk, wv, w_up, sharded
    along N) and, recomputed (op-level or full AC), the forward's 2 again: per step forward 4 x 2 x 4
    = 32, backward 4 x 4 x 4 = 64 (96 recomputed). The timeline spends the table's seconds on them."""
    model = dict(layers=4, hidden=64, ffn=256, gated_mlp=False, q_heads=4, vocab=256)
    mesh = {"names": ["dp_shard", "tp"], "shape": [2, 2], "world": 4, "sequence_parallel": sp}
    plan = build_plan(config_from_dict({"model": model, "cluster": {"system": "dgx-h100", "nodes": 1},
                                        "training": {"global_batch": 8, "seq_len": 64, "micro_batch": 1,
                                                     "linear_dtype": "fp8", "fp8_recipe": "rowwise",
                                                     "recompute": recompute},
                                        "mesh": mesh}))
    rows = [r for r in plan.stage(0).collectives if r.dtype == "fp64"]
    back = 96 if recompute != "none" else 64
    assert sorted((r.size_bytes, r.phase, r.per_step) for r in rows) == [(512, "backward", back)] * 2 + [
        (512, "forward", 32)] * 2
    st = step_time(plan)
    spent = sum(ie.end_s - ie.start_s for e in st.pipeline.events if e.stage == 0 and e.stream == "compute"
                for ie in st.units.of_event(e).events if "scales" in ie.args.get("group", ""))
    assert spent == pytest.approx(sum(r.time_s * r.per_step for r in rows), rel=1e-9) and spent > 0


@pytest.mark.parametrize("gather,fwd,bwd", [(True, 2, 5 + 2), (False, 9, 5 + 9)])
def test_v022_converter_name_runs_plain_tp(tmp_path, gather, fwd, bwd):
    """torchtitan v0.2.2's converter name ``"quantize.linear.float8"`` (the example TOML, tp 2):
    its parallelize's ``enable_float8_linear = "float8" in job_config.model.converters`` is false,
    so ``apply_tp`` gets ``enable_float8_tensorwise_tp=False`` and plain ``ColwiseParallel`` /
    ``RowwiseParallel`` (parallelize.py:77-93, 192-210 at 73a0e69): every tp all-gather in bf16,
    the same rows as the bf16 plan's (65 forward, 129 backward a micro-batch: 64 layer gathers and
    the head's, 128 and its mirror). Each Float8Linear casts after the gathers; the amax of a
    tp-sharded DTensor is a Partial max, all-reduced over tp: per layer forward wo's and w_down's
    inputs (RowwiseParallel hands them over sharded along K) and, unless FSDP gathers the weights in
    float8, the 7 weights; backward the 5 column-parallel output gradients (sharded along N); the
    column-parallel inputs and the row-parallel output gradients arrive gathered (Replicate). The
    example's op-level SAC replays the forward's in backward: forward 32 x (2 or 9), backward
    32 x (5 + 2 or 5 + 9), one micro-batch a step."""
    p = titan(tmp_path, float8=True, gather=gather, tp=2)
    t = p.config.training
    assert (t.linear_dtype, t.fp8_recipe, t.fp8_tp, t.float8_tp_gathers) == ("fp8", "tensorwise", False, False)
    note = next(n for n in p.config.notes if "float8 TP off" in n)
    assert 'enable_float8_linear = "float8" in job_config.model.converters' in note
    assert "torchtitan/models/llama3/infra/parallelize.py:77 at 73a0e69, v0.2.2" in note
    assert tp_rows(p) == tp_rows(titan(tmp_path, float8=False, tp=2)) == {
        ("forward", "all-gather", "bf16"): (2 * BSH, 65), ("forward", "reduce-scatter", "bf16"): (2 * BSH, 65),
        ("backward", "all-gather", "bf16"): (2 * BSH, 129), ("backward", "reduce-scatter", "bf16"): (2 * BSH, 65)}
    amax = {r.phase: r.per_step for r in p.stage(0).collectives if r.dtype == "fp64"}
    assert amax == {"forward": 32 * fwd, "backward": 32 * bwd}
    # the layer's kernels mark the same casts (whose all-reduce the timeline waits for)
    c = layer_cost(p.config.model, catalog.gpu("h100-sxm5-80gb"), workload_of(p))
    calls = (float8_tp_reduces.tp_amax_calls(c.ops, "", "forward"), float8_tp_reduces.tp_amax_calls(c.ops, "", "backward_input"))
    assert calls == float8_tp_reduces.plain_tp_amax_per_layer(frozenset(float8.INPUTS), gather) == (fwd, 5)


def test_mixed_float8_names_and_export_say_what_torchtitan_does(tmp_path):
    """The converter ``"float8"`` beside ``[quantize.linear.float8]``: v0.2.x has no converter of that
    name (KeyError 'float8' in ModelConvertersContainer, protocols/model_converter.py:62 at 73a0e69),
    torchtitan before 5b5d468 reads [float8]: planned as "float8" runs, float8 TP on, with a note.
    A meshplan config planning float8 TP exported to torchtitan (v0.2.2 names) loses it: the header
    says so (tp 2, tensorwise)."""
    text = TT.read_text().replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 2").replace(
        'flavor = "8B"\n', 'flavor = "8B"\nconverters = ["float8"]\n') + '\n[quantize.linear.float8]\nfilter_fqns = ["output"]\n'
    f = tmp_path / "mixed.toml"
    f.write_text(text)
    cfg = load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=1))
    assert cfg.training.fp8_tp and cfg.training.float8_tp_gathers
    assert any(n.startswith('torchtitan: model.converters "float8" with [quantize.linear.float8]') and "KeyError 'float8'" in n
               for n in cfg.notes)
    plan = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                             "training": {"global_batch": 4, "seq_len": 8192, "linear_dtype": "fp8"},
                             "mesh": {"names": ["dp_shard", "tp"], "shape": [4, 2], "sequence_parallel": True}})
    _, head = export(plan, "torchtitan", "f8")
    assert "not expressed in torchtitan: training.fp8_tp: True -> False" in head
