"""The configurations checked by ``tests/test_memory_vs_tracker.py`` and
``benchmarks/memory_vs_tracker.py``: meshplan's memory timeline against torch's
FSDPMemTracker on the fake process group (:mod:`meshplan.runtime.validation.memcheck`).
Test data, kept out of the package."""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil, prod

from meshplan.config import Config, config_from_dict
from meshplan.runtime.validation.memcheck import TORCH_CPU_MEMORY

_FP32 = dict(param_dtype="fp32", compute_dtype="fp32", grad_dtype="fp32", optimizer_dtype="fp32",
             reduce_dtype="fp32", optimizer="adamw", flash_attention=True)


@dataclass(frozen=True)
class Case:
    """One configuration to check: ``model`` ([model] fields), ``mesh`` ([mesh] fields:
    names, shape, sequence_parallel), ``training`` (seq_len, micro_batch, sharding,
    recompute, ...; fp32 everywhere unless given). One micro-batch per step: the global
    batch is ``micro_batch x dp``."""

    name: str
    model: dict
    mesh: dict
    training: dict
    memory: dict = field(default_factory=dict)

    def config(self) -> Config:
        names, shape = self.mesh["names"], self.mesh["shape"]
        world = prod(shape)
        dp = prod(d for n, d in zip(names, shape) if n in ("dp", "dp_replicate", "dp_shard"))
        training = {**_FP32, "global_batch": self.training.get("micro_batch", 1) * dp, **self.training}
        data = {"model": self.model, "cluster": {"system": "dgx-h100", "nodes": ceil(world / 8)},
                "training": training, "mesh": {"world": world, **self.mesh},
                "memory": {**TORCH_CPU_MEMORY, **self.memory}}
        return config_from_dict(data)


DENSE = dict(name="tiny-dense", layers=2, hidden=128, ffn=256, q_heads=4, kv_heads=4, vocab=512)
GQA = dict(name="tiny-gqa", layers=2, hidden=128, ffn=256, q_heads=8, kv_heads=2, vocab=512)


def _case(name: str, model: dict, names: list, shape: list, sp: bool, **training) -> "Case":
    return Case(name, model, dict(names=names, shape=shape, sequence_parallel=sp),
                {**dict(seq_len=64, micro_batch=2, sharding="zero3", recompute="none"), **training})


#: The checked configurations: dense (MHA) and GQA, with and without SP, FSDP and HSDP,
#: recompute none and full, 8 to 64 ranks; 2 layers, hidden 128, seq 64, micro-batch 2.
CASES = (
    _case("dense tp2 sp fsdp4", DENSE, ["dp_shard", "tp"], [4, 2], True),
    _case("gqa tp2 fsdp4", GQA, ["dp_shard", "tp"], [4, 2], False),
    _case("dense fsdp8 full-recompute", DENSE, ["dp_shard"], [8], False, recompute="full"),
    _case("gqa hsdp2x4 tp2 sp full-recompute", GQA, ["dp_replicate", "dp_shard", "tp"], [2, 4, 2], True,
          sharding="hsdp", recompute="full"),
    _case("dense hsdp4x4 tp4", DENSE, ["dp_replicate", "dp_shard", "tp"], [4, 4, 4], False, sharding="hsdp"),
    _case("gqa fsdp8 tp2 sp full-recompute", GQA, ["dp_shard", "tp"], [8, 2], True, recompute="full"),
)
