"""A Megatron-LM export carries what the plan models, and an import refuses what it does not
(newcomer findings, issue 11).

Sources (NVIDIA/Megatron-LM at d98e8a6): ``TransformerConfig.moe_token_dispatcher_type``
(allgather, alltoall, flex; default allgather) and ``cp_comm_type`` (p2p, all_gather, a2a,
a2a+p2p), megatron/core/transformer/transformer_config.py; arguments.py ``--cp-comm-type``
(default p2p) and its assertion ``max_position_embeddings >= seq_length``;
``MegatronFSDP.__init__`` forces ``overlap_grad_reduce`` for optim_grads / optim_grads_params
and ``overlap_param_gather`` for optim_grads_params
(megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py lines 326-337).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export
from meshplan.interop.foreign import load_any
from meshplan.interop.megatron import write
from meshplan.plan import build_plan
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.overlap_policy import megatron_reduce_line
from meshplan.schedule.steptime import step_time
from nccl_published import ndr_ring_s
from tests.cli_run import run_captured


def _cfg(model: str, nodes: int, training: dict, mesh: dict):
    return config_from_dict({"model": {"catalog": model}, "cluster": {"system": "dgx-h100", "nodes": nodes},
                             "training": training, "mesh": mesh})


MIXTRAL = _cfg("mixtral-8x7b", 1, {"global_batch": 8, "seq_len": 4096, "sharding": "zero3"},
               {"names": ["dp", "ep"], "shape": [8, 8]})
#: Llama 3 70B at 128k tokens (the model's max_position is 8192), cp 16 x tp 4 over 16 nodes
LONG = _cfg("llama3-70b", 16, {"global_batch": 32, "seq_len": 131072, "sharding": "zero3", "recompute": "full"},
            {"names": ["dp", "cp", "tp"], "shape": [2, 16, 4], "sequence_parallel": True})


def _header(cfg) -> list[str]:
    return export(cfg, "megatron", "t.toml")[1]


def _lost(header: list[str]) -> list[str]:
    """The re-import check's lines, less the framework (an export is Megatron-LM's by definition)
    and the parameter dtype that follows it (torch's fp32 default, Megatron-LM's bf16)."""
    return [h for h in header if h.startswith("not expressed") and "training.framework" not in h
            and "training.param_dtype" not in h]


def test_export_writes_the_dispatcher_and_cp_comm_type_the_plan_models():
    flags = write(MIXTRAL)
    assert "--moe-token-dispatcher-type alltoall" in flags and not any(f.startswith("--cp-comm") for f in flags)
    flags = write(LONG)  # torch's ring: Megatron-LM runs Transformer Engine's p2p ring, its default
    assert "--cp-comm-type p2p" in flags and not any(f.startswith("--moe-token") for f in flags)
    assert _lost(_header(MIXTRAL)) == [] and _lost(_header(LONG)) == []
    gather = replace(LONG, training=LONG.training.model_copy(update={"cp_attention": "allgather"}))
    assert "--cp-comm-type all_gather" in write(gather) and _lost(_header(gather)) == []


def test_export_raises_max_position_to_the_sequence_and_says_so():
    flags = write(LONG)
    assert "--max-position-embeddings 131072" in flags and "--seq-length 131072" in flags
    header = _header(LONG)
    assert ("--max-position-embeddings 131072: raised from model llama3-70b's max_position 8192 to --seq-length "
            "(Megatron-LM asserts max_position_embeddings >= seq_length)") in header
    assert _lost(header) == []  # the raised rows are the note's, not a loss
    short = _cfg("llama3-70b", 1, {"global_batch": 8, "seq_len": 4096}, {"names": ["dp"], "shape": [8]})
    assert "--max-position-embeddings 8192" in write(short) and not any("raised" in h for h in _header(short))


def test_plan_and_step_warn_when_the_sequence_exceeds_max_position():
    line = ("training.seq_len 131072 is more than model llama3-70b's max_position 8192: planned as given (RoPE has "
            "no table; the cost is the same), assuming RoPE scaling the model does not state; set model.max_position "
            "to the scaled context (e.g. 131072) or use catalog model llama3.1-70b (Llama 3.1: 131072 positions, RoPE "
            "scaled) or shorten training.seq_len")  # nc59 #4: llama3-70b is Llama 3 (8192), llama3.1-70b its 131072
    assert line in build_plan(LONG).notes
    short = _cfg("llama3-70b", 1, {"global_batch": 8, "seq_len": 8192}, {"names": ["dp"], "shape": [8]})
    assert not any("max_position" in n for n in build_plan(short).notes)


def _args(tmp_path, cfg, *extra: str, drop: str = ""):
    f = tmp_path / "a.args"
    f.write_text("\n".join([x for x in write(cfg) if not (drop and x.startswith(drop))] + list(extra)) + "\n")
    return f


@pytest.mark.parametrize("flag, value, planned", [
    ("--moe-token-dispatcher-type", "allgather", "alltoall"),
    ("--cp-comm-type", "a2a", "p2p or --cp-comm-type all_gather"),
    ("--cp-comm-type", "a2a+p2p", "p2p or --cp-comm-type all_gather")])
def test_import_refuses_a_dispatch_or_cp_meshplan_does_not_model(tmp_path, flag, value, planned):
    cfg = MIXTRAL if flag.startswith("--moe") else LONG
    f = _args(tmp_path, cfg, f"{flag} {value}", drop=flag)  # the last given wins, as argparse
    opts = ImportOptions(cluster="dgx-h100", nodes=cfg.cluster.nodes)
    with pytest.raises(ConfigError, match=rf"does not model .*; use {flag} {planned}$") as e:
        load_any(f, "megatron", opts)
    assert e.value.field == flag
    r = run_captured("import", "megatron", f, "--cluster", "dgx-h100", "--nodes", cfg.cluster.nodes, "-o", "-")
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith(f"error: {flag}: {value} ")


def test_import_reads_the_planned_values_and_notes_megatron_defaults(tmp_path):
    opts = ImportOptions(cluster="dgx-h100", nodes=1)
    again = load_any(_args(tmp_path, MIXTRAL), "megatron", opts)
    assert not any("--moe-token-dispatcher-type" in n for n in again.notes)  # read: neither unused nor noted
    bare = load_any(_args(tmp_path, MIXTRAL, drop="--moe-token-dispatcher-type"), "megatron", opts)
    assert any(n.startswith("megatron: --moe-token-dispatcher-type not given: Megatron-LM's default allgather")
               and n.endswith("planned as alltoall: add --moe-token-dispatcher-type alltoall") for n in bare.notes)
    opts = ImportOptions(cluster="dgx-h100", nodes=16)
    # --cp-comm-type: absent, Megatron-LM's default p2p, planned as such (Transformer Engine's ring); given, read
    bare = load_any(_args(tmp_path, LONG, drop="--cp-comm-type"), "megatron", opts)
    assert not any("--cp-comm-type" in n for n in bare.notes)
    assert bare.training.cp_attention is None and bare.training.cp_kind == "p2p"
    for value, key in (("p2p", "p2p"), ("all_gather", "allgather")):
        given = load_any(_args(tmp_path, LONG, f"--cp-comm-type {value}", drop="--cp-comm-type"), "megatron", opts)
        assert given.training.cp_attention == key and not any("--cp-comm-type" in n for n in given.notes)
    # a value meshplan does not model is fine where it does not communicate: cp 1
    dense = _cfg("llama3-8b", 1, {"global_batch": 8, "seq_len": 4096}, {"names": ["dp"], "shape": [8]})
    assert load_any(_args(tmp_path, dense, "--cp-comm-type p2p"), "megatron",
                    ImportOptions(cluster="dgx-h100", nodes=1))


def test_megatron_fsdp_overlaps_its_reduce_scatters_by_hand():
    """Llama 3 8B, zero3 over dp 8 on one DGX H100, m = 1, framework megatron (Megatron FSDP
    optim_grads_params, its overlap forced on). With the reduce-scatters overlapped only what
    nothing can hide is exposed: the root unit's forward all-gather (5.014 ms, the step's first
    transfer), the first layer's forward all-gather (1.058 ms: issued with the root's, on the
    same stream, behind it), the first backward all-gather (1.058 ms: the last layer was
    resharded after forward) and the root's reduce-scatter (10.006 ms, fp32), which the
    optimizer step waits for. Megatron-LM's DDP order (the reduction after each backward,
    ``Overlap(grad_reduce=False)``, what framework megatron modelled for every sharding before)
    adds each of the 32 layers' 2.094 ms reduce-scatter in full."""
    cfg = _cfg("llama3-8b", 1, {"global_batch": 8, "seq_len": 4096, "sharding": "zero3", "framework": "megatron"},
               {"names": ["dp"], "shape": [8]})
    p = build_plan(cfg)
    rows = {(r.phase, r.op, r.cadence): r.time_s for r in p.stage(0).collectives}
    ag, rs = rows[("forward", "all-gather", "every layer")], rows[("backward", "reduce-scatter", "every layer")]
    root_ag = rows[("forward", "all-gather", "per root (embedding/norm/output)")]
    root_rs = rows[("backward", "reduce-scatter", "per root (embedding/norm/output)")]
    assert (round(root_ag * 1e3, 3), round(ag * 1e3, 3), round(rs * 1e3, 3), round(root_rs * 1e3, 3)) == \
        (5.014, 1.058, 2.094, 10.006)
    exposed = step_time(p).exposed_s["fsdp"]
    assert exposed == pytest.approx(root_ag + 2 * ag + root_rs, abs=1e-9)  # 17.136 ms
    blocking = step_time(p, Overlap(grad_reduce=False)).exposed_s["fsdp"]
    assert blocking - exposed == pytest.approx(32 * rs, abs=1e-9)  # 67.022 ms
    assert megatron_reduce_line(cfg.training).startswith("note: Megatron FSDP (sharding zero3): each unit's "
                                                         "gradient reduce-scatter overlaps the next unit's backward")


def test_export_writes_the_overlap_flags_megatron_fsdp_runs():
    zero3 = write(MIXTRAL)
    assert {"--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params", "--overlap-grad-reduce",
            "--overlap-param-gather"} <= set(zero3)
    zero1 = _cfg("llama3-8b", 1, {"global_batch": 8, "seq_len": 4096, "sharding": "zero1", "framework": "megatron"},
                 {"names": ["dp"], "shape": [8]})
    assert not any(f.startswith("--overlap") for f in write(zero1))  # the plan reduces after the backward
    assert "not overlapped" in megatron_reduce_line(zero1.training)
    # DeepSpeed's engines under framework megatron (the SC'21 ZeRO-3 runs, ZeRO-1/2): not Megatron-LM's line
    for other in ({"zero3_engine": "deepspeed-2021"}, {"sharding": "zero1", "zero12_engine": "deepspeed"}):
        t = zero1.training.model_copy(update={"sharding": "zero3", **other})
        assert megatron_reduce_line(t) == ""


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-405b", "gpt3-175b", "megatron-22b", "mixtral-8x7b",
                                  "deepseek-v2-lite", "deepseek-v3"])
def test_every_model_field_of_the_catalog_survives_a_megatron_round_trip(name):
    """Each catalog model exported and read back: the re-import check lists no model field
    (rope_theta, norm_eps, swiglu, untied embeddings, vocab, query groups, MoE and MLA dims)."""
    cfg = _cfg(name, 2, {"global_batch": 16, "seq_len": 2048}, {"names": ["dp"], "shape": [16]})
    header = _header(cfg)
    assert not [h for h in header if h.startswith("not expressed") and "model." in h], header


def test_rope_base_and_norm_epsilon_are_written_and_read_back(tmp_path):
    flags = write(_cfg("llama3-8b", 1, {"global_batch": 8, "seq_len": 4096}, {"names": ["dp"], "shape": [8]}))
    assert {"--rotary-base 500000", "--norm-epsilon 1e-05"} <= set(flags)  # config.json rope_theta, rms_norm_eps
    ds = write(_cfg("deepseek-v2-lite", 1, {"global_batch": 8, "seq_len": 4096}, {"names": ["dp"], "shape": [8]}))
    assert {"--rotary-base 10000", "--norm-epsilon 1e-06"} <= set(ds)
    gpt3 = write(_cfg("gpt3-175b", 1, {"global_batch": 8, "seq_len": 2048}, {"names": ["dp"], "shape": [8]}))
    assert not any(f.startswith(("--rotary-base", "--norm-epsilon")) for f in gpt3)  # learned positions, unstated
    f = tmp_path / "a.args"
    f.write_text("\n".join(x for x in flags if not x.startswith(("--rotary-base", "--norm-epsilon"))) + "\n")
    cfg = load_any(f, "megatron", ImportOptions(cluster="dgx-h100", nodes=1))
    assert cfg.model.name == "llama3-8b" and cfg.model.rope_theta == 500000.0
    assert ("megatron: the model flags give catalog model llama3-8b but not --rotary-base (Megatron-LM's default "
            "10000; llama3-8b: 500000): planned as llama3-8b (the same costs); add --rotary-base 500000 to train "
            "it") in cfg.notes  # --norm-epsilon's default 1e-5 is llama3-8b's: not named
    f.write_text("\n".join(flags + ["--rotary-base 10000"]) + "\n")
    custom = load_any(f, "megatron", ImportOptions(cluster="dgx-h100", nodes=1)).model
    assert (custom.name, custom.rope_theta, custom.norm_eps) == ("megatron-args", 10000.0, 1e-5)
    f.write_text("\n".join(flags + ["--norm-epsilon x"]) + "\n")
    with pytest.raises(ConfigError, match="is not a norm epsilon") as e:
        load_any(f, "megatron", ImportOptions(cluster="dgx-h100", nodes=1))
    assert e.value.field == "--norm-epsilon"


def test_megatron_fsdp_makes_no_copies_on_the_compute_stream_by_hand():
    """Llama 3 8B, zero3 over dp 8 on one DGX H100, fp32 parameters and reduction. FSDP2
    (framework torch) copies on the compute stream: a layer's copy-out reads and writes its
    436.224 MB bf16 all-gather output (872.4 MB at Triad 2.97 TB/s: 293.8 us), its copy-in reads
    218,112,000 bf16 gradients and writes them in fp32 (1.309 GB: 440.6 us); 32 layers gathered
    twice and reduced once, the embedding unit (707.5 / 1061.3 us, gathered twice) and the
    [norm, output] unit (707.5 / 1061.3 us, gathered once): 37.1 ms per step. Megatron FSDP
    (NVIDIA/Megatron-LM d98e8a6: the parameters are views of the all-gather bucket, the
    weight-gradient GEMMs write into the reduce-scatter bucket) makes none: every row's copy 0,
    no copies note, and the search's copies 0 too."""
    import numpy as np

    from meshplan.search.memory import Tables
    from meshplan.search.space import SHARDING, enumerate_candidates
    from meshplan.search.comm_bounds import fsdp_copies

    training = {"global_batch": 8, "seq_len": 4096, "sharding": "zero3", "param_dtype": "fp32", "reduce_dtype": "fp32"}
    copies = {}
    for fw in ("torch", "megatron"):
        cfg = _cfg("llama3-8b", 1, {**training, "framework": fw}, {"names": ["dp"], "shape": [8]})
        p = build_plan(cfg)
        copies[fw] = {(r.phase, r.op, r.cadence): round(r.copy_s * 1e6, 1) for r in p.stage(0).collectives}
        notes = [n for n in step_time(p).notes if n.startswith("FSDP2 copies on the compute stream")]
        c = enumerate_candidates(cfg)
        i = int(np.flatnonzero((c.fsdp == 8) & (c.tp == 1) & (c.sh == SHARDING.index("zero3")))[0])
        searched = fsdp_copies(cfg, Tables(cfg), c.take([i]))
        if fw == "torch":
            assert copies[fw][("forward", "all-gather", "every layer")] == 293.8
            assert copies[fw][("backward", "reduce-scatter", "every layer")] == 440.6
            by_hand = 64 * 293.8 + 32 * 440.6 + 3 * 707.5 + 2 * 1061.3  # us
            assert notes == [f"FSDP2 copies on the compute stream: {by_hand / 1e3:.1f} ms per step (stage 0): the "
                             "copy-out after each all-gather and the copy-in before each reduce-scatter "
                             "(meshplan.comm.fsdp2)"] and f"{by_hand / 1e3:.1f}" == "37.1"
            assert round(float(searched["out"][0]) * 1e6, 1) == 293.8
        else:
            assert set(copies[fw].values()) == {0.0} and len(copies[fw]) == 5 and notes == []
            assert all(float(v[0]) == 0.0 for v in searched.values())
            assert "no copies on the compute stream around them, unlike FSDP2" in megatron_reduce_line(cfg.training)


#: A Llama 3 70B launch script as a newcomer wrote it (issue 11, trial 4): tp 8, pp 4 interleaved
#: (5 layers a virtual stage), the distributed optimizer with both overlap flags, 8 nodes: dp 2.
LLAMA70B_SH = """#!/bin/bash
GPT_ARGS="
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --sequence-parallel
    --num-layers-per-virtual-pipeline-stage 5
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --micro-batch-size 1 --global-batch-size 64 --seq-length 4096 --bf16 --use-flash-attn
    --recompute-activations
"
torchrun --nproc_per_node 8 --nnodes 8 pretrain_gpt.py $GPT_ARGS
"""
OVERLAP_FLAGS = " --overlap-grad-reduce --overlap-param-gather"


def _import_70b(tmp_path, text: str):
    f = tmp_path / "pretrain_llama70b.sh"
    f.write_text(text)
    return load_any(f, "megatron", ImportOptions(cluster="dgx-h100", model="llama3-70b"))


def test_megatron_overlap_flags_are_read_planned_and_written(tmp_path):
    """``--overlap-grad-reduce --overlap-param-gather`` with the distributed optimizer are
    ``training.overlap_grad_reduce`` / ``overlap_param_gather``, which the step's line names
    and the export writes back; without them the line says the reduction is not overlapped
    and the export writes neither."""
    on, off = _import_70b(tmp_path, LLAMA70B_SH), _import_70b(tmp_path, LLAMA70B_SH.replace(OVERLAP_FLAGS, ""))
    assert (on.training.sharding, on.training.overlap_grad_reduce, on.training.overlap_param_gather) == \
        ("zero1", True, True)
    assert (off.training.overlap_grad_reduce, off.training.overlap_param_gather) == (False, False)
    assert not any("overlap" in n for n in on.notes)
    assert megatron_reduce_line(on.training) == (
        "note: Megatron-LM DDP buffers (sharding zero1, --overlap-grad-reduce): each gradient bucket is reduced once "
        "its gradients are ready in the last backward, overlapping the rest of it (--overlap-param-gather: the next "
        "forward waits for the first bucket's parameter all-gather, the others run beside it)")
    assert megatron_reduce_line(off.training).endswith("not overlapped (Megatron-LM's default, --overlap-grad-reduce "
                                                       "off)")
    flags = write(on)
    assert flags.count("--overlap-grad-reduce") == flags.count("--overlap-param-gather") == 1
    assert not any(f.startswith("--overlap") for f in write(off))
    assert _lost(_header(on)) == []  # read back the same


@pytest.mark.parametrize("text, field, words", [
    (LLAMA70B_SH.replace("--overlap-grad-reduce ", ""), "--overlap-param-gather", "without --overlap-grad-reduce"),
    (LLAMA70B_SH.replace("--use-distributed-optimizer ", ""), "--overlap-param-gather",
     "needs --use-distributed-optimizer")])
def test_megatron_overlap_flags_megatron_refuses_are_refused(tmp_path, text, field, words):
    """What Megatron-LM's arguments.py asserts (d98e8a6 lines 1024-1029) is a one-line error."""
    with pytest.raises(ConfigError, match=f"^{field}: .*{words}"):
        _import_70b(tmp_path, text)


def test_megatron_overlapped_reduce_by_hand(tmp_path):
    """The step's exposed dp with and without the flags, from the step's parts. dp = 64 / (8 x 4)
    = 2, so a bucket is max(40e6, 1e6 x 2) = 40,000,000 elements (``DistributedDataParallel``,
    d98e8a6 lines 131-137). Stage 0 (pp 4 interleaved, 4 chunks of 5 layers) buckets only its
    chunk 0 (Megatron turns bucketing off for every local chunk after the first,
    megatron_buckets.megatron_bucketed): the embedding 129,024 x 8192 / 8 (the vocabulary padded to
    128 x tp) + 5 layers x 106,971,136 (attention (8192^2 x 2 + 8192 x 1024 x 2) / 8, MLP 3 x 8192 x
    28672 / 8, two norms 2 x 8192) = 666,976,256 elements = 16 x 4e7 + 26,976,256; chunks 1-3 one
    bucket each of 5 x 106,971,136 = 534,855,680 (fp32 4 B reduced, bf16 2 B gathered).
    Off: the reduce-scatter S and the all-gather G run after the last backward, both exposed.
    On: the buckets' reduce-scatters run on the dp stream as the last backward of each chunk
    makes them ready (one twentieth of S_b after each of stage 0's 20 layers); only what is left
    when the stage's last unit ends is exposed, at most the last unit's 5 layers' share (chunk 0
    of 4); with virtual stages (Megatron-LM's align_param_gather) the schedule issues chunks 0 and
    1's buckets before the first forward and chunk 0's whole gather is waited for
    (test_megatron_param_gather.py): chunk 0's 17 buckets' seconds are exposed (until 2026-12 this
    test pinned max(G_b / 57, G_b - F0), 37.58 ms, the unaligned order; then G_b x chunk 0's share
    of the elements, 0.2936, with 57 equal buckets on the stage). Everything else (compute,
    bubble, tp, pp) is the same but for SP's norm-gradient all-reduce over tp, exposed after the
    last backward when off, so the steps differ by the exposed dp and that all-reduce."""
    on, off = (build_plan(_import_70b(tmp_path, t)) for t in (LLAMA70B_SH, LLAMA70B_SH.replace(OVERLAP_FLAGS, "")))
    rows_on = [r for r in on.stage(0).collectives if r.axis == "dp"]
    (rs,), (ag,) = ([r for r in off.stage(0).collectives if r.axis == "dp" and r.op == op]
                    for op in ("reduce-scatter", "all-gather"))
    numel = rs.size_bytes // 4
    assert (rs.dtype, -(-numel // 40_000_000)) == ("fp32", 57)
    assert sorted((r.op, r.size_bytes, r.per_step) for r in rows_on) == [
        ("all-gather", 2 * 26_976_256, 1), ("all-gather", 2 * 40_000_000, 16), ("all-gather", 2 * 534_855_680, 3),
        ("reduce-scatter", 4 * 26_976_256, 1), ("reduce-scatter", 4 * 40_000_000, 16),
        ("reduce-scatter", 4 * 534_855_680, 3)]
    s_b = sum(r.time_s * r.per_step for r in rows_on if r.op == "reduce-scatter")
    g_b = sum(r.time_s * r.per_step for r in rows_on if r.op == "all-gather")
    st_on, st_off = step_time(on), step_time(off)
    post = {s: {e.name: e.end_s - e.start_s for e in st.post_events if e.stage == 0} for s, st in
            (("on", st_on), ("off", st_off))}
    tp_norms = sum(r.time_s for r in off.stage(0).collectives if r.axis == "tp" and r.phase == "step")
    assert post["off"]["grad reduce: reduce-scatter (per step)"] == pytest.approx(rs.time_s, rel=1e-9)
    assert post["off"]["param all-gather (per step)"] == pytest.approx(ag.time_s, rel=1e-9)
    # SP's coalesced norm-gradient all-reduce (0.04 ms) runs over tp beside them, exposed as tp
    assert post["off"]["grad reduce: all-reduce (per step)"] == pytest.approx(tp_norms, rel=1e-9)
    assert st_off.exposed_s["dp"] == pytest.approx(rs.time_s + ag.time_s, rel=1e-9)
    # off by hand: the whole buffer in one call each, 4 B (fp32) reduced and 2 B (bf16) gathered: 144.71 ms
    off_hand = ndr_ring_s(2, 1, 4 * numel) + ndr_ring_s(2, 1, 2 * numel)
    assert rs.time_s + ag.time_s == pytest.approx(off_hand, rel=1e-9) and round(off_hand * 1e3, 2) == 144.71
    assert "grad reduce: reduce-scatter (per step)" not in post["on"]
    f0 = min((e for e in st_on.pipeline.events if e.stage == 0 and e.name.startswith("F0.")), key=lambda e: e.start_s)
    gather = post["on"]["param all-gather (per step)"]
    emb, layer = 129_024 * 8192 // 8, (8192 * 8192 * 2 + 8192 * 1024 * 2) // 8 + 3 * 8192 * 28672 // 8 + 2 * 8192
    assert (layer, numel) == (106_971_136, emb + 20 * layer) and on.stages[0][0] == list(range(5))
    assert emb + 5 * layer == 16 * 40_000_000 + 26_976_256 and 5 * layer == 534_855_680
    g0 = sum(r.time_s * r.per_step for r in rows_on if r.op == "all-gather" and r.size_bytes < 2 * 5 * layer)
    assert gather == pytest.approx(g0, rel=1e-9)
    # by hand on the catalog's NIC curve (tests/nccl_published.py ndr_ring_s: 47.10 GB/s per NIC): dp 2,
    # one rank a node on its own NIC, LL's 6.6 + 2.7 us + half the buffer: 16 x 858.6 us + 582.1 us = 14.32 ms
    hand = 16 * ndr_ring_s(2, 1, 2 * 40_000_000) + ndr_ring_s(2, 1, 2 * 26_976_256)
    assert gather == pytest.approx(hand, rel=1e-9) and round(hand * 1e3, 2) == 14.32
    assert gather < g_b - (f0.end_s - f0.start_s)  # what the first-bucket order would leave: 48.76 - 11.20 ms
    tail = st_on.exposed_s["dp"] - gather
    assert 0 < tail <= (s_b + tp_norms) * 5 / 20
    parts = ("compute", "bubble", "exposed tp", "exposed pp")
    # equal up to the last printed digit (shown_ms rounds the parts so that they add up to each step),
    # but for the norms' all-reduce, exposed tp when it runs after the last backward (off)
    shown_on = [float(st_on.shown_ms()[k]) for k in parts]
    assert shown_on == pytest.approx([float(st_off.shown_ms()[k]) - (k == "exposed tp") * tp_norms * 1e3
                                      for k in parts], abs=0.0101)
    assert st_off.step_s - st_on.step_s == pytest.approx(st_off.exposed_s["dp"] + tp_norms - st_on.exposed_s["dp"],
                                                         rel=1e-9)
    # off: 144.76 ms while the norms' tp all-reduce was counted as dp; on: 47.33 ms with the first-bucket
    # order's 37.58 ms of gather, 47.33 - 37.58 + 14.32 (48.76 x 0.2936) = 24.07 ms with chunk 0's share of
    # 57 equal buckets; with chunks 1-3 one bucket each (G_b 48.76 -> 48.42 ms, the larger calls nearer the
    # bus bandwidth) chunk 0's 17 buckets' own 14.32 ms + the reduce-scatters' tail 9.67 ms (9.75 before);
    # the import plans Megatron Core since 2026-12 (megatron_runtime "core"): the last backward unit no
    # longer carries 2022's two backward-compute timer syncs (2 x 4.7 us issue floors,
    # compute/megatron_core.py item 3), so it ends 9.4 us earlier and the tail is 9.67 + 0.0094 = 9.68 ms
    assert (round(gather * 1e3, 2), round(tail * 1e3, 2)) == (14.32, 9.68)
    assert (round(st_off.exposed_s["dp"] * 1e3, 2), round(st_on.exposed_s["dp"] * 1e3, 2)) == (144.71, 24.00)


@pytest.mark.parametrize("training, words", [
    ({"overlap_grad_reduce": True}, "overlap_grad_reduce is Megatron-LM's --overlap-grad-reduce (framework "
                                    "\"megatron\"); framework 'torch' overlaps its reductions as its runtime does"),
    ({"framework": "megatron", "sharding": "zero3", "overlap_grad_reduce": True},
     "sharding 'zero3' runs Megatron FSDP, which forces both on: remove it"),
    ({"framework": "megatron", "sharding": "zero1", "overlap_param_gather": True},
     "overlap_param_gather needs overlap_grad_reduce and sharding \"zero1\""),
    ({"framework": "megatron", "sharding": "none", "overlap_grad_reduce": True, "overlap_param_gather": True},
     "overlap_param_gather needs overlap_grad_reduce and sharding \"zero1\"")])
def test_megatron_overlap_keys_where_megatron_has_no_such_flag_are_refused(training, words):
    with pytest.raises(ConfigError, match="^training: ") as e:
        _cfg("llama3-8b", 1, {"global_batch": 8, "seq_len": 4096, **training}, {"names": ["dp"], "shape": [8]})
    assert words in str(e.value) and len(str(e.value).splitlines()) == 1


MEGATRON_8B = Path(__file__).parents[1] / "examples" / "megatron_llama3-8b_16xh100_tp2-pp2.args"


def _import_8b(tmp_path, extra: str, drop: str = ""):
    f = tmp_path / "args"
    f.write_text(MEGATRON_8B.read_text().replace(drop, "") + extra + "\n")
    return load_any(f, "megatron", ImportOptions(cluster="dgx-h100", nodes=2))


def test_ddp_bucket_size_sets_the_buckets_by_hand(tmp_path):
    """``--ddp-bucket-size 100000000`` (Megatron-LM arguments.py:3125 at d98e8a6,
    DistributedDataParallelConfig.bucket_size, used under --overlap-grad-reduce) on the 8B
    example (zero1, --overlap-grad-reduce, tp 2, pp 2, dp 4): a stage-0 rank's 2,007,629,824
    gradient elements (16 layers x (218,103,808 / 2 + 8,192) + the embedding 128,256 x 4,096 / 2)
    go in 20 buckets of 1e8 and one of 7,629,824, fp32: reduce-scatters of 400,000,000 B x 20
    and 30,519,296 B; Megatron-LM's default, max(40e6, 1e6 x 4) = 4e7, makes 50 of 4e7 and the
    same rest. The export writes the flag back; it reads back the same."""
    numel = 16 * (218_103_808 // 2 + 8_192) + 128_256 * 4_096 // 2
    assert numel == 2_007_629_824
    cfg = _import_8b(tmp_path, "--ddp-bucket-size 100000000")
    assert cfg.memory.grad_bucket_elements == 100_000_000 and not any("ddp-bucket" in n for n in cfg.notes)
    for c, size, full in ((cfg, 100_000_000, 20), (_import_8b(tmp_path, ""), 40_000_000, 50)):
        rows = [r for r in build_plan(c).stage(0).collectives if r.axis == "dp" and r.op == "reduce-scatter"]
        assert sorted((r.size_bytes, r.per_step) for r in rows) == [(4 * (numel - full * size), 1), (4 * size, full)]
    assert "--ddp-bucket-size 100000000" in write(cfg)
    assert _lost(_header(cfg)) == []
    assert not any(f.startswith("--ddp-bucket-size") for f in write(_import_8b(tmp_path, "")))


@pytest.mark.parametrize("extra, drop, words", [
    ("--ddp-bucket-size 100000000", "--overlap-grad-reduce", "without --overlap-grad-reduce Megatron-LM's DDP "
     "ignores it"),
    ("--ddp-bucket-size 100000000 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params", "",
     "Megatron FSDP (zero3) makes each transformer layer one FSDP unit whatever the size"),
    # Megatron FSDP's switch before NVIDIA/Megatron-LM af28b5a (2025-08), the same run
    ("--ddp-bucket-size 100000000 --use-custom-fsdp --data-parallel-sharding-strategy optim_grads", "",
     "Megatron FSDP (zero2) makes each transformer layer one FSDP unit whatever the size")])
def test_ddp_bucket_size_where_megatron_does_not_bucket_by_it_is_a_note(tmp_path, extra, drop, words):
    """Megatron-LM d98e8a6: without --overlap-grad-reduce its DDP resolves the size to None
    (training.py resolve_ddp_bucket_size); under Megatron FSDP each TransformerLayer is one
    FSDP unit and the size only buckets the parameters outside the layers
    (param_and_grad_buffer.py _get_parameter_groups), which meshplan plans as one root unit: the
    note says the flag is not planned (DDP) or ignored (FSDP), and the plan is the same as
    without it (the same dp/fsdp collectives on stage 0)."""
    cfg = _import_8b(tmp_path, extra, drop)
    assert cfg.memory.grad_bucket_elements is None
    (note,) = [n for n in cfg.notes if "--ddp-bucket-size" in n]
    fsdp = "fsdp" in extra
    assert note.startswith(f"megatron: --ddp-bucket-size 100000000 {'ignored' if fsdp else 'not planned'}: ") \
        and words in note, note
    assert cfg.training.sharding == ("zero3" if "params" in extra else "zero2" if fsdp else "zero1")
    without = _import_8b(tmp_path, extra.replace("--ddp-bucket-size 100000000 ", ""), drop)
    rows = [sorted((r.axis, r.op, r.size_bytes, r.per_step) for r in build_plan(c).stage(0).collectives
                   if r.axis in ("dp", "dp_shard", "fsdp")) for c in (cfg, without)]
    assert rows[0] == rows[1] and rows[0]
