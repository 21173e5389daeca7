"""DeepSpeed ZeRO++'s keys of a DeepSpeed JSON config (:func:`zeropp_training`; what they do:
:mod:`meshplan.comm.zeropp`), read at stage 3 by :func:`meshplan.interop.deepspeed_zero.zero3_training`:
``zero_optimization.zero_hpz_partition_size`` (above 1: hpZ's secondary partition over that many
consecutive ranks, its backward and later gathers inside them), ``zero_quantized_weights`` (qwZ:
int8 parameter all-gathers) and ``zero_quantized_gradients`` (qgZ: the gradient reduce-scatter
replaced by the hierarchical int4 all-to-all across nodes) into the ``[training]`` keys of the same
names, and written back by ``export --to deepspeed``. ``zeropp_loco_param`` (LoCo's error-feedback
variant of qgZ, ``all_to_all_loco_quant_reduce``) is refused by name beside qgZ: its error buffers
and kernels are not modelled.
"""

from __future__ import annotations

from typing import Any

from meshplan.errors import ConfigError
from meshplan.limits import BOUNDS

#: ZeRO++'s ``zero_optimization`` keys meshplan reads at stage 3 (:func:`zeropp_training`).
ZEROPP_KEYS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients")


def zeropp_training(zero: Any) -> dict[str, Any]:
    """The ``[training]`` keys of ZeRO++ in ``zero`` (the ``zero_optimization`` table; module
    docstring): ``zero_hpz_partition_size`` above 1 (DeepSpeed's 0 and 1 are no secondary
    partition: ``stage3.py`` tests ``> 1``), the two quantization switches when true. A
    ConfigError names a key of the wrong type, and ``zeropp_loco_param`` beside qgZ.

    >>> zeropp_training({"zero_hpz_partition_size": 8, "zero_quantized_weights": True}), zeropp_training({"zero_hpz_partition_size": 1})
    ({'zero_hpz_partition_size': 8, 'zero_quantized_weights': True}, {})
    >>> zeropp_training({"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}})
    Traceback (most recent call last):
    meshplan.errors.ConfigError: zero_optimization.zeropp_loco_param: LoCo's error-feedback qgZ (all_to_all_loco_quant_reduce: error buffers and their int8 kernels) is not modelled; remove it to plan qgZ (all_to_all_quant_reduce)
    """
    if not isinstance(zero, dict):
        return {}
    out: dict[str, Any] = {}
    g = zero.get("zero_hpz_partition_size", 1)
    if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g <= BOUNDS["world"].value:
        raise ConfigError("zero_optimization.zero_hpz_partition_size", f"{g!r}: a whole number of ranks >= 0 "
                          f"(0 and 1: no secondary partition)")
    if g > 1:
        out["zero_hpz_partition_size"] = g
    for key in ZEROPP_KEYS[1:]:
        v = zero.get(key, False)
        if not isinstance(v, bool):
            raise ConfigError(f"zero_optimization.{key}", f"{v!r}: true or false")
        if v:
            out[key] = True
    if out.get("zero_quantized_gradients") and zero.get("zeropp_loco_param") is not None:
        raise ConfigError("zero_optimization.zeropp_loco_param", "LoCo's error-feedback qgZ "
                          "(all_to_all_loco_quant_reduce: error buffers and their int8 kernels) is not modelled; "
                          "remove it to plan qgZ (all_to_all_quant_reduce)")
    return out
