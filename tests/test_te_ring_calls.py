"""Transformer Engine's p2p ring (Megatron-LM's ``--cp-comm-type p2p``): each ring step's attention
call rated at its own shape (meshplan.compute.ring_attention.te_ring), by hand from the catalog's
H100 FlashAttention-3 points (kernels.toml ``[gpu.h100-sxm5-80gb.attention]``, S7c forward, S8
backward, d 128). Before, the rank's whole causal ``(s / cp, s)`` shape was one call read at S = s,
beyond the rows' 16,384 and so held there (forward 616, backward 561 TFLOP/s at any cp), and the
timeline split it into cp equal steps: a cp 32 rank's 3,072-token calls looked as efficient as a
cp 2 rank's 49,152-token ones (newcomer trial 31, issue 11 open item 1b).

TE's calls (AttnFuncWithCPAndKVP2P, NVIDIA/TransformerEngine d0067d0 context_parallel.py): step 0
the causal ``L x L`` diagonal, at ``i <= rank`` the whole Q against the first half of the received
K/V (``L x L/2``), at ``i > rank`` the second half of Q against the whole K/V (``L/2 x L``), ``L =
s / cp``; each ``L^2 / 2`` query-key pairs, ``2 L^2 H d`` forward FLOP (flash-attention's convention:
``4 S_q S_kv H d``, halved when causal), backward 2.5x. The forward's rate is read at the keys it
loops over, the backward's at the queries (ring_attention.rate_lengths); between the measured
lengths linear in log2(S).
"""

from __future__ import annotations

import tomllib
from math import log2

import pytest

from meshplan import catalog
from meshplan.compute.layer import layer_cost
from meshplan.compute.ops import Workload
from meshplan.compute.kernel_choices import framework_kernels
from meshplan.compute.ring_attention import MERGE
from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.spec.training import TrainingSpec
from tests.configs import NC31_TOP1_TOML, nc31_cp16_toml

LLAMA70B = catalog.model("llama3-70b")
H100 = catalog.gpu("h100-sxm5-80gb")
S = 98_304  # 96k tokens: the cp 8 and cp 32 calls fall between the table's lengths
# FA3 d128 rows (kernels.toml): seq 512 1024 2048 4096 8192 16384
CAUSAL = (292, 423, 521, 579, 602, 616)   # fwd causal, S7c
NONE = (467, 565, 625, 638, 646, 648)     # fwd unmasked, S7c
BWD = (316, 424, 501, 542, 559, 561)      # bwd, S8 (mask not identified)
#: log2(1.5): where 1.5 x a measured length sits between it and twice it
F = log2(12288) - log2(8192)


def _megatron(cp: int) -> Workload:
    t = TrainingSpec(global_batch=32, seq_len=S, framework="megatron")
    return Workload(seq_len=S, micro_batch=1, tp=8, cp=cp, sp=True, recompute="none", **framework_kernels(t))


def _attention_ms(w: Workload) -> tuple[float, float]:
    ops = {o.phase: o for o in layer_cost(LLAMA70B, H100, w).ops if o.name == "attention"}
    return ops["forward"].seconds * 1e3, ops["backward_input"].seconds * 1e3


def _between_points(cp: int, k: int):
    """The docstring's derivation for a cp whose ``L = S / cp`` is 1.5 x the table's k-th length (512
    x 2^k, so ``L / 2`` is 1.5 x the (k - 1)-th): rates (TFLOP/s) F of the way up from those points,
    causal at L, unmasked at L and L/2, backward at L and L/2; the pair's forward FLOP ``2 L^2 H d``
    (H 8, d 128); and rank r's (forward, backward) ms: ``pair (1/causal + r/unmasked(L/2) + (cp - 1 -
    r)/unmasked(L))``, ``2.5 pair ((1 + r)/bwd(L) + (cp - 1 - r)/bwd(L/2))``."""
    L = S // cp
    assert L == 1.5 * 512 * 2 ** k
    up = lambda row, i: row[i] + F * (row[i + 1] - row[i])
    causal, whole, half, bwd, bwd_half = up(CAUSAL, k), up(NONE, k), up(NONE, k - 1), up(BWD, k), up(BWD, k - 1)
    pair = 2 * L ** 2 * 8 * 128
    rank = lambda r: (pair * (1 / causal + r / half + (cp - 1 - r) / whole) / 1e9,
                      2.5 * pair * ((1 + r) / bwd + (cp - 1 - r) / bwd_half) / 1e9)
    return (causal, whole, half, bwd, bwd_half), pair, rank


def test_te_ring_calls_rated_at_their_shapes_by_hand():
    """Llama-3-70B at tp 8 (64 / 8 = 8 q heads of d 128 on a rank), b 1, s 98,304.

    cp 2: L 49,152, L/2 24,576, both past 16,384: every rate held at the last point. Rank 0: the
    causal L x L (616 forward, 561 backward) and one upper-triangle L/2 x L (forward over L keys
    648, backward over L/2 queries 561); rank 1's lower-triangle L x L/2 reads 648 and 561 too: a
    tie of the calls, which TE's correction kernels break (compute.te_ring; test_te_ring_steps.py):
    rank 1 corrects its whole output and dQ, rank 0 half of them; the same calls. pair = 2 x 49152^2
    x 8 x 128 = 4.948e12 FLOP: forward pair (1/616 + 1/648) = 15.668 ms (16.064 ms as one causal
    call at 616), backward 2.5 pair x 2 / 561 = 44.098 ms (the same).

    cp 8: L 12,288 = 1.5 x 8,192, L/2 6,144 = 1.5 x 4,096, both F = log2 1.5 = 0.585 of the way
    up: causal 602 + F (616 - 602) = 610.19, unmasked at L 646 + 2 F = 647.17, at L/2 638 + 8 F =
    642.68; backward at L 559 + 2 F = 560.17, at L/2 542 + 17 F = 551.94. Rank r: forward pair
    (1/610.19 + r/642.68 + (7 - r)/647.17), backward 2.5 pair ((1 + r)/560.17 + (7 - r)/551.94);
    each step of r adds pair (1/642.68 - 1/647.17) forward and takes 2.5 pair (1/551.94 - 1/560.17)
    backward, more: by its calls rank 0 is the slowest, rank 7's 120.6 us shorter. pair = 2 x
    12288^2 x 8 x 128 = 3.092e11. TE's corrections take rank 7 longer by more (H100 Triad 2.97
    TB/s, each kernel at least the 4.7 us issue floor; rows = 8 x 12,288 = 98,304, n_o = n_dq = 128
    rows, n_kv = 12,288 x 1 KV head x 256 = 3,145,728): its 7 output corrections read and write the
    whole output, 7 x (3 n_o + 4 rows) = 267.0 MB more than rank 0's halves, 89.9 us; its dQ
    accumulation 46 n_dq against 25, 264.2 MB, 89.0 us; its dK/dV adds are half-size (floored) where
    rank 0's 12 whole ones take 6.355 us each: -25.95 us; +152.9 us in all: rank 7 is the slowest
    rank, forward pair (1/610.19 + 7/642.68) = 3.875 ms (4.016 ms before the calls were rated by
    shape), backward 2.5 pair x 8 / 560.17 = 11.041 ms (11.025 ms).

    cp 32: L 3,072 = 1.5 x 2,048, L/2 1,536 = 1.5 x 1,024: causal 521 + 58 F = 554.93, unmasked
    at L 625 + 13 F = 632.60, at L/2 565 + 60 F = 600.10; backward at L 501 + 41 F = 524.98, at L/2
    424 + 77 F = 469.04. Rank 0: pair = 2 x 3072^2 x 8 x 128 = 1.933e10, forward pair (1/554.93 +
    31/632.60) = 0.982 ms (1.004 ms before), backward 2.5 pair (1/524.98 + 31/469.04) = 3.286 ms
    (2.756 ms before: +19%, the short calls' backward at 469 against the held 561)."""
    assert round(F, 4) == 0.585
    pair2 = 2 * 49152 ** 2 * 8 * 128
    fwd2 = pair2 * (1 / CAUSAL[-1] + 1 / NONE[-1]) / 1e9
    bwd2 = 2.5 * pair2 * 2 / BWD[-1] / 1e9
    assert (round(fwd2, 3), round(bwd2, 3)) == (15.668, 44.098)
    assert _attention_ms(_megatron(2)) == pytest.approx((fwd2, bwd2), rel=1e-9)

    rates8, pair8, rank8 = _between_points(8, 4)
    assert [round(x, 2) for x in rates8] == [610.19, 647.17, 642.68, 560.17, 551.94]
    assert max(range(8), key=lambda r: sum(rank8(r))) == 0   # by the calls alone
    assert round((sum(rank8(7)) - sum(rank8(0))) * 1e3, 1) == -120.6
    rows, t, floor = 98_304, 2.97e12, 4.7e-6
    n_o, n_kv = 128 * rows, 12_288 * 256
    k = lambda b: max(b / t, floor)
    out = 7 * (k(6 * n_o + 8 * rows) - k(3 * n_o + 4 * rows))
    dq = k(4 * n_o) + 7 * k(6 * n_o) - (2 * k(2 * n_o) + 7 * k(3 * n_o))
    dkv = (2 * k(2 * n_kv) + 12 * k(3 * n_kv) + 2 * k(6 * n_kv)) - (2 * k(4 * n_kv) + 12 * k(6 * n_kv) + 2 * k(3 * n_kv)
                                                                  + 2 * k(2 * n_kv))
    assert [round(x * 1e6, 2) for x in (out, dq, dkv)] == [89.9, 88.97, -25.95]
    assert out + dq + dkv > (sum(rank8(0)) - sum(rank8(7))) / 1e3
    assert [round(x, 3) for x in rank8(7)] == [3.875, 11.041]
    assert _attention_ms(_megatron(8)) == pytest.approx(rank8(7), rel=1e-9)

    rates32, pair32, rank32 = _between_points(32, 2)
    assert [round(x, 2) for x in rates32] == [554.93, 632.60, 600.10, 524.98, 469.04]
    assert max(range(32), key=lambda r: sum(rank32(r))) == 0
    assert [round(x, 3) for x in rank32(0)] == [0.982, 3.286]
    assert _attention_ms(_megatron(32)) == pytest.approx(rank32(0), rel=1e-9)
    # before: the whole causal (L, s) call at the held 616 / 561, the same rate at every cp
    before = lambda cp, pair: (cp * pair / CAUSAL[-1] / 1e9, 2.5 * cp * pair / BWD[-1] / 1e9)
    assert [round(x, 3) for x in before(32, pair32)] == [1.004, 2.756]
    assert [round(x, 3) for x in before(8, pair8)] == [4.016, 11.025]


def test_te_ring_runs_no_torch_ring_kernels():
    """TE's ring corrects its outputs in its own kernels, not torch's fp32 merges: no MERGE op; at cp 1
    there is no ring, the whole causal call read at S 98,304 (held at 616 / 561)."""
    ops = layer_cost(LLAMA70B, H100, _megatron(8)).ops
    assert not any(o.name.startswith(MERGE) for o in ops)
    fwd, bwd = _attention_ms(_megatron(1))
    pair = 4 * S ** 2 * 8 * 128 / 2   # one causal S x S call: 4 S^2 H d, halved
    assert (fwd, bwd) == pytest.approx((pair / CAUSAL[-1] / 1e9, 2.5 * pair / BWD[-1] / 1e9), rel=1e-9)


def test_newcomer31_ranking_turns_to_the_longer_calls():
    """Newcomer trial 31: ``meshplan search`` of Llama-3-70B at 128k on 256 H100 (Megatron-LM, TE's p2p
    ring) put dp_shard 4 x cp 32 x tp 2 first at 28.829 s, dp_shard 4 x cp 16 x tp 4 (tp overlap) second at
    29.056 s: every cp's attention at the held 616 / 561. With the calls rated at their shapes, per layer
    and micro-batch (cp rank 0 both): cp 32 (L 4,096, 64 / 2 = 32 q heads, pair = 2 x 4096^2 x 32 x 128)
    forward pair (1/579 + 31/638) = 6.915 ms (7.140 before), backward 2.5 pair (1/542 + 31/501) = 21.894 ms
    (19.599: its 31 upper-triangle backward calls loop over 2,048 queries, 501 TFLOP/s); cp 16 (L 8,192, 16
    q heads, pair' = 2 x 8192^2 x 16 x 128) forward pair' (1/602 + 15/646) = 6.839 ms, backward 2.5 pair'
    (1/559 + 15/542) = 20.248 ms (7.140 and 19.599 before, the same as cp 32's: cp x pair is the rank's
    whole causal call). x 80 layers x 8 micro-batches (32 / dp_shard 4): +1.325 s and +0.223 s, all of
    each step's change (no send is exposed either way): cp 32 30.154 s, cp 16 29.279 s.

    Now TE's correction kernels too (compute.te_ring: H100 Triad 2.97 TB/s, each kernel at least the
    4.7 us issue floor). Both meshes have rows = 131,072 lse rows (32 x 4,096; 16 x 8,192), n_o = n_dq =
    128 rows = 16,777,216 and n_k = n_v = 2,097,152 (4 KV heads x 4,096 x 128; 2 x 8,192 x 128), and a
    K/V buffer copy of 4 (n_k + n_v) = 16.8 MB (5.649 us) each pass. cp 32, rank 0: forward 32 lse
    kernels (at most 12 rows = 1.6 MB: floored, 4.7 us each), 31 of them beside the next call on TE's
    other flash stream (compute.te_ring.side_stream: hidden by calls of 0.2 ms; 150.4 us in series
    before), the last after the loop (4.7 us), the output's init (4 n_o + 8 rows, 22.95 us)
    and 31 half corrections (3 n_o + 4 rows = 50.9 MB, 17.125 us): 558.5 us; backward dQ 2 x 2 n_dq
    (11.297 us) + 31 x 3 n_dq (16.946 us) = 547.9 us, 66 dK/dV kernels of at most 6 n_k = 12.6 MB
    (floored, 310.2 us): 858.1 us; 1.4279 ms a layer with the copies: +0.914 s, 31.068 s. cp 16: by its
    calls rank 15 (forward pair' (1/602 + 15/638) = 6.919 ms, backward 2.5 pair' 16 / 559 = 19.669 ms:
    0.4983 ms shorter than rank 0) is the slowest with its kernels, 0.502 ms more than rank 0's: forward
    16 floored lse kernels, 15 hidden beside calls, the last 4.7 us, the init and 15 whole corrections
    (6 n_o + 8 rows = 101.7 MB, 34.25 us): 541.4 us; backward dQ 4 n_dq (22.60 us) + 15 x 6 n_dq (33.89 us),
    32 floored dK/dV kernels (150.4 us): 681.4 us; +1.2340 ms of kernels - 0.4983 ms of calls = +0.736 ms a
    layer: +0.471 s, 29.750 s, still ahead of cp 32 (both ranks hide 15 lse kernels: rank 15 stays the slowest).

    nc52fixC: NCCL's network collectives hold their channels' SMs while they run (16 rings or 4 send/recv
    channels of the H100's 132, row_shares.nccl_net_channels): both meshes' cp ring sends and FSDP
    collectives cross nodes beside the attention, so each step gains SM contention, read from the model
    (not derived per kernel): cp 32 0.049 -> 1.715 s, cp 16 0.204 -> 1.704 s (0.049 and 0.204 s the tp
    NVLink collectives' alone, as the model gave them before), exposed fsdp 0.3 and 0.2 ms less. Without
    NIC sharing: cp 32 31.068 + 1.666 = 32.734 s, cp 16 29.750 + 1.500 = 31.250 s: cp 16 still first, by
    4.5%. With NIC sharing cp 16's network collectives, slowed beside each other, overlap more compute:
    its contention 1.924 s, the step 31.469 s, the 0.219 s difference all contention; cp 32 34.194 s."""
    p32, p16 = 2 * 4096 ** 2 * 32 * 128, 2 * 8192 ** 2 * 16 * 128
    d32 = p32 * (1 / 579 + 31 / 638 - 32 / 616) + 2.5 * p32 * (1 / 542 + 31 / 501 - 32 / 561)
    d16 = p16 * (1 / 602 + 15 / 646 - 16 / 616) + 2.5 * p16 * (1 / 559 + 15 / 542 - 16 / 561)
    assert [round(x / 1e9, 3) for x in (p32 * (1 / 579 + 31 / 638), 2.5 * p32 * (1 / 542 + 31 / 501),
                                        p16 * (1 / 602 + 15 / 646), 2.5 * p16 * (1 / 559 + 15 / 542))] == [
        6.915, 21.894, 6.839, 20.248]
    assert (round(640 * d32 / 1e12, 3), round(640 * d16 / 1e12, 3)) == (1.325, 0.223)
    rows, n, nk = 131_072, 16_777_216, 2_097_152
    k = lambda b: max(b / 2.97e12, 4.7e-6)
    copies = 2 * k(4 * 2 * nk)
    te32 = (k(12 * rows) + k(4 * n + 8 * rows) + 31 * k(3 * n + 4 * rows)
            + 2 * k(2 * n) + 31 * k(3 * n) + 66 * k(6 * nk) + copies)
    te16 = (k(12 * rows) + k(4 * n + 8 * rows) + 15 * k(6 * n + 8 * rows)
            + k(4 * n) + 15 * k(6 * n) + 32 * k(6 * nk) + copies)
    calls16 = (p16 * (1 / 602 + 15 / 638) + 2.5 * p16 * 16 / 559 - p16 * (1 / 602 + 15 / 646)
               - 2.5 * p16 * (1 / 559 + 15 / 542)) / 1e12
    assert [round(x * 1e3, 4) for x in (te32, te16, calls16)] == [1.4279, 1.2340, -0.4983]
    plans = [build_plan(config_from_dict(tomllib.loads(t))) for t in (NC31_TOP1_TOML, nc31_cp16_toml())]
    # the attention's change alone: NIC sharing off (it came in beside the calls' rating, nicshare)
    steps = [step_time(p, Overlap(nic_sharing=False)).step_s for p in plans]
    want = [28.829 + 640 * d32 / 1e12 + 640 * te32, 29.056 + 640 * d16 / 1e12 + 640 * (te16 + calls16)]
    assert [round(x, 3) for x in want] == [31.068, 29.750]
    slow = [step_time(p, Overlap(nic_sharing=False)).contention_s() for p in plans]
    assert [round(x, 3) for x in slow] == [1.715, 1.704]
    before = [0.049, 0.204]   # the contention before nc52fixC (docstring): the tp collectives' alone
    assert [s - (x - b) for s, x, b in zip(steps, slow, before)] == pytest.approx(want, abs=1.5e-3)  # 1 ms prints
    assert [round(x, 3) for x in steps] == [32.734, 31.250]
    # with NIC sharing (the default) cp 32's forward sends beside its FSDP all-gathers are exposed too
    # (tests/test_nic_sharing.py): cp 16 stays first
    shared = [step_time(p).step_s for p in plans]
    assert shared[1] < shared[0] and shared[0] > steps[0]
    assert shared[1] - steps[1] == pytest.approx(step_time(plans[1]).contention_s() - slow[1], rel=1e-9)
