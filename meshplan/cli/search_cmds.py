"""search and compare: every mesh of a workload rejected with reasons or ranked by predicted
step (``--export`` writes a row, or row 1's mesh at a labelled other setting, through
:func:`meshplan.cli.interop_cmds._write_export`; the row: :mod:`meshplan.cli.search_rows`), or two meshes side by side with the rejected one's evidence."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from meshplan.cli.common import (
    CONFIG_HELP,
    CalibrationOpt,
    KernelsOpt,
    TopologyOpt,
    TOML_ONLY_HELP,
    _console,
    _echo,
    _html_option,
    _infeasible,
    _json_option,
    json_path_given,
    _refuse_existing,
    _write_doc,
    _write_text,
    _wrote,
)
from meshplan.cli.interop_cmds import _flavor_file, _write_export, python_source
from meshplan.cli.search_frameworks_cmd import CrossExport, search_frameworks
from meshplan.cli.search_rows import export_choice
from meshplan.cli.foreign_opts import Foreign, foreign_options
from meshplan.cli.loading import _cal_note, _calibrated, _calibration, _kernels_note, _load, _measured_cluster, _notes
from meshplan.compare import (compare, compare_html, compare_to_dict, evidence_folder, gemm_basis, table_rows,
                              write_evidence)
from meshplan.errors import ConfigError, check_number, printable
from meshplan.fileio import check_destination, write_output
from meshplan.interop.common import FORMATS
from meshplan.interop.foreign import load_any
from meshplan.interop.source_file import carried_source, with_source_model
from meshplan.interop.search_export import export_pick, search_export_refusal
from meshplan.interop.torchtitan_pytarget import target
from meshplan.interop.torchtitan_write import custom_flavor
from meshplan.plan_capacity import checked
from meshplan.plan_runtime import config_warnings
from meshplan.compute.routing import balance_note
from meshplan.schedule.ep_routing import routing_note
from meshplan.report import shown
from meshplan.report.html_pages import search_page
from meshplan.report.progress import ProgressBar
from meshplan.report.search import print_search, search_to_dict, timing_line
from meshplan.report.search_fix import infeasible_line
from meshplan.report.search_clear import export_warnings
from meshplan.search.driver import search
from meshplan.search.widen import widen
from meshplan.search.frameworks import (FRAMEWORKS, ORIGIN_NOTE, configured_names, dropped_note, framework_config,
                                        framework_names)


def compare_cmd(config_a: Path = typer.Argument(..., help="mesh A: " + TOML_ONLY_HELP),
                config_b: Path = typer.Argument(..., help="mesh B (same model, cluster and workload): " + TOML_ONLY_HELP),
                out: Path = typer.Option(Path("out/compare"), "--out", help="folder for the rejected mesh's evidence"),
                html_path: Optional[Path] = _html_option("both meshes side by side"),
                json_path: Optional[Path] = _json_option("compare"),
                force: bool = typer.Option(False, "--force", help="replace an existing evidence folder, --html and "
                                                                  "--json files"),
                calibration: CalibrationOpt = None,
                kernels: KernelsOpt = None,
                topology: TopologyOpt = None):
    """Compare two plans of one workload side by side and keep the rejected one's evidence. Both configs share the
    model, the same cluster (another is refused: run step on each to compare clusters) and the workload's [training]
    fields (batch, sequence, dtypes); the mesh and the plan's knobs
    (micro_batch, recompute, sharding, reshard_after_forward, tp_comm_overlap, float8 linear_dtype, schedule, virtual stages ...) may
    differ, each differing knob shown as a row. The verdict is the search's order through the search's own key: a plan
    that fits beats one that does not; a step shorter by more than 1% wins; within 1%, fewer axes, then lower
    degrees, then fewer and cheaper settings off their default (recompute none < selective < op < layer < block < full, no tp
    overlap, vpp 1, resharded, even split, 1F1B), then a peak lower by more than 1%, then the shorter step;
    "decided by:" names the criterion in the search's words. Under the verdict, the reasons: the step's parts that
    differ, under compute the frameworks' kernel choices, the GEMMs and, with the same kernel choices, the kernel
    kinds outside the GEMMs and attention whose seconds differ most ('of compute, cp ring merge: ...'), and always
    its seconds by kernel kind on each side's critical stage (GEMMs, attention, copies on the compute stream, other:
    'of compute by kernel kind ...'), then peak memory and the bytes a rank sends
    per step on NVLink and on the network: under a pipeline each on the stage whose ranks send the most, named
    ('ep16 1.1 GB (stage 1)': a MoE model's dense stage 0 sends no ep traffic). A side that fits with under 15% of its
    usable memory free gets a 'warning (NAME): tight: ...' line, search's headroom rule (--json: each side's headroom and
    headroom_warnings); a side in a setting whose step error was measured larger than the development set's
    (ZeRO-3 sharded across nodes, torch FSDP on A100, torch on H100) a 'warning: NAME lies where ...' line
    naming it with its measured error (--json: setting_warnings). Exit 0 when a plan that fits wins or the two are identical or equal on
    every criterion (nothing rejected), 1 when neither fits, identical or not (both reasons printed)."""

    check_destination(out, "--out", force=True, folder=True)  # a writable folder before the work
    _refuse_existing(html_path, force, "--html")
    _refuse_existing(json_path, force, "--json")
    a, b, names = _compare_sides(config_a, config_b, topology, calibration, kernels)
    c = compare(a, b, names=names)  # refuses a different workload (model, cluster, batch ...) naming the field
    evidence_folder(c, out, force)  # refuse an existing folder before printing the report
    cal = _calibration(calibration, a.config.cluster)  # the header line (one cluster: compare refuses two)
    kern = _kernels_note(a.config.cluster)
    con = _console()
    _print_compare(c, con)
    for path in write_evidence(c, out, force=force, calibration=cal):
        con.print(f"wrote {printable(str(path))}", markup=False)
    if html_path:
        con.print(f"wrote {printable(str(write_output(html_path, compare_html(c, _cal_note(cal, kern)), force, '--html')))}",
                  highlight=False, markup=False)
    _write_doc(json_path, _calibrated(compare_to_dict(c), cal), force)
    if c.none_fit:
        for side in (c.a,) if c.a.name == c.b.name else (c.a, c.b):  # one file given twice: its reasons once
            _infeasible(side.plan, side.name)
        raise typer.Exit(1)


def _compare_sides(config_a: Path, config_b: Path, topology, calibration, kernels) -> tuple:
    """(plan A, plan B, their names): each config planned (the topology's notes once), the same
    measured kernel tables required of both, two files of one name told apart as -A and -B."""
    a, b = (checked(_load(c, topology, calibration=calibration, unresolved=True, kernels=kernels, quiet=c is config_b))
            for c in (config_a, config_b))  # the topology's notes once
    if [f.text for f in a.config.cluster.gpu.kernels] != [f.text for f in b.config.cluster.gpu.kernels]:
        raise ConfigError("kernels.files", f"{config_a} and {config_b} lay different measured kernel tables over the "
                          f"catalog; give both configs the same [kernels] files (or pass them once as --kernels)")
    names = (config_a.stem, config_b.stem)
    if names[0] == names[1] and config_a.resolve() != config_b.resolve():
        names = (f"{names[0]}-A", f"{names[1]}-B")  # two files of one name: keep the sides apart
    return a, b, names


def _print_compare(c, con) -> None:
    """The comparison's table, GEMM basis, verdict and reasons, headroom and setting lines, and
    each side's runtime warnings, on ``con``."""
    tab = Table(title="compare", title_justify="left")
    for col in ("quantity", c.a.name, c.b.name):
        tab.add_column(shown(col))
    for row in table_rows(c):
        tab.add_row(*(shown(x) for x in row))
    con.print(tab)
    if gemm_basis(c):
        con.print(gemm_basis(c), highlight=False, markup=False, soft_wrap=True)
    con.print(f"[bold]verdict:[/] {shown(c.verdict)}")
    if c.decided_by:
        con.print(f"decided by: {c.decided_by}", highlight=False, markup=False)
    for r in c.reasons:
        con.print(f"  - {shown(r)}")
    for line in c.headroom_lines():  # a side under 15% free: the search's headroom rule
        con.print(shown(line), highlight=False)
    for line in c.setting_lines():  # a side where the model's measured error is larger (spec/accuracy.py)
        con.print(shown(line), highlight=False)
    for side in (c.a, c.b):  # what the framework's runtime does differently (plan prints them as notes)
        for w in config_warnings(side.plan.config):
            con.print(f"warning ({shown(side.name)}): {shown(w)}", highlight=False)


@foreign_options()
def search_cmd(config: Path = typer.Argument(..., help=CONFIG_HELP + "; a meshplan TOML's optional [search] "
                                                      "table sets the search (tp = [4, 8], pp = [1], micro_batch = [1, 2]; "
                                                      "every key: docs/input.md, 'The [search] table'), its [mesh] table "
                                                      "is ignored by the search and ranked after it"),
               top: Optional[int] = typer.Option(None, "--top", help="candidates ranked and shown (default: "
                                                                    "[search] top, 10)"),
               rank_tight: bool = typer.Option(False, "--rank-tight", help="rank the rows by step time alone, "
                                               "the rows under 15% of usable memory free among the others ([search] "
                                               "headroom_tier = false); by default they are listed after the rows "
                                               "that keep it, each mesh at a setting that keeps it where it has one"),
               json_path: Optional[Path] = typer.Option(None, "--json", callback=json_path_given,
                                                        help="write the result as JSON to PATH, or "
                                                        "with - to stdout (the rest of the output then on stderr)"),
               html_path: Optional[Path] = _html_option("the top candidates and the rejection counts"),
               force: bool = typer.Option(False, "--force", help="replace existing --json, --html and -o files"),
               export_rank: Optional[str] = typer.Option(None, "--export", metavar="N|1b",
                                                         help="export the row of this rank in the order shown (1 = the top), or "
                                                         "row 1's mesh at another setting by its label on the line "
                                                         "under the table (1a, 1b, 1c), with --to and -o"),
               to: str = typer.Option("meshplan", "--to", help="export format: " + ", ".join(FORMATS)),
               out: Optional[Path] = typer.Option(None, "-o", "--out", help="file the --export row (or variant) is "
                                                  "written to "
                                                  "(-: stdout, the rest of the output then on stderr)"),
               framework: Optional[str] = typer.Option(None, "--framework", metavar="NAME[,NAME...]",
                                                       help="plan the candidates under this framework's runtime "
                                                       "(" + ", ".join(FRAMEWORKS) + ") in place of the config's "
                                                       "training.framework and engines; several, comma-separated, "
                                                       "are searched each with its own rules and ranked in one "
                                                       "table, each row naming its framework (then --export N "
                                                       "writes row N under its framework; no --html); default: "
                                                       "[search] frameworks, else the config's own"),
               calibration: CalibrationOpt = None,
               kernels: KernelsOpt = None,
               topology: TopologyOpt = None,
               foreign: Foreign = Foreign()):
    """Search every mesh of the workload: reject with reasons, rank by predicted step time. Exit 0 when some
    candidate fits, 1 when none does (then one line instead of the table names the rules that rejected the
    most candidates, their counts, and a fix; where [search] cp is narrowed and memory rejected some, the fix
    first names the fastest row the same search finds with every cp, searched for it after the search).
    Under DeepSpeed ZeRO-Offload (training.offload_optimizer = "cpu") a mesh whose node's ranks need more
    host memory than cluster.node.host_memory_gb is rejected, rule 'host', as plan rejects it.

    Searched: degrees of pp, dp_replicate, dp_shard, cp, tp (ep, etp for MoE), micro-batch, recompute
    (op-level "op" under framework torch, cp = 1; Megatron's "selective" under torchtitan only
    where [search] recompute lists it; torchtitan's per-layer "layer", every 2nd layer, its default, with
    ep > 1 or MLA beside op, elsewhere only where [search] recompute lists it: it adds ~40% to a dense
    search's time; under framework megatron Megatron-LM's block recompute, shown "block n/k", the first n of
    a chunk's k layers checkpointed, n the smallest that fits (keeping 15% free under [search]
    headroom_tier) where none does not, exported as --recompute-method block --recompute-num-layers n),
    vpp (interleaved 1F1B), sharding, training.reshard_after_forward
    (FSDP), training.tp_comm_overlap (tp > 1), DeepSpeed ZeRO++ hpZ's training.zero_hpz_partition_size
    (zero3 under DeepSpeed, the data axis the world over more than one node: the config's g, the node's
    GPUs, 1) and the Llama 3 layer split with lighter first and last stages (pp >= 3); [search] narrows
    each ([search] zero_hpz_partition_size = [1] holds hpZ off). A pp that does not divide the layers gets, at vpp 1, the balanced
    split, or under training.framework megatron the one Megatron-LM's --decoder-first/last-pipeline-num-layers
    set (middle stages even: 61 layers at pp 16 as [3, 4 x 14, 2]); a pp where they set none is rejected,
    rule 'split' (61 layers at pp 32). [search] pp_schedules adds ZB-V and DualPipeV (zbv, dualpipev) on
    candidates with pp > 1 and vpp 2, and ZB-H1 (zb_h1) on those with pp > 1 and vpp 1 (an error under
    training.framework megatron, which runs none of them); under
    framework torch a ZB-V, DualPipeV or ZB-H1 candidate with FSDP2 over a data axis (zero3 or hsdp, dp_replicate x
    dp_shard x cp > 1) and reshard_after_forward true is rejected, rule 'v-reshard': torch 2.13 computes no weight
    gradient for a layer unit resharded after its forward where the schedule splits its backward, so its gradients
    are wrong (validate refuses such a mesh; plan, step and compare warn; fix: reshard_after_forward false,
    torchtitan's default under pp), while the same rows with reshard_after_forward false are kept; one with
    recompute op is rejected, rule 'split-op': torch 2.13 raised in W (op-level selective AC serves one
    recompute, W runs one per parameter group; fix: recompute full or none, or 1f1b/interleaved); under framework
    torch with other activation checkpointing (a torchtitan activation_checkpoint.mode
    other than none) they are kept and ranked, as torchtitan and torch run them, one note counts them with what
    torchtitan issue #773
    and pytorch issue #136766 report (far slower than interleaved 1F1B, out of memory), a warning under the
    table names row 1 when it is one, and --export writes the plan's warning in its header. Where row 1 lies in a
    setting whose step error was measured larger than the development set's (ZeRO-3 sharded across nodes, torch
    FSDP on A100, torch on H100; docs/fidelity.md), a warning under the table names it with its figures. Rows are distinct meshes (axis degrees), each at its first setting by
    the order; a MoE row names its experts' mesh after ep where efsdp (dp_shard x cp x tp / (ep x etp)) is > 1,
    'ep 16 (efsdp 4, etp 1)' (--json: expert_mesh); a line names row 1's mesh at its other settings within 1%, labelled 1a, 1b, 1c (--json: placed,
    top_variants, each with its label).
    Order: by step time; candidates within 1% of the fastest not yet listed go toward fewer axes, then lower
    tp*pp*cp*ep, then lower tp, then fewer and cheaper settings (no recompute, no tp overlap, vpp 1,
    resharded, even split, 1F1B first; ZB-V and DualPipeV one setting, their vpp 2 implied), then a peak
    lower by more than 1%, then the shorter step. Headroom tiers (default): the meshes that keep under 15%
    of the usable memory free while [memory] fragmentation_fraction is below 15% (PyTorch's caching allocator
    loses about that to fragmentation, GMLake) at every setting are listed after the meshes that keep it,
    each tier by that order applied to its settings alone and the whole ranking before it is cut to --top N
    (row N is the same whatever N; a faster tight mesh may be left out, the title says so), marked "tight" in
    the peak column, with one line saying how many; a mesh whose first setting is tight is shown at its
    fastest setting that keeps 15% free, a line naming the tight one; --export N and --json follow the order shown (--json: each row's tier, headroom_tiers); --rank-tight
    ([search] headroom_tier = false) ranks by step time alone. The
    --html page carries every line the text prints under the table. The output names what makes the top faster than #2 (its step
    X% shorter than #2's: 1 - top / #2, as compare says it; compute, bubble, exposed communication per axis,
    with their seconds; compute by kernel kind where its other ops differ most: 'kernels: cp ring merge 0 ms vs
    13.6 ms, ...'), or, where the tie rule listed it before a
    faster candidate, how much longer its step is than the fastest's, naming it. Where CONFIG has a [mesh], one
    line after the table (and on the --html page) says where it ranks by step time among the feasible candidates
    the search decided (the search's exact model; its row in the table beside it; the undecided near the memory
    limit counted apart; a range, between #LO and #HI, where more candidates than [search] rank_max, default
    32, could rank ahead unplanned; where its settings are not its mesh's fastest searched setting, the mesh at
    that setting, e.g. 'at mb 4, full'), why it is infeasible, or why no candidate is that mesh. Goodput (Daly,
    not ranked) is a
    column where the rows differ in it; where every row shows the same, the goodput line gives it once and says
    why (--json keeps it per row). The same input gives the
    same output on any machine ([search] budgets are counts: settle_max, exact_max, refine_max, rank_max); only the
    timings differ: the wall time, printed on stderr ('timing: ...'), and --json's wall_s and timings_s.
    --export N --to FORMAT -o FILE writes row N (its layer split included) as a meshplan TOML, torchtitan
    TOML, Megatron-LM arguments or DeepSpeed JSON; --export 1b writes row 1's mesh at the setting labelled 1b
    on the line of its other settings, as a row is written (a label the search did not print: one line naming those it did);
    a row under the headroom margin gets the table's headroom warning in the export's header. Where row 1 has any of
    the search's row warnings (under 15% of usable memory free, a V schedule under activation checkpointing, another
    runtime warning of the plan), each keeps its line and one line after them names the first row shown with none
    (its peak, free share and step against row 1's), or says none is, with how many rows have each warning and the
    setting that leaves it out of a search; --json holds it as first_clear_row, and --export of a row with a row
    warning writes the same pointer in its header. training.fp8_all_gather and training.grad_accumulation
    apply to the FSDP candidates (grad_accumulation with pp 1); the others are planned without them (a note
    says so). training.zero3_engine deepspeed or deepspeed-2021 applies to zero3 candidates with pp 1 (the
    others with zero3 are rejected, rule 'engine'; hsdp is planned with FSDP2; under deepspeed, zero1 and
    zero2 with DeepSpeed's ZeRO-1/2, the same runtime at another stage); training.zero12_engine deepspeed applies to
    zero1 and zero2 candidates (zero2 is searched under it, or zero3_engine deepspeed, only; zero3 candidates
    then run DeepSpeed's ZeRO-3, zero3_engine deepspeed). Under training.framework
    torch zero1 is rejected (rule 'framework': torch and torchtitan have no ZeRO-1 engine) unless
    training.zero12_engine or zero3_engine is deepspeed; a zero1 candidate without a data axis (dp_shard x cp 1) is its
    zero3 twin's run and is listed once, as zero3. An hsdp candidate with dp_shard x cp 1 shards nothing and
    is named ddp; under torch it is rejected (rule 'replicate': torchtitan applies FSDP2 only where
    dp_shard x cp > 1, and refuses DDP beside pp or tp). --export --to T is refused before the search when T
    takes no row the search can rank (a model without a torchtitan flavor, no zero3/hsdp in [search]
    sharding for torchtitan, no one-data-axis mesh for DeepSpeed), and after it when T refuses row N (one
    line naming the first row T takes). Under DeepSpeed a line says what --export N --to deepspeed of the rows
    shown does not express (training.recompute: the model code chooses activation checkpointing), and under
    training.framework megatron what --export N --to megatron does not (reshard_after_forward false: Megatron
    FSDP reshards after forward) and which rows it refuses (hsdp)."""

    names = framework_names(framework) if framework is not None else ()
    pick = export_pick(export_rank) if export_rank is not None else None  # (row, variant letter or "")
    _refuse_search_options(names, pick, framework, html_path, out, to, force)  # before loading
    cfg = load_any(config, foreign.fmt, foreign.options(), require_mesh=False)
    _notes(cfg)
    cfg = _search_options(_measured_cluster(cfg, topology, calibration=calibration, kernels=kernels), top, rank_tight)
    names = names or configured_names(cfg)  # --framework, else [search] frameworks
    cfg = _one_framework(cfg, names, pick, html_path)
    if pick is not None and pick[0] > cfg.search.top:  # before the search, not after it
        raise ConfigError("--export", f"{pick[0]} > --top {cfg.search.top}: the search lists {cfg.search.top} "
                          f"row(s); pass --top {pick[0]} or export a lower rank")
    user, carried = carried_source(config, foreign.fmt, cfg) if pick is not None else (None, [])
    cfg = with_source_model(cfg, user)  # a [source] torchtitan file's model names, written back
    if len(names) > 1:
        search_frameworks(cfg, names, json_path, force, calibration,
                           None if pick is None or out is None else CrossExport(pick[0], to, out, config, user, carried))
    if pick is not None and (refusal := search_export_refusal(cfg, to)) is not None:
        raise ConfigError("--to", refusal)  # a target that refuses every row, before the search
    if pick is not None and out is not None and to == "torchtitan" and custom_flavor(cfg) is not None:
        _flavor_file(out, force)  # the .py registering the model's llama3 flavor beside -o: refused as -o is
    _refuse_existing(json_path, force, "--json")
    _refuse_existing(html_path, force, "--html")
    cal = _calibration(calibration, cfg.cluster)  # the header line, after the refusals
    kern = _kernels_note(cfg.cluster)
    with ProgressBar() as bar:
        result = search(cfg, progress=bar)
    result = widen(result)  # no row and [search] cp narrowed: the fastest row with every cp, for the fix
    print_search(result, _console())
    _search_outputs(result, cfg, config, pick, to, out, force, (user, carried, foreign.options().job_config),
                    json_path, html_path, (cal, kern))


def _refuse_search_options(names: tuple, pick, framework: Optional[str], html_path: Optional[Path],
                           out: Optional[Path], to: str, force: bool) -> None:
    """search's option refusals before the config is read: --html or an export's variant with
    several frameworks, --export without -o, an unknown --to, an existing -o."""
    if len(names) > 1 and (html_path is not None or (pick is not None and pick[1])):
        raise ConfigError("--html" if html_path is not None else "--export",
                          f"not with several frameworks ({framework}): search the row's framework alone, "
                          f"--framework NAME, to write its page or export its other settings")
    if pick is not None:
        if out is None:
            raise ConfigError("-o", "--export needs -o FILE")
        if to not in FORMATS:
            raise ConfigError("--to", f"{to!r}; use {', '.join(FORMATS)}")
        _refuse_existing(out, force, "-o")


def _search_options(cfg, top: Optional[int], rank_tight: bool):
    """``cfg`` with --top and --rank-tight in its [search] options."""
    if top is not None:
        check_number("--top", top, 1, 10_000)
        cfg = replace(cfg, search=cfg.search.model_copy(update={"top": top}))
    if rank_tight:
        cfg = replace(cfg, search=cfg.search.model_copy(update={"headroom_tier": False}))
    return cfg


def _one_framework(cfg, names: tuple, pick, html_path: Optional[Path]):
    """``cfg`` under its one framework ``names[0]`` (its notes printed), or unchanged with several
    (refused with --html or an export's variant)."""
    if len(names) > 1 and (html_path is not None or (pick is not None and pick[1])):
        raise ConfigError("--html" if html_path is not None else "--export",
                          f"not with several frameworks ({', '.join(names)}): search the row's framework alone, "
                          f"--framework NAME, to write its page or export its other settings")
    if len(names) == 1:
        for note in [dropped_note(cfg, names[0])] + ([ORIGIN_NOTE] if cfg.origin == "deepspeed" else []):
            if note:
                _echo(f"note: {note}")
        cfg = framework_config(cfg, names[0])  # one framework: the whole search, under its runtime
    return cfg


def _search_outputs(result, cfg, config: Path, pick, to: str, out: Optional[Path], force: bool, source: tuple,
                    json_path: Optional[Path], html_path: Optional[Path], notes: tuple) -> None:
    """After the table: the routing and balance notes, the --export row (``source``: the user file,
    the lines it carries and a torchtitan .py's ``--config``), --json, --html, the timing line and the exit (0: a row fits)."""
    (user, carried, job_config), (cal, kern) = source, notes
    widest = max((int(result.candidates.ep[e.index]) for e in result.top), default=1)
    if (caveat := routing_note(cfg.model, widest, cfg.training.moe_dispatcher)) is not None:  # what ep rows model
        _echo(caveat)
    if (moe := balance_note(cfg.model, cfg.training)) is not None:  # once: every row is planned with it
        _echo(f"note: {moe}")
    if pick is not None and out is not None:  # its refusals (exit 2) come before any --json document
        row, what = export_choice(result, pick, to)
        # -o FILE.py: a Python config, keeping the values of the torchtitan .py searched or imported
        # (its [source]), as export does (python_source)
        py, function, python = python_source(config, cfg, job_config, None, to)
        pyjob = target(out, None, None, py, python, function) if to == "torchtitan" else None
        named = f"search {config} {what}" + (f" with {py}, its [source]" if pyjob is not None and py != config else "")
        _write_export(row, to, out, named, force, user, [*carried, *export_warnings(result, pick)],
                      pyjob)
    _write_text(json_path, json.dumps(_calibrated(search_to_dict(result), cal), indent=1), force)
    if html_path:
        _wrote(write_output(html_path, search_page(result, config.name, _cal_note(cal, kern)), force,
                            '--html'))
    _echo(timing_line(result), err=True)  # measured: stderr (it varies by machine, the report does not); after
    # --export's refusals, so an error stays one line
    if not result.top:  # the verdict on stderr as every command's exit 1 (EXIT_CODES), after the report on stdout
        _echo(f"infeasible: {infeasible_line(result)}", err=True)
    raise typer.Exit(0 if result.top else 1)
