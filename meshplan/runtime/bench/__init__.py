"""Benchmarks on the machine at hand: ``meshplan bench comm`` (:mod:`.comm`, :mod:`.comm_worker`,
and what it writes, nccl-tests text and calibration: :mod:`.comm_results`), ``meshplan bench gemm``
(:mod:`.gemm`) and ``meshplan bench attention`` (:mod:`.attention`).
"""

__all__ = ["attention", "comm", "comm_results", "comm_worker", "gemm"]
