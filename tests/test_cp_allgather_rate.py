"""All-gather CP's attention (``training.cp_attention = "allgather"``: K and V gathered, one causal
call of the rank's ``L = s / cp`` queries against the ``s`` keys) rated at its own (L, s) shape, as
a ring's calls are (meshplan.compute.attention, ring_attention.rate_lengths): the forward (a block
per 128 queries, FlashAttention-2/3's ``grid(num_m_block, b, h)``) at its loop over the keys, the
backward (a block per 128 keys, ``num_blocks_n = ceil_div(seqlen_k, kBlockN)``) at its loop over
the queries. Before, both passes were read at ``s``."""

from __future__ import annotations

import pytest

from meshplan import catalog
from meshplan.compute.attention import flash_ops
from meshplan.compute.ops import Workload
from meshplan.compute.shapes import Attention

H100 = catalog.gpu("h100-sxm5-80gb")


def _ms(att: Attention, cp: int) -> list[float]:
    ops = flash_ops(H100, att, Workload(seq_len=att.seq_kv, cp=cp), False)
    return [o.seconds * 1e3 for o in ops if o.kind == "attention"]


def test_allgather_backward_reads_the_local_length():
    """Llama-3-8B's attention at s 8,192, cp 8: L = 1,024 queries on the rank, 32 q heads, d 128, b 1.
    FLOP forward 4 b h L s d / 2 (causal) = 4 x 32 x 1024 x 8192 x 128 / 2 = 6.872e10. H100 FA3
    rows (public-microbenchmarks S7c, S8): forward causal d128 at S 8,192 (its loop over the 8,192
    keys, s / 2 on average under the causal mask, as the square row's): 602 TFLOP/s, 0.11415 ms;
    backward at S 1,024 (each of the 64 key blocks loops over the rank's queries, L / 2 on average):
    424 TFLOP/s, 2.5 x 6.872e10 / 424e12 = 0.40519 ms; read at S 8,192 before: 559, 0.30733 ms."""
    att = Attention(1, 32, 8, 1024, 8192, 128)
    fwd = 4 * 32 * 1024 * 8192 * 128 / 2
    assert fwd == pytest.approx(6.872e10, rel=1e-3)
    got = _ms(att, 8)
    assert [round(x, 5) for x in got] == [round(fwd / 602e9, 5), round(2.5 * fwd / 424e9, 5)] == [0.11415, 0.40519]
    assert round(2.5 * fwd / 559e9, 5) == 0.30733   # before: the backward at S 8,192


def test_allgather_at_cp1_is_the_square_call():
    """cp 1 (L = s = 4,096): the same call as before, both passes at S 4,096: FA3 causal forward 579,
    backward 542 TFLOP/s; FLOP 4 x 32 x 4096^2 x 128 / 2 = 1.3744e11: 0.23737 and 0.63394 ms."""
    fwd = 4 * 32 * 4096 ** 2 * 128 / 2
    assert [round(x, 5) for x in _ms(Attention(1, 32, 8, 4096, 4096, 128), 1)] == [
        round(fwd / 579e9, 5), round(2.5 * fwd / 542e9, 5)] == [0.23737, 0.63394]
