"""Benchmarks on the machine at hand: ``meshplan bench comm`` (:mod:`.comm`, :mod:`.comm_worker`,
nccl-tests text and calibration), ``meshplan bench gemm`` (:mod:`.gemm`) and
``meshplan bench attention`` (:mod:`.attention`).
"""

__all__ = ["attention", "comm", "comm_worker", "gemm"]
