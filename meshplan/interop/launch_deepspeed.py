"""What ``meshplan launch`` checks in a DeepSpeed plan's training command (newcomer trial nc52:
``launch job_h100_z3.toml -- python train.py --deepspeed other.json --per_device_train_batch_size 4
--gradient_accumulation_steps 32`` wrote the scripts, exit 0, for a plan of micro-batch 1 and 4
accumulation steps). launch appends nothing to such a command (DeepSpeed reads its JSON, the HF
Trainer its own arguments), so a number there that is not the plan's makes another run; it is
refused in one line, as a Megatron-LM flag the plan leaves out is
(:func:`meshplan.interop.launch_args.refuse_unplanned`).

Checked, where the command gives them:

- the HF Trainer's ``--per_device_train_batch_size`` and ``--gradient_accumulation_steps``
  (huggingface/transformers ``TrainingArguments``; the Trainer fills the JSON's batch ``"auto"``
  from them and refuses a JSON number that disagrees, :mod:`meshplan.interop.deepspeed_auto`)
  against ``training.micro_batch`` and the plan's micro-batches per step;
- the DeepSpeed JSON after ``--deepspeed_config`` (deepspeed.add_config_arguments, also
  Megatron-DeepSpeed's) or ``--deepspeed PATH`` (the HF Trainer's), read from the folder launch
  runs in: ``zero_optimization.stage``, ``train_micro_batch_size_per_gpu``,
  ``gradient_accumulation_steps``, ``train_batch_size`` and ``zero_optimization.zero_hpz_partition_size``
  against the plan, each where a number (``"auto"``: the Trainer's, checked by its flag). A JSON
  not found there is not read, and a note says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from meshplan.errors import ConfigError
from meshplan.interop.shell_words import flag_value
from meshplan.spec.training_fields import DEEPSPEED_ZERO3

#: The HF Trainer's batch arguments -> the DeepSpeed JSON key it fills from each.
HF_BATCH = {"--per_device_train_batch_size": "train_micro_batch_size_per_gpu",
            "--gradient_accumulation_steps": "gradient_accumulation_steps"}


def deepspeed_plan(t: Any) -> bool:
    """Whether DeepSpeed's engine runs training ``t``: its ZeRO-3 engine, its ZeRO-1/2 engine
    (BF16_Optimizer too) or its PipelineEngine."""
    return ((t.sharding == "zero3" and t.zero3_engine in DEEPSPEED_ZERO3) or t.pp_engine == "deepspeed"
            or (t.sharding in ("zero1", "zero2") and t.zero12_engine == "deepspeed"))


def plan_numbers(t: Any, micro_batches: int) -> dict[str, Any]:
    """The DeepSpeed JSON numbers the plan of training ``t`` runs, ``micro_batches`` per step:
    ``stage`` (BF16_Optimizer: 0 or 1, either of which DeepSpeed runs it at with bf16 and fp32
    ``grad_accum_dtype``, deepspeedai/DeepSpeed edaa722 ``runtime/engine.py:1994-1996``; else ZeRO's),
    the batch keys, hpZ's partition."""
    stage = {"zero1": 1, "zero2": 2, "zero3": 3}.get(t.sharding, 0)
    return {"stage": (0, 1) if t.bf16_optimizer else stage, "train_micro_batch_size_per_gpu": t.micro_batch,
            "gradient_accumulation_steps": micro_batches, "train_batch_size": t.global_batch,
            "zero_hpz_partition_size": t.zero_hpz_partition_size if stage == 3 else 1}


def mismatches(program: tuple[str, ...], numbers: dict[str, Any], read_json=None) -> tuple[list[str], list[str]]:
    """(each ``what is X, the plan's Y`` of ``program`` against the plan's ``numbers``
    (:func:`plan_numbers`), notes); ``read_json``: path -> dict or None (not found).

    >>> n = {"stage": 3, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
    ...      "train_batch_size": 1024, "zero_hpz_partition_size": 8}
    >>> mismatches(("python", "train.py", "--deepspeed", "x.json", "--per_device_train_batch_size", "4",
    ...             "--gradient_accumulation_steps", "32"), n, lambda p: None)[0]
    ['--per_device_train_batch_size 4, the plan 1', '--gradient_accumulation_steps 32, the plan 4']
    >>> mismatches(("python", "t.py", "--deepspeed_config", "ds.json"), n,
    ...            lambda p: {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"})[0]
    ['ds.json zero_optimization.stage 2, the plan 3', 'ds.json zero_optimization.zero_hpz_partition_size 1, the plan 8']
    """
    out: list[str] = []
    notes: list[str] = []
    for flag, key in HF_BATCH.items():
        v = flag_value(program, flag, True)
        if v is not None and v != str(numbers[key]):
            out.append(f"{flag} {v}, the plan {numbers[key]}")
    path = flag_value(program, "--deepspeed_config", True) or flag_value(program, "--deepspeed", True)
    if path is None or not path.endswith(".json"):
        return out, notes
    d: Optional[dict] = (read_json or _read)(path)
    if not isinstance(d, dict):
        notes.append(f"{path}: not found from here, so its ZeRO stage and batch were not checked against the plan")
        return out, notes
    z = d.get("zero_optimization")
    zero: dict = z if isinstance(z, dict) else {}
    given = {"stage": zero.get("stage", 0), "zero_hpz_partition_size": zero.get("zero_hpz_partition_size", 1),
             **{k: d[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
                if k in d}}
    for key, v in given.items():
        want = numbers[key] if isinstance(numbers[key], tuple) else (numbers[key],)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v not in want:
            where = f"zero_optimization.{key}" if key in ("stage", "zero_hpz_partition_size") else key
            out.append(f"{path} {where} {v:g}, the plan {' or '.join(map(str, want))}")
    return out, notes


def _read(path: str) -> Optional[dict]:
    p = Path(path)
    if not p.is_file():
        return None
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError("PROGRAM", f"{path}: not a DeepSpeed JSON launch can read ({e})") from None
    return d if isinstance(d, dict) else None


def refuse_deepspeed_mismatch(program: tuple[str, ...], t: Any, micro_batches: int, config: Path) -> list[str]:
    """A one-line ConfigError naming PROGRAM where the DeepSpeed plan of training ``t``'s command
    gives numbers that are not the plan's (:func:`mismatches`); else the notes (a JSON not
    found). Nothing for a plan DeepSpeed does not run (:func:`deepspeed_plan`)."""
    if not program or not deepspeed_plan(t):
        return []
    bad, notes = mismatches(program, plan_numbers(t, micro_batches))
    if bad:
        raise ConfigError("PROGRAM", f"{'; '.join(bad)}: the training command would run another batch or ZeRO "
                                     f"setup than {config.name} plans (launch appends nothing to a DeepSpeed "
                                     f"command); give the plan's values, or plan the command's in {config.name}")
    return notes
