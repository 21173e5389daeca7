"""A DeepSpeed JSON's ZeRO keys that meshplan cannot take are refused in one line that names
the user's key (``zero_optimization.<key>``), never an internal ``[memory]`` field."""

from __future__ import annotations

import json

import pytest

from meshplan.errors import ConfigError
from meshplan.interop.foreign import load_any
from meshplan.interop.megatron_deepspeed import ds_config
from tests.test_interop_strict import DSOPTS, _write

BASE = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}


def _error(tmp_path, zero: dict) -> str:
    f = _write(tmp_path, "ds.json", json.dumps({**BASE, "zero_optimization": zero}))
    with pytest.raises(ConfigError) as e:
        load_any(f, "deepspeed", opts=DSOPTS)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("flag", [True, False])
def test_boolean_stage_is_refused_by_name(tmp_path, flag):
    """DeepSpeed's ``DeepSpeedZeroConfig.stage`` (a ``ZeroStageEnum(int, Enum)`` of a pydantic
    model in lax mode) coerces ``true`` to 1 and ``false`` to 0, as Python's ``True == 1`` made
    meshplan read it; meshplan asks for the number instead. Before: ``true`` planned ZeRO-1."""
    msg = _error(tmp_path, {"stage": flag})
    assert msg.startswith(f"zero_optimization.stage: {str(flag).lower()} is not a stage")
    assert "write 0, 1, 2 or 3" in msg


def test_boolean_stage_is_refused_beside_zero_stage(tmp_path):
    """Megatron-DeepSpeed's ds config under ``--zero-stage 1``: ``"stage": true`` equalled 1 and
    passed the agreement check; it is now the same one-line error."""
    f = _write(tmp_path, "ds.json", json.dumps({**BASE, "zero_optimization": {"stage": True}}))
    with pytest.raises(ConfigError, match=r"^zero_optimization\.stage: true is not a stage"):
        ds_config(f, 1)
    assert ds_config(_write(tmp_path, "ok.json", json.dumps({"zero_optimization": {"stage": 1}})), 1) == \
        {"zero_optimization": {"stage": 1}}


@pytest.mark.parametrize("stage,key", [(2, "reduce_bucket_size"), (3, "reduce_bucket_size"),
                                       (3, "stage3_prefetch_bucket_size"), (3, "stage3_max_live_parameters"),
                                       (3, "max_reuse_distance")])
def test_out_of_range_element_counts_name_the_deepspeed_key(tmp_path, stage, key):
    """1e30 elements is past the 1 TiB bound of the ``[memory]`` fields these keys fill
    (meshplan.limits.BOUNDS["bytes"] = 2^40 = 1,099,511,627,776); the error named
    ``memory.grad_bucket_elements`` (or ``memory.deepspeed_*``) before."""
    msg = _error(tmp_path, {"stage": stage, key: 1e30})
    assert msg.startswith(f"zero_optimization.{key}: must be a whole number of elements from ")
    assert "to 1099511627776 (1 TiB" in msg and msg.endswith("got 1e+30")
    assert "memory." not in msg
