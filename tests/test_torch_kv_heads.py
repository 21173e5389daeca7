"""Tensor parallelism past the KV heads under framework torch (issue ttmoe, rule ``torch_kv_heads``):
torchtitan b5bcd76 shards wk/wv colwise over tp and views each rank's slice as whole heads
(``torchtitan/models/common/decoder_sharding.py``:182-192, ``attention.py``:698-705), so Llama-3-70B
(8 KV heads) at tp 16 leaves each rank half a head: infeasible under torch (before: planned with
``kv_replica`` copies), planned as Megatron-LM's QKV sub-sharding under megatron, and refused by
``export --to torchtitan`` of that megatron plan."""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import FORMATS, ImportOptions
from meshplan.interop.export import export
from meshplan.interop.foreign import load_any
from meshplan.plan import Plan, build_plan
from meshplan.plan_runtime import export_refusals

REASON = ("framework torch: tp 16 with kv_heads 8: torchtitan shards wk/wv colwise over tp and views each rank's "
          "slice as whole KV heads (b5bcd76 decoder_sharding.py:182-192, attention.py:698-705); it replicates no "
          "KV head; fix: tp 1, 2, 4 or 8 (a divisor of kv_heads 8)")


def _cfg(tp: int, framework: str):
    return config_from_dict({"model": {"catalog": "llama3-70b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
                             "training": {"global_batch": 64, "seq_len": 8192, "micro_batch": 1, "recompute": "full",
                                          "framework": framework},
                             "mesh": {"names": ["dp_shard" if framework == "torch" else "dp", "tp"],
                                      "shape": [32 // tp, tp], "sequence_parallel": True}})


def test_llama3_70b_tp16_is_infeasible_under_torch_only():
    """tp 16 (a multiple of the 8 KV heads): torch gives the rule's one reason with its fix;
    megatron plans Megatron-LM's QKV sub-sharding (no copies, no kv_replica row: per layer an
    all-gather over the tp group of 16 of the fused QKV output, b 1 x s 8192 x (64 + 16) x 128 x
    2 B = 167,772,160 B); tp 8 divides the KV heads and is feasible under torch."""
    torch16 = build_plan(_cfg(16, "torch"))
    assert not isinstance(torch16, Plan)
    assert torch16.reasons == (REASON + ", or training.framework = \"megatron\" (Megatron-LM runs tp > kv_heads)",)
    assert not any("KV heads replicated" in n for n in torch16.notes)  # no copies under torch
    mega = build_plan(_cfg(16, "megatron"))
    assert isinstance(mega, Plan)
    assert not [r for r in mega.stage(0).collectives if r.axis == "kv_replica"]
    qkv = [(r.phase, r.op, r.group_size, r.n_groups, r.size_bytes) for r in mega.stage(0).collectives
           if "QKV sub-sharding" in r.cadence]
    assert qkv[:2] == [("forward", "all-gather", 16, 2, 8192 * 80 * 128 * 2),
                       ("backward", "reduce-scatter", 16, 2, 8192 * 80 * 128 * 2)]
    assert any(n.startswith("kv_heads 8 < tp 16: Megatron-LM's QKV sub-sharding") for n in mega.notes)
    assert isinstance(build_plan(_cfg(8, "torch")), Plan)


def test_torchtitan_job_at_tp16_plans_infeasible(tmp_path):
    """A torchtitan job TOML of llama3 70B with tensor_parallel_degree 16 imports (the degrees
    are read as written) and its plan is infeasible with the rule's reason."""
    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "llama3"\nflavor = "70B"\n[training]\nlocal_batch_size = 1\nseq_len = 8192\n'
                   '[parallelism]\ndata_parallel_shard_degree = -1\ntensor_parallel_degree = 16\n'
                   '[activation_checkpoint]\nmode = "full"\n')
    plan = build_plan(load_any(job, opts=ImportOptions(cluster="dgx-h100", nodes=4)))
    assert not isinstance(plan, Plan) and plan.reasons[0].startswith(REASON)


def test_export_of_the_megatron_plan_to_torchtitan_is_refused():
    """The megatron plan at tp 16 is refused by ``export --to torchtitan`` with the rule's
    reason (without its megatron fix) and what is refused (``export_refusals``, what the CLI
    passes); the same plan at tp 8 is not refused."""
    cfg = _cfg(16, "megatron")
    assert export_refusals(cfg, "torchtitan") == (f"{REASON}: torchtitan's runtime refuses tp past the KV heads",)
    assert export_refusals(_cfg(8, "megatron"), "torchtitan") == ()
    with pytest.raises(ConfigError) as e:
        export(cfg, "torchtitan", "x", refused={t: export_refusals(cfg, t) for t in FORMATS})
    assert str(e.value).startswith(f"--to: {REASON}: torchtitan's runtime refuses tp past the KV heads; export --to")
