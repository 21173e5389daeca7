"""The message for an unknown catalog name (:func:`unknown_message`): the closest entries
(:func:`meshplan.errors.did_you_mean`) only where they hold the same GPU as the name typed,
else how to describe the GPU or node in the config.

What a name says of its GPU (:func:`gpu_variant`): the model (``h100``), the memory
(``40gb``, or ``40g`` as ``dgx-a100-40g`` spells it) and the form factor (``pcie``, ``sxm``, ``nvl``, ``oam``). Two names hold another
GPU (:func:`other_gpu`) when their models differ other than as a typo (``h800`` against
``h100``; ``h10`` and ``h10O`` against ``h100`` are typos), when the typed model is a real GPU
whose name only looks like a catalog one's (:data:`OTHER_GPUS`: ``h20`` is NVIDIA H20, not a
short ``h200``), or when both give a memory or both a form factor and these differ
(``a100-40gb`` against ``a100-sxm-80gb``).
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

from meshplan.errors import did_you_mean

_GPU_PART = re.compile(r"[a-z]{1,2}[0-9]{2,3}[a-z]?")
#: A memory size part, in GB: ``40gb`` or ``40g`` (any case: names are read lower case).
_MEMORY = re.compile(r"([0-9]{2,3})gb?")
#: Form factors a GPU name carries as the start of a part (h100-pcie, a100-sxm4-40gb, h100-nvl, mi300x-oam).
_FORMS = ("pcie", "sxm", "nvl", "oam")
#: Letters typed for the digit they look like, read as that digit after a model's first digit (h10O: h100).
_LOOKALIKE = str.maketrans({"o": "0", "l": "1", "i": "1"})

#: Real GPUs whose model name starts a catalog GPU's (h20 of h200, a10 of a100), which the rule
#: "one name starts the other" would take for a typo: what each is (said in the error), and its source.
OTHER_GPUS = {
    "h20": ("NVIDIA H20: Hopper, 96 GB HBM3, compute cut for export to China",
            "no NVIDIA datasheet is public; 96 GB HBM3 at 4.0 TB/s is what its resellers list"),
    "a10": ("NVIDIA A10: Ampere GA102, 24 GB GDDR6, PCIe", "NVIDIA A10 Tensor Core GPU datasheet"),
}


class GPUVariant(NamedTuple):
    """What a name says of its GPU: model (lower case), memory in GB, form factor; None where
    it says nothing."""

    model: Optional[str]
    memory_gb: Optional[int] = None
    form: Optional[str] = None

    def label(self) -> str:
        """The parts given, joined as a catalog name would: ``a100-40gb``, ``h100-pcie``."""
        mem = f"{self.memory_gb}gb" if self.memory_gb else None
        return "-".join(p for p in (self.model, self.form, mem) if p)


def gpu_part(name: object) -> Optional[str]:
    """The GPU model a catalog-style name holds, lower case: its first ``-``-separated part of
    1-2 letters, 2-3 digits and at most one letter, a letter typed for a digit read as that
    digit (``h10O``: h100); None without one.

    >>> gpu_part("dgx-H800"), gpu_part("h100-sxm5-80gb"), gpu_part("mi300x-azure-nd-v5"), gpu_part("seed-8x8-2nic")
    ('h800', 'h100', 'mi300x', None)
    >>> gpu_part("dgx-h10O"), gpu_part("hgx-h20")
    ('h100', 'h20')
    """
    if not isinstance(name, str):
        return None
    part = next((p for p in name.lower().split("-") if _GPU_PART.fullmatch(p)), None)
    if part is None:
        return None
    digit = next(i for i, ch in enumerate(part) if ch.isdigit()) + 1  # the model's first digit stays
    fixed = part[:digit] + part[digit:].translate(_LOOKALIKE)
    return fixed if re.fullmatch(r"[a-z]{1,2}[0-9]{3}", fixed) else part


def gpu_variant(name: object) -> GPUVariant:
    """The model, memory (a part ``NNgb`` or ``NNg``, any case) and form factor (a part starting ``pcie``, ``sxm``,
    ``nvl`` or ``oam``) a catalog-style name holds.

    >>> gpu_variant("dgx-a100-40gb"), gpu_variant("h100-pcie"), gpu_variant("h100-sxm5-80gb")
    (GPUVariant(model='a100', memory_gb=40, form=None), GPUVariant(model='h100', memory_gb=None, form='pcie'), \
GPUVariant(model='h100', memory_gb=80, form='sxm'))
    >>> [gpu_variant(n).memory_gb for n in ("dgx-a100-40g", "DGX-A100-40G", "dgx-a100-80G", "a100-40GB")]
    [40, 40, 80, 40]
    """
    if not isinstance(name, str):
        return GPUVariant(None)
    parts = name.lower().split("-")
    mem = next((int(m.group(1)) for p in parts if (m := _MEMORY.fullmatch(p))), None)
    form = next((f for p in parts for f in _FORMS if p.startswith(f)), None)
    return GPUVariant(gpu_part(name), mem, form)


def other_gpu(typed: GPUVariant, known: GPUVariant, known_models: tuple[str, ...] = ()) -> bool:
    """True when the entry ``known`` (a GPU; for a node its GPU's variant, and the model its
    own name gives in ``known_models``) holds another GPU than the name typed (see the module
    docstring). Models not given are no evidence either way.

    >>> v = GPUVariant
    >>> other_gpu(v("h800"), v("h100")), other_gpu(v("h10"), v("h100")), other_gpu(v("h800"), v(None))
    (True, False, False)
    >>> other_gpu(v("h20"), v("h200")), other_gpu(v("a100", 40), v("a100", 80, "sxm")), other_gpu(v("h100", 80), v("h100"))
    (True, True, False)
    >>> other_gpu(v("gb200"), v("b200", 186), ("gb200",)), other_gpu(v("h100", form="pcie"), v("h100", 80, "sxm"))
    (False, True)
    """
    differ = [typed.memory_gb and known.memory_gb and typed.memory_gb != known.memory_gb,
              typed.form and known.form and typed.form != known.form]
    if any(differ):
        return True
    models = [m for m in (known.model, *known_models) if m]
    if not typed.model or not models or typed.model in models:
        return False
    if typed.model in OTHER_GPUS:
        return True
    return not any(typed.model.startswith(m) or m.startswith(typed.model) for m in models)


#: Words of a node name that say which network it is on (``dgx-h100-roce``): the catalog's nodes
#: name their GPU and form, never their scale-out network (a catalog system carries its own).
NETWORK_WORDS = {"roce": "RoCE", "rocev2": "RoCE", "ib": "InfiniBand", "infiniband": "InfiniBand",
                 "ndr": "InfiniBand NDR", "hdr": "InfiniBand HDR", "xdr": "InfiniBand XDR", "eth": "Ethernet",
                 "ethernet": "Ethernet", "efa": "AWS EFA", "tcp": "TCP", "spectrumx": "Spectrum-X Ethernet"}


def network_hint(name: object, known: list[str]) -> str:
    """For a node name that names a network (:data:`NETWORK_WORDS`) no catalog node's name has,
    how to describe that node on its network (docs/input.md, "Input: inline clusters"): the
    ``; ...`` end of the unknown-node message, else "".

    >>> network_hint("dgx-h100-roce", ["dgx-h100"])[:60]
    '; a dgx-h100-roce on RoCE is not a catalog system: describe '
    >>> network_hint("dgx-h10", ["dgx-h100"])
    ''
    """
    words = re.split(r"[-_.@/: ]+", name.lower()) if isinstance(name, str) else []
    known_words = {w for n in known for w in re.split(r"[-_.@/: ]+", n.lower())}
    nets = [NETWORK_WORDS[w] for w in words if w in NETWORK_WORDS and w not in known_words]
    if not nets:
        return ""
    return (f"; a {name} on {nets[0]} is not a catalog system: describe it in [cluster] without system, as gpu, "
            f"nodes, node = {{ ..., nics = [...] }} (its NICs' rate_gbit_per_s) and network = [...] (its tiers' "
            f"latency_us, oversubscription), the catalog node's values as a start (meshplan catalog node), "
            f"docs/input.md \"Input: inline clusters\"")


def unknown_message(kind: str, name: object, known: list[str], held: dict[str, str]) -> str:
    """The message for an unknown ``name`` of ``kind`` (``known``: the catalog's names; ``held``:
    each node's GPU, for ``kind`` node): the closest entries, or those containing it
    (:func:`meshplan.errors.did_you_mean`), then every known one. A guess holds the same GPU as
    the name typed (:func:`other_gpu`): where the near names hold another GPU, or the typed GPU is
    a real one (:data:`OTHER_GPUS`, or a catalog model in a variant none holds), the message says
    so, names no entry as a spelling of it, lists the entries (nodes with their GPUs) and how to
    describe one in ``[cluster]`` (docs/input.md)."""
    typed = gpu_variant(name)
    variant = {n: (gpu_variant(held.get(n, n)), tuple(m for m in (gpu_part(n),) if m and n in held)) for n in known}
    same = [n for n in known if not other_gpu(typed, *variant[n])]
    guess, near = did_you_mean(name, same), did_you_mean(name, known)
    kin = [n for n in known if typed.model and typed.model in (variant[n][0].model, *variant[n][1])]
    real = typed.model in OTHER_GPUS or (kin and not set(kin) & set(same))  # a GPU no entry holds
    if guess or not (near or real):
        hint = network_hint(name, known) if kind == "node" else ""
        return f"unknown {kind} '{name}'; {guess}known: {', '.join(known)}{hint}"
    nearest = near.split("'")[1] if near else kin[0] if kin else None
    why = [OTHER_GPUS[typed.model][0]] if typed.model in OTHER_GPUS else []
    why += [f"'{nearest}' is another GPU, not a spelling of it"] if nearest else []
    lacks = (f"no catalog node holds GPU '{typed.label()}'" if kind == "node" else
             f"no catalog GPU is an '{typed.label()}'")
    listing = ", ".join(f"{n} ({held[n]})" for n in known) if kind == "node" else ", ".join(known)
    how = ("[cluster] gpu = {...} and node = {...}, or a catalog system with gpu = {...} and fabric = {...}"
           if kind == "node" else "[cluster] gpu = {...}")
    return (f"unknown {kind} '{name}'; {lacks} ({'; '.join(why)}); known: {listing}; describe yours in the "
            f"config: {how} (docs/input.md)")
