"""Compute (layer 7): local GEMM and attention shapes per rank (:mod:`.shapes`), kernel
measurements shipped in the catalog and their interpolation (:mod:`.measured`), GEMM time by
shape (:mod:`.gemm`) and per-op FLOP and time, MFU/HFU (:mod:`.ops`), Megatron-LM 2022's own
kernels around the GEMMs as bytes (:mod:`.megatron`).
"""

__all__ = ["gemm", "measured", "ops", "shapes"]
