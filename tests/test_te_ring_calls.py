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
from meshplan.compute.ops import Workload, framework_kernels
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
    tie, rank 0. pair = 2 x 49152^2 x 8 x 128 = 4.948e12 FLOP: forward pair (1/616 + 1/648) =
    15.668 ms (16.064 ms as one causal call at 616), backward 2.5 pair x 2 / 561 = 44.098 ms (the same).

    cp 8: L 12,288 = 1.5 x 8,192, L/2 6,144 = 1.5 x 4,096, both F = log2 1.5 = 0.585 of the way
    up: causal 602 + F (616 - 602) = 610.19, unmasked at L 646 + 2 F = 647.17, at L/2 638 + 8 F =
    642.68; backward at L 559 + 2 F = 560.17, at L/2 542 + 17 F = 551.94. Rank r: forward pair
    (1/610.19 + r/642.68 + (7 - r)/647.17), backward 2.5 pair ((1 + r)/560.17 + (7 - r)/551.94);
    each step of r adds pair (1/642.68 - 1/647.17) forward and takes 2.5 pair (1/551.94 - 1/560.17)
    backward, more: rank 0 is the slowest. pair = 2 x 12288^2 x 8 x 128 = 3.092e11: forward
    3.852 ms (4.016 ms before), backward 11.185 ms (11.025 ms).

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

    pairs = {}
    for cp, k, rates, ms in ((8, 4, [610.19, 647.17, 642.68, 560.17, 551.94], [3.852, 11.185]),
                             (32, 2, [554.93, 632.60, 600.10, 524.98, 469.04], [0.982, 3.286])):
        got, pairs[cp], rank = _between_points(cp, k)
        assert [round(x, 2) for x in got] == rates
        assert max(range(cp), key=lambda r: sum(rank(r))) == 0
        assert [round(x, 3) for x in rank(0)] == ms
        assert _attention_ms(_megatron(cp)) == pytest.approx(rank(0), rel=1e-9)
    # before: the whole causal (L, s) call at the held 616 / 561, the same rate at every cp
    before = lambda cp, pair: (cp * pair / CAUSAL[-1] / 1e9, 2.5 * cp * pair / BWD[-1] / 1e9)
    assert [round(x, 3) for x in before(32, pairs[32])] == [1.004, 2.756]
    assert [round(x, 3) for x in before(8, pairs[8])] == [4.016, 11.025]


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
    29.056 s: every cp's attention at the held 616 / 561. Now, per layer and micro-batch (cp rank 0 both):
    cp 32 (L 4,096, 64 / 2 = 32 q heads, pair = 2 x 4096^2 x 32 x 128) forward pair (1/579 + 31/638) =
    6.915 ms (7.140 before), backward 2.5 pair (1/542 + 31/501) = 21.894 ms (19.599: its 31 upper-triangle
    backward calls loop over 2,048 queries, 501 TFLOP/s); cp 16 (L 8,192, 16 q heads, pair' = 2 x 8192^2 x
    16 x 128) forward pair' (1/602 + 15/646) = 6.839 ms, backward 2.5 pair' (1/559 + 15/542) = 20.248 ms
    (7.140 and 19.599 before, the same as cp 32's: cp x pair is the rank's whole causal call). x 80 layers x
    8 micro-batches (32 / dp_shard 4): +1.325 s and +0.223 s, all of each step's change (no send is
    exposed either way): cp 32 30.154 s, cp 16 29.279 s, which now ranks first (search row 1)."""
    p32, p16 = 2 * 4096 ** 2 * 32 * 128, 2 * 8192 ** 2 * 16 * 128
    d32 = p32 * (1 / 579 + 31 / 638 - 32 / 616) + 2.5 * p32 * (1 / 542 + 31 / 501 - 32 / 561)
    d16 = p16 * (1 / 602 + 15 / 646 - 16 / 616) + 2.5 * p16 * (1 / 559 + 15 / 542 - 16 / 561)
    assert [round(x / 1e9, 3) for x in (p32 * (1 / 579 + 31 / 638), 2.5 * p32 * (1 / 542 + 31 / 501),
                                        p16 * (1 / 602 + 15 / 646), 2.5 * p16 * (1 / 559 + 15 / 542))] == [
        6.915, 21.894, 6.839, 20.248]
    assert (round(640 * d32 / 1e12, 3), round(640 * d16 / 1e12, 3)) == (1.325, 0.223)
    plans = [build_plan(config_from_dict(tomllib.loads(t))) for t in (NC31_TOP1_TOML, nc31_cp16_toml())]
    # the attention's change alone: NIC sharing off (it came in beside this change, nicshare)
    steps = [step_time(p, Overlap(nic_sharing=False)).step_s for p in plans]
    assert [round(x, 3) for x in steps] == [round(28.829 + 1.325, 3), round(29.056 + 0.223, 3)] == [30.154, 29.279]
    # with NIC sharing (the default) cp 32's forward sends beside its FSDP all-gathers are exposed too
    # (tests/test_nic_sharing.py): cp 16 stays first
    shared = [step_time(p).step_s for p in plans]
    assert shared[1] < shared[0] and shared[0] > steps[0] and round(shared[1], 3) == 29.279
