"""The fused attention's shape model, and the catalog's attention rows read below their shortest
length (:func:`below_rows`), as :mod:`meshplan.compute.gemm_points` reads the GEMM points below
their box.

The shape model (:func:`flash_efficiency`): a flash kernel runs one thread block per 128 rows of
the dimension it parallelises (forward: the queries, FlashAttention-2's ``kBlockM`` 128 at head
dim 128, ``flash_fwd_launch_template.h`` ``grid(num_m_block, b, h)``; backward: the keys,
``run_flash_bwd_seqk_parallel`` ``grid_n(num_n_block, b, h)``, and FlashAttention-3's
``hopper/flash_bwd_launch_template.h`` ``num_blocks_n = ceil_div(seqlen_k, kBlockN)``,
Dao-AILab/flash-attention 000786d) and loops over the other in blocks of 128. Its efficiency is
the fraction of the SMs its blocks' waves keep busy, ``tiles / (waves x SMs)`` (``tiles = b x h x
ceil(par / 128)``, ``waves = ceil(tiles / SMs)``), times the fraction of its loop's last block
that is real work, ``loop / (128 ceil(loop / 128))``. The model leaves out each block's fixed
prologue and epilogue (loading Q, writing O), which the measured rows hold: below the rows a
short call, latency-bound, may take longer than the model says. No public A100 or H100 measurement
below 512 tokens was found to time that fixed cost from (searched Dec 2026: flash-attention issue
#591 asks for 64-256 token numbers and the maintainer has none; issue #477's 128-256 token runs
are on an RTX 4090, not a catalog GPU), so none is modelled.

Below the rows (:func:`below_rows`): the catalog's rows (flash-attention's
``benchmarks/benchmark_flash_attention.py`` and FA3's hopper benchmark: ``bs_seqlen_vals``
(32, 512) .. (1, 16384), 16k tokens, ``nheads = 2048 // headdim``) start at 512 tokens; a call
whose parallel or loop length is shorter than a row's first length is read at the edge ``(max(par,
S0), max(loop, S0))`` and scaled by ``min(1, eff(call) / eff(edge))``, both at the call's own
batch and heads: the measured level at the edge, the model only for how it falls as the call
shrinks (capped at 1: never above the measurement). Before, such a call read the 512 rate itself.
"""

from __future__ import annotations

from math import ceil

#: Rows of the parallelised dimension per thread block, and of the loop per iteration (module docstring).
FLASH_BLOCK = 128


def flash_waves(sms: int, heads: int, par: int) -> float:
    """Fraction of ``sms`` SMs busy over a flash call's waves: ``heads`` = batch x q heads
    blocks' columns, ``par`` rows of the parallelised dimension (module docstring).

    >>> flash_waves(132, 8, 512)       # 32 blocks in one wave of 132
    0.24242424242424243
    >>> flash_waves(132, 32 * 16, 512)   # the benchmark's (32, 512) at 16 heads: 2,048 blocks in 16 waves
    0.9696969696969697
    """
    tiles = heads * ceil(par / FLASH_BLOCK)
    return tiles / (ceil(tiles / sms) * sms)


def flash_efficiency(sms: int, heads: int, par: int, loop: int) -> float:
    """The shape model's efficiency of one flash call (module docstring): :func:`flash_waves` x
    the real fraction of the loop's blocks.

    >>> round(flash_efficiency(132, 8, 256, 200), 4)   # 16 blocks of 132; 200 of 256 loop rows
    0.0947
    """
    return flash_waves(sms, heads, par) * loop / (FLASH_BLOCK * ceil(loop / FLASH_BLOCK))


def below_rows(sms: int, heads: int, par: int, loop: int, first: int) -> tuple[float, str]:
    """(ratio, how) of a call of ``par`` parallel and ``loop`` loop rows (``heads`` = batch x q
    heads) against a row whose shortest length is ``first``: 1.0 and "" at or above it, else
    ``min(1, eff(call) / eff(edge))`` (:func:`flash_efficiency`; module docstring).

    >>> below_rows(132, 8, 1024, 1024, 512)
    (1.0, '')
    >>> r, how = below_rows(132, 8, 256, 512, 512)   # 16 blocks against 32: half the SMs' share
    >>> r, how
    (0.5, 'x0.500 (shape model: 16 blocks of 128 over 512-row loops, capped at 1) of the 512x512 edge')
    """
    if par >= first and loop >= first:
        return 1.0, ""
    edge = (max(par, first), max(loop, first))
    ratio = min(1.0, flash_efficiency(sms, heads, par, loop) / flash_efficiency(sms, heads, *edge))
    tiles = heads * ceil(par / FLASH_BLOCK)
    return ratio, (f"x{ratio:.3f} (shape model: {tiles} blocks of {FLASH_BLOCK} over {loop}-row loops, capped at 1) "
                   f"of the {edge[0]}x{edge[1]} edge")
