"""Scheduled step (layer 11): per-unit compute and communication streams of one rank
(:mod:`.rank_timeline`), the step time of a plan (:mod:`.steptime`), readiness, concurrency and
load on each physical link (:mod:`.linkload`), and the network-bound verdict (:mod:`.verdict`).
"""

__all__ = ["linkload", "rank_timeline", "steptime", "verdict"]
