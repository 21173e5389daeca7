"""Terminal report of a plan (rich). Summaries on screen; full lists go to the JSON.

Collective columns follow nccl-tests: size (B), time (us), algbw (GB/s), busbw (GB/s).
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from meshplan.compute.megatron_core import runtime_followed
from meshplan.compute.recompute import op_replays_ep
from meshplan.compute.shapes import fused_qkv_words
from meshplan.memory.buffers import hpz_secondary_words
from meshplan.memory.state_estimates import megatron_estimate, megatron_withheld, zero_textbook_bytes
from meshplan.mesh.axes import order_words
from meshplan.mesh.resolve import Mesh
from meshplan.mesh.tpsplit import experts_apart, model_groups
from meshplan.placement.assign import Placement, rank_row
from meshplan.plan import Infeasible, Plan
from meshplan.report import shown
from meshplan.report.layer_counts import per_layer_words
from meshplan.report.memory import timeline_table
from meshplan.report.plan_warnings import plan_notes, plan_warnings
from meshplan.schedule.window_regathers import cadence_words
from meshplan.spec.mesh_words import axis_labels, mesh_text, renamed_words, replicates, shown_names
from meshplan.spec.recompute_words import recompute_words
from meshplan.spec.wording import gathered_words, nic_words, runtime, sharding_words, shard_words, state_cell, state_title
from meshplan.units import GB, US, GiB, counted, human_bytes, param_number

MAX_LIST = 8


def fmt_ranks(ranks) -> str:
    """Rank list for printing: in full up to 8 entries, else a summary (full lists in --json).

    >>> fmt_ranks([24, 25, 26, 27, 28, 29, 30, 31])
    '24..31'
    >>> fmt_ranks([5, 13, 21, 29, 37, 45, 53, 61])
    '5,13,21,29,37,45,53,61'
    >>> fmt_ranks(list(range(3, 3 + 8 * 128, 8)))
    '3,11,...,1019 (128 ranks, stride 8)'
    >>> fmt_ranks([0, 1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192])
    '0,1024,...,8192 (9 ranks, stride 1024)'
    """
    ranks = [int(r) for r in ranks]
    n = len(ranks)
    step = ranks[1] - ranks[0] if n > 1 else 1
    arith = all(b - a == step for a, b in zip(ranks, ranks[1:]))
    if arith and step == 1 and n > 2:
        return f"{ranks[0]}..{ranks[-1]}"
    if n <= MAX_LIST:
        return ",".join(map(str, ranks))
    if arith:
        return f"{ranks[0]},{ranks[1]},...,{ranks[-1]} ({n} ranks, stride {step})"
    return ",".join(map(str, ranks[:6])) + f",... ({n} ranks)"


def fmt_layers(chunks: list[list[int]]) -> str:
    """Layers of one pipeline stage, chunk by chunk (a chunk per virtual stage, in the order
    the stage holds them), so the interleaving shows (handed case C8).

    >>> fmt_layers([[0, 1, 2, 3]])
    'layers 0..3'
    >>> fmt_layers([[0, 1], [4, 5]])
    'layers 0,1 | 4,5 (2 chunks of 2 layers)'
    >>> fmt_layers([[4 * c, 4 * c + 1] for c in range(10)])
    'layers 0,1 | 4,5 | 8,9 | ... | 36,37 (10 chunks of 2 layers)'
    >>> fmt_layers([[0], [3, 4]])
    'layers 0 | 3,4 (2 chunks of 1, 2 layers)'
    >>> fmt_layers([[], [1], [3], [5]])  # the first chunk holds the embedding alone (stage_layers)
    'layers - | 1 | 3 | 5 (4 chunks of 0, 1 layers)'
    """
    def one(c: list[int]) -> str:
        if not c:
            return "-"
        contiguous = all(b - a == 1 for a, b in zip(c, c[1:]))
        return f"{c[0]}..{c[-1]}" if contiguous and len(c) > 2 else ",".join(map(str, c))

    if len(chunks) == 1:
        return f"layers {one(chunks[0])}"
    shown_chunks = [one(c) for c in chunks] if len(chunks) <= 4 else \
        [one(c) for c in chunks[:3]] + ["...", one(chunks[-1])]
    sizes = sorted({len(c) for c in chunks})
    return (f"layers {' | '.join(shown_chunks)} ({len(chunks)} chunks of "
            f"{', '.join(map(str, sizes))} layers)")


def print_plan(plan: Plan | Infeasible, rank: int = 0, console: Console | None = None) -> None:
    """Print the whole plan for the point of view of ``rank``; of an :class:`Infeasible`
    mesh, what was resolved (mesh, groups, placement when it has them) and the reasons."""
    con = console or Console()
    _header(plan, con)
    _constraints(plan, con)
    if plan.mesh is not None and plan.placement is not None:
        _mesh(plan, plan.mesh, con)
        print_groups(plan.mesh, rank, con, model_groups(plan.mesh, plan.config.model, plan.config.training.framework), training=plan.config.training,
                     origin=plan.config.origin)
        _placement(plan, plan.placement, rank, con)
    if isinstance(plan, Plan):
        _shapes(plan, con)
        _memory(plan, con)
        _collectives(plan, con)
    _verdict(plan, con)


def plan_replicates(plan: Plan | Infeasible) -> bool:
    """Whether ``plan``'s mesh shards nothing under FSDP2 (:func:`meshplan.spec.mesh_words.replicates`;
    False without a mesh): the header then names an hsdp plan as the DDP it runs."""
    return plan.mesh is not None and replicates(plan.mesh, plan.config.model.is_moe)


def _header(plan: Plan | Infeasible, con: Console) -> None:
    c = plan.config
    m, t, cl = c.model, c.training, c.cluster
    con.rule(f"[bold]meshplan plan[/] {shown(c.path or '')}")
    con.print(f"model   {m.name}: {m.layers} layers, hidden {m.hidden}, ffn {m.ffn}{' gated' if m.gated_mlp else ''}, "
              f"{m.attention_summary}, vocab {m.vocab}, "
              f"{param_number(m.param_count())} params" + (f", {m.experts} experts top-{m.top_k}" if m.is_moe else ""))
    if m.is_moe:
        con.print(f"        {m.active_words()}")
    if "; not modelled: " in m.source:  # what a Hugging Face family has that ModelSpec does not (spec.hf)
        con.print(f"        not modelled: {shown(m.source.split('; not modelled: ', 1)[1])}")
    if m.rope_scaling is not None and m.rope_scaling.note(t.seq_len):  # only past the original context
        con.print(f"        {m.rope_scaling.note(t.seq_len)}")
    con.print(f"cluster {shown(cl.name)}: {counted(cl.nodes, 'node')} x {cl.node.gpus} {cl.gpu.name} "
              f"({cl.gpu.hbm_bytes / GiB:.1f} GiB HBM), "
              f"{shown(nic_words(cl.node, ('step notes how they are timed',) * any(n.transport == 'roce' for n in cl.node.nics)))}"
              f", world {plan.world}")
    tokens, ep_replay = t.global_batch * t.seq_len, op_replays_ep(c.model, t)
    con.print(f"train   global batch {t.global_batch} x seq {t.seq_len} = {tokens:,} tokens/step, micro-batch "
              f"{t.micro_batch}, sharding {sharding_words(t, c.origin, plan_replicates(plan))}, "
              f"recompute {t.recompute} "
              f"({recompute_words(t, runtime(t, c.origin), short=bool(plan.timelines), replays_ep=ep_replay)}"
              f"{_block_layers(plan)}), "
              f"{t.dtype_words}, "
              f"reserve {t.memory_reserve:.0%}")
    if (mg := runtime_followed(m, t)) is not None:  # which Megatron-LM generation the step models
        con.print(f"        {mg['line']}")


def _block_layers(plan) -> str:
    """``; recomputed: ...`` under Megatron-LM's block recompute
    (:meth:`~meshplan.spec.training.TrainingSpec.block_layers_text`), "" otherwise or without stages."""
    stages = getattr(plan, "stages", None)
    text = plan.config.training.block_layers_text(stages) if stages else ""
    return f"; {text}" if text else ""


def _constraints(plan: Plan | Infeasible, con: Console) -> None:
    cs = plan.constraints
    tab = Table(title="Constraints (before any mesh)", title_justify="left")
    for col in ("kind", "constraint", "requires"):
        tab.add_column(col)
    for row in cs.rows:
        tab.add_row(row.kind, row.text, row.requires)
    con.print(tab)


def _mesh(plan: Plan | Infeasible, mesh: Mesh, con: Console) -> None:
    sharding = plan.config.training.sharding
    shape = mesh_text(mesh.layout.names, mesh.layout.shape, sharding, mesh.ep, mesh.etp)
    renamed = renamed_words(mesh.layout.names, sharding)
    con.print(f"\n[bold]mesh[/] ({shape})  canonical {tuple(mesh.given_names)}, {order_words(mesh.given_names)}"
              + (f" ({renamed})" if renamed else "") + (", sequence parallel" if mesh.sequence_parallel else ""))
    for line in plan.derivation:
        con.print(f"  {line}")
    for axis, why in plan.constraints.axes.items():
        con.print(f"  axis {axis}: {why}")


def print_groups(mesh: Mesh, rank: int, con: Console | None = None, extra: dict | None = None,
                 sharding: str = "", training=None, origin: str = "") -> None:
    """What ``rank`` would print at start-up: coordinates and every group's ranks; ``extra``:
    groups that depend on the model (:func:`meshplan.mesh.tpsplit.model_groups`: kv_replica),
    one row each after the axes'. Axes are named as the mesh line names them
    (:func:`meshplan.spec.mesh_words.shown_names` of ``sharding``, ``training.sharding``: ``dp`` vs
    ``dp_shard`` by whether the parameters are sharded over it), with a line saying so when a
    name differs from the config's; ``training`` (a TrainingSpec, its sharding used when given)
    names the derived groups in the runtime's words (:func:`meshplan.spec.wording.group_words`:
    Megatron-LM's dp x cp group); ``--json`` keeps the config's names."""
    con = con or Console()
    axes = mesh.all_axes()
    sharding = training.sharding if training is not None else sharding
    shown = axis_labels(mesh, training, origin) if training is not None else \
        shown_names(mesh.layout.names, sharding, taken=[a for a in axes if a not in mesh.layout.names])
    coords = mesh.layout.coords_of(rank)
    con.print(f"\n[bold]rank {rank}[/] = coordinates {_c(coords)} ("
              + ", ".join(f"{shown.get(n, n)}={c}" for n, c in zip(mesh.layout.names, coords)) + ")")
    con.print("strides (row-major, rank = sum of coordinate x stride): "
              + ", ".join(f"{shown.get(n, n)} {s}" for n, s in zip(mesh.layout.names, mesh.layout.strides)))
    renamed = renamed_words(mesh.layout.names, sharding) if shown else ""
    tab = Table(title=f"Process groups (of rank {rank}; all groups in --json). Each axis's groups partition the "
                      f"ranks; members are ordered by their coordinates, outermost axis first"
                      + (f"; {renamed}" if renamed else ""), title_justify="left")
    for col in ("axis", "size", "groups", f"group of rank {rank}", "as coordinates", "first groups"):
        tab.add_column(col)
    for axis in axes:
        g = mesh.groups(axis)
        first = "; ".join(fmt_ranks(row) for row in g[:2]) + ("; ..." if len(g) > 2 else "")
        mine = mesh.group_of(rank, axis)
        ends = [mesh.layout.coords_of(r) for r in (mine[0], mine[-1])]
        span = f"[{_c(ends[0])}..{_c(ends[1])}]" if len(mine) > 1 else f"[{_c(ends[0])}]"
        tab.add_row(shown.get(axis, axis), str(g.shape[1]), str(g.shape[0]), fmt_ranks(mine), span, first)
    for name, g in (extra or {}).items():
        mine = [int(r) for r in g[(g == rank).any(axis=1)][0]]
        first = "; ".join(fmt_ranks(row) for row in g[:2]) + ("; ..." if len(g) > 2 else "")
        ends = [mesh.layout.coords_of(r) for r in (mine[0], mine[-1])]
        tab.add_row(name, str(g.shape[1]), str(g.shape[0]), fmt_ranks(mine), f"[{_c(ends[0])}..{_c(ends[1])}]", first)
    con.print(tab)


def _c(coords) -> str:
    return "(" + ",".join(map(str, coords)) + ")"


def _placement(plan: Plan | Infeasible, placement: Placement, rank: int, con: Console) -> None:
    row = rank_row(placement, rank)
    con.print(f"placement of rank {rank}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    for f in plan.flags:
        style = {"fault": "red", "warn": "yellow"}.get(f.severity, "dim")
        con.print(f"  [{style}]{f.severity}[/] {f.axis}: {f.message}")


def _shapes(plan: Plan, con: Console) -> None:
    tab = Table(title=f"Local forward GEMMs per rank per micro-batch (M tokens = {plan.tokens_per_microbatch})",
                title_justify="left")
    for col in ("gemm", "M", "N", "K", "count", "GFLOP"):
        tab.add_column(col, justify="right")
    for g in plan.gemms:
        tab.add_row(g.name, str(g.m), str(g.n), str(g.k), str(g.count), f"{g.flops / 1e9:.1f}")
    con.print(tab)
    m, tp = plan.config.model, plan.mesh.degree("tp")
    con.print(f"q projection: output width {m.q_heads * m.d_head} / tp {tp} = {m.q_heads * m.d_head // tp} "
              f"output features per rank; MLP: ffn {m.ffn} / tp {tp} = {m.ffn // tp} per gate")
    fused = fused_qkv_words(m, tp, plan.config.training.framework)
    if fused:
        con.print(fused)
    a = plan.attention
    con.print(f"attention per rank: batch {a.batch}, q heads {a.q_heads}, kv heads {a.kv_heads}, "
              f"seq q {a.seq_q} x kv {a.seq_kv}, head dim {a.head_dim}"
              + (f" (v {a.d_v})" if a.d_v != a.head_dim else "") + ", "
              f"{a.flops() / 1e9:.1f} GFLOP forward (causal, half of the full QK^T and PV)")
    for k, chunks in enumerate(plan.stages[:4]):
        extra = (" + embedding" if k == 0 else "") + (" + final norm, output" if plan.stage(k).last else "")
        con.print(f"stage {k}: {fmt_layers(chunks)}{extra}")
    if len(plan.stages) > 4:
        con.print(f"... {len(plan.stages)} stages in all")


def _memory(plan: Plan, con: Console) -> None:
    states = plan.state if len(plan.state) <= 4 else (plan.state[0], max(plan.state, key=lambda s: s.total_bytes),
                                                       plan.state[-1])
    t, origin = plan.config.training, plan.config.origin
    tab = Table(title=f"Persistent state per rank ({states[0].label}; {state_title(t, origin)})",
                title_justify="left")
    for col in ("stage", "params/rank", "kind", "group", "elements/rank", "bytes/elem", "bytes", "sharded over"):
        tab.add_column(col, justify="right")
    for s in dict.fromkeys(states):
        tab.add_row(str(s.stage), f"{s.params.total:,}", "", "", "", "", "", "")
        for i in s.items:
            tab.add_row("", "", i.kind, i.group, f"{i.count:,}", str(i.bytes_per_element), human_bytes(i.size_bytes),
                        state_cell(t, shard_words(i.axis, plan.mesh.layout.names, t.sharding), i.divisor, origin))
        tab.add_row("", "", "[bold]total[/]", "", "", "", human_bytes(s.total_bytes), "")
    con.print(tab)
    if t.bf16_optimizer:  # held beside this state, outside the optimizer step's (memory.buffers.bf16_lp_grad_bytes)
        big = max(states, key=lambda s: s.total_bytes)
        con.print(f"[dim]DeepSpeed BF16_Optimizer also keeps the bf16 gradients (param.grad) beside the fp32 ones, "
                  f"whole, from each backward to the next: stage {big.stage} {big.params.total:,} x 2 B = "
                  f"{human_bytes(2 * big.params.total)} (in the memory timeline; its step reads the fp32 ones)[/]")
    sec = hpz_secondary_words(t, max(states, key=lambda s: s.total_bytes).params.total)
    if sec:  # held beside this state, in the memory timeline (memory.buffers.hpz_secondary_bytes)
        con.print(f"[dim]also held beside it: {sec} (in the memory timeline and the first estimate; not in the "
                  "textbook accounting)[/]")
    for line in _accounting_lines(plan, max(states, key=lambda s: s.total_bytes)):
        con.print(f"[dim]{line}[/]")
    e = plan.constraints.estimate
    if e is not None:
        con.print(f"[dim]first estimate (constraints, before the timeline): "
                  f"{e.line(gathered_words(t, origin))}[/]")
    con.print(timeline_table(plan))


ZERO_STAGE = {"none": 0, "zero1": 1, "zero2": 2, "zero3": 3, "hsdp": 3}


def _group_psi(state, group: str) -> tuple[int, int]:
    """(parameters per rank before data parallelism, degree its optimizer state is sharded
    over) of one group (dense, expert) of ``state``."""
    items = [i for i in state.items if i.group == group]
    return (sum(i.numel for i in items if i.kind == "params"),
            next((i.divisor for i in items if i.kind == "optimizer"), 1))


def _accounting_lines(plan: Plan, state) -> list[str]:
    """The two closed-form accountings beside the exact one (docs/conventions.md): the ZeRO
    paper's textbook bytes for the most loaded stage's ``psi`` parameters per rank (before data
    parallelism), N the degree its optimizer state is sharded over, K 12, with a MoE model's
    routed experts as a second group (psi_e, this rank's ep x etp share, over N_e = efsdp), so
    the line counts the same parameters as the framework table; and, under ``training.framework``
    ``megatron`` only (the formula is Megatron-LM's own start-up log line, which no other run
    prints: beside a torch plan's state it read as the plan's), Megatron-LM's estimate, or for a
    MoE mesh with ep > 1 one line saying why it is not shown
    (:func:`~meshplan.memory.state_estimates.megatron_withheld`). Both ignore what the exact count
    holds (dtypes as configured, padding, norms)."""
    psi, n = _group_psi(state, "dense")
    psi_e, n_e = _group_psi(state, "expert")
    z = zero_textbook_bytes(psi, n, stage=ZERO_STAGE[plan.config.training.sharding], expert_params=psi_e,
                            expert_n=n_e)
    where = f" on pipeline stage {state.stage} (the most loaded)" if len(plan.state) > 1 else ""
    first = f"{z.label}{where}: {human_bytes(z.size_bytes)} ({z.formula})"
    if plan.config.training.framework != "megatron":
        return [first]
    withheld = megatron_withheld(plan.config.model, plan.mesh)
    if withheld is not None:
        return [first, withheld]
    meg = megatron_estimate(plan.config.model, plan.mesh, plan.config.training)
    return [first, f"{meg.label}: {human_bytes(meg.size_bytes)} ({meg.formula})"]


def _per_columns(row) -> tuple[str, str]:
    """The "per layer" and "per mb" cells of a collective row: calls per layer and per
    micro-batch of a row issued alike in every micro-batch, "-" for one that is not (once per
    step, e.g. no_sync's reduce-scatter or DDP's all-reduce: the "per step" cell counts it)."""
    if not row.per_microbatch:
        return "-", "-"
    return f"{row.per_layer:.2f}", str(row.per_microbatch)


def _cadence_lines(rows, shown: dict, window=lambda r: "", moe_layers: int = 0, apart: bool = False) -> list[str]:
    """Lines under a collective table: each cadence (the JSON's ``cadence``) and the rows issued
    at it, ``  every norm (SP weight gradients): tp backward all-reduce 16,384 B``, each count
    that is not whole per layer said (:func:`meshplan.report.layer_counts.per_layer_words` of the
    stage's ``moe_layers``, the routed experts ``apart`` or not); ``window``: a row's count
    explained by torch's unshard window re-gathers
    (:func:`meshplan.schedule.window_regathers.cadence_words`)."""
    by: dict[str, list[str]] = {}
    for r in rows:
        by.setdefault(r.cadence, []).append(f"{shown.get(r.axis, r.axis)} {r.phase} {r.op} {r.size_bytes:,.0f} B"
                                            f"{per_layer_words(r, moe_layers, apart)}{window(r)}")
    return [f"  {c}: {', '.join(items)}" for c, items in by.items()]


#: Under a table with deepep rows: what their columns hold (:mod:`meshplan.comm.ep_rows`).
DEEPEP_COLUMNS = ("deepep rows: size = the bytes one rank sends through its NIC per call (on NVLink inside one "
                  "node), busbw = algbw = size / time, that link's rate (no all-to-all (n-1)/n factor); the NVLink "
                  "fan-out bytes per call are named in the row's cadence")


def _collectives(plan: Plan, con: Console) -> None:
    """The collective tables, one per stage; the data axis named as the mesh line names it
    (:func:`meshplan.spec.mesh_words.axis_labels`: ``dp_shard`` where zero3 shards the parameters).
    Under each, when each row is issued (:func:`_cadence_lines`)."""
    shown = axis_labels(plan.mesh, plan.config.training, plan.config.origin)
    for stage, rows in plan.collectives.items():
        tab = Table(title=f"Collectives, {stage} (alpha-beta time of the fastest NCCL algorithm on the path; what waits on each row: --json)", title_justify="left")
        for col in ("axis", "phase", "op", "n", "size (B)", "dtype", "per layer", "per mb", "per step", "path",
                    "alg", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
            tab.add_column(col, justify="right")
        for r in rows:
            tab.add_row(shown.get(r.axis, r.axis), r.phase, r.op, str(r.group_size), f"{r.size_bytes:,.0f}", r.dtype,
                        *_per_columns(r), str(r.per_step), r.path.kind, r.algorithm_shown,
                        f"{r.time_s / US:,.1f}", f"{r.algbw_bytes_per_s / GB:.1f}", f"{r.busbw_bytes_per_s / GB:.1f}")
        con.print(tab)
        if any(r.algorithm == "deepep" for r in rows):
            con.print(DEEPEP_COLUMNS, markup=False, highlight=False)
        con.print("when each row is issued:", highlight=False)
        k = int(stage.split()[-1])  # "stage 3" (plan.table_key)
        moe = sum(plan.config.model.is_moe_layer(i) for ch in plan.stages[k] for i in ch)
        words = lambda r, k=k: cadence_words(plan, k, r)  # noqa: E731
        for line in _cadence_lines(rows, shown, words, moe, experts_apart(plan.mesh)):
            con.print(line, markup=False, highlight=False)


def _verdict(plan: Plan | Infeasible, con: Console) -> None:
    for n in plan_notes(plan):
        con.print(f"[dim]note[/] {n}")
    for w in plan_warnings(plan):
        con.print(w, markup=False, highlight=False)
    faults = sorted({f.axis for f in plan.flags if f.severity == "fault"})
    if plan.feasible:
        con.print("[bold green]feasible[/] (validity, groups and the memory peak); predicted step time, MFU, "
                  "exposed communication and link load: meshplan step CONFIG")
        if faults:  # C3: flagged, not refused; the step model times the traffic where it runs
            con.print(f"[red]placement fault[/] ({', '.join(faults)}): another axis order would keep these groups "
                      "inside one NVLink domain (see placement above); the mesh runs as placed, its step timed so")
    else:
        con.print("[bold red]infeasible[/]")
        for r in plan.reasons:
            con.print(f"  - {r}")
