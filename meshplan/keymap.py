"""The names a ``fix:`` or ``hint:`` line gives a setting: meshplan's own fields by default, a
foreign file's keys where the config was read from one (ttkeys finding 2: a torchtitan job TOML,
Megatron-LM arguments or a DeepSpeed JSON has no ``training.global_batch``). A builder of such a
line takes a :class:`KeyMap` and prints its words directly; each format's map has one home,
:mod:`meshplan.interop.keymaps`. A field or setting the map has no key for keeps meshplan's name,
so that the line stays true.

>>> OWN.field("training.global_batch"), OWN.bare("micro_batch"), OWN.axis("tp"), OWN.setting("recompute full")
('training.global_batch', 'micro_batch', 'tp', 'recompute full')
>>> tt = KeyMap(fields={"training.micro_batch": "training.local_batch_size"}, degrees={"tp": "tensor_parallel_degree"})
>>> f"{tt.axis('tp')} x2 ({tt.axis('dp_shard')} 2 x {tt.axis('tp')} 4); {tt.bare('micro_batch')} 1"
'tensor_parallel_degree x2 (dp_shard 2 x tensor_parallel_degree 4); training.local_batch_size 1'
"""

from __future__ import annotations

from dataclasses import dataclass, field as _field
from typing import Callable, Mapping, Optional, Sequence


@dataclass(frozen=True, eq=False)
class KeyMap:
    """A file format's words for meshplan's: ``fields``, a dotted meshplan field
    (``training.global_batch``) -> the file's key; ``settings``, a fix's setting in meshplan's
    words (``recompute full``) -> what to write in the file; ``degrees``, a mesh axis (``tp``) ->
    the file's key for its degree, as a fix names it beside the degree (``tp 4``, ``tp x2``)."""

    fields: Mapping[str, str] = _field(default_factory=dict)
    settings: Mapping[str, str] = _field(default_factory=dict)
    degrees: Mapping[str, str] = _field(default_factory=dict)
    #: axis -> the file's own key for its degree (``parallelism.tensor_parallel_degree``), and what
    #: stands between a key and its value where the file sets it (Megatron-LM's flags: a space).
    degree_keys: Mapping[str, str] = _field(default_factory=dict)
    assign: str = " = "
    #: dotted field -> how many of the file's units one of meshplan's holds, where they differ: a
    #: torchtitan b5bcd76 registry counts the batch in tokens, ``max_context_length`` a sequence
    #: (:mod:`meshplan.interop.torchtitan_batch`); absent: the same unit.
    units: Mapping[str, int] = _field(default_factory=dict)
    #: (layers per stage, chunks a stage) -> the file's setting of that pipeline split, where the file
    #: has no key of layer counts (torchtitan's module names per model part:
    #: :func:`meshplan.interop.torchtitan_split.split_setting`); None: ``mesh.pp_layer_split``'s key.
    splits: Optional[Callable[[list[int], int], Optional[str]]] = None

    def field(self, name: str) -> str:
        """The key of dotted field ``name`` (``training.global_batch``)."""
        return self.fields.get(name, name)

    def bare(self, name: str) -> str:
        """The key of a batch field written without its table (``micro_batch 1 x dp 512``,
        ``global_batch / micro_batch 2``): ``training.<name>``'s key, else ``name``."""
        return self.fields.get(f"training.{name}", name)

    def amount(self, name: str, n: int) -> str:
        """The key of batch field ``name`` (dotted, ``training.global_batch``, or bare, ``micro_batch``
        for ``training.<name>``, each as :meth:`field` and :meth:`bare` name it) with the value ``n``
        (meshplan's unit: sequences) as the file writes it: ``n`` times its unit, then ``(n x unit)``
        (newcomer trial nc57 #4b: a b5bcd76 torchtitan registry's token counts).

        >>> tok = KeyMap(fields={"training.micro_batch": "training.num_tokens_per_microbatch_per_dp_rank"},
        ...              units={"training.micro_batch": 8192})
        >>> tok.amount("micro_batch", 2), OWN.amount("micro_batch", 2), OWN.amount("training.global_batch", 8)
        ('training.num_tokens_per_microbatch_per_dp_rank 16384 (2 x 8192)', 'micro_batch 2', 'training.global_batch 8')
        """
        dotted = "." in name
        key, unit = (self.field(name), self.units.get(name, 1)) if dotted else \
            (self.bare(name), self.units.get(f"training.{name}", 1))
        return f"{key} {n * unit} ({n} x {unit})" if unit != 1 else f"{key} {n}"

    def split_setting(self, split: list[int], chunks: int) -> str:
        """What the file writes for the per-stage pipeline split ``split`` with ``chunks`` chunks a
        stage (newcomer trial nc58 #3b: torchtitan takes module names, not counts).

        >>> OWN.split_setting([15, 17], 1)
        'mesh.pp_layer_split = [15, 17]'
        """
        own = self.splits(split, chunks) if self.splits is not None else None
        return own or f"{self.field('mesh.pp_layer_split')} = {split}"

    def setting(self, words: str) -> str:
        """What the file writes for the setting ``words`` (``recompute full``)."""
        return self.settings.get(words, words)

    def axis(self, name: str) -> str:
        """The key of axis ``name``'s degree where a fix names it beside the degree."""
        return self.degrees.get(name, name)

    def mesh_change(self, names: Sequence[str], old: Sequence[int], new: Sequence[int]) -> Optional[str]:
        """The degrees of ``new`` that differ from ``old`` (shapes over the axes ``names``) as the
        file sets them; None where none differs or the file has no key for one of them (the line
        then keeps meshplan's ``mesh.shape [...]``).

        >>> mg = KeyMap(degree_keys={"tp": "--tensor-model-parallel-size"}, assign=" ")
        >>> mg.mesh_change(["dp", "tp"], [2, 4], [2, 2]), mg.mesh_change(["dp", "tp"], [2, 4], [4, 2])
        ('--tensor-model-parallel-size 2', None)
        >>> OWN.mesh_change(["dp", "tp"], [2, 4], [4, 2]) is None
        True
        """
        changed = [self.degree_setting(n, d) for n, d, was in zip(names, new, old) if d != was]
        if not changed or any(c is None for c in changed):
            return None
        return ", ".join(c for c in changed if c)

    def degree_setting(self, axis: str, degree: int) -> Optional[str]:
        """The file's setting of ``axis``'s degree (``parallelism.tensor_parallel_degree = 2``), or
        None where it has no key for it."""
        key = self.degree_keys.get(axis)
        return None if key is None else f"{key}{self.assign}{degree}"


#: meshplan's own names: the default of every builder that takes a :class:`KeyMap`.
OWN = KeyMap()
