"""``CUDA_DEVICE_MAX_CONNECTIONS``, the environment variable Megatron-LM checks at start-up (megaenv
finding 1): one rule (:func:`max_connections`) for the three places that speak of it, the header of
``export --to megatron`` (:func:`env_note`), ``launch``'s ``torchrun.sh`` for a Megatron-LM plan
(:func:`launch_env`) and the import of a launch script that exports it (:func:`import_note`); the
script's other exports are listed by the import as not used and carried into an export's header
(:func:`carried_env`), as its unplanned flags are carried. Transformer Engine's ``UB_SKIPMC``, which
``--tp-comm-overlap`` needs on GPUs before Hopper (:data:`UB_SKIPMC`, :func:`ub_skipmc`), is set the same way.

The rule, ``megatron/training/arguments.py`` ``validate_args`` at NVIDIA/Megatron-LM d98e8a6:

- lines 1453-1479: with ``tensor_model_parallel_size > 1`` or ``context_parallel_size > 1`` and
  ``get_device_arch_version() < 10`` (the compute capability's major, ``torch.cuda.
  get_device_properties(...).major``, megatron/training/utils/common_utils.py:527; "no longer
  exists since the Blackwell architecture"), it asserts ``CUDA_DEVICE_MAX_CONNECTIONS == "1"``
  unless Torch FSDP2 or Megatron FSDP runs (then only a warning) or
  ``--overlap-moe-expert-parallel-comm`` (which meshplan notes as not modelled and does not write);
- lines 1048 and 1166: under ``--use-torch-fsdp2`` and ``--use-megatron-fsdp`` it asserts the
  variable is not ``"1"``, whatever tp and cp (:func:`~meshplan.interop.megatron_write.fsdp_env_note`
  says so in an export's header).

Sequence parallelism needs tp > 1 (Megatron-LM), so it is covered by the tp condition.
"""

from __future__ import annotations

import re
import shlex
from typing import Optional

from meshplan.config import Config
from meshplan.interop.megatron_flags import FSDP_ENV
from meshplan.interop.shell_words import unquote
from meshplan.interop.tomlout import resolved

#: The compute capability major of each catalog GPU, what Megatron-LM's ``get_device_arch_version``
#: returns: NVIDIA's CUDA GPU compute capability table (developer.nvidia.com/cuda-gpus): A100 8.0,
#: H100 / H800 / H200 9.0 (Hopper), B200 and GB200 10.0 (Blackwell); MI300X (gfx942) reports major
#: 9 under ROCm (HIP's ``hipDeviceProp_t.major``/``minor`` 9.4 for gfx942, which torch.cuda reports).
ARCH_MAJOR = {"a100-sxm-80gb": 8, "a100-sxm-40gb": 8, "h100-sxm5-80gb": 9, "h100-hbm2e-96gb-500w": 9,
              "h800-sxm-80gb": 9, "h200-sxm-141gb": 9, "b200-sxm-180gb": 10, "b200-gb200-186gb": 10,
              "mi300x-oam-192gb": 9}
#: The first major Megatron-LM exempts (``get_device_arch_version() < 10``).
BLACKWELL = 10
#: Where the rule is, for the lines that cite it.
SOURCE = "arguments.py validate_args at Megatron-LM d98e8a6"


def max_connections(gpu: str, tp: int, cp: int, fsdp: bool) -> tuple[Optional[str], str]:
    """(what Megatron-LM needs of :data:`FSDP_ENV` on ``gpu`` (a catalog name) at ``tp`` and ``cp``,
    ``fsdp`` meaning Torch FSDP2 or Megatron FSDP: ``"1"``, ``"unset"`` (not 1) or None (nothing),
    why in words) by the module's rule. A GPU :data:`ARCH_MAJOR` does not know is taken as before
    Blackwell, and the words say so: 1 is then what Megatron-LM asserts, and harmless after.

    >>> max_connections("h100-sxm5-80gb", 8, 1, False)
    ('1', 'Megatron-LM asserts it is 1 with tp 8 on GPUs before Blackwell (h100-sxm5-80gb: compute capability 9)')
    >>> max_connections("b200-sxm-180gb", 8, 1, False)[0], max_connections("h100-sxm5-80gb", 1, 1, False)[0]
    (None, None)
    >>> max_connections("a100-sxm-80gb", 1, 2, True)[0]
    'unset'
    """
    if fsdp:
        return "unset", "Megatron-LM asserts it is not 1 under --use-megatron-fsdp and --use-torch-fsdp2"
    parallel = " and ".join(f"{a} {d}" for a, d in (("tp", tp), ("cp", cp)) if d > 1)
    if not parallel:
        return None, "Megatron-LM asserts nothing of it at tp 1 and cp 1"
    major = ARCH_MAJOR.get(gpu)
    if major is not None and major >= BLACKWELL:
        return None, f"Megatron-LM asserts nothing of it on Blackwell and later ({gpu}: compute capability {major})"
    arch = f"compute capability {major}" if major is not None else "not in meshplan's table, taken as before Blackwell"
    return "1", f"Megatron-LM asserts it is 1 with {parallel} on GPUs before Blackwell ({gpu}: {arch})"


def plan_rule(cfg: Config) -> tuple[Optional[str], str]:
    """:func:`max_connections` of a config: its GPU, its mesh's tp and cp, and Megatron FSDP where
    the export writes ``--use-megatron-fsdp`` (sharding zero2 or zero3, or ``training.megatron_fsdp``)."""
    mesh, t = resolved(cfg), cfg.training
    deg = {a: mesh.layout.degree(a) if a in mesh.layout.names else 1 for a in ("tp", "cp")}
    fsdp = t.sharding not in ("none", "zero1") or bool(t.megatron_fsdp)
    return max_connections(cfg.cluster.gpu.name, deg["tp"], deg["cp"], fsdp)


def env_note(cfg: Config) -> list[str]:
    """The header line of ``export --to megatron`` where Megatron-LM asserts :data:`FSDP_ENV` is 1
    (:func:`plan_rule`; Megatron FSDP's ``unset`` line is
    :func:`~meshplan.interop.megatron_write.fsdp_env_note`'s), and :data:`UB_SKIPMC`'s where
    :func:`ub_skipmc` says; nothing otherwise."""
    value, why = plan_rule(cfg)
    skip = ub_skipmc(cfg)
    out = [f"environment: export {UB_SKIPMC}=1 before launching: {skip}; meshplan launch's torchrun.sh sets it"] \
        if skip else []
    if value != "1":
        return out
    return [f"environment: export {FSDP_ENV}=1 before launching: {why} ({SOURCE}); meshplan launch's torchrun.sh "
            f"sets it"] + out


#: Transformer Engine's switch off its CUDA-multicast userbuffers path (newcomer trial 23: is
#: ``--tp-comm-overlap`` Hopper-only? It is not). NVIDIA/TransformerEngine d0067d0:
#: ``common/comm_gemm_overlap/userbuffers/userbuffers-host.cpp`` sets up multicast only where
#: ``!getenv("UB_SKIPMC") && cuda::supports_multicast()``, ``userbuffers.cu`` compiles the multicast
#: kernels only under ``__CUDA_ARCH__ >= 900`` and keeps its IPC-handle kernels for sm80 (bf16 from
#: ``__CUDA_ARCH__ >= 800``), and ``examples/pytorch/comm_gemm_overlap/README.md`` says devices older
#: than compute capability 9.0 require ``UB_SKIPMC=1`` to fall back on the IPC implementation. Megatron-LM
#: d98e8a6 checks no compute capability for it (``arguments.py`` asserts only ``--sequence-parallel``;
#: ``initialize.py`` ``_initialize_tp_communicators`` the TE version). So an A100 plan keeps the knob,
#: and export and launch set this variable for it.
UB_SKIPMC = "UB_SKIPMC"
#: The first compute capability major with CUDA multicast (Hopper).
HOPPER = 9


def ub_skipmc(cfg: Config) -> str:
    """Why :data:`UB_SKIPMC` must be 1 for a Megatron-LM plan of ``cfg`` with ``--tp-comm-overlap`` on
    a GPU before Hopper (:data:`ARCH_MAJOR` below :data:`HOPPER`); "" otherwise (another framework,
    no overlap, Hopper or later, or a GPU the table does not know)."""
    t, gpu = cfg.training, cfg.cluster.gpu.name
    major = ARCH_MAJOR.get(gpu)
    if t.framework != "megatron" or not t.tp_comm_overlap or major is None or major >= HOPPER:
        return ""
    return (f"--tp-comm-overlap runs Transformer Engine's userbuffers, whose CUDA-multicast path needs compute "
            f"capability 9.0 ({gpu}: {major}); TE's comm_gemm_overlap README: older devices require UB_SKIPMC=1 "
            f"(its IPC-handle path, less performant; NVIDIA/TransformerEngine d0067d0)")


def launch_env(cfg: Config) -> tuple[tuple[str, Optional[str], str], ...]:
    """What ``torchrun.sh`` sets for a plan of ``cfg`` as (name, value or None to unset, why):
    under ``training.framework = "megatron"`` :data:`FSDP_ENV` 1 or unset by :func:`plan_rule`, and
    :data:`UB_SKIPMC` 1 where :func:`ub_skipmc` says so; nothing for another framework or where
    Megatron-LM asserts nothing."""
    if cfg.training.framework != "megatron":
        return ()
    value, why = plan_rule(cfg)
    skip = ub_skipmc(cfg)
    return (() if value is None else ((FSDP_ENV, None if value == "unset" else value, f"{why} ({SOURCE})"),)) + (
        ((UB_SKIPMC, "1", skip),) if skip else ())


def import_note(exported: dict[str, str], gpu: str, tp: int, cp: int, fsdp: bool, script: bool) -> list[str]:
    """The import's note on :data:`FSDP_ENV` of a Megatron-LM file whose ``exported`` variables
    (``export NAME=value`` lines) are given: its value against :func:`max_connections`; where the
    file is a launch ``script`` (a launcher in it) that does not export it and Megatron-LM asserts
    it is 1, a note saying so. Export and launch write it by the rule, whatever the file had.

    >>> import_note({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "h100-sxm5-80gb", 1, 1, True, True)[0][:100]
    'export CUDA_DEVICE_MAX_CONNECTIONS=1 in the script: Megatron-LM asserts it is not 1 under --use-mega'
    """
    value = run_value(FSDP_ENV, exported.get(FSDP_ENV))
    need, why = max_connections(gpu, tp, cp, fsdp)
    if value is None:
        return [f"{FSDP_ENV} not exported by the script: {why}; export it as 1 (export --to megatron's header and "
                f"meshplan launch's torchrun.sh do)"] if need == "1" and script else []
    given = f"export {FSDP_ENV}={exported[FSDP_ENV]} in the script"
    if (need == "1" and value != "1") or (need == "unset" and value == "1"):
        fix = "set it to 1" if need == "1" else "unset it (or set it above 1)"
        return [f"{given}: {why} ({SOURCE}); {fix} (export --to megatron's header and meshplan launch's "
                f"torchrun.sh do)"]
    return [f"{given}: read ({why}); export --to megatron and meshplan launch write it by that rule"]


def run_value(name: str, raw: Optional[str]) -> Optional[str]:
    """The value an ``export name=raw`` of a script gives where the environment does not set it
    already: ``raw``'s default for ``${name:-d}`` (or ``${name-d}``; Bash Reference Manual 3.5.3), else
    ``raw`` (:func:`meshplan.interop.shell_run.run` keeps what only the run knows as written).

    >>> run_value("CUDA_DEVICE_MAX_CONNECTIONS", "${CUDA_DEVICE_MAX_CONNECTIONS:-1}"), run_value("A", "2")
    ('1', '2')
    """
    m = re.fullmatch(r"\$\{" + re.escape(name) + r":?-([^}$`]*)\}", raw or "")
    return unquote(m.group(1)) if m else raw


def carried_env(exported: tuple[tuple[str, str], ...], source: str) -> list[str]:
    """The header line of ``export --to megatron`` carrying the user's script's other exports
    (``export NCCL_IB_TIMEOUT=19``; :data:`FSDP_ENV` is the rule's, :func:`env_note`), values
    quoted for the shell where they need it; nothing where there are none.

    >>> carried_env((("CUDA_DEVICE_MAX_CONNECTIONS", "1"), ("NCCL_IB_TIMEOUT", "19"), ("X", "a b")), "job.sh")
    ["environment carried unchanged from job.sh: export NCCL_IB_TIMEOUT=19 X='a b'"]
    >>> carried_env((("NCCL_IB_TIMEOUT", "${NCCL_IB_TIMEOUT:-19}"),), "job.sh")
    ['environment carried unchanged from job.sh: export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-19}']
    """
    kept = [f"{k}={v if '$' in v or '`' in v else shlex.quote(v)}" for k, v in exported if k != FSDP_ENV]
    return [f"environment carried unchanged from {source}: export {' '.join(kept)}"] if kept else []


#: The script's exports ``launch`` carries into ``torchrun.sh`` (newcomer trial 34 finding 5): NCCL's
#: (NCCL's environment variables, docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html) and
#: Transformer Engine's (``NVTE_*``), which change what the ranks run.
CARRIED_PREFIXES = ("NCCL_", "NVTE_")
#: NCCL's switch for NVLink SHARP: ``NCCL_PARAM(NvlsEnable, "NVLS_ENABLE", 2)`` and ``if
#: (!ncclParamNvlsEnable() ...) return ncclSuccess;`` before NVLS is set up (NVIDIA/nccl 5067397c,
#: src/transport/nvls.cc:159 and 262): 0 leaves the communicator without NVLS, so the all-reduce
#: runs on the NVLink ring (or tree).
NVLS_ENV = "NCCL_NVLS_ENABLE"


def script_env(exported: tuple[tuple[str, str], ...], source: str) -> tuple[tuple[str, Optional[str], str], ...]:
    """``launch``'s ``torchrun.sh`` lines (as :func:`launch_env`'s) for the script's exports of
    :data:`CARRIED_PREFIXES`, values as the script gives them (``${NAME:-d}`` kept so:
    :func:`meshplan.placement.rendezvous.env_lines` writes it); one holding what only the run knows
    otherwise (``$(...)``, another variable) is left out.

    >>> script_env((("NCCL_IB_TIMEOUT", "19"), ("NVTE_X", "${NVTE_X:-16}"), ("NCCL_Y", "$(id)"), ("A", "1")), "j.sh")
    (('NCCL_IB_TIMEOUT', '19', 'exported by j.sh'), ('NVTE_X', '${NVTE_X:-16}', 'exported by j.sh'))
    """
    out = []
    for name, raw in exported:
        value = run_value(name, raw)
        if name.startswith(CARRIED_PREFIXES) and value is not None and "$" not in value and "`" not in value:
            out.append((name, raw, f"exported by {source}"))
    return tuple(out)


def nvls_off(exported: dict[str, str], nvls: bool, notes: list[str]) -> dict:
    """The [cluster] ``fabric`` keys of a script exporting :data:`NVLS_ENV` ``0`` on a node whose
    fabric reduces in the switch (``nvls``): ``nvls = false``, so the plan times the all-reduce on the
    NVLink ring as NCCL then runs it, with a note; nothing otherwise."""
    if run_value(NVLS_ENV, exported.get(NVLS_ENV)) != "0" or not nvls:
        return {}
    notes.append(f"export {NVLS_ENV}=0 in the script: NCCL sets up no NVLS (NVLink SHARP; nccl src/transport/"
                 f"nvls.cc), so the plan times the all-reduce on the NVLink ring ([cluster] fabric nvls = false)")
    return {"fabric": {"nvls": False, "source": f"{NVLS_ENV}=0 exported by the launch script: no NVLS"}}
