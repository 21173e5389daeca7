"""What makes the search's top mesh faster than the runner-up: both exact step times split
into the same parts, and the parts that differ most, with their numbers.

The parts come from :mod:`meshplan.search.step_parts`
(:func:`~meshplan.search.step_parts.step_breakdown`: seconds on the critical stage that add up
to the step; :func:`~meshplan.search.step_parts.layer_passes`: a count, kept apart from the
seconds). :func:`explain` lines up two breakdowns and names the largest differences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from meshplan.search.tie_key import RECOMPUTE_BY_COST
from meshplan.search.step_parts import SPLIT_PARTS
from meshplan.spec.search import TIE, shorter_by
from meshplan.schedule.kernel_kinds import largest_kinds
from meshplan.spec.mesh_words import data_axis
from meshplan.spec.wording import fold_streams


@dataclass(frozen=True)
class Difference:
    """One part of the step: its seconds in the top and the runner-up, and what sets it."""

    part: str
    top_s: float
    runner_s: float
    context: str
    shown: str = ""  # the part as the line prints it (its stream named by the engine, :func:`_shown`); "": part

    @property
    def gain_s(self) -> float:
        """Seconds the runner-up spends more on this part (negative: the top spends more)."""
        return self.runner_s - self.top_s


def _shorter_words(rel: float, top_s: float, runner_s: float) -> str:
    """``top's step is 4.1% shorter than #2's`` (``rel``: :func:`~meshplan.spec.search.shorter_by`,
    1 - top / #2, as ``compare`` and the rule say it), with more digits below 0.1% (``0.042%
    shorter``), and ``equals #2's`` with both steps when they agree to 0.001% (a "0.0% shorter"
    says nothing).

    >>> _shorter_words(0.041, 10.0, 10.43), _shorter_words(0.00042, 12.0, 12.005)
    ("top's step is 4.1% shorter than #2's", "top's step is 0.042% shorter than #2's")
    >>> _shorter_words(0.0, 12.3456, 12.3456)
    "top's step equals #2's (12.346 s both, within 0.001%)"
    """
    if rel >= 1e-3:
        return f"top's step is {rel:.1%} shorter than #2's"
    if rel >= 1e-5:
        return f"top's step is {rel * 100:.2g}% shorter than #2's"
    both = f"{top_s:.3f} s both" if f"{top_s:.3f}" == f"{runner_s:.3f}" else f"{top_s:.3f} s vs {runner_s:.3f} s"
    return f"top's step equals #2's ({both}, within 0.001%)"


def relative(rel: float, than: str) -> str:
    """``|rel|`` as a percentage, ``longer`` or ``shorter`` (rel < 0) ``than``: two decimals
    from 0.1%, two significant digits below (``0.0042% longer``), and ``equal to ... within
    0.001%`` where the two agree that closely (never a "0.00% longer").

    >>> relative(0.0123, "the top's"), relative(-4.2e-5, "the top's")
    ("1.23% longer than the top's", "0.0042% shorter than the top's")
    >>> relative(3e-6, "the top's")
    "equal to the top's within 0.001%"
    """
    a = abs(rel)
    word = "longer" if rel >= 0 else "shorter"
    if a >= 1e-3:
        return f"{a:.2%} {word} than {than}"
    if a >= 1e-5:
        return f"{a * 100:.2g}% {word} than {than}"
    return f"equal to {than} within 0.001%"


@dataclass(frozen=True)
class Explanation:
    """The top against the runner-up: relative step difference (runner / top - 1), the
    parts ordered by how much they differ, and the fastest feasible candidate the search
    knows: ``fastest_step_s`` (seconds), ``fastest_row`` (its row, 1 = the top; None when
    the rows listed leave it out) and ``fastest_label``. When it is faster than the top
    (``tie_listed_first``), the top is within the tie rule's 1% of it and was listed first for
    its simpler mesh; the line then says so and names it, so that no row listed is faster
    than the line claims the top to be. ``by_tie_rule``: the tie rule ordered the top and the
    runner-up, both within :data:`~meshplan.spec.search.TIE` (1%) of the fastest, an exact tie
    included. ``tie_criterion``: the tie rule's criterion that placed the top before the fastest,
    with both values (:func:`meshplan.search.rank.decide`: ``lower peak memory (64.4 vs 66.1
    GiB)``), named on the line; "" when unknown. ``tiers``: the headroom tiers
    (:mod:`meshplan.search.headroom`), not the tie rule, listed the top before faster rows, the
    criterion then their free memory, and the top may be more than 1% longer than the fastest."""

    top_step_s: float
    runner_step_s: float
    parts: tuple[Difference, ...]
    fastest_step_s: float
    fastest_row: Optional[int] = 1
    fastest_label: str = ""
    tie_criterion: str = ""
    tiers: bool = False

    @property
    def faster(self) -> float:
        """#2's step over the top's, less 1 (the JSON's ``runner_up_slower_by``: #2 is that much
        longer than the top's)."""
        return self.runner_step_s / self.top_step_s - 1

    @property
    def shorter(self) -> float:
        """How much shorter the top's step is than #2's, 1 - top / #2
        (:func:`~meshplan.spec.search.shorter_by`: the line's figure, as ``compare`` says it)."""
        return shorter_by(self.top_step_s, self.runner_step_s)

    @property
    def tie_listed_first(self) -> bool:
        """Whether a candidate faster than the top exists (the tie rule listed the top first)."""
        return self.fastest_step_s < self.top_step_s

    @property
    def by_tie_rule(self) -> bool:
        """Whether the tie rule set the top's place against the runner-up: a faster candidate
        exists (:attr:`tie_listed_first`), or the runner-up is within the rule's 1% of the
        fastest (0% included: equal steps are ordered by the rule's keys).

        >>> explain({"step": 10.0}, {"step": 10.0}, {}, {}).by_tie_rule
        True
        >>> [explain({"step": 10.0}, {"step": s}, {}, {}).by_tie_rule for s in (10.1, 10.11)]
        [True, False]
        """
        return self.tie_listed_first or self.runner_step_s <= self.fastest_step_s * (1 + TIE)

    def line(self, most: int = 3) -> str:
        """``top's step is 4.1% shorter than #2's: bubble 3.2 s vs 5.0 s (pp 16 vs 32), ...`` when the top
        is the fastest; else ``top's step 12.337 s is 0.089% longer than the fastest's (#4,
        12.326 s), within 1%: ...; against #2 (12.348 s, 0.089% longer than the top's): ...``
        (:func:`relative`: never a "0.00%")."""
        parts = self.parts_text(most)
        if not self.tie_listed_first:
            return f"{_shorter_words(self.shorter, self.top_step_s, self.runner_step_s)}: {parts}"
        where = f"#{self.fastest_row}" if self.fastest_row else f"{self.fastest_label}, not listed"
        longer = relative(self.top_step_s / self.fastest_step_s - 1, "the fastest's")
        why = (f": {self.tie_criterion}" if self.tie_criterion
               else " (fewer axes / lower degrees / lower peak memory)")
        head = (f"top's step {self.top_step_s:.3f} s is {longer} ({where}, {self.fastest_step_s:.3f} s), within 1%: "
                f"listed first by the tie rule{why}")
        if self.tiers:
            head = (f"top's step {self.top_step_s:.3f} s is {longer} ({where}, {self.fastest_step_s:.3f} s): listed "
                    f"first by the headroom tiers{why}")
        if self.fastest_row == 2:
            return f"{head}; parts against #2: {parts}"
        runner = f"{self.runner_step_s:.3f} s, " + relative(self.faster, "the top's")
        return f"{head}; against #2 ({runner}): {parts}"

    def parts_text(self, most: int = 3) -> str:
        """The ``most`` parts that differ most, as :meth:`line` prints them (``no part differs``)."""
        return ", ".join(_part_text(d) for d in self.parts[:most]) or "no part differs"

    def to_dict(self) -> dict:
        return {"top_step_s": self.top_step_s, "runner_up_step_s": self.runner_step_s,
                "runner_up_slower_by": self.faster, "by_tie_rule": self.by_tie_rule,
                "tie_listed_first": self.tie_listed_first,
                "fastest_step_s": self.fastest_step_s, "fastest_row": self.fastest_row,
                "fastest_label": self.fastest_label, "tie_criterion": self.tie_criterion, "tiers": self.tiers,
                "parts": [{"part": d.part, "top_s": d.top_s, "runner_up_s": d.runner_s, "context": d.context}
                          for d in self.parts],
                "line": self.line()}


def _fmt(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}g} s" if abs(x) >= 1 else f"{x * 1e3:.{digits}g} ms"


def _pair(a: float, b: float) -> str:
    """``a vs b`` (seconds) to 3 significant digits, more (up to 6) where two different values
    would print the same: a user read ``compute 1.51 s vs 1.51 s`` for 1.5113 vs 1.5142 s.

    >>> _pair(1.5113, 1.5142), _pair(0.0126, 0.013), _pair(2.0, 2.0)
    ('1.511 s vs 1.514 s', '12.6 ms vs 13 ms', '2 s vs 2 s')
    """
    digits = 3
    while a != b and digits < 6 and _fmt(a, digits) == _fmt(b, digits):
        digits += 1
    return f"{_fmt(a, digits)} vs {_fmt(b, digits)}"


def _part_text(d: Difference) -> str:
    return f"{d.shown or d.part} {_pair(d.top_s, d.runner_s)}" + (f" ({d.context})" if d.context else "")


def _shown(part: str, a: dict, b: dict) -> str:
    """``part`` as the step text names it: an ``exposed <stream>`` by each row's ``streams``
    (:func:`meshplan.spec.wording.stream_words`: the stream follows the engine), both names where
    the rows' engines differ.

    >>> zero = {"streams": {"fsdp": "ZeRO data-parallel"}}
    >>> _shown("exposed fsdp", zero, zero), _shown("exposed fsdp", zero, {}), _shown("bubble", zero, {})
    ('exposed ZeRO data-parallel', 'exposed ZeRO data-parallel (#2: fsdp)', 'bubble')
    """
    if not part.startswith("exposed "):
        return part
    stream = part[len("exposed "):]
    na, nb = (x.get("streams", {}).get(stream, stream) for x in (a, b))
    return f"exposed {na}" if na == nb else f"exposed {na} (#2: {nb})"


def _data_vs(a: dict, b: dict) -> str:
    """The data axis's degrees, each named by its row's sharding (:func:`meshplan.spec.mesh_words.data_axis`:
    ``dp`` on zero1/zero2 rows, ``dp_shard`` on zero3/hsdp ones), as the rows' meshes print it.

    >>> _data_vs({"dp_shard": 8, "sharding": "zero1"}, {"dp_shard": 4, "sharding": "zero1"})
    'dp 8 vs 4'
    >>> _data_vs({"dp_shard": 8, "sharding": "zero1"}, {"dp_shard": 4, "sharding": "zero3"})
    'dp 8 vs dp_shard 4'
    """
    if "dp_shard" not in a or "dp_shard" not in b or a["dp_shard"] == b["dp_shard"]:
        return ""
    na, nb = (data_axis(x["sharding"]) if "sharding" in x else "dp_shard" for x in (a, b))
    return f"{na} {a['dp_shard']} vs " + (f"{b['dp_shard']}" if na == nb else f"{nb} {b['dp_shard']}")


#: How a description key is printed where its own name would not read well.
LABELS = {"gemm_efficiency": "GEMM efficiency", "m": "micro-batches", "micro_batch": "micro-batch",
          "stage_flops": "FLOP per GPU", "copies_s": "copies on the compute stream"}

#: Recompute policies from the least to the most recomputed: more recompute, more compute (the
#: tie rule's order, one home).
RECOMPUTE_ORDER = RECOMPUTE_BY_COST


def _compute_causes(a: dict, b: dict) -> list[str]:
    """What explains the compute part's direction (top ``a``, runner-up ``b``, each with its
    ``compute`` seconds): first, with both ``compute_split``
    (:func:`~meshplan.search.step_parts.compute_split`), the part
    whose seconds differ most (:func:`_largest_split`); then a higher GEMM efficiency, fewer executed FLOP per GPU, less recompute,
    less time in collectives' copies on the compute stream (``copies_s``: FSDP2's) on the side
    with less compute; a cause pointing the other way is not named. Micro-batch and tp follow
    as plain differences (they move compute either way).

    >>> a = {"compute": 26.5, "gemm_efficiency": 0.696, "stage_flops": 1.6e16, "recompute": "none"}
    >>> _compute_causes(a, {"compute": 27.0, "gemm_efficiency": 0.713, "stage_flops": 1.8e16, "recompute": "full"})
    ['FLOP per GPU 1.6e+16 vs 1.8e+16', 'recompute none vs full']
    >>> _compute_causes(a, {"compute": 27.0, "gemm_efficiency": 0.6, "stage_flops": 1.6e16, "recompute": "none"})
    ['GEMM efficiency 69.6% vs 60.0%']
    >>> _compute_causes({**a, "copies_s": 0.0}, {"compute": 27.0, "gemm_efficiency": 0.713, "stage_flops": 1.6e16,
    ...                                         "recompute": "none", "copies_s": 0.433})
    ['copies on the compute stream 0 ms vs 433 ms']
    """
    less = b.get("compute", 0.0) - a.get("compute", 0.0)  # > 0: the top computes less
    out = [_largest_split(a, b)] if "compute_split" in a and "compute_split" in b else []
    out = [t for t in out if t]
    if "gemm_efficiency" in a and "gemm_efficiency" in b and (a["gemm_efficiency"] - b["gemm_efficiency"]) * less > 0:
        out.append(_vs(a, b, "gemm_efficiency", "{:.1%}"))
    if a.get("stage_flops") and b.get("stage_flops") and (b["stage_flops"] - a["stage_flops"]) * less > 0:
        out.append(_vs(a, b, "stage_flops", "{:.3g}"))
    word = lambda x: str(x.get("recompute", "")).split(" ")[0]  # a block row's "block 5/10": its policy's place
    ra, rb = (RECOMPUTE_ORDER.index(word(x)) if word(x) in RECOMPUTE_ORDER else None for x in (a, b))
    if ra is not None and rb is not None and (rb - ra) * less > 0:
        out.append(_vs(a, b, "recompute"))
    named = bool(out) and out[0].startswith(f"largest: {SPLIT_PARTS[2]}")
    if a.get("copies_s") is not None and b.get("copies_s") is not None and (b["copies_s"] - a["copies_s"]) * less > 0 \
            and not named:
        out.append(f"{LABELS['copies_s']} {_pair(a['copies_s'], b['copies_s'])}")
    return out + [t for t in (_vs(a, b, "micro_batch"), _vs(a, b, "tp")) if t]


def _largest_split(a: dict, b: dict) -> str:
    """The part of :func:`~meshplan.search.step_parts.compute_split` (``compute_split`` of each
    description) whose seconds differ most between the top ``a`` and the runner-up ``b``, with its difference, the compute
    difference (the gap) and its share of it, all three from the unrounded seconds, so that the
    share can be checked against the two printed differences (the pairs beside them are rounded
    to 3 digits; newcomer trial, issue 11 follow-up: a part 1 ms of a 1.22 ms gap reads 82%);
    "" when compute is equal.

    >>> a = {"compute": 27.66, "compute_split": {"GEMMs": 20.0, "copies on the compute stream": 2.649}}
    >>> _largest_split(a, {"compute": 26.07, "compute_split": {"GEMMs": 19.74, "copies on the compute stream": 1.325}})
    'largest: copies on the compute stream 2.65 s vs 1.32 s = 1.32 s of the 1.59 s gap (83%)'
    >>> _largest_split({"compute": 0.05, "compute_split": {"GEMMs": 0.03, "other": 0.02}},
    ...                {"compute": 0.05122, "compute_split": {"GEMMs": 0.031, "other": 0.02022}})
    'largest: GEMMs 30 ms vs 31 ms = 1 ms of the 1.22 ms gap (82%)'
    >>> _largest_split({"compute": 6.84, "compute_split": {"GEMMs": 5.0, "other": 0.864}},
    ...                {"compute": 6.93, "compute_split": {"GEMMs": 4.9, "other": 1.02}})
    'largest: other 864 ms vs 1.02 s, the other parts differing the other way'
    """
    gap = a.get("compute", 0.0) - b.get("compute", 0.0)
    sa, sb = a["compute_split"], b["compute_split"]
    if not gap or not sa:
        return ""
    part = max(sa, key=lambda k: abs(sa[k] - sb.get(k, 0.0)))
    diff = sa[part] - sb.get(part, 0.0)
    share = diff / gap
    text = f"largest: {part} {_pair(sa[part], sb.get(part, 0.0))}" + _kinds_text(part, diff, a, b)
    if 0 < share <= 1:  # a share over 100% or of the other sign: the other parts move the other way
        return f"{text} = {_fmt(abs(diff))} of the {_fmt(abs(gap))} gap ({share:.0%})"
    return f"{text}, the other parts differing the other way"


#: A kernel kind is named under the ``other`` part where it makes this share of the part's difference.
KIND_SHARE = 0.05


def _kinds_text(part: str, diff: float, a: dict, b: dict) -> str:
    """`` (kernels: SP layout copy 0 ms vs 43.4 ms, cp ring merge 0 ms vs 13.6 ms)``: under the
    split's ``other`` part, the kernel kinds of each description's ``kernels_s``
    (:func:`~meshplan.schedule.kernel_kinds.kernel_kinds_s`) that differ most (:func:`~meshplan.schedule.kernel_kinds.largest_kinds`, up to 3, each at least
    :data:`KIND_SHARE` of the part's difference ``diff``); "" for another part or without them.

    >>> a = {"kernels_s": {"cp ring merge": 0.0, "rope": 0.004}}
    >>> _kinds_text(SPLIT_PARTS[3], -0.0141, a, {"kernels_s": {"cp ring merge": 0.0136, "rope": 0.0045}})
    ' (kernels: cp ring merge 0 ms vs 13.6 ms)'
    """
    if part != SPLIT_PARTS[3] or not a.get("kernels_s") or not b.get("kernels_s"):
        return ""
    kinds = largest_kinds(a["kernels_s"], b["kernels_s"], floor_s=KIND_SHARE * abs(diff))
    return f" (kernels: {', '.join(f'{k} {_pair(x, y)}' for k, x, y in kinds)})" if kinds else ""


def _vs(a: dict, b: dict, key: str, fmt: str = "{}") -> str:
    if key not in a or key not in b or a[key] == b[key]:
        return ""
    return f"{LABELS.get(key, key)} {fmt.format(a[key])} vs {fmt.format(b[key])}"


def _context(part: str, a: dict, b: dict) -> str:
    """What sets ``part`` in the two candidates' descriptions (``a``, ``b``: mesh degrees,
    micro-batches ``m``, ``vpp``, ``gemm_efficiency``, ``recompute``, flags): the keys that
    differ among those that set it.

    >>> a = {"dp_replicate": 1, "dp_shard": 64, "cp": 1, "sharding": "zero3"}
    >>> b = {"dp_replicate": 2, "dp_shard": 32, "cp": 1, "sharding": "hsdp"}
    >>> _context("exposed dp_replicate", a, b)
    'dp_replicate 1 vs 2, dp_shard 64 vs 32, sharding zero3 vs hsdp'
    >>> _context("exposed fsdp", a, {**b, "dp_shard": 64, "cp": 2, "dp_replicate": 1})
    'cp 1 vs 2, sharding zero3 vs hsdp'
    >>> _context("exposed fsdp", {**a, "zero_hpz_partition_size": 8}, {**a, "zero_hpz_partition_size": 1})
    'zero_hpz_partition_size 8 vs 1'
    """
    if part == "bubble":
        keys = [("pp", "{}"), ("vpp", "{}"), ("m", "{}")]
    elif part == "compute":
        return ", ".join(_compute_causes(a, b))
    elif part in ("exposed tp", "exposed loss"):
        keys = [("tp", "{}"), ("tp_comm_overlap", "{}")]
    elif part in ("exposed fsdp", "exposed efsdp", "exposed dp", "exposed dp_replicate"):
        # the data axes that differ, the part's own group first: fsdp = dp_shard x cp, the
        # replicas' all-reduce over dp_replicate (at one world, a change of one moves another)
        axes = ["dp_replicate", "dp_shard", "cp"] if part in ("exposed dp", "exposed dp_replicate") else \
            ["dp_shard", "cp", "dp_replicate"]
        keys = [(k, "{}") for k in axes] + [("sharding", "{}"), ("reshard_after_forward", "{}"),
                                             ("zero_hpz_partition_size", "{}"), ("micro_batch", "{}")]
    elif part == "exposed cp":
        keys = [("cp", "{}")]
    elif part == "exposed ep":
        keys = [("ep", "{}")]
    else:
        keys = [("pp", "{}"), ("m", "{}")]
    out = [t for t in (_data_vs(a, b) if k == "dp_shard" else _vs(a, b, k, f) for k, f in keys) if t]
    if part == "exposed cp" and a.get("layer_passes") and b.get("layer_passes"):
        out.append(f"per layer pass {_pair(a.get(part, 0.0) / a['layer_passes'], b.get(part, 0.0) / b['layer_passes'])}")
    return ", ".join(out)


def explain(top: dict, runner: dict, top_desc: dict, runner_desc: dict, fastest_step_s: Optional[float] = None,
            fastest_row: Optional[int] = 1, fastest_label: str = "", tie_criterion: str = "",
            tiers: bool = False) -> Explanation:
    """The parts of two :func:`~meshplan.search.step_parts.step_breakdown` results ordered by
    ``|runner - top|``, largest first; parts equal in both are left out. ``*_desc``: what :func:`_context` reads
    (``layer_passes`` among them). ``fastest_*``: the fastest feasible candidate
    (:class:`Explanation`; default: the top); ``tie_criterion``: what placed the top before it."""
    top, runner = (fold_streams(x, d.get("streams", {})) for x, d in ((top, top_desc), (runner, runner_desc)))
    keys = [k for k in dict.fromkeys([*top, *runner]) if k != "step"]
    a, b = {**top_desc, **top}, {**runner_desc, **runner}
    diffs = [Difference(k, top.get(k, 0.0), runner.get(k, 0.0), _context(k, a, b), _shown(k, a, b)) for k in keys]
    diffs = [d for d in diffs if abs(d.gain_s) > 1e-12 * max(top["step"], 1e-30)]
    diffs.sort(key=lambda d: -abs(d.gain_s))
    fastest = top["step"] if fastest_step_s is None else fastest_step_s
    return Explanation(top["step"], runner["step"], tuple(diffs), fastest, fastest_row, fastest_label,
                       tie_criterion, tiers)
