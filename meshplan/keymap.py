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
from typing import Mapping, Optional, Sequence


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

    def field(self, name: str) -> str:
        """The key of dotted field ``name`` (``training.global_batch``)."""
        return self.fields.get(name, name)

    def bare(self, name: str) -> str:
        """The key of a batch field written without its table (``micro_batch 1 x dp 512``,
        ``global_batch / micro_batch 2``): ``training.<name>``'s key, else ``name``."""
        return self.fields.get(f"training.{name}", name)

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
