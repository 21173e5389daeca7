"""Parallel axes: the registry (one module per axis family, :mod:`meshplan.spec.axes.registry`)
and the axis vocabulary: meshplan's axis names and the names torchtitan and Megatron-LM give them.

Canonical names (what every later layer sees): ``pp``, ``dp_replicate``, ``dp``,
``dp_shard``, ``cp``, ``tp`` (dense) and ``ep``, ``etp`` (expert). The foreign vocabularies
map onto them explicitly:

* torchtitan (``torchtitan/distributed/parallel_dims.py``, mesh dims
  ``["pp", "dp_replicate", "dp_shard", "cp", "tp"]``, expert mesh ``["efsdp", "ep", "etp"]``,
  and the derived ``fsdp`` = dp_shard x cp): :data:`TORCHTITAN_AXES`.
* Megatron-LM (``megatron/core/parallel_state.py``, ``order="tp-cp-ep-dp-pp"``, plus the
  expert tensor axis ``etp``): :data:`MEGATRON_AXES`.

A mesh axis named ``fsdp`` (torchtitan's word) is planned as ``dp_shard`` with a note: as a
single mesh axis it shards parameters, gradients and optimizer state, which is what
``dp_shard`` means (torchtitan's ``fsdp`` also folds in cp; with cp an axis of its own the two
are the same). Any other name is a user-named axis (rank math only, no model semantics)
when it is not close to a known one; a name close to a known axis (``tq``, ``TP``,
``dp-shard``) is an error unless the mesh lists it in ``custom_axes``, but for :data:`OWN_AXES`
(``sp``, xDiT's sequence-parallel axis), taken as the user's own with a note.
"""

from __future__ import annotations

import difflib

from meshplan.errors import ConfigError
from meshplan.spec.axes.registry import AXES, Axis, foreign_names

__all__ = ["ALIASES", "AXES", "Axis", "DENSE_AXES", "EXPERT_AXES", "KNOWN_AXES", "MEGATRON_AXES", "TORCHTITAN_AXES",
           "FOREIGN_WORDS", "OWN_AXES", "canonical_names", "close_axis", "foreign_word"]

#: Dense axes (multiplied into the world) and expert axes (re-factoring the dense block), in
#: mesh order, from the registry (:mod:`meshplan.spec.axes.registry`).
DENSE_AXES = tuple(str(n) for n, a in AXES.items() if not a.expert)
EXPERT_AXES = tuple(str(n) for n, a in AXES.items() if a.expert)
KNOWN_AXES = DENSE_AXES + EXPERT_AXES

#: torchtitan mesh dimension name -> meshplan axis (torchtitan ParallelDims).
TORCHTITAN_AXES = foreign_names("torchtitan")
#: Megatron-LM order-string name -> meshplan axis (parallel_state.initialize_model_parallel).
MEGATRON_AXES = foreign_names("megatron")
#: Names that are not canonical but mean a canonical axis, with the note printed.
ALIASES = {"fsdp": ("dp_shard", "mesh axis 'fsdp' is planned as 'dp_shard' (torchtitan's fsdp: parameters, "
                                "gradients and optimizer state sharded over it; torchtitan's derived fsdp = "
                                "dp_shard x cp, and cp stays an axis of its own here)")}


#: Names other frameworks give an axis meshplan calls otherwise, suggested first (not renamed: the name
#: may be a custom axis of the same spelling): ``sp`` is xDiT's sequence-parallel group, Ulysses x ring
#: attention over the sequence (xdit-project/xDiT 47f2071, xfuser/core/distributed/parallel_state.py,
#: ``initialize_model_parallel``: ``ulysses_degree`` x ``ring_degree``, order "tp-sp-pp-cfg-dp"), and
#: DeepSpeed-Ulysses's ``sequence_parallel_size``: meshplan's context parallelism (Megatron-LM's sequence
#: parallelism, with tp, is ``[mesh] sequence_parallel`` instead).
KNOWN_MEANINGS = {"sp": "cp"}

#: Names close to a known axis that are taken as the user's own axis without ``custom_axes`` (rank math
#: only, no model semantics), with the note printed: handed case C2 gives xDiT's order "tp-sp-pp-cfg-dp"
#: as the input whose groups it checks, ``sp`` unlisted. Not an alias of ``cp``: xDiT's sp is Ulysses
#: (an all-to-all of the heads) x ring attention, not meshplan's all-gather CP, and its groups are named sp.
#: DeepSpeed-Ulysses's own word (``sequence_parallel_size``) is taken the same way, for the same reason.
_ULYSSES = ("is planned as a user-named axis (rank math only, no model semantics: xDiT's and DeepSpeed-Ulysses's "
            "sequence-parallel group, not modelled); for the sequence split's memory and collectives use meshplan's "
            "'cp' (context parallelism); Megatron-LM's sequence parallelism is [mesh] sequence_parallel = true")
OWN_AXES = {n: f"mesh axis '{n}' {_ULYSSES}" for n in ("sp", "sequence", "sequence_parallel")}


_TT_MG = "torchtitan/Megatron"
#: Whole words other frameworks use for meshplan's axes -> (axis, whose word). Refused as a mesh
#: name unless listed in ``custom_axes`` (a custom axis named ``tensor`` would silently plan no TP).
#: Sources: torchtitan ``ParallelismConfig`` (``tensor_parallel_degree``, ``pipeline_parallel_degree``,
#: ``context_parallel_degree``, ``expert_parallel_degree``, ``data_parallel_replicate_degree``,
#: ``data_parallel_shard_degree``); Megatron-LM ``parallel_state`` (``tensor_model_parallel_size``,
#: ``pipeline_model_parallel_size``, ``context_parallel_size``, ``expert_model_parallel_size``,
#: ``expert_tensor_parallel_size``, ``get_data_parallel_group``); DeepSpeed ``PipeModelDataParallelTopology``
#: (axes ``pipe``, ``data``, ``model``). ``sp``, ``sequence`` and ``sequence_parallel`` (Ulysses) are not here:
#: they are :data:`OWN_AXES` (handed case C2 takes sp as the user's own axis, with a note).
FOREIGN_WORDS = {
    "tensor": ("tp", _TT_MG), "tensor_parallel": ("tp", _TT_MG), "tensor_model_parallel": ("tp", "Megatron"),
    "model": ("tp", "DeepSpeed"), "model_parallel": ("tp", "DeepSpeed/Megatron"),
    "pipeline": ("pp", _TT_MG), "pipeline_parallel": ("pp", _TT_MG), "pipeline_model_parallel": ("pp", "Megatron"),
    "pipe": ("pp", "DeepSpeed"),
    "data": ("dp", "Megatron/DeepSpeed"), "data_parallel": ("dp", "Megatron/DeepSpeed"),
    "ddp": ("dp_replicate", "PyTorch"), "replicate": ("dp_replicate", "torchtitan"),
    "data_parallel_replicate": ("dp_replicate", "torchtitan"),
    "shard": ("dp_shard", "torchtitan"), "data_parallel_shard": ("dp_shard", "torchtitan"),
    "context": ("cp", _TT_MG), "context_parallel": ("cp", _TT_MG),
    "expert": ("ep", _TT_MG), "expert_parallel": ("ep", _TT_MG), "expert_model_parallel": ("ep", "Megatron"),
    "expert_tensor": ("etp", _TT_MG), "expert_tensor_parallel": ("etp", _TT_MG),
}


def foreign_word(name: str) -> str | None:
    """The one-line refusal for a mesh name that is another framework's word for an axis
    (:data:`FOREIGN_WORDS`, any case, ``-`` as ``_``), else None.

    >>> print(foreign_word("tensor"))
    "tensor" is torchtitan/Megatron's word for tp; write "tp" (or list it in mesh.custom_axes to keep a custom axis of that name)
    >>> foreign_word("cfg") is None
    True
    """
    hit = FOREIGN_WORDS.get(name.lower().replace("-", "_"))
    if hit is None:
        return None
    axis, who = hit
    return (f'"{name}" is {who}\'s word for {axis}; write "{axis}" (or list it in mesh.custom_axes to '
            f"keep a custom axis of that name)")


def close_axis(name: str) -> list[str]:
    """Known axes that ``name`` is probably a slip for (the same name in another case,
    :data:`KNOWN_MEANINGS` first, then difflib close matches); empty for a known or a clearly
    different name.

    >>> close_axis("tq"), close_axis("TP"), close_axis("cfg"), close_axis("tp"), close_axis("sp")
    (['tp'], ['tp'], [], [], ['cp', 'tp', 'pp', 'ep'])
    """
    if name in KNOWN_AXES or name in ALIASES:
        return []
    if name.lower() in KNOWN_AXES:
        return [name.lower()]
    meant = [KNOWN_MEANINGS[name.lower()]] if name.lower() in KNOWN_MEANINGS else []
    close = difflib.get_close_matches(name.lower(), KNOWN_AXES, n=3, cutoff=0.5)
    return meant + [c for c in close if c not in meant]


def canonical_names(names, custom=(), field: str = "mesh.names") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(canonical names, notes): aliases renamed (``fsdp`` -> ``dp_shard``, one note each);
    a name of :data:`OWN_AXES` (``sp``) kept as a user-named axis, with its note where ``custom``
    does not list it; another name close to a known axis raises ConfigError unless it is in ``custom``.

    >>> canonical_names(["fsdp", "tp"])[0]
    ('dp_shard', 'tp')
    >>> canonical_names(["dp_shard", "tq"], custom=["tq"])
    (('dp_shard', 'tq'), ())
    >>> names, notes = canonical_names(["tp", "sp", "pp", "cfg", "dp"]); names, notes[0][:53]
    (('tp', 'sp', 'pp', 'cfg', 'dp'), "mesh.names: mesh axis 'sp' is planned as a user-named")
    >>> canonical_names(["dp_shard", "tq"])
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: mesh.names: 'tq' is not a standard axis; did you mean 'tp'? ...
    """
    out, notes = [], []
    for n in names:
        if n in ALIASES and n not in custom:
            target, note = ALIASES[n]
            if target in names:
                raise ConfigError(field, f"{n!r} and {target!r} both given; {n!r} means {target!r}: name it once")
            out.append(target)
            notes.append(f"{field}: {note}")
            continue
        if n in OWN_AXES and n not in custom:
            out.append(n)
            notes.append(f"{field}: {OWN_AXES[n]}")
            continue
        refusal = foreign_word(n) if n not in custom else None
        if refusal:
            raise ConfigError(field, refusal)
        close = close_axis(n)
        if close and n not in custom:
            quoted = [repr(c) for c in close]
            alts = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
            why = (f" ({n!r} in xDiT and DeepSpeed-Ulysses splits the sequence: meshplan's {close[0]!r}, context "
                   f"parallelism; Megatron-LM's sequence parallelism is [mesh] sequence_parallel = true)"
                   if n.lower() in KNOWN_MEANINGS else "")
            raise ConfigError(field, f"{n!r} is not a standard axis; did you mean {alts}?{why} If it is an axis of "
                              f"your own (rank math only, no model semantics), list it in mesh.custom_axes = [{n!r}]")
        out.append(n)
    return tuple(out), tuple(notes)
