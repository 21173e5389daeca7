"""A search heavy in Transformer Engine's p2p ring (compute.te_ring.te_rank): newcomer trial 31's
256-GPU Megatron-LM job (tests.configs.NC31_TOP1_TOML: llama3-70b, 128k tokens, cp_attention p2p),
searched with one worker.

Prints the search's CPU seconds (``time.process_time``: on a shared 2-core machine the wall time
varies with the other processes), the CPU seconds spent inside ``te_rank`` (wrapped here) and its
calls, te_ring's memo (hits, misses) where it has one, and the top rows' steps and peaks, which
a speed change must leave as they are. Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_te_ring.py``.
"""

from __future__ import annotations

import time
import tomllib

from meshplan.compute import te_ring
from meshplan.config import config_from_dict
from meshplan.search.driver import search
from tests.configs import NC31_TOP1_TOML


def main() -> None:
    spent = [0.0, 0]
    inner = te_ring.te_rank

    def timed(*a, **k):
        t0 = time.process_time()
        try:
            return inner(*a, **k)
        finally:
            spent[0] += time.process_time() - t0
            spent[1] += 1

    te_ring.te_rank = timed  # attention.flash_ops calls it through the module
    cfg = config_from_dict(tomllib.loads(NC31_TOP1_TOML))
    c0, w0 = time.process_time(), time.perf_counter()
    r = search(cfg, workers=1)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    print(f"search CPU {cpu:.1f} s (wall {wall:.1f} s); te_rank: {spent[1]} calls, {spent[0]:.2f} CPU-s; "
          f"{len(r.candidates):,} candidates")
    memo = getattr(te_ring, "_slowest", None)
    if memo is not None:
        print(f"te_ring memo: {memo.cache_info()}")
    for e in r.top[:5]:
        print(f"  candidate {e.index}: step {e.step_s!r} s, peak {e.peak_bytes!r} B")


if __name__ == "__main__":
    main()
