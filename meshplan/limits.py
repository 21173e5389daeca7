"""Stated bounds on every input, each with the reason it is where it is (issue 13 item 3).

Every bound sits generously above the largest real system or model published, so that no
real input meets it, while the work and memory of every algorithm stay bounded at it: a
number in a config cannot make a plan run for minutes or fill the machine. Input above a
bound is malformed input (exit 2, one line naming the field, the bound and its reason).

>>> MAX_WORLD, BOUNDS["layers"].value
(1048576, 1024)
>>> over("layers", 5000)
'5000 is over the bound 1024 (8x the deepest published LLM: Llama 3 405B has 126 layers)'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Bound:
    """An upper bound ``value`` on one input and why it is there."""

    value: int | float
    reason: str


@dataclass(frozen=True)
class FileLimit:
    """The largest input file ``value`` bytes one reader reads, and why."""

    value: int
    reason: str


KiB, MiB = 1 << 10, 1 << 20

MAX_WORLD = 1 << 20
MAX_GPUS_PER_NODE = 1024
MAX_LAYERS = 1024
MAX_GLOBAL_BATCH = 1 << 18
MAX_SEQ_LEN = 1 << 24
MAX_STRING = 4096
MAX_TOML_DEPTH = 8
MAX_XML_DEPTH = 64
MAX_CPU_ID = 1 << 16
MAX_LINE_CHARS = 1 << 16
MAX_LINK_GB_PER_S = 1e6
MAX_SEARCH_WORLD = 1 << 17
MAX_MICRO_BATCHES = 4096
MAX_PIPELINE_UNITS = 1 << 19
MAX_LATENCY_US = 1e7

_WORLD = Bound(MAX_WORLD, "over 5x the largest announced training cluster, 200,000 GPUs")

#: Bounds by field name (the last part of the field's path).
BOUNDS: dict[str, Bound] = {
    "world": _WORLD,
    "nodes": _WORLD,
    "gpus": Bound(MAX_GPUS_PER_NODE, "GPUs per node: the largest NVLink domain, NVL576, has 576 GPUs"),
    "layers": Bound(MAX_LAYERS, "8x the deepest published LLM: Llama 3 405B has 126 layers"),
    "dense_layers": Bound(MAX_LAYERS, "8x the deepest published LLM: Llama 3 405B has 126 layers"),
    "hidden": Bound(1 << 17, "5x the widest published LLM: Megatron's GPT 1T has hidden 25,600"),
    "ffn": Bound(1 << 19, "5x the widest published MLP: Megatron's GPT 1T has 102,400"),
    "expert_ffn": Bound(1 << 19, "5x the widest published MLP: Megatron's GPT 1T has 102,400"),
    "shared_expert_ffn": Bound(1 << 19, "5x the widest published MLP: Megatron's GPT 1T has 102,400"),
    "q_heads": Bound(2048, "12x the most attention heads published (GPT 1T: 160)"),
    "kv_heads": Bound(2048, "12x the most attention heads published (GPT 1T: 160)"),
    "head_dim": Bound(2048, "8x the largest published head dimension (256)"),
    "qk_nope_head_dim": Bound(2048, "8x the largest published head dimension (256)"),
    "qk_rope_head_dim": Bound(2048, "8x the largest published head dimension (256)"),
    "v_head_dim": Bound(2048, "8x the largest published head dimension (256)"),
    "q_lora_rank": Bound(1 << 17, "the hidden bound (a latent narrower than the hidden size; DeepSeek-V3: 1,536)"),
    "kv_lora_rank": Bound(1 << 17, "the hidden bound (a latent narrower than the hidden size; DeepSeek-V3: 512)"),
    "vocab": Bound(1 << 23, "32x the largest published vocabulary (Gemma: 256,000)"),
    "experts": Bound(4096, "16x the most routed experts published (DeepSeek-V3: 256)"),
    "shared_experts": Bound(4096, "16x the most routed experts published (DeepSeek-V3: 256)"),
    "top_k": Bound(4096, "at most the expert bound"),
    "max_position": Bound(MAX_SEQ_LEN, "16x the longest published training context (1M tokens)"),
    "rope_theta": Bound(1e10, "10,000x the largest RoPE base in the catalog (Mixtral's 1e6, config.json)"),
    "norm_eps": Bound(0.1, "10,000x Llama 3's 1e-5 (config.json rms_norm_eps)"),
    "rope_scaling_factor": Bound(1e4, "250x the largest RoPE scaling factor in tests/data/hf (DeepSeek's yarn 40)"),
    "seq_len": Bound(MAX_SEQ_LEN, "16x the longest published training context (1M tokens)"),
    "global_batch": Bound(MAX_GLOBAL_BATCH, "4x the largest published batch: LAMB's BERT batch of 65,536 "
                                            "sequences; the step model's cost grows with the micro-batches"),
    "micro_batch": Bound(MAX_GLOBAL_BATCH, "the global batch bound"),
    "vocab_pad_divisor": Bound(1 << 16, "Megatron pads to 128; 512x that"),
    "virtual_stages": Bound(MAX_LAYERS, "at most one layer per virtual stage"),
    "layers_per_virtual_stage": Bound(MAX_LAYERS, "the layer bound"),
    "sms": Bound(1 << 16, "500x the SMs of an H100 (132)"),
    "cuda_sm": Bound(1 << 10, "10x Blackwell's compute capability 10.0 (sm 100)"),
    "nvlinks_per_gpu": Bound(1 << 10, "50x the 18 NVLinks of an H100 or B200"),
    "cores": Bound(MAX_CPU_ID, "CPU ids below 65,536: 8x Linux's largest NR_CPUS (8,192)"),
    "hbm_gb": Bound(1e5, "500x the HBM of an H200 (141 GB)"),
    "device_memory_gib": Bound(1e5, "700x the device memory of an H200 (139.8 GiB)"),
    "hbm_bandwidth_tb_per_s": Bound(1e4, "2,000x an H200 (4.8 TB/s)"),
    "peak_tflops": Bound(1e7, "5,000x an H100's dense fp8 peak (1,979 TFLOP/s)"),
    "bandwidth_gb_per_s": Bound(MAX_LINK_GB_PER_S, "1,000x NVLink 5 (900 GB/s per direction)"),
    "line_gb_per_s": Bound(MAX_LINK_GB_PER_S, "1,000x NVLink 5 (900 GB/s per direction)"),
    "busbw_gb_per_s": Bound(MAX_LINK_GB_PER_S, "1,000x NVLink 5 (900 GB/s per direction)"),
    "rate_gbit_per_s": Bound(8 * MAX_LINK_GB_PER_S, "1,000x NVLink 5 (900 GB/s per direction)"),
    "latency_us": Bound(MAX_LATENCY_US, "10 s per step: 10,000x a cross-datacenter round trip"),
    "string": Bound(MAX_STRING, "Linux's PATH_MAX; names and paths are shorter"),
    "toml depth": Bound(MAX_TOML_DEPTH, "the deepest config value, cluster.node.nics[].gpus[], is 5 levels"),
    "xml depth": Bound(MAX_XML_DEPTH, "NCCL topology dumps nest about 10 levels (CPU, PCIe switches, device)"),
    "cpu id": Bound(MAX_CPU_ID, "8x Linux's largest NR_CPUS (8,192)"),
    "line": Bound(MAX_LINE_CHARS, "NCCL, nccl-tests and nvidia-smi print lines of at most a few hundred characters"),
    "search world": Bound(MAX_SEARCH_WORLD, "the search builds its exact plans rank by rank: 16,384 GPUs take about "
                                           "6 s on 2 cores, 2^18 over 5 minutes; `meshplan plan` of one mesh goes to "
                                           "2^20"),
    "micro-batches": Bound(MAX_MICRO_BATCHES, "per step and pipeline: the scale the step model is held to "
                                              "(issue 11: GPT 1T on 16,384 GPUs, benchmarks/configs), 32x the ~128 "
                                              "of published pipeline runs; the model simulates each one"),
    "pipeline units": Bound(MAX_PIPELINE_UNITS, "pp x vpp x micro-batches, the forward passes the step model "
                                                "simulates: issue 11's GPT 1T, pp 64 x vpp 2 x 4,096"),
    "bytes": Bound(1 << 40, "1 TiB: 7x the HBM of an H200"),
    "nccl_channels": Bound(1024, "NCCL uses at most 64 channels (MAXCHANNELS)"),
    "optimizer_temp_states": Bound(64, "Adam keeps 2 states per parameter"),
    "top": Bound(100_000, "candidates shown; the search ranks at most its exact_max"),
    "exact_min": Bound(1_000_000, "exact plans built by the search, each ~10 ms"),
    "exact_max": Bound(1_000_000, "exact plans built by the search, each ~10 ms"),
    "refine_max": Bound(1_000_000, "exact plans built by the search, each ~10 ms"),
    "settle_max": Bound(1_000_000, "exact plans built by the search, each ~10 ms"),
    "rank_max": Bound(1_000_000, "exact plans built by the search, each ~10 ms"),
    "checkpoint_write_gb_per_s": Bound(1e6, "1,000x the 7 TB/s storage of Llama 3's cluster"),
    "checkpoint_read_gb_per_s": Bound(1e6, "1,000x the 7 TB/s storage of Llama 3's cluster"),
    "restart_overhead_s": Bound(1e7, "115 days"),
    "topology devices": Bound(MAX_GPUS_PER_NODE, "GPUs or NICs in one node: the largest NVLink domain has 576 GPUs"),
}

#: File size limits by reader, bytes, with reasons.
FILE_BYTES: dict[str, FileLimit] = {
    "config": FileLimit(8 * MiB, "real configs are a few KB; a rank_to_gpu list of 2^20 ranks is about 8 MB"),
    "hf_config": FileLimit(4 * MiB, "Hugging Face config.json files are a few KB"),
    "topology": FileLimit(16 * MiB, "nvidia-smi and NCCL topology dumps of one node are under 100 KB"),
    "calibration": FileLimit(1 * MiB, "a calibration file holds three small tables"),
    "nccl_tests": FileLimit(64 * MiB, "an nccl-tests run prints a few KB per size"),
    "gemm_table": FileLimit(64 * MiB, "a measured table holds a few hundred rows"),
    "kernels": FileLimit(8 * MiB, "a measured kernels.toml grid holds a few hundred points"),
    "nccl_log": FileLimit(256 * MiB, "an NCCL_DEBUG=INFO log of a few thousand ranks' init"),
}


def over(field: str, value) -> str:
    """The message for ``value`` over the bound of ``field`` (a key of :data:`BOUNDS`)."""
    b = BOUNDS[field]
    return f"{value} is over the bound {b.value:g} ({b.reason})" if isinstance(b.value, float) else \
        f"{value} is over the bound {b.value} ({b.reason})"


def bound_message(err: Mapping[str, Any]) -> str | None:
    """The message for a pydantic error dict that is one of these bounds (type
    ``less_than_equal``/``less_than`` on a field of :data:`BOUNDS`), else None: the bound
    with its reason instead of pydantic's bare "Input should be less than or equal to"."""
    name = next((str(x) for x in reversed(err.get("loc", ())) if isinstance(x, str)), "")
    if err.get("type") in ("less_than_equal", "less_than") and name in BOUNDS:
        return over(name, err.get("input"))
    return None
