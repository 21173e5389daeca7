"""DeepSpeed ZeRO++ (:mod:`meshplan.comm.zeropp`) on a low-bandwidth cluster: an external sanity
line, not a fidelity row (nothing here is a published step time of this workload, and nothing is
fitted to anything).

The ZeRO++ paper (Wang et al., arXiv 2306.10209, abstract) reports "up to 2.16x better throughput at
384 GPU scale" on low-bandwidth clusters, communication volume cut 4x. Its models, batch and network
are not this config's; the config (benchmarks/zeropp/llama3-70b_384xa100_1nic100g.toml) takes 48
HGX A100 nodes with one 100 Gb/s NIC each, Llama 3 70B, seq 2048, micro-batch 1, 2 micro-batches a
step, DeepSpeed's ZeRO-3 over all 384 ranks, and prints meshplan's step with each ZeRO++ switch
alone and all three (hpZ g = 8, the node).

    PYTHONPATH=. .venv/bin/python benchmarks/zeropp_sanity.py
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time

CONFIG = Path(__file__).parent / "zeropp" / "llama3-70b_384xa100_1nic100g.toml"
SWITCHES = {"plain ZeRO-3": {}, "hpZ 8": {"zero_hpz_partition_size": 8}, "qwZ": {"zero_quantized_weights": True},
            "qgZ": {"zero_quantized_gradients": True},
            "hpZ 8 + qwZ + qgZ": {"zero_hpz_partition_size": 8, "zero_quantized_weights": True,
                                  "zero_quantized_gradients": True}}


def main() -> None:
    base = tomllib.loads(CONFIG.read_text())
    first = None
    print(f"{'setting':<20} {'step (s)':>9} {'exposed (s)':>12} {'peak (GiB)':>11} {'speed-up':>9}")
    for name, keys in SWITCHES.items():
        d = {**base, "training": {**base["training"], **keys}}
        plan = build_plan(config_from_dict(d))
        st = step_time(plan)
        first = first or st.step_s
        print(f"{name:<20} {st.step_s:9.2f} {sum(st.exposed_s.values()):12.2f} "
              f"{plan.timeline.peak.total_bytes / 2**30:11.1f} {first / st.step_s:8.2f}x")
    print("ZeRO++ paper (arXiv 2306.10209): up to 2.16x at 384 GPUs on low-bandwidth clusters (external, not tuned)")


if __name__ == "__main__":
    main()
