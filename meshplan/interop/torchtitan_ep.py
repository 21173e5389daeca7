"""torchtitan's ``parallelism.expert_parallel_comm_backend`` <-> ``training.moe_dispatcher``.

The key is in torchtitan's job TOML from 36a4b69 (#2107, 2025-12-17) until 9810191 (2026-02-23, Python
configs), e347b1e (v0.2.2, what meshplan reads and writes) included: ``Literal["standard", "deepep"]``
(``torchtitan/config/job_config.py``:474 at e347b1e). "standard" is torch's all-to-all (meshplan's
``alltoall``); "deepep" runs DeepEP's V1 normal dispatch and combine, the kernels Megatron-LM's flex
dispatcher calls (:mod:`meshplan.comm.deepep`): ``moe_dispatcher = "deepep"``. "hybridep" (HybridEP's TMA
kernels for GB200 NVL72, 156db2e) and "minimal_async_ep" came later, with the Python configs'
``moe_comm_backend``: a job TOML that names them is one no torchtitan reads, and meshplan models neither.

>>> read_backend({"expert_parallel_comm_backend": "deepep"}, True, [])
{'moe_dispatcher': 'deepep'}
>>> read_backend({}, True, [])
{}
>>> write_backend("deepep")
{'expert_parallel_comm_backend': 'deepep'}
"""

from __future__ import annotations

from meshplan.errors import ConfigError, printable

KEY = "expert_parallel_comm_backend"
#: The backends of later torchtitan (Python configs, ``moe_comm_backend``), with what each runs.
LATER = {"hybridep": "HybridEP's TMA kernels for GB200 NVL72 (torchtitan 156db2e, 2026-03-11)",
         "minimal_async_ep": "MinimalAsyncEP (torchtitan's Python configs)"}


def read_backend(par: dict, moe: bool, notes: list[str]) -> dict:
    """``training`` keys of ``[parallelism] expert_parallel_comm_backend`` (module docstring): deepep ->
    ``{"moe_dispatcher": "deepep"}`` (with a note where the model has no experts: torchtitan ignores it);
    "standard" or absent -> ``{}``; another value a ConfigError naming the key."""
    value = par.get(KEY)
    if value is None or value == "standard":
        return {}
    if value in LATER:
        raise ConfigError(f"parallelism.{KEY}", f"{value!r} runs {LATER[value]}, which no torchtitan job TOML "
                          f"takes (e347b1e: standard or deepep) and meshplan does not model; use deepep or standard")
    if value != "deepep":
        raise ConfigError(f"parallelism.{KEY}", f"{printable(str(value))[:40]!r} is not standard or deepep "
                          "(torchtitan's job_config.py:474 at e347b1e); give one of them")
    if not moe:
        notes.append(f"parallelism.{KEY} = \"deepep\" on a model without experts: no effect (torchtitan: \"No effect "
                     "for non-MoE models\")")
        return {}
    return {"moe_dispatcher": "deepep"}


def write_backend(moe_dispatcher: str) -> dict:
    """``[parallelism]`` keys of ``training.moe_dispatcher`` (the inverse of :func:`read_backend`): none for
    the default all-to-all (torchtitan's "standard")."""
    return {KEY: "deepep"} if moe_dispatcher == "deepep" else {}
