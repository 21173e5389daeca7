"""The candidate meshes of a restart on fewer nodes (:mod:`meshplan.restart` states the rules):
each a :class:`Proposal`, enumerated by :func:`candidates` over the data-parallel degrees the GPUs
left hold, at each (tp, cp) and pipeline degree tried (:mod:`meshplan.restart_degrees`), with the
batch contract it runs (kept, a smaller micro_batch, or a smaller global batch) or why none works.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from math import prod
from typing import Any, Callable, Optional, Union

from meshplan.mesh.resolve import Infeasible as NoMesh, resolve_mesh
from meshplan.restart_degrees import PipelineRule, axes_at, pipelines, splits
from meshplan.restart_rank import bounded, same_kind
from meshplan.restart_text import split_words
from meshplan.spec import mesh_words
from meshplan.spec.mesh import MeshSpec

#: Meshes that keep the global batch evaluated at most per pipeline degree (largest first), and larger
#: refused meshes reported.
KEEPERS, REFUSED_SHOWN = 4, 4


@dataclass(frozen=True)
class Proposal:
    """One mesh for the restart. ``names``/``shape``: dense axes (mesh order); ``ep``,
    ``etp`` kept; ``gpus``: ranks it uses; ``contract``: "" (kept as configured) or the
    changed field, ``"micro_batch 4 -> 2"`` (global batch kept) or ``"global_batch 512 -> 511"``;
    ``step_s``, ``tokens_per_s``, ``peak_bytes`` (most loaded stage): from its plan, None
    without an evaluator; ``sharding``: ``training.sharding``, which names the data axis in its
    text (:func:`meshplan.spec.mesh_words.mesh_text`; "" keeps the names); ``layers``: the model's
    layers where the text names the layer split (a pp or split the job did not run), else 0."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    ep: int
    etp: int
    gpus: int
    dp: int
    micro_batch: int
    global_batch: int
    micro_batches: int
    contract: str = ""
    step_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    peak_bytes: Optional[float] = None
    pp_layer_split: Optional[tuple[int, ...]] = None
    sharding: str = ""
    layers: int = 0

    @property
    def keeps_global_batch(self) -> bool:
        return not self.contract.startswith("global_batch")

    @property
    def pp(self) -> int:
        return dict(zip(self.names, self.shape)).get("pp", 1)

    @property
    def tp_cp(self) -> tuple[int, int]:
        deg = dict(zip(self.names, self.shape))
        return deg.get("tp", 1), deg.get("cp", 1)

    @property
    def ideal(self) -> float:
        """GPUs x the 1F1B busy fraction ``m / (m + pp - 1)`` (Narayanan et al. SC'21, 2.2.1:
        bubble ``(pp - 1) / m`` of the ideal time): the order meshes are planned in (:func:`~meshplan.restart_rank.bounded`)."""
        return self.gpus * self.micro_batches / (self.micro_batches + self.pp - 1)

    def mesh_text(self) -> str:
        """Every axis > 1, the expert axes too (``pp 16 x dp_shard 64 x ep 64``), and pp 1 where
        pp is an axis (a restart that removed the pipeline says so); with ``layers``, the layer
        split after pp (:func:`mesh_split_text`)."""
        return mesh_split_text(self.names, self.shape, self.sharding, self.ep, self.etp, self.pp_layer_split,
                               self.layers)

    def summary(self) -> str:
        """Mesh, GPUs, contract and (when planned) step and throughput, one line."""
        out = f"{self.mesh_text()} on {self.gpus} GPUs"
        out += f", {self.contract}" if self.contract else ", contract kept"
        if self.step_s is not None and self.tokens_per_s is not None:
            out += f": step {self.step_s:.2f} s, {self.tokens_per_s:,.0f} tokens/s"
        return out


def mesh_split_text(names, shape, sharding: str, ep: int, etp: int, split, layers: int) -> str:
    """A restart mesh's text (:func:`meshplan.spec.mesh_words.mesh_text`, pp 1 shown where pp is
    an axis) with, where ``layers`` is given and pp > 1, its layers per stage ``split`` (None:
    even) after pp (:func:`~meshplan.restart_text.split_words`), as a newcomer asked of a pp
    that does not divide the layers (trial 16).

    >>> mesh_split_text(("pp", "dp_shard", "tp"), (27, 1, 8), "", 1, 1, [3] * 26 + [2], 80)
    'pp 27 (3 layers per stage, 2 on the last) x tp 8'
    >>> mesh_split_text(("pp", "dp_shard", "tp"), (16, 2, 8), "", 1, 1, None, 80)
    'pp 16 (5 layers per stage) x dp_shard 2 x tp 8'
    """
    text = mesh_words.mesh_text(names, shape, sharding, ep, etp, ("pp",) if "pp" in names else ())
    pp = dict(zip(names, shape)).get("pp", 1)
    head = f"pp {pp}"
    if not layers or pp < 2 or not (text == head or text.startswith(head + " x ")):
        return text
    return f"{head} ({split_words(split, layers, pp)})" + text[len(head):]


@dataclass(frozen=True)
class Where:
    """What every candidate mesh is checked against: the old ``mesh``, the ``left`` GPUs, the
    batch contract (``reasons_of(pp, m)``: the schedule's micro-batch rule), ``sharding`` (the
    text's data axis) and the evaluator's ``screen`` (why a mesh cannot fit before it is
    planned, "" when it may; None: none)."""

    mesh: Any
    left: int
    global_batch: int
    micro_batch: int
    reasons_of: Callable[[int, int], tuple[str, ...]]
    sharding: str = ""
    screen: Optional[Callable[[Proposal], str]] = None


def candidates(w: Where, pipeline: Optional[PipelineRule] = None,
               pairs: tuple[tuple[int, int], ...] = ()) -> tuple[list, Optional[Proposal], list, list, list]:
    """(meshes keeping the global batch: up to :data:`KEEPERS` per (tp, cp, pp), largest first,
    at most :data:`~meshplan.restart_rank.TRIED` (:func:`~meshplan.restart_rank.bounded`); the largest mesh changing it when larger than
    those; refused meshes as (text, GPUs); those of them the screen refused), for data-parallel
    degrees from the most the GPUs left hold down to 1, at each (tp, cp) of ``pairs`` (the
    mesh's own by default) and each pipeline degree of :func:`pipelines`; last, the job's kind
    (:func:`~meshplan.restart_rank.same_kind`: the configured tp, cp, pp and split): its largest
    mesh keeping the global batch and its largest changing it where larger (all GPUs but a few)."""
    keepers: list[Proposal] = []
    changers: list[Proposal] = []
    refused: list[tuple[str, int]] = []
    kind: list[Proposal] = []
    pairs = pairs or ((w.mesh.degree("tp"), w.mesh.degree("cp")),)
    for tp, cp in pairs:
        for pp, split in pipelines(w.mesh, w.left, pipeline, tp * cp):
            new = pipeline is not None and (pp, split) != (pipeline.pp, pipeline.split)  # named in the text
            k, c, r = _at(w, {"tp": tp, "cp": cp, "pp": pp}, split, pipeline.layers if new and pipeline else 0)
            if not kind and not keepers + changers and pp == w.mesh.degree("pp"):  # the configured tp, cp, pp first
                kind = k[:1] + ([c] if c and (not k or c.gpus > k[0].gpus) else [])
            keepers += k
            changers += [c] if c else []
            refused += r
    tried, screened = bounded(keepers, pairs, w.screen)
    top = max((p.gpus for p in keepers), default=0)
    changer = max((c for c in changers if c.gpus > top), key=lambda c: c.gpus, default=None)
    return tried, changer, refused, screened, [p for p in kind if same_kind(p, w.mesh)]


def _at(w: Where, inner: dict[str, int], split, layers: int = 0):
    """:func:`candidates` at one (tp, cp, pp) ``inner`` (layers per stage ``split``, named in the
    text where ``layers`` is given: :func:`mesh_split_text`). At most
    :data:`REFUSED_SHOWN` refusals kept (the largest; only those can be shown), later meshes
    whose expert block cannot divide then skipped unresolved; once the changer or a keeper is
    found, a degree that cannot keep the global batch is skipped (only the largest changer is
    kept, and a smaller refusal is not shown). The schedule's reasons are asked once per
    micro-batch count."""
    mesh, pp = w.mesh, inner["pp"]
    names, deg = axes_at(mesh, inner)
    ep, etp = mesh.ep, mesh.etp
    fixed_world = inner["tp"] * inner["cp"] * pp
    reasons_of = lru_cache(maxsize=None)(lambda m: w.reasons_of(pp, m))
    keepers: list[Proposal] = []
    changer: Optional[Proposal] = None
    refused: list[tuple[str, int]] = []
    for d in range(w.left // fixed_world, 0, -1):
        if all(w.global_batch % (b * d) for b in range(1, w.micro_batch + 1)) and (
                changer is not None or keepers or len(refused) >= REFUSED_SHOWN
                and all(reasons_of(m) for m in range(max(1, w.global_batch // (w.micro_batch * d)), 0, -1))):
            continue  # cannot keep the global batch: neither the largest changer nor a refusal shown
        for shape in splits(names, deg, d):
            gpus = fixed_world * d
            block = prod(x for n, x in zip(names, shape) if n in ("dp_shard", "dp", "cp", "tp"))
            if len(refused) >= REFUSED_SHOWN and block % (ep * etp):
                continue
            spec = MeshSpec(names=list(names) + [a for a, x in (("ep", ep), ("etp", etp)) if x > 1],
                            shape=list(shape) + [x for x in (ep, etp) if x > 1])
            resolved = resolve_mesh(spec, gpus)
            text = f"{mesh_split_text(names, shape, w.sharding, ep, etp, split, layers)} ({gpus} GPUs)"
            if isinstance(resolved, NoMesh):
                refused.append((f"{text}: {'; '.join(resolved.reasons)}", gpus))
                continue
            p = _contract(Proposal(names, shape, ep, etp, gpus, d, w.micro_batch, w.global_batch, 0,
                                   pp_layer_split=split, sharding=w.sharding, layers=layers), reasons_of)
            if isinstance(p, str):
                refused.append((f"{text}: {p}", gpus))
            elif p.keeps_global_batch:
                keepers.append(p)
            elif changer is None and not keepers:
                changer = p
            if len(keepers) >= KEEPERS:
                return keepers, changer, refused[:REFUSED_SHOWN]
    return keepers, changer, refused[:REFUSED_SHOWN]


def why_not_kept(global_batch: int, micro_batch: int, p: Proposal, reasons_of) -> str:
    """Why ``p``'s dp breaks the contract as configured (the dp rule's words, or the schedule's at its pp)."""
    dp = p.dp
    if global_batch % (micro_batch * dp):
        return (f"global_batch {global_batch} is not divisible by micro_batch {micro_batch} x dp {dp} = "
                f"{micro_batch * dp}")
    return "; ".join(reasons_of(p.pp, global_batch // (micro_batch * dp)))


def _contract(p: Proposal, reasons_of) -> Union[Proposal, str]:
    """``p`` with the contract it runs: as configured; else the largest smaller micro_batch
    that keeps the global batch; else the largest global batch below the configured one that
    is a whole number of micro-batches the schedule accepts (at least one per rank). A string:
    why none works (the schedule's reasons at the most micro-batches the global batch allows)."""
    gb, mb, dp = p.global_batch, p.micro_batch, p.dp
    for b in range(mb, 0, -1):
        if gb % (b * dp) == 0 and not reasons_of(gb // (b * dp)):
            return replace(p, micro_batch=b, micro_batches=gb // (b * dp),
                           contract="" if b == mb else f"micro_batch {mb} -> {b}")
    most = max(1, gb // (mb * dp))
    for m in range(most, 0, -1):
        if not reasons_of(m):
            return replace(p, micro_batches=m, global_batch=m * mb * dp, contract=f"global_batch {gb} -> {m * mb * dp}")
    return (f"none of 1-{most} micro-batches a step runs ({most} = global_batch {gb} // (micro_batch {mb} x dp {dp})); "
            f"at {most}: " + "; ".join(reasons_of(most)))
