"""Megatron-LM's block recompute (``--recompute-granularity full --recompute-method block
--recompute-num-layers n``, ``training.recompute_num_layers``): the first n layers of each model
chunk checkpointed in full, the others keeping all their activations. Megatron-Core's
``checkpointed_forward`` checkpoints ``layer_idx < recompute_num_layers`` over the
TransformerBlock's own layers, one block per virtual stage (NVIDIA/Megatron-LM d98e8a6,
``megatron/core/recompute.py:167-181``; 2022's ``megatron/model/transformer.py:990-1000`` at
e1c334b the same).

Model G of tests/test_activation_checkpointing.py (4 layers, hidden 16, gated MLP 64, 4 heads of
4, 4 KV heads, bf16, flash, seq 8, micro-batch 1, tp 1) under framework megatron. Kept per layer
per micro-batch, by hand (Korthikanti et al. 2022 Table 2 terms, meshplan.memory.activations):

- none: attention norm input and QKV input 2 x 256, q k v 3 x 256, flash statistics
  4 x 4 x 8 = 128, context 256, MLP norm input and w_in input 2 x 256, gate, up and w_out input
  3 x (2 x 8 x 64 = 1024): 5248 B (Megatron-LM's fused SwiGLU, MemoryOptions.fused_glu_for,
  keeps no SiLU output: torch's 6272 less 1024);
- full: the layer input 2 x 8 x 16 = 256 B;
- block n = 2 of the stage's 4 layers: 256, 256, 5248, 5248.
"""

from __future__ import annotations

import pytest

from meshplan.cli import main
from meshplan.errors import ConfigError
from meshplan.memory.activations import layer_bytes
from meshplan.memory.constraints import estimate
from meshplan.memory.layer_dims import LayerDims
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap

from tests.test_activation_checkpointing import G, kept
from tests.test_memory_timeline import plan_of

MEG = dict(model=G, framework="megatron", sharding="zero1")


def _plans():
    return (plan_of(recompute="none", **MEG), plan_of(recompute="full", **MEG),
            plan_of(recompute="full", recompute_num_layers=2, **MEG))


def test_kept_activations_two_inputs_and_two_whole_layers():
    """n = 2 of 4: 2 x (layer input, 256) + 2 x (whole layer, 5248) = 11,008 B a micro-batch."""
    none, full, block = _plans()
    assert kept(none) == [5248] * 4 and kept(full) == [256] * 4
    assert kept(block) == [256, 256, 5248, 5248]
    assert sum(kept(block)) == 2 * 256 + 2 * 5248 == 11008


def test_recompute_time_is_two_forward_layers():
    """Only the checkpointed layers replay their forward in backward: full replays 4 forward
    layers, block n = 2 the first 2 (the last two layers' costs hold no recompute op)."""
    none, full, block = (step_time(p, Overlap()) for p in _plans())
    forward = none.units.chunks[0][0].layers[0].seconds(phase="forward")
    assert full.recompute_s() == pytest.approx(4 * forward, rel=1e-12)
    assert block.recompute_s() == pytest.approx(2 * forward, rel=1e-12)
    assert [c.seconds(recompute=True) for c in block.units.chunks[0][0].layers][2:] == [0, 0]


def test_peak_between_full_and_none():
    """The timeline keeps two whole layers more than full and two fewer than none."""
    peaks = [p.timeline.peak.total_bytes for p in _plans()]
    assert peaks[1] < peaks[2] < peaks[0]


def test_each_model_chunk_counts_its_own_layers():
    """8 layers at pp 2 x vpp 2 (interleaved 1F1B): stage 0 holds chunks [0, 1] and [4, 5]; n = 1
    checkpoints the first layer of each chunk (0 and 4), not the stage's first layer alone."""
    mesh = dict(names=["pp", "dp_shard"], shape=[2, 1], world=2, virtual_stages=2, pp_schedule="interleaved_1f1b")
    p = plan_of(mesh=mesh, recompute="full", recompute_num_layers=1, **{**MEG, "model": dict(G, layers=8)})
    assert p.stages[0] == [[0, 1], [4, 5]]
    assert p.config.training.stage_recomputed(p.stages[0]) == (True, False, True, False)
    assert p.timeline.templates  # planned
    from meshplan.memory.sizes import stage_sizes
    sz = stage_sizes(p.config.model, p.config.training, p.mesh, p.stages, p.state[0], p.config.memory, [])
    assert {i: sz.acts[i].saved for i in sz.acts} == {0: 256, 1: 5248, 4: 256, 5: 5248}
    assert p.config.training.block_layers_text(p.stages) == \
        "recomputed: 2 of 4 layers per stage (stage 0: layers 0, 4)"


def test_tp_replays_only_the_checkpointed_layers():
    """tp 2 with SP under Megatron-LM: a layer's backward runs its forward's 2 all-gathers and 2
    reduce-scatters mirrored plus 2 all-gathers of the SP input for the weight gradients (4 AG +
    2 RS), the head 2 AG and 1 RS more: none 18 AG, 9 RS. A recomputed layer replays its forward's
    2 AG + 2 RS: full 26 and 17, block n = 2 (2 layers) 22 and 13."""
    mesh = dict(names=["tp"], shape=[2], world=2, sequence_parallel=True)
    counts = []
    for kw in ({"recompute": "none"}, {"recompute": "full"}, {"recompute": "full", "recompute_num_layers": 2}):
        p = plan_of(mesh=mesh, **MEG, **kw)
        rows = {r.op: r.per_microbatch for r in p.collectives["stage 0"] if r.axis == "tp" and r.phase == "backward"}
        counts.append((rows["all-gather"], rows["reduce-scatter"]))
    assert counts == [(18, 9), (26, 17), (22, 13)]


def test_first_estimate_keeps_the_unchecked_layers_whole():
    """memory.constraints.estimate (the capacity rows' first estimate) at pp 1: the block row's
    activations exceed full's by (4 - 2) x (none - full) per layer of its own formula."""
    p = _plans()[1]
    t, m = p.config.training, p.config.model
    est = {n: estimate(m, t.model_copy(update={"recompute_num_layers": n}), p.mesh, p.stages, 2).activation_bytes
           for n in (None, 2)}
    dims = LayerDims.from_model(m, t.seq_len, t.micro_batch)
    kw = dict(tp=1, sp=False, cp=1, flash=True, framework="megatron")
    excess = layer_bytes(dims, recompute="none", **kw) - layer_bytes(dims, recompute="full", **kw)
    assert est[2] - est[None] == 2 * excess == 2 * (6272 - 256)


def test_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"training.recompute_num_layers: 5 > 4, the layers of the largest model "
                                          r"chunk .*use 1 to 4, or remove it"):
        plan_of(recompute="full", recompute_num_layers=5, **MEG)
    with pytest.raises(ConfigError, match="recompute_num_layers is Megatron-LM's --recompute-method block"):
        plan_of(recompute="selective", recompute_num_layers=2, **MEG)
    with pytest.raises(ConfigError, match="framework 'torch'"):
        plan_of(model=G, recompute="full", recompute_num_layers=2)


ARGS = """--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
--num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
--swiglu --normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope --rotary-base 500000
--max-position-embeddings 8192 --untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 128256
--attention-dropout 0.0 --hidden-dropout 0.0
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2
--num-layers-per-virtual-pipeline-stage 4 --use-distributed-optimizer
--recompute-granularity full --recompute-method block --recompute-num-layers 2
--micro-batch-size 1 --global-batch-size 128 --seq-length 8192 --bf16 --use-flash-attn
"""


def _run(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    return done.value.code or 0, out.out, out.err


def test_import_sets_the_field_and_export_writes_the_flags(tmp_path, capsys):
    """32 layers at pp 2 with 4 a virtual stage: vpp 4, chunks of 4; --recompute-num-layers 2
    checkpoints layers 0, 1 of each: 8 of a stage's 16 (stage 0: 0, 1, 8, 9, 16, 17, 24, 25)."""
    (tmp_path / "j.args").write_text(ARGS)
    rc, _, err = _run(["import", "megatron", tmp_path / "j.args", "--cluster", "dgx-h100", "--nodes", "2",
                       "--out", tmp_path / "j.toml"], capsys)
    toml = (tmp_path / "j.toml").read_text()
    assert rc == 0, err
    assert 'recompute = "full"\nrecompute_num_layers = 2\n' in toml and "planned as full recompute" not in toml
    rc, out, err = _run(["export", tmp_path / "j.toml", "--to", "megatron", "-o", "-"], capsys)
    assert rc == 0, err
    assert "--recompute-granularity full --recompute-method block --recompute-num-layers 2" in " ".join(out.split())
    rc, out, err = _run(["step", tmp_path / "j.toml"], capsys)
    assert rc == 0, err
    assert "recomputed: 8 of 16 layers per stage (stage 0: layers 0, 1, 8, 9, 16, 17, 24, 25)" in " ".join(out.split())
