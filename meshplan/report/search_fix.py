"""Why no candidate of a search fits, and what widens it (the one line ``meshplan search``
prints instead of its table, ``--json``'s ``no_feasible_mesh``, the HTML page's verdict): the
rejection rules that removed the most candidates (:func:`rule_counts`) and a fix per rule
(:data:`_FIXES`); where ``[search] cp`` is narrowed and the same search with every cp finds a row
(:func:`meshplan.search.widen.widen`), the fix names that row first, as ``plan``'s ``fix:`` line names
the smallest cp that fits (:func:`meshplan.plan_fix.memory_fix`); under Megatron Core at a long sequence,
before it, the search without the data loader's attention mask (:func:`unmasked_words`, as ``plan``'s
:func:`meshplan.plan_fix_mask.mask_variant`).
"""

from __future__ import annotations

from typing import Any

from meshplan.interop.keymaps import keymap_of
from meshplan.memory.constraints import state_floor_fix
from meshplan.plan_fix_mask import SETTING, mask_words
from meshplan.search.columns import SHARDING
from meshplan.search.driver import SearchResult, Widened
from meshplan.search.reasons import CODE, engine_texts, reason_texts
from meshplan.units import GiB

#: What widens the search past a rejection rule that removed most candidates (the rule keys of
#: :data:`~meshplan.search.reasons.REASONS`); other rules get :data:`_FIX_ANY`.
_FIXES = {
    "framework": "set training.zero12_engine = \"deepspeed\" (DeepSpeed's ZeRO-1) or framework = \"megatron\", "
                 "or add zero3 to search.sharding",
    "engine": "let [search] reach meshes the engine runs (cp 1, ep 1; DeepSpeed's ZeRO-1 with pp > 1 at vpp 1 only, "
              "ZeRO-2 and DeepSpeed's ZeRO-3 at pp 1) or set training.zero12_engine / zero3_engine back to its default",
    "split": "let search.pp reach a pp the layers divide or one Megatron-LM's first/last split sets (meshplan."
             "mesh.layers.first_last_split), or set training.framework = \"torch\" (torchtitan takes any split)",
    "replicate": "add zero3 to search.sharding or let search.dp_shard or search.cp exceed 1 (FSDP2 shards over them)",
    "v-reshard": "let search.reshard_after_forward include false (training.reshard_after_forward = false, "
                 "torchtitan's default under pp), or drop zbv, dualpipev and zb_h1 from search.pp_schedules",
    "split-op": "set [search] recompute to full or none (not op), or keep 1f1b (with vpp > 1: interleaved) alone in "
                "search.pp_schedules",
    "deepep": "let search.ep (x etp) reach a group size DeepEP has a config for (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, "
              "144, 160; not 1) or set training.moe_dispatcher = \"alltoall\"",
    "memory": "add nodes, or let [search] reach less memory (recompute full, sharding zero3, micro_batch 1, larger "
              "tp/pp/cp)",
    "host": "add nodes (a rank's host partition is its parameters over the data axis, so more ranks keep less each), "
            "write the node's real cluster.node.host_memory_gb, or set training.offload_optimizer = \"none\"",
    "block": "none: block recompute is tried beside none and full; set [search] recompute without block to leave it out",
    "batch": "set training.global_batch to a multiple of micro_batch x dp for some [search] micro_batch and dp",
    "1f1b": "raise training.global_batch (more micro-batches per step) or narrow search.pp",
    "interleaved": "raise training.global_batch (more micro-batches per step) or narrow search.vpp",
    "dualpipev": "raise training.global_batch (more micro-batches per step), drop dualpipev from search.pp_schedules, "
                 "or with ep > 1 under torch set recompute \"none\" or training.pp_ep_overlap = false",
}
_FIX_ANY = "widen the [search] lists or change the [training] field the rule names"
#: :data:`_FIXES` where ``training.framework = "megatron"`` words the rule otherwise
#: (:data:`meshplan.search.reasons.MEGATRON_REFUSED`).
_FIXES_MEGATRON = {
    "framework": "let search.reshard_after_forward include true and search.sharding zero1 or zero3 (Megatron FSDP "
                 "reshards every layer; Megatron-LM's HSDP is not modelled), or set training.framework = \"torch\"",
}


def infeasible_verdict(r: SearchResult) -> dict[str, Any] | None:
    """Why no candidate fits, as data (None when one does): ``candidates``, ``rules`` (the up
    to 3 rejection rules that removed the most candidates, most first, each ``{"rule", "rejected",
    "text"}``), ``undecided`` (candidates near the memory limit not settled), ``fix`` (what
    widens the search past the first rule, :data:`_FIXES`, or where the model state alone
    exceeds usable memory fully sharded over every GPU, the GPUs it needs:
    :func:`~meshplan.memory.constraints.state_floor_fix`; null without a rule) and ``line``
    (:func:`infeasible_line`: the one line the text prints). ``search --json`` holds it as
    ``no_feasible_mesh``, the HTML page shows the line. ``widened``: the row the search finds
    with every cp where ``[search] cp`` is narrowed (:class:`~meshplan.search.widen.Widened`'s
    dict; null otherwise: :func:`meshplan.search.widen.widen` not run or finding none), named first
    in ``fix``; ``widened_ep`` the same for ``[search] ep`` of an MoE model, named before it, and
    ``widened_mask`` (the search without Megatron Core's data-loader mask) before both (not keys:
    their rows are in ``fix``)."""
    if r.top:
        return None
    most = sorted(rule_counts(r), key=lambda x: -x[2])[:3]
    rules: list[dict[str, Any]] = [{"rule": k, "rejected": n, "text": t} for k, t, n in most]
    fixes = _FIXES | _FIXES_MEGATRON if r.config.training.framework == "megatron" else _FIXES
    cfg = r.config  # a model state over memory fully sharded: no batch or knob helps, only GPUs
    fix = (state_floor_fix(cfg.model, cfg.training, cfg.cluster) or fixes.get(most[0][0], _FIX_ANY)) if most else None
    for w in (r.widened, r.widened_ep):  # the ep row first (nc58 #1b: the knob that shards the experts)
        if w is not None:
            fix = widened_words(w) + (f"; or {fix}" if fix else "")
    if "widen mask" in r.timings:  # one flag, the mesh unchanged: before every other (nc59 #1)
        fix = unmasked_words(r) + (f"; or {fix}" if fix else "")
    verdict: dict[str, Any] = {"candidates": len(r.candidates), "rules": rules, "undecided": r.counts()["undecided"],
                               "fix": fix, "widened": r.widened.to_dict() if r.widened else None}
    return verdict | {"line": _verdict_line(verdict)}


def widened_words(w: Widened) -> str:
    """The fix a narrowed ``[search] cp`` gets where the search with every cp finds a row.

    >>> print(widened_words(Widened((1,), 4, "pp 2 x cp 4 x tp 8, mb 1, none, vpp 1, zero3", 384.986, 55.1 * GiB)))
    ... # doctest: +NORMALIZE_WHITESPACE
    widen [search] cp (now 1): with every cp the fastest that fits is pp 2 x cp 4 x tp 8, mb 1, none, vpp 1, zero3
    (cp 4: step 384.986 s, peak 55.1 GiB)
    """
    now = "/".join(map(str, w.given)) or "none"
    return (f"widen [search] {w.axis} (now {now}): with every {w.axis} the fastest that fits is {w.label} ({w.axis} "
            f"{w.degree}: step {w.step_s:.3f} s, peak {w.peak_bytes / GiB:.1f} GiB)")


def unmasked_words(r: SearchResult) -> str:
    """The fix naming Megatron Core's data-loader mask (:func:`meshplan.search.widen.unmasked`): its
    setting in the config's own format's words (a Megatron-LM file's
    ``--no-create-attention-mask-in-dataloader``), its bytes at the smallest ``[search] micro_batch``
    (:func:`~meshplan.plan_fix_mask.mask_words`) and the fastest row of the search without it, or
    that it finds none either."""
    cfg = r.config
    said = f"{keymap_of(cfg).setting(SETTING)} ({mask_words(min(cfg.search.micro_batch), cfg.training.seq_len)}, " \
           "not built)"
    w = r.widened_mask
    if w is None:
        return f"{said}: the search without it finds no row either"
    return f"{said}: the fastest that fits is {w.label} (step {w.step_s:.3f} s, peak {w.peak_bytes / GiB:.1f} GiB)"


def _verdict_line(v: dict[str, Any]) -> str:
    """:func:`infeasible_verdict`'s one line."""
    if not v["rules"]:
        return f"no feasible mesh among {v['candidates']:,} candidates"
    first, *rest = v["rules"]
    line = (f"no feasible mesh: of {v['candidates']:,} candidates rule '{first['rule']}' rejected "
            f"{first['rejected']:,} ({first['text']})" + "".join(f", '{x['rule']}' {x['rejected']:,}" + (
                f" ({x['text']})" if x["rule"] == "engine" else "") for x in rest))  # engine: one per engine
    if v["undecided"]:
        line += f"; {v['undecided']:,} undecided near the memory limit (raise search.settle_max)"
    return f"{line}; fix: {v['fix']}"


def infeasible_line(r: SearchResult) -> str:
    """The one line printed instead of the table when no candidate fits: the rejection rules
    that removed the most candidates (at most 3, with their counts; the first with its text) and
    what widens the search past the first (:data:`_FIXES`); empty when one fits."""
    v = infeasible_verdict(r)
    return v["line"] if v else ""


def rule_counts(r: SearchResult) -> list[tuple[str, str, int]]:
    """(rule, text, candidates rejected) of each rule that rejected some, in :data:`REASONS`'
    order, the ``engine`` rule split per engine (:func:`_engine_counts`): the one split that the
    text's counts, the no-feasible-mesh line and the HTML page all show."""
    counts = r.counts()
    out: list[tuple[str, str, int]] = []
    for key, text in reason_texts(r.config.training).items():
        if key == "engine" and counts[key]:
            out += [(key, t, n) for t, n in _engine_counts(r, text, counts[key]) if n]
        elif counts[key]:
            out.append((key, text, counts[key]))
    return out


def _engine_counts(r: SearchResult, text: str, n: int) -> list[tuple[str, int]]:
    """The ``engine`` rule's rejections split by the engine that refused them: zero3 rows by the
    ZeRO-3 engine's rule, the others by ZeRO-1/2's (a DeepSpeed ZeRO-3 search plans both, and
    its 12 rows kept gathered are ZeRO-3's alone); one line with ``text`` when one engine is planned."""
    fam = engine_texts(r.config.training)
    if len(fam) < 2:
        return [(text, n)]
    zero3 = int(((r.code == CODE["engine"]) & (r.candidates.sh == SHARDING.index("zero3"))).sum())
    return [(fam["zero12"], n - zero3), (fam["zero3"], zero3)]
