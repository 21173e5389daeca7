"""Transformer Engine fp8 under Megatron-LM (te50): the working set's gathers at 1 B, the fp8 weight cache,
``--fp8-param-gather`` (state, collective table, import/export) and the once-a-step weight casts.

The job: a small dense model, h 64, 4 heads of 16 (4 KV heads), gated MLP f 128, 2 layers, vocab 128, on one
DGX node at tp 2 x dp 4 under framework megatron, ``--fp8-format`` (``linear_dtype = "fp8"``), sequence
parallel, seq 32, micro-batch 2, the distributed optimizer (zero1). A layer's linear weights: wq, wk, wv, wo
4 x 64 x 64 = 16,384, w_gate, w_up, w_down 3 x 64 x 128 = 24,576; 40,960 in all, every dim a multiple of 16
(TE fp8), so 20,480 a rank at tp 2 and 40,960 for the stage's two layers (pp 1): the rank's fp8 weight values.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError

MODEL = {"layers": 2, "hidden": 64, "ffn": 128, "q_heads": 4, "kv_heads": 4, "vocab": 128, "gated_mlp": True}
FP8_VALUES = 2 * (4 * 64 * 64 + 3 * 64 * 128) // 2  # 40,960: two layers' linear weights at tp 2


def _cfg(system: str = "dgx-h100", mesh: dict | None = None, **training):
    t = {"global_batch": 16, "seq_len": 32, "micro_batch": 2, "framework": "megatron", "linear_dtype": "fp8",
         "sharding": "zero1", "vocab_pad_divisor": 1} | training
    return config_from_dict({"model": MODEL, "cluster": {"system": system, "nodes": 1}, "training": t,
                             "mesh": mesh or {"names": ["dp", "tp"], "shape": [4, 2], "sequence_parallel": True}})


def _plan(**kw):
    from meshplan.plan import build_plan
    return build_plan(_cfg(**kw))


def test_working_set_gathers_fp8_under_te():
    """Task 1: under TE's fp8 the layer norm's output is quantized on the sequence shard and gathered as fp8
    (TE d0067d0 layernorm_linear.py:292-313), the output gradient before proj's and fc2's dgrad (base.py
    1718-1749): the working set asks compute.dtensor_sp.fp8_tp_gathers, as the collective table does. The
    rank's full sequence: 32 x 2 = 64 tokens. Forward: the gathered input 64 x 64 values, 4,096 B at 1 B
    (8,192 B in bf16). Backward, mlp w_out: the gathered dY 64 x 64 = 4,096 B + its dX F = 2 B x 64 x
    128 / 2 = 8,192 B: 12,288 B (16,384 B in bf16)."""
    from meshplan.memory.workingset import layer_act_sizes
    from meshplan.plan import build_plan
    for fp8, gathered, w_out in ((True, 4096, 12288), (False, 8192, 16384)):
        cfg = _cfg(**({} if fp8 else {"linear_dtype": None}))
        p = build_plan(cfg)
        a = layer_act_sizes(cfg.model, cfg.training, p.mesh, cfg.memory)
        assert (a.fwd_temp, a.fwd_what) == (gathered, "SP all-gathered input")
        assert {s.name: s.work for s in a.steps}["mlp w_out"] == w_out


@pytest.mark.parametrize("system, per", [("dgx-h100", 2), ("dgx-b200", 1)])
def test_fp8_weight_cache_in_the_init(system, per):
    """Task 3: Megatron-Core passes is_first_microbatch to TE's linears, so TE keeps each weight's fp8 copy in
    _fp8_workspaces["weight"] for the run (TE linear.py:1958-1960, 2068-2071), cast again only on a step's first
    micro-batch (linear.py:479). With gradients its column-wise form is kept too: on Hopper (sm 90, TN-only fp8
    GEMMs) a transpose of 1 B more (float8_tensor.py:423-427), on Blackwell (sm 100) none (utils.py:658-664).
    40,960 values x 2 B = 81,920 B on H100, x 1 B = 40,960 B on B200, kind params, beside the bf16 parameters
    (the state unchanged: params dense 40,960 fp8 values + 64 x 64 embedding + output 128 x 64 / 2 + norms...)."""
    p = _plan(system=system)
    init = [e for e in p.timelines[0].events() if e.phase == "init" and "fp8 weight cache" in e.label]
    assert [(e.kind, e.delta_bytes) for e in init] == [("params", FP8_VALUES * per)]
    assert p.state[0].params.fp8_params == FP8_VALUES
    assert p.state[0].bytes_of("params") == 2 * p.state[0].params.total  # no part of it in fp8


def test_fp8_param_gather_state_and_transpose():
    """Task 2: under --fp8-param-gather TE's linear weights are Float8Tensor parameters in a uint8 DDP buffer
    (Megatron d98e8a6 param_and_grad_buffer.py:921-923): 40,960 x 1 B, the rest of the dense parameters at
    2 B; TE keeps only the transpose beside them on H100 (post_all_gather_processing, TE utils.py:1404-1427):
    40,960 x 1 B. The rest: embedding 128 x 64 / 2 = 4,096 (vocab-parallel), output 4,096, norms 2 x 2 x 64 +
    64 = 320: 8,512 values, 17,024 B. Gradients stay 4 B (fp32 main grads) on all 49,472 values."""
    p = _plan(fp8_param_gather=True)
    st = p.state[0]
    assert st.params.total == FP8_VALUES + 8512
    parts = {i.name: i.size_bytes for i in st.items if i.kind == "params"}
    assert parts == {"params dense (TE fp8 weights)": 40960, "params dense (other)": 17024}
    assert st.bytes_of("grads") == 4 * 49472
    init = [e for e in p.timelines[0].events() if e.phase == "init" and "transposes of the fp8 parameters" in e.label]
    assert [e.delta_bytes for e in init] == [40960]


def test_fp8_param_gather_all_gathers_one_byte():
    """Task 2: the distributed optimizer all-gathers the fp8 buffer's 40,960 values at 1 B (40,960 B) and the
    other buffer's 8,512 at bf16 (17,024 B), each buffer reduce-scattered apart in fp32 (163,840 B and 34,048
    B); before, one all-gather of 49,472 x 2 = 98,944 B. Under --overlap-grad-reduce the same buffers in
    Megatron's buckets (here each one bucket: 40e6 elements a bucket), the fp8 one's rows marked."""
    for extra in ({}, {"overlap_grad_reduce": True}):
        rows = [r for r in _plan(fp8_param_gather=True, **extra).collectives["stage 0"]
                if r.phase == "step" and r.axis in ("dp", "fsdp")]
        ag = sorted((r.size_bytes, r.dtype) for r in rows if r.op == "all-gather")
        rs = sorted((r.size_bytes, r.dtype) for r in rows if r.op == "reduce-scatter")
        assert ag == [(17024, "bf16"), (40960, "fp8")] and rs == [(34048, "fp32"), (163840, "fp32")]
        assert all("fp8 parameters" in r.cadence for r in rows if r.dtype == "fp8")
    rows = [r for r in _plan().collectives["stage 0"] if r.phase == "step" and r.op == "all-gather"]
    assert [(r.size_bytes, r.dtype) for r in rows] == [(98944, "bf16")]


def test_te_casts_once_a_step():
    """Task 3's compute: one cast of each weight a step (the cache reused by the later micro-batches), the bf16
    read and the fp8 data and transpose written (delayed scaling's fused cast-transpose): 40,960 x 4 B =
    163,840 B; under --fp8-param-gather the fp32 main shard cast into the fp8 shard (40,960 / 4 = 10,240 x 5 B)
    and the transpose after the all-gather (40,960 x 2 B): 133,120 B. Seconds: at the H100's optimizer
    bandwidth, never below one issue floor (these are tiny: the floor)."""
    from meshplan.compute.kernel_time import issue_floor, optimizer_bandwidth
    from meshplan.memory.te_fp8 import cast_bytes
    from meshplan.schedule.step_end import te_fp8_cast_s
    for pg, nbytes in ((False, 163840), (True, 133120)):
        p = _plan(fp8_param_gather=pg)
        gpu = p.config.cluster.gpu
        assert cast_bytes(FP8_VALUES, FP8_VALUES // 4, p.config.training, gpu.cuda_sm, 2) == nbytes
        assert te_fp8_cast_s(p, 0) == issue_floor(gpu, nbytes / optimizer_bandwidth(gpu)) > 0
    assert te_fp8_cast_s(_plan(linear_dtype=None), 0) == 0.0


@pytest.mark.parametrize("training, field", [({"fp8_param_gather": True, "framework": "torch"}, "fp8_param_gather"),
                                             ({"fp8_param_gather": True, "linear_dtype": None}, "fp8_param_gather"),
                                             ({"fp8_param_gather": True, "sharding": "none"}, "fp8_param_gather")])
def test_fp8_param_gather_refused_where_megatron_has_none(training, field):
    """fp8_param_gather is Megatron-LM's distributed optimizer's (arguments.py:1095-1097), of TE's fp8 linears:
    one line naming the field and the fix, not a traceback."""
    with pytest.raises(ConfigError) as e:
        _cfg(**training)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_import_reads_and_export_writes_fp8_param_gather():
    """nc49 train_fp8pg.sh: --fp8-param-gather with --fp8-format hybrid and --use-distributed-optimizer is
    training.fp8_param_gather (no NOT-modelled note for it now), and an export writes the flag back. Without
    the distributed optimizer Megatron-LM asserts (arguments.py:1095-1097): one line."""
    from pathlib import Path
    from meshplan.interop import megatron
    from meshplan.interop.common import ImportOptions
    from meshplan.interop.megatron_precision import fp8_param_gather_keys
    from meshplan.interop.megatron_write import write
    text = (Path(__file__).parent / "data" / "nc49" / "train_fp8pg.sh").read_text()
    imp = megatron.read(text, ImportOptions(cluster="dgx-h100"))
    assert imp.tables["training"]["fp8_param_gather"] is True
    assert not any("--fp8-param-gather" in n for n in imp.notes)
    assert "--fp8-param-gather" in " ".join(write(config_from_dict(imp.tables)))
    with pytest.raises(ConfigError, match="--fp8-param-gather"):
        fp8_param_gather_keys({"--fp8-param-gather": True, "--fp8-format": "hybrid"}, [])


@pytest.mark.parametrize("pg", [False, True], ids=["cache", "fp8-param-gather"])
def test_search_bounds_hold_with_te_fp8(pg):
    """The search's state counts TE's fp8 weights as the plan does (search.memory.state through
    memory.te_fp8.stage_bytes: the cache, and under --fp8-param-gather the parameters at 1 B) and its step
    bound gathers the zero1 rows' parameters at 1 B a value under --fp8-param-gather (a lower bound of the
    table's two buffers): on every feasible candidate of tests.test_search's 8-GPU Megatron case in fp8 the
    memory lower bound <= the exact peak <= the upper bound (within the margin) and the step bound <= the
    simulated step (the GPU: tests.test_search's 6 GB H100 with the catalog H100's fp8 peak and sm 90). Without
    the search's count of the cache the "cache" case fails (an upper bound under the exact peak; tried)."""
    from meshplan.search.driver import search
    from tests.test_search import SMALL, gpu, plan_all, refused
    h100 = gpu(6.0) | {"peak_tflops": {"bf16": 989.4, "fp8": 1978.9}, "cuda_sm": 90}  # fp8 peak: catalog H100's
    cfg = config_from_dict({"model": SMALL, "cluster": {"system": "dgx-h100", "nodes": 1, "gpu": h100},
                            "training": {"global_batch": 64, "seq_len": 2048, "framework": "megatron", "sharding": "zero1",
                                         "linear_dtype": "fp8", "fp8_param_gather": pg},
                            "search": {"settle_max": 1_000_000, "micro_batch": [1, 2], "recompute": ["selective"],
                                       "sharding": ["zero1"], "top": 4}}, require_mesh=False)
    r = search(cfg, workers=1)
    m, checked = cfg.search.memory_margin, 0
    for i, (feasible, _, peak, step) in enumerate(plan_all(cfg, r)):
        if peak is not None and np.isfinite(r.est.peak_lo[i]):
            assert r.est.peak_lo[i] <= peak <= r.est.peak_hi[i] * (1 + m), r.candidates.label(i)
        if feasible and not refused(r, i):
            assert r.est.step_lo[i] <= step * (1 + 1e-9), r.candidates.label(i)
            checked += 1
    assert checked > 0
