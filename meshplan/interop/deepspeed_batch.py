"""The batch of a DeepSpeed JSON config by DeepSpeed's rule: ``train_batch_size =
train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp`` (any two give the third;
deepspeed.ai/docs/config-json, runtime/config.py ``_batch_assertion``), with the ``fix:`` of three
values that disagree; read by :mod:`meshplan.interop.deepspeed`.
"""

from __future__ import annotations

from typing import Optional

from meshplan.errors import ConfigError


def _given(d: dict, key: str) -> Optional[int]:
    v = d.get(key)
    if v is None or v == "auto":
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(key, f"must be a whole number >= 1 or \"auto\"; got {v!r}")
    return v


def batch(d: dict, dp: int) -> tuple[int, int]:
    """(global batch, micro-batch) of ``d`` over ``dp`` ranks by DeepSpeed's rule (module docstring).

    >>> batch({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 8)
    (64, 4)
    >>> batch({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 8)
    (64, 2)
    """
    g, m, a = (_given(d, k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                      "gradient_accumulation_steps"))
    if g is None and m is None:
        raise ConfigError("train_batch_size", "give train_batch_size or train_micro_batch_size_per_gpu")
    if g is None and m is not None:
        return m * (a or 1) * dp, m
    if g is None:  # unreachable: one of the two is given
        raise ConfigError("train_batch_size", "give train_batch_size or train_micro_batch_size_per_gpu")
    if m is None:
        per = g // ((a or 1) * dp)
        if per * (a or 1) * dp != g:
            unit = (a or 1) * dp
            raise ConfigError("train_batch_size", f"{g} is not gradient_accumulation_steps {a or 1} x dp {dp} x a "
                              f"whole micro-batch; fix: train_batch_size = {max(1, round(g / unit)) * unit} (a "
                              f"multiple of {a or 1} x dp {dp} = {unit})")
        return g, per
    if a is not None and g != m * a * dp:
        raise ConfigError("train_batch_size", f"{g} != train_micro_batch_size_per_gpu {m} x "
                          f"gradient_accumulation_steps {a} x dp {dp} = {m * a * dp}; {_batch_fix(g, m, a, dp)}")
    return g, m


def _batch_fix(g: int, m: int, a: int, dp: int) -> str:
    """The ``fix:`` of a DeepSpeed batch whose three values disagree (DeepSpeed asserts
    ``train_batch_size == micro x accumulation x world``, runtime/config.py
    ``_batch_assertion``): set train_batch_size to the product, or the accumulation steps that
    give ``g`` where they are whole, or leave train_batch_size out (DeepSpeed derives it).

    >>> _batch_fix(1000, 1, 16, 64), _batch_fix(2048, 2, 4, 128)
    ('fix: train_batch_size = 1024 (1 x 16 x dp 64), or leave it out and DeepSpeed derives it', 'fix: train_batch_size = 1024 (2 x 4 x dp 128), or gradient_accumulation_steps = 8 (2048 / (2 x dp 128))')
    """
    steps = g // (m * dp) if g % (m * dp) == 0 and g >= m * dp else None
    other = (f"gradient_accumulation_steps = {steps} ({g} / ({m} x dp {dp}))" if steps
             else "leave it out and DeepSpeed derives it")
    return f"fix: train_batch_size = {m * a * dp} ({m} x {a} x dp {dp}), or {other}"
