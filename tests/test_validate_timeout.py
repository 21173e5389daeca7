"""validate's default wall-clock limit per world scales with the ranks per core (newcomer nc33:
a 16-rank run on 2 cores, progressing, was ended at the fixed 120 s as a stall; it passed with
--timeout-s 450, its torchrun taking 137.5 s; the 8-rank run took 80.3 s)."""

from meshplan.runtime.validation.options import Options, world_timeout_s


def test_default_limit_scales_with_ranks_per_core():
    """120 s up to 4 ranks per core; past it 120 x world / (4 x cores): world 16 on 2 cores
    120 x 16 / 8 = 240 s (1.75x the 137.5 s the run took), world 8 on 2 cores 120 s (1.5x its
    80.3 s), world 64 on 16 cores 120 s; a given --timeout-s wins."""
    assert world_timeout_s(Options(), 16, cores=2) == (240.0, "default 120 s x 16 ranks / (4 x 2 cores); "
                                                             "--timeout-s sets it")
    assert world_timeout_s(Options(), 8, cores=2)[0] == 120.0
    assert world_timeout_s(Options(), 64, cores=16)[0] == 120.0
    assert world_timeout_s(Options(timeout_s=450.0), 16, cores=2) == (450.0, "--timeout-s")
