"""Context parallelism's buffers in the memory timeline (meshplan.memory.cp_buffers, issue 11):
all-gather CP keeps the whole sequence's K and V for backward and holds its gathered K/V beside;
torch's ring holds its gathered K/V, the fp32 merged output, the fp32 dQ accumulator and four fp32
dK/dV buffers (the received one, the re-concatenated halves, the one sent, the next received).
Every expected value below is derived by hand from the sizes in the module docstring.
"""

from __future__ import annotations

from meshplan.config import load_config
from meshplan.memory.timeline import memory_timeline
from meshplan.memory.workingset import layer_act_sizes
from meshplan.mesh.resolve import resolve_mesh
from meshplan.plan import build_plan
from meshplan.spec.memory import MemoryOptions
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from tests.configs import job_toml

GiB = 2 ** 30
#: 4 q heads and 2 KV heads of d = 16 (hidden 64), MLP 128, bf16 (a = 2 B), seq 64, micro-batch 1
SMALL = ModelSpec(layers=1, hidden=64, ffn=128, q_heads=4, kv_heads=2, vocab=100)


def _small(cp: int, attention: str, framework: str = "torch", recompute: str = "none", **memory):
    t = TrainingSpec(global_batch=8, seq_len=64, micro_batch=1, compute_dtype="bf16", recompute=recompute,
                     flash_attention=True, cp_attention=attention, framework=framework)
    mesh = resolve_mesh(MeshSpec(names=["cp"], shape=[cp]), cp)
    return layer_act_sizes(SMALL, t, mesh, MemoryOptions(**memory))


def _core(sizes) -> int:
    return next(st.work for st in sizes.steps if st.name == "attention core")


def test_small_model_allgather_cp_by_hand():
    ag, ring = _small(2, "allgather"), _small(2, "ring")
    # cp 2: 32 local tokens. The ring saves local K and V at the 2 KV heads, 2 B x 32 x 2 x (16 + 16) =
    # 4,096 B; all-gather CP the whole sequence's, 2 x 64 x 2 x 32 = 8,192 B: 4,096 B more
    assert ag.saved - ring.saved == 8192 - 4096
    # forward: the gathered K/V G = 2 x 64 x 2 x 32 = 8,192 B beside the saved ones (no SP, no recompute: nothing else)
    assert ag.fwd_temp == 8192 and ag.fwd_what == "cp all-gathered K and V"
    # attention core backward: d(context) + dq 2 x 32 x 4 x (16 + 16) = 8,192, the whole sequence's dK and dV
    # 8,192, and G = 8,192 the reduce-scatter reads: 24,576 B
    assert _core(ag) == 8192 + 8192 + 8192
    # kv_expanded (the runtime's repeat_interleave): SDPA's K and V at the 4 q heads, 2 x 64 x 4 x 32 = 16,384
    # saved and as dK/dV; G stays at the KV heads: 8,192 + 16,384 + 8,192
    wide = _small(2, "allgather", kv_expanded=True)
    assert wide.fwd_temp == 8192 and _core(wide) == 8192 + 16384 + 8192
    # Megatron-LM's all-gather CP is Transformer Engine's (AttnFuncWithCPAndKVAllGather): only local tensors saved
    # (half of them at cp 4); its buffers: test_small_model_te_allgather_by_hand
    meg, meg4 = _small(2, "allgather", framework="megatron"), _small(4, "allgather", framework="megatron")
    assert meg.saved == 2 * meg4.saved == _small(2, "p2p", framework="megatron").saved  # as its p2p ring


def test_small_model_ring_by_hand():
    ring2, ring4 = _small(2, "ring"), _small(4, "ring")
    # K and V at the heads the SDPA reads (meshplan.spec.axes.tp.sdpa_kv_heads): the 2 KV heads by default
    # ([memory] kv_expanded false, enable_gqa), the 4 q heads with kv_expanded (repeat_kv; below).
    # cp 2, L = 32: R = 2 B x 64 x 2 KV heads x 32 = 8,192 (gathered), its concatenated local input R / 2 =
    # 4,096, the fp32 merged output (q heads) 4 x 32 x 4 x 16 = 8,192
    assert ring2.fwd_temp == 8192 + 4096 + 8192 and ring2.fwd_what.startswith("cp ring")
    # backward core: local d(context) + dq 8,192 and dK + dV 2 x 32 x 2 x 32 = 4,096; R 8,192; no K/V
    # concatenation at step 1 of cp 2 (the last step); fp32 dQ 4 x 32 x 4 x 16 = 8,192; four fp32 dK/dV
    # buffers of 4 x (64 x 2 x 32 / 2) = 8,192 each
    assert _core(ring2) == 8192 + 4096 + 8192 + 8192 + 4 * 8192
    # cp 4, L = 16: forward 8,192 + 2,048 + 4 x 16 x 4 x 16 = 4,096; backward 4,096 + 2,048 + 8,192 + the
    # step's K/V concatenation 2,048 (cp > 2) + dQ 4,096 + 4 x 4 x 1,024
    assert ring4.fwd_temp == 8192 + 2048 + 4096
    assert _core(ring4) == 4096 + 2048 + 8192 + 2048 + 4096 + 4 * 4096
    assert ring2.saved == 2 * ring4.saved  # the ring keeps only local tensors: half the tokens, half the bytes
    # kv_expanded, cp 2: R = 2 x 64 x 4 x 32 = 16,384, R / 2 = 8,192, the same fp32 output 8,192; backward the
    # SDPA's dK + dV at the q heads 2 x 32 x 4 x 32 = 8,192, R, dQ 8,192 and four dK/dV buffers of
    # 4 x (64 x 4 x 32 / 2) = 16,384
    wide = _small(2, "ring", kv_expanded=True)
    assert wide.fwd_temp == 16384 + 8192 + 8192
    assert _core(wide) == 8192 + 8192 + 16384 + 8192 + 4 * 16384


# Transformer Engine under Megatron-LM (NVIDIA/TransformerEngine d0067d0, dot_product_attention/context_parallel.py;
# meshplan.memory.cp_buffers). SMALL at cp 2: L = 32 local tokens, a = 2 B, 4 q and 2 KV heads of d = d_v = 16:
#   KV = 2 x 32 x 2 x 32 = 4,096 (local K and V), Q = C = 2 x 32 x 4 x 16 = 4,096 (local q, attention output),
#   G = 2 x 64 x 2 x 32 = 8,192 (the whole sequence's K and V), K_s = 2 x 64 x 2 x 16 = 4,096 (its K);
# at cp 4: L = 16, KV = Q = C = 2,048, G = 8,192, K_s = 4,096. The attention core step's own set (no CP buffer):
# d(context) + dq + local dK/dV = C + Q + KV (12,288 at cp 2, 6,144 at cp 4).


def test_small_model_te_p2p_by_hand():
    p2, p4 = _small(2, "p2p", framework="megatron"), _small(4, "p2p", framework="megatron")
    # forward, cp rank cp - 1 (every step a full-q tile): p2p_comm_buffers keeps cp K/V buffers (lines 1685-1706)
    # and out_per_step cp outputs (lines 1672, 1810-1898) to the function's end: cp (KV + C)
    assert p2.fwd_temp == 2 * (4096 + 4096) == 16384 and p2.fwd_what.startswith("cp p2p ring")
    assert p4.fwd_temp == 4 * (2048 + 2048) == 16384
    # backward: dq_buffer = empty_like(q), Q in bf16, and two (2, *kv.shape) send/recv buffers, 4 KV (lines 2396-2399)
    assert _core(p2) == (4096 + 4096 + 4096) + 4096 + 4 * 4096 == 32768
    assert _core(p4) == (2048 + 2048 + 2048) + 2048 + 4 * 2048 == 16384
    # selective recompute replays the core (checkpointed core_attention): its last received buffer, KV, kept beside
    # the checkpoint's local k and v; at cp 8 (L = 8, KV = Q = C = 1,024) the replayed forward's 8 (KV + C) = 16,384
    # without the step's own dq, dk, dv (Q + KV) beats Q + 4 KV + KV = 6,144: the core step holds
    # C + 16,384 = 17,408 (the step's C + Q + KV 3,072 + 16,384 - 2,048)
    assert _core(_small(2, "p2p", framework="megatron", recompute="selective")) == 32768 + 4096
    assert _core(_small(8, "p2p", framework="megatron", recompute="selective")) == 3072 + 16384 - 2048
    assert _core(_small(8, "p2p", framework="megatron")) == 3072 + 1024 + 4 * 1024  # no replay: 8,192


def test_small_model_te_allgather_by_hand():
    ag2, ag4 = _small(2, "allgather", framework="megatron"), _small(4, "allgather", framework="megatron")
    # forward: k_ag, v_ag (G, lines 3215-3230) beside out = zeros (C, line 3263), the two half out_per_step (C) and a
    # step's q.select().contiguous() (Q / 2, line 3352): G + 2C + Q/2, or the reorder's G + K_s where larger
    assert ag2.fwd_temp == 8192 + 2 * 4096 + 2048 == 18432 and ag2.fwd_what.endswith("(Transformer Engine)")
    assert ag4.fwd_temp == 8192 + max(2 * 2048 + 1024, 4096) == 13312
    # backward: dK, dV of the whole sequence G (lines 3768-3777), k_ag, v_ag again G (3788-3807), both steps' dq
    # (Q) and dk, dv (G (2 cp + 1) / (2 cp)), the last step's q, out and dout halves (Q/2 + C, 3874-3889), the dK/dV
    # reorder K_s (4116-4117): beyond C + Q + KV, 3G - G / (2 cp) + 3Q/2 + C + K_s
    assert _core(ag2) == 12288 + 3 * 8192 - 8192 // 4 + 6144 + 4096 + 4096 == 49152
    assert _core(ag4) == 6144 + 3 * 8192 - 8192 // 8 + 3072 + 2048 + 4096 == 38912
    # full recompute: the checkpointed forward holds its local q, k, v and output too, Q + KV + C
    full = _small(2, "allgather", framework="megatron", recompute="full")
    assert full.fwd_temp == 18432 + 3 * 4096


def _megatron_8b(tmp_path, cp: int, attention: str):
    path = tmp_path / f"megatron_8b_128k_cp{cp}_{attention}.toml"
    path.write_text(job_toml(nodes=cp // 8, training={
        "framework": "megatron", "global_batch": 8, "seq_len": 131072, "micro_batch": 1, "sharding": "zero1",
        "recompute": "selective", "cp_attention": attention}, mesh={"names": ["cp"], "shape": [cp]}), encoding="utf-8")
    return memory_timeline(build_plan(load_config(path)), 0)


MiB = 2 ** 20


def test_megatron_8b_128k_te_buffers(tmp_path, monkeypatch):
    # Llama-3-8B at 128k, selective recompute, cp 8: L = 16,384, 32 q and 8 KV heads of 128, bf16:
    #   KV = 2 x 16,384 x 8 x 256 = 64 MiB, Q = C = 2 x 16,384 x 32 x 128 = 128 MiB, G = 512 MiB, K_s = 256 MiB.
    # p2p: forward 8 (64 + 128) = 1,536 MiB; core step 320 + max(128 + 256 + 64, 1,536 - 192) = 1,664 MiB.
    # all-gather: forward 512 + max(256 + 64, 256) = 832 MiB; core 320 + 1,536 - 32 + 192 + 128 + 256 = 2,400 MiB.
    from meshplan.memory import workingset
    for kind, fwd, core in (("p2p", 1536, 1664), ("allgather", 832, 2400)):
        tl = _megatron_8b(tmp_path, 8, kind)
        deltas = {e.label: e.delta_bytes for e in tl.events()}
        what = "cp p2p ring (Transformer Engine): K/V and output of every step" if kind == "p2p" else \
            "cp all-gathered K and V (Transformer Engine)"
        assert deltas[f"layer 31 forward: {what}"] == fwd * MiB
        assert deltas["layer 31 backward attention core: working set (gradients of activations)"] == core * MiB
        # the peak stays the head's (its fp32 logits, 4 B x 16,384 x 128,256 = 7.8 GiB, beside every layer's saved)
        assert tl.peak.label == "head: final norm and output inputs, logits and loss saved"
    # cp 128 (16 nodes, L = 1,024): the p2p ring's forward is 128 (4 + 8) = 1,536 MiB whatever cp; the head's logits
    # are 16 x smaller: the peak moves from the head (before, 51,947.0 MiB) to the last layer's forward, its total
    # there 1,536 MiB above the same moment without the buffers
    after = _megatron_8b(tmp_path, 128, "p2p")
    monkeypatch.setattr(workingset, "cp_buffers", lambda *a, **k: workingset.CpBuffers())
    before = _megatron_8b(tmp_path, 128, "p2p")
    assert before.peak.label == "head: final norm and output inputs, logits and loss saved"
    assert after.peak.label == "layer 31: saved activations (recompute selective)"
    moment = next(e.t_index for e in before.events() if e.label == after.peak.label)  # the same event, no buffers
    there = int(before.running()[moment].sum())
    assert after.peak.total_bytes == there + 1536 * MiB > before.peak.total_bytes


def _job(tmp_path, cp: int, attention: str, recompute: str):
    path = tmp_path / f"llama8b_256k_cp{cp}_{attention}_{recompute}.toml"
    path.write_text(job_toml(nodes=cp // 8, training={
        "global_batch": 2, "seq_len": 262144, "micro_batch": 1, "sharding": "zero3", "recompute": recompute,
        "cp_attention": attention}, mesh={"names": ["cp"], "shape": [cp]}), encoding="utf-8")
    return memory_timeline(build_plan(load_config(path)), 0)


def test_llama8b_256k_allgather_keeps_the_whole_sequences_kv(tmp_path):
    # Llama-3-8B at 256k, no recompute: the activations are largest at the head's forward, every layer's saved.
    # All-gather CP keeps each layer's K and V of the whole sequence, G = 2 B x 262,144 x 8 KV heads x 256 =
    # 1 GiB, where the ring keeps the local G / cp: 32 layers x 1 GiB x (1 - 1/cp) more, 28 GiB at cp 8 and
    # 31 GiB at cp 32
    for cp, more in ((8, 28 * GiB), (32, 31 * GiB)):
        ag, ring = _job(tmp_path, cp, "allgather", "none"), _job(tmp_path, cp, "ring", "none")
        assert ag.max_by_kind["activations"] - ring.max_by_kind["activations"] == more == 32 * GiB * (cp - 1) // cp
        assert ag.peak.where() == "forward of the head (micro-batch 1)"
    # cp 8: both peak there (the ring's buffers are freed by then), 28 GiB apart; cp 32: the ring's peak is its
    # last layer's attention core backward (below)
    ag, ring = _job(tmp_path, 8, "allgather", "none"), _job(tmp_path, 8, "ring", "none")
    assert ring.peak.where() == ag.peak.where() and ag.peak.total_bytes - ring.peak.total_bytes == 28 * GiB


def test_llama8b_256k_ring_buffers_in_the_attention_core(tmp_path, monkeypatch):
    # torchtitan's default (ring), full recompute. The attention core step's working set, by hand, with
    # L = 262,144 / cp local tokens, 32 q heads, 8 KV heads, d 128, bf16, K and V at the 8 KV heads the SDPA
    # reads ([memory] kv_expanded false: enable_gqa; at the 32 q heads, repeat_kv, R was 4 GiB and the core
    # 9.625 and 5.40625 GiB):
    #   d(context) + dq 2 x 2 B x L x 32 x 128, local dK + dV 2 B x L x 8 x 256,
    #   R = 2 B x 262,144 x 8 x 256 = 1 GiB (whatever cp), the step's K/V concatenation R / cp,
    #   fp32 dQ 4 B x L x 32 x 128, four fp32 dK/dV buffers 4 x 4 B x L x 8 x 256
    def core(cp: int) -> int:
        L = 262144 // cp
        return (2 * 2 * L * 32 * 128 + 2 * L * 8 * 256 + GiB + GiB // cp + 4 * L * 32 * 128
                + 4 * 4 * L * 8 * 256)
    assert core(8) == int(3.25 * GiB) and core(32) == int(1.5625 * GiB)
    tls = {cp: _job(tmp_path, cp, "ring", "full") for cp in (8, 32)}
    for cp, tl in tls.items():
        works = {e.delta_bytes for e in tl.events() if e.label.endswith("attention core: working set (gradients of "
                                                                          "activations)")}
        assert works == {core(cp)}
    # cp 32: the peak stays the head's forward, the buffers add nothing there (the core at the KV heads,
    # 1.56 GiB, stays under it; at the q heads, 5.41 GiB, it was the peak, 1.78 GiB above the head's)
    assert tls[32].peak.where() == "forward of the head (micro-batch 1)"
    from meshplan.memory import workingset
    from meshplan.memory.cp_buffers import CpBuffers
    monkeypatch.setattr(workingset, "cp_buffers", lambda *a, **k: CpBuffers())
    before = _job(tmp_path, 32, "ring", "full")
    assert before.peak.where() == "forward of the head (micro-batch 1)"
    assert tls[32].peak.total_bytes == before.peak.total_bytes
    # cp 8: the fp32 logits of 32,768 tokens x 128,256 (16 GiB) at the head's forward stay the peak
    assert tls[8].peak.where() == "forward of the head (micro-batch 1)"


def test_search_reads_the_same_attention_core(tmp_path):
    from meshplan.search.columns import RECOMPUTE
    from meshplan.search.memory import Tables
    path = tmp_path / "job.toml"
    path.write_text(job_toml(nodes=4, training={"global_batch": 2, "seq_len": 262144, "micro_batch": 1,
                                                "sharding": "zero3", "recompute": "full"},
                             mesh={"names": ["cp"], "shape": [32]}), encoding="utf-8")
    cfg = load_config(path)
    acts = Tables(cfg).acts(1, 32, 1, RECOMPUTE.index("full"), 1, 1)
    tl = memory_timeline(build_plan(cfg), 0)
    core = next(e.delta_bytes for e in tl.events() if "attention core: working set" in e.label)
    assert acts["d_bwd"] == core == int(1.5625 * GiB)  # the widest step: the ring's core, as above
