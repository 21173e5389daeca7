"""Issue 14 item 3: precision per tensor class.

Tiny model T of tests/test_memory_timeline.py (2 layers, hidden 16, GeLU MLP 64, 4 heads,
vocab 128, untied), dp_shard 2, zero3, bf16 compute. torchtitan float8 training with
``enable_fsdp_float8_all_gather`` all-gathers only the Linear weights in float8; the norms
(and embeddings) stay bf16 in the same unit's buffer. By hand, per layer unit: Linear
weights q, k, v, o 4 x 256 + w_in 1024 + w_out 1024 = 3072 elements x 1 B, norms 2 x 16 x
2 B = 64 B: 3136 B (bf16: 6208 B), gathered as one uint8 buffer. Root unit (embedding 2048,
final norm 16, output 2048 elements): bf16 8224 B, the output excluded from float8 as
torchtitan's default ``filter_fqns = ["output"]``; with ``fp8_output_layer`` 4096 + 32 + 2048
= 6176 B. Float8 scales: one fp32 amax per float8 weight, all-reduced once per step:
6 weights x 2 layers = 12 -> 48 B (13 -> 52 B with the output layer). Float8 Linears without
the float8 all-gather (``linear_dtype`` alone) gather everything in bf16, as without float8.
"""

import pytest

from meshplan.errors import ConfigError

from tests.test_memory_timeline import plan_of


def gathers(plan):
    rows = plan.collectives[next(iter(plan.collectives))]
    return sorted((r.cadence, r.size_bytes, r.dtype) for r in rows if r.op == "all-gather" and r.phase == "forward")


def amax(plan):
    rows = plan.collectives[next(iter(plan.collectives))]
    return [(r.size_bytes, r.dtype, r.per_step) for r in rows if r.phase == "step" and r.op == "all-reduce"]


def test_float8_all_gather_sizes_by_hand():
    # torchtitan's units: the embedding (2048 x 2 B) and [norm, output] ((16 + 2048) x 2 B) apart
    emb, head = ("per root (embedding)", 4096, "bf16"), ("per root (norm/output)", 4128, "bf16")
    assert gathers(plan_of()) == [("every layer", 6208, "bf16"), emb, head]
    assert gathers(plan_of(linear_dtype="fp8")) == gathers(plan_of())
    assert amax(plan_of(linear_dtype="fp8")) == []
    fp8 = plan_of(linear_dtype="fp8", fp8_all_gather=True)
    assert gathers(fp8) == [("every layer", 3136, "uint8"), emb, head]
    assert amax(fp8) == [(48, "fp32", 1)] and amax(plan_of()) == []
    out = plan_of(linear_dtype="fp8", fp8_all_gather=True, fp8_output_layer=True)
    # the float8 output layer (2048 x 1 B) beside the bf16 final norm (16 x 2 B) in one byte buffer
    assert gathers(out) == [("every layer", 3136, "uint8"), emb, ("per root (norm/output)", 2080, "uint8")]
    assert amax(out) == [(52, "fp32", 1)]


def test_float8_gathered_memory():
    tl = plan_of(linear_dtype="fp8", fp8_all_gather=True).timeline
    copy_out = {e.delta_bytes for e in tl.events() if e.label == "layer 0: copy-out to unsharded parameters"}
    assert copy_out == {3136}
    # the unsharded gradients stay in the compute dtype: 3104 elements x 2 B
    grads = [e.delta_bytes for e in tl.events() if e.label.startswith("layer 0: unsharded gradient")
             and e.microbatch == 0]
    assert sum(d for d in grads if d > 0) == -min(grads) == 3104 * 2
    assert tl.peak.total_bytes < plan_of().timeline.peak.total_bytes


def test_tied_embedding_all_reduce_in_main_gradient_dtype():
    """pp 2, tied embeddings, bf16 parameters, fp32 gradients: the embedding gradient is
    all-reduced between the first and the last stage in fp32 (Megatron-LM's main gradients),
    128 x 16 elements / fsdp 2 = 1024 x 4 B = 4096 B."""
    model = dict(layers=2, hidden=16, ffn=64, gated_mlp=False, q_heads=4, vocab=128, tied_embeddings=True)
    p = plan_of(model=model, param_dtype="bf16", grad_dtype="fp32", global_batch=8,
                mesh=dict(names=["pp", "dp_shard"], shape=[2, 2], world=4))
    rows = [r for rows in p.collectives.values() for r in rows if r.axis == "pp" and r.op == "all-reduce"]
    assert {(r.size_bytes, r.dtype) for r in rows} == {(4096, "fp32")}


def test_errors():
    with pytest.raises(ConfigError, match="fp8_all_gather is FSDP2's float8 all-gather"):
        plan_of(sharding="zero1", linear_dtype="fp8", fp8_all_gather=True)
    for key in ("fp8_all_gather", "fp8_output_layer"):
        with pytest.raises(ConfigError, match=f"^training: {key} applies to the float8 Linear layers; set "
                                              f"linear_dtype = \"fp8\" or remove it$"):
            plan_of(**{key: True})
    # the old spelling of float8 training: a migration error naming the fields to set
    with pytest.raises(ConfigError, match=r"^training: compute_dtype \"fp8\" would make activations, norms and "
                                          r"gathers 1 byte; .* set compute_dtype = \"bf16\" and linear_dtype = "
                                          r"\"fp8\"$"):
        plan_of(compute_dtype="fp8")
