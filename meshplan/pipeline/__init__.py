"""Pipeline schedules (layer 5): per-stage op orders of GPipe, 1F1B, interleaved 1F1B and
ZB-H1, their dependencies and an event simulation of one step (:mod:`.simulate`): bubble,
critical path, Perfetto trace. Pure functions of (schedule, p, m, v); no model or cluster.
"""

__all__ = ["simulate"]
