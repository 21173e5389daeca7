"""The gradient buckets of the ``[memory]`` table and the bytes DeepSpeed ZeRO-3's parameter
coordinator holds: what ``grad_bucket_elements``, ``deepspeed_prefetch_elements`` and
``deepspeed_max_live_elements`` (documented on :class:`meshplan.spec.memory.MemoryOptions`) come to
under a training contract, torch DDP's and Megatron-Core's bucket or DeepSpeed's, on one rank's ints
or on the search's numpy arrays alike.

>>> MemoryBuckets().bucket_elements(8), MemoryBuckets(grad_bucket_elements=1000).deepspeed_bucket_elements()
(40000000, 1000)
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from meshplan.spec.deepspeed_memory import (DEEPSPEED_MAX_LIVE_ELEMENTS, DEEPSPEED_PREFETCH_ELEMENTS,
                                            DEEPSPEED_REDUCE_BUCKET_ELEMENTS, deepspeed_bucket_bytes)
from meshplan.spec.memory_fields import MemoryFields
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes


class MemoryBuckets(MemoryFields):
    """The gradient bucket and DeepSpeed's coordinator bytes of :class:`MemoryFields` (the base of
    :class:`meshplan.spec.memory.MemoryOptions`, whose docstring gives the fields and their sources)."""

    def bucket_elements(self, dp_size):
        """Gradient bucket of the non-FSDP shardings, elements (see the docstring of
        :class:`~meshplan.spec.memory.MemoryOptions`). ``dp_size``: an int, or a numpy array (the
        search's candidates) giving an array.

        >>> MemoryBuckets().bucket_elements(8), MemoryBuckets().bucket_elements(128)
        (40000000, 128000000)
        >>> MemoryBuckets().bucket_elements(np.array([8, 128])).tolist()
        [40000000, 128000000]
        """
        out = np.maximum(40_000_000, 1_000_000 * np.asarray(dp_size, dtype=np.int64))
        if self.grad_bucket_elements is not None:
            out = np.full_like(out, self.grad_bucket_elements)
        return out if np.ndim(dp_size) else int(out)

    def grad_bucket_bytes(self, training: TrainingSpec, dp_size, params_numel):
        """Bytes of the gradient bucket of a rank without FSDP units (the caller checks
        that): ``min(bucket_elements(dp_size), params_numel) x reduce-dtype bytes`` when the
        gradients are reduced in a bucket: zero2 (reduce-scatter per bucket every backward)
        or a reduce dtype that differs from the gradient dtype (a cast copy); else 0.
        ``dp_size`` and ``params_numel`` (the rank's parameter elements): ints, or numpy
        arrays that broadcast, as in the search's (candidates, stages) arrays. Under
        ``training.zero12_engine = "deepspeed"``: :meth:`deepspeed_bucket_bytes`.

        >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", grad_dtype="bf16", reduce_dtype="fp32")
        >>> MemoryBuckets().grad_bucket_bytes(t, 8, 10**9) == 40_000_000 * 4
        True
        """
        if training.zero12_engine == "deepspeed":
            return self.deepspeed_bucket_bytes(training, params_numel)
        if training.sharding != "zero2" and training.grad_dtype == training.reduce_dtype:
            return 0 * params_numel
        out = np.minimum(self.bucket_elements(dp_size), params_numel) * dtype_bytes(training.reduce_dtype)
        return out if np.ndim(out) else int(out)

    def grad_bucket_acts(self, training: TrainingSpec) -> Optional[int]:
        """``grad_bucket_elements`` as it acts under ``training``: DeepSpeed's ``reduce_bucket_size``
        (:meth:`deepspeed_bucket_elements`, unset its default 5e8) under a DeepSpeed engine
        (``zero12_engine = "deepspeed"``, or a DeepSpeed ``zero3_engine`` at sharding zero3), else
        the field as given; what ``meshplan compare`` weighs (:func:`meshplan.compare.differences.config_differences`),
        so a ZeRO-2 import's explicit 5e8 and a ZeRO-3 import's unset one are no difference.

        >>> t = TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed")
        >>> MemoryBuckets().grad_bucket_acts(t), MemoryBuckets().grad_bucket_acts(TrainingSpec(global_batch=8, seq_len=16))
        (500000000, None)
        """
        deepspeed = training.zero12_engine == "deepspeed" or (
            training.sharding == "zero3" and training.zero3_engine != "fsdp2")
        return self.deepspeed_bucket_elements() if deepspeed else self.grad_bucket_elements

    def deepspeed_prefetch_bytes(self, training: TrainingSpec) -> Optional[tuple[int, int]]:
        """(prefetch, live) bytes of DeepSpeed ZeRO-3's parameter coordinator under
        ``training.zero3_engine = "deepspeed"`` at sharding zero3 (``deepspeed_prefetch_elements``
        and ``deepspeed_max_live_elements``, unset DeepSpeed's 5e7 and 1e9, x the parameter dtype's
        bytes, which DeepSpeed gathers), else None (FSDP2's ``prefetch_layers``).

        >>> t = TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed")
        >>> MemoryBuckets().deepspeed_prefetch_bytes(t), MemoryBuckets().deepspeed_prefetch_bytes(TrainingSpec(
        ...     global_batch=8, seq_len=16))
        ((100000000, 2000000000), None)
        """
        if training.sharding != "zero3" or training.zero3_engine != "deepspeed":
            return None
        p = dtype_bytes(training.param_dtype)
        prefetch = DEEPSPEED_PREFETCH_ELEMENTS if self.deepspeed_prefetch_elements is None \
            else self.deepspeed_prefetch_elements
        live = DEEPSPEED_MAX_LIVE_ELEMENTS if self.deepspeed_max_live_elements is None \
            else self.deepspeed_max_live_elements
        return prefetch * p, live * p

    def deepspeed_bucket_elements(self) -> int:
        """DeepSpeed ZeRO-1/2's ``reduce_bucket_size``, elements: ``grad_bucket_elements``, or
        DeepSpeed's default 5e8 (:data:`DEEPSPEED_REDUCE_BUCKET_ELEMENTS`).

        >>> MemoryBuckets().deepspeed_bucket_elements(), MemoryBuckets(grad_bucket_elements=1000).deepspeed_bucket_elements()
        (500000000, 1000)
        """
        return self.grad_bucket_elements or DEEPSPEED_REDUCE_BUCKET_ELEMENTS

    def deepspeed_bucket_bytes(self, training: TrainingSpec, params_numel):
        """Bytes DeepSpeed ZeRO-1/2 holds for its gradient buckets during a backward:
        :func:`meshplan.spec.deepspeed_memory.deepspeed_bucket_bytes` with ``B`` =
        :meth:`deepspeed_bucket_elements` (``params_numel``: an int or a numpy array)."""
        return deepspeed_bucket_bytes(self.deepspeed_bucket_elements(), training, params_numel)
