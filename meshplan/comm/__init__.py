"""Communication (layer 9): the alpha-beta cost of one collective with nccl-tests' busbw
convention (:mod:`.alphabeta`), the collective table per group and phase
(:mod:`.collectives`), nccl-tests calibration fits (:mod:`.calibration`), the calibration
file from a user's nccl-tests runs (:mod:`.calibrate`) and the NCCL log: its reader
(:mod:`.nccl_log`), what it holds (:mod:`.nccl_records`) and its check against the placement
(:mod:`.nccl_check`). Measured busbw curves per link class come from the catalog
(``catalog/nccl.toml``).
"""

__all__ = ["alphabeta", "calibrate", "calibration", "collectives", "nccl_check", "nccl_log", "nccl_records"]
