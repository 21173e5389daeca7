"""benchmarks/fidelity.py (issue 11 item 6): its core function on one development-set run.

The model is not fitted to the published step times (D2 is -0.8% today, see the benchmark's
output and the issue 11 notes), so no fidelity band is asserted: the test checks the
benchmark's bookkeeping against values derived by hand and the per-term values of the model
that the benchmark reports."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fidelity  # noqa: E402

from meshplan.schedule.steptime import step_time  # noqa: E402
from meshplan.schedule.workload import chunk_costs, workload_of  # noqa: E402

D2 = fidelity.RUNS[1]


def test_predict_one_run_bookkeeping():
    r = fidelity.predict(D2)
    assert (D2.published_s, D2.calculon_s) == (1.10, 1.14)  # published-runs-dev.md
    assert r["calculon_err"] == pytest.approx(1.14 / 1.10 - 1)  # +3.6%
    assert r["meshplan_s"] == pytest.approx(step_time(fidelity.plan_of(D2.config)).step_s)
    assert r["meshplan_err"] == pytest.approx(r["meshplan_s"] / 1.10 - 1)
    # a guard, not a fidelity claim: not worse than the -22% of the model before measured kernels
    # (issue 11), and not beyond the 10% max on the slow side (other terms still move:
    # the collective model of issue 11 item 2 is expected to lengthen the step)
    assert -0.22 < r["meshplan_err"] < 0.10


def test_d2_per_term_values_by_hand():
    """The D2 config as the benchmark builds it: dropout on from [memory], SP, selective
    recompute, non-flash attention. Scores per rank b a/tp s^2 = 4 x 8 x 2048^2 = 134,217,728:
    Megatron's causal fused softmax reads the lower triangle (a fraction 2049 / 4096) and writes
    every score in 2 B (402.7 MB), the attention dropout reads 2 B,
    writes 2 B and a 1 B mask (671.1 MB), both at A100 Triad 1.70 TB/s (BabelStream, S3); the
    optimizer step's passes at Triad too (schedule/optimizer_step.optimizer_step_bytes)."""
    plan = fidelity.plan_of(D2.config)
    w = workload_of(plan)
    assert w.dropout and w.sp and w.recompute == "selective" and not w.flash
    layer = chunk_costs(plan, w)[0][0].layers[0]
    op = {(o.name, o.phase): o.seconds for o in layer.ops}
    scores = 4 * 8 * 2048 ** 2
    assert op[("softmax", "forward")] == pytest.approx(2 * (2049 / 4096 + 1) * scores / 1.70e12)  # 236.9 us
    assert op[("attention dropout", "forward")] == pytest.approx(5 * scores / 1.70e12)  # 394.8 us
    st = step_time(plan)
    opt = [e for e in st.post_events if e.name == "optimizer step"][0]
    s = plan.state[0]
    # Megatron's mixed precision, by pass: gradient norm and clip 3 x 4 B, Adam 28 B (reads fp32
    # master, main gradient, two moments; writes master and moments), master -> bf16 copy 6 B,
    # zeroed main-gradient buffer 4 B, and the buffer divided by the dp size in place (read and
    # write 8 B, Megatron-LM's allreduce_gradients, also at dp 1): 58 B per parameter (2.75 G on
    # each tp rank); then Megatron's per-step kernels (compute/megatron_cost.megatron_step_cost): each of
    # the 8 small tensors per layer (norm weights and biases, row-parallel biases: 6144; QKV bias
    # 2304; h-to-4h bias 3072) and the final norm's 2 copied master -> bf16 by its own copy_ at
    # the 4.7 us floor (beyond its 6 B per element), the 290 sequence_parallel tensors
    # (48 x 6 + 2, 1,781,760 fp32 elements) flattened by one cat (8 B each, 8.4 us) and copied
    # back one kernel each, and 23 syncs (11 timers, the gradient norm's .item())
    n = s.bytes_of("params") // 2
    assert s.total_bytes == 18 * n
    floor = 4.7e-6
    small = 48 * ([6144] * 6 + [2304, 3072]) + [6144, 6144]
    copies = sum(floor - 6 * e / 1.70e12 for e in small)
    sp_grads = 8 * 290 * 6144 / 1.70e12 + 290 * floor
    # and the loss of the one micro-batch averaged and logged (training.py: 0 + loss, / 1,
    # training_log's torch.cuda.FloatTensor([0.0]) and add): 4 floors
    assert opt.end_s - opt.start_s == pytest.approx(58 * n / 1.70e12 + copies + sp_grads + 23 * floor + 4 * floor)


def test_sources_name_every_term():
    text = "\n".join(fidelity.sources("a100-sxm-80gb"))
    for word in ("GEMM", "attention", "Triad", "issue floor", "micro-batch", "optimizer", "collectives"):
        assert word in text


def test_components_add_up_and_calculon_rows_match_its_published_totals():
    """benchmarks/fidelity_components.py: meshplan's components of D2 sum to its step (the rest is
    named), compute is the layer costs times 48 layer passes; the Calculon rows it prints are the
    runs whose totals published-runs-dev.md quotes (1.14 s and 13.64 s, rounded)."""
    import fidelity_components as fc

    c = fc.components(D2)
    parts = ("fw", "bw", "recompute", "embedding + head", "tp", "pp", "dp", "optimizer", "pipeline idle and rest")
    assert sum(c[k] for k in parts) == pytest.approx(c["total"], rel=1e-12)
    assert c["total"] == pytest.approx(fidelity.predict(D2)["meshplan_s"])
    plan = fidelity.plan_of(D2.config)
    layer = chunk_costs(plan, workload_of(plan))[0][0].layers[0]
    assert c["layers x micro-batches"] == 48
    assert c["recompute"] == pytest.approx(48 * layer.seconds(recompute=True))
    assert round(fc.CALCULON[D2.run]["total"], 2) == D2.calculon_s
    assert round(fc.CALCULON[fidelity.RUNS[3].run]["total"], 2) == fidelity.RUNS[3].calculon_s


def test_layer_itemisation_lists_every_op_and_the_layer_times():
    """fidelity_components.py --layer: the D5 layer's ops one line each (the 22B layer without
    recompute or SP has 16 forward ops: 2 norms, Q, K, V (shares of the fused QKV GEMM), wo, QK^T,
    PV, softmax, attention dropout, context copy, QKV bias add, 2 residual adds with dropout,
    2 MLP GEMMs and GeLU: 17), its two 100.7 MB tp all-reduces (4 x 2048 x 6144 x 2 B), and the
    layer's times as fidelity.predict_layer gives them."""
    import fidelity_components as fc

    lines = fc.layer_lines("none", False)
    assert sum(x.startswith("forward ") for x in lines) == 17
    coll = [x for x in lines if x.startswith("collective")]
    assert len(coll) == 2 and all("all-reduce" in x and "100.7 MB" in x for x in coll)
    f, b = fidelity.predict_layer("none", False)
    assert lines[-1] == f"layer forward {f:.2f} ms (published 7.7), backward {b:.2f} ms (published 11.9)"


def test_layer_summary_splits_the_d5_forward_by_hand():
    """fidelity_components.layer_summary on D5 without recompute or SP (Korthikanti Table 4's
    baseline; Megatron-LM 2755bcb's forward, audited in docs/fidelity.md). The forward's rest of
    the unit is its two blocking tp all-reduces of [s, b, h] = 2048 x 4 x 6144 x 2 B = 96 MiB,
    each half way between S15's 64M row (1.75 x 2^26 B / 171.54 GB/s = 684.6 us) and its 128M row
    (1.75 x 2^27 B / 176.9 GB/s = 1327.8 us): 2 x 1006.2 us (tests/test_busbw.py). Its memory-bound
    kernels at Triad 1.70 TB/s (S3): the causal softmax (lower triangle read, 2049/4096 of the
    scores, every score written, 2 B), the attention dropout (2 + 2 + 1 B a score), the context
    permute copy and the QKV bias add (read + write of [s, b, h/tp] and [s, b, 3h/tp], 2 B), two
    bias + dropout + add (x and residual read, out written, 1 B mask: 7 B an element of [s, b, h])
    and bias + GeLU ([s, b, 4h/tp] read and written); the two LayerNorms at the catalog's norm
    fit, 8.8 us + bytes / 1.55 TB/s (S11, rounded there: 0.5% here) of [s, b, h] read and written.
    The same ops summed give the compute; compute + rest = the layer's forward (8.08 ms)."""
    import fidelity_components as fc

    plan = fc.layer_plan("none", False)
    layer = chunk_costs(plan, workload_of(plan))[0][0].layers[0]
    f_ms, _ = fidelity.predict_layer("none", False)
    groups = fc.pass_groups(layer, fc.PASSES["forward"])
    t64, t128 = 1.75 * 2**26 / 171.54e9, 1.75 * 2**27 / 176.9e9
    assert f_ms * 1e-3 - sum(groups.values()) == pytest.approx(2 * (t64 + t128) / 2, rel=1e-6)
    tokens, scores = 2048 * 4, 4 * 8 * 2048 ** 2
    triad = (2 * (2049 / 4096 + 1) * scores + 5 * scores + 4 * tokens * 768 + 4 * tokens * 2304
             + 2 * 7 * tokens * 6144 + 4 * tokens * 3072)
    norms = 2 * (8.8e-6 + 4 * tokens * 6144 / 1.55e12)
    assert groups["memory-bound"] == pytest.approx(triad / 1.70e12 + norms, rel=5e-3)  # 1.442 ms
    assert set(groups) == {"gemm", "attention bmm", "memory-bound"}
    lines = fc.layer_summary(layer, f_ms * 1e-3, 0.0)
    assert lines[0].endswith(f"tp waits + SM contention {2 * (t64 + t128) / 2 * 1e3:.3f} (ms; unit {f_ms:.3f})")
