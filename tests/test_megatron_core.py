"""Megatron Core (``training.megatron_runtime = "core"``) against Megatron-LM 2022, difference by
difference (meshplan/compute/megatron_core.py lists them with NVIDIA/Megatron-LM d98e8a64dd's
source lines): get_batch on the end stages only with one tp broadcast per tensor, the SP
embedding's reduce-scatter, no timer syncs, one sync per blocking p2p call; the keys' checks, and
what ``import megatron`` / ``export --to megatron`` do with them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.export import export
from meshplan.interop.megatron import read
from meshplan.interop.common import ImportOptions
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.workload import chunk_costs, workload_of

#: A small Llama-like model (RoPE, no learned positions) that fits one H100 whole.
MODEL = {"layers": 8, "hidden": 1024, "ffn": 4096, "q_heads": 8, "kv_heads": 8, "head_dim": 128, "vocab": 32000}


def _cfg(mesh: dict, runtime: str = "core", model: dict = MODEL, **training):
    t = {"global_batch": 16, "seq_len": 2048, "micro_batch": 1, "sharding": "none", "framework": "megatron",
         "megatron_runtime": runtime, "recompute": "none", **training}
    return config_from_dict({"model": model, "cluster": {"system": "dgx-h100", "nodes": 1}, "training": t,
                             "mesh": mesh})


PP2_TP4 = {"names": ["pp", "tp"], "shape": [2, 4], "sequence_parallel": True}


def _broadcasts(plan, stage: int) -> list[tuple[str, float, int]]:
    return sorted((r.dtype, r.size_bytes, r.per_microbatch) for r in plan.stage(stage).collectives
                  if r.axis == "tp" and r.op == "broadcast")


def test_core_get_batch_broadcasts_each_tensor_on_the_end_stages():
    """pp 2, tp 4, micro-batch 1, s 2048. Megatron Core (get_batch_on_this_tp_rank, utils.py:2272-2300):
    the first stage broadcasts tokens and position ids (int64, 8 x 2048 = 16,384 B each) and the
    data loader's boolean mask (2048 x 2048 = 4,194,304 B), the last labels (16,384 B), the fp32
    loss mask (4 x 2048 = 8,192 B) and the mask, once per micro-batch each; without the mask
    (--no-create-attention-mask-in-dataloader) the same less the bool rows. 2022 (mpu/data.py
    broadcast_data) broadcasts on both stages the 5 int64 key sizes (40 B) and the flattened
    batch, 8 x (2048 + 1) = 16,392 B."""
    core = build_plan(_cfg(PP2_TP4))
    mask = ("bool", 4_194_304, 1)
    assert _broadcasts(core, 0) == [mask, ("int64", 16_384, 1), ("int64", 16_384, 1)]
    assert _broadcasts(core, 1) == [mask, ("fp32", 8_192, 1), ("int64", 16_384, 1)]
    bare = build_plan(_cfg(PP2_TP4, dataloader_attention_mask=False))
    assert [_broadcasts(bare, s) for s in (0, 1)] == [[("int64", 16_384, 1)] * 2, [("fp32", 8_192, 1), ("int64", 16_384, 1)]]
    old = build_plan(_cfg(PP2_TP4, "2022"))
    assert [_broadcasts(old, s) for s in (0, 1)] == [[("int64", 40, 1), ("int64", 16_392, 1)]] * 2


def test_core_get_batch_runs_in_the_end_chunks_only():
    """pp 2 with 2 virtual stages (8 micro-batches): 2022 runs get_batch in each of the 4 chunks
    (forward_step per model chunk), Megatron Core in chunk 0 of stage 0 and chunk 1 of stage 1 only
    (is_first_or_last_pipeline_stage(vp_stage), common_utils.py:515-525; pretrain_gpt.py:129-134)."""
    mesh = {**PP2_TP4, "virtual_stages": 2, "pp_schedule": "interleaved_1f1b"}
    where = {}
    for runtime in ("2022", "core"):
        plan = build_plan(_cfg(mesh, runtime))
        costs = chunk_costs(plan, workload_of(plan))
        where[runtime] = [(s, c) for s, st in enumerate(costs) for c, ch in enumerate(st) if ch.batch is not None]
    assert where == {"2022": [(0, 0), (0, 1), (1, 0), (1, 1)], "core": [(0, 0), (1, 1)]}


def _sp_embedding_rows(plan) -> tuple[int, int]:
    """(embedding all-reduces, forward reduce-scatters) per micro-batch of stage 0's tp rows."""
    rows = plan.stage(0).collectives
    ar = sum(r.per_microbatch for r in rows if r.axis == "tp" and r.cadence.startswith("every micro-batch (Megatron emb"))
    rs = sum(r.per_microbatch for r in rows if r.axis == "tp" and r.phase == "forward" and r.op == "reduce-scatter")
    return ar, rs


def test_core_reduce_scatters_the_sp_embedding_without_learned_positions():
    """Stage 0 holds 4 layers, 2 forward reduce-scatters each under SP (after the attention's and the
    MLP's row-parallel GEMMs): 8. 2022 all-reduces the embedding's output and splits it (1 all-reduce,
    8 reduce-scatters); Megatron Core reduce-scatters it (reduce_scatter_embeddings,
    language_model_embedding.py:51-56: 0 and 9) unless a learned position embedding is added, when it
    all-reduces as 2022 did (1 and 8)."""
    assert _sp_embedding_rows(build_plan(_cfg(PP2_TP4, "2022"))) == (1, 8)
    assert _sp_embedding_rows(build_plan(_cfg(PP2_TP4))) == (0, 9)
    learned = {**MODEL, "position_embedding": "learned", "max_position": 2048}
    assert _sp_embedding_rows(build_plan(_cfg(PP2_TP4, model=learned))) == (1, 8)


def test_core_step_by_hand_on_one_node_of_data_parallelism():
    """dp 8, tp 1, pp 1 (no broadcast, no p2p, no SP): the two generations differ by get_batch and the
    timers alone. H100 (catalog: issue floor 4.7 us, Triad 2.97 TB/s), PCIe 5.0 x16 (63 GB/s, 5.7 us),
    b 1, s 2048, 2 micro-batches per rank.
    2022 per micro-batch: the batch's copy 8 x 2049 = 16,392 B (0.2602 + 5.7 us); the mask's
    ones(1, s, s) fp32 16,777,216 B (5.6490 us), tril 33,554,432 B (11.2980), < 0.5 20,971,520 B
    (7.0611), loss mask and position ids at the floor (2 x 4.7); 4 timer syncs and broadcast_data's 2
    size copies (6 x 4.7) in forward, 2 timer syncs (2 x 4.7) in backward: 76.9683 us.
    Core per micro-batch: tokens, labels, position ids 16,384 B each (3 x (0.2601 + 5.7)), the loss
    mask 8,192 B (0.1300 + 5.7), the mask 4,194,304 B (66.5763 + 5.7): 95.9866 us.
    Per step 2022 also synchronises its 11 step timers at start and stop: 22 x 4.7 = 103.4 us.
    2022 - core = 2 x (76.9683 - 95.9866) + 103.4 = 65.3634 us."""
    mesh = {"names": ["dp"], "shape": [8]}
    old, core = (step_time(build_plan(_cfg(mesh, r))) for r in ("2022", "core"))
    per_22 = 0.2602 + 5.7 + 5.6490 + 11.2980 + 7.0611 + 2 * 4.7 + 6 * 4.7 + 2 * 4.7
    per_core = 3 * (0.2601 + 5.7) + 0.1300 + 5.7 + 66.5763 + 5.7
    assert (round(per_22, 4), round(per_core, 4)) == (76.9683, 95.9866)
    hand = 2 * (per_22 - per_core) + 22 * 4.7
    assert (old.step_s - core.step_s) * 1e6 == pytest.approx(hand, abs=0.01)


@pytest.mark.parametrize("training, words", [
    ({"megatron_runtime": "core", "framework": "torch"},
     "megatron_runtime is the Megatron-LM generation the step model follows (framework \"megatron\"); framework "
     "'torch': remove it or set framework = \"megatron\""),
    ({"megatron_runtime": "2022", "dataloader_attention_mask": False},
     "dataloader_attention_mask is Megatron Core's --create-attention-mask-in-dataloader"),
    ({"megatron_runtime": "2023"}, "training.megatron_runtime"),
    ({"sharding": "zero3", "zero3_engine": "deepspeed"}, "megatron_runtime \"core\" is Megatron Core's get_batch"),
    ({"sharding": "zero1", "zero12_engine": "deepspeed", "pp_engine": "deepspeed"},
     "set megatron_runtime = \"2022\" or remove it"),
    ({"sharding": "zero1", "zero12_engine": "deepspeed"}, "is Megatron-DeepSpeed")])
def test_runtime_keys_are_refused_in_one_line(training, words):
    """The generation applies under framework megatron only, the mask key under its core generation
    only (2022 builds the mask on the GPU whatever the loader does), and the values are "2022" and
    "core": each a one-line ConfigError naming the key. Review rv48: "core" under a DeepSpeed
    engine (Megatron-DeepSpeed, whose get_batch and get_batch_pipe in microsoft/Megatron-DeepSpeed's
    pretrain_gpt.py broadcast ['text'] with broadcast_data and build the masks on the GPU, 2022's
    way, as its import already plans) was planned with Megatron Core's end-stage get_batch."""
    with pytest.raises(ConfigError) as e:
        _cfg({"names": ["dp"], "shape": [8]}, **training)
    assert words in str(e.value) and "\n" not in str(e.value)


SCRIPT = ("--num-layers 8 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 8 --seq-length 2048 "
          "--max-position-embeddings 2048 --position-embedding-type rope --vocab-size 32000 --swiglu "
          "--normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear "
          "--tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 2 "
          "--micro-batch-size 1 --global-batch-size 16 --bf16 --attention-dropout 0.0 --hidden-dropout 0.0\n")


def test_import_plans_core_and_export_writes_the_mask_flag_back():
    """A current Megatron-LM script imports as Megatron Core (the flags of d98e8a6), the mask flag as
    dataloader_attention_mask false; the export writes --no-create-attention-mask-in-dataloader back
    and the round trip loses nothing. A 2022 plan exports with a header line saying that the flags run
    on Megatron Core, not as a lost field (the generation is the runtime's, as the loss is)."""
    opts = ImportOptions(cluster="dgx-h100", nodes=1)
    plain = config_from_dict(read(SCRIPT, opts).tables)
    bare = config_from_dict(read(SCRIPT + "--no-create-attention-mask-in-dataloader\n", opts).tables)
    assert (plain.training.megatron_runtime, plain.training.core_attention_mask) == ("core", True)
    assert (bare.training.megatron_runtime, bare.training.core_attention_mask) == ("core", False)
    text, header = export(bare, "megatron", "test")
    assert "--no-create-attention-mask-in-dataloader" in text.splitlines()
    assert not [h for h in header if h.startswith("not expressed")]
    old = replace(plain, training=plain.training.model_copy(update={"megatron_runtime": "2022"}))
    text, header = export(old, "megatron", "test")
    assert "--no-create-attention-mask-in-dataloader" not in text
    assert [h for h in header if h.startswith("training.megatron_runtime: this plan follows Megatron-LM 2022")]
    assert not [h for h in header if h.startswith("not expressed")]


def test_core_syncs_once_per_blocking_p2p_call():
    """pp 2, 1F1B, 16 micro-batches (tp 4, dp 1), calls as meshplan.compute.megatron_cost.p2p_calls
    counts them: stage 0 warms up min(1, 16) = 1 forward (its send_forward), makes one
    send_forward_recv_backward per steady forward (15) and one recv_backward in the cool-down: 17;
    stage 1 its leading recv_forward and one send_backward(_recv_forward) per micro-batch: 17.
    2022 synchronises 3 times a call (two timer syncs and _communicate's): 51 x 4.7 = 239.7 us;
    Megatron Core once (_communicate's batch_p2p_sync, p2p_communication.py:421-424): 17 x 4.7 = 79.9 us."""
    mesh = {**PP2_TP4, "pp_schedule": "1f1b"}
    got = {}
    for runtime in ("2022", "core"):
        st = step_time(build_plan(_cfg(mesh, runtime)))
        got[runtime] = {e.stage: round(e.dur_s * 1e6, 4) for e in st.post_events if e.name == "pipeline p2p calls' syncs"}
    assert got == {"2022": {0: 239.7, 1: 239.7}, "core": {0: 79.9, 1: 79.9}}


def test_core_interleaved_at_m_equal_p_counts_core_s_warm_up():
    """pp 4 x tp 2, interleaved 1F1B with 2 chunks a stage, m = 4 = p micro-batches, the p2p overlap off
    (blocking calls, each synchronised). Megatron-LM 2022 puts every unit in warm-up at m == p
    (w = m v = 8 on every stage): m v + w + [s > 0] + [s < p - 1] = 17, 18, 18, 17 calls, 3 syncs each
    x 4.7 us = 239.7, 253.8, 253.8, 239.7 us. Megatron Core (d98e8a64dd ``schedules.py``
    ``get_pp_rank_microbatches`` 929-987) has no m == p case: w = min(8, 2 (3 - s) + 4) = 8, 8, 6, 4,
    the receive before the cool-down only where w = m v (1960-1972, stages 0 and 1): 17, 18, 15, 13
    calls, one sync each: 79.9, 84.6, 70.5, 61.1 us. Before, core counted 2022's calls (84.6 us on
    stages 2 and 3)."""
    mesh = {"names": ["pp", "tp"], "shape": [4, 2], "sequence_parallel": True, "pp_schedule": "interleaved_1f1b",
            "virtual_stages": 2}
    got = {}
    for runtime in ("2022", "core"):
        st = step_time(build_plan(_cfg(mesh, runtime, global_batch=4, pp_p2p_overlap=False)))
        got[runtime] = {e.stage: round(e.dur_s * 1e6, 4) for e in st.post_events if e.name == "pipeline p2p calls' syncs"}
    assert got == {"2022": {0: 239.7, 1: 253.8, 2: 253.8, 3: 239.7}, "core": {0: 79.9, 1: 84.6, 2: 70.5, 3: 61.1}}


@pytest.mark.parametrize("mesh, kept", [(PP2_TP4, 2048 * 2048), ({"names": ["pp", "cp", "tp"], "shape": [2, 2, 2],
                                                                   "sequence_parallel": True}, 2048 * 2048 // 2)])
def test_core_loader_mask_on_the_gpu_of_the_end_stages(mesh, kept):
    """The data loader's ``[b, 1, s, s]`` bool mask (NVIDIA/Megatron-LM d98e8a64dd): pinned host memory
    until ``get_batch`` (``pretrain_gpt.py:110-160``) copies it to the GPU on tp rank 0 and every other
    tp rank allocates its broadcast buffer, ``torch.empty((b, 1, s, s), dtype=torch.bool)``
    (``megatron/core/utils.py:2337-2342``): b 1, s 2048, 1 B: 4,194,304 B on every rank of the first and
    the last stage, in the first chunk's forward and the last's, none on another stage or pass. At cp 2
    ``_get_batch_on_this_cp_rank_per_sequence_balancing`` (2504-2560) index_selects 2 of the 4 row chunks
    into a new tensor, 4,194,304 / 2 = 2,097,152 B kept, the full copy freed. Freed when ``forward_step``
    returns (a local, not saved for backward): every allocation has its free in the same pass. The
    last stage's peak is its head's forward of the first micro-batch, where the mask is held, so its
    peak is ``kept`` above the same plan without the loader's mask (``dataloader_attention_mask =
    false``); stage 0's peak is in a backward, unchanged. Before, the timeline held no mask at all."""
    on, off = build_plan(_cfg(mesh)), build_plan(_cfg(mesh, dataloader_attention_mask=False))
    full = 2048 * 2048
    for stage, tl in enumerate(on.timelines):
        masks = [e for e in tl.events() if e.label.startswith("get_batch")]
        micro = on.config.training.global_batch // (on.config.training.micro_batch * on.mesh.degree("dp"))
        assert sum(e.delta_bytes for e in masks if e.delta_bytes > 0) == micro * full
        assert sum(e.delta_bytes for e in masks) == 0 and {e.phase for e in masks} == {"forward"}
        peak = max(e.delta_bytes for e in masks if e.delta_bytes > 0)
        assert peak == full
    last = len(on.timelines) - 1
    assert on.timelines[last].peak.total_bytes - off.timelines[last].peak.total_bytes == kept
    assert on.timelines[0].peak.total_bytes == off.timelines[0].peak.total_bytes
    assert not [e for e in off.timelines[last].events() if e.label.startswith("get_batch")]
