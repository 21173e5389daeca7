"""Scheduled step (layer 11): per-unit compute and communication streams of one rank
(:mod:`.rank_timeline`, :mod:`.backward_pass`, with :mod:`.comm_times`, :mod:`.unit_sim`, :mod:`.layer_timeline`,
:mod:`.deepspeed_layer`, :mod:`.grad_reduce`), the step time of a plan (:mod:`.steptime`, with
:mod:`.workload`, :mod:`.overlap_policy`, :mod:`.unit_times`, :mod:`.pipeline_exposure`,
:mod:`.optimizer_step`, :mod:`.step_end`, :mod:`.step_summary`, :mod:`.tp_overlap_lines`),
readiness, concurrency and load on each physical link (:mod:`.linkload`), and the network-bound
verdict (:mod:`.verdict`).
"""

__all__ = ["linkload", "rank_timeline", "steptime", "verdict"]
