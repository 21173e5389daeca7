"""Execution: the runtime transformer (:mod:`.model`, :mod:`.moe`, :mod:`.cp`), its
parallelization on a DeviceMesh (:mod:`.parallelize`, its TP/SP plan :mod:`.tensor_parallel`,
:mod:`.pipelined`, :mod:`.pipelined_stage`), the per-rank program and its timed step (:mod:`.worker`,
:mod:`.trainstep`), the collective recorder (:mod:`.recorder`), torchrun with a wall-clock
limit (:mod:`.launch`) and DCP checkpoints (:mod:`.checkpoint`).
"""

__all__ = ["buildable", "checkpoint", "cp", "launch", "model", "moe", "parallelize", "pipelined", "pipelined_stage", "recorder",
           "tensor_parallel", "trainstep", "worker"]
