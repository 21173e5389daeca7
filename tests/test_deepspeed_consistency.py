"""A meshplan TOML under DeepSpeed's engines and the DeepSpeed JSON of the same run plan alike
(DeepSpeed read at deepspeedai/DeepSpeed edaa722), and what DeepSpeed refuses is refused."""

from __future__ import annotations

import json

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export, reimport_options
from meshplan.interop.foreign import load_any
from meshplan.plan import Plan, build_plan
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.steptime import step_time

#: Llama 3 8B's parameters: embedding and output 2 x 128256 x 4096, 32 layers of 218,112,000
#: (test_interop's zero3 test), the final norm 4096.
LLAMA3_8B = 2 * 128256 * 4096 + 32 * 218_112_000 + 4096


def _toml(sharding: str, **training) -> dict:
    return {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
            "training": {"global_batch": 32, "seq_len": 4096, "sharding": sharding, "zero12_engine": "deepspeed",
                         "recompute": "none"} | training,
            "mesh": {"names": ["dp_shard"], "shape": [16]}}


def _peak_and_step(cfg) -> tuple[float, float]:
    p = build_plan(cfg)
    assert isinstance(p, Plan) and p.feasible, p.reasons
    return p.timeline.peak.total_bytes, step_time(p, Overlap()).step_s


@pytest.mark.parametrize("sharding", ["zero1", "zero2"])
def test_a_toml_and_its_deepspeed_json_plan_the_same_gradients(tmp_path, sharding):
    """``grad_dtype`` unset under ``zero12_engine = "deepspeed"`` is DeepSpeed's: the model's
    bf16 (``deepspeed_grad_dtype``: stage 2's ``grads_in_partition`` in ``self.dtype``, stage 1's
    ``param.grad`` without ``grad_accum_dtype``), as the JSON reader sets it; fp32 before, so the
    TOML planned 2 B more per gradient element than its own DeepSpeed JSON."""
    cfg = config_from_dict(_toml(sharding))
    assert cfg.training.grad_dtype == "bf16"
    text, header = export(cfg, "deepspeed", "x")
    assert not [h for h in header if h.startswith("not expressed")], header
    assert "data_types" not in json.loads(text)
    path = tmp_path / "ds.json"
    path.write_text(text)
    back = load_any(path, "deepspeed", reimport_options(cfg, "deepspeed"))
    assert back.training.grad_dtype == "bf16"
    peak, step = _peak_and_step(cfg)
    assert _peak_and_step(back) == (pytest.approx(peak, rel=1e-12), pytest.approx(step, rel=1e-12))
    if sharding == "zero1":  # a given grad_dtype stays: fp32 with bf16 at stage 1 is DeepSpeed's BF16_Optimizer
        # (38327e0 engine.py:1316-1318), which keeps fp32 gradients (+2 B x 8.03e9 over ZeRO-1's bf16 ones) and
        # the bf16 param.grad beside them (+2 B x 8.03e9), and holds no ZeRO-1 ipg buffer nor backward bucket
        # (5e8 x 2 B each, 2e9 B at ZeRO-1's peak, the backward of the head); activations and temporaries alike
        fp32 = config_from_dict(_toml(sharding, grad_dtype="fp32"))
        assert fp32.training.grad_dtype == "fp32" and fp32.training.bf16_optimizer
        assert build_plan(fp32).timeline.peak.total_bytes - peak == 4 * LLAMA3_8B - 2 * 500_000_000 * 2


def test_fp16_with_fp32_accumulation_at_stage_1_round_trips(tmp_path):
    """fp16 at ZeRO-1 with ``data_types.grad_accum_dtype = "fp32"``: ``param.grad_accum`` in fp32
    (the one mix its ZeRO-1 engine runs): the reader and a TOML naming it agree, and export writes
    the key back."""
    cfg = config_from_dict(_toml("zero1", param_dtype="fp16", compute_dtype="fp16", grad_dtype="fp32"))
    text, _ = export(cfg, "deepspeed", "x")
    assert json.loads(text)["data_types"] == {"grad_accum_dtype": "fp32"}
    path = tmp_path / "ds.json"
    path.write_text(text)
    assert load_any(path, "deepspeed", reimport_options(cfg, "deepspeed")).training.grad_dtype == "fp32"
    assert config_from_dict(_toml("zero1", param_dtype="fp16", compute_dtype="fp16")).training.grad_dtype == "fp16"


OPTS = ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096)
BASE = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}


@pytest.mark.parametrize("bf16_key", ["bf16", "bfloat16"])
def test_bf16_and_fp16_both_enabled_is_refused(tmp_path, bf16_key):
    """DeepSpeed asserts ``not (fp16.enabled and bf16.enabled)`` (runtime/config.py:827-828 at
    edaa722): one line naming both fields and the fix."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BASE | {bf16_key: {"enabled": True}, "fp16": {"enabled": True}}))
    with pytest.raises(ConfigError) as err:
        load_any(path, opts=OPTS)
    assert str(err.value) == (f"{bf16_key}.enabled: and fp16.enabled are both true, which DeepSpeed refuses "
                              "('bfloat16 and fp16 modes cannot be simultaneously enabled', runtime/config.py); set "
                              "one of them to false")
    assert "\n" not in str(err.value)
    path.write_text(json.dumps(BASE | {bf16_key: {"enabled": True}, "fp16": {"enabled": False}}))
    assert load_any(path, opts=OPTS).training.param_dtype == "bf16"


def _zero3(engine: str) -> dict:
    return {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
            "training": {"global_batch": 32, "seq_len": 4096, "sharding": "zero3", "zero3_engine": engine,
                         "param_dtype": "bf16", "grad_dtype": "bf16", "grad_reduce_dtype": "bf16", "recompute": "none"},
            "mesh": {"names": ["dp_shard"], "shape": [16]}}


def test_deepspeed_zero3_copies_run_on_its_collective_streams():
    """DeepSpeed's ZeRO-3 (``zero3_engine = "deepspeed"``, edaa722) copies on its all-gather
    stream (``partitioned_param_coordinator.py:400-415``) only the part of a layer its coordinator
    prefetched, ``torch.cat`` in ``AllGatherCoalescedHandle.wait`` (``partition_parameters.py:750-784``);
    the rest is gathered parameter by parameter, the parameters views of the buffer
    (``_all_gather_sequential``, :1339-1376), no copy. It copies each gradient into its reduce bucket
    on ``reduce_and_partition_stream`` (``stage3.py:1541-1560``). Both added to the collectives'
    time, not the compute stream's. Llama 3 8B's layer (218,112,000 bf16 elements, 436.2 MB
    gathered) after a layer's fetch: prefetched min(1e9 x 2 B - 436,224,000 B, 5e7 x 2 B) = 1e8 B,
    copy-out 2 x 1e8 B at the H100's Triad 2.97 TB/s = 67.3 us (FSDP2's 2 x 436.2 MB: 293.8 us);
    copy-in 218,112,000 x (2 + 2) B = 872.4 MB, 293.8 us. The step's compute loses every FSDP2
    copy (the note's ms per step). (nc52fixC: the cross-node rings hold 16 of the H100's 132 SMs while
    they run, row_shares.nccl_net_channels, and slow the kernels beside them: the compute part is the
    kernels' own seconds plus that SM contention, which differs between the two (FSDP2 38.14 ms, DeepSpeed
    31.29 ms, read from the model: FSDP2's copies are kernels on the compute stream beside the rings,
    slowed too, where DeepSpeed's lie in its collectives' time). So the copies are the difference of the
    compute less each side's contention: 70.32 - (38.14 - 31.29) = 63.48 ms. With nc52d's DeepSpeed
    reduce-scatters per ipg bucket of 5e8 elements (fewer and larger, less time beside the compute),
    DeepSpeed's contention is 31.10 ms (read from the model) and its compute 747.50 ms: 818.02 - 747.50
    = 70.51 ms, less 38.14 - 31.10 = 7.04 ms, 63.48 ms again.)"""
    fsdp2, ds = (build_plan(config_from_dict(_zero3(e)), memory=False) for e in ("fsdp2", "deepspeed"))
    rows = {e: {(r.axis, r.phase, r.op, r.cadence): r for r in p.collectives["stage 0"]}
            for e, p in (("fsdp2", fsdp2), ("deepspeed", ds))}
    layer = 2 * 218_112_000  # torchtitan's end units under FSDP2 and DeepSpeed alike: the layers compared
    keys = [k for k in rows["fsdp2"] if k[3] == "every layer"]
    assert len(keys) == 3 and keys[:2] == [k for k in rows["deepspeed"] if k[3] == "every layer"]
    # DeepSpeed reduce-scatters per ipg bucket of 5e8 elements across layers (nc52d,
    # comm/deepspeed_ipg.py): its buckets hold the layers' gradients, 32 x 436,224,000 B a micro-batch
    ipg = [r for k, r in rows["deepspeed"].items() if k[2] == "reduce-scatter" and "ipg bucket" in k[3]]
    assert sum(r.size_bytes * r.per_microbatch for r in ipg) == layer * rows["fsdp2"][keys[2]].per_microbatch
    triad = 2.97e12  # the H100's BabelStream Triad, the catalog's (fsdp2.copy_out_seconds' doctest)
    for key in keys[:2]:
        r, d = rows["fsdp2"][key], rows["deepspeed"][key]
        assert d.copy_s == 0.0 and d.size_bytes == r.size_bytes == layer and d.per_step == r.per_step
        assert round(r.copy_s * 1e6, 1) == 293.8
        copied = 2 * 10**8 / triad  # torch.cat
        assert d.time_s == pytest.approx(r.time_s + copied, rel=1e-3)
    gather = rows["deepspeed"][keys[0]]
    assert round((gather.time_s - rows["fsdp2"][keys[0]].time_s) * 1e6, 1) == 67.3
    # the step's first fetch, the embedding's in forward, is prefetched by nothing: no copy-out
    emb = {k[1]: rows["deepspeed"][k].time_s - rows["fsdp2"][k].time_s for k in rows["deepspeed"]
           if k[2] == "all-gather" and k[3] == "per root (embedding)"}
    assert round(emb["forward"] * 1e6, 1) == 0.0 and round(emb["backward"] * 1e6, 1) == 67.3
    assert not [r for r in ds.collectives["stage 0"] if r.copy_s]
    copies = sum(r.copy_s * r.per_step for r in fsdp2.collectives["stage 0"])
    a, b = step_time(fsdp2), step_time(ds)
    own = [x.parts_s()["compute"] - x.contention_s() for x in (a, b)]   # the kernels' own seconds
    assert own[0] - own[1] == pytest.approx(copies, rel=1e-9)
    assert [round(x.contention_s() * 1e3, 2) for x in (a, b)] == [38.14, 31.10]
    assert copies > 0.06  # ~63.5 ms a step on this mesh
    assert any(n.startswith("FSDP2 copies on the compute stream") for n in a.notes)
    assert not any("FSDP2" in n for n in b.notes)
    text = "\n".join(b.lines())
    assert "exposed ZeRO data-parallel" in text and "exposed fsdp" not in text


def test_deepspeed_zero3_copies_out_what_the_memory_model_prefetches():
    """The step's copy-out and the memory timeline's prefetched part are one quantity
    (:func:`meshplan.spec.deepspeed_memory.deepspeed_copied_bytes`): with ``stage3_max_live_parameters``
    2.5e8 (``[memory] deepspeed_max_live_elements``) a layer prefetches (2.5e8 - 218,112,000) x 2 B
    = 63,776,000 B run on to the end of wo, the parameter that reaches it (coordinator :457; norm
    8,192 + wq 33,554,432 + wk, wv 2 x 8,388,608 + wo 33,554,432): 83,894,272 B, the memory model's
    'copied out of the buffer (torch.cat)' event and the all-gather row's copy, 2 x 83,894,272 B at
    Triad 2.97 TB/s = 56.5 us more than with 2e8 (below one layer: nothing prefetched, no
    copy-out). (63,776,000 B and 42.9 us before the run past max live was modelled.)"""
    def plan(live: int):
        data = _zero3("deepspeed") | {"memory": {"deepspeed_max_live_elements": live}}
        return build_plan(config_from_dict(data))

    def gather_s(p) -> float:
        return next(r.time_s for r in p.collectives["stage 0"]
                    if r.phase == "forward" and r.op == "all-gather" and r.cadence == "every layer")

    some, none = plan(250_000_000), plan(200_000_000)
    cat = [e.delta_bytes for e in some.timeline.events() if e.phase == "forward" and e.microbatch == 0
           and e.layer == 6 and "(torch.cat)" in e.label]
    assert cat == [83_894_272]
    assert not [e for e in none.timeline.events() if "(torch.cat)" in e.label and e.layer == 6]
    assert round((gather_s(some) - gather_s(none)) * 1e6, 1) == round(2 * 83_894_272 / 2.97e12 * 1e6, 1) == 56.5


def test_deepspeed_zero3_json_and_search_rows_run_deepspeeds_engine(tmp_path):
    """A DeepSpeed stage 3 JSON imports to ``zero3_engine = "deepspeed"`` (not FSDP2) and exports back
    unchanged; a DeepSpeed ZeRO-2 config's search plans its zero3 rows with that engine too, pp 1,
    resharded (its pipeline engine refuses ZeRO-3; reshard_after_forward is FSDP2's)."""
    from meshplan.search.space import SHARDING, candidate_config, enumerate_candidates

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 1,
                                "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    cfg = load_any(path, opts=OPTS)
    t = cfg.training
    assert (t.zero3_engine, t.grad_dtype, t.gradient_reduce_dtype) == ("deepspeed", "bf16", "bf16")
    text, header = export(cfg, "deepspeed", "x")
    assert not [h for h in header if h.startswith("not expressed")], header
    cfg2 = config_from_dict(_toml("zero2") | {"search": {"pp": [1, 2], "dp_replicate": [1], "cp": [1], "tp": [1],
                                                         "sharding": ["zero2", "zero3"], "micro_batch": [1]}},
                            require_mesh=False)
    c = enumerate_candidates(cfg2)
    z3 = [i for i in range(len(c)) if SHARDING[c.sh[i]] == "zero3" and c.pp[i] == 1 and c.rf[i]]
    assert z3 and all(candidate_config(cfg2, c, i).training.zero3_engine == "deepspeed" for i in z3)

    from meshplan.search.space import first_reason, reason_table
    engine = [k for k, _ in reason_table()].index("engine")
    kept = [i for i in range(len(c)) if SHARDING[c.sh[i]] == "zero3" and c.pp[i] == 1 and not c.rf[i]]
    assert kept and all(first_reason(cfg2, c)[i] == engine for i in kept)
