"""The cluster of a Megatron-LM import (:func:`meshplan.interop.megatron.read`) as its launch
script states it: the node count from torchrun's ``--nnodes`` (:func:`launcher_nnodes`), NVLS off
where the script exports ``NCCL_NVLS_ENABLE=0`` (:func:`with_nvls`, :func:`fabric_nvls`), and the
GPU's catalog name (:func:`gpu_name`).
"""

from __future__ import annotations

from typing import Optional

from meshplan import catalog
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.megatron_env import nvls_off
from meshplan.interop.shell_words import default_of


def fabric_nvls(cluster: dict) -> bool:
    """Whether the NVLink fabric of a [cluster] table reduces in the switch (NVLS)."""
    if "node" in cluster:
        return bool(cluster["node"]["fabric"].get("nvls"))
    return bool(catalog.node(str(cluster["system"])).fabric.nvls)


def with_nvls(cluster: dict, exported: dict[str, str], notes: list[str]) -> dict:
    """``cluster`` without NVLS where the script exports ``NCCL_NVLS_ENABLE=0``
    (:func:`~meshplan.interop.megatron_env.nvls_off`): a resolved cluster's fabric changed in place
    of the ``fabric`` keys beside a catalog ``system``."""
    off = nvls_off(exported, fabric_nvls(cluster), notes)
    if not off or "node" not in cluster:
        return cluster | off
    node = cluster["node"] | {"fabric": cluster["node"]["fabric"] | off["fabric"]}
    return cluster | {"node": node}


def gpu_name(cluster: dict) -> str:
    """The catalog name of the GPU of a [cluster] table (:func:`~meshplan.interop.common.cluster_table`):
    its ``gpu`` (a name, or a resolved cluster's GPU fields), else its catalog node's."""
    gpu = cluster.get("gpu")
    if isinstance(gpu, dict):
        return str(gpu.get("name", ""))
    return str(gpu) if gpu else str(catalog.entry("node", cluster["system"])["gpu"])


def launcher_nnodes(args: dict, opts: ImportOptions, notes: list[str]) -> Optional[int]:
    """torchrun's ``--nnodes`` of a launch script (None when absent or ``--nodes`` is
    given: then a note when they differ); ``${VAR:-N}`` (or ``${VAR-N}``) is read as ``N``, what
    bash gives where ``VAR`` is unset (Bash Reference Manual 3.5.3; a note says so: newcomer trial 49,
    ``--nnodes ${SLURM_NNODES:-128}``); an elastic range or another unresolved variable asks for
    ``--nodes``."""
    v = args.get("--nnodes")
    if v is None:
        return None
    word, v = str(v), default_of(str(v))
    if opts.nodes is not None:
        if v != str(opts.nodes):
            notes.append(f"--nodes {opts.nodes} used; the launch script's --nnodes {word} is not")
        return None
    if not (v.isascii() and v.isdigit() and len(v) <= 9) or int(v) < 1:
        raise ConfigError("--nodes", f"the launch script's --nnodes is {word!r}, not a node count; give --nodes N")
    if v != word:
        notes.append(f"the launch script's --nnodes {word} read as its default, {v} nodes (bash's value where the "
                     f"variable is unset); give --nodes N to plan another count")
    return int(v)
