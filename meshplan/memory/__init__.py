"""Memory (layer 8): persistent model state (:mod:`.state`), activations per layer
(:mod:`.activations`, Korthikanti et al. 2022 Table 2), sizes of every tensor class
(:mod:`.sizes`), per-stage op lists (:mod:`.schedule`), timeline passes (:mod:`.passes`;
its FSDP units' events: :mod:`.unit_events`),
which template each pass of a step repeats and the peak, on arrays (:mod:`.passtable`,
:mod:`.peakscan`) and pass by pass (:mod:`.reference`), the per-rank memory timeline
(:mod:`.timeline`), PyTorch's CUDA caching allocator simulated on it for the reserved bytes
(:mod:`.allocator`, :mod:`.reserved`), and the first capacity estimates that say which axis each degree solves (:mod:`.constraints`).
"""

__all__ = ["activations", "allocator", "constraints", "passes", "passtable", "peakscan", "reference", "reserved", "schedule", "sizes",
           "state", "timeline"]
