"""What an export of a torchtitan job TOML keeps of the user's own (``meshplan export JOB.toml
--to torchtitan``): every key meshplan does not read (``[job]``, ``optimizer.lr``,
``[lr_scheduler]``, ``[checkpoint]``, ``training.steps`` ...) carried unchanged beside the
written ones, as Megatron-LM's and DeepSpeed's exports carry their files' other settings
(:mod:`meshplan.interop.megatron_carry`, :func:`meshplan.interop.deepspeed_carry.carried`); a key
meshplan reads is the plan's (:func:`meshplan.interop.torchtitan_write.write`).
"""

from __future__ import annotations

from meshplan.interop.common import flatten, merge_tables, strip_keys
from meshplan.interop.torchtitan import READ
from meshplan.interop.torchtitan_tables import LINEAR_CONVERTERS

#: Keys the reader reads whose values the plan leaves as they were (the tokenizer and weights'
#: folder; the clipping bound, read as clipping on; whether torchao precomputes the float8
#: scales, read for a note, the plan's float8 all-gather timed with the precompute either way):
#: carried by :func:`carried`, not rewritten.
KEPT = {"model.hf_assets_path", "training.max_norm", "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"}


def carried(user: dict, written: dict) -> tuple[dict, list[str]]:
    """(tables, what was carried) of ``written`` (:func:`~meshplan.interop.torchtitan_write.write`)
    with the user's torchtitan job TOML ``user`` carried through: every key meshplan does not
    read (``[job]``, ``optimizer.lr``, ``[lr_scheduler]``, ``[metrics]``, ``[checkpoint]``,
    ``training.steps``, ...) and :data:`KEPT` unchanged (``job.description`` the user's where it
    has one), the converters meshplan does not model kept beside the written ones; every other
    read key is what :func:`~meshplan.interop.torchtitan_write.write` says (the plan), absent
    where it writes none. ``model.hf_assets_path`` only while the model is still the user's.
    What was carried: whole tables as ``[name]``, single keys dotted.

    >>> user = {"job": {"dump_folder": "./o"}, "training": {"seq_len": 4096, "steps": 10},
    ...         "activation_checkpoint": {"mode": "full", "early_stop": True}}
    >>> tables, names = carried(user, {"training": {"seq_len": 8192}, "activation_checkpoint": {"mode": "none"}})
    >>> tables["training"], tables["activation_checkpoint"]
    ({'steps': 10, 'seq_len': 8192}, {'early_stop': True, 'mode': 'none'})
    >>> names
    ['[job]', 'training.steps', 'activation_checkpoint.early_stop']
    """
    moved = "model" in written and _model_key(user) != _model_key(written)
    keep = strip_keys(user, (READ - KEPT) | ({"model.hf_assets_path"} if moved else set()))
    tables = merge_tables(keep, strip_keys(written, set(flatten(keep))))  # the user's description of the job stays
    other = [str(c) for c in user.get("model", {}).get("converters", []) if str(c) not in LINEAR_CONVERTERS]
    if other:
        model = tables.get("model", {})
        tables["model"] = {**model, "converters": [*model.get("converters", []), *other]}
    # the user's [checkpoint] is carried whole, the interval meshplan read from it included (written
    # only for a plan without the user's file: torchtitan_write.write)
    read = {r.partition(".")[0] for r in READ} | (set(written) - ({"checkpoint"} if "checkpoint" in keep else set()))
    names = [f"[{k}]" for k in keep if k not in read] + list(flatten({k: v for k, v in keep.items() if k in read}))
    return tables, names + [f"model.converters {other}"] * bool(other)


def _model_key(d: dict) -> tuple:
    m = d.get("model", {})
    return m.get("name", "llama3"), m.get("flavor", "debugmodel")

