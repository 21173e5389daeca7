"""Testbed: an emulated multi-node cluster in network namespaces (:mod:`.netns`, :mod:`.routes`),
per-rank NICs and byte counters (:mod:`.nics`), torchrun per node namespace (:mod:`.launch`) and
validate on the testbed (:mod:`.run`). Imports no torch.
"""

__all__ = ["launch", "netns", "nics", "routes", "run"]
