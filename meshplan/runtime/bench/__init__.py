"""Benchmarks on the machine at hand: ``meshplan bench comm`` (:mod:`.comm`, :mod:`.comm_worker`,
nccl-tests text and calibration) and ``meshplan bench gemm`` (:mod:`.gemm`).
"""

__all__ = ["comm", "comm_worker", "gemm"]
