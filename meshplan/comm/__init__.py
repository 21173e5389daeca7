"""Communication (layer 9): the alpha-beta cost of one collective with nccl-tests' busbw
convention (:mod:`.alphabeta`), the collective table per group and phase
(:mod:`.collectives`), nccl-tests calibration fits (:mod:`.calibration`) and the NCCL log
check (:mod:`.nccl_log`).
"""

__all__ = ["alphabeta", "calibration", "collectives", "nccl_log"]
