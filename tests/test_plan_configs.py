"""Plans across mesh kinds: each checks values derived by hand for that configuration."""


from meshplan.plan import build_plan
from meshplan.config import config_from_dict


def plan_of(model, nodes, mesh, system="dgx-h100", **training):
    t = {"global_batch": 512, "seq_len": 8192, **training}
    return build_plan(config_from_dict({"model": model, "cluster": {"system": system, "nodes": nodes},
                                        "training": t, "mesh": mesh}))


def test_unforced_tensor_axis_is_flagged():
    # Llama-3-8B fits one GPU's share with zero3 over 64 ranks: tp 8 solves no constraint.
    p = plan_of({"catalog": "llama3-8b"}, 8, {"names": ["dp_shard", "tp"], "shape": [8, 8],
                                               "sequence_parallel": True}, param_dtype="fp32")
    assert p.feasible
    assert p.constraints.unforced == ("tp",)
    assert "solves no stated constraint" in p.constraints.axes["tp"]


def test_batch_forces_model_parallelism():
    # 64 GPUs, global batch 16: dp <= 16, so tp*pp*cp >= 4
    p = plan_of({"catalog": "llama3-8b"}, 8, {"names": ["dp_shard", "tp"], "shape": [16, 4]},
                global_batch=16, param_dtype="fp32")
    row = next(r for r in p.constraints.rows if r.kind == "compute/batch")
    assert row.requires == "tp*pp*cp >= 4"
    assert p.constraints.axes["tp"].startswith("compute/batch: tp*pp*cp >= 4")


def test_axes_optional_alone_but_one_needed_for_the_batch():
    # 64 GPUs, global batch 16: tp*pp*cp >= 4. tp 4 x pp 4: without tp 4 >= 4, without pp 4 >= 4,
    # without both 1 < 4: neither "solves no stated constraint" (as the 405B plan said of both)
    p = plan_of({"catalog": "llama3-8b"}, 8, {"names": ["pp", "dp_shard", "tp"], "shape": [4, 4, 4]},
                global_batch=16, param_dtype="fp32")
    assert p.constraints.unforced == ()
    assert p.constraints.axes["tp"] == ("compute/batch: optional alone (tp*pp*cp 4 >= 4 without it), but one of pp, "
                                        "tp is needed: without both tp*pp*cp is 1 < 4 (keep it or pp 4)")
    assert p.constraints.axes["pp"].endswith("without both tp*pp*cp is 1 < 4 (keep it or tp 4)")


def test_hsdp_megatron_order_and_groups():
    p = plan_of({"catalog": "llama3-8b"}, 4,
                {"order": "tp-dp_shard-dp_replicate", "degrees": {"tp": 4, "dp_shard": 4, "dp_replicate": 2}},
                sharding="hsdp", param_dtype="fp32")
    m = p.mesh
    assert m.layout.names == ("dp_replicate", "dp_shard", "tp")
    assert m.megatron_order == "tp-dp_shard-dp_replicate"
    assert m.group_of(5, "dp_shard") == [1, 5, 9, 13]
    assert m.group_of(5, "dp_replicate") == [5, 21]
    assert m.group_of(5, "dp") == [1, 5, 9, 13, 17, 21, 25, 29]
    assert p.micro_batches == 512 // 8
    rows = p.collectives["stage 0"]
    rep = [r for r in rows if r.axis == "dp_replicate"]
    assert rep and all(r.op == "all-reduce" for r in rep)
    # state is sharded over dp_shard only (4), not over the 8-way dp
    assert {i.divisor for i in p.state[0].items} == {4}


def test_pipeline_with_virtual_stages():
    p = plan_of({"catalog": "llama3-70b"}, 8, {"names": ["pp", "dp_shard", "tp"], "shape": [4, 2, 8],
                                                "sequence_parallel": True, "virtual_stages": 2,
                                                "pp_schedule": "interleaved_1f1b"}, param_dtype="fp32")
    assert p.feasible, p.reasons
    assert p.stages[0] == [list(range(0, 10)), list(range(40, 50))]
    assert p.stages[3] == [list(range(30, 40)), list(range(70, 80))]
    assert set(p.collectives) == {"stage 0", "stage 1", "stage 3"}  # first, a middle one, last
    send = next(r for r in p.collectives["stage 0"] if r.axis == "pp")
    assert send.size_bytes == 8192 * 8192 * 2 / 8  # b*s*h bf16 split over tp by SP
    # per micro-batch: a send for each chunk but the model's last, a receive for each but its first
    counts = {k: next(r for r in p.collectives[f"stage {k}"] if r.axis == "pp").per_microbatch for k in (0, 1, 3)}
    assert counts == {0: 3, 1: 4, 3: 3}
    assert p.micro_batches == 256


def test_interleaved_micro_batch_rule_is_the_frameworks():
    """global batch 10 over dp 2: m 5 at pp 4. Megatron-LM needs pp | m; torch 2.13 runs one
    round of 5 (its rounds max(1, 5 // 4) = 1 divide 5): no schedule reason, only memory;
    m 9 (global batch 18): two rounds, 9 odd, torch refuses too."""
    mesh = {"names": ["pp", "dp_shard", "tp"], "shape": [4, 2, 8], "virtual_stages": 2,
            "pp_schedule": "interleaved_1f1b"}
    meg = plan_of({"catalog": "llama3-70b"}, 8, mesh, global_batch=10, framework="megatron")
    assert "interleaved 1F1B needs micro-batches (5) divisible by pp (4) (Megatron-LM)" in meg.reasons
    torch5 = plan_of({"catalog": "llama3-70b"}, 8, mesh, global_batch=10)
    assert torch5.micro_batches == 5 and not any("interleaved" in r for r in torch5.reasons)
    torch9 = plan_of({"catalog": "llama3-70b"}, 8, mesh, global_batch=18)
    assert not torch9.feasible
    assert ("interleaved 1F1B needs micro-batches (9) a multiple of torch's rounds max(1, m // pp 4) = 2 "
            "(torch ScheduleInterleaved1F1B)") in torch9.reasons


def test_1f1b_with_fewer_micro_batches_than_stages():
    """m 8 at pp 16 (global batch 8, dp 1): torch's Schedule1F1B refuses it (a reason, not
    an error); Megatron-LM's 1F1B runs it."""
    mesh = {"names": ["pp", "tp"], "shape": [16, 4], "pp_schedule": "1f1b"}
    p = plan_of({"catalog": "llama3-70b"}, 8, mesh, global_batch=8)
    assert p.micro_batches == 8 and not p.feasible
    assert "1F1B needs micro-batches (8) >= pp (16) (torch Schedule1F1B)" in p.reasons
    meg = plan_of({"catalog": "llama3-70b"}, 8, mesh, global_batch=8, framework="megatron")
    assert not any("1F1B needs" in r for r in meg.reasons)


def test_context_parallel_rows_and_seq_check():
    p = plan_of({"catalog": "llama3-8b"}, 4, {"names": ["dp_shard", "cp", "tp"], "shape": [4, 2, 4],
                                               "sequence_parallel": True}, param_dtype="fp32", cp_attention="allgather")
    cp = [r for r in p.collectives["stage 0"] if r.axis == "cp"]
    # K and V of the full sequence: 2 * s * kv_local(8/4=2) * 128 * 2 bytes (all-gather CP)
    assert [r.op for r in cp] == ["all-gather", "reduce-scatter"]
    assert cp[0].size_bytes == 2 * 8192 * 2 * 128 * 2
    # torch's ring (cp_attention unset under framework torch): K and V at the heads the SDPA reads, by default
    # the 8 / tp 4 = 2 KV heads ([memory] kv_expanded false, enable_gqa; 32 / tp 4 = 8 q heads after repeat_kv):
    # 8192 x 2 x (128 + 128) x 2 B gathered, the same as all-gather CP's; each fp32 dK/dV shift of the 8192 / cp 2
    # local tokens
    ring = plan_of({"catalog": "llama3-8b"}, 4, {"names": ["dp_shard", "cp", "tp"], "shape": [4, 2, 4],
                                                  "sequence_parallel": True}, param_dtype="fp32")
    cp = [r for r in ring.collectives["stage 0"] if r.axis == "cp"]
    assert [(r.op, r.size_bytes) for r in cp] == [("all-gather", 8192 * 2 * 256 * 2)] * 2 + [
        ("send/recv", 8192 // 2 * 2 * 256 * 4)] * 2
    assert p.mesh.group_of(0, "fsdp") == [0, 4, 8, 12, 16, 20, 24, 28]
    bad = plan_of({"catalog": "llama3-8b"}, 4, {"names": ["dp_shard", "cp", "tp"], "shape": [4, 2, 4]},
                  seq_len=8190, global_batch=8)
    assert "seq_len 8190 is not divisible by 2 * cp (4) for load-balanced causal CP" in bad.reasons


def test_tensor_across_nodes_is_flagged():
    p = plan_of({"catalog": "llama3-70b"}, 2, {"names": ["tp", "dp_shard"], "shape": [8, 2]},
                global_batch=16)
    errs = [f for f in p.flags if f.axis == "tp" and f.severity == "fault"]
    assert errs and "every layer" in errs[0].message
