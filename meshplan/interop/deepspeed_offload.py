"""DeepSpeed's ZeRO-Offload keys of a DeepSpeed JSON config (:mod:`meshplan.interop.deepspeed_zero`
reads the other ZeRO knobs).

``zero_optimization.offload_optimizer`` with ``device = "cpu"`` (or its deprecated boolean
``cpu_offload: true``, which zero/config.py maps to it) at stages 1-3 is read into
``training.offload_optimizer = "cpu"`` (:func:`offload_training`; ZeRO-Offload as
:mod:`meshplan.memory.offload` models it: host state, CPU Adam, PCIe copies) and written back as
``{"device": "cpu"}``. Its ``pin_memory`` is timed as DeepSpeed's default, true, either way: ``false``
(pageable copies) adds a note; the key is the user's, carried on export. Refused by name: device ``nvme``
(ZeRO-Infinity's swapping), ``offload_param`` with a device other than ``"none"`` (DeepSpeed's
default when the table has no ``device``) and its boolean ``cpu_offload_param``, and offload at
stage 0: meshplan models neither parameter offload nor NVMe traffic; the error names the key.
"""

from __future__ import annotations

from typing import Any

from meshplan.errors import ConfigError

#: The ZeRO-Offload keys every ZeRO stage reads (:func:`offload_training`).
#: ``offload_optimizer.pin_memory`` is not among them: timed as pinned either way, it is the user's
#: key, listed unused and carried on export (:mod:`meshplan.interop.deepspeed_carry`).
OFFLOAD_USED = frozenset({"zero_optimization.offload_optimizer.device", "zero_optimization.cpu_offload",
                          "zero_optimization.offload_param.device"})


def refuse_offload(zero: Any, optimizer_cpu: bool = True) -> None:
    """ConfigError naming the first offload key of ``zero`` (the ``zero_optimization`` table) that
    meshplan does not model (module docstring): ``offload_param``, device ``nvme``, and with
    ``optimizer_cpu`` false (a reader that does not read it: Megatron-DeepSpeed's) the CPU optimizer too.

    >>> refuse_offload({"offload_param": {"device": "none"}, "offload_optimizer": {"device": "cpu"}, "cpu_offload": True})
    >>> refuse_offload({"offload_optimizer": {"device": "nvme", "nvme_path": "/local"}})
    Traceback (most recent call last):
    meshplan.errors.ConfigError: zero_optimization.offload_optimizer: device 'nvme': meshplan models ZeRO-Offload to the CPU only (not NVMe swapping or parameter offload); set its device to "cpu" or "none"
    >>> refuse_offload({"cpu_offload_param": True})
    Traceback (most recent call last):
    meshplan.errors.ConfigError: zero_optimization.cpu_offload_param: meshplan models ZeRO-Offload to the CPU only (not NVMe swapping or parameter offload); remove it (or set false)
    """
    if not isinstance(zero, dict):
        return
    fix = "meshplan models ZeRO-Offload to the CPU only (not NVMe swapping or parameter offload)"
    for key in ("offload_optimizer", "offload_param"):
        table = zero.get(key)
        device = table.get("device", "none") if isinstance(table, dict) else table
        if device is not None and device != "none" and not (key == "offload_optimizer" and device == "cpu"
                                                            and optimizer_cpu):
            raise ConfigError(f"zero_optimization.{key}", f"device {device!r}: {fix}; set its device to "
                              + ('"cpu" or "none"' if key == "offload_optimizer" and optimizer_cpu else '"none"'))
    for key in ("cpu_offload_param",) + (() if optimizer_cpu else ("cpu_offload",)):  # true means device "cpu"
        if zero.get(key):
            raise ConfigError(f"zero_optimization.{key}", f"{fix}; remove it (or set false)")


def offload_training(zero: dict, stage: int, notes: list[str]) -> dict[str, str]:
    """``{"offload_optimizer": "cpu"}`` where ``zero`` offloads the optimizer to the CPU
    (``offload_optimizer.device = "cpu"`` or ``cpu_offload: true``), else {}; ConfigError at stage 0
    (ZeRO-Offload runs in ZeRO's optimizers). ``pin_memory: false`` adds a note (timed as pinned).

    >>> offload_training({"offload_optimizer": {"device": "cpu", "pin_memory": True}}, 3, []), offload_training({}, 3, [])
    ({'offload_optimizer': 'cpu'}, {})
    """
    table = zero.get("offload_optimizer")
    on = (isinstance(table, dict) and table.get("device") == "cpu") or bool(zero.get("cpu_offload"))
    if not on:
        return {}
    if stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer", "ZeRO-Offload runs in ZeRO's optimizers (stages "
                          "1-3); set zero_optimization.stage to 1, 2 or 3, or the device to \"none\"")
    if isinstance(table, dict) and table.get("pin_memory") is False:
        notes.append("zero_optimization.offload_optimizer.pin_memory false: DeepSpeed copies through pageable host "
                     "memory, which meshplan times as pinned (the PCIe line rate); expect slower copies")
    return {"offload_optimizer": "cpu"}
