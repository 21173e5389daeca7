"""torch without torch.compile runs its elementwise ops one kernel each (compute/torch_eager.py):
the layer's op list, the head's cross entropy, the torchtitan [compile] table and the step.

Llama 3 8B on one H100 rank, 8,192 tokens (one sequence), bf16: gate activation A = 8192 x
14336 = 117,440,512 elements; q = 8192 x 32 x 128 = 33,554,432 elements, k = 8192 x 8 x 128 =
8,388,608; logits 8192 x 128,256 = 1,050,673,152.
"""

from pathlib import Path

from dataclasses import replace

import pytest

from meshplan import catalog
from meshplan.compute.embed_head import head_cost
from meshplan.compute.layer import layer_cost
from meshplan.compute.ops import Workload
from meshplan.compute.kernel_choices import framework_kernels
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.torchtitan import read
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.spec.training import TrainingSpec

A, Q, K, LOGITS = 8192 * 14336, 8192 * 32 * 128, 8192 * 8 * 128, 8192 * 128256
LLAMA, H100 = catalog.model("llama3-8b"), catalog.gpu("h100-sxm5-80gb")


def _bytes(cost, phase):
    return {o.name: o.size_bytes for o in cost.ops if o.phase == phase and o.kind == "memory" and not o.recompute}


def _work(eager: bool) -> Workload:
    return Workload(seq_len=8192, micro_batch=1, recompute="none", attention_kernels=("FA2",), torch_eager=eager)


def test_eager_layer_kernels_by_hand():
    fused, eager = layer_cost(LLAMA, H100, _work(False)), layer_cost(LLAMA, H100, _work(True))
    f, e = _bytes(fused, "forward"), _bytes(eager, "forward")
    assert f["silu x up"] == 6 * A and "silu" not in f                       # one fused kernel: 2 in, 1 out
    assert (e["silu"], e["silu x up"]) == (4 * A, 6 * A)                      # silu; then the multiply
    assert f["rope"] == 4 * (Q + K)
    # eager: per tensor upcast (2 + 4), complex multiply (4 + 4), downcast (4 + 2); q's ops then k's
    rope = [(o.name, o.size_bytes) for o in eager.ops if o.phase == "forward" and o.name.startswith("rope")]
    assert rope == [("rope upcast", 6 * Q), ("rope complex mul", 8 * Q), ("rope downcast", 6 * Q),
                    ("rope upcast", 6 * K), ("rope complex mul", 8 * K), ("rope downcast", 6 * K)]
    # no repeat_kv by default ([memory] kv_expanded false: the SDPA takes the 8 KV heads, enable_gqa)
    assert "repeat_kv" not in f and "repeat_kv" not in e
    # with kv_expanded (32 q heads over 8 KV heads) in both: K and V each read once, written 4 times
    fx, ex = (_bytes(layer_cost(LLAMA, H100, replace(_work(eager), kv_expanded=True)), "forward") for eager in (False, True))
    assert fx["repeat_kv"] == ex["repeat_kv"] == 2 * 2 * (K + Q)
    b = _bytes(eager, "backward_input")
    assert (b["silu grad"], b["silu x up grad"]) == (6 * A, 12 * A)
    assert _bytes(fused, "backward_input")["silu x up"] == 10 * A
    # everything else is the same op list
    same = lambda c: [(o.name, o.phase) for o in c.ops if not o.name.startswith(("rope", "silu"))]
    assert same(fused) == same(eager)
    assert eager.forward_s > fused.forward_s and eager.backward_s > fused.backward_s


def test_eager_cross_entropy_by_hand():
    fused, eager = head_cost(LLAMA, H100, _work(False)), head_cost(LLAMA, H100, _work(True))
    assert _bytes(fused, "forward")["cross entropy"] == 6 * LOGITS
    assert _bytes(fused, "backward_input")["cross entropy"] == 6 * LOGITS
    f = _bytes(eager, "forward")
    assert f == {"final norm": 2 * 2 * 8192 * 4096, "logits upcast": 6 * LOGITS, "log_softmax": 8 * LOGITS}
    b = _bytes(eager, "backward_input")
    assert (b["nll_loss grad"], b["log_softmax grad"], b["logits upcast grad"]) == (4 * LOGITS, 12 * LOGITS,
                                                                                   6 * LOGITS)


def test_framework_and_compile_set_eager():
    kernels = lambda **kw: framework_kernels(TrainingSpec(global_batch=8, seq_len=16, **kw))["torch_eager"]
    assert kernels() is True
    assert kernels(torch_compile=True) is False
    assert kernels(framework="megatron") is False
    with pytest.raises(ValueError, match="torch_compile is torch.compile of a torch model"):
        TrainingSpec(global_batch=8, seq_len=16, framework="megatron", torch_compile=True)


def _titan(compile_table: dict | None):
    d = {"model": {"name": "llama3", "flavor": "8B"}, "training": {"local_batch_size": 1, "seq_len": 8192},
         "parallelism": {"data_parallel_shard_degree": -1}}
    if compile_table is not None:
        d["compile"] = compile_table
    return read(d, Path("."), ImportOptions(cluster="dgx-h100", nodes=1))


def test_torchtitan_compile_table():
    assert _titan(None).tables["training"]["torch_compile"] is False
    assert _titan({"enable": True}).tables["training"]["torch_compile"] is True
    assert _titan({"enable": False, "components": ["model"]}).tables["training"]["torch_compile"] is False
    half = _titan({"enable": True, "components": ["loss"]})
    assert half.tables["training"]["torch_compile"] is False
    assert any("compile.components ['loss']" in n and "planned eager" in n for n in half.notes)
    assert "compile.enable" not in _titan({"enable": True}).unused
    with pytest.raises(ConfigError, match="compile.enable: 'yes'; use true or false"):
        _titan({"enable": "yes"})


def test_uncompiled_step_is_longer():
    """The torchtitan example's mesh (FSDP2 over 8 H100, Llama 3 8B, op-level SAC): eager runs
    longer than compiled by at least its extra forward bytes at Triad (32 layers)."""
    base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 8, "seq_len": 8192, "micro_batch": 1, "param_dtype": "fp32",
                         "recompute": "op"},
            "mesh": {"names": ["dp_shard"], "shape": [8]}}
    steps = {}
    for c in (False, True):
        cfg = config_from_dict(base | {"training": base["training"] | {"torch_compile": c}})
        steps[c] = step_time(build_plan(cfg)).step_s
    extra_fwd = 32 * (2 * 2 * A + 16 * (Q + K)) / 2.97e12      # silu apart, RoPE's fp32 casts: forward only
    assert steps[False] - steps[True] > extra_fwd


def test_async_tp_needs_compile():
    """torchtitan's parallelize raises "Async TP requires torch.compile": its
    enable_async_tensor_parallel without [compile] enable is refused at import, a meshplan config
    with tp_comm_overlap under torch without torch_compile too, and the search leaves the overlap
    off there (tests/test_search_explain.py)."""
    def titan(par: dict, compile_table: dict | None):
        d = {"model": {"name": "llama3", "flavor": "8B"}, "training": {"local_batch_size": 1, "seq_len": 8192},
             "parallelism": {"data_parallel_shard_degree": -1, "tensor_parallel_degree": 2} | par}
        if compile_table is not None:
            d["compile"] = compile_table
        return read(d, Path("."), ImportOptions(cluster="dgx-h100", nodes=1))
    with pytest.raises(ConfigError, match="^parallelism.enable_async_tensor_parallel: torchtitan raises \"Async TP "
                                          "requires torch.compile\" without \\[compile\\] enable = true"):
        titan({"enable_async_tensor_parallel": True}, None)
    t = titan({"enable_async_tensor_parallel": True}, {"enable": True}).tables["training"]
    assert t["tp_comm_overlap"] and t["torch_compile"]
    assert TrainingSpec(global_batch=8, seq_len=16, tp_comm_overlap=True, framework="megatron").tp_comm_overlap
    with pytest.raises(ValueError, match="needs torch.compile"):
        TrainingSpec(global_batch=8, seq_len=16, tp_comm_overlap=True)


def test_torchtitan_ddp_beside_tp_and_unknown_converters():
    """torchtitan's parallelize raises "DDP has not supported > 1D parallelism" for a replicated,
    unsharded model beside pp or tp: refused at import and at export; a converter meshplan does
    not model is named in a note, not dropped silently."""
    def titan(par: dict, model: dict | None = None):
        d = {"model": {"name": "llama3", "flavor": "8B"} | (model or {}),
             "training": {"local_batch_size": 8, "seq_len": 8192}, "parallelism": par}
        return read(d, Path("."), ImportOptions(cluster="dgx-h100", nodes=1))
    with pytest.raises(ConfigError, match="^parallelism.data_parallel_replicate_degree: replicated without sharding "
                                          "\\(DDP\\) beside pp or tp: torchtitan raises"):
        titan({"data_parallel_replicate_degree": 4, "data_parallel_shard_degree": 1, "tensor_parallel_degree": 2})
    assert titan({"data_parallel_replicate_degree": 8, "data_parallel_shard_degree": 1}).tables["training"][
        "sharding"] == "none"
    notes = titan({"data_parallel_shard_degree": -1}, {"converters": ["quantize.linear.mx"]}).notes
    assert "model.converters ['quantize.linear.mx']: not modelled (meshplan models the float8 Linear converter " \
           "'quantize.linear.float8' only); planned without it" in notes
    from meshplan.interop.torchtitan_write import write
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 8192, "sharding": "none"},
                            "mesh": {"names": ["dp_replicate", "tp"], "shape": [4, 2], "sequence_parallel": True}})
    with pytest.raises(ConfigError, match="^--to: DDP \\(sharding none\\) beside pp or tp"):
        write(cfg)


def test_torchtitan_accumulation_under_pp_is_planned_as_schedule_runs():
    """global 32 = 4 x local 2 x dp 4 with pp 2: torchtitan runs the 1F1B schedule 4 times (2
    micro-batches each, one schedule.step() per accumulation step): training.pp_schedule_runs 4."""
    d = {"model": {"name": "llama3", "flavor": "8B"},
         "training": {"local_batch_size": 2, "global_batch_size": 32, "seq_len": 8192},
         "parallelism": {"data_parallel_shard_degree": -1, "pipeline_parallel_degree": 2,
                         "pipeline_parallel_schedule": "1F1B", "pipeline_parallel_microbatch_size": 1}}
    got = read(d, Path("."), ImportOptions(cluster="dgx-h100", nodes=1))
    t = got.tables["training"]
    assert (t["micro_batch"], t["global_batch"], t["pp_schedule_runs"]) == (1, 32, 4)
    assert ("training.global_batch_size 32 = 4 x local_batch_size 2 x dp 4: torchtitan runs 4 gradient-accumulation "
            "steps, each a pipeline schedule of 2 micro-batches: training.pp_schedule_runs = 4") in got.notes
    d["training"]["local_batch_size"] = 8
    got = read(d, Path("."), ImportOptions(cluster="dgx-h100", nodes=1))
    assert "pp_schedule_runs" not in got.tables["training"]
    assert not [n for n in got.notes if "gradient-accumulation" in n]


@pytest.mark.parametrize("name,sched", [("ZBVZeroBubble", "zbv"), ("DualPipeV", "dualpipev")])
def test_torchtitan_v_schedules_import(name, sched):
    """torch.distributed.pipelining's V-shaped schedules, as torchtitan names them: 2 x pp model
    parts (2 stages per rank), split as torchtitan splits them (first and last part one layer
    lighter: (32 + 2) / 4 parts -> 8, 9, 8, 7); another count of parts per rank is refused."""
    par = {"data_parallel_shard_degree": -1, "pipeline_parallel_degree": 2, "pipeline_parallel_schedule": name}
    d = {"model": {"name": "llama3", "flavor": "8B"}, "training": {"local_batch_size": 8, "seq_len": 8192},
         "parallelism": par}
    mesh = read(d, Path("."), ImportOptions(cluster="dgx-h100", nodes=1)).tables["mesh"]
    assert (mesh["pp_schedule"], mesh["virtual_stages"], mesh["pp_layer_split"]) == (sched, 2, [8, 9, 8, 7])
    par["pipeline_parallel_layers_per_stage"] = 6    # (32 + 2) / 6 -> 6 parts: 3 per rank
    with pytest.raises(ConfigError, match=f"^parallelism.pipeline_parallel_schedule: {name} with 3 stages per rank"):
        read(d, Path("."), ImportOptions(cluster="dgx-h100", nodes=1))


def test_torchtitan_degree_message_says_which_takes_minus_one():
    d = {"model": {"name": "llama3", "flavor": "8B"}, "training": {"local_batch_size": 8, "seq_len": 8192},
         "parallelism": {"pipeline_parallel_degree": -1}}
    with pytest.raises(ConfigError, match=r"^parallelism.pipeline_parallel_degree: must be a whole number >= 1 "
                                          r"\(only data_parallel_shard_degree takes -1\); got -1$"):
        read(d, Path("."), ImportOptions(cluster="dgx-h100", nodes=1))


def test_blocks_compiled_alone_leave_the_head_eager():
    """torchtitan compiles each TransformerBlock alone (9dec370 ``apply_compile``; the loss
    compile commented out in its train.py; later ``[compile] components`` without "loss"). Llama
    3 8B head, 8192 tokens, bf16 logits 8192 x 128256 (LOGITS): the cross entropy eager is
    6 + 8 B forward and 4 + 12 + 6 B backward a logit, 36 B against the compiled 12 (+24 B); the
    final norm under torch_norm "decomposed" stays torchtitan's RMSNorm kernel by kernel
    (36 + 92 B an element against 4 + 6 fused, 8192 x 4096 elements) compiled or not."""
    def head(**kw):
        t = TrainingSpec(global_batch=8, seq_len=8192, micro_batch=1, recompute="none", **kw)
        cost = head_cost(LLAMA, H100, Workload(seq_len=8192, micro_batch=1, recompute="none", **framework_kernels(t)))
        return sum(_bytes(cost, "forward").values()) + sum(_bytes(cost, "backward_input").values())
    whole = head(torch_compile=True)
    blocks = head(torch_compile=True, torch_compile_loss=False)
    assert blocks - whole == 24 * LOGITS
    # 118 B an element (the weight's own 4096-element kernels add under 1e-4 of it)
    assert head(torch_compile=True, torch_norm="decomposed") - whole == pytest.approx((36 + 92 - 4 - 6) * 8192 * 4096,
                                                                                       rel=1e-4)
    assert head(torch_compile=False) == head(torch_compile=True, torch_compile_loss=False)  # fused norm: eager = fused
    t = _titan({"enable": True, "components": ["model"]})
    assert (t.tables["training"]["torch_compile"], t.tables["training"]["torch_compile_loss"]) == (True, False)
    assert "torch_compile_loss" not in _titan({"enable": True}).tables["training"]  # default: the loss compiled
    with pytest.raises(ValueError, match="torch_compile_loss = false leaves the loss eager beside a compiled model"):
        TrainingSpec(global_batch=8, seq_len=16, torch_compile_loss=False)
