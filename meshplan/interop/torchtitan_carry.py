"""What an export of a torchtitan job TOML keeps of the user's own (``meshplan export JOB.toml
--to torchtitan``): every key meshplan does not read (``[job]``, ``optimizer.lr``,
``[lr_scheduler]``, ``[checkpoint]``, ``training.steps`` ...) carried unchanged beside the
written ones, as Megatron-LM's and DeepSpeed's exports carry their files' other settings
(:mod:`meshplan.interop.megatron_carry`, :func:`meshplan.interop.deepspeed_carry.carried`); a key
meshplan reads is the plan's (:func:`meshplan.interop.torchtitan_write.write`).
"""

from __future__ import annotations

import json

from meshplan.config import Config
from meshplan.interop.common import flatten, merge_tables, strip_keys
from meshplan.interop.tomlout import resolved
from meshplan.interop.torchtitan import READ
from meshplan.interop.torchtitan_checkpoint import in_users_spelling, without_interval
from meshplan.interop.torchtitan_float8 import LINEAR_CONVERTERS, filters_output
from meshplan.interop.torchtitan_tables import op_limits, read_recompute

#: The [activation_checkpoint] keys that say the recompute (:func:`kept_recompute`).
AC_KEYS = ("mode", "selective_ac_option")

#: Keys the reader reads whose values the plan leaves as they were (the tokenizer and weights'
#: folder; the clipping bound, read as clipping on and as training.grad_clip_norm, which no plan
#: changes; whether torchao precomputes the float8
#: scales, read for a note, the plan's float8 all-gather timed with the precompute either way; the
#: ring attention's K/V rotation, read as training.cp_rotate, which the writer writes where "alltoall"):
#: carried by :func:`carried`, not rewritten.
KEPT = {"model.hf_assets_path", "training.max_norm", "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
        "parallelism.context_parallel_rotate_method"}


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
    if "checkpoint" in written:  # the plan's interval ([reliability]) replaces the file's, in its spelling
        keep, written = without_interval(keep), in_users_spelling(user, written)
    tables = merge_tables(keep, strip_keys(written, set(flatten(keep))))  # the user's description of the job stays
    tables = _kept_etp(user, _kept_filter(user, tables))
    other = [str(c) for c in user.get("model", {}).get("converters", []) if str(c) not in LINEAR_CONVERTERS]
    if other:
        model = tables.get("model", {})
        tables["model"] = {**model, "converters": [*model.get("converters", []), *other]}
    # the user's [checkpoint] is carried, but the keys meshplan reads (enable, interval) where the
    # plan has an interval: those are the plan's (torchtitan_write.write), so a table the plan
    # writes is named by the keys carried in it, never as a table carried unchanged
    read = {r.partition(".")[0] for r in READ} | set(written)
    names = [f"[{k}]" for k in keep if k not in read] + list(flatten({k: v for k, v in keep.items() if k in read}))
    return tables, names + [f"model.converters {other}"] * bool(other)


def _kept_filter(user: dict, tables: dict) -> dict:
    """``tables`` with the user's ``quantize.linear.float8.filter_fqns`` in place of the written
    one where both filter the output layer alike (:func:`~meshplan.interop.torchtitan_float8.filters_output`,
    what the plan models of the list): the other entries (``router.gate``, module names meshplan
    does not plan apart) stay the user's, so the exported job converts no Linear the user kept out
    of float8 (newcomer trial 48 #3: ``["output", "router.gate"]`` was written ``["output"]``).

    >>> user = {"quantize": {"linear": {"float8": {"filter_fqns": ["output", "router.gate"]}}}}
    >>> _kept_filter(user, {"quantize": {"linear": {"float8": {"filter_fqns": ["output"]}}}})
    {'quantize': {'linear': {'float8': {'filter_fqns': ['output', 'router.gate']}}}}
    >>> _kept_filter(user, {"quantize": {"linear": {"float8": {"filter_fqns": []}}}})  # the plan converts the output
    {'quantize': {'linear': {'float8': {'filter_fqns': []}}}}
    """
    mine = user.get("quantize", {}).get("linear", {}).get("float8", {}).get("filter_fqns")
    f8 = tables.get("quantize", {}).get("linear", {}).get("float8", {})
    mine = mine.split(",") if isinstance(mine, str) else mine
    if not isinstance(mine, list) or "filter_fqns" not in f8 or filters_output(mine) != filters_output(f8["filter_fqns"]):
        return tables
    quantize = tables["quantize"]
    return {**tables, "quantize": {**quantize, "linear": {**quantize["linear"], "float8": {**f8, "filter_fqns": mine}}}}


def _kept_etp(user: dict, tables: dict) -> dict:
    """``tables`` with the user's ``parallelism.expert_tensor_parallel_degree`` where the plan writes
    none (:func:`meshplan.interop.torchtitan_write.write` writes the key only for etp = tp > 1 at ep >
    1) and the user's value is one torchtitan v0.2.2 takes at the written degrees, 1 or the tp degree,
    as the import's note says the export keeps it (newcomer trial 48 #5: it was listed "1 -> dropped").

    >>> _kept_etp({"parallelism": {"expert_tensor_parallel_degree": 1}}, {"parallelism": {"expert_parallel_degree": 8}})
    {'parallelism': {'expert_parallel_degree': 8, 'expert_tensor_parallel_degree': 1}}
    >>> _kept_etp({"parallelism": {"expert_tensor_parallel_degree": 4}}, {"parallelism": {"tensor_parallel_degree": 2}})
    {'parallelism': {'tensor_parallel_degree': 2}}
    """
    par, etp = tables.get("parallelism", {}), user.get("parallelism", {}).get("expert_tensor_parallel_degree")
    if etp not in (1, par.get("tensor_parallel_degree", 1)) or "expert_tensor_parallel_degree" in par:
        return tables
    return {**tables, "parallelism": {**par, "expert_tensor_parallel_degree": etp}}


def kept_recompute(user: dict, tables: dict, cfg: Config) -> tuple[dict, list[str]]:
    """(``tables``, header notes) with the user's ``activation_checkpoint.mode`` and
    ``selective_ac_option`` as ``user`` (their torchtitan job TOML) writes them, in place of
    the plan's (:func:`~meshplan.interop.torchtitan_tables.write_recompute`), where they read
    back (:func:`~meshplan.interop.torchtitan_tables.read_recompute`, at ``cfg``'s mesh) as the
    plan's recompute: an export of the user's own setting keeps it, so that op-level SAC at cp
    > 1, planned as Megatron-LM's selective recompute, is not written as ``mode = "none"``. One
    note says what the plan assumed when that is not what the user wrote. A recompute the plan
    changed (a search row's) is the plan's, listed as written otherwise by the caller.

    >>> from meshplan.config import config_from_dict
    >>> cfg = config_from_dict({"model": {"catalog": "llama3-70b"}, "cluster": {"system": "dgx-h100", "nodes": 32},
    ...     "training": {"global_batch": 8, "seq_len": 32768, "recompute": "selective"},
    ...     "mesh": {"names": ["dp_shard", "cp", "tp"], "shape": [8, 4, 8], "sequence_parallel": True}})
    >>> user = {"activation_checkpoint": {"mode": "selective", "selective_ac_option": "op", "early_stop": True}}
    >>> tables, notes = kept_recompute(user, {"activation_checkpoint": {"mode": "none", "early_stop": True}}, cfg)
    >>> tables["activation_checkpoint"]
    {'early_stop': True, 'mode': 'selective', 'selective_ac_option': 'op'}
    >>> print(notes[0])  # doctest: +NORMALIZE_WHITESPACE
    note: activation_checkpoint kept as written (mode "selective", selective_ac_option "op": op-level SAC); the plan
    assumed Megatron-LM's selective recompute (attention core recomputed, the other activations kept), as op-level SAC
    is planned with cp = 1 only and this mesh has cp 4
    """
    m, t = resolved(cfg), cfg.training
    deg = {"cp": m.degree("cp"), "ep": m.ep}
    plan = {"recompute": t.recompute} | ({"ac_freq": t.ac_freq} if t.recompute == "layer" else {})
    if read_recompute(user, deg, cfg.model.is_mla, []) != plan:
        return tables, []
    ac = user.get("activation_checkpoint", {})
    mine = {k: ac[k] for k in AC_KEYS if k in ac}
    table = {k: v for k, v in tables.get("activation_checkpoint", {}).items() if k not in AC_KEYS} | mine
    tables = {**tables, "activation_checkpoint": table}  # in its place
    if not table:  # the user wrote none: torchtitan's defaults, which read back as the plan's
        del tables["activation_checkpoint"]
    if t.recompute != "selective":  # op-level SAC at cp > 1 (read_recompute)
        return tables, []
    written = ", ".join(f"{k} {json.dumps(v)}" for k, v in mine.items())
    return tables, [f"note: activation_checkpoint kept as written ({written}: op-level SAC); the plan assumed "
                    f"Megatron-LM's selective recompute (attention core recomputed, the other activations kept), as "
                    f"op-level SAC is planned with cp = 1 only and this mesh has "
                    f"{' and '.join(op_limits(deg))}"]


def _model_key(d: dict) -> tuple:
    m = d.get("model", {})
    return m.get("name", "llama3"), m.get("flavor", "debugmodel")

