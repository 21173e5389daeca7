"""Runtime (layer 16): running planned meshes for real. The only package that imports torch.
:mod:`.execution` (the runner), :mod:`.validation` (validate and its checks), :mod:`.testbed`
(network-namespace cluster, no torch) and :mod:`.bench` (GEMM and collective benchmarks).
"""

__all__ = ["bench", "execution", "testbed", "validation"]
