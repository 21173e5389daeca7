"""The lines a search report prints before its top table, one source for the text
(:func:`meshplan.report.search.print_search`) and the HTML page: what was searched and how
(:func:`header_lines`): the model, cluster and batch, the axis order and placement, the training
knobs searched beside the mesh (FSDP resharding, async TP, torchtitan's per-layer AC
:func:`layer_words`, Megatron-LM's block recompute :func:`block_words`, DeepSpeed ZeRO++ hpZ
:func:`hpz_words`, the lighter end stages, the pipeline schedules), the candidates and the rules
that cut them, and the ``[search]`` narrowing (:func:`narrowed_lines`).
"""

from __future__ import annotations

from meshplan.memory.offload import offloads
from meshplan.search.columns import LAYER_AC_FREQ, RECOMPUTE
from meshplan.search.driver import SearchResult
from meshplan.search.reasons import LATE_RULES, REASONS
from meshplan.search.space import overlap_searched
from meshplan.search.space_recompute import layer_for_op
from meshplan.spec.axes.tp import max_tp
from meshplan.units import GiB


def header_lines(r: SearchResult) -> list[str]:
    """What was searched and how (printed before the table)."""
    cfg, o = r.config, r.config.search
    m, t, cl = cfg.model, cfg.training, cfg.cluster
    return [f"{m.name} on {cl.world} GPUs ({cl.nodes} x {cl.node.gpus} {cl.gpu.name}); global batch "
            f"{t.global_batch} x {t.seq_len} tokens; usable {r.usable_bytes / GiB:.1f} GiB per GPU",
            "mesh order (pp, dp_replicate, dp_shard, cp, tp), tp innermost, ranks node-major; SP on when tp > 1; "
            f"tp <= {max_tp(cfg)}; [mesh] of the config ignored",
            "also searched: training.reshard_after_forward (FSDP-sharded parameters), "
            + ("training.tp_comm_overlap (tp > 1), " if overlap_searched(t) else "")
            + layer_words(r) + block_words(r) + hpz_words(r)
            + "first and last stage lighter by one layer each (Llama 3 split, pp >= 3; with vpp > 1 where "
            "(layers + 2) / (pp x vpp) is whole)"
            + "".join(f", pipeline schedule {x} (pp > 1, vpp 2)" for x in o.pp_schedules if x != "1f1b")
            + ("" if "1f1b" in o.pp_schedules else "; pp > 1 only under those"),
            f"{len(r.candidates):,} candidates: {len(REASONS) - LATE_RULES} validity rules, memory bounds, "
            + ("host memory (ZeRO-Offload, cluster.node.host_memory_gb), " if offloads(t) else "") +
            f"GEMM threshold {o.min_gemm_efficiency:.0%}; {len(r.exact)} planned exactly (build_plan + step_time; "
            f"memory timelines for {sum(e.complete for e in r.exact.values())} of them)"] + \
        ([] if overlap_searched(t) or o.tp == [1] else [
            "not searched: training.tp_comm_overlap (torch without torch_compile: torchtitan's async TP needs "
            "torch.compile; set training.torch_compile = true to search it)"]) + narrowed_lines(o)


def hpz_words(r: SearchResult) -> str:
    """The "also searched" part for DeepSpeed ZeRO++ hpZ's g (:func:`meshplan.search.space.hpz_applies`),
    where some candidate has g above 1; "" otherwise."""
    hz = r.candidates.hz
    if hz is None or not (hz > 1).any():
        return ""
    return (f"training.zero_hpz_partition_size {'/'.join(map(str, sorted(set(hz.tolist()))))} (DeepSpeed ZeRO++ hpZ: "
            "zero3 with the data axis the whole world), ")


def layer_words(r: SearchResult) -> str:
    """The "also searched" part for torchtitan's per-layer AC searched beside op
    (:func:`meshplan.search.space_recompute.layer_for_op`), where some candidate has it; "" otherwise."""
    cfg = r.config
    if not layer_for_op(cfg) or not (r.candidates.rc == RECOMPUTE.index("layer")).any():
        return ""
    where = "multi-head latent attention" if cfg.model.is_mla else "ep > 1"
    return (f"recompute layer at ac_freq {LAYER_AC_FREQ} (torchtitan's per-layer AC, selective_ac_option "
            f"\"{LAYER_AC_FREQ}\") with {where}, beside op, ")


def block_words(r: SearchResult) -> str:
    """The "also searched" part for Megatron-LM's block recompute (:mod:`meshplan.search.block_recompute`),
    where some candidate has it; "" otherwise."""
    if not (r.candidates.rc == RECOMPUTE.index("block")).any():
        return ""
    fit = "keeps 15% free" if r.config.search.headroom_tier else "fits"
    return ("recompute block n/k (Megatron-LM's --recompute-method block --recompute-num-layers n: the first n of a "
            f"chunk's k layers) beside none and full, n the smallest that {fit} where none does not, ")


def narrowed_lines(o) -> list[str]:
    """The [search] narrowing (mesh axes, vpp, micro-batch, recompute, sharding and the searched
    knobs), when the config sets it (a DeepSpeed config sets it to what DeepSpeed runs:
    :data:`meshplan.interop.deepspeed.SEARCH`).

    >>> from meshplan.spec.search import SearchOptions
    >>> narrowed_lines(SearchOptions(pp=[1], tp=[1, 2], sharding=["zero1", "zero3"]))
    ['only these, by [search]: pp 1, tp 1/2, sharding zero1/zero3']
    >>> narrowed_lines(SearchOptions(vpp=[8], recompute=["none"], micro_batch=[1], tp_comm_overlap=[True]))
    ['only these, by [search]: vpp 8, micro_batch 1, recompute none, tp_comm_overlap true']
    >>> narrowed_lines(SearchOptions())
    []
    """
    default = type(o)()
    given = [(k, getattr(o, k)) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp", "vpp",
                                          "zero_hpz_partition_size") if getattr(o, k) is not None]
    given += [(k, getattr(o, k)) for k in ("micro_batch", "recompute", "sharding")
              if getattr(o, k) != getattr(default, k)]
    given += [(k, [str(x).lower() for x in getattr(o, k)]) for k in ("reshard_after_forward", "tp_comm_overlap",
                                                                    "uneven_stages") if getattr(o, k) is not None]
    return ["only these, by [search]: " + ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in given)] if given else []
