"""The search's estimate phase shares work across candidates (issue 11 item 7: Llama-3-405B on
16,384 H100 searched within 10 s on 2 cores) without changing a number: every recompute policy
of a layer shape from one set of ops (``compute.layer.layer_costs``), ``Cost.seconds`` from one
pass in op order, the op fields of ``search.timing.TimeTables`` shared by the policies. Each
test checks the shared result against the per-policy computation it replaced, bit for bit
(``==`` on floats: a changed summation order fails)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from meshplan import catalog
from meshplan.compute.embed_head import embedding_cost, head_cost
from meshplan.compute.layer import layer_cost, layer_costs
from meshplan.compute.ops import BLOCKS, PHASES, RECOMPUTE, Workload
from meshplan.compute.kernel_choices import float8_gemms, framework_kernels
from meshplan.compute.recompute import full_ac_not_replayed
from meshplan.compute.routing import RoutingOptions
from meshplan.schedule.layer_timeline import LAYER_BLOCKS
from meshplan.schedule.ring_timeline import cp_parts
from meshplan.search.memory import Tables
from meshplan.search.space import RECOMPUTE as SEARCHED
from meshplan.search.time_tables import UNIFORM
from meshplan.search.time_tables import PHASES as FIELD_PHASES
from meshplan.search.timing import TimeTables
from test_search import MOE, config

H100, A100 = catalog.gpu("h100-sxm5-80gb"), catalog.gpu("a100-sxm-80gb")
WORKLOADS = [
    ("llama3-8b", H100, Workload(seq_len=4096, micro_batch=2, tp=4, cp=2, sp=True)),
    ("megatron-22b", A100, Workload(seq_len=2048, micro_batch=4, tp=8, flash=False, dropout=True,
                                    fused_qkv=True, fp32_wgrad_accumulation=True, megatron_ops=True)),
    ("deepseek-v3", H100, Workload(seq_len=4096, tp=2, sp=True, ep=8)),
]


def _reference_seconds(cost, phase, block, recompute):
    """The sum ``Cost.seconds`` was before its table: every matching op, in op order."""
    return sum(o.seconds for o in cost.ops if phase in (None, o.phase) and block in (None, o.block)
               and recompute in (None, o.recompute))


@pytest.mark.parametrize("name,gpu,w", WORKLOADS, ids=[n for n, _, _ in WORKLOADS])
def test_cost_seconds_equal_the_op_order_sum(name, gpu, w):
    m = catalog.model(name)
    for rc in RECOMPUTE:
        cost = layer_cost(m, gpu, replace(w, recompute=rc), layer=m.layers - 1)
        for phase in PHASES + (None,):
            for block in BLOCKS + (None,):
                for r in (None, False, True):
                    assert cost.seconds(phase, block, r) == _reference_seconds(cost, phase, block, r)


@pytest.mark.parametrize("name,gpu,w", WORKLOADS, ids=[n for n, _, _ in WORKLOADS])
def test_layer_costs_of_every_policy_equal_one_policy_at_a_time(name, gpu, w):
    m = catalog.model(name)
    together = layer_costs(m, gpu, w, RECOMPUTE + ("layer",), layer=m.layers - 1)
    for rc, cost in together.items():
        assert cost == layer_cost(m, gpu, replace(w, recompute=rc), layer=m.layers - 1)
    none, full, sel = together["none"], together["full"], together["selective"]
    # no policy changes the ops it does not replay, nor their order
    for cost in together.values():
        assert [o for o in cost.ops if not o.recompute] == list(none.ops)
    # full recompute replays every forward op once in backward, in the forward's order, but
    # under torch what only feeds the MLP's closing reduce-scatter (compiled: w_down too)
    replays = [o for o in full.ops if o.recompute]
    skip = full_ac_not_replayed(w)
    assert [o.name for o in replays] == [o.name + " (recompute)" for o in none.ops
                                         if o.phase == "forward" and o.name not in skip]
    assert ("w_down" in skip) == (not w.megatron_ops and not w.torch_eager)
    skipped = sum(o.seconds for o in none.ops if o.phase == "forward" and o.name in skip)
    assert full.seconds("backward_input", None, True) == pytest.approx(none.seconds("forward") - skipped, rel=1e-12)
    assert all(o.model_flops == 0.0 and o.phase == "backward_input" for o in replays)
    # selective replays the attention core only (flash: the one fused kernel's forward)
    assert {o.block for o in sel.ops if o.recompute} == {"attn"}
    if w.flash:
        core = [o.seconds for o in none.ops if o.phase == "forward" and o.kind == "attention"]
        assert len(core) == 1 and sel.seconds("backward_input", "attn", True) == core[0]
    with pytest.raises(ValueError):
        layer_costs(m, gpu, w, ("sometimes",))


def _reference_ops(cfg, tp, cp, mb, rc, ep, etp, layer):
    """``TimeTables.ops`` before the policies shared a shape: one layer_cost per policy."""
    m, t, gpu = cfg.model, cfg.training, cfg.cluster.gpu
    w = Workload(seq_len=t.seq_len, micro_batch=mb, tp=tp, cp=cp, sp=tp > 1, ep=ep, etp=etp,
                 dtype=t.compute_dtype, recompute=SEARCHED[rc], flash=t.flash_attention,
                 vocab_pad_divisor=t.vocab_pad_divisor, routing=RoutingOptions.of(t), **framework_kernels(t),
                 **float8_gemms(m, t))
    cost = layer_cost(m, gpu, w, layer=layer)
    out = {f"{p}_{b}": cost.seconds(ph, b, r) for p, (ph, r) in FIELD_PHASES.items() for b in LAYER_BLOCKS}
    out.update({f"{p}_cpq": cp_parts(cost, ph, r)["q"] for p, (ph, r) in FIELD_PHASES.items() if p != "bw"})
    # one of the ring's cp steps (its SDPA calls and ring kernels over cp)
    out.update({f"{p}_cps": cp_parts(cost, ph, r)["sdpa"] / cp for p, (ph, r) in FIELD_PHASES.items() if p != "bw"})
    # a selective recompute's replayed attention, Transformer Engine's p2p ring's forward steps again
    out.update({f"{p}_cpr": cp_parts(cost, ph, r)["replay"] / cp for p, (ph, r) in FIELD_PHASES.items() if p != "bw"})
    emb, head = embedding_cost(m, gpu, w), head_cost(m, gpu, w)
    out.update(emb_f=emb.seconds("forward"), emb_bw=emb.seconds("backward_weight"),
               head_f=head.seconds("forward"), head_b=head.backward_s)
    gemms = [o for o in cost.ops + head.ops if o.kind == "gemm" and not o.recompute]
    peak = [o.hardware_flops / gpu.peak_flops(w.gemm_dtype(o.name)) for o in gemms]  # each at its dtype's peak
    out.update(gemm_peak_s=sum(p for o, p in zip(gemms, peak) if o.block != "head"),
               gemm_s=sum(o.seconds for o in gemms if o.block != "head"),
               head_gemm_peak_s=sum(p for o, p in zip(gemms, peak) if o.block == "head"),
               head_gemm_s=sum(o.seconds for o in gemms if o.block == "head"))
    return out


@pytest.mark.parametrize("model,float8", [(None, False), (MOE, False), (None, True)], ids=["dense", "moe", "float8"])
def test_time_tables_ops_equal_one_layer_cost_per_policy(model, float8):
    cfg = config(1, model=model)
    if float8:  # the Linears' GEMMs in fp8 (training.linear_dtype), each GEMM at its own dtype's peak
        gpu = cfg.cluster.gpu.model_copy(update={"peak_tflops": cfg.cluster.gpu.peak_tflops | {"fp8": 1978.9}})
        cfg = replace(cfg, cluster=cfg.cluster.model_copy(update={"gpu": gpu}),
                      training=cfg.training.model_copy(update={"linear_dtype": "fp8"}))
    tt = TimeTables(cfg, Tables(cfg))
    layer = cfg.model.dense_layers if cfg.model.is_moe else 0
    ep = 2 if cfg.model.is_moe else 1
    for tp, cp, mb in ((1, 1, 1), (2, 2, 1), (4, 1, 2), (2, 4, 2)):
        for rc in (SEARCHED.index(r) for r in UNIFORM):  # per-layer AC is costed as none (columns.bound_recompute)
            got, want = tt.ops(tp, cp, mb, rc, ep, 1, layer), _reference_ops(cfg, tp, cp, mb, rc, ep, 1, layer)
            assert got.keys() == want.keys()
            for k in want:
                if k.endswith(("_cpq", "_cps", "_cpr")) and cp == 1:  # no CP exchange: the bound adds max(0 - q, 0) = 0, q unused
                    assert got[k] == 0.0 and want[k] >= 0.0
                else:
                    assert got[k] == want[k], (tp, cp, mb, rc, k)
    assert np.isfinite(list(tt.ops(2, 2, 1, 1, ep, 1, layer).values())).all()
