"""torchtitan's expert-parallel keys: ``parallelism.expert_tensor_parallel_degree`` read
(:func:`read_etp`), and ``parallelism.expert_parallel_comm_backend`` <-> ``training.moe_dispatcher``.

The backend key is in torchtitan's job TOML from 36a4b69 (#2107, 2025-12-17) until 9810191
(2026-02-23, Python configs), e347b1e (v0.2.2, what meshplan reads and writes) included: ``Literal["standard", "deepep"]``
(``torchtitan/config/job_config.py``:474 at e347b1e). "standard" is torch's all-to-all (meshplan's
``alltoall``); "deepep" runs DeepEP's V1 normal dispatch and combine, the kernels Megatron-LM's flex
dispatcher calls (:mod:`meshplan.comm.deepep`): ``moe_dispatcher = "deepep"``. "hybridep" (HybridEP's TMA
kernels for GB200 NVL72, 156db2e) and "minimal_async_ep" came later, with the Python configs'
``moe_comm_backend``: a job TOML that names them is one no torchtitan reads, and meshplan models neither.

Only two model families read the key (:data:`DEEPEP_FAMILIES`): at e347b1e
``torchtitan/models/deepseek_v3/infra/parallelize.py``:99-134 and ``models/llama4/infra/parallelize.py``:113-148
test ``expert_parallel_comm_backend == "deepep"`` and pass ``use_deepep`` to ``apply_moe_ep_tp`` (and
deepseek_v3's ``model/args.py``:116 builds ``DeepEPMoE`` from it); ``models/qwen3/infra/parallelize.py``:108-118
and ``models/gpt_oss/infra/parallelize.py``:106 call their ``apply_moe_ep_tp`` without it, so a qwen3 job runs
the standard all-to-all whatever the key says. The family is ``[model] name`` (torchtitan's model registry key,
the one :func:`~meshplan.interop.torchtitan_flavors.read_model` reads).

>>> read_backend({"expert_parallel_comm_backend": "deepep"}, True, [], "deepseek_v3")
{'moe_dispatcher': 'deepep'}
>>> read_backend({"expert_parallel_comm_backend": "deepep"}, True, [], "qwen3")
{}
>>> read_backend({}, True, [], "deepseek_v3")
{}
>>> read_backend({"moe_comm_backend": "deepep"}, True, [], "deepseek_v3")
Traceback (most recent call last):
...
meshplan.errors.ConfigError: parallelism.moe_comm_backend: not a torchtitan job-TOML key (the name torchtitan's Python configs give the backend, model_registry(..., moe_comm_backend=)); in a job TOML write parallelism.expert_parallel_comm_backend = 'deepep'
>>> write_backend("deepep")
{'expert_parallel_comm_backend': 'deepep'}
"""

from __future__ import annotations

from meshplan.errors import ConfigError, printable
from meshplan.spec.axes.moe_tp import TORCH_ETP, TORCH_ETP_EP1

KEY = "expert_parallel_comm_backend"
#: The backend's name in torchtitan's Python configs (``model_registry(..., moe_comm_backend=)``, 7cec166 on),
#: refused in a job TOML with the key to write there (:func:`read_backend`).
PY_NAME = "moe_comm_backend"
#: The backends of later torchtitan (Python configs, ``moe_comm_backend``), with what each runs.
LATER = {"hybridep": "HybridEP's TMA kernels for GB200 NVL72 (torchtitan 156db2e, 2026-03-11)",
         "minimal_async_ep": "MinimalAsyncEP (torchtitan's Python configs)"}
#: torchtitan model families (``[model] name``) whose parallelize reads the key at e347b1e (module docstring).
DEEPEP_FAMILIES = ("deepseek_v3", "llama4")


def read_backend(par: dict, moe: bool, notes: list[str], family: str) -> dict:
    """``training`` keys of ``[parallelism] expert_parallel_comm_backend`` (module docstring): deepep ->
    ``{"moe_dispatcher": "deepep"}`` for a ``family`` (``[model] name``) of :data:`DEEPEP_FAMILIES`; ``{}``
    with a note where torchtitan ignores it (a model without experts, or another family: the standard
    all-to-all planned); "standard" or absent -> ``{}``; another value a ConfigError naming the key."""
    if PY_NAME in par:  # nc58 #7: the Python configs' name in a job TOML, listed unused, the backend left standard
        raise ConfigError(f"parallelism.{PY_NAME}", f"not a torchtitan job-TOML key (the name torchtitan's Python "
                          f"configs give the backend, model_registry(..., {PY_NAME}=)); in a job TOML write "
                          f"parallelism.{KEY} = {printable(str(par[PY_NAME]))[:40]!r}")
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
    if family not in DEEPEP_FAMILIES:
        notes.append(f"parallelism.{KEY} = \"deepep\" is ignored for model {printable(family)[:40]}: torchtitan's "
                     f"{printable(family)[:40]} parallelize never passes it to apply_moe_ep_tp (only "
                     f"{' and '.join(DEEPEP_FAMILIES)} read it: e347b1e models/qwen3/infra/parallelize.py:108-118, "
                     "models/deepseek_v3/infra/parallelize.py:99-134): planned with the standard all-to-all")
        return {}
    return {"moe_dispatcher": "deepep"}


def write_backend(moe_dispatcher: str) -> dict:
    """``[parallelism]`` keys of ``training.moe_dispatcher`` (the inverse of :func:`read_backend`): none for
    the default all-to-all (torchtitan's "standard")."""
    return {KEY: "deepep"} if moe_dispatcher == "deepep" else {}


def read_etp(par: dict, deg: dict[str, int], notes: list[str]) -> None:
    """``parallelism.expert_tensor_parallel_degree`` (e347b1e's ``job_config.py``:464, v0.2.2; c4b409a
    removed it: :data:`~meshplan.spec.axes.moe_tp.TORCH_ETP`). With ep > 1, v0.2.2 runs etp 1 or tp
    (``parallel_dims.py``:58-59 at e347b1e), another etp a ConfigError; etp = tp is read, with a note, and
    planned as v0.2.2 runs it (the import names that torchtitan: ``training.op_sac_policy = "238fa99"``,
    :attr:`~meshplan.spec.training.TrainingSpec.torchtitan_v022`; rule ``torch_etp`` accepts it). At ep 1 it is read
    as tp (the experts over tp there), with a note; else as it is, with a note naming c4b409a.

    >>> read_etp({"expert_tensor_parallel_degree": 2}, {"ep": 4, "etp": 2, "tp": 4}, [])
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: parallelism.expert_tensor_parallel_degree: 2 with expert_parallel_degree 4 and tensor_parallel_degree 4: torchtitan v0.2.2 runs 1 or the tp degree there ("Currently we only support ETP=TP or ETP=1", parallel_dims.py:58-59 at e347b1e); fix: expert_tensor_parallel_degree = 1 or 4
    """
    if "expert_tensor_parallel_degree" not in par:
        return
    ep, etp, tp = deg["ep"], deg["etp"], deg["tp"]
    if ep > 1 and etp not in (1, tp):
        raise ConfigError("parallelism.expert_tensor_parallel_degree", f"{etp} with expert_parallel_degree {ep} and "
                          f"tensor_parallel_degree {tp}: torchtitan v0.2.2 runs 1 or the tp degree there (\"Currently "
                          f"we only support ETP=TP or ETP=1\", parallel_dims.py:58-59 at e347b1e); fix: "
                          f"expert_tensor_parallel_degree = {'1' if tp == 1 else f'1 or {tp}'}")
    if ep == 1 and etp != tp:  # ep 1: the experts over tp whatever the key (torch_etp)
        notes.append(f"parallelism.expert_tensor_parallel_degree = {etp} at expert_parallel_degree 1: read as etp "
                     f"{tp}, the tp degree: {TORCH_ETP_EP1}")
        deg["etp"] = etp = tp
    if ep > 1 and etp > 1:
        notes.append(f"parallelism.expert_tensor_parallel_degree = {etp} with expert_parallel_degree {ep}: planned as "
                     f"torchtitan v0.2.2 runs it (ETP = TP, each routed expert sharded over tp: parallel_dims.py:58-59 "
                     f"at e347b1e; training.op_sac_policy = \"238fa99\", the TOML-reading torchtitan); c4b409a "
                     f"(2026-04-30) removed it: {TORCH_ETP}, so for a later torchtitan set "
                     "expert_tensor_parallel_degree = 1")
        return
    notes.append(f"parallelism.expert_tensor_parallel_degree = {etp}: read as etp {etp}; torchtitan up to v0.2.2 "
                 "reads the key (meshplan export keeps it); c4b409a (#3167, 2026-04-30) removed it with expert "
                 "tensor parallelism, so delete it for a torchtitan after that commit")
