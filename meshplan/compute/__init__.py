"""Compute (layer 7): local GEMM and attention shapes per rank (:mod:`.shapes`), GEMM
efficiency by shape (:mod:`.gemm`) and per-op FLOP and time, MFU/HFU (:mod:`.ops`).
"""

__all__ = ["gemm", "ops", "shapes"]
