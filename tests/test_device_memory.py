"""The device memory the runtime reports (catalog ``device_memory_gib``), each figure as its public
source quotes it (newcomer trial 27: plans showed a100-sxm-80gb as 74.5 GiB, 80e9 B, where torch
reports a total capacity of 79.25 GiB)."""

from meshplan import catalog
from meshplan.units import GiB

#: catalog GPU -> the runtime's total in GiB as quoted (gpus.toml's source names where).
QUOTED_GIB = {
    "a100-sxm-80gb": 79.25,            # levihsu/OOTDiffusion #235: "79.25 GiB total capacity"
    "a100-sxm-40gb": 42298834944 / GiB,  # bottlerocket #3873 deviceQuery: "(42298834944 bytes)"
    "h100-sxm5-80gb": 79.11,           # vllm-project/vllm #27508: "total capacity of 79.11 GiB"
    "h200-sxm-141gb": 139.80,          # torch OOM logs on H200: "total capacity of 139.80 GiB"
    "b200-sxm-180gb": 178.35,          # pytorch/ao #4002: "Total Global Memory: 178.35"
    "mi300x-oam-192gb": 191.98,        # ROCm blog, MI300X: "total capacity of 191.98 GiB"
}
#: parts with no public runtime figure: the datasheet's GB stay what plans fit into.
NOT_PUBLISHED = {"h100-hbm2e-96gb-500w", "h800-sxm-80gb", "b200-gb200-186gb"}


def test_every_gpu_has_a_quoted_runtime_total_or_says_none_was_found():
    assert set(QUOTED_GIB) | NOT_PUBLISHED == set(catalog.names("gpu"))
    for name, gib in QUOTED_GIB.items():
        gpu = catalog.gpu(name)
        assert gpu.device_memory_gib == gib, name
        assert f"device_memory_gib {gib:.2f}" in gpu.source or "42298834944 B / 2**30" in gpu.source, name
    for name in NOT_PUBLISHED:
        gpu = catalog.gpu(name)
        assert gpu.device_memory_gib == 0 and "device_memory_gib: NOT set" in gpu.source, name


def test_the_runtime_total_lies_below_the_hbm_stacks_and_above_the_datasheet_gb():
    """NVIDIA's 80GB parts: 80 GiB of stacks (NVML 81920 MiB on A100), the driver keeps some:
    80e9 B = 74.51 GiB < 79.25 GiB < 80 GiB. H200: 141e9 B = 131.3 GiB < 139.80 < 141 GiB."""
    for name, gib in QUOTED_GIB.items():
        gpu = catalog.gpu(name)
        assert gpu.hbm_gb * 1e9 / GiB < gib < gpu.hbm_gb, name
