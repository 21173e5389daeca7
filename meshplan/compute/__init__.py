"""Compute (layer 7): local GEMM and attention shapes per rank (:mod:`.shapes`), kernel
measurements shipped in the catalog and their interpolation (:mod:`.measured`), GEMM time by
shape (:mod:`.gemm`) and per-op FLOP and time, MFU/HFU (:mod:`.ops`).
"""

__all__ = ["gemm", "measured", "ops", "shapes"]
